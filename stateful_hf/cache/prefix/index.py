"""The prefix index: full chunks of identical prefixes, found by content, held once.

Every chat opens with the same system prompt; every agent with the same tool definitions. A chunk
(`block_size` tokens at a fixed position) whose KV is the KV of the same ids from position 0 is the
same chunk whoever computed it: attention is causal and positions are absolute, so chunk k's K/V is
a function of ids[: (k + 1) * block_size] alone (and of the model). This module names such chunks by
content so that the store can keep one physical copy and let every session that holds that prefix
point at it.

How the others do it, and what is taken from each:
- vLLM's automatic prefix caching keys a full block by hash(parent block's hash, the block's token
  ids, extra keys such as the LoRA id and the request's `cache_salt` in the first block): a chain, so
  a key names the whole prefix, not only the block's own ids. Only full blocks are cached; a block
  whose holders all finish stays cached (in the free queue, LRU) until its memory is taken. Here:
  the same chain, over xxh3-128, with (tenant, cache_salt) at the root.
- nano-vllm keeps the same chain (xxh64) and compares the block's own ids on a hit, not the prefix
  before it. Here a hit is verified in full: each entry records its own ids and its parent *entry*,
  and a lookup accepts chunk k only if its entry's ids equal ids[k*bs:(k+1)*bs] and its parent is the
  entry accepted for chunk k-1 (for k = 0: its scope is the request's scope). By induction the whole
  prefix is compared, id by id, without storing it more than once. The hash only finds a candidate;
  it is never trusted alone: a collision is a miss (counted), never a wrong chunk.
- SGLang's radix cache is a tree of token runs with a lock count per node (`inc_lock_ref`) and evicts
  unlocked leaves by LRU. Here the tree is implicit (each entry's parent), a holder set replaces the
  lock count (so `check()` and the store's integrity check can compare it with the sessions that hold
  the chunk), and eviction is the store's policy's decision, not the index's.

Terms:
- scope: `PrefixScope(tenant, cache_salt)`. Chunks are shared only within one scope: a tenant never
  sees another's chunks (nor learns by timing that another sent a prefix), and clients of one tenant
  can split further with vLLM's `cache_salt`.
- entry: one full chunk of one prefix in one scope: its key, its ids, its parent entry, its depth k
  (tokens [k*bs, (k+1)*bs)), its holders and the store's payload (the physical chunk, opaque here).
- holder: a session id whose chunk `depth` is this entry's physical chunk. The reference count is
  `len(holders)`. An entry may have no holder (a throwaway session's system prompt, kept for the next
  request as vLLM keeps a finished request's blocks): then the store still owns its KV, and its policy
  may drop it like any other chunk.

Rules (the invariants `check()` asserts):
- Only full chunks are entries, and an entry never changes its ids: chunks are immutable once full,
  so no copy-on-write is ever needed. A holder that diverges inside the shared prefix (an edited
  message) releases the entries from the divergence on and continues privately; the entries stay.
- An entry's parent is in the index (or the entry is at depth 0): `remove(e)` takes out e and every
  entry below it, so no entry is reachable through a parent other than the one it was verified with.
  Removing an entry does not touch its holders' KV: it stays theirs, only it can no longer be found.
- Keys are unique: inserting content whose key is taken by other content (a hash collision) is refused
  (`insert` returns None) and the chunk stays private to its session.

The index is plain data: no lock, no tensors, no policy. The store calls it under its own lock.

Content keys of full chunks: the scope a prefix is shared in, and the chained digest that names it.

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
from dataclasses import dataclass, field

import xxhash

from ..sessions.tenant import DEFAULT_TENANT, check_tenant

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


@dataclass(eq=False, slots=True)
class PrefixEntry:
    """One full chunk of one prefix in one scope. Identity is the object (eq=False): two entries are
    the same chunk only if they are the same object.

    key:      the chained digest of (scope, ids[: (depth + 1) * block_size]).
    ids:      this chunk's block_size ids, ids[depth * bs : (depth + 1) * bs] of every holder.
    parent:   the entry of chunk depth - 1 of the same prefix (None at depth 0).
    holders:  session ids whose chunk `depth` is this entry's physical chunk (the reference count).
    payload:  the store's physical chunk; the index never reads it.
    children: entries whose parent this is, by key (kept so that `remove` takes them out too).
    """

    key: bytes
    scope: PrefixScope
    depth: int
    ids: tuple[int, ...]
    parent: PrefixEntry | None
    payload: object = None
    holders: set[str] = field(default_factory=set)
    children: dict[bytes, PrefixEntry] = field(default_factory=dict)

    @property
    def refcount(self) -> int:
        return len(self.holders)

    @property
    def end(self) -> int:
        """Tokens of the prefix through this chunk."""
        return (self.depth + 1) * len(self.ids)


@dataclass(slots=True)
class IndexCounters:
    """Cumulative lookups since the index was made (chunks, not tokens)."""

    hits: int = 0            # chunks a lookup found and verified
    misses: int = 0          # lookups that stopped at a chunk with no entry (full chunks only)
    collisions: int = 0      # candidates whose key matched but whose ids or parent did not: treated as misses
    refused: int = 0         # inserts refused because their key belonged to other content


class PrefixIndex:
    """Full chunks by content key (`PrefixKeys`, `prefix/index.py`). `block_size`: tokens per chunk (the
    store's). `digest`: the chain's hash (default xxh3-128; tests pass a weak one to force collisions).

    Mutating methods: `insert` (adds an entry, no holder), `acquire` / `release` (a holder), `remove`
    (an entry and everything below it). `match`, `keys`, `get`, `entries`, `check` read only
    (`match` counts hits and misses in `counters`)."""

    def __init__(self, block_size: int, digest: Digest = xxh3_128):
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        self.block_size = block_size
        self.keying = PrefixKeys(block_size, digest)
        self.counters = IndexCounters()
        self._entries: dict[bytes, PrefixEntry] = {}

    def keys(self, scope: PrefixScope, ids: Sequence[int]) -> Iterator[bytes]:
        """Keys of the full chunks of `ids`, in order (`PrefixKeys.keys`)."""
        return self.keying.keys(scope, ids)

    # ---- lookup ---------------------------------------------------------------------------------

    def match(self, scope: PrefixScope, ids: Sequence[int], max_chunks: int | None = None) -> list[PrefixEntry]:
        """The entries of the longest indexed prefix of `ids`' full chunks in `scope` (at most
        `max_chunks`), each verified against the ids (see the module docstring); [] if none."""
        out: list[PrefixEntry] = []
        limit = len(ids) // self.block_size if max_chunks is None else min(max_chunks, len(ids) // self.block_size)
        bs = self.block_size
        for k, key in enumerate(self.keys(scope, ids)):
            if k >= limit:
                break
            e = self._entries.get(key)
            if e is None:
                self.counters.misses += 1
                break
            parent = out[-1] if out else None
            if not (e.depth == k and e.parent is parent and e.scope == scope
                    and e.ids == tuple(ids[k * bs:(k + 1) * bs])):
                self.counters.collisions += 1
                break
            out.append(e)
        self.counters.hits += len(out)
        return out

    def get(self, key: bytes) -> PrefixEntry | None:
        """The entry with this key, unverified (for the store's bookkeeping, never to serve KV)."""
        return self._entries.get(key)

    # ---- changes --------------------------------------------------------------------------------

    def insert(self, scope: PrefixScope, ids: Sequence[int], depth: int, parent: PrefixEntry | None,
               payload: object, parent_checked: bool = False) -> PrefixEntry | None:
        """Index chunk `depth` of `ids` (a full chunk: len(ids) >= (depth + 1) * block_size) with
        `payload`, under `parent`: the entry of chunk depth - 1 of the same ids (as `match` returned
        it), None at depth 0. Returns the new entry (no holders yet); the existing entry if this
        content is indexed already (the payload is not taken: the caller uses the existing one); None
        if the key belongs to other content (a collision: the chunk stays private).
        Raises ValueError if `parent` is not the indexed entry of the same prefix: compared id by id
        up to the root, O(depth), unless `parent_checked` (then only that it is indexed): the caller
        got `parent` from this method or `match` for chunk depth - 1 of these same ids (a restore
        indexing a session's chunks in order), so a run of n chunks costs O(n), not O(n^2)."""
        bs = self.block_size
        if depth < 0 or len(ids) < (depth + 1) * bs:
            raise ValueError(f"chunk {depth} is not full in {len(ids)} ids (block size {bs})")
        if (parent is None) != (depth == 0):
            raise ValueError(f"chunk {depth} needs {'no parent' if depth == 0 else 'its parent entry'}")
        if parent is not None and not (self._entries.get(parent.key) is parent
                                       and (parent_checked or self._chain_is(parent, scope, ids))):
            raise ValueError(f"parent of chunk {depth} is not the indexed entry of the same prefix")
        chunk = tuple(ids[depth * bs:(depth + 1) * bs])
        key = self.keying.chunk_key(self.keying.root(scope) if parent is None else parent.key, chunk)
        have = self._entries.get(key)
        if have is not None:
            if have.parent is parent and have.scope == scope and have.ids == chunk:
                return have
            self.counters.refused += 1
            return None
        e = PrefixEntry(key, scope, depth, chunk, parent, payload)
        self._entries[key] = e
        if parent is not None:
            parent.children[key] = e
        return e

    def _chain_is(self, entry: PrefixEntry, scope: PrefixScope, ids: Sequence[int]) -> bool:
        """Whether `entry` is chunk entry.depth of exactly `ids` in `scope`: its ids and every
        ancestor's, compared id by id (a caller's claim is never taken on trust)."""
        bs, e = self.block_size, entry
        while e is not None:
            if e.scope != scope or e.ids != tuple(ids[e.depth * bs:(e.depth + 1) * bs]):
                return False
            e = e.parent
        return True

    def acquire(self, entry: PrefixEntry, holder: str) -> None:
        """`holder` now points at `entry`'s physical chunk. Idempotent per holder."""
        self._indexed(entry)
        entry.holders.add(holder)

    def release(self, entry: PrefixEntry, holder: str) -> int:
        """`holder` no longer points at `entry` (it may have been removed from the index: a holder
        keeps its chunk after `remove`). Returns the holders left."""
        if holder not in entry.holders:
            raise KeyError(f"{holder!r} does not hold chunk {entry.depth} ({entry.key.hex()[:12]})")
        entry.holders.discard(holder)
        return len(entry.holders)

    def remove(self, entry: PrefixEntry) -> list[PrefixEntry]:
        """Take `entry` and every entry below it out of the index (they can no longer be found or
        inserted under). Returns them, deepest first; their holders and payloads are unchanged (the
        caller decides what becomes of chunks that no session holds)."""
        self._indexed(entry)
        out: list[PrefixEntry] = []
        stack = [entry]
        while stack:                     # preorder, then reversed: every child before its parent
            e = stack.pop()
            out.append(e)
            stack.extend(e.children.values())
        out.reverse()
        for e in out:
            del self._entries[e.key]
            e.children = {}
        if entry.parent is not None:
            del entry.parent.children[entry.key]
        return out

    def _indexed(self, entry: PrefixEntry) -> None:
        if self._entries.get(entry.key) is not entry:
            raise KeyError(f"chunk {entry.depth} ({entry.key.hex()[:12]}) is not in the index")

    # ---- reading --------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, entry: object) -> bool:
        return isinstance(entry, PrefixEntry) and self._entries.get(entry.key) is entry

    def entries(self) -> list[PrefixEntry]:
        return list(self._entries.values())

    def held_tokens(self) -> tuple[int, int]:
        """(tokens of indexed chunks, tokens their holders would hold without sharing): their
        difference is what sharing saves."""
        physical = logical = 0
        for e in self._entries.values():
            physical += self.block_size
            logical += self.block_size * len(e.holders)
        return physical, logical

    def check(self) -> None:
        """Raise AssertionError unless the rules of the module docstring hold: keys are the chain of
        (scope, ids), parents are indexed and list their children, children are indexed."""
        for key, e in self._entries.items():
            assert e.key == key, f"entry filed under another key: {e.depth}"
            assert len(e.ids) == self.block_size, f"entry of {len(e.ids)} ids (block size {self.block_size})"
            if e.parent is None:
                assert e.depth == 0, f"entry at depth {e.depth} without a parent"
                assert key == self.keying.chunk_key(self.keying.root(e.scope), e.ids), "depth-0 key is not the chain's"
            else:
                assert self._entries.get(e.parent.key) is e.parent, f"parent of depth {e.depth} not indexed"
                assert e.parent.depth == e.depth - 1 and e.parent.scope == e.scope, f"bad parent at {e.depth}"
                assert e.parent.children.get(key) is e, f"depth {e.depth} missing from its parent's children"
                assert key == self.keying.chunk_key(e.parent.key, e.ids), f"key of depth {e.depth} is not the chain's"
            for ck, c in e.children.items():
                assert self._entries.get(ck) is c and c.parent is e, f"child of depth {e.depth} not indexed"
