"""Content keys of full chunks: the scope a prefix is shared in, and the chained digest that names it.

A key names a whole prefix, not only a chunk's own ids: key_0 = digest(root(scope) + ids of chunk 0),
key_k = digest(key_{k-1} + ids of chunk k) (vLLM's block-hash chain; here xxh3-128, with
(tenant, cache_salt) at the root: `PrefixScope`). A key only finds a candidate: the index
(`prefix/index.py`) verifies every hit id by id, so a collision is a miss, never a wrong chunk.
Pure: no state but the block size and the digest (unseeded: the same ids in the same scope give the
same keys in every process).
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import xxhash

from ..tenant import DEFAULT_TENANT, check_tenant

Digest = Callable[[bytes], bytes]


@dataclass(frozen=True, slots=True)
class PrefixScope:
    """Who may share: chunks of one scope are never found from another. `cache_salt` None and ""
    are the same scope (no salt)."""

    tenant: str = DEFAULT_TENANT
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        check_tenant(self.tenant)
        if self.cache_salt is not None and not isinstance(self.cache_salt, str):
            raise TypeError(f"cache_salt must be a string or None, got {type(self.cache_salt).__name__}")
        if self.cache_salt == "":
            object.__setattr__(self, "cache_salt", None)

    def encode(self) -> bytes:
        """Unambiguous bytes of the scope (length-prefixed parts), the root of every key chain."""
        parts = [self.tenant.encode(), b"" if self.cache_salt is None else b"s" + self.cache_salt.encode()]
        return b"".join(len(p).to_bytes(4, "little") + p for p in parts)


def xxh3_128(data: bytes) -> bytes:
    return xxhash.xxh3_128_digest(data)


class PrefixKeys:
    """Keys of full chunks of `block_size` ids under `digest` (default xxh3-128)."""

    def __init__(self, block_size: int, digest: Digest = xxh3_128):
        self.block_size, self.digest = block_size, digest

    def root(self, scope: PrefixScope) -> bytes:
        """The chain's start for `scope` (not an entry's key)."""
        return self.digest(b"stateful-hf prefix v1\0" + scope.encode())

    def chunk_key(self, parent_key: bytes, chunk_ids: Sequence[int]) -> bytes:
        """Key of a chunk given its parent's key (or the scope's root) and its own ids."""
        if len(chunk_ids) != self.block_size:
            raise ValueError(f"only full chunks have keys: {len(chunk_ids)} ids, block size {self.block_size}")
        return self.digest(parent_key + array("q", chunk_ids).tobytes())

    def keys(self, scope: PrefixScope, ids: Sequence[int]) -> Iterator[bytes]:
        """Keys of the full chunks of `ids`, in order (lazily: a lookup stops at its first miss)."""
        bs, key = self.block_size, self.root(scope)
        for k in range(len(ids) // bs):
            key = self.chunk_key(key, ids[k * bs:(k + 1) * bs])
            yield key
