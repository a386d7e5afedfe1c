"""Prefix affinity: which replica last served a prompt prefix, so that a request with no KV of its
own anywhere (a turn without a session id, or a session's first turn) goes where its prefix is
already stored and shared (SGLang's cache-aware routing, in its simple form).

A prompt's key for its first j full blocks of `block_tokens` ids is a chain of xxh3-64 hashes
(key_j = H(key_{j-1}, ids of block j)), started from the request's scope encoded as the replicas
encode it (`PrefixScope(tenant, cache_salt).encode()`: length-prefixed, so salt None and "" are one
scope and "None" another): two scopes never match, as in the replicas' prefix index
(stateful_hf/cache/prefix/index.py). The router needs no proof here: a wrong guess costs only a recomputation
on the replica, whose own index verifies ids.

Owns: the map key -> replica (an LRU of at most `capacity` keys). Written by `record` (after the
router picked a replica), read by `lookup`; `forget_replica` is not needed: a stale entry routes to a
replica that recomputes, and the next `record` overwrites it.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Sequence

import xxhash

from ..cache.prefix.index import PrefixScope
from ..cache.sessions.tenant import DEFAULT_TENANT


class PrefixAffinity:
    def __init__(self, block_tokens: int = 32, max_blocks: int = 64, capacity: int = 100_000):
        if block_tokens < 1 or max_blocks < 1 or capacity < 1:
            raise ValueError("block_tokens, max_blocks and capacity must be >= 1")
        self.block_tokens, self.max_blocks, self.capacity = block_tokens, max_blocks, capacity
        self._where: OrderedDict[int, int] = OrderedDict()       # chained key -> replica index

    def keys(self, prompt: Sequence[int], tenant: str | None, cache_salt: str | None) -> list[int]:
        """Chained keys of the prompt's full blocks (at most `max_blocks`), shortest prefix first."""
        bt = self.block_tokens
        h = xxhash.xxh3_64_intdigest(PrefixScope(tenant or DEFAULT_TENANT, cache_salt).encode())   # the replicas' scope
        out = []
        for j in range(min(len(prompt) // bt, self.max_blocks)):
            block = array("q", prompt[j * bt:(j + 1) * bt]).tobytes()
            h = xxhash.xxh3_64_intdigest(block, seed=h)
            out.append(h)
        return out

    def lookup(self, keys: Sequence[int]) -> tuple[int | None, int]:
        """(replica that served the longest known prefix, its length in blocks); (None, 0) if none."""
        for j in range(len(keys) - 1, -1, -1):
            i = self._where.get(keys[j])
            if i is not None:
                self._where.move_to_end(keys[j])
                return i, j + 1
        return None, 0

    def record(self, keys: Sequence[int], replica: int) -> None:
        """The prompt with these keys was served by `replica`: its prefixes are stored there now."""
        for k in keys:
            self._where[k] = replica
            self._where.move_to_end(k)
        while len(self._where) > self.capacity:
            self._where.popitem(last=False)

    def __len__(self) -> int:
        return len(self._where)
