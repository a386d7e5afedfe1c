"""`SessionStore(model, ...)`: the store of `stateful_hf.cache`, sized from a transformers model."""

from __future__ import annotations

import os

import torch

from .cache import CostProfile, EvictionPolicy, KVSpec, LRUPolicy, RetentionPolicy
from .cache import SessionStore as _TensorStore
from .integration import enable
from .kernels import resolve_backend
from .profile import measure_cost_profile
from .stateful_cache import StatefulCache


class SessionStore(_TensorStore):
    """Session KV for one model. Creating it enables the model (see `stateful_hf.enable`).

    device_capacity / host_capacity / disk_capacity: tokens (int) or sizes ("2GiB"). A host tier
        exists when host_capacity is given; a disk tier when disk_dir is (default capacity 1GiB).
    chunk_size: tokens per chunk, the unit of movement (= the pools' block size).
    policy: "pensieve" (retention value Cost(l) / T_idle), "lru", or an EvictionPolicy.
    cost_profile: Pensieve's Cost(l); measured on the model (once per geometry and device) if None.
    swap_out_threshold: after a turn, chunks move to the host ahead of time while fewer than this
        share of device blocks is free.
    attn_backend: "auto" (the fastest available for the model's device and dtype), "torch",
        "triton", "flashinfer" or "flash_attn"; resolved once here, so a missing one fails now.
    """

    def __init__(self, model: torch.nn.Module, device_capacity: int | str = 4096, *, chunk_size: int = 32,
                 host_capacity: int | str | None = None, disk_dir: str | os.PathLike | None = None,
                 disk_capacity: int | str | None = None, policy: str | EvictionPolicy = "pensieve",
                 cost_profile: CostProfile | None = None, attn_backend: str = "auto",
                 swap_out_threshold: float = 0.25):
        adapter = enable(model)
        param = next(model.parameters())
        spec = KVSpec(adapter.num_layers, adapter.num_kv_heads, adapter.head_dim, dtype=param.dtype,
                      device=param.device, block_size=chunk_size, window=adapter.window)
        attn_backend = resolve_backend(attn_backend, spec.device, spec.dtype)
        if policy == "pensieve":
            policy = RetentionPolicy(cost_profile or measure_cost_profile(model, spec))
        elif policy == "lru":
            policy = LRUPolicy()
        elif not isinstance(policy, EvictionPolicy):
            raise ValueError(f"policy must be 'pensieve', 'lru' or an EvictionPolicy, got {policy!r}")
        super().__init__(spec, device_capacity, host_capacity=host_capacity, disk_dir=disk_dir,
                         disk_capacity=disk_capacity, policy=policy, attn_backend=attn_backend,
                         swap_out_threshold=swap_out_threshold)
        self.model = model
        self.adapter = adapter

    def cache(self, session_id: str) -> StatefulCache:
        """A transformers Cache over the session (created empty if new), for generate/forward."""
        self.open(session_id)
        return StatefulCache(self, session_id)
