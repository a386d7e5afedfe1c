"""Pensieve's Cost(l): the time to recompute one chunk attending to l tokens, measured once per model
geometry and device at powers of two of l (then interpolated by `CostProfile`).

Measured profiles are kept for this process and on disk, under `$STATEFUL_HF_CACHE` (default
`~/.cache/stateful_hf`)/cost_profiles, keyed by the model config, device, dtype, chunk size, torch
version, processor and quantized weights (`_key`), so a model is profiled once per machine, not once per store.

A first measurement shows a tqdm bar (on a terminal) saying what it measures. Each point is the median of
its repeats; when the repeats spread widely (another process took the cores: a profile taken on a busy host
once read 1.3-2.7 s a chunk where prefill took ~0.25 s, and steered every later decision) the sweep is taken
again, up to `MAX_SWEEPS` times, and the calmest kept; a profile still that noisy is used for this process
and saved marked so, and the next start measures again. `CostProfile.source` says which (`StoreStats.cost_profile`)."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..cache import CostProfile, KVSpec, KVStore
from ..integration.hooks import run_step
from ..kernels.quantization import detect

_MEASURED: dict[str, CostProfile] = {}   # memo per model geometry and device, for this process
MAX_SWEEPS = 3          # timed sweeps at most, when the host is busy
BUSY_SPREAD = 0.5       # a sweep whose median point spreads (max - min) / median more than this was disturbed


def _key(model: torch.nn.Module, spec: KVSpec) -> str:
    """The profile's cache key: config, device, dtype, chunk, torch, processor, threads, and the model's quantized
    weights when it has any (a model quantized with torchao's `quantize_` keeps its config: a plain model's key
    is unchanged). Always measured eager: an engine's compiled steps correct it online (`profile/correction.py`)."""
    config = json.dumps(model.config.to_dict(), sort_keys=True, default=str)
    where = f"{spec.device}|{spec.dtype}|{spec.block_size}|{torch.__version__}|{platform.machine()}|" \
            f"{platform.processor()}|{torch.get_num_threads()}"
    quant = detect(model)
    if quant is not None:
        where += f"|{quant.describe()}"
    return hashlib.sha1(f"{config}|{where}".encode()).hexdigest()


def _cache_file(key: str) -> Path:
    root = os.environ.get("STATEFUL_HF_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "stateful_hf")
    return Path(root) / "cost_profiles" / f"{key}.json"


def _load(key: str) -> CostProfile | None:
    try:
        path = _cache_file(key)
        saved = json.loads(path.read_text())
        if not saved.get("calm", True):
            return None      # taken on a busy host: measured again
        return CostProfile(tuple(saved["lengths"]), tuple(saved["seconds"]),
                           f"cached in {path} ({saved.get('source', 'measured')})")
    except (OSError, ValueError, KeyError, TypeError):
        return None          # absent or unreadable: measure again


def _save(key: str, profile: CostProfile, calm: bool) -> None:
    path = _cache_file(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"lengths": list(profile.lengths), "seconds": list(profile.seconds),
                                   "source": profile.source, "calm": calm}))
        os.replace(tmp, path)
    except OSError:
        pass                 # a read-only home is no reason to fail: the profile stays in memory


def _fit_linear(lengths: list[int], seconds: list[float]) -> list[float]:
    """Pensieve's model Cost(l) = c + a * l (attention grows linearly in the context, the rest is a
    constant c), fitted by least squares with a >= 0 and c > 0, evaluated at `lengths`. Fitting the
    whole curve keeps one noisy point from reordering chunks."""
    n = len(lengths)
    mx, my = sum(lengths) / n, sum(seconds) / n
    var = sum((x - mx) ** 2 for x in lengths)
    a = max(sum((x - mx) * (y - my) for x, y in zip(lengths, seconds)) / var, 0.0) if var else 0.0
    c = max(my - a * mx, min(seconds) * 1e-3, 1e-9)
    return [c + a * x for x in lengths]


@torch.inference_mode()
def measure_cost_profile(model: torch.nn.Module, spec: KVSpec, max_length: int = 4096,
                         repeats: int = 3) -> CostProfile:
    """Time one chunk's forward at contexts 32, 64, ... up to `max_length` (capped by the model's
    positions) after one untimed warm-up sweep; the median of `repeats` runs per point, then the linear fit.
    A sweep whose repeats spread more than BUSY_SPREAD is taken again (MAX_SWEEPS at most) and the calmest
    kept. Memoized per model geometry and device (in this process and on disk; a disturbed one is measured
    again by the next process); a
    kept profile is reused when it reaches at least as far, else the range is measured again and the longer
    profile kept."""
    key = _key(model, spec)
    chunk = spec.block_size
    limit = min(max_length, model.config.max_position_embeddings - chunk)
    lengths = [chunk]
    while lengths[-1] * 2 <= limit:
        lengths.append(lengths[-1] * 2)
    for known in (_MEASURED.get(key), _load(key)):      # reuse a profile that covers these lengths
        if known is not None and known.lengths[-1] >= lengths[-1]:
            _MEASURED[key] = known
            return known
    ids = torch.randint(0, model.get_input_embeddings().num_embeddings, (lengths[-1] + chunk,)).tolist()
    total = len(lengths) * (1 + repeats * MAX_SWEEPS)
    with tqdm(total=total, desc="stateful-hf: measuring Cost(l), once per model and device", unit="run",
              leave=False, disable=None) as bar:
        _sweep(model, spec, ids, lengths, 1, bar)   # warm-up: kernels for every shape, not timed
        sweeps = []
        for _ in range(MAX_SWEEPS):
            sweeps.append(_sweep(model, spec, ids, lengths, repeats, bar))
            if sweeps[-1][1] <= BUSY_SPREAD:
                break
    medians, spread = min(sweeps, key=lambda s: s[1])
    calm = spread <= BUSY_SPREAD
    source = (f"measured at {time.strftime('%Y-%m-%d %H:%M:%S')}: median of {repeats} runs a point, "
              f"spread {spread:.2f}, {len(sweeps)} sweep{'s' if len(sweeps) > 1 else ''}"
              + ("" if calm else "; the host was busy: measured again at the next start"))
    profile = CostProfile(tuple(lengths), tuple(_fit_linear(lengths, medians)), source)
    _MEASURED[key] = profile
    _save(key, profile, calm)
    return profile


def _sweep(model: torch.nn.Module, spec: KVSpec, ids: list[int], lengths: list[int], repeats: int,
           bar: tqdm) -> tuple[list[float], float]:
    """The median of `repeats` timings of one chunk's forward at each context length, growing one
    session's context through `lengths`; and the median over points of their spread, (max - min) / median.
    The growth is committed without running the model: a chunk's forward costs the same whatever the K/V it
    attends to holds (the blocks keep the pool's zeros), and computing 4096 tokens of real context would cost
    more than all the timed runs."""
    chunk = spec.block_size
    store = KVStore(spec, lengths[-1] + chunk, swap_out_threshold=0.0)
    store.open("p")
    seconds, spreads, done = [], [], 0
    for n in lengths:
        if n - chunk > done:
            store.commit(store.plan_step([("p", ids[done:n - chunk], range(done, n - chunk))]))
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
            bar.update(1)
        seconds.append(statistics.median(runs))
        spreads.append((max(runs) - min(runs)) / max(seconds[-1], 1e-12))
    return seconds, statistics.median(spreads)


_BANDWIDTH: dict[tuple, float] = {}


def measure_offload_bandwidth(device_pool, host_device: torch.device | str = "cpu", blocks: int = 8,
                              repeats: int = 5) -> float:
    """Bytes per second of one layer's blocks gathered from the device pool and copied to host memory
    (LayerKV's BW in T_offload): the fastest of `repeats` copies of `blocks` blocks into a scratch
    buffer (the pools are not written). Memoized per device, dtype and block geometry."""
    key = (str(device_pool.device), device_pool.spec.dtype, tuple(device_pool.data.shape[2:]))
    if key not in _BANDWIDTH:
        n = max(1, min(blocks, device_pool.num_blocks))
        src = torch.arange(n, device=device_pool.device)
        buf = torch.empty(device_pool.data[0, :n].shape, dtype=device_pool.data.dtype, device=host_device)
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            buf.copy_(device_pool.read(0, src))
            if device_pool.device.type == "cuda":
                torch.cuda.synchronize(device_pool.device)
            best = min(best, time.perf_counter() - t0)
        _BANDWIDTH[key] = buf.numel() * buf.element_size() / max(best, 1e-9)
    return _BANDWIDTH[key]
