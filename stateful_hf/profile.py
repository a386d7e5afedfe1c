"""Pensieve's Cost(l): the time to recompute one chunk attending to l tokens, measured once per model
geometry and device at powers of two of l (then interpolated by `CostProfile`)."""

from __future__ import annotations

import hashlib
import json
import time

import torch

from .cache import CostProfile, KVSpec
from .cache import SessionStore as TensorStore
from .integration import run_step

_MEASURED: dict[str, CostProfile] = {}   # memo per model geometry and device, for this process


def _key(model: torch.nn.Module, spec: KVSpec) -> str:
    config = json.dumps(model.config.to_dict(), sort_keys=True, default=str)
    return hashlib.sha1(f"{config}|{spec.device}|{spec.dtype}|{spec.block_size}".encode()).hexdigest()


@torch.inference_mode()
def measure_cost_profile(model: torch.nn.Module, spec: KVSpec, max_length: int = 4096,
                         repeats: int = 3) -> CostProfile:
    """Time one chunk's forward at contexts 32, 64, ... up to `max_length` (capped by the model's
    positions); the median of `repeats` runs per point. Memoized per model geometry and device."""
    key = _key(model, spec)
    if key in _MEASURED:
        return _MEASURED[key]
    chunk = spec.block_size
    limit = min(max_length, model.config.max_position_embeddings - chunk)
    lengths = [chunk]
    while lengths[-1] * 2 <= limit:
        lengths.append(lengths[-1] * 2)
    store = TensorStore(spec, lengths[-1] + chunk, swap_out_threshold=0.0)
    ids = torch.randint(0, model.get_input_embeddings().num_embeddings, (lengths[-1] + chunk,)).tolist()
    store.open("p")
    warm = store.plan_step([("p", ids[:chunk], range(chunk))])
    run_step(model, warm)   # first calls allocate and dispatch: keep them out of the timings
    store.abort(warm)
    seconds, done = [], 0
    for n in lengths:
        if n - chunk > done:   # grow the context to n - chunk tokens (not timed)
            step = store.plan_step([("p", ids[done:n - chunk], range(done, n - chunk))])
            run_step(model, step)
            store.commit(step)
            done = n - chunk
        runs = []
        for _ in range(repeats):
            step = store.plan_step([("p", ids[done:n], range(done, n))])
            t0 = time.perf_counter()
            run_step(model, step)
            if spec.device.type == "cuda":
                torch.cuda.synchronize(spec.device)
            runs.append(time.perf_counter() - t0)
            store.abort(step)
        seconds.append(sorted(runs)[len(runs) // 2])
    profile = CostProfile(tuple(lengths), tuple(seconds))
    _MEASURED[key] = profile
    return profile
