"""A fake store that keeps the engine's door (`EngineStore`, stateful_hf/cache/doors/engine.py) without tensors or a
model: a paged device pool of `device_blocks` blocks, no host tier (a chunk moved down is dropped, its ids kept
for recomputation), no prefix sharing, no layer-wise KV. It drives the scheduler in fast unit tests
(tests/test_scheduler.py); tests/test_store_contract.py runs one contract against it and the real store, so the
two cannot drift. `broken` names one rule the fake breaks on purpose: the contract's negative control.

A session is its token ids and one `Place` per chunk (DEVICE or DROPPED). Free blocks are the pool's less every
DEVICE chunk; a step that needs more takes idle sessions' device chunks, least recently used first (the real
store's default policy ranks by the same recency)."""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from stateful_hf.cache.doors.engine import (
    CapacityError,
    Committed,
    Place,
    PoolSizes,
    Room,
    SessionBusyError,
    StoreError,
    TurnNeeds,
    TurnStats,
    UnknownSessionError,
)
from stateful_hf.cache.sessions.history import common_prefix, kept_prefix  # the keep rule, one copy

BROKEN_RULES = ("room_ignores_idle", "end_keeps_lease", "abort_keeps_ids")


@dataclass
class _Session:
    tokens: list[int] = field(default_factory=list)
    places: list[Place] = field(default_factory=list)   # one per chunk of `tokens`: DEVICE or DROPPED
    busy: bool = False
    used: int = 0                                       # the store's step counter at its last use (recency)


@dataclass(frozen=True)
class FakeStep:
    """A planned step: per entry (session id, ids, positions), and how to undo it."""

    entries: tuple[tuple[str, tuple[int, ...], tuple[int, ...]], ...]
    undo: tuple[tuple[str, list[int], list[Place]], ...]   # each touched session's tokens and places before


class FakeStore:
    """`EngineStore` in memory (see the module docstring). Every answer is the real store's for the same calls."""

    layerwise = False
    keeps_hidden = False
    invariant_split: int | None = None
    cost_profile = None
    spec = None

    def __init__(self, device_blocks: int, block_size: int = 4, broken: str | None = None):
        assert broken is None or broken in BROKEN_RULES, broken
        self.block_size, self.broken = block_size, broken
        self.pool_sizes = PoolSizes(device_blocks, 0)
        self.clock = time.monotonic
        self.sessions: dict[str, _Session] = {}
        self.expected: dict[str, float] = {}
        self._uses = itertools.count(1)

    # ---- reads -------------------------------------------------------------------------------------

    def _get(self, session_id: str) -> _Session:
        try:
            return self.sessions[session_id]
        except KeyError:
            raise UnknownSessionError(f"no session {session_id!r}") from None

    def __contains__(self, session_id: str) -> bool:
        return session_id in self.sessions

    def is_busy(self, session_id: str) -> bool:
        s = self.sessions.get(session_id)
        return s is not None and s.busy

    def num_tokens(self, session_id: str) -> int:
        s = self.sessions.get(session_id)
        return 0 if s is None else len(s.tokens)

    def token_ids(self, session_id: str) -> list[int]:
        return list(self._get(session_id).tokens)

    def places(self, session_id: str) -> tuple[Place, ...]:
        return tuple(self._get(session_id).places)

    def missing_positions(self, session_id: str, cut: int | None = None) -> list[int]:
        s, bs = self._get(session_id), self.block_size
        end = len(s.tokens) if cut is None else min(cut, len(s.tokens))
        return [p for p in range(end) if s.places[p // bs] is Place.DROPPED]

    def match_prefix(self, session_id: str, token_ids: Sequence[int]) -> int:
        return common_prefix(self._get(session_id).tokens, token_ids)

    def free_blocks(self) -> int:
        return self.pool_sizes.device_blocks - sum(p is Place.DEVICE for s in self.sessions.values() for p in s.places)

    def room(self) -> Room:
        idle = sum(p is Place.DEVICE for s in self.sessions.values() if not s.busy for p in s.places)
        return Room(self.free_blocks() + (0 if self.broken == "room_ignores_idle" else idle), 0, None)

    def held_blocks(self, session_id: str) -> float:
        return float(sum(p is Place.DEVICE for p in self._get(session_id).places))

    def available_host_blocks(self) -> int:
        return 0

    def offload_bandwidth(self) -> float:
        raise StoreError("the fake store has no host tier")

    # ---- a turn ------------------------------------------------------------------------------------

    def turn_needs(self, session_id: str, prompt: Sequence[int] | None = None,
                   cache_salt: str | None = None) -> TurnNeeds:
        s = self.sessions.setdefault(session_id, _Session()) if prompt is not None else self._get(session_id)
        bs = self.block_size
        if s.busy and prompt is not None:
            return TurnNeeds(session_id, True, 0, (), (), (), None, bs, self.room())
        keep = len(s.tokens) if prompt is None else kept_prefix(s.tokens, prompt)
        missing = tuple(self.missing_positions(session_id, keep))
        return TurnNeeds(session_id, False, keep, missing, tuple(s.tokens[p] for p in missing),
                         tuple(s.places[:math.ceil(keep / bs)]), None, bs, self.room())

    def begin(self, session_id: str, prompt: Sequence[int], cache_salt: str | None = None, *,
              keep: int | None = None) -> TurnStats:
        s = self._get(session_id)                       # `turn_needs` opens a session
        if s.busy:
            raise SessionBusyError(f"session {session_id!r} is busy")
        kept = kept_prefix(s.tokens, prompt)
        if keep is not None and keep != kept:
            raise StoreError(f"session {session_id!r} changed: the turn keeps {kept} tokens, not {keep}")
        s.busy, s.used = True, next(self._uses)
        truncated = len(s.tokens) - kept
        del s.tokens[kept:]
        del s.places[math.ceil(kept / self.block_size):]
        reused = kept - len(self.missing_positions(session_id))
        return TurnStats(reused_tokens=reused, reused_device=reused, truncated_tokens=truncated)

    def end(self, session_id: str, generated: int) -> Room:
        s = self._get(session_id)
        s.busy = s.busy and self.broken == "end_keeps_lease"
        return self.room()

    def plan_step(self, requests: Sequence[tuple[str, Sequence[int], Sequence[int]]],
                  factors: Sequence[int] | None = None) -> FakeStep:
        assert factors is None or all(f == 1 for f in factors), "the fake store has no layer-wise KV"
        bs, undo, need = self.block_size, [], 0
        for sid, ids, pos in requests:
            s = self._get(sid)
            assert len(ids) == len(pos) and s.busy, (sid, s.busy)
            undo.append((sid, list(s.tokens), list(s.places)))
            chunks = {p // bs for p in pos}
            need += sum(1 for k in chunks if k >= len(s.places) or s.places[k] is not Place.DEVICE)
        busy = {sid for sid, _, _ in requests}
        if need > self.free_blocks():
            self._make_room(need - self.free_blocks(), busy)
        for (sid, ids, pos), (_, _, before) in zip(requests, undo, strict=True):
            s = self.sessions[sid]
            for p, t in zip(pos, ids, strict=True):
                if p < len(s.tokens):
                    assert s.tokens[p] == t and before[p // bs] is Place.DROPPED, (sid, p)     # a recomputed row
                else:
                    assert p == len(s.tokens), (sid, p, len(s.tokens))                     # rows append in order
                    s.tokens.append(t)
                while len(s.places) <= p // bs:
                    s.places.append(Place.DROPPED)
                s.places[p // bs] = Place.DEVICE
            s.used = next(self._uses)
        return FakeStep(tuple((sid, tuple(ids), tuple(pos)) for sid, ids, pos in requests), tuple(undo))

    def _make_room(self, blocks: int, busy: set[str]) -> None:
        """Drop idle sessions' device chunks, least recently used first, until `blocks` are free; else
        CapacityError with nothing changed."""
        idle = sorted((s for sid, s in self.sessions.items() if not s.busy and sid not in busy), key=lambda s: s.used)
        victims = [(s, k) for s in idle for k, p in enumerate(s.places) if p is Place.DEVICE][:blocks]
        if len(victims) < blocks:
            raise CapacityError(f"the step needs {blocks} more device blocks than are free or idle")
        for s, k in victims:
            s.places[k] = Place.DROPPED

    def commit(self, step: FakeStep) -> Committed:   # type: ignore[override]
        room = self.room()
        return Committed(room, {sid: self.turn_needs(sid) for sid, _, _ in step.entries}, self.free_blocks())

    def abort(self, step: FakeStep) -> None:
        for sid, tokens, places in reversed(step.undo):
            s = self.sessions[sid]
            if self.broken != "abort_keeps_ids":
                s.tokens = tokens
            s.places = places[:math.ceil(len(s.tokens) / self.block_size)] + \
                [Place.DROPPED] * (math.ceil(len(s.tokens) / self.block_size) - len(places))

    # ---- moving KV ---------------------------------------------------------------------------------

    def evict(self, session_id: str) -> int:
        s = self._get(session_id)
        freed = sum(p is Place.DEVICE for p in s.places)
        s.places = [Place.DROPPED] * len(s.places)
        return freed

    def move(self, session_id: str, chunks: Iterable[int], tier: str, reason: str = "explicit") -> None:
        s = self._get(session_id)
        if s.busy:
            raise SessionBusyError(f"session {session_id!r} is busy")
        for k in chunks:
            if tier == "dropped":
                s.places[k] = Place.DROPPED
            elif tier != "device" or s.places[k] is not Place.DEVICE:
                raise StoreError(f"the fake store moves chunks to 'dropped' only, not {tier!r}")

    def offload_layers(self, session_id: str, full: bool = False) -> int:
        return 0

    def expect(self, session_id: str, seconds: float) -> float:
        self._get(session_id)
        self.expected[session_id] = at = self.clock() + min(seconds, 600.0)     # max_retain's default
        return at

    def due(self, within: float) -> tuple[list[str], float]:
        now = self.clock()
        due = sorted((at, sid) for sid, at in self.expected.items() if at <= now + within)
        for _, sid in due:
            del self.expected[sid]
        return [sid for _, sid in due], min(self.expected.values(), default=math.inf)

    def flush(self, timeout: float = 10.0) -> None:
        return None                     # no disk tier

    def delete(self, session_id: str, keep_shared: bool = False) -> None:
        if self._get(session_id).busy:
            raise SessionBusyError(f"session {session_id!r} is busy")
        del self.sessions[session_id]
