"""Fast pure-torch paged attention: grouped gather into a reused workspace + one SDPA per group.

Measured on the 2-core CPU (benchmarks/bench_kernels.py): a per-sub-request loop costs 4-8x contiguous
SDPA, a block-wise online-softmax loop in torch ~1.6x (and changes rounding), while gathering each
group's blocks with `index_select(out=workspace)` and running one SDPA over the padded group costs
~1.5-1.9x and gives bit-for-bit the output contiguous SDPA gives on the same keys. The workspace is
allocated on the first layer of a step and reused by every later layer (fresh 100 MB allocations
cost more than the copy itself: first-touch page faults).

Plan (host side, once per step): sub-requests with query rows are sorted by (q_len, blocks) and cut
into groups whose padded cost n * max_q * max_kv stays within PAD_SLACK of the real sum q_i * kv_i,
so one long prompt is not padded against 31 decode rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .batch import PagedBatch

PAD_SLACK = 1.5     # a group may cost up to this much more than its unpadded work


class _Group:
    """Sub-requests attended by one SDPA call. n members, padded to max_q rows and nb blocks."""

    def __init__(self, batch: PagedBatch, members: list[int], block_size: int, table: torch.Tensor):
        cu_q, kv_len = batch.host
        device = batch.cu_q.device
        self.n = len(members)
        self.max_q = max(cu_q[i + 1] - cu_q[i] for i in members)
        self.nb = max(-(-kv_len[i] // block_size) for i in members)
        self.length = self.nb * block_size                     # L: padded context length
        blocks, q_rows, out_src, out_rows = [], [], [], []
        self.tails = []                                        # (member j, kv_len) where keys kv_len.. are padding
        for j, i in enumerate(members):
            need = -(-kv_len[i] // block_size)
            row = table[i, :need].tolist()
            blocks += row + [row[0]] * (self.nb - need)        # padding reads a valid block, zeroed later
            a, b = cu_q[i], cu_q[i + 1]
            q_rows += list(range(a, b)) + [a] * (self.max_q - (b - a))
            out_src += range(j * self.max_q, j * self.max_q + b - a)
            out_rows += range(a, b)
            if kv_len[i] < self.length:
                self.tails.append((j, kv_len[i]))
        as_long = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)
        self.blocks = as_long(blocks)                          # [n * nb] pool block ids
        self.q_rows = as_long(q_rows)                          # [n * max_q] packed query rows (padded)
        self.out_src = as_long(out_src)                        # [R] rows of the flattened [n * max_q] output
        self.out_rows = as_long(out_rows)                      # [R] their packed rows
        # absolute position of every padded query row; padded rows get -1 (they see nothing)
        pos = torch.full((self.n * self.max_q,), -1, dtype=torch.long, device=device)
        pos[self.out_src] = batch.q_pos[self.out_rows].long()
        self.pos = pos.view(self.n, 1, self.max_q, 1)
        self._masks: dict[int | None, torch.Tensor] = {}

    def mask(self, window: int | None) -> torch.Tensor:        # [n, 1, max_q, L] bool, cached per window
        if window not in self._masks:
            keys = torch.arange(self.length, device=self.pos.device)
            m = keys <= self.pos
            if window is not None:
                m &= keys > self.pos - window
            self._masks[window] = m
        return self._masks[window]


class TorchPlan:
    """Per-step state of the batched torch path; reuse it for every layer of the step."""

    def __init__(self, batch: PagedBatch, block_size: int):
        cu_q, kv_len = batch.host
        self.batch, self.block_size = batch, block_size
        live = [i for i in range(batch.num_seqs) if cu_q[i + 1] > cu_q[i]]
        live.sort(key=lambda i: (cu_q[i + 1] - cu_q[i], kv_len[i]))
        table = batch.block_table.cpu()
        groups, cur = [], []
        for i in live:
            trial = cur + [i]
            q = [cu_q[j + 1] - cu_q[j] for j in trial]
            kv = [-(-kv_len[j] // block_size) * block_size for j in trial]
            if cur and len(trial) * max(q) * max(kv) > PAD_SLACK * sum(a * b for a, b in zip(q, kv)):
                groups.append(cur)
                trial = [i]
            cur = trial
        if cur:
            groups.append(cur)
        self.groups = [_Group(batch, g, block_size, table) for g in groups]
        self._work: dict[tuple, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def _workspace(self, key_cache: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """K and V buffers [n * nb, block_size, Hkv, D] per group, allocated once per step."""
        key = (key_cache.dtype, key_cache.device, tuple(key_cache.shape[1:]))
        if key not in self._work:
            self._work[key] = [
                tuple(key_cache.new_empty((g.n * g.nb, *key_cache.shape[1:])) for _ in range(2))
                for g in self.groups
            ]
        return self._work[key]

    def run(self, query, key_cache, value_cache, scale: float, window: int | None = None) -> torch.Tensor:
        # query [T, Hq, D]; caches [num_blocks, block_size, Hkv, D] (strided views are fine)
        out = torch.zeros_like(query)
        hq, d = query.shape[1:]
        hkv = key_cache.shape[2]
        for g, (kbuf, vbuf) in zip(self.groups, self._workspace(key_cache)):
            torch.index_select(key_cache, 0, g.blocks, out=kbuf)
            torch.index_select(value_cache, 0, g.blocks, out=vbuf)
            k = kbuf.view(g.n, g.length, hkv, d)
            v = vbuf.view(g.n, g.length, hkv, d)
            for j, n in g.tails:          # masked keys must still be finite: SDPA adds the mask to q.k
                k[j, n:] = 0
                v[j, n:] = 0
            q = query.index_select(0, g.q_rows).view(g.n, g.max_q, hq, d).transpose(1, 2)
            o = F.scaled_dot_product_attention(
                q, k.transpose(1, 2), v.transpose(1, 2), attn_mask=g.mask(window), scale=scale,
                enable_gqa=hq != hkv,
            )                             # [n, Hq, max_q, D]
            out[g.out_rows] = o.transpose(1, 2).reshape(g.n * g.max_q, hq, d)[g.out_src]
        return out
