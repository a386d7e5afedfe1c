"""`SessionStore(model, ...)`: the store of `stateful_hf.cache`, sized from a transformers model."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..cache import DEFAULT_POLICY, POLICY_NAMES, EvictionPolicy, KVSpec, KVStore, make_policy
from ..cache.disk.directory import saved_hidden_layers
from ..cache.hidden.partition import HiddenPlan, min_hidden_layers, plan_layers
from ..cache.hidden.states import HiddenSpec
from ..fingerprint import model_fingerprint
from ..kernels import select_backend
from ..kernels.quantization import Quantization
from ..kernels.quantization import detect as detect_quantization
from ..kernels.step_backends import measure as measure_step_backends
from ..options import HiddenStates, Layout, SessionStoreKwargs, SessionStoreOptions, StoreOptions, TokensOrSize, Unpack
from ..profile.cost import measure_cost_profile, measure_offload_bandwidth
from ..profile.hidden import measure_hidden_costs
from .hooks import enable
from .projector import kv_projector
from .stateful_cache import StatefulCache


class SessionStore(KVStore):
    """Session KV for one model. Creating it enables the model (`stateful_hf.enable`).

    `device_capacity`: tokens (an int) or a size ("2GiB"). The options are `SessionStoreOptions`'
    fields, each declared once with its default and a one-line doc (`stateful_hf/options/store.py`;
    docs/store.md): an unknown one raises TypeError naming the closest valid ones, a bad value
    ValueError naming it, before the model is touched. What the store reads from the model: its KV
    geometry, windows and max positions, Pensieve's Cost(l) (measured once per geometry and device
    when a named policy uses it and no `cost_profile` is given) and HCache's layer split (measured,
    unless `hidden_layers` or a disk_dir's recorded split says it)."""

    def __init__(self, model: torch.nn.Module, device_capacity: TokensOrSize = 4096,
                 **options: Unpack[SessionStoreKwargs]):
        o = SessionStoreOptions.build(device_capacity=device_capacity, **options)
        adapter = enable(model)
        param = next(model.parameters())
        spec = KVSpec(adapter.num_layers, adapter.num_kv_heads, adapter.head_dim, dtype=param.dtype,
                      device=param.device, block_size=o.chunk_size, windows=adapter.layer_windows)
        if o.batch_invariant:
            check_invariant(adapter, spec)
        quantization = detect_quantization(model)
        off = "batch_invariant=False" if o.batch_invariant is False else None if o.batch_invariant else \
            invariant_off(adapter, spec, o, quantization)
        if off is None:
            from ..kernels.invariance import pack_weights
            pack_weights(model)
        attn_backend = select_backend("cpu" if off is None else o.attn_backend, spec.device, spec.dtype,
                                      spec.head_dim, spec.block_size, layerwise_kv=o.layerwise_kv, layout=o.layout).name
        backends = None
        if off is not None and o.attn_backend == "auto" and spec.device.type == "cpu" and not o.layerwise_kv \
                and o.layout is Layout.PAGED:   # per step, the C++ kernel where it measured faster
            backends = measure_step_backends(adapter.num_heads, adapter.num_kv_heads, adapter.head_dim,
                                             spec.block_size, spec.dtype, adapter.num_layers, torch.get_num_threads())
            attn_backend = backends.long
        policy = DEFAULT_POLICY if o.policy is None else o.policy
        if isinstance(policy, str) and policy in POLICY_NAMES:
            profile = None if policy == "lru" else o.cost_profile or measure_cost_profile(model, spec)
            policy = make_policy(policy, profile)
        elif not isinstance(policy, EvictionPolicy):
            raise ValueError(f"policy must be one of {POLICY_NAMES} or an EvictionPolicy, got {policy!r}")
        kv_per_layer = 2 * adapter.num_kv_heads * adapter.head_dim
        uses_hidden = o.hidden_states is HiddenStates.ALWAYS or (o.hidden_states is HiddenStates.AUTO
                                                                and adapter.hidden_size < kv_per_layer)
        self.hidden_plan: HiddenPlan | None = None
        hidden_spec, hidden_layers = None, o.hidden_layers
        if uses_hidden:
            floor = min_hidden_layers(o.hidden_budget, adapter.num_layers, adapter.hidden_size, kv_per_layer)
            saved = saved_hidden_layers(o.disk_dir) if o.disk_dir is not None and hidden_layers is None else None
            if saved is not None and floor <= saved <= adapter.num_layers:
                hidden_layers = saved             # hidden chunks on disk in this split stay usable
            if hidden_layers is None:
                costs = o.hidden_costs or measure_hidden_costs(model, adapter, spec)
                self.hidden_plan = plan_layers(costs, adapter.num_layers, complement="kv", min_hidden=floor)
                hidden_layers = self.hidden_plan.hidden_layers
        if uses_hidden and o.hidden_states is HiddenStates.AUTO and hidden_layers == 0:
            uses_hidden = False     # the fastest restore is all K/V: keep K/V, capture nothing
        if uses_hidden:
            hidden_spec = HiddenSpec(spec, adapter.hidden_size, hidden_layers)
        shared = {name: getattr(o, name) for name in StoreOptions.names() if name != "device_capacity"}
        shared.update(policy=policy, attn_backend=attn_backend, step_backends=backends,
                      hidden_states=o.hidden_states if uses_hidden else HiddenStates.NEVER,
                      max_context=o.max_context or adapter.max_positions)
        super().__init__(spec, o.device_capacity, **shared, hidden_spec=hidden_spec,
                         project=kv_projector(model, adapter) if uses_hidden else None,
                         disk_fingerprint=model_fingerprint(model) if o.disk_dir is not None else "")
        self.options = o
        self.model = model
        self.adapter = adapter
        # the split of batch_invariant() every forward of this store's turns runs under; None: not invariant
        self.invariant_split: int | None = o.chunk_size if off is None else None
        self.invariant_off: str | None = off      # why the store is not batch-invariant; None: it is
        self.quantization: Quantization | None = quantization   # the model's quantized weights; None: plain

    def cache(self, session_id: str) -> StatefulCache:
        """A transformers Cache over the session (created empty if new), for generate/forward."""
        self.open(session_id)
        return StatefulCache(self, session_id)

    def offload_bandwidth(self) -> float:
        """Bytes per second of one layer's device blocks copied to host memory (LayerKV's BW; measured once
        per device, dtype and geometry, memoized)."""
        return measure_offload_bandwidth(self.tiers.device)


def invariant_off(adapter, spec: KVSpec, o: SessionStoreOptions,
                  quantization: Quantization | None = None) -> str | None:
    """batch_invariant=None: why this store is not batch-invariant (it is then off), None: it is. A model whose
    activations are quantized per row at run time is treated as bf16 is: a 1-ulp difference in a row's
    input moves its rounding, so stock kernels do not give stateless generate's tokens."""
    if spec.dtype not in (torch.bfloat16, torch.float16) and not (quantization and quantization.dynamic_activations):
        return f"{str(spec.dtype).removeprefix('torch.')}: stock kernels already give stateless generate's tokens " \
               "(on by default in bfloat16 and float16 and with int8 activations; batch_invariant=True for " \
               "bitwise logits)"
    try:
        check_invariant(adapter, spec)
    except ValueError as e:
        return str(e)
    if o.layerwise_kv or o.layout is not Layout.PAGED or o.attn_backend not in ("auto", "cpu"):
        return f"layout={o.layout.value!r}, layerwise_kv={o.layerwise_kv}, attn_backend={o.attn_backend!r}: " \
               "batch invariance needs the 'cpu' attention kernel over a paged pool"
    try:
        select_backend("cpu", spec.device, spec.dtype, spec.head_dim, spec.block_size)
    except (ValueError, RuntimeError) as e:
        return f"the 'cpu' attention kernel cannot serve this store: {e}"
    return None


def check_invariant(adapter, spec: KVSpec) -> None:
    """batch_invariant=True: ValueError naming what is supported where the store could not keep it."""
    if spec.device.type != "cpu":
        raise ValueError(f"batch_invariant=True is implemented on the CPU (invariant GEMM, norms and attention); "
                         f"the model is on {spec.device}")
    if any(w is not None for w in adapter.layer_windows) or adapter.final_softcap is not None:
        raise ValueError("batch_invariant=True supports full causal attention without softcaps (Llama, Qwen, "
                         "Phi-3, OPT...); this model has sliding windows or attention softcaps")


if TYPE_CHECKING:     # mypy: a SessionStore keeps every consumer's door (each imports only its own)
    from ..cache.doors.demo import DemoStore
    from ..cache.doors.engine import EngineStore
    from ..cache.doors.migration import MigrationStore
    from ..cache.doors.seam import SeamStore
    from ..cache.doors.server import ServerStore

    def keeps_the_doors(s: SessionStore) -> tuple[EngineStore, SeamStore, ServerStore, MigrationStore, DemoStore]:
        return s, s, s, s, s
