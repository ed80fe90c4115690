"""An approximate, bounded record of which pair saw which prompt prefix (prefix-aware routing).

The router does not tokenize, so prompts are text (``routing_text``). A prompt is cut into chunks of
``CHUNK_CHARS`` characters; chunk i is named by a hash chain over chunks 0..i, so one name stands for the whole
prefix up to the end of that chunk. The names a pair holds are the nodes of a radix tree over chunks (a node
is its path from the root), stored flat: ``holders[name]`` is the set of pairs holding that node, and each pair
keeps its own nodes in LRU order. The longest prefix a pair holds is the run of leading chunks whose names it
holds: one walk down the chain answers every pair at once.

Bounds: a pair holds at most ``max_chunks`` nodes; beyond that its least recently used nodes go first.
``record`` touches a prompt's nodes deepest first, so a prefix's root side is more recent than its leaves and
eviction trims conversations from their tails (a trimmed prefix still matches its head). ``forget`` drops a
pair that left the topology (or whose workers changed: their caches are new) with everything it held.

Approximate by design: it is what the router sent, not what the engines hold (they evict on their own, and
chunks are characters, not pages); a false hit costs only a cache miss on a pair chosen within the load bound.
"""

from __future__ import annotations

import json
from collections import OrderedDict

CHUNK_CHARS = 32  # characters per tree node: about 8 tokens of English, half a 16-token KV page
_ROOT = 0x5EED  # hash chain seed
_NONE: frozenset[int] = frozenset()


def chunk_names(text: str) -> list[int]:
    """The hash-chain names of ``text``'s full chunks, in order (a trailing partial chunk is not named)."""
    names, h = [], _ROOT
    for i in range(0, len(text) - CHUNK_CHARS + 1, CHUNK_CHARS):
        h = hash((h, text[i:i + CHUNK_CHARS]))
        names.append(h)
    return names


def routing_text(body: dict) -> str | None:
    """The text a worker body's prompt is routed by: a completion's ``text``, or a chat's messages serialized in
    order (round k+1 of a conversation extends round k's messages, so its text extends round k's). None: none."""
    if isinstance(body.get("text"), str):
        return body["text"]
    messages = body.get("messages")
    if not messages:
        return None
    return "".join(json.dumps(m, sort_keys=True, ensure_ascii=False) + "\x1e" for m in messages)


class PrefixTree:
    """Which pairs (by topology index) hold which prompt prefixes, at most ``max_chunks`` nodes per pair."""

    def __init__(self, max_chunks: int) -> None:
        if max_chunks < 1:
            raise ValueError(f"PrefixTree max_chunks={max_chunks} is invalid; accepted: an integer >= 1")
        self.max_chunks = max_chunks
        self.holders: dict[int, set[int]] = {}  # node name -> pairs holding it
        self.lru: dict[int, OrderedDict[int, None]] = {}  # pair -> its node names, least recently used first
        self.evictions = 0  # nodes dropped for the size bound

    def size(self, pair: int) -> int:
        """Nodes (chunks) ``pair`` holds."""
        return len(self.lru.get(pair, ()))

    def match(self, names: list[int], pairs: set[int] | frozenset[int]) -> dict[int, int]:
        """Leading chunks of the prompt named by ``names`` that each of ``pairs`` holds (0 for none)."""
        out = dict.fromkeys(pairs, 0)
        alive, depth = set(pairs), 0
        for name in names:
            still = alive & self.holders.get(name, _NONE)
            for p in alive - still:
                out[p] = depth
            alive, depth = still, depth + 1
            if not alive:
                break
        for p in alive:
            out[p] = depth
        return out

    def record(self, pair: int, names: list[int]) -> None:
        """``pair`` now holds the prompt named by ``names`` (it was sent there); evict past the bound."""
        if not names:
            return
        own = self.lru.setdefault(pair, OrderedDict())
        for name in reversed(names[:self.max_chunks]):  # deepest first: the root side ends most recent
            if name in own:
                own.move_to_end(name)
            else:
                own[name] = None
                self.holders.setdefault(name, set()).add(pair)
        while len(own) > self.max_chunks:
            name, _ = own.popitem(last=False)
            self._drop(name, pair)
            self.evictions += 1

    def forget(self, pair: int) -> None:
        """Drop everything ``pair`` held (it left the topology, or its workers are new)."""
        for name in self.lru.pop(pair, ()):
            self._drop(name, pair)

    def _drop(self, name: int, pair: int) -> None:
        held = self.holders.get(name)
        if held is not None:
            held.discard(pair)
            if not held:
                del self.holders[name]

    def pairs(self) -> list[int]:
        return sorted(self.lru)
