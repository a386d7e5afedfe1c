"""The store's optional features as the core sees them: `StoreFeature`, the one interface a feature
(disk tier, hidden states, LayerKV, the virtual layout's page mapper) plugs in through, and the null
parts that stand in for a feature that is off where the core needs one of its answers.

`store_parts.assemble` builds a feature's part only when its option is on and registers it in
`StoreParts.features` (build order); the core calls every registered feature at each point below, in
that order, with the store lock held (`stop` aside). A default store registers none: the loops run
over an empty tuple, and the null parts (`NoHiddenStates`, `NoDisk`, `NoLayers`) answer from the core,
so no function of a feature package runs (tests/test_architecture.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

from .sessions.session import ChunkState, Session

if TYPE_CHECKING:
    import torch

    from .audit.stats import Counters, FlushReport
    from .prefix.sharing import PrefixSharing
    from .step import StepBatch

NO_HIDDEN_TIER = ("this store keeps no hidden states (hidden_states='never', or 'auto' on a model whose K/V is not "
                  "larger than its hidden states): use hidden_states='always'")


class StoreFeature(Protocol):
    """One feature's hooks into a store's life. A feature subclasses this and overrides what it uses;
    the rest are the no-ops below."""

    per_layer: bool = False     # `before_layer` has work: its steps carry it (and run eager, not compiled)

    def before_layer(self, step: StepBatch, layer: int, hidden: torch.Tensor) -> None:
        """Decoder layer `layer` of `step` is about to run on `hidden` ([1, T, D]) after its swap-in
        copies landed (`StepBatch.before_layer`). Changes the device pool's layer and the feature's buffers."""

    def commit(self, step: StepBatch) -> None:
        """`step`'s forward is over and it commits (the transfer engine's step ended first), before its rows
        count: land the feature's work of the step. Changes the feature's buffers and the chunks it rebuilt."""

    def abort(self, step: StepBatch) -> None:
        """`step` is aborted (the transfer engine's step ended first), before its new tokens leave the
        history: take the feature's work of the step back."""

    def settle(self, s: Session) -> int:
        """`s` runs no turn now, or its chunks are about to move (a lease's end, a move, an eviction, the
        commit or abort of an idle session's step): chunks of a form that lives only within a turn take
        their lasting form. Changes `s`'s chunks; returns the device blocks freed."""
        return 0

    def released(self, s: Session) -> None:
        """The lease on `s` ended, after the store's upkeep (`KVStore.lease`, `KVStore.end`). Reads `s`."""

    def sync(self) -> None:
        """A store method that may change what is kept across a restart ends: make it durable; never raises."""

    def flush(self, deadline: float) -> FlushReport | None:
        """Write what a restart should find and is not written yet, until `deadline` (time.monotonic());
        the report, or None when the feature keeps nothing across a restart."""
        return None

    def stop(self) -> None:
        """The store closes: stop background work (before its last `flush`; the store lock not held)."""

    def close(self) -> None:
        """The store closes, after its last flush and every copy landed: release what the feature holds."""


class NoHiddenStates:
    """The hidden tier of a store that captures nothing (`HiddenTier`'s answers the core asks for):
    no block's hidden states are captured, no chunk is in a hidden form, nothing is rebuilt."""

    capture = None
    pool = None

    @staticmethod
    def captured(block: int) -> bool:
        return False

    def computed(self, block: int, captured: bool) -> None:
        """Device block `block` got K/V computed (`captured`: while capturing) or copied up: nothing to note."""

    def copy_block(self, old: int, new: int) -> None:
        """Block `old`'s K/V was copied to `new`: no hidden states go with it."""

    @staticmethod
    def new_restore(counters: Counters) -> None:
        return None

    @staticmethod
    def step_hidden(slots: list[int], restore: None) -> None:
        return None

    @staticmethod
    def target(state: ChunkState, target: ChunkState) -> ChunkState:
        return target

    @staticmethod
    def check_move(s: Session, ks: list[int], target: ChunkState) -> None:
        if target is ChunkState.HIDDEN:      # without a hidden tier no chunk is in a hidden form
            raise ValueError(NO_HIDDEN_TIER)


class NoDisk:
    """The disk state of a store without a disk tier (`DiskState`'s answers the core asks for): no
    chunk is on disk, so none needs proof and no disk row changes."""

    @staticmethod
    def failed(s: Session, ks=None) -> list[int]:
        return []

    @staticmethod
    def row_holders(items: list[tuple[Session, int]], sharing: PrefixSharing) -> Iterable[str]:
        return ()

    def mark_changed(self, session_ids: Iterable[str] | None = None) -> None:
        """No disk rows to commit."""

    @staticmethod
    def prefetch(items: list[tuple[Session, int]]) -> None:
        """Nothing is on disk to read."""

    @staticmethod
    def keep(items: list[tuple[Session, int]]) -> None:
        assert not items, "no chunk is on disk"


class NoLayers:
    """The layered chunks of a store without layerwise_kv (`LayeredChunks`' answers the core asks for):
    every keep factor is 1, no chunk is LAYERED."""

    @property
    def stage(self) -> None:
        return None

    @stage.setter
    def stage(self, stage: bool | None) -> None:
        """Without layerwise_kv no step is layer-wise: nothing to stage."""

    @staticmethod
    def check_factors(factors: list[int]) -> None:
        if any(f != 1 for f in factors):
            raise ValueError("plan_step: keep factors other than 1 need a store made with layerwise_kv=True")

    @staticmethod
    def offload(s: Session, full: bool) -> int:
        return 0

    @staticmethod
    def step_map(sessions: list[Session], positions: list[tuple[int, ...]], tables: list[list[int]]) -> None:
        return None
