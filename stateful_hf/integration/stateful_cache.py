"""`StatefulCache`: a transformers `Cache` that is a view of one session of a store.

The K/V themselves never pass through `update`: the registered attention has the step write them
into the session's blocks (one `StepBatch` per forward, planned by the store and made the thread's
current step by the model's hooks: docs/step.md). The cache answers the questions transformers asks
(`get_seq_length`, mask sizes) and carries the step in flight (`pending`). It needs only the
model-free store (`cache.KVStore`); `SessionStore.cache(sid)` is how one is made for a model.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from ..cache.doors.seam import SeamStore, StepBatch


class StatefulCache(Cache):
    """Batch size 1, one session. `get_seq_length()` is the session's logical length, including
    tokens whose KV still has to be restored, so `generate` feeds only the new tokens."""

    def __init__(self, store: SeamStore, session_id: str):
        super().__init__(layers=[])
        self.store = store
        self.session_id = session_id
        self.pending: StepBatch | None = None   # planned step whose forward has not returned yet

    def __repr__(self) -> str:
        return f"StatefulCache(session_id={self.session_id!r}, tokens={self.get_seq_length()})"

    def get_seq_length(self, layer_idx: int = 0) -> int:
        pending = len(self.pending.input_ids[0]) if self.pending is not None else 0
        return self.store.num_tokens(self.session_id) - pending

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        # The mask transformers builds is unused on a paged step (the kernel masks by position).
        return query_length, 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if self.pending is None:
            raise RuntimeError("StatefulCache.update outside a stateful step: the model is not enabled "
                               "(stateful_hf.enable(model)) or its attention implementation was changed")
        return key_states, value_states

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def batch_size(self) -> int:
        return 1

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove < 0:
            tokens_to_remove = self.get_seq_length() + tokens_to_remove
        self.store.truncate(self.session_id, max(self.get_seq_length() - tokens_to_remove, 0))

    def reset(self) -> None:
        self.store.truncate(self.session_id, 0)

    def _one_sequence_only(self, *args, **kwargs):
        raise NotImplementedError("a StatefulCache holds one sequence: beam search and num_return_sequences > 1 "
                                  "are not supported; use stateful_hf.Engine for many sessions")

    reorder_cache = batch_repeat_interleave = batch_select_indices = _one_sequence_only
