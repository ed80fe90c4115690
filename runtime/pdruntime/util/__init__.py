"""Small helpers every pdstack component shares (runtime, operator, tests, bench): stdlib only, no torch.

``sse``: server-sent events, written and parsed; ``ports``: free ports and port blocks; ``backoff``: capped
exponential backoff; ``periodic``: an asyncio task on a fixed tick; ``headers``: pdstack's HTTP header names;
``aio``: ``within``, a deadline-bounded await that never swallows a cancellation (3.11's ``wait_for`` can).
"""
