"""The KV store: the facade over the store's parts; the one place session KV state changes.

Contract: every public method takes the store lock; chunk states, slot ownership and token ids change only inside it,
through the parts. A method that raises leaves every session's token ids as they were and the invariants of
`check_integrity()` intact: every slot of every tier is free or owned by exactly one chunk (device blocks: by a DEVICE
chunk, as a HOST/HIDDEN chunk's cached `shadow`, or split by residue among LAYERED chunks). After each method that may
change what is on disk, the facade syncs the registered features (`_sync`: the disk index, which never raises).

The parts are built by `store_parts.assemble`, each with its collaborators; docs/store.md says what each owns and
mutates. A method whose contract is longer than its docstring names the part's method that holds it."""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, overload

from ..kernels import StepBackends, select_backend
from ..options import KVStoreKwargs, Layout, StoreConfig, TokensOrSize, Unpack
from .audit.integrity import check_integrity
from .audit.stats import SessionStats, StoreStats, TurnStats, summary
from .audit.store_stats import session_stats, store_stats
from .eviction.policy import CostProfile, EvictionPolicy
from .movement.migration import SessionExport, export_session, import_sessions
from .movement.relocation import chunk_indices, target_state
from .prefix.fork import fork_session
from .sessions.history import common_prefix
from .sessions.session import Session
from .sessions.tenant import TenantUsage
from .spec import KVSpec
from .step import StepBatch
from .store_parts import assemble
from .turn import Committed, Place, PoolSizes, Room, TurnNeeds, places_of

if TYPE_CHECKING:
    from .audit.stats import FlushReport


class KVStore:
    """The model-free session store. Its options are `StoreConfig`'s (`stateful_hf/options/store.py` documents
    each; here `attn_backend` defaults to "torch"): an unknown one raises TypeError, a bad value ValueError naming
    it, before anything is allocated. The parts are attributes named as in `StoreParts` (`store.sessions`,
    `store.planner`, ...); `config` holds the resolved backend."""

    def __init__(self, spec: KVSpec, device_capacity: TokensOrSize = 4096, **options: Unpack[KVStoreKwargs]):
        c = StoreConfig.build(device_capacity=device_capacity, **{"attn_backend": "torch", **options})
        attn_backend = select_backend(c.attn_backend, spec.device, spec.dtype, spec.head_dim, spec.block_size,
                                      layerwise_kv=c.layerwise_kv, layout=c.layout).name
        backends = c.step_backends if c.step_backends is not None else StepBackends(attn_backend)
        if backends.long != attn_backend:
            raise ValueError(f"step_backends {backends.describe()!r} must fall back to the store's backend "
                             f"{attn_backend!r}")
        if backends.short is not None:    # it attends some steps, so it must serve this store too
            select_backend(backends.short, spec.device, spec.dtype, spec.head_dim, spec.block_size,
                           layerwise_kv=c.layerwise_kv, layout=c.layout)
        self.config = dataclasses.replace(c, attn_backend=attn_backend, step_backends=backends)
        self.spec, self.block_size, self.layout, self.attn_backend = spec, spec.block_size, c.layout, attn_backend
        self.step_backends: StepBackends = backends   # which backend attends each step (`StepPlanner.plan`)
        p = self.parts = assemble(spec, self.config)
        self.kernels, self.transfer, self.counters, self.moves = p.kernels, p.transfer, p.counters, p.moves
        self.sessions, self.sharing, self.hidden, self.disk_state = p.sessions, p.sharing, p.hidden, p.disk_state
        self.tiers, self.placement, self.swap_in, self.layered = p.tiers, p.placement, p.swap_in, p.layered
        self.relocation, self.planner, self.history, self.capacity = p.relocation, p.planner, p.history, p.capacity
        self.writer = p.writer        # the disk writer (write-behind, the flush); None without a disk tier
        self.features = p.features    # the registered features (`feature.StoreFeature`); () for a default store
        self.lock = self.sessions.lock
        self.clock: Callable[[], float] = self.sessions.clock   # seconds; `time.monotonic` unless a test gave one
        self.pool_sizes: PoolSizes = self.tiers.sizes()         # fixed: pools never resize

    # ---- facts and knobs (the parts themselves: `store.tiers`, `store.hidden`, ... as in `StoreParts`) ------

    @property
    def keeps_hidden(self) -> bool:
        """Whether the store keeps hidden states (HCache: hidden_states "always" or "auto" with a hidden tier)."""
        return self.tiers.hidden is not None       # the hidden tier's pool: only a store with one has it

    @property
    def layerwise(self) -> bool:
        """Whether the store was made with layerwise_kv (LayerKV)."""
        return self.config.layerwise_kv

    @property
    def policy(self) -> EvictionPolicy:
        """The eviction policy (`Placement` owns it); replace it with `store.policy = ...` (under the lock)."""
        return self.placement.policy

    @policy.setter
    def policy(self, policy: EvictionPolicy) -> None:
        with self.lock:
            self.placement.policy = policy

    @property
    def cost_profile(self) -> CostProfile | None:
        """The cost profile the eviction policy's keys read (None: a policy that reads none)."""
        return self.placement.policy.profile

    @property
    def emulate_async(self) -> bool:
        """Deprecated (one release): `store.transfer.emulate`, whether copies run under the CPU async emulator."""
        warnings.warn("KVStore.emulate_async is deprecated; read store.transfer.emulate", DeprecationWarning,
                      stacklevel=2)
        return self.transfer.emulate

    @property
    def layerwise_stage(self) -> bool | None:
        """Deprecated (one release): `store.layered.stage`, LayerKV's staging choice."""
        warnings.warn("KVStore.layerwise_stage is deprecated; use store.layered.stage", DeprecationWarning,
                      stacklevel=2)
        return self.layered.stage

    @layerwise_stage.setter
    def layerwise_stage(self, stage: bool | None) -> None:
        warnings.warn("KVStore.layerwise_stage is deprecated; use store.layered.stage", DeprecationWarning,
                      stacklevel=2)
        self.layered.stage = stage         # without layerwise_kv (`NoLayers`) nothing to stage: ignored

    def use_cost_profile(self, profile: CostProfile) -> None:
        """The eviction policy's keys read `profile` from now on (the engine's online correction)."""
        with self.lock:
            self.placement.policy.use_profile(profile)

    # ---- sessions and their history (history.py) -------------------------------------------------

    def session(self, session_id: str) -> Session:
        with self.lock:
            return self.sessions.get(session_id)

    def open(self, session_id: str) -> Session:
        """Return the session, creating an empty one if it does not exist."""
        with self.lock:
            return self.sessions.open(session_id)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self.sessions

    def session_ids(self) -> list[str]:
        """Ids of the sessions (not of those deleted and retained for their shared prefix)."""
        with self.lock:
            return [s.session_id for s in self.sessions if not s.retained]

    def tenant_usage(self) -> dict[str, TenantUsage]:
        """Per tenant (`session.py`): sessions, history tokens, tokens stored in some tier."""
        with self.lock:
            return self.history.tenant_usage()

    def delete(self, session_id: str, keep_shared: bool = False) -> None:
        """Forget the session and free what only it holds (`keep_shared`: see `History.delete`)."""
        with self.lock:
            self.history.delete(self.sessions.get(session_id), keep_shared)
            self._sync()

    def _acquire(self, session_id: str) -> None:
        """Lease the session for one turn: it becomes busy (SessionBusyError if leased). End with `_release`
        (callers: `lease`, `begin`)."""
        with self.lock:
            if (gap := self.sessions.acquire(session_id)[1]) is not None:   # back with history: the policy sees it
                self.placement.policy.observe_return(gap)

    def _release(self, session_id: str) -> None:
        """End the session's lease (callers: `lease`, `begin` on error, `end`): its layered chunks settle,
        chunks move down ahead of time if free device blocks fell under the threshold."""
        with self.lock:
            s = self.sessions.get(session_id)
            for f in self.features:            # e.g. its layered chunks become HOST before the table marks it
                f.settle(s)
            self.sessions.release(s)
            self.maintain()
            for f in self.features:            # e.g. write-behind: its chunks' disk copies are due after the delay
                f.released(s)

    @contextmanager
    def lease(self, session_id: str) -> Iterator[None]:
        """The session is leased for one turn around the block (SessionBusyError if it is already): busy, then
        released (its layered chunks settle, chunks move down ahead of time, write-behind notes it)."""
        self._acquire(session_id)
        try:
            yield
        finally:
            self._release(session_id)

    # ---- a scheduler's turn: one query, one admission, one end (turn.py) -------------------------

    def room(self) -> Room:
        """What a step could get now."""
        with self.lock:
            return self.capacity.room()

    def free_blocks(self) -> int:
        """Device blocks on the free list now (idle sessions' blocks are not free; `room` counts them)."""
        with self.lock:
            return self.tiers.device.num_free

    def turn_needs(self, session_id: str, prompt: Sequence[int] | None = None,
                   cache_salt: str | None = None) -> TurnNeeds:
        """What admitting a turn with `prompt` (the whole conversation) would take. Opens the session if
        new; an idle one first adopts the prompt's shared prefix (`History.adopt`; ValueError: another
        `cache_salt` than the session's). `prompt` None: the leased session's turn continuing."""
        with self.lock:
            s = self.sessions.get(session_id) if prompt is None else self.sessions.open(session_id)
            if prompt is not None and not s.busy:
                self.history.adopt(s, prompt, cache_salt)
            return self.history.turn_needs(s, prompt, self.capacity.room(), self.capacity.has_slot(s))

    def begin(self, session_id: str, prompt: Sequence[int], cache_salt: str | None = None, *,
              keep: int | None = None) -> TurnStats:
        """Admit a turn: take the lease and `begin_turn` with `prompt`, at once (SessionBusyError if
        leased; on any error the lease is not held). `keep`: the kept prefix `turn_needs` answered; a
        StoreError if the turn would keep another (the session changed since). End it with `end`."""
        with self.lock:
            self._acquire(session_id)
            try:
                turn = self.history.begin_turn(self.sessions.get(session_id), prompt, cache_salt, keep)
                self._sync()
                return turn
            except BaseException:
                self._release(session_id)
                raise

    def end(self, session_id: str, generated: int) -> Room:
        """The leased turn ends having generated `generated` tokens: `add_generated`, then the lease ends.
        Returns the room after."""
        with self.lock:
            self.planner.add_generated(self.sessions.get(session_id), generated)
            self._release(session_id)
            return self.capacity.room()

    def num_tokens(self, session_id: str) -> int:
        """Tokens of the session's history; 0 for an unknown session."""
        with self.lock:
            s = self.sessions.find(session_id)
            return 0 if s is None else s.num_tokens

    def token_ids(self, session_id: str) -> list[int]:
        """A copy of the session's history."""
        with self.lock:
            return list(self.sessions.get(session_id).token_ids)

    def expect(self, session_id: str, seconds: float) -> float:
        """The session's next turn is expected within `seconds` (clamped to `max_retain`; a tool pause): its
        KV is ranked for eviction as if active then, a priority that never pins (`policy.py`). Returns the
        clock time it is expected at."""
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 <= seconds < float("inf"):
            raise ValueError(f"expected within seconds must be a number >= 0, got {seconds!r}")
        with self.lock:
            at = self.sessions.clock() + min(seconds, self.config.max_retain)
            self.sessions.expect(self.sessions.get(session_id), at)
            return at

    def due(self, within: float) -> tuple[list[str], float]:
        """Idle sessions whose expected turn (`expect`) comes within `within` seconds, each expectation once,
        soonest first; and the clock time of the next expectation still pending (inf: none)."""
        with self.lock:
            return self.sessions.due(self.sessions.clock() + within), self.sessions.expectations.soonest()

    def is_busy(self, session_id: str) -> bool:
        """Whether a turn holds the session's lease (False for an unknown session)."""
        with self.lock:
            s = self.sessions.find(session_id)
            return s is not None and s.busy

    def places(self, session_id: str) -> tuple[Place, ...]:
        """Where each chunk of the session is (`turn.Place`)."""
        with self.lock:
            return places_of(self.sessions.get(session_id))

    def begin_turn(self, session_id: str, prompt: Sequence[int], cache_salt: str | None = None) -> TurnStats:
        """A turn of the leased session starts with `prompt`, the whole conversation (`History.begin_turn`)."""
        with self.lock:
            turn = self.history.begin_turn(self.sessions.get(session_id), prompt, cache_salt)
            self._sync()
            return turn

    def add_generated(self, session_id: str, n: int) -> None:
        """The session's turn generated `n` tokens (its last_turn's generated_tokens)."""
        with self.lock:
            self.planner.add_generated(self.sessions.get(session_id), n)

    def match_prefix(self, session_id: str, token_ids: Sequence[int]) -> int:
        """Length of the longest common prefix of the session's history and `token_ids`."""
        with self.lock:
            return common_prefix(self.sessions.get(session_id).token_ids, token_ids)

    def truncate(self, session_id: str, length: int) -> int:
        """Cut the session's history to its first `length` tokens; returns how many were cut."""
        with self.lock:
            cut = self.history.truncate(self.sessions.get(session_id), length)
            self._sync()
            return cut

    def missing_positions(self, session_id: str, cut: int | None = None) -> list[int]:
        """History positions a step must recompute, as after a cut to `cut` (`History.missing_positions`)."""
        with self.lock:
            return self.history.missing_positions(self.sessions.get(session_id), cut)

    def residency(self, session_id: str, upto: int | None = None) -> dict[str, int]:
        """Tokens of the session per tier (of its first `upto` tokens; None: all)."""
        with self.lock:
            return self.sessions.get(session_id).residency(self.block_size, upto)

    # ---- steps (step_planner.py) ----------------------------------------------------------------

    def plan_step(self, requests: Sequence[tuple[str, Sequence[int], Sequence[int]]],
                  factors: Sequence[int] | None = None) -> StepBatch:
        """Reserve device blocks for one forward step of (session_id, token_ids, positions) requests
        and describe it; the contract is `StepPlanner.plan`'s."""
        with self.lock:
            step = self.planner.plan(requests, factors)
            self._sync()
            return step

    def commit(self, step: StepBatch) -> Committed:
        """Make a planned step permanent; a leased session's last_turn counts its rows. Returns the room
        after it and each stepped session's continuing turn."""
        with self.lock:
            self.planner.commit(step)
            room = self.capacity.room()
            held = {e.session_id: s for e in step.entries if (s := self.sessions.find(e.session_id)) is not None}
            return Committed(room, {sid: self.history.turn_needs(s, None, room, self.capacity.has_slot(s))
                                    for sid, s in held.items()}, self.tiers.device.num_free)

    def abort(self, step: StepBatch) -> None:
        """Undo `plan_step` (`StepPlanner.abort`): history and blocks as before the step."""
        with self.lock:
            self.planner.abort(step)

    def held_blocks(self, session_id: str) -> float:
        """Device blocks the session holds: a whole block per DEVICE chunk, 1/f of one per residue block."""
        with self.lock:
            return self.capacity.held_blocks(self.sessions.get(session_id))

    def offload_layers(self, session_id: str, full: bool = False) -> int:
        """LayerKV's push-down for a running request; device blocks freed (0 without layerwise_kv)."""
        with self.lock:
            return self.layered.offload(self.sessions.get(session_id), full)

    # ---- movement (relocation.py, placement.py) and capacity (tier_pools.py) ------------------------

    def move(self, session_id: str, chunks: Iterable[int], tier: str, reason: str = "explicit") -> None:
        """Move chosen chunks of an idle session to `tier` ("device", "host", "hidden", "disk", "dropped"),
        labelled `reason` in `self.moves` (moves.REASONS); the rules: `Relocation.move`."""
        target, chunks = target_state(tier), chunk_indices(chunks)
        with self.lock, self.placement.moving(reason):
            self.relocation.move(self.sessions.get(session_id), chunks, target)
            self._sync()

    def prefetch_shared(self, fraction: float = 0.5) -> int:
        """Ahead of the first turns after a restart (a server's replica calls it before /health): the chunks that
        several sessions share and that sit on the host or disk (a chat template's system prompt, held by every
        session) move up to the device, most holders first, into at most `fraction` of its free blocks, so no
        returning turn reads them; each disk chunk's proof is checked as it is read (one that fails is dropped:
        the next turn recomputes it). Returns the tokens moved, each shared chunk counted once."""
        if not 0 <= fraction <= 1:
            raise ValueError(f"fraction must be in [0, 1], got {fraction}")
        with self.lock, self.placement.moving("ahead"):
            moved = self.relocation.prefetch_shared(int(self.tiers.device.num_free * fraction))
            self._sync()
            return moved

    def evict(self, session_id: str) -> int:
        """The session's device chunks one tier down, also when busy; device blocks freed (`Relocation.evict`)."""
        with self.lock, self.placement.moving("evict"):
            freed = self.relocation.evict(self.sessions.get(session_id))
            self._sync()
            return freed

    def available_host_blocks(self) -> int:
        """Host slots a step could get now: free, or idle sessions' (`Capacity.host_blocks`)."""
        with self.lock:
            return self.capacity.host_blocks()

    def reclaim(self) -> int:
        """Virtual layout: give back free device blocks' committed pages now (else kept up to `keep_freed`); bytes."""
        with self.lock:
            return self.tiers.device.reclaim() if self.layout is Layout.VIRTUAL else 0

    def maintain(self) -> None:
        """Forget idle sessions past the bounds, swap out ahead of time (also whenever a lease ends)."""
        with self.lock:
            self.history.forget_idle(self.config.max_sessions, self.config.session_ttl)
            self.placement.swap_out_ahead()
            self.history.collect_retained()
            self._sync()

    def export_session(self, session_id: str) -> SessionExport:
        """The idle session's token ids and stored KV (SessionBusyError while leased; `migration.py`)."""
        with self.lock:
            return export_session(self.parts, self.spec, self.sessions.get(session_id))

    def fork(self, session_id: str, new_id: str, token_ids: Sequence[int] | None = None,
             replace: bool = False) -> int:
        """A new session `new_id` with the session's history (its common prefix with `token_ids`; None: all of
        it) and KV: the full chunks shared, the partial last chunk copied to a new device block (`prefix/fork.py`).
        The session may be busy: its step in flight is left out. Tokens whose KV came along. StoreError if
        `new_id` exists (unless `replace`: then it is deleted first, under the same lock; SessionBusyError if it
        is busy) or prefix sharing is off; ValueError if `new_id` is another tenant's or the session itself."""
        with self.lock:
            got = fork_session(self.parts, self.sessions.get(session_id), new_id, token_ids, replace)
            self._sync()
            return got

    def import_session(self, exp: SessionExport) -> int:
        """Make `exp` this store's session of its id, on the device; tokens whose KV came along."""
        return self.import_sessions([exp])

    def import_sessions(self, exps: Iterable[SessionExport], tier: str | None = None) -> int:
        """Bulk `import_session`s under one lock, each moved to `tier` at once (None: on the device), then one
        `maintain` and disk commit (a failure part way keeps those before it). Tokens imported."""
        with self.lock:
            try:
                return import_sessions(self.parts, self.spec, exps, None if tier is None else target_state(tier))
            finally:
                self.maintain()

    def _sync(self) -> None:
        """Each feature makes durable what changed (the disk index; `StoreFeature.sync`, never raises). Lock held."""
        for f in self.features:
            f.sync()

    # ---- integrity and statistics ---------------------------------------------------------------

    def check_integrity(self) -> None:
        """AssertionError unless every slot of every tier is free or owned by one chunk (`integrity.py`: all)."""
        with self.lock:
            check_integrity(self.sessions, self.tiers, self.block_size)   # slots, disk rows, shared chunks

    @overload
    def stats(self, session_id: None = None) -> StoreStats: ...
    @overload
    def stats(self, session_id: str) -> SessionStats: ...

    def stats(self, session_id: str | None = None) -> StoreStats | SessionStats:
        """The store's statistics (tiers, counters, traffic), or with `session_id` the session's (its tiers,
        lease, `last_turn`). Reads only."""
        with self.lock:
            if session_id is not None:
                return session_stats(self.sessions.get(session_id), self.block_size)
            profile = self.placement.policy.profile
            return dataclasses.replace(store_stats(self.sessions, self.tiers, self.counters),
                                       cost_profile=None if profile is None else profile.source)

    def summary(self) -> str:
        """The store's tiers and traffic, for a person."""
        return summary(self.stats())

    def flush(self, timeout: float = 10.0) -> FlushReport | None:
        """Write to disk the device and host KV chunks of idle sessions that are not on disk yet (the partial
        last chunks too), most recently active sessions first, within `timeout` seconds, then commit the index:
        what a restart on the same disk_dir finds (`DiskWriter.flush`; what is left is logged in one line and
        recomputed after a restart). None without a disk tier, or once it is closed (`StoreFeature.flush`)."""
        if not self.features:
            return None
        deadline = time.monotonic() + timeout
        self.transfer.synchronize()
        with self.lock:
            reports = [f.flush(deadline) for f in self.features]
        return next((r for r in reports if r is not None), None)

    def close(self, flush: bool = True, timeout: float = 10.0) -> FlushReport | None:
        """Stop write-behind, land every copy, `flush` (with `flush`: within `timeout` seconds; False: what is
        not on disk yet is lost, the behaviour before write-behind), write the disk index, release the disk
        tier. The device and host contents are gone afterwards. Returns the flush's report (None: none)."""
        for f in self.features:
            f.stop()                                  # write-behind, the page mapper's thread
        report = self.flush(timeout) if flush else None
        self.transfer.synchronize()
        with self.lock:
            for f in self.features:
                f.close()                             # the disk index committed, the tier released
        return report
