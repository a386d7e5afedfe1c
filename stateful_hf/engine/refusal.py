"""Refusal at submit: a request that can never fit is failed before it takes anything; the
CapacityErrors the scheduler fails a request with when the pools are taken by others.

"Never fits" is decided from the pool sizes alone (not from what other sessions hold now, which
changes), for the request's least footprint:
    tokens = len(prompt) + min(max_new_tokens - 1, block_size)   (the prompt and one block of decode)
    chunks = ceil(tokens / block_size)
Without layer-wise allocation every chunk needs a device block with all layers: refused iff
chunks > device blocks. With it (LayerKV) the chunks the turn adds (`new`, past the history it
shares with the session) may keep only some layers on the device, every layer they do not keep in a
host slot; history on the host is read in place. Refused iff even the sparsest keep factor allowed
by x_min does not fit:
    new > host blocks, or residue_blocks(f_max, new) > device blocks, or
    chunks > host blocks + device blocks - residue_blocks(f_max, new)
(f_max: the keep factor with the fewest layers on the device and >= x_min of them; 0 when x_min = 0.)
Everything that passes may still wait for room; it is served once the pool is free enough.
"""

from __future__ import annotations

from ..cache import CapacityError
from .layer_offload import LayerwisePolicy, residue_blocks
from .request import Request


def least_chunks(r: Request, block_size: int) -> int:
    """Chunks the request needs at the least: its prompt and up to one block of decode."""
    tokens = len(r.prompt) + min(r.sampling.max_new_tokens - 1, block_size)
    return -(-tokens // block_size)


def refusal(store, layerwise: LayerwisePolicy | None, r: Request) -> CapacityError | None:
    """The CapacityError to fail `r` with at submit, or None if some state of the pools serves it."""
    bs, device = store.block_size, store.device_pool.num_blocks
    chunks = least_chunks(r, bs)
    if chunks <= device:
        return None
    what = (f"request {r.request_id} (session {r.session_id!r}) can never fit: its {len(r.prompt)} prompt tokens "
            f"and one block of decode need {chunks} chunks of {bs} tokens")
    if layerwise is None:
        return CapacityError(
            f"{what} with all layers on the device, and the device pool holds {device} ({device * bs} tokens). "
            f"Raise device_capacity, or serve it with layerwise_kv=True (layer-wise KV: the layers that do not "
            f"fit live on the host tier; host_capacity of at least {chunks * bs} tokens)")
    host = store.host_pool.num_blocks
    keep = 0
    if r.session_id in store:            # the history the turn shares: already on some tier
        keep = min(store.match_prefix(r.session_id, r.prompt), len(r.prompt) - 1)
    new = chunks - -(-keep // bs)
    x_min = layerwise.x_min(len(r.prompt) - keep, keep)
    sparsest = layerwise.factors(x_min)[-1]
    on_device = residue_blocks(sparsest, new)
    if new <= host and on_device <= device and chunks <= host + device - on_device:
        return None
    kept = layerwise.num_layers if sparsest == 1 else (0 if sparsest == 0 else layerwise.num_layers // sparsest)
    return CapacityError(
        f"{what}, {new} of them new, even with layer-wise KV: keeping {kept} of {layerwise.num_layers} layers on "
        f"the device (x_min = {x_min}) takes {on_device} of the {device} device blocks, and the rest needs host "
        f"slots ({host} in the host pool). Raise device_capacity or host_capacity")


# ---- failures while scheduling (the pools are taken by others and nothing more can be freed) ----

def no_device_room(r: Request, need: int, avail: int, block_size: int, layerwise: bool, more: bool) -> CapacityError:
    """`r` needs `need` (`more`: further) device blocks and only `avail` can be made available."""
    hint = "" if layerwise else (
        ", or serve it with layerwise_kv=True (layers that do not fit on the device live on the host tier)")
    return CapacityError(f"request {r.request_id} (session {r.session_id!r}) needs {need} {'more ' if more else ''}"
                         f"device blocks of {block_size} tokens and only {avail} can be made available; raise "
                         "device_capacity" + hint)


def no_host_slots(r: Request) -> CapacityError:
    return CapacityError(
        f"request {r.request_id} (session {r.session_id!r}) needs host slots for its layer-wise KV and the "
        "host tier has none left for it (the other running requests hold them); raise host_capacity")


def no_layered_fit(r: Request, host_avail: int) -> CapacityError:
    return CapacityError(
        f"request {r.request_id} (session {r.session_id!r}) does not fit even with layer-wise KV allocation: its "
        f"prompt needs more host slots ({host_avail} available) or more device blocks for its x_min kept layers "
        "than can be made available; raise host_capacity or device_capacity")
