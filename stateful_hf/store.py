"""`SessionStore(model, ...)`: the store of `stateful_hf.cache`, sized from a transformers model."""

from __future__ import annotations

import torch

from .cache import EvictionPolicy, KVSpec
from .cache import SessionStore as _TensorStore
from .integration import enable
from .stateful_cache import StatefulCache


class SessionStore(_TensorStore):
    """Session KV for one model. Creating it enables the model (see `stateful_hf.enable`).

    device_capacity: tokens (int) or a size ("2GiB") of the device pool.
    chunk_size: tokens per chunk, the unit of eviction (= the pool's block size).
    """

    def __init__(self, model: torch.nn.Module, device_capacity: int | str = 4096, *, chunk_size: int = 32,
                 policy: EvictionPolicy | None = None, attn_backend: str = "torch"):
        adapter = enable(model)
        param = next(model.parameters())
        spec = KVSpec(adapter.num_layers, adapter.num_kv_heads, adapter.head_dim, dtype=param.dtype,
                      device=param.device, block_size=chunk_size, window=adapter.window)
        super().__init__(spec, device_capacity, policy=policy, attn_backend=attn_backend)
        self.model = model
        self.adapter = adapter

    def cache(self, session_id: str) -> StatefulCache:
        """A transformers Cache over the session (created empty if new), for generate/forward."""
        self.open(session_id)
        return StatefulCache(self, session_id)
