"""One contract for the engine's door (`EngineStore`), run against the real store and the fake one
(tests/fake_store.py) that drives the scheduler's unit tests, so the fake cannot drift from the store. The
negative control: a fake that breaks one rule fails the contract.

Both stores: 16 device blocks of 4 tokens, no host tier (a chunk moved down is dropped), no prefix sharing."""

from __future__ import annotations

import pytest
from fake_store import BROKEN_RULES, FakeStore

from stateful_hf import SessionStore
from stateful_hf.cache.doors.engine import CapacityError, Place, SessionBusyError, StoreError
from stateful_hf.testing import tiny_llama

BLOCKS, BS = 16, 4
MODEL = tiny_llama()


def real_store():
    return SessionStore(MODEL, BLOCKS * BS, chunk_size=BS, prefix_sharing=False)


def fake_store(broken: str | None = None):
    return lambda: FakeStore(BLOCKS, BS, broken=broken)


def admit(store, sid: str, prompt: list[int]) -> None:
    """The engine's admission: ask what the turn needs, then begin it with the kept prefix answered."""
    store.begin(sid, prompt, keep=store.turn_needs(sid, prompt).keep)


def run_turn(store, sid: str, prompt: list[int], generated: list[int] = ()) -> None:
    """A whole turn through the door: admit, one prefill step, decode steps, end."""
    needs = store.turn_needs(sid, prompt)
    store.begin(sid, prompt, keep=needs.keep)
    rows = needs.missing + tuple(range(needs.keep, len(prompt)))
    ids = needs.missing_ids + tuple(prompt[needs.keep:])
    store.commit(store.plan_step([(sid, list(ids), list(rows))]))
    for t in generated:
        n = store.num_tokens(sid)
        store.commit(store.plan_step([(sid, [t], [n])]))
    store.end(sid, len(generated))


# ---- the contract: each a function of a store factory ------------------------------------------------------

def new_session_keeps_nothing(store) -> None:
    needs = store.turn_needs("a", [1, 2, 3, 4, 5, 6])
    assert (needs.busy, needs.keep, needs.missing, needs.places) == (False, 0, (), ())
    assert needs.room.device_blocks == BLOCKS and store.free_blocks() == BLOCKS
    assert store.pool_sizes.device_blocks == BLOCKS and "a" in store and store.num_tokens("a") == 0


def a_turn_holds_its_lease(store) -> None:
    admit(store, "a", [1, 2, 3, 4, 5, 6])
    assert store.is_busy("a") and store.turn_needs("a", [1, 2, 3, 4, 5, 6, 7]).busy
    with pytest.raises(SessionBusyError):
        admit(store, "a", [1, 2, 3, 4, 5, 6])
    store.end("a", 0)
    assert not store.is_busy("a")


def a_step_appends_and_holds_blocks(store) -> None:
    admit(store, "a", [1, 2, 3, 4, 5, 6])
    committed = store.commit(store.plan_step([("a", [1, 2, 3, 4, 5, 6], list(range(6)))]))
    assert store.token_ids("a") == [1, 2, 3, 4, 5, 6] and store.places("a") == (Place.DEVICE, Place.DEVICE)
    assert committed.device_free == store.free_blocks() == BLOCKS - 2
    assert committed.room.device_blocks == BLOCKS - 2                  # a busy session's blocks are not room
    assert committed.turns["a"].keep == 6 and committed.turns["a"].held == 2
    assert store.end("a", 0).device_blocks == BLOCKS                   # an idle session's blocks are
    assert store.free_blocks() == BLOCKS - 2 and store.held_blocks("a") == 2


def abort_undoes_the_step(store) -> None:
    run_turn(store, "a", [1, 2, 3, 4, 5])
    admit(store, "a", [1, 2, 3, 4, 5, 6])
    store.abort(store.plan_step([("a", [6, 7, 8, 9], [5, 6, 7, 8])]))
    assert store.token_ids("a") == [1, 2, 3, 4, 5] and store.free_blocks() == BLOCKS - 2


def a_returning_turn_keeps_the_common_prefix(store) -> None:
    run_turn(store, "a", [1, 2, 3, 4, 5, 6], generated=[7, 8])
    assert store.turn_needs("a", [1, 2, 3, 4, 5, 6, 7, 8, 9]).keep == 8
    needs = store.turn_needs("a", [1, 2, 3, 9, 9])                     # diverges at position 3
    assert needs.keep == 3 and needs.missing == ()
    assert store.turn_needs("a", [1, 2, 3, 4, 5, 6, 7, 8]).keep == 7   # one row short: the logits
    admit(store, "a", [1, 2, 3, 9, 9])
    assert store.token_ids("a") == [1, 2, 3]
    store.end("a", 0)


def a_stale_keep_is_refused(store) -> None:
    run_turn(store, "a", [1, 2, 3, 4, 5, 6])
    with pytest.raises(StoreError):
        store.begin("a", [1, 2, 3, 4, 5, 6, 7], keep=2)
    assert not store.is_busy("a") and store.token_ids("a") == [1, 2, 3, 4, 5, 6]


def an_evicted_session_is_recomputed(store) -> None:
    run_turn(store, "a", [1, 2, 3, 4, 5, 6])
    assert store.evict("a") == 2 and store.free_blocks() == BLOCKS
    assert store.places("a") == (Place.DROPPED, Place.DROPPED) and store.missing_positions("a") == list(range(6))
    needs = store.turn_needs("a", [1, 2, 3, 4, 5, 6, 7])
    assert needs.keep == 6 and needs.missing == tuple(range(6)) and needs.missing_ids == (1, 2, 3, 4, 5, 6)
    run_turn(store, "a", [1, 2, 3, 4, 5, 6, 7])                         # recomputed, then extended
    assert store.places("a") == (Place.DEVICE, Place.DEVICE) and store.missing_positions("a") == []


def a_step_takes_idle_sessions_blocks(store) -> None:
    run_turn(store, "idle", list(range(100, 100 + 4 * 10)))             # 10 blocks, then idle
    admit(store, "a", list(range(40)))
    store.commit(store.plan_step([("a", list(range(40)), list(range(40)))]))   # 10 blocks: 4 of idle's go
    assert store.free_blocks() == 0 and sum(p is Place.DEVICE for p in store.places("idle")) == 6
    assert store.missing_positions("idle")                              # its dropped KV is recomputed later
    store.end("a", 0)


def a_step_that_cannot_fit_changes_nothing(store) -> None:
    admit(store, "a", list(range(60)))
    store.commit(store.plan_step([("a", list(range(60)), list(range(60)))]))   # 15 of 16 blocks, busy
    admit(store, "b", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    with pytest.raises(CapacityError):
        store.plan_step([("b", [1, 2, 3, 4, 5, 6, 7, 8, 9], list(range(9)))])  # 3 blocks, 1 free, none idle
    assert store.num_tokens("b") == 0 and store.free_blocks() == 1 and store.num_tokens("a") == 60
    store.end("a", 0), store.end("b", 0)


def delete_forgets_the_session(store) -> None:
    run_turn(store, "a", [1, 2, 3, 4, 5])
    store.delete("a")
    assert "a" not in store and store.free_blocks() == BLOCKS and store.num_tokens("a") == 0


CONTRACT = [new_session_keeps_nothing, a_turn_holds_its_lease, a_step_appends_and_holds_blocks, abort_undoes_the_step,
            a_returning_turn_keeps_the_common_prefix, a_stale_keep_is_refused, an_evicted_session_is_recomputed,
            a_step_takes_idle_sessions_blocks, a_step_that_cannot_fit_changes_nothing, delete_forgets_the_session]


@pytest.mark.parametrize("rule", CONTRACT, ids=lambda f: f.__name__)
@pytest.mark.parametrize("make", [real_store, fake_store()], ids=["real", "fake"])
def test_the_store_keeps_the_engines_contract(make, rule):
    store = make()
    rule(store)
    if make is real_store:
        store.check_integrity()


@pytest.mark.parametrize("broken", BROKEN_RULES)
def test_a_fake_that_breaks_a_rule_fails_the_contract(broken):
    """The negative control: each rule the fake can break is caught by at least one contract case."""
    failed = []
    for rule in CONTRACT:
        try:
            rule(FakeStore(BLOCKS, BS, broken=broken))
        except Exception:              # a failed assertion, or an error the real store would not raise
            failed.append(rule.__name__)
    assert failed, f"no contract case sees a fake whose rule {broken!r} is broken"
