"""The prefix index alone (stateful_hf/cache/prefix/index.py): keys, verified lookup, holders, removal.

The model of the index in these tests is a dict {(scope, prefix ids): entry} of what was inserted:
`match` must return exactly the longest chain of full chunks whose every prefix is in it, and a hash
that collides (a weak digest) must never make it return an entry of other ids."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stateful_hf.cache.prefix.index import PrefixEntry, PrefixIndex, PrefixScope, xxh3_128

A, B = PrefixScope("a"), PrefixScope("b")


def weak(data: bytes) -> bytes:
    """A digest with 4 values: almost every key collides."""
    return bytes([sum(data) % 4])


def index_all(ix: PrefixIndex, scope: PrefixScope, ids: list[int]) -> list[PrefixEntry | None]:
    """Insert every full chunk of `ids` (stopping at a refused one, as the store does)."""
    out, parent = [], None
    for k in range(len(ids) // ix.block_size):
        e = ix.insert(scope, ids, k, parent, payload=("chunk", k))
        out.append(e)
        if e is None:
            break
        parent = e
    return out


def test_chain_key_names_the_whole_prefix():
    ix = PrefixIndex(2)
    k1 = list(ix.keys(A, [1, 2, 3, 4]))
    k2 = list(ix.keys(A, [9, 2, 3, 4]))
    assert len(k1) == 2 and k1[0] != k2[0] and k1[1] != k2[1]    # same second chunk, other prefix
    assert list(ix.keys(B, [1, 2, 3, 4])) != k1                    # other tenant
    assert list(ix.keys(PrefixScope("a", "salt"), [1, 2, 3, 4])) != k1
    assert list(ix.keys(PrefixScope("a", ""), [1, 2, 3, 4])) == k1  # "" is no salt
    assert list(ix.keys(A, [1, 2, 3])) == k1[:1]                   # only full chunks


def test_scope_encoding_is_unambiguous():
    assert PrefixScope("a", "b/c").encode() != PrefixScope("a", "b").encode()
    assert PrefixScope("ab", None).encode() != PrefixScope("a", "b").encode()
    with pytest.raises(ValueError):
        PrefixScope("bad tenant")
    with pytest.raises(TypeError):
        PrefixScope("a", 3)


def test_match_insert_acquire_release():
    ix = PrefixIndex(2)
    ids = [1, 2, 3, 4, 5]
    e0, e1 = index_all(ix, A, ids)
    assert ix.match(A, ids) == [e0, e1]
    assert ix.match(A, [1, 2, 3, 9]) == [e0]
    assert ix.match(A, [1, 2, 3, 4], max_chunks=1) == [e0]
    assert ix.match(B, ids) == []
    assert ix.insert(A, ids, 0, None, payload="other") is e0            # existing content: the entry
    assert e0.payload == ("chunk", 0)
    ix.acquire(e0, "s1")
    ix.acquire(e0, "s2")
    ix.acquire(e0, "s2")
    assert e0.refcount == 2 and ix.held_tokens() == (4, 4)
    assert ix.release(e0, "s1") == 1
    with pytest.raises(KeyError):
        ix.release(e0, "s1")
    ix.check()


def test_insert_refuses_a_wrong_parent_and_partial_chunks():
    ix = PrefixIndex(2)
    (e0,) = index_all(ix, A, [1, 2])
    with pytest.raises(ValueError, match="not full"):
        ix.insert(A, [1, 2, 3], 1, e0, None)
    with pytest.raises(ValueError, match="parent"):
        ix.insert(A, [7, 7, 3, 4], 1, e0, None)        # e0 is not the entry of [7, 7]
    with pytest.raises(ValueError, match="parent"):
        ix.insert(B, [1, 2, 3, 4], 1, e0, None)        # other scope
    with pytest.raises(ValueError, match="parent"):
        ix.insert(A, [1, 2, 3, 4], 1, None, None)


def test_remove_takes_the_subtree_out_and_keeps_holders():
    ix = PrefixIndex(1)
    a = index_all(ix, A, [1, 2, 3])
    b = index_all(ix, A, [1, 2, 4])
    assert a[:2] == b[:2]
    ix.acquire(a[2], "s")
    gone = ix.remove(a[1])
    assert set(map(id, gone)) == {id(a[1]), id(a[2]), id(b[2])} and gone[-1] is a[1]
    assert a[2].holders == {"s"} and a[2] not in ix and len(ix) == 1
    assert ix.match(A, [1, 2, 3]) == [a[0]]
    with pytest.raises(KeyError):
        ix.acquire(a[2], "t")                            # removed entries cannot gain holders
    assert ix.release(a[2], "s") == 0                    # ... but their holders can let go
    c = index_all(ix, A, [1, 2, 3])                      # re-indexed: new entries, verified anew
    assert c[0] is a[0] and c[1] is not a[1] and ix.match(A, [1, 2, 3]) == c
    ix.check()


def test_collisions_are_misses_never_wrong_chunks():
    ix = PrefixIndex(1, digest=lambda data: b"\0")         # every key is the same
    (e1,) = index_all(ix, A, [1])
    assert index_all(ix, A, [2]) == [None] and ix.counters.refused == 1
    assert ix.match(A, [2]) == [] and ix.counters.collisions == 1
    assert ix.match(B, [1]) == [] and ix.counters.collisions == 2    # same ids, other scope
    assert ix.match(A, [1, 5]) == [e1]
    ix.check()


def test_insert_verifies_the_whole_parent_chain():
    ix = PrefixIndex(1)
    (x0, x1) = index_all(ix, A, [1, 2])
    with pytest.raises(ValueError, match="parent"):      # same last chunk [2], other prefix [7, 2]
        ix.insert(A, [7, 2, 3], 2, x1, None)


prefixes = st.lists(st.lists(st.integers(0, 2), max_size=9), min_size=1, max_size=6)


@settings(max_examples=300, deadline=None)
@given(seqs=prefixes, probes=prefixes, bs=st.integers(1, 3), weak_hash=st.booleans(),
       scopes=st.lists(st.booleans(), min_size=6, max_size=6))
def test_match_is_the_longest_indexed_prefix(seqs, probes, bs, weak_hash, scopes):
    ix = PrefixIndex(bs, digest=weak if weak_hash else xxh3_128)
    model: dict[tuple, PrefixEntry] = {}
    for i, ids in enumerate(seqs):
        scope = A if scopes[i] else B
        for k, e in enumerate(index_all(ix, scope, ids)):
            if e is not None:
                model.setdefault((scope, tuple(ids[:(k + 1) * bs])), e)
                assert model[scope, tuple(ids[:(k + 1) * bs])] is e
            else:
                assert weak_hash, "refusals happen only on collisions"
    ix.check()
    for scope in (A, B):
        for ids in seqs + probes:
            found = ix.match(scope, ids)
            for k, e in enumerate(found):       # every entry returned is the chunk of exactly this prefix
                assert model[scope, tuple(ids[:(k + 1) * bs])] is e and e.ids == tuple(ids[k * bs:(k + 1) * bs])
            n = len(found)
            if not weak_hash:                   # no collisions: the longest prefix present, exactly
                assert n == len(ids) // bs or (scope, tuple(ids[:(n + 1) * bs])) not in model


@settings(max_examples=200, deadline=None)
@given(seqs=prefixes, bs=st.integers(1, 3), picks=st.lists(st.integers(0, 40), max_size=5))
def test_remove_keeps_the_index_consistent(seqs, bs, picks):
    ix = PrefixIndex(bs)
    for ids in seqs:
        index_all(ix, A, ids)
    for p in picks:
        entries = ix.entries()
        if not entries:
            break
        victim = entries[p % len(entries)]
        gone = ix.remove(victim)
        assert victim in gone and all(e not in ix for e in gone)
        ix.check()
    for ids in seqs:                             # what remains is still found, and only verified
        for k, e in enumerate(ix.match(A, ids)):
            assert e in ix and e.ids == tuple(ids[k * bs:(k + 1) * bs])
