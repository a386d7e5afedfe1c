"""One forward step over the store: built once per step by the store's planner, then, while the
forward runs, the current step of its thread (`stateful_hf/integration/context.py`), which every decoder
layer prepares (`before_layer`) and whose attention places its rows (`write_rows`). docs/step.md.

The one writer of computed K/V: every K/V row that a forward computes or a restore rebuilds
enters a pool layer through `pool.write_kv`, and through nothing else.

Its callers, all within one step (docs/step.md):
- the step's own rows, from the registered attention through `StepBatch.write_rows`: at the rows'
  device slots, or where LayerKV's placement puts each layer of their chunk (`layerwise/step.py`:
  device blocks, the host pool in place, a staged buffer, the host rows written down at commit);
- HCache's layer-wise restore (`HiddenRestore`, `hidden/states.py`): the K/V of the context's hidden
  chunks, projected from hidden states or read from the chunk's K/V layers, as whole device blocks.

Not through here: moving whole blocks between tiers (swap-in, swap-out, disk reads and writes).
Those are block copies of K/V already written, owned by the transfer engine (`transfer.py`: one
`Copy` per group of blocks with one event per layer; `before_layer` waits on the events of its
layer before anything reads those blocks) and by the tier moves that call it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from ..kernels import KernelState, Overlay, PagedBatch
from .movement.transfer import wait_event
from .pools.pool import BlockPool, SlotRows, write_kv

if TYPE_CHECKING:
    from .hidden.states import StepHidden
    from .layerwise.step import LayeredStep



class LayerWork(Protocol):
    """A store feature with work before each decoder layer of a step (`feature.StoreFeature.before_layer`)."""

    def before_layer(self, step: StepBatch, layer: int, hidden: torch.Tensor) -> None: ...


@dataclass(frozen=True, slots=True)
class StepEntry:
    """One session's rows in a step: token ids computed at `positions` (recomputed history and/or
    new tokens appended at the end). `old_len` is the session length before the step."""

    session_id: str
    token_ids: tuple[int, ...]
    positions: tuple[int, ...]
    old_len: int
    new_blocks: tuple[int, ...]         # chunk indices that received a block in this step


@dataclass(frozen=True, slots=True)
class StepBatch:
    """What every layer of the forward needs: where to write each row's K/V (`slots`, [T]) and how
    to attend (`paged`, one sub-request per entry). Rows are packed in entry order. The fields are
    fixed at planning; a forward mutates only pools and buffers, through `before_layer` (each layer,
    first) and `write_rows` (each layer's attention); the store's commit or abort ends the step."""

    entries: tuple[StepEntry, ...]
    paged: PagedBatch
    slots: torch.Tensor                 # [T] block * block_size + offset
    input_ids: torch.Tensor             # [1, T]
    position_ids: torch.Tensor          # [1, T]
    pool: BlockPool
    backend: str = "torch"
    windows: tuple[int | None, ...] = ()   # [num_layers] sliding window of each layer (KVSpec.windows)
    layer_events: tuple | None = None   # per layer, CUDA events of swap-in copies its KV waits for
    hidden: StepHidden | None = None    # capture of the rows' hidden states, restore of hidden chunks
    dense_slots: tuple[int, ...] | None = None  # virtual layout: each entry's slot (dense kernels, no table)
    layered: LayeredStep | None = None  # layer-wise residency of rows and context (LAYERED chunks), else None
    kernels: KernelState | None = None  # the store's long-lived kernel state (FlashInfer workspace + wrapper)
    features: tuple[LayerWork, ...] = ()   # the store's features with per-layer work (`feature.StoreFeature`)
    rows: SlotRows | None = None        # `slots` as rows of the pool's `layer_rows` (a BlockPool), else None

    @property
    def num_tokens(self) -> int:
        return self.slots.numel()

    @property
    def has_layer_work(self) -> bool:
        """Whether some layer has work besides its attention: a swap-in event to wait for, hidden states
        to capture or restore (`before_layer`), or LayerKV placement of its rows (`write_rows`). A step
        without is the same graph for any data (the compiled step); one with it runs eager."""
        return (bool(self.features) or self.layered is not None
                or (self.layer_events is not None and any(self.layer_events)))

    def before_layer(self, layer: int, hidden: torch.Tensor) -> None:
        """The step's work for decoder layer `layer`, once, before the layer runs (its pre-hook),
        given the layer's input `hidden` ([1, T, D], the residual stream of the step's rows). In order:
        1. wait for the layer's swap-in copies (transfer rule 2: no read of a destination before its
           event; emulated copies are performed here);
        2. each feature's work of the layer (`StoreFeature.before_layer`; hidden states: capture `hidden` at
           the rows' slots, layers [0, L_H), then rebuild this layer's K/V of the context's hidden chunks,
           HCache, through the K/V writer, leaving the captured rows alone).
        Mutates the device pool's layer `layer` (restored blocks) and the features' buffers, nothing else."""
        if self.layer_events is not None:
            for event in self.layer_events[layer]:
                wait_event(event, self.pool.device)
        for f in self.features:
            f.before_layer(self, layer, hidden)

    def write_rows(self, layer: int, key_cache: torch.Tensor, value_cache: torch.Tensor,
                   key: torch.Tensor, value: torch.Tensor) -> Overlay | None:
        """Write the rows' K/V of `layer` ([T, Hkv, D]) through the one K/V writer: at `slots` in the
        layer's device views `key_cache`, `value_cache` (`pool.layer(layer)`), or, for a layer-wise
        step, where that layer of each row's chunk lives (`LayeredStep`). Returns the overlay the
        attention reads this layer's host-resident context through (None: all on the device)."""
        if self.layered is None:
            at = self.rows
            write_kv(key_cache, value_cache, key, value, self.slots,
                     None if at is None else (self.pool.layer_rows(layer), at))
            return None
        return self.layered.write_and_overlay(layer, key_cache, value_cache, key, value)

    def window(self, layer: int) -> int | None:
        """The sliding-window span of `layer` (keys j > pos - window), None for full attention."""
        return self.windows[layer] if self.windows else None

    def last_rows(self) -> torch.Tensor:
        """[S] index of each entry's last row (where its next-token logits come from)."""
        return self.paged.cu_q[1:] - 1

