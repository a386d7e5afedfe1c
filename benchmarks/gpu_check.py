"""One command to check a GPU machine: the `cuda` tests plus kernel, tier, hidden-state and engine
figures at GPU sizes, in one JSON file.

    python -m benchmarks.gpu_check --json gpu.json

Assumes a CUDA build of torch is installed and then `pip install -e ".[dev,gpu]"` (flash-attn is a
source build: `pip install -e ".[flash-attn]"` adds it; a backend whose package is missing is
skipped). On a machine without CUDA it says so and exits 0. Model shapes are Llama-3.2-1B-like
(16 layers, hidden 2048, 32 query / 8 KV heads of 64, random weights, vocab 32000) with 4K
contexts; `--smoke` runs every step at tiny sizes on any device (to test this script: its
figures mean nothing).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from types import SimpleNamespace

import torch

DESCRIPTION = __doc__.split("\n\n")[0] + """

Assumes a CUDA build of torch is installed and then `pip install -e ".[dev,gpu]"` (optional: the
[flash-attn] extra, a source build). Without CUDA it prints that it needs CUDA and exits 0."""

GPU_SHAPE = {"num_hidden_layers": 16, "hidden_size": 2048, "intermediate_size": 8192, "num_attention_heads": 32,
             "num_key_value_heads": 8, "vocab_size": 32000}
SMOKE_SHAPE = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
               "num_key_value_heads": 2, "vocab_size": 256}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_s(fn, reps: int, device: torch.device) -> float:
    times = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _model(shape: dict, device: torch.device, dtype: torch.dtype):
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**shape, max_position_embeddings=8192, tie_word_embeddings=True)
    return transformers.LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()


def _prefill(model, store, sid: str, ids: torch.Tensor) -> None:
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False, pad_token_id=0,
                   past_key_values=store.cache(sid))


# ---- the tests ---------------------------------------------------------------------------------------

def run_tests(timeout: float) -> dict:
    """`pytest -m cuda`: per test its outcome, seconds and recorded properties (bf16 agreement)."""
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "junit.xml"
        t0 = time.perf_counter()
        try:
            r = subprocess.run([sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider",
                                f"--junitxml={xml}"], capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout:.0f} s"}
        out = {"returncode": r.returncode, "seconds": round(time.perf_counter() - t0, 1),
               "summary": r.stdout.strip().splitlines()[-1] if r.stdout.strip() else "", "tests": {}}
        if xml.exists():
            for case in ET.parse(xml).getroot().iter("testcase"):
                outcome = "passed"
                for tag in ("failure", "error", "skipped"):
                    node = case.find(tag)
                    if node is not None:
                        outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                        out["tests"].setdefault("_messages", {})[case.get("name")] = (node.get("message") or "")[:300]
                props = {p.get("name"): p.get("value") for p in case.iter("property")}
                out["tests"][f"{case.get('classname')}::{case.get('name')}"] = {
                    "outcome": outcome, "seconds": float(case.get("time", 0)), **props}
        return out


# ---- the benchmarks ----------------------------------------------------------------------------------

def bench_kernels(device: torch.device, smoke: bool) -> dict:
    """benchmarks/bench_kernels.py's paths at 1B attention shapes (ms per call, one layer)."""
    from benchmarks import bench_kernels
    from stateful_hf import kernels

    args = SimpleNamespace(seqs=2 if smoke else 16, queries=2 if smoke else 8, heads=4 if smoke else 32,
                           kv_heads=2 if smoke else 8, head_dim=16 if smoke else 64, block_size=16,
                           reps=2 if smoke else 7)
    gpu = [b for b in ("triton", "flashinfer", "flash_attn")
           if device.type == "cuda" and b in kernels.available_backends(device, torch.float16)]
    out = {"shape": vars(args), "backends": gpu, "ms": {}}
    for ctx in ((64,) if smoke else (1024, 4096)):
        times, plan_ms = bench_kernels.measure(ctx, args, device, gpu)
        out["ms"][ctx] = {**{n: round(t * 1e3, 4) for n, t in times.items()}, "plan+first": round(plan_ms, 3)}
    return out


def bench_tiers(model, device: torch.device, ctx: int, reps: int) -> dict:
    """One ctx-token session: seconds to bring it back to the device from each tier (swap-in),
    to push it down (swap-out, landed), and to recompute it (prefill)."""
    from stateful_hf import SessionStore

    ids = torch.randint(3, model.config.vocab_size, (1, ctx), generator=torch.Generator().manual_seed(0)).to(device)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        store = SessionStore(model, device_capacity=2 * ctx + 64, host_capacity=2 * ctx + 64, disk_dir=tmp,
                             disk_capacity=2 * ctx + 64, policy="lru")
        _prefill(model, store, "s", ids)
        chunks = range(len(store.session("s").chunks))
        for tier in ("host", "disk"):
            def down(tier=tier):
                store.move("s", chunks, tier)
                store.transfer.synchronize()

            def up():
                store.move("s", chunks, "device")

            downs, ups = [], []
            for _ in range(reps):
                downs.append(_median_s(down, 1, device))
                ups.append(_median_s(up, 1, device))
            out[f"swap_out_{tier}_s"] = round(statistics.median(downs), 5)
            out[f"swap_in_{tier}_s"] = round(statistics.median(ups), 5)
        store.delete("s")
        out["recompute_s"] = round(_median_s(lambda: (_prefill(model, store, "r", ids), store.delete("r")),
                                             reps, device), 5)
        out["kv_bytes"] = store.spec.bytes_per_block * len(chunks)
        store.close()
    return out


def bench_hidden(model, device: torch.device, ctx: int, reps: int) -> dict:
    """HCache: seconds to restore a ctx-token session from hidden states (projection) vs its K/V
    from the host, and the prefill time with capture on vs off."""
    from stateful_hf import SessionStore
    from stateful_hf.cache import CostProfile

    ids = torch.randint(3, model.config.vocab_size, (1, ctx), generator=torch.Generator().manual_seed(1)).to(device)
    cap = 2 * ctx + 64
    out = {}
    for mode in ("never", "always"):
        store = SessionStore(model, device_capacity=cap, host_capacity=cap, hidden_states=mode,
                             hidden_layers=None if mode == "never" else model.config.num_hidden_layers // 2,
                             policy="lru", cost_profile=CostProfile())
        out[f"prefill_capture_{mode}_s"] = round(_median_s(
            lambda store=store: (_prefill(model, store, "p", ids), store.delete("p")), reps, device), 5)
        _prefill(model, store, "s", ids)
        chunks = range(len(store.session("s").chunks))
        tier = "host" if mode == "never" else "hidden"
        times = []
        for _ in range(reps):
            store.move("s", chunks, tier)
            store.transfer.synchronize()
            times.append(_median_s(lambda store=store, chunks=chunks: store.move("s", chunks, "device"), 1, device))
        out[f"restore_from_{tier}_s"] = round(statistics.median(times), 5)
    return out


def bench_engine(model, device: torch.device, sessions: int, prompt: int, new: int) -> dict:
    """Engine throughput: `sessions` sessions, two turns each, `new` tokens per turn."""
    from stateful_hf import Engine, SamplingParams, SessionStore

    store = SessionStore(model, device_capacity=sessions * (2 * prompt + 2 * new) + 256,
                         host_capacity=sessions * (2 * prompt + 2 * new), policy="lru")
    engine = Engine(model, store=store)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, model.config.vocab_size, (prompt,), generator=g).tolist() for _ in range(sessions)]
    sids = [f"e{i}" for i in range(sessions)]
    out = {}
    for turn in range(2):
        _sync(device)
        t0 = time.perf_counter()
        outs = engine.generate(sids, prompts, SamplingParams(max_new_tokens=new))
        _sync(device)
        dt = time.perf_counter() - t0
        errors = [repr(o.error) for o in outs if o.error is not None]
        out[f"turn{turn + 1}"] = {"seconds": round(dt, 3), "tokens_per_s": round(sessions * new / dt, 1),
                                  "errors": errors[:3]}
        prompts = [p + list(o.token_ids) + p[:16] for p, o in zip(prompts, outs)]
    return out


def _guarded(name: str, fn, report: dict) -> None:
    t0 = time.perf_counter()
    try:
        report[name] = fn()
    except Exception as e:                 # one failing benchmark does not hide the others' figures
        report[name] = {"error": f"{type(e).__name__}: {e}"}
    print(f"{name}: {time.perf_counter() - t0:.1f} s", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=DESCRIPTION,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default="gpu_check.json", help="where to write the report (default gpu_check.json)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on any device, to test this script")
    ap.add_argument("--no-tests", action="store_true", help="skip `pytest -m cuda`")
    ap.add_argument("--test-timeout", type=float, default=420.0, help="seconds for the cuda tests (default 420)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() and not args.smoke:
        print("gpu_check needs CUDA: torch.cuda.is_available() is False here (a CPU build of torch, or no GPU). "
              "Nothing was run; install a CUDA build of torch, then pip install -e \".[dev,gpu]\".")
        return 0
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    report: dict = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "cuda": torch.version.cuda, "smoke": args.smoke,
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    if not args.no_tests:
        _guarded("tests", lambda: run_tests(args.test_timeout), report)
    shape, ctx, reps = (SMOKE_SHAPE, 64, 2) if args.smoke else (GPU_SHAPE, 4096, 3)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    report["model"] = {**shape, "dtype": str(dtype).removeprefix("torch."), "context": ctx}
    _guarded("kernels", lambda: bench_kernels(device, args.smoke), report)
    model = _model(shape, device, dtype)
    _guarded("tiers", lambda: bench_tiers(model, device, ctx, reps), report)
    _guarded("hidden", lambda: bench_hidden(model, device, ctx, reps), report)
    _guarded("engine", lambda: bench_engine(model, device, 2 if args.smoke else 16, 32 if args.smoke else 1024,
                                            4 if args.smoke else 64), report)
    Path(args.json).write_text(json.dumps(report, indent=1, default=str))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
