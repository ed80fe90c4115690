"""Server-sent events as OpenAI and SGLang stream them: ``data: <json>`` lines, ended by ``data: [DONE]``.

Writing (:func:`sse`, :data:`SSE_DONE`) is for servers; :func:`sse_data`, :func:`iter_sse` and
:func:`aiter_sse` are the parser every client (``pdrt chat``, probes, tests, benchmarks) uses, and
:class:`SSEBuffer` the same line rule for a body read in pieces as bytes (the router's decode leg).
"""

from __future__ import annotations

import json
from typing import Any, AsyncIterable, AsyncIterator, Iterable, Iterator

DONE = "[DONE]"  # the payload of the stream's last event
DONE_BYTES = DONE.encode()  # the same, as SSEBuffer returns it
SSE_DONE = b"data: [DONE]\n\n"


def sse(obj: Any) -> bytes:
    """One event: ``obj`` as compact JSON on a ``data:`` line."""
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def sse_data(line: str) -> str | None:
    """The payload of a ``data:`` line (:data:`DONE` included); None for any other line (blank, comment, field)."""
    if not line.startswith("data:"):
        return None
    return line[5:].strip()


def _event(data: str) -> Any:
    return DONE if data == DONE else json.loads(data)


def iter_sse(lines: Iterable[str]) -> Iterator[Any]:
    """Each ``data:`` line's JSON value, and :data:`DONE` (the string) for ``data: [DONE]``; the caller decides
    whether to read on after it. ValueError for a payload that is not JSON."""
    for line in lines:
        data = sse_data(line)
        if data is not None:
            yield _event(data)


async def aiter_sse(lines: AsyncIterable[str]) -> AsyncIterator[Any]:
    """:func:`iter_sse` over an async line iterator (``httpx.Response.aiter_lines()``)."""
    async for line in lines:
        data = sse_data(line)
        if data is not None:
            yield _event(data)


class SSEBuffer:
    """:func:`iter_sse`'s lines for a body read in pieces as they arrive (the router's decode leg): ``feed(piece)``
    -> the ``data:`` payloads, as bytes (``b"[DONE]"`` included), of the lines that piece completed; ``end()`` ->
    that of a last line without its newline."""

    __slots__ = ("_tail",)

    def __init__(self) -> None:
        self._tail = b""

    def feed(self, piece: bytes) -> list[bytes]:
        if self._tail:
            piece = self._tail + piece
        *lines, self._tail = piece.split(b"\n")
        return [line[5:].strip() for line in lines if line.startswith(b"data:")]

    def end(self) -> list[bytes]:
        tail, self._tail = self._tail, b""
        return [tail[5:].strip()] if tail.startswith(b"data:") else []
