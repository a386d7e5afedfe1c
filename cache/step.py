"""One forward step's metadata over the store: built once per step by the store, read by every layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels import KernelState, PagedBatch
from .hidden_states import StepHidden
from .layered_step import LayeredStep
from .pool import BlockPool
from .transfer import wait_event


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
    """What the attention of every layer needs: where to write each row's K/V (`slots`, [T]) and how
    to attend (`paged`, one sub-request per entry). Rows are packed in entry order."""

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

    @property
    def num_tokens(self) -> int:
        return self.slots.numel()

    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) views of one layer of the device pool, once that layer's swap-in has landed and the
        K/V of the context's hidden chunks has been rebuilt for this layer (HCache, layer-wise)."""
        if self.layer_events is not None:
            for event in self.layer_events[layer]:
                wait_event(event, self.pool.device)
        if self.hidden is not None and self.hidden.restore is not None:
            self.hidden.restore.run(layer, self.pool)
        return self.pool.layer(layer)

    def window(self, layer: int) -> int | None:
        """The sliding-window span of `layer` (keys j > pos - window), None for full attention."""
        return self.windows[layer] if self.windows else None

    def capture_hidden(self, layer: int, hidden: torch.Tensor) -> None:
        """Keep the rows' hidden state entering `layer` ([1, T, D]) when the store uses hidden states."""
        if self.hidden is not None:
            self.hidden.capture(layer, hidden)

    def last_rows(self) -> torch.Tensor:
        """[S] index of each entry's last row (where its next-token logits come from)."""
        return self.paged.cu_q[1:] - 1
