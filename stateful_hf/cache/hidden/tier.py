"""The hidden-state tier (HCache): its pools, the capture of hidden states, and the rules of moving
hidden chunks.

Hidden chunks live in the host hidden pool (HIDDEN) and, below it, in the disk tier's hidden file
(DISK_HIDDEN, same split, so moving between them is a copy of slots). Either restores to the device
the same way: read up layer by layer and projected (`HiddenRestore`, run by the step; its slots are
settled by `swap_in.py`).

Owns: the HiddenCapture (which device blocks' hidden states were captured), the hidden pool and
(opened in the disk tier) the disk hidden pool. Mutates nothing after construction except through
the capture (written by steps and by swap-in, `capture.valid`). Stateless rules otherwise. A store
that captures nothing (`hidden_states="never"`, the default) has no hidden tier: its callers skip it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from ...options import HiddenStates
from ..audit.stats import Counters
from ..feature import StoreFeature
from ..pools.tier import LazyFree
from ..sessions.session import HIDDEN_FORMS, ChunkState, Session
from ..spec import KVSpec, capacity_in_blocks
from .states import HiddenCapture, HiddenPool, HiddenRestore, HiddenSpec, Projector, StepHidden

if TYPE_CHECKING:
    from ..disk.tier import DiskTier
    from ..step import StepBatch

HIDDEN_MODES = tuple(HiddenStates)
DEVICE, HIDDEN, DISK, DROPPED = ChunkState.DEVICE, ChunkState.HIDDEN, ChunkState.DISK, ChunkState.DROPPED


def open_hidden_tier(mode: str, spec: HiddenSpec | None, project: Projector | None, kv: KVSpec, device_blocks: int,
                     capacity, host_capacity, disk: DiskTier | None, disk_capacity=None,
                     transfer: LazyFree | None = None) -> HiddenTier | None:
    """The store's hidden tier, or None when it captures nothing. mode "never": None. "always":
    capture while computing and keep chunks moving down from the device as hidden states. "auto":
    like "always" when a layer's hidden state is smaller than its K+V (MHA), else None (GQA keeps
    KV). With a disk tier, hidden chunks moving down from the host stay hidden states in its hidden
    file, which holds `disk_capacity` (tokens or a size). `capacity`: the hidden pool (default
    `host_capacity`), which frees through `transfer` (the store's)."""
    mode = HiddenStates.of("hidden_states", mode)
    if mode is HiddenStates.NEVER:
        return None
    if spec is None or project is None:
        raise ValueError(f"hidden_states={mode!r} needs a HiddenSpec and a projector (hidden -> K/V)")
    if spec.kv != kv:
        raise ValueError("the HiddenSpec must describe the store's own KV geometry")
    if mode is HiddenStates.AUTO and spec.hidden_size >= 2 * spec.kv.num_kv_heads * spec.kv.head_dim:
        return None
    capacity = capacity if capacity is not None else host_capacity
    if capacity is None:
        raise ValueError(f"hidden_states={mode!r} needs room for hidden states: give hidden_capacity "
                         "(or host_capacity, which it defaults to)")
    pool = HiddenPool(spec, capacity_in_blocks(capacity, spec), "cpu", pin_memory=kv.device.type == "cuda",
                      transfer=transfer)
    disk_pool = None
    if disk is not None:
        disk.open_hidden(spec, capacity_in_blocks(disk_capacity or "1GiB", spec))
        disk_pool = disk.hidden_pool
    return HiddenTier(spec, project, pool, HiddenCapture(spec, device_blocks), disk_pool)


class HiddenTier:
    """A store's hidden tier (`open_hidden_tier` builds it; a store that captures nothing has none):
    the hidden pool, the disk tier's hidden pool (None without a disk tier) and the capture."""

    def __init__(self, spec: HiddenSpec, project: Projector, pool: HiddenPool, capture: HiddenCapture,
                 disk_pool: HiddenPool | None):
        self.spec, self.project, self.pool, self.capture, self.disk_pool = spec, project, pool, capture, disk_pool

    def captured(self, block: int) -> bool:
        """Whether device block `block` holds K/V whose hidden states were captured."""
        return bool(self.capture.valid[block])

    def computed(self, block: int, captured: bool) -> None:
        """Device block `block` got K/V computed while capturing (`captured`), or copied up or in (its hidden
        states unknown). Mutates: the capture's valid flag of the block."""
        self.capture.valid[block] = captured

    def copy_block(self, old: int, new: int) -> None:
        """Block `old`'s K/V was copied to `new` (copy on write): its captured hidden states go with it."""
        self.capture.data[:, new] = self.capture.data[:, old]
        self.capture.valid[new] = self.capture.valid[old]

    def new_restore(self, counters: Counters) -> HiddenRestore:
        """An empty restore for a step."""
        return HiddenRestore(self.capture, self.project, counters)

    def step_hidden(self, slots: list[int], restore: HiddenRestore | None) -> StepHidden:
        """A step's capture of its rows at device `slots` and its restore (kept only if it has chunks)."""
        return StepHidden(self.capture, torch.tensor(slots, dtype=torch.long),
                          restore if restore and restore.chunks else None)

    @staticmethod
    def target(state: ChunkState, target: ChunkState) -> ChunkState:
        """Where `move(..., target)` puts a chunk in `state`: hidden chunks stay hidden states on disk,
        and disk hidden chunks come up to the host as hidden states."""
        if target is DISK and state in HIDDEN_FORMS:
            return ChunkState.DISK_HIDDEN
        return target

    def check_source(self, items: list[tuple[Session, int]], state: ChunkState) -> None:
        """ValueError unless every chunk of `items` (in `state`) can become HIDDEN."""
        bad = [(s.session_id, k) for s, k in items if state is not DEVICE or not self.capture.valid[s.chunks[k].loc]]
        if bad:
            raise ValueError(f"chunks {bad[:4]} cannot become hidden: their hidden states were not captured "
                             "(only device chunks computed or rebuilt from hidden states while capturing can)")

    def check_move(self, s: Session, ks: list[int], target: ChunkState) -> None:
        """Refuse moves the hidden forms cannot make (ValueError, nothing moved)."""
        if target is HIDDEN:
            self.check_source([(s, k) for k in ks if s.chunks[k].state is DEVICE], DEVICE)
            if any(s.chunks[k].state not in (DEVICE, *HIDDEN_FORMS) for k in ks):
                raise ValueError(f"session {s.session_id!r}: only device chunks can become hidden (host and disk "
                                 "chunks keep K/V only; their hidden states are gone)")
        if target not in (DEVICE, DISK, HIDDEN, DROPPED) and any(s.chunks[k].state in HIDDEN_FORMS for k in ks):
            raise ValueError(f"session {s.session_id!r}: hidden chunks move to the device (their K/V is rebuilt "
                             "there), to disk (as hidden states) or are dropped")


class HiddenSteps(StoreFeature):
    """The hidden tier's part in each step (registered by `store_parts.assemble`): per layer, capture the
    rows' hidden states and rebuild the context's hidden chunks (`StepHidden`); at commit or abort, the
    captured rows reach the buffer and swap-in settles the rebuilds (`settle`: `SwapIn.settle`)."""

    per_layer = True

    def __init__(self, settle: Callable[[HiddenRestore, bool], None]):
        self.settle_rebuilds = settle

    def before_layer(self, step: StepBatch, layer: int, hidden: torch.Tensor) -> None:
        step.hidden.capture(layer, hidden)
        if step.hidden.restore is not None:
            step.hidden.restore.run(layer, step.pool)

    def commit(self, step: StepBatch) -> None:
        step.hidden.flush()                  # captured rows (CUDA: side-stream copies) reach the buffer
        if step.hidden.restore is not None:
            step.hidden.restore.finish(step.pool)     # layers a forward did not reach, if any
            self.settle_rebuilds(step.hidden.restore, True)

    def abort(self, step: StepBatch) -> None:
        step.hidden.flush()
        if step.hidden.restore is not None:
            self.settle_rebuilds(step.hidden.restore, step.hidden.restore.complete)
