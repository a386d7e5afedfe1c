"""`SessionStore(model, ...)`: the store of `stateful_hf.cache`, sized from a transformers model."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import torch

from .cache import DEFAULT_POLICY, POLICY_NAMES, CostProfile, EvictionPolicy, KVSpec, KVStore, make_policy
from .cache.disk.directory import saved_hidden_layers
from .cache.hidden.partition import HiddenCosts, HiddenPlan, min_hidden_layers, plan_layers
from .cache.hidden.states import HiddenSpec
from .cache.hidden.tier import HIDDEN_MODES
from .fingerprint import model_fingerprint
from .hidden_profile import measure_hidden_costs
from .integration import enable
from .kernels import select_backend
from .profile import measure_cost_profile
from .projector import kv_projector
from .stateful_cache import StatefulCache


class SessionStore(KVStore):
    """Session KV for one model. Creating it enables the model (see `stateful_hf.enable`).

    device_capacity / host_capacity / disk_capacity: tokens (int) or sizes ("2GiB"). A host tier
        exists when host_capacity is given; a disk tier when disk_dir is (default capacity 1GiB).
    chunk_size: tokens per chunk, the unit of movement (= the pools' block size).
    policy: "recency_cost" (default: least recently active conversation first, inside it the cheapest
        chunk to recompute first), "return_aware" (expected recompute cost Cost(s, l) * P(returns | idle
        T), P estimated online from observed gaps), "pensieve" (Pensieve's retention value Cost(l) / T),
        "lru", or an EvictionPolicy; see `stateful_hf.cache.policy`.
    cost_profile: Pensieve's Cost(l); measured on the model (once per geometry and device) if None and
        the policy uses it.
    swap_out_threshold: after a turn, chunks move to the host ahead of time while fewer than this
        share of device blocks is free.
    layout: "paged" (a pool of blocks) or "virtual" (vAttention: device_capacity is reserved as
        virtual memory, one contiguous slot of max_context tokens per session on the device, pages
        committed as sessions grow and returned when they leave; dense kernels, no block tables).
    max_context: tokens per slot of the virtual layout (default: the model's max positions).
    keep_freed: virtual layout: freed device pages kept committed for reuse (tokens or a size; zeroed
        when reused; `store.reclaim()` gives them back). map_ahead: virtual layout: a background
        thread maps the block each session grows into next, before the step that needs it.
    attn_backend: "auto" (the first in a fixed order, flashinfer, flash_attn, triton, torch, that serves
        the model's device, dtype, head_dim, chunk_size, layerwise_kv and layout: not measured, see
        docs/gpu.md; each one passed over is logged with its reason), "torch", "triton", "flashinfer"
        or "flash_attn"; resolved once here (`kernels.select_backend`), so a forced one that cannot serve
        this store raises now: ValueError for its dtype, head_dim, chunk_size or features, RuntimeError
        for a missing package or device.
    hidden_states: HCache. "never" (default): K/V only, nothing captured. "always": hidden states are
        captured while tokens are computed and chunks moving down from the device are kept as
        hidden states. "auto": "always" when a layer's hidden state is smaller than its K+V (MHA) and
        the split keeps at least one layer as hidden states, else "never" (GQA keeps K/V; so does a
        planner that finds all-K/V restores fastest, possible with hidden_budget=None).
        `move(sid, chunks, "hidden")` needs a capturing store.
    hidden_layers: layers kept as hidden states (the rest as K/V); None: HCache's planner decides
        from `hidden_costs` (measured on the model if None) under `hidden_budget`.
    hidden_budget: most bytes per token a hidden chunk may store, as a share of its K/V bytes
        (default 0.55; None: fastest restore whatever the size). Where it cannot be met (GQA) it is
        ignored. hidden_capacity: room for hidden chunks (tokens or size; default host_capacity).
        With a disk tier, hidden chunks moving down from the host stay hidden states on disk, in a
        second file of hidden_disk_capacity (default disk_capacity); a store reopened over the same
        disk_dir keeps the split recorded there (unless hidden_layers says otherwise, in which case
        those chunks are recomputed from their token ids). The disk tier records the model's fingerprint
        (config and a sample of the weights) and refuses a disk_dir made for another model; it serves
        a chunk only if its checksum proves it is the chunk it names, else recomputes it
        (docs/durability.md).
    clock: the time source of sessions' last activity (the policy's idle time); default time.monotonic.
    layerwise_kv: LayerKV's layer-wise KV allocation: engine steps may keep only some layers of a
        chunk on the device (blocks shared by residue class) and the others on the host tier, read
        and written there layer by layer. Needs host_capacity, layout "paged", the torch backend and
        hidden_states "never"; `Engine(..., layerwise_kv=True)` makes such a store.
    emulate_async: run every copy to or from the device under the CPU async emulator
        (`stateful_hf/cache/transfer.py`, docs/gpu.md); default: STATEFUL_HF_EMULATE_ASYNC=1 in the environment.
    prefix_sharing: full chunks of identical prefixes (same tenant and cache_salt) are held once and
        reused by every session whose prompt starts with them (docs/prefix-sharing.md). Default (None):
        on where it can be (layout "paged", no layerwise_kv); True where it cannot raises ValueError.
    """

    def __init__(self, model: torch.nn.Module, device_capacity: int | str = 4096, *, chunk_size: int = 32,
                 host_capacity: int | str | None = None, disk_dir: str | os.PathLike | None = None,
                 disk_capacity: int | str | None = None, policy: str | EvictionPolicy = DEFAULT_POLICY,
                 cost_profile: CostProfile | None = None, attn_backend: str = "auto",
                 swap_out_threshold: float = 0.25, hidden_states: str = "never", hidden_layers: int | None = None,
                 hidden_capacity: int | str | None = None, hidden_budget: float | None = 0.55,
                 hidden_costs: HiddenCosts | None = None, layout: str = "paged", max_context: int | None = None,
                 clock: Callable[[], float] = time.monotonic, keep_freed: int | str = "64MiB",
                 map_ahead: bool = True, hidden_disk_capacity: int | str | None = None,
                 layerwise_kv: bool = False, emulate_async: bool | None = None,
                 prefix_sharing: bool | None = None):
        adapter = enable(model)
        param = next(model.parameters())
        spec = KVSpec(adapter.num_layers, adapter.num_kv_heads, adapter.head_dim, dtype=param.dtype,
                      device=param.device, block_size=chunk_size, windows=adapter.layer_windows)
        attn_backend = select_backend(attn_backend, spec.device, spec.dtype, spec.head_dim, spec.block_size,
                                      layerwise_kv=layerwise_kv, layout=layout).name
        if isinstance(policy, str) and policy in POLICY_NAMES:
            policy = make_policy(policy, None if policy == "lru" else cost_profile or measure_cost_profile(model, spec))
        elif not isinstance(policy, EvictionPolicy):
            raise ValueError(f"policy must be one of {POLICY_NAMES} or an EvictionPolicy, got {policy!r}")
        if hidden_states not in HIDDEN_MODES:
            raise ValueError(f"hidden_states must be one of {HIDDEN_MODES}, got {hidden_states!r}")
        kv_per_layer = 2 * adapter.num_kv_heads * adapter.head_dim
        uses_hidden = hidden_states == "always" or (hidden_states == "auto" and adapter.hidden_size < kv_per_layer)
        self.hidden_plan: HiddenPlan | None = None
        hidden_spec = None
        if uses_hidden:
            floor = min_hidden_layers(hidden_budget, adapter.num_layers, adapter.hidden_size, kv_per_layer)
            saved = saved_hidden_layers(disk_dir) if disk_dir is not None and hidden_layers is None else None
            if saved is not None and floor <= saved <= adapter.num_layers:
                hidden_layers = saved             # hidden chunks on disk in this split stay usable
            if hidden_layers is None:
                costs = hidden_costs or measure_hidden_costs(model, adapter, spec)
                self.hidden_plan = plan_layers(costs, adapter.num_layers, complement="kv", min_hidden=floor)
                hidden_layers = self.hidden_plan.hidden_layers
        if uses_hidden and hidden_states == "auto" and hidden_layers == 0:
            uses_hidden = False     # the fastest restore is all K/V: keep K/V, capture nothing
        if uses_hidden:
            hidden_spec = HiddenSpec(spec, adapter.hidden_size, hidden_layers)
        super().__init__(spec, device_capacity, host_capacity=host_capacity, disk_dir=disk_dir,
                         disk_capacity=disk_capacity, policy=policy, attn_backend=attn_backend,
                         swap_out_threshold=swap_out_threshold, hidden_states=hidden_states if uses_hidden else "never",
                         hidden_spec=hidden_spec, hidden_capacity=hidden_capacity,
                         project=kv_projector(model, adapter) if uses_hidden else None, layout=layout,
                         max_context=max_context or adapter.max_positions, clock=clock, keep_freed=keep_freed,
                         map_ahead=map_ahead, hidden_disk_capacity=hidden_disk_capacity,
                         layerwise_kv=layerwise_kv, emulate_async=emulate_async, prefix_sharing=prefix_sharing,
                         disk_fingerprint=model_fingerprint(model) if disk_dir is not None else "")
        self.model = model
        self.adapter = adapter

    def cache(self, session_id: str) -> StatefulCache:
        """A transformers Cache over the session (created empty if new), for generate/forward."""
        self.open(session_id)
        return StatefulCache(self, session_id)
