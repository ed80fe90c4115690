import asyncio, time
from harness import manifest, eventually, NS

async def test_smoke(operator):
    c = operator
    c.apply(manifest("demo"))
    await eventually(lambda: len(c.pods("demo")) == 4, what="4 pods", timeout=20)
    await eventually(lambda: c.condition("demo", "Ready").get("status") == "True", what="ready", timeout=20)
    print(c.pdd("demo")["status"])
