"""The one writer of computed K/V: every K/V row that a forward computes or a restore rebuilds
enters a pool layer through `write_kv`, and through nothing else.

Its callers, all within one step (docs/step.md):
- the step's own rows, from the registered attention through `StepBatch.write_rows`: at the rows'
  device slots, or where LayerKV's placement puts each layer of their chunk (`layerwise/step.py`:
  device blocks, the host pool in place, a staged buffer, the host rows written down at commit);
- HCache's layer-wise restore (`HiddenRestore`, `hidden/states.py`): the K/V of the context's hidden
  chunks, projected from hidden states or read from the chunk's K/V layers, as whole device blocks.

Not through here: moving whole blocks between tiers (swap-in, swap-out, disk reads and writes).
Those are block copies of K/V already written, owned by the transfer engine (`transfer.py`: one
`Copy` per group of blocks with one event per layer; `before_layer` waits on the events of its
layer before anything reads those blocks) and by the tier moves that call it.
"""

from __future__ import annotations

import torch


def write_kv(
    key_cache: torch.Tensor,    # [num_blocks, block_size, Hkv, D] one layer of a pool (a view of it)
    value_cache: torch.Tensor,
    key: torch.Tensor,          # rows [T, Hkv, D], or whole blocks [n, block_size, Hkv, D]
    value: torch.Tensor,
    slots: torch.Tensor,        # rows: [T] block * block_size + offset; blocks: [n] block ids. Long, caches' device
) -> None:
    """Store K/V in one pool layer: row t at slot `slots[t]` (vLLM's reshape_and_cache), or, given
    whole blocks, block i at block `slots[i]` (a restore: one copy per block instead of per row).
    Mutates the two caches only. The cache keeps values in its own dtype, not autograd history:
    gradients never flow into stored KV."""
    key, value = key.detach().to(key_cache.dtype), value.detach().to(value_cache.dtype)
    if key.dim() == 4:
        key_cache.index_copy_(0, slots, key)
        value_cache.index_copy_(0, slots, value)
        return
    block_size = key_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    key_cache[blocks, offsets] = key
    value_cache[blocks, offsets] = value
