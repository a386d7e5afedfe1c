"""Per-step metadata of a paged attention call: built once per step, shared by all layers."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class PagedBatch:
    """Packed queries of S sub-requests over a paged KV pool.

    cu_q:        [S + 1] int   offsets of each sub-request's rows in the packed query (cu_q[0] = 0).
    q_pos:       [T] int       absolute position of each query row; row t of sub-request i sees that
                               sub-request's keys at positions <= q_pos[t] (and > q_pos[t] - window).
    kv_len:      [S] int       keys of sub-request i are positions 0 .. kv_len[i] - 1.
    block_table: [S, M] int    block ids: position p of sub-request i lives in block
                               block_table[i, p // block_size] at offset p % block_size.
                               Entries past ceil(kv_len / block_size) are ignored (any value).

    Positions need not be contiguous: a dropped-prefix recompute and a new prompt of one session are
    rows of the same batch (their own sub-requests, or one sub-request with a gap in q_pos).
    Python copies of the small tensors are taken once here, so no layer syncs on them.
    """

    cu_q: torch.Tensor
    q_pos: torch.Tensor
    kv_len: torch.Tensor
    block_table: torch.Tensor
    host: tuple[list[int], list[int]] = field(init=False, repr=False, compare=False)
    # per-step plans made by paged_attention when the caller passes none (see stateful_hf/kernels/kernel_plan.py)
    plans: dict = field(init=False, repr=False, compare=False, default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("cu_q", "q_pos", "kv_len", "block_table"):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor) or t.dtype not in (torch.int32, torch.int64):
                raise TypeError(f"PagedBatch.{name} must be an int32/int64 tensor, got {type(t).__name__}"
                                f"{'' if not isinstance(t, torch.Tensor) else ' of ' + str(t.dtype)}")
        if self.cu_q.dim() != 1 or self.kv_len.dim() != 1 or self.q_pos.dim() != 1:
            raise ValueError("PagedBatch: cu_q, q_pos and kv_len must be 1-D")
        if self.block_table.dim() != 2:
            raise ValueError(f"PagedBatch.block_table must be 2-D [S, M], got shape {tuple(self.block_table.shape)}")
        s = self.kv_len.numel()
        if self.cu_q.numel() != s + 1 or self.block_table.shape[0] != s:
            raise ValueError(f"PagedBatch: {s} sub-requests in kv_len but cu_q has {self.cu_q.numel()} entries "
                             f"and block_table {self.block_table.shape[0]} rows")
        cu_q = self.cu_q.tolist()
        kv_len = self.kv_len.tolist()
        if cu_q[0] != 0 or any(b < a for a, b in zip(cu_q, cu_q[1:])) or cu_q[-1] != self.q_pos.numel():
            raise ValueError(f"PagedBatch.cu_q must rise from 0 to the {self.q_pos.numel()} query rows, got {cu_q}")
        if any(n < 0 for n in kv_len):
            raise ValueError(f"PagedBatch.kv_len must be >= 0, got {kv_len}")
        object.__setattr__(self, "host", (cu_q, kv_len))

    @property
    def num_seqs(self) -> int:
        return self.kv_len.numel()

    @property
    def num_tokens(self) -> int:
        return self.q_pos.numel()

    def to(self, device: torch.device | str) -> PagedBatch:
        return PagedBatch(*(t.to(device) for t in (self.cu_q, self.q_pos, self.kv_len, self.block_table)))

    def validate(self, num_blocks: int, block_size: int) -> None:
        """Raise unless every row reads only blocks that exist and positions its context covers."""
        cu_q, kv_len = self.host
        needed = [-(-n // block_size) for n in kv_len]
        if max(needed, default=0) > self.block_table.shape[1]:
            i = max(range(len(needed)), key=needed.__getitem__)
            raise ValueError(f"PagedBatch: sub-request {i} has kv_len {kv_len[i]} = {needed[i]} blocks of "
                             f"{block_size} but its block_table row has {self.block_table.shape[1]} entries")
        table = self.block_table.tolist()          # one copy to the host, then Python over small lists
        for i, n in enumerate(needed):
            row = table[i][:n]
            if n and (min(row) < 0 or max(row) >= num_blocks):
                raise ValueError(f"PagedBatch: sub-request {i} names block ids {row} outside the pool's "
                                 f"0..{num_blocks - 1}")
        if self.num_tokens:
            pos = self.q_pos.tolist()
            for i, (a, b) in enumerate(zip(cu_q, cu_q[1:])):
                if b > a and (min(pos[a:b]) < 0 or max(pos[a:b]) >= kv_len[i]):
                    raise ValueError(f"PagedBatch: sub-request {i} has query positions "
                                     f"{min(pos[a:b])}..{max(pos[a:b])} outside its context "
                                     f"0..{kv_len[i] - 1}")


@dataclass(frozen=True)
class Overlay:
    """Context blocks of one layer read from another source than the pool (LayerKV's layer-wise
    residency: a block whose KV of this layer lives on the host).

    table: [S, M] int  -1: block (i, j) comes from the pool through block_table[i, j]; b >= 0: from
                       block b of `key` / `value` instead.
    key, value: [source blocks, block_size, Hkv, D] (strided views are fine), same dtype and device as
                the pool's layer. Only the torch backend reads overlays."""

    table: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor

    def __post_init__(self) -> None:
        if self.table.dim() != 2 or self.table.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"Overlay.table must be a 2-D int tensor [S, M], got {tuple(self.table.shape)} "
                             f"{self.table.dtype}")
        if self.key.shape != self.value.shape or self.key.dim() != 4:
            raise ValueError(f"Overlay key/value must be [blocks, block_size, Hkv, D] of one shape, got "
                             f"{tuple(self.key.shape)} and {tuple(self.value.shape)}")
