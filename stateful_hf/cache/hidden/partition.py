"""HCache's bubble-free restoration planner (EuroSys '25, §4.1): which layers of a returning
session come from hidden states and which from a complementary method.

Layer-wise partition. Costs are per layer for the same number of tokens (profiled once per model
and device): IO_H copy one layer's hidden states up, IO_KV copy one layer's K/V up, C_H project
hidden states to K/V, C_Token recompute one layer from tokens.

- Pipelined (a copy engine overlaps compute, CUDA): the paper's closed forms.
  C_H > IO_H (compute-bound), pair with KV offload, first L_H layers hidden, the rest KV:
      L_H = ceil(N * IO_KV / (IO_KV + C_H - IO_H)),  T = max(C_H * L_H, IO_H * L_H + IO_KV * L_O)
  C_H <= IO_H (I/O-bound), pair with token recompute, first L_O layers recomputed:
      L_H = ceil(N * C_Token / (C_Token + IO_H - C_H)),  T = max(C_Token * L_O + C_H * L_H, IO_H * L_H)
- Serial (copies and compute share the same cores, the CPU): nothing overlaps, T is the sum, which
  is linear in L_H: an end point (or the bound) is optimal.

The result is compared with the two pure strategies by predicted time and never predicted slower
than the better of them. `min_hidden` bounds L_H from below (a storage budget, see
`min_hidden_layers`); both objectives are convex in L_H, so clamping keeps the constrained optimum.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class HiddenCosts:
    """Seconds per layer for `tokens` tokens; `overlap`: copies run concurrently with compute."""

    io_hidden: float
    io_kv: float
    c_hidden: float
    c_token: float
    overlap: bool
    tokens: int = 1024

    def __post_init__(self) -> None:
        for name in ("io_hidden", "io_kv", "c_hidden", "c_token"):
            if not getattr(self, name) > 0:
                raise ValueError(f"HiddenCosts.{name} must be positive, got {getattr(self, name)}")


@dataclass(frozen=True, slots=True)
class HiddenPlan:
    hidden_layers: int          # L_H: layers [0, L_H) from hidden states (KV pairing) ...
    other_layers: int           # L_O: ... the rest from the complement
    complement: str             # "kv" (layers after the hidden ones) or "recompute" (layers before them)
    predicted: float            # seconds for `costs.tokens` tokens
    pure_hidden: float          # predicted seconds, every layer from hidden states
    pure_other: float           # predicted seconds, every layer from the complement


def predicted_time(c: HiddenCosts, n_layers: int, l_h: int, complement: str) -> float:
    l_o = n_layers - l_h
    if complement == "kv":
        compute, io = c.c_hidden * l_h, c.io_hidden * l_h + c.io_kv * l_o
    elif complement == "recompute":
        compute, io = c.c_token * l_o + c.c_hidden * l_h, c.io_hidden * l_h
    else:
        raise ValueError(f"complement must be 'kv' or 'recompute', got {complement!r}")
    return max(compute, io) if c.overlap else compute + io


def plan_layers(c: HiddenCosts, n_layers: int, *, complement: str | None = None, min_hidden: int = 0) -> HiddenPlan:
    """The split of `n_layers`; `complement` forces the pairing (None: the paper's rule)."""
    if n_layers <= 0 or not 0 <= min_hidden <= n_layers:
        raise ValueError(f"need n_layers > 0 and 0 <= min_hidden <= n_layers, got {n_layers}, {min_hidden}")
    if complement is None:
        complement = "kv" if c.c_hidden > c.io_hidden else "recompute"
    if c.overlap:
        if complement == "kv":
            l_h = math.ceil(n_layers * c.io_kv / max(c.io_kv + c.c_hidden - c.io_hidden, 1e-30))
        else:
            l_h = math.ceil(n_layers * c.c_token / max(c.c_token + c.io_hidden - c.c_hidden, 1e-30))
        candidates = [min(max(l_h, 0), n_layers)]
    else:
        candidates = []
    candidates += [0, n_layers]
    candidates = [max(x, min_hidden) for x in candidates]
    t = {x: predicted_time(c, n_layers, x, complement) for x in candidates}
    best = min(candidates, key=lambda x: (t[x], -x))    # ties: more hidden layers (less storage)
    return HiddenPlan(best, n_layers - best, complement, t[best],
                      predicted_time(c, n_layers, n_layers, complement), predicted_time(c, n_layers, 0, complement))


def min_hidden_layers(budget: float | None, n_layers: int, hidden_size: int, kv_per_layer: int) -> int:
    """Fewest hidden layers (KV pairing) so that stored values per token <= budget x the K/V values
    (kv_per_layer = 2 * kv_heads * head_dim). 0 when there is no budget or it cannot be met (GQA:
    hidden states are not smaller than K/V there)."""
    if budget is None or hidden_size >= kv_per_layer:
        return 0
    # (l_h * D + (N - l_h) * kv) <= budget * N * kv  <=>  l_h >= N * kv * (1 - budget) / (kv - D)
    need = math.ceil(n_layers * kv_per_layer * (1 - budget) / (kv_per_layer - hidden_size) - 1e-9)
    return min(max(need, 0), n_layers)
