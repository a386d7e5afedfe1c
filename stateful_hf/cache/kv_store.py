"""The KV store: the facade over the store's parts; the one place session KV state changes.

Contract: every public method takes the store lock; chunk states, slot ownership and token ids
change only inside it, through the parts. A method that raises leaves every session's token ids as
they were and the invariants of `check_integrity()` intact: every slot of every tier is free or
owned by exactly one chunk (device blocks: by a DEVICE chunk, as the cached `shadow` of one
HOST/HIDDEN chunk, or split by residue among LAYERED chunks). After each method that may change
what is on disk, the facade syncs the disk index (`_sync_disk`: `DiskState.sync`, which never
raises; a store without a disk tier has no disk state and skips it).

The parts are built by `store_parts.assemble`, each with its collaborators; docs/store.md says
what each owns and mutates. A method whose contract is longer than its docstring names the part's
method that holds it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

from ..kernels import select_backend
from .chunk_needs import ChunkNeeds
from .history import common_prefix
from .integrity import check_integrity
from .policy import EvictionPolicy
from .relocation import chunk_indices, target_state
from .session import Session, TurnStats
from .spec import KVSpec
from .stats import SessionStats, StoreStats, summary
from .step import StepBatch
from .store_parts import StoreConfig, assemble
from .store_stats import session_stats, store_stats
from .tenant import TenantUsage

if TYPE_CHECKING:
    from .hidden.states import HiddenSpec, Projector


class KVStore:
    """The model-free session store. The options are `StoreConfig`'s (`store_parts.py` documents
    each); the parts are attributes named as in `StoreParts` (`store.sessions`, `store.planner`, ...)."""

    def __init__(self, spec: KVSpec, device_capacity: int | str = 4096, *, host_capacity: int | str | None = None,
                 disk_dir: str | os.PathLike | None = None, disk_capacity: int | str | None = None,
                 policy: EvictionPolicy | None = None, attn_backend: str = "torch",
                 swap_out_threshold: float = 0.25, hidden_states: str = "never",
                 hidden_spec: HiddenSpec | None = None, hidden_capacity: int | str | None = None,
                 project: Projector | None = None, layout: str = "paged", max_context: int | None = None,
                 clock: Callable[[], float] = time.monotonic, keep_freed: int | str = "64MiB",
                 map_ahead: bool = True, hidden_disk_capacity: int | str | None = None,
                 layerwise_kv: bool = False, disk_fingerprint: str = "", emulate_async: bool | None = None,
                 prefix_sharing: bool | None = None):
        attn_backend = select_backend(attn_backend, spec.device, spec.dtype, spec.head_dim, spec.block_size,
                                      layerwise_kv=layerwise_kv, layout=layout).name
        self.config = StoreConfig(
            device_capacity=device_capacity, host_capacity=host_capacity, disk_dir=disk_dir,
            disk_capacity=disk_capacity, policy=policy, attn_backend=attn_backend,
            swap_out_threshold=swap_out_threshold, hidden_states=hidden_states, hidden_spec=hidden_spec,
            hidden_capacity=hidden_capacity, project=project, layout=layout, max_context=max_context, clock=clock,
            keep_freed=keep_freed, map_ahead=map_ahead, hidden_disk_capacity=hidden_disk_capacity,
            layerwise_kv=layerwise_kv, disk_fingerprint=disk_fingerprint, emulate_async=emulate_async,
            prefix_sharing=prefix_sharing)
        self.spec, self.block_size, self.layout, self.attn_backend = spec, spec.block_size, layout, attn_backend
        p = self.parts = assemble(spec, self.config)
        self.kernels, self.transfer, self.counters, self.moves = p.kernels, p.transfer, p.counters, p.moves
        self.sessions, self.sharing, self.hidden, self.disk_state = p.sessions, p.sharing, p.hidden, p.disk_state
        self.tiers, self.placement, self.swap_in, self.layered = p.tiers, p.placement, p.swap_in, p.layered
        self.relocation, self.planner, self.history, self.capacity = p.relocation, p.planner, p.history, p.capacity
        self.lock = self.sessions.lock

    # ---- the parts' objects, for callers that read them (one line each) ---------------------------

    device_pool = property(lambda self: self.tiers.device)
    host_pool = property(lambda self: self.tiers.host)
    disk = property(lambda self: self.tiers.disk)
    hidden_pool = property(lambda self: self.tiers.hidden)
    disk_hidden_pool = property(lambda self: self.tiers.disk_hidden)
    capture = property(lambda self: None if self.hidden is None else self.hidden.capture)
    hidden_spec = property(lambda self: self.config.hidden_spec)
    project = property(lambda self: self.config.project)
    residues = property(lambda self: self.tiers.residues, doc="LayerKV's residue blocks (the pools own the table)")
    page_mapper = property(lambda self: self.planner.page_mapper)
    layerwise = property(lambda self: self.layered is not None)
    swap_out_threshold = property(lambda self: self.placement.swap_out_threshold)
    clock = property(lambda self: self.sessions.clock)
    emulate_async = property(lambda self: self.transfer.emulate, doc="copies run under the CPU async emulator")

    @property
    def layerwise_stage(self) -> bool | None:
        """LayerKV's staging choice (`LayeredChunks.stage`); None and not settable without layerwise_kv."""
        return None if self.layered is None else self.layered.stage

    @layerwise_stage.setter
    def layerwise_stage(self, stage: bool | None) -> None:
        if self.layered is not None:       # without layerwise_kv no step is layer-wise: nothing to stage
            self.layered.stage = stage

    @property
    def policy(self) -> EvictionPolicy:
        return self.placement.policy

    @policy.setter
    def policy(self, policy: EvictionPolicy) -> None:
        with self.lock:
            self.placement.policy = policy

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
        """Per tenant (`tenant.py`): sessions, history tokens, tokens stored in some tier."""
        with self.lock:
            return self.history.tenant_usage()

    def delete(self, session_id: str, keep_shared: bool = False) -> None:
        """Forget the session and free what only it holds (`keep_shared`: see `History.delete`)."""
        with self.lock:
            self.history.delete(self.sessions.get(session_id), keep_shared)
            self._sync_disk()

    @contextmanager
    def lease(self, session_id: str) -> Iterator[Session]:
        """Mark the session busy for one turn; a second lease raises SessionBusyError. When the turn
        ends, chunks move down ahead of time if free device blocks fell under the threshold."""
        with self.lock:
            s, gap = self.sessions.acquire(session_id)
            if gap is not None:      # a conversation with history is back: the policy sees the gap
                self.placement.policy.observe_return(gap)
        try:
            yield s
        finally:
            with self.lock:          # lease end: layered chunks settle, swap-out ahead, then the index
                self.sessions.release(s)
                if self.layered is not None:
                    self.layered.settle(s)
                self.maintain()

    def begin_turn(self, session_id: str, prompt: Sequence[int], cache_salt: str | None = None) -> TurnStats:
        """A turn of the leased session starts with `prompt`, the whole conversation (`History.begin_turn`)."""
        with self.lock:
            turn = self.history.begin_turn(self.sessions.get(session_id), prompt, cache_salt)
            self._sync_disk()
            return turn

    def add_generated(self, session_id: str, n: int) -> None:
        """The session's turn generated `n` tokens (its last_turn's generated_tokens)."""
        with self.lock:
            self.planner.add_generated(self.sessions.get(session_id), n)

    def adopt_prefix(self, session_id: str, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        """The idle session takes the shared prefix of the prompt `token_ids`; the tokens gained (`History.adopt`)."""
        with self.lock:
            return self.history.adopt(self.sessions.get(session_id), token_ids, cache_salt)

    def match_prefix(self, session_id: str, token_ids: Sequence[int]) -> int:
        """Length of the longest common prefix of the session's history and `token_ids`."""
        with self.lock:
            return common_prefix(self.sessions.get(session_id).token_ids, token_ids)

    def truncate(self, session_id: str, length: int) -> int:
        """Cut the session's history to its first `length` tokens; returns how many were cut."""
        with self.lock:
            cut = self.history.truncate(self.sessions.get(session_id), length)
            self._sync_disk()
            return cut

    def missing_positions(self, session_id: str, cut: int | None = None) -> list[int]:
        """History positions a step must recompute, as after a cut to `cut` (`History.missing_positions`)."""
        with self.lock:
            return self.history.missing_positions(self.sessions.get(session_id), cut)

    def residency(self, session_id: str) -> dict[str, int]:
        """Tokens of the session per tier."""
        with self.lock:
            return self.sessions.get(session_id).residency(self.block_size)

    # ---- steps (step_planner.py) ----------------------------------------------------------------

    def plan_step(self, requests: Sequence[tuple[str, Sequence[int], Sequence[int]]],
                  factors: Sequence[int] | None = None) -> StepBatch:
        """Reserve device blocks for one forward step of (session_id, token_ids, positions) requests
        and describe it; the contract is `StepPlanner.plan`'s."""
        with self.lock:
            step = self.planner.plan(requests, factors)
            self._sync_disk()
            return step

    def commit(self, step: StepBatch) -> None:
        """Make a planned step permanent; a leased session's last_turn counts its rows."""
        with self.lock:
            self.planner.commit(step)

    def abort(self, step: StepBatch) -> None:
        """Undo `plan_step` (`StepPlanner.abort`): history and blocks as before the step."""
        with self.lock:
            self.planner.abort(step)

    def chunk_needs(self, session_id: str, end: int, *, length: int | None = None, factor: int = 1) -> ChunkNeeds:
        """What a step of the session up to row `end` - 1 does with each chunk (`chunk_needs.needs`)."""
        with self.lock:
            return self.capacity.chunk_needs(self.sessions.get(session_id), end, length, factor)

    def blocks_needed(self, session_id: str, end: int, *, length: int | None = None, factor: int = 1) -> int:
        """Device blocks such a step takes at most (the engine scheduler's question; `capacity.py`)."""
        with self.lock:
            return self.capacity.blocks_needed(self.sessions.get(session_id), end, length, factor)

    def residue_blocks_needed(self, factor: int, n_chunks: int) -> int:
        """Device blocks n_chunks new chunks of keep factor `factor` take now: n for 1, 0 for 0, about n / f else."""
        with self.lock:
            return self.capacity.residue_blocks_needed(factor, n_chunks)

    def offload_layers(self, session_id: str, full: bool = False) -> int:
        """LayerKV's push-down for a running request; device blocks freed (`LayeredChunks.offload`; 0
        without layerwise_kv)."""
        with self.lock:
            s = self.sessions.get(session_id)
            return 0 if self.layered is None else self.layered.offload(s, full)

    # ---- movement (relocation.py, placement.py) and capacity (capacity.py) -------------------------

    def move(self, session_id: str, chunks: Iterable[int], tier: str, reason: str = "explicit") -> None:
        """Move chosen chunks of an idle session to `tier` ("device", "host", "hidden", "disk", "dropped"),
        labelled `reason` in `self.moves` (moves.REASONS); the rules: `Relocation.move`."""
        target, chunks = target_state(tier), chunk_indices(chunks)
        with self.lock, self.placement.moving(reason):
            self.relocation.move(self.sessions.get(session_id), chunks, target)
            self._sync_disk()

    def evict(self, session_id: str) -> int:
        """The session's device chunks one tier down, also when busy; device blocks freed (`Relocation.evict`)."""
        with self.lock, self.placement.moving("evict"):
            freed = self.relocation.evict(self.sessions.get(session_id))
            self._sync_disk()
            return freed

    def available_blocks(self) -> int:
        """Device blocks a step could get now: free, or idle sessions' (`Capacity.device_blocks`)."""
        with self.lock:
            return self.capacity.device_blocks()

    def available_host_blocks(self) -> int:
        """Host slots a step could get now: free, or idle sessions' (`Capacity.host_blocks`)."""
        with self.lock:
            return self.capacity.host_blocks()

    def available_slots(self) -> int | None:
        """Virtual layout: device slots busy sessions could still get; None if paged (`Capacity.device_slots`)."""
        with self.lock:
            return self.capacity.device_slots()

    def reclaim(self) -> int:
        """Virtual layout: give back the committed pages of free device blocks now (they are kept for
        reuse up to `keep_freed` otherwise). Returns the bytes given back (0 for a paged pool)."""
        with self.lock:
            return self.tiers.device.reclaim() if self.layout == "virtual" else 0

    def maintain(self) -> None:
        """Run ahead-of-time swap-out now (it also runs whenever a lease ends)."""
        with self.lock:
            self.placement.swap_out_ahead()
            self.history.collect_retained()
            self._sync_disk()

    def _sync_disk(self) -> None:
        """Commit the disk index if the disk state changed (`DiskState.sync`, which never raises); nothing
        without a disk tier. Lock held."""
        if self.disk_state is not None:
            self.disk_state.sync()

    # ---- integrity and statistics ---------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise AssertionError unless every slot of every tier is free or owned by exactly one chunk
        (`integrity.py` has the full list)."""
        with self.lock:
            check_integrity(self.sessions, self.tiers, self.block_size)   # slots, disk rows, shared chunks

    def stats(self, session_id: str | None = None) -> StoreStats | SessionStats:
        with self.lock:
            if session_id is not None:
                return session_stats(self.sessions.get(session_id), self.block_size)
            return store_stats(self.sessions, self.tiers, self.counters)

    def summary(self) -> str:
        """The store's tiers and traffic, for a person."""
        return summary(self.stats())

    def close(self) -> None:
        """Land every copy, write the disk index and release the disk tier's lock and mappings
        (device and host contents are lost)."""
        self.transfer.synchronize()
        self.planner.stop_mapping()
        with self.lock:
            if self.disk_state is not None:
                self.disk_state.sync(force=True)      # best effort: the last committed index stays true
                self.tiers.disk.close()
