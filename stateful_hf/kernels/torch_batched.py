"""Fast pure-torch paged attention: gather into a cache-sized workspace + one SDPA per slice of a group.

Shape of the work:
  - GQA folded into query rows: the G query heads sharing a KV head become G * q rows of one
    [n, Hkv, G * q, D] query, so SDPA never expands K/V to Hq heads (enable_gqa does);
  - a group is attended in slices of members whose gathered K+V fits WORKSPACE_BYTES, so the
    gather's writes and SDPA's reads stay in cache instead of making two more trips to DRAM.
The workspace is allocated on the first layer of a step and reused by every later layer (a fresh
allocation per layer costs more than the copy: first-touch page faults).

Plan (host side, once per step): sub-requests with query rows are sorted by (q_len, blocks) and cut
into groups whose padded cost n * max_q * max_kv stays within PAD_SLACK of the real sum q_i * kv_i,
so one long prompt is not padded against 31 decode rows.

Its cost against contiguous SDPA and the alternatives (`benchmarks/bench_kernels.py`): docs/virtual-layout.md.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from .batch import PagedBatch

PAD_SLACK = 1.5                 # a group may cost up to this much more than its unpadded work
WORKSPACE_BYTES = 16 << 20      # gathered K+V of one slice of a group (16-32 MiB best of 8..1024 MiB here)


class _SdpaGroup:
    """Sub-requests attended by one SDPA call. n members, padded to max_q rows and nb blocks.

    Padding reads real pool blocks: a member's keys past its kv_len (the rest of its last block, and
    whole padding blocks, which repeat its first block) are masked out, and zeroed in the workspace
    first: they may hold anything (fresh device memory, NaN) and SDPA adds the mask to q.k."""

    def __init__(self, batch: PagedBatch, members: list[int], block_size: int, table: torch.Tensor):
        cu_q, kv_len = batch.host
        self.device = batch.cu_q.device
        self.n = len(members)
        self.max_q = max(cu_q[i + 1] - cu_q[i] for i in members)
        self.nb = max(-(-kv_len[i] // block_size) for i in members)
        self.length = self.nb * block_size                     # L: padded context length
        blocks, cells, q_rows, out_src, out_rows, tails = [], [], [], [], [], []
        self.tail_start = [0]                                  # member j's tail rows: tails[tail_start[j]:..[j+1]]
        width = table.shape[1]
        for j, i in enumerate(members):
            need = -(-kv_len[i] // block_size)
            row = table[i, :need].tolist()
            blocks += row + [row[0]] * (self.nb - need)
            cells += [i * width + c for c in range(need)] + [i * width] * (self.nb - need)
            a, b = cu_q[i], cu_q[i + 1]
            q_rows += list(range(a, b)) + [a] * (self.max_q - (b - a))
            out_src += range(j * self.max_q, j * self.max_q + b - a)
            out_rows += range(a, b)
            tails += range(j * self.length + kv_len[i], (j + 1) * self.length)
            self.tail_start.append(len(tails))
        as_long = lambda xs: torch.tensor(xs, dtype=torch.long, device=self.device)
        self.blocks = as_long(blocks)                          # [n * nb] pool block ids
        self.cells = torch.tensor(cells, dtype=torch.long)     # [n * nb] flat (sub-request, table column), CPU
        self.q_rows = as_long(q_rows)                          # [n * max_q] packed query rows (padded)
        self.out_src = as_long(out_src)                        # [R] rows of the flattened [n * max_q] output
        self.out_rows = as_long(out_rows)                      # [R] their packed rows
        self.tails = as_long(tails)                            # rows of the [n * L] keys past each kv_len
        self.dense = q_rows == list(range(len(q_rows)))          # no padded query row, members' rows in order
        self._slice_tails: dict[tuple[int, int], torch.Tensor] = {}
        self._halves: dict[tuple[int, int], torch.Tensor] = {}
        self._kv_tails: dict[tuple[int, int], torch.Tensor] = {}
        # absolute position of every padded query row; padded rows get -1 (they see nothing)
        pos = torch.full((self.n * self.max_q,), -1, dtype=torch.long, device=self.device)
        pos[self.out_src] = batch.q_pos[self.out_rows].long()
        self.pos = pos.view(self.n, 1, self.max_q, 1)
        self._masks: dict[tuple, torch.Tensor] = {}
        self._rows: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def mask(self, window: int | None, groups: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """[n, 1, groups * max_q, L] bool, rows ordered (query head in its KV group, row); cached. With `dtype`:
        the additive form SDPA makes of the bool mask (0 where True, -inf where False), cached too, so no layer
        converts it again."""
        if (window, groups, None) not in self._masks:
            keys = torch.arange(self.length, device=self.device)
            m = keys <= self.pos
            if window is not None:
                m &= keys > self.pos - window
            self._masks[window, groups, None] = m.repeat(1, 1, groups, 1)
        if (window, groups, dtype) not in self._masks:
            m = self._masks[window, groups, None]
            self._masks[window, groups, dtype] = torch.zeros_like(m, dtype=dtype).masked_fill_(~m, float("-inf"))
        return self._masks[window, groups, dtype]

    def tails_of(self, a: int, b: int) -> torch.Tensor:
        """Rows of the [(b - a) * L] workspace keys of members a..b-1 that lie past their kv_len."""
        if (a, b) not in self._slice_tails:
            self._slice_tails[a, b] = self.tails[self.tail_start[a]: self.tail_start[b]] - a * self.length
        return self._slice_tails[a, b]

    def halves_of(self, a: int, b: int) -> torch.Tensor:
        """[2 * (b - a) * nb] rows of the interleaved caches (`interleaved`) to gather for members a..b-1: their
        blocks' K halves (2 * block), then their V halves (2 * block + 1); cached."""
        if (a, b) not in self._halves:
            blocks = self.blocks[a * self.nb: b * self.nb]
            self._halves[a, b] = torch.cat((2 * blocks, 2 * blocks + 1))
        return self._halves[a, b]

    def kv_tails_of(self, a: int, b: int) -> torch.Tensor:
        """`tails_of(a, b)` in the [2 * (b - a) * L] rows of a K-then-V workspace: K's, then V's; cached."""
        if (a, b) not in self._kv_tails:
            t = self.tails_of(a, b)
            self._kv_tails[a, b] = torch.cat((t, t + (b - a) * self.length))
        return self._kv_tails[a, b]

    def rows(self, hq: int, hkv: int, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat row indices for query heads folded into rows, cached per head geometry:
        src [n * Hkv * rep * max_q] rows of the packed [T * Hq, D] query, in [n, Hkv, rep, max_q] order;
        dst, same length, the row of the [T * Hq + 1, D] output each result goes to (the extra last
        row takes the results of padded query rows)."""
        if (hq, hkv) not in self._rows:
            rep = hq // hkv
            head = torch.arange(hq, device=self.device).view(1, hkv, rep, 1)          # h = kv * rep + g
            q = self.q_rows.view(self.n, 1, 1, self.max_q) * hq + head                # [n, Hkv, rep, max_q]
            dst = torch.full((self.n * self.max_q,), -1, dtype=torch.long, device=self.device)
            dst[self.out_src] = self.out_rows
            dst = dst.view(self.n, 1, 1, self.max_q) * hq + head
            dst = torch.where(dst >= 0, dst, num_tokens * hq)
            self._rows[hq, hkv] = q.flatten(), dst.flatten()
        return self._rows[hq, hkv]


class TorchPlan:
    """Per-step state of the batched torch path; reuse it for every layer of the step."""

    def __init__(self, batch: PagedBatch, block_size: int, members: Sequence[int] | None = None):
        # members: the sub-requests attended (None: all); the others' rows of the output are zero
        cu_q, kv_len = batch.host
        self.batch, self.block_size = batch, block_size
        live = [i for i in (range(batch.num_seqs) if members is None else members) if cu_q[i + 1] > cu_q[i]]
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
        # within a group, members in packed order: SDPA treats each batch element alone, so the order changes no
        # value, and a group of every row in order (a decode step's one group) needs no gather of its queries
        self.groups = [_SdpaGroup(batch, sorted(g), block_size, table) for g in groups]
        g0 = self.groups[0] if len(self.groups) == 1 else None
        self.in_place = g0 is not None and g0.dense and g0.n * g0.max_q == batch.num_tokens
        self._work: dict[tuple, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._overlays: dict[int, tuple] = {}     # id(overlay.table) -> (table, per group, per slice: rows, ids)

    def _overlay_rows(self, overlay, work) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
        """Per group, per slice of m members: (workspace block rows, source block ids) the overlay
        replaces. Made once per overlay table (layers with the same residency share one)."""
        key = id(overlay.table)
        if key not in self._overlays:
            flat = overlay.table.cpu().reshape(-1).long()
            if flat.numel() and int(flat.max()) >= overlay.key.shape[0]:
                raise ValueError(f"overlay names block {int(flat.max())} of a source with {overlay.key.shape[0]}")
            device = overlay.key.device
            per_group = []
            for g, (m, *_) in zip(self.groups, work):
                src = flat[g.cells]                                        # [n * nb] source id or -1
                rows = (src >= 0).nonzero().squeeze(1)
                ids = src[rows]
                slices = []
                for a in range(0, g.n, m):
                    lo, hi = a * g.nb, min(a + m, g.n) * g.nb
                    sel = (rows >= lo) & (rows < hi)
                    slices.append(((rows[sel] - lo).to(device), ids[sel].to(device)))
                per_group.append(slices)
            self._overlays[key] = (overlay.table, per_group)    # keeps the table alive: its id stays unique
        return self._overlays[key][1]

    def _workspace(self, key_cache: torch.Tensor) -> list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Per group: members per slice m, and K, V buffers [m * nb, block_size, Hkv, D], the two halves of one
        [2 * m * nb, ...] buffer (the third), made once per step."""
        key = (key_cache.dtype, key_cache.device, tuple(key_cache.shape[1:]))
        if key not in self._work:
            block_bytes = 2 * key_cache[0].numel() * key_cache.element_size()
            self._work[key] = []
            for g in self.groups:
                m = max(1, min(g.n, WORKSPACE_BYTES // (g.nb * block_bytes)))
                kv = key_cache.new_empty((2 * m * g.nb, *key_cache.shape[1:]))
                self._work[key].append((m, kv[: m * g.nb], kv[m * g.nb:], kv))
        return self._work[key]

    def run(self, query, key_cache, value_cache, scale: float, window: int | None = None,
            softcap: float | None = None, overlay=None) -> torch.Tensor:
        # query [T, Hq, D]; caches [num_blocks, block_size, Hkv, D] (strided views are fine)
        # overlay: kernels.Overlay, blocks of this layer read from overlay.key/value instead of the caches
        t, hq, d = query.shape
        hkv = key_cache.shape[2]
        rep = hq // hkv                   # query heads per KV head; head h reads KV head h // rep
        work = self._workspace(key_cache)
        halves = interleaved(key_cache, value_cache)
        if self.in_place and overlay is None and work[0][0] == self.groups[0].n:
            return self._run_in_place(query, key_cache, value_cache, scale, window, softcap, work[0], halves)
        q_flat = query.reshape(t * hq, d)
        out = query.new_zeros(t * hq + 1, d)
        over = self._overlay_rows(overlay, work) if overlay is not None else [None] * len(self.groups)
        for g, (m, kbuf, vbuf, kvbuf), ov in zip(self.groups, work, over):
            src, dst = g.rows(hq, hkv, t)
            q = q_flat.index_select(0, src).view(g.n, hkv, rep * g.max_q, d)
            mask = g.mask(window, rep, None if softcap is not None else query.dtype)
            if m == g.n:                  # one slice: SDPA's output is the group's
                o = self._attend(g, 0, g.n, q, mask, key_cache, value_cache, kbuf, vbuf, scale, softcap,
                                 ov and (overlay, *ov[0]), halves, kvbuf)
            else:
                o = torch.empty_like(q)
                for a in range(0, g.n, m):
                    b = min(a + m, g.n)
                    o[a:b] = self._attend(g, a, b, q[a:b], mask[a:b], key_cache, value_cache, kbuf, vbuf, scale,
                                          softcap, ov and (overlay, *ov[a // m]), halves, kvbuf)
            out.index_copy_(0, dst, o.view(-1, d))
        return out[:-1].view(t, hq, d)

    def _run_in_place(self, query, key_cache, value_cache, scale: float, window: int | None, softcap: float | None,
                      work: tuple[int, torch.Tensor, torch.Tensor, torch.Tensor],
                      halves: torch.Tensor | None = None) -> torch.Tensor:
        """`run` for one group holding every row in packed order, within one slice: its queries are the packed
        rows reshaped (a view when each member has one row, a decode step) and its output the packed output."""
        t, hq, d = query.shape
        hkv = key_cache.shape[2]
        rep = hq // hkv
        g, (_, kbuf, vbuf, kvbuf) = self.groups[0], work      # one slice: run() checked it
        q = query.reshape(g.n, g.max_q, hkv, rep, d).permute(0, 2, 3, 1, 4).reshape(g.n, hkv, rep * g.max_q, d)
        o = self._attend(g, 0, g.n, q, g.mask(window, rep, None if softcap is not None else query.dtype),
                         key_cache, value_cache, kbuf, vbuf, scale, softcap, None, halves, kvbuf)
        return o.view(g.n, hkv, rep, g.max_q, d).permute(0, 3, 1, 2, 4).reshape(t, hq, d)

    @staticmethod
    def _attend(g: _SdpaGroup, a: int, b: int, q, mask, key_cache, value_cache, kbuf, vbuf, scale: float,
                softcap: float | None = None, over: tuple | None = None, halves: torch.Tensor | None = None,
                kvbuf: torch.Tensor | None = None):
        """SDPA of members a..b-1 of group g: [b - a, Hkv, rep * max_q, D]. `over`: (overlay,
        workspace block rows, source block ids) of this slice, read from the overlay's source. `halves`: the
        caches as one [2 * num_blocks, ...] view (`interleaved`), gathered with one copy into `kvbuf`
        (K of the slice's blocks, then V), else K and V are gathered apart into `kbuf`, `vbuf`."""
        hkv, d = key_cache.shape[2:]
        n = (b - a) * g.nb
        if halves is not None and kvbuf is not None:
            both = kvbuf[: 2 * n]
            torch.index_select(halves, 0, g.halves_of(a, b), out=both)
            kb, vb = both[:n], both[n:]
        else:
            both = None
            kb, vb = kbuf[:n], vbuf[:n]
            torch.index_select(key_cache, 0, g.blocks[a * g.nb: b * g.nb], out=kb)
            torch.index_select(value_cache, 0, g.blocks[a * g.nb: b * g.nb], out=vb)
        if over is not None and over[1].numel():      # host-resident blocks of this layer
            overlay, rows, ids = over
            kb.index_copy_(0, rows, overlay.key.index_select(0, ids))
            vb.index_copy_(0, rows, overlay.value.index_select(0, ids))
        if both is not None:
            tails = g.kv_tails_of(a, b)
            if tails.numel():
                both.view(-1, hkv, d).index_fill_(0, tails, 0)
        else:
            tails = g.tails_of(a, b)
            if tails.numel():
                kb.view(-1, hkv, d).index_fill_(0, tails, 0)
                vb.view(-1, hkv, d).index_fill_(0, tails, 0)
        k = kb.view(b - a, g.length, hkv, d).transpose(1, 2)
        v = vb.view(b - a, g.length, hkv, d).transpose(1, 2)
        if softcap is not None:
            return softcapped_attention(q, k, v, mask, scale, softcap)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def interleaved(key_cache: torch.Tensor, value_cache: torch.Tensor) -> torch.Tensor | None:
    """The two caches ([num_blocks, block_size, Hkv, D] each) as one [2 * num_blocks, block_size, Hkv, D] view
    (row 2b: block b's K, 2b + 1: its V) where they are the K and V halves of one layer laid out
    [num_blocks, 2, block_size, Hkv, D] (a `BlockPool`'s), so one gather reads both; else None."""
    block = key_cache[0].numel()
    stride = (block, *key_cache.stride()[1:])
    if (key_cache.stride(0) != 2 * block or value_cache.stride() != key_cache.stride()
            or value_cache.shape != key_cache.shape or stride[1:] != (key_cache.shape[2] * key_cache.shape[3],
                                                                      key_cache.shape[3], 1)
            or value_cache.data_ptr() - key_cache.data_ptr() != block * key_cache.element_size()):
        return None
    return key_cache.as_strided((2 * key_cache.shape[0], *key_cache.shape[1:]), stride)


def softcapped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                         softcap: float) -> torch.Tensor:
    """softmax(mask(c * tanh(q k^T * scale / c))) v, in the order of transformers' eager attention
    (SDPA has no softcap). q [..., Lq, D], k/v [..., Lk, D] with the same leading dims (or broadcastable),
    mask [..., Lq, Lk] bool -> [..., Lq, D]. Rows that see no key give 0 (as the other paths do)."""
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    s = torch.tanh(s / softcap) * softcap
    s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return torch.matmul(p, v)
