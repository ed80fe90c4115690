"""One HTTP/1.1 request read off an asyncio stream, for the tests' loopback stand-ins of a worker."""

from __future__ import annotations

import asyncio


async def read_request(reader: asyncio.StreamReader) -> tuple[str, str, dict[str, str], bytes]:
    """(method, path, headers with lower-case names, body by content-length); IncompleteReadError at EOF."""
    head = await reader.readuntil(b"\r\n\r\n")
    line, *lines = head[:-4].decode().split("\r\n")
    method, path, _ = line.split(" ")
    headers = {k.lower(): v.strip() for k, _, v in (x.partition(":") for x in lines)}
    body = await reader.readexactly(int(headers.get("content-length", 0)))
    return method, path, headers, body
