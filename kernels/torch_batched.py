"""Fast pure-torch paged attention: gather into a cache-sized workspace + one SDPA per slice of a group.

Measured on the 2-core CPU (benchmarks/bench_kernels.py, 32 x 8 rows, Hq 16 / Hkv 4, 4096 context):
a per-sub-request loop costs ~11x contiguous SDPA; gathering a whole group then one SDPA ~1.9x
(the gathered copy is written to and read back from DRAM); a block-wise online-softmax loop in torch
~1.6x. What this file does, ~1.2x of the best contiguous call:
  - GQA folded into query rows: the G query heads sharing a KV head become G * q rows of one
    [n, Hkv, G * q, D] query, so SDPA never expands K/V to Hq heads (enable_gqa does);
  - a group is attended in slices of members whose gathered K+V fits WORKSPACE_BYTES, so the
    gather's writes and SDPA's reads stay in cache instead of making two more trips to DRAM.
The workspace is allocated on the first layer of a step and reused by every later layer (fresh
100 MB allocations cost more than the copy itself: first-touch page faults).

Plan (host side, once per step): sub-requests with query rows are sorted by (q_len, blocks) and cut
into groups whose padded cost n * max_q * max_kv stays within PAD_SLACK of the real sum q_i * kv_i,
so one long prompt is not padded against 31 decode rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .batch import PagedBatch

PAD_SLACK = 1.5                 # a group may cost up to this much more than its unpadded work
WORKSPACE_BYTES = 16 << 20      # gathered K+V of one slice of a group (16-32 MiB best of 8..1024 MiB here)


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

    def mask(self, window: int | None, groups: int) -> torch.Tensor:
        """[n, 1, groups * max_q, L] bool, rows ordered (query head in its KV group, row); cached."""
        if (window, groups) not in self._masks:
            keys = torch.arange(self.length, device=self.pos.device)
            m = keys <= self.pos
            if window is not None:
                m &= keys > self.pos - window
            self._masks[window, groups] = m.repeat(1, 1, groups, 1)
        return self._masks[window, groups]


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

    def _workspace(self, key_cache: torch.Tensor) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        """Per group: members per slice m and K, V buffers [m * nb, block_size, Hkv, D], made once per step."""
        key = (key_cache.dtype, key_cache.device, tuple(key_cache.shape[1:]))
        if key not in self._work:
            block_bytes = 2 * key_cache[0].numel() * key_cache.element_size()
            self._work[key] = []
            for g in self.groups:
                m = max(1, min(g.n, WORKSPACE_BYTES // (g.nb * block_bytes)))
                self._work[key].append((m, *(key_cache.new_empty((m * g.nb, *key_cache.shape[1:]))
                                             for _ in range(2))))
        return self._work[key]

    def run(self, query, key_cache, value_cache, scale: float, window: int | None = None) -> torch.Tensor:
        # query [T, Hq, D]; caches [num_blocks, block_size, Hkv, D] (strided views are fine)
        out = torch.zeros_like(query)
        hq, d = query.shape[1:]
        hkv = key_cache.shape[2]
        rep = hq // hkv                   # query heads per KV head; head h reads KV head h // rep
        for g, (m, kbuf, vbuf) in zip(self.groups, self._workspace(key_cache)):
            # [n, Hkv, rep * max_q, D]: rows of one KV head's query heads stacked
            q = (query.index_select(0, g.q_rows).view(g.n, g.max_q, hkv, rep, d)
                 .permute(0, 2, 3, 1, 4).reshape(g.n, hkv, rep * g.max_q, d))
            mask = g.mask(window, rep)
            o = torch.empty_like(q)
            for a in range(0, g.n, m):
                b = min(a + m, g.n)
                kb, vb = kbuf[: (b - a) * g.nb], vbuf[: (b - a) * g.nb]
                torch.index_select(key_cache, 0, g.blocks[a * g.nb: b * g.nb], out=kb)
                torch.index_select(value_cache, 0, g.blocks[a * g.nb: b * g.nb], out=vb)
                k = kb.view(b - a, g.length, hkv, d)
                v = vb.view(b - a, g.length, hkv, d)
                for j, n in g.tails:      # masked keys must still be finite: SDPA adds the mask to q.k
                    if a <= j < b:
                        k[j - a, n:] = 0
                        v[j - a, n:] = 0
                o[a:b] = F.scaled_dot_product_attention(q[a:b], k.transpose(1, 2), v.transpose(1, 2),
                                                        attn_mask=mask[a:b], scale=scale)
            o = o.view(g.n, hkv, rep, g.max_q, d).permute(0, 3, 1, 2, 4).reshape(g.n * g.max_q, hq, d)
            out[g.out_rows] = o[g.out_src]
        return out
