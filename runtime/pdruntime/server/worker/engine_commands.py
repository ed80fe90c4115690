"""Commands the event loop sends to the engine thread (:meth:`EngineRunner.call`), one type per operation.

Each is a frozen dataclass that is called with the engine on the engine thread and returns what the awaiting
handler gets. A command reads its request's fields when it runs (after the commands queued before it), not when
it is made. Any ``callable(engine)`` is also accepted by the runner (tests drive fake engines with lambdas).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class RequestGone(Exception):
    """A command that would give pages to a request found it already failed or aborted (``req.gone``): the
    failure's Abort was queued before this command, so nothing would ever free what it allocated."""


def _alive(req: Any) -> None:
    if getattr(req, "gone", False):
        raise RequestGone(f"request {req.rid} already ended; no pages given")


@dataclass(frozen=True)
class Reserve:
    """Decode: reserve pages for ``req``'s prompt and its forks' copied pages -> (the prompt's block ids, leading
    prompt tokens whose KV the reservation already holds: shared from the prefix cache, page-aligned, 0 without)."""

    req: Any  # DecodeRequest

    def __call__(self, engine: Any) -> tuple[list[int], int]:
        r = self.req
        _alive(r)  # on the engine thread, after every command queued before it: race-free
        blocks = engine.reserve(r.rid, len(r.prompt_ids), [fid for fid, _ in r.forks], prompt_token_ids=r.prompt_ids)
        return blocks, engine.pages(r.rid)[1]


@dataclass(frozen=True)
class Unshare:
    """Decode: prefill sends the whole prompt after all -> the reservation's pages, none of them shared."""

    req: Any  # DecodeRequest

    def __call__(self, engine: Any) -> list[int]:
        _alive(self.req)
        return engine.unshare(self.req.rid)


@dataclass(frozen=True)
class AddRequest:
    """Queue ``req`` for prefill: prefill only (a prefill worker) or whole, with its forks (a monolithic decode)."""

    req: Any  # PrefillRequest | DecodeRequest
    prefill_only: bool = False

    def __call__(self, engine: Any) -> None:
        r = self.req
        _alive(r)
        if self.prefill_only:
            return engine.add_request(r.rid, r.prompt_ids, r.params, prefill_only=True)
        return engine.add_request(r.rid, r.prompt_ids, r.params, forks=r.forks)


@dataclass(frozen=True)
class AdmitPrefilled:
    """Decode: the transferred request (and its forks) into the running batch, continuing from ``first_token_id``
    -> with forks, the holders of each of its pages right after the fork (for /debug/requests), else None."""

    req: Any  # DecodeRequest
    first_token_id: int

    def __call__(self, engine: Any) -> list[int] | None:
        r = self.req
        engine.add_prefilled(r.rid, r.prompt_ids, self.first_token_id, r.params, forks=r.forks)
        if not r.forks:
            return None
        try:
            return engine.page_refs(r.rid)
        except KeyError:  # choice 0 finished at once (its first token ended it)
            return None


@dataclass(frozen=True)
class Abort:
    """Abort every id (unknown ids are a no-op) and free their pages."""

    rids: tuple[str, ...]

    def __call__(self, engine: Any) -> list:
        return [engine.abort(rid) for rid in self.rids]


@dataclass(frozen=True)
class Release:
    """Prefill: the KV of ``rid`` reached decode; free its pages."""

    rid: str

    def __call__(self, engine: Any) -> None:
        return engine.release(self.rid)


@dataclass(frozen=True)
class Pages:
    """Prefill: (block ids, tokens) of ``rid``'s KV."""

    rid: str

    def __call__(self, engine: Any) -> tuple[list[int], int]:
        return engine.pages(self.rid)


@dataclass(frozen=True)
class GatherPages:
    """Tensor parallel prefill: every rank's copy of ``blocks`` (a collective, on the engine thread)."""

    blocks: tuple[int, ...]

    def __call__(self, engine: Any) -> list:
        return engine.gather_pages(list(self.blocks))


@dataclass(frozen=True)
class ScatterPages:
    """Tensor parallel decode: write each rank's staged pages into ``blocks`` on that rank."""

    blocks: tuple[int, ...]
    staged: list

    def __call__(self, engine: Any) -> None:
        return engine.scatter_pages(list(self.blocks), self.staged)


@dataclass(frozen=True)
class PageOwners:
    """-> ({engine request id: pages held}, pages in use that no sequence holds): the ownership snapshot."""

    def __call__(self, engine: Any) -> tuple[dict[str, int], int]:
        return engine.page_owners()
