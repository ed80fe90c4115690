"""Prefix cache: full, computed KV pages indexed by the hash chain of their tokens (as vLLM's automatic prefix
caching), shared by reference count through the BlockPool and evicted LRU only under memory pressure.

Why a hash chain over page-aligned token blocks rather than a radix tree (SGLang's RadixAttention):
* the page is already the unit the pool shares, counts and evicts; a radix tree's token-granular match would be
  cut back to a page boundary anyway (a partly matching page cannot be shared without a copy and a recompute);
* lookup and insertion are one dict operation per page, O(pages) per request, no tree to split or rebalance;
  eviction order lives in the pool (one LRU of unreferenced cached pages), not in tree nodes;
* a page's key names its whole prefix in 16 bytes, deterministically across processes (blake2b, not Python's
  salted ``hash``): a decode worker, a prefill worker and a router can tell "which leading pages do you hold" by
  key alone, which the PD delta transfer needs (issue 21 §3); a radix tree is local to its process.

Key of page i: ``blake2b(key(i - 1) || tokens[i*B:(i+1)*B] as uint32 LE, digest_size=16)``; page 0 chains from
the namespace root: the model's weight sha256, weight format, dtype, page size and TP size, i.e. everything that
makes the KV of the same tokens differ, so two engines agree on a key only when their KV pages are
interchangeable. Invariants: a page is indexed only when it is full (B tokens) and its KV is computed (the
sequence's ``num_cached`` passed its end: a chunk that raised, a partial page or an aborted prefill's uncomputed
page is never indexed); indexed pages are never written again (writers start at ``num_cached``, which is
page-aligned after a hit, and forks write past the prompt's full pages).
"""

from __future__ import annotations

from array import array
from hashlib import blake2b

from .block_pool import BlockPool
from .sequence import Sequence

KEY_BYTES = 16  # 128-bit digests: a collision (wrong KV served) is ~2**-64 likely after 2**32 pages


def namespace_root(namespace: str) -> bytes:
    return blake2b(namespace.encode(), digest_size=KEY_BYTES).digest()


def page_key(parent: bytes, tokens: list[int]) -> bytes:
    """Key of a full page holding ``tokens`` (block_size ids) after the page keyed ``parent``."""
    h = blake2b(parent, digest_size=KEY_BYTES)
    h.update(array("I", tokens).tobytes())
    return h.digest()


def chain_keys(root: bytes, tokens: list[int], block_size: int) -> list[bytes]:
    """Keys of every full page of ``tokens`` (len(tokens) // block_size of them). Pure."""
    keys, parent = [], root
    for i in range(len(tokens) // block_size):
        parent = page_key(parent, tokens[i * block_size: (i + 1) * block_size])
        keys.append(parent)
    return keys


class PrefixCache:
    """Index key -> page over the pool's cached pages. The pool owns which pages are held, evictable or empty
    and evicts (calling back :meth:`_forget`); this class owns the keys and the hit/miss counters."""

    def __init__(self, pool: BlockPool, block_size: int, namespace: str, max_pages: int | None = None) -> None:
        self.pool, self.block_size, self.max_pages = pool, block_size, max_pages
        self.namespace = namespace
        self.root = namespace_root(namespace)
        self._page_of: dict[bytes, int] = {}  # key -> page id
        self._key_of: dict[int, bytes] = {}  # page id -> key
        self.hit_tokens = 0  # prompt tokens whose KV a lookup found (admission, reserve)
        self.miss_tokens = 0  # prompt tokens a lookup did not find (computed by prefill, or transferred)
        pool.on_evict = self._forget

    def __len__(self) -> int:
        return len(self._page_of)

    def _key(self, seq: Sequence, i: int) -> bytes:
        """Key of seq's page i (seq.page_keys caches the chain: a pure function of seq.tokens, which only grow)."""
        keys, bs = seq.page_keys, self.block_size
        while len(keys) <= i:
            j = len(keys)
            keys.append(page_key(keys[-1] if keys else self.root, seq.token_range(j * bs, (j + 1) * bs)))
        return keys[i]

    def match(self, seq: Sequence, max_tokens: int) -> list[int]:
        """Pages holding the longest cached prefix of seq.tokens of at most ``max_tokens`` tokens, in order
        (page-aligned: len(result) * block_size tokens). Does not take references (pool.reuse does)."""
        pages = []
        for i in range(max(0, max_tokens) // self.block_size):
            page = self._page_of.get(self._key(seq, i))
            if page is None:
                break
            pages.append(page)
        return pages

    def count(self, hit: int, miss: int) -> None:
        self.hit_tokens += hit
        self.miss_tokens += miss

    def publish(self, seq: Sequence) -> None:
        """Index seq's pages that became full and computed since the last call (seq.num_published up to
        seq.num_cached // block_size). A page whose key is indexed already (the same prefix computed twice at
        once) stays the sequence's own and returns to the empty pool when freed."""
        full = min(seq.num_cached // self.block_size, len(seq.blocks))
        for i in range(seq.num_published, full):
            key, page = self._key(seq, i), seq.blocks[i]
            if key in self._page_of or self.pool.is_cached(page):
                continue
            if self.max_pages is not None and len(self._page_of) >= self.max_pages and not self.pool.evict_one():
                continue  # at the size limit and every cached page is held: not indexed
            self._page_of[key] = page
            self._key_of[page] = key
            self.pool.mark_cached(page)
        seq.num_published = max(seq.num_published, full)

    def _forget(self, page: int) -> None:
        """Pool callback: ``page`` was evicted (it holds other KV from now on)."""
        del self._page_of[self._key_of.pop(page)]

    def check(self) -> None:
        """AssertionError unless the index and the pool agree on which pages are cached."""
        wrong = [p for p in self._key_of if not self.pool.is_cached(p)]
        if wrong or len(self._key_of) != len(self._page_of) or self.pool.num_cached != len(self._key_of):
            raise AssertionError(f"prefix cache index disagrees with the pool: {len(self._key_of)} indexed, "
                                 f"{self.pool.num_cached} cached in the pool; indexed but not cached: {wrong[:16]}")
