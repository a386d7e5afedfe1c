"""Where a step's time goes, against this CPU's GEMM rate: the engine beside transformers' CB.

    python -m benchmarks.profile_step                       # 8 new 360-token prompts, then 23 decode steps
    python -m benchmarks.profile_step --prompts 8 --prompt-len 360 --decode 23 --threads 2

Both systems serve the same round on the same random ~100M Llama (bench_engine's model) with the same
max batch tokens, each stepping on its own background thread (the engine: its loop, released caller
pool and sized team as configured; CB: its generation thread), under torch.profiler on that thread.
Each op's self time is put in one bucket: linear (aten::mm/addmm: the projections, MLP and LM head),
attention (SDPA and the K/V gather/write: index_select, index, index_put, index_copy), other ops (norms,
RoPE, activations, sampling...), and the rest of the wall time is Python and framework overhead.
The GEMM rate is measured here first: the same matmul shapes back to back on the benchmark's threads,
so "linear at the GEMM rate" is what the linear layers would take if every matmul ran at that rate.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time

import torch
from torch.profiler import ProfilerActivity, profile

from .bench_engine import build_model, engine_threads
from .neighbours import Neighbours

ATTENTION = ("scaled_dot_product", "flash_attention", "index_select", "aten::index", "index_put", "index_copy",
             "_index_put_impl_")
LINEAR = ("aten::mm", "aten::addmm")


def buckets(prof, wall: float) -> dict:
    """Seconds per bucket of one profiled run (self times of the ops on the profiled thread)."""
    out = {"linear": 0.0, "attention": 0.0, "other_ops": 0.0}
    for e in prof.key_averages():
        if e.key in LINEAR:
            out["linear"] += e.self_cpu_time_total / 1e6
        elif any(a in e.key for a in ATTENTION):
            out["attention"] += e.self_cpu_time_total / 1e6
        else:
            out["other_ops"] += e.self_cpu_time_total / 1e6
    out["python_and_framework"] = max(wall - sum(out.values()), 0.0)
    out["wall"] = wall
    return out


def gemm_rate(shapes: list[tuple[int, int, int]], seconds: float = 2.0) -> float:
    """GFLOP/s of back-to-back matmuls of these (rows, in, out) shapes on a fresh thread."""
    xs = [(torch.randn(m, k), torch.randn(n, k)) for m, k, n in shapes]
    result = {}

    def run():
        for x, w in xs:                            # warm up
            torch.nn.functional.linear(x, w)
        done, flop, t0 = 0, 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            for x, w in xs:
                torch.nn.functional.linear(x, w)
                flop += 2 * x.shape[0] * x.shape[1] * w.shape[0]
            done += 1
        result["rate"] = flop / (time.perf_counter() - t0) / 1e9

    th = threading.Thread(target=run)
    th.start()
    th.join()
    return result["rate"]


def linear_flop(model, rows: int, logit_rows: int) -> int:
    """FLOPs of the linear layers of one forward over `rows` rows, the LM head on `logit_rows`."""
    total = 0
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear):
            n = logit_rows if name.endswith("lm_head") else rows
            total += 2 * n * mod.in_features * mod.out_features
    return total


def profile_engine(model, prompts, decode: int, max_batch_tokens: int, step_threads) -> tuple[dict, dict]:
    """The engine's steps on a fresh thread, as its loop runs them (the caller's pool released first,
    the team sized before each step), under the profiler."""
    from stateful_hf import Engine, SamplingParams, SessionStore
    from stateful_hf.engine.openmp import release_thread_pool

    store = SessionStore(model, len(prompts) * 1024, max_context=1024)
    engine = Engine(model, store=store, max_batch_tokens=max_batch_tokens, max_num_seqs=len(prompts),
                    step_threads=step_threads)
    release_thread_pool()
    handles = [engine.submit(f"s{i}", p, SamplingParams(max_new_tokens=decode + 1, ignore_eos=True))
               for i, p in enumerate(prompts)]
    timing: dict = {}

    def drive():
        if engine.thread_sizer is not None:
            engine.thread_sizer.claim()         # this thread steps as the engine's loop would
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            while engine.has_work():
                engine.step()
                if "first_round_s" not in timing and all(h.snapshot()[0] for h in handles):
                    timing["first_round_s"] = time.perf_counter() - t0
            timing["wall"] = time.perf_counter() - t0
        timing["prof"] = prof

    th = threading.Thread(target=drive)
    th.start()
    th.join()
    assert all(h.done for h in handles)
    timing["steps"] = engine.stats().steps
    if engine.thread_sizer is not None:
        timing["steps_by_threads"] = dict(engine.thread_sizer.steps_by_threads)
    return buckets(timing.pop("prof"), timing["wall"]), timing


def profile_cb(model, prompts, decode: int, max_batch_tokens: int) -> tuple[dict, dict]:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    from transformers.generation.continuous_batching import continuous_api

    gen_cfg = GenerationConfig(max_new_tokens=decode + 1, do_sample=False, eos_token_id=-1, pad_token_id=0)
    cb_cfg = ContinuousBatchingConfig(allow_block_sharing=True, num_blocks=len(prompts) * 40, page_size=32,
                                      max_batch_tokens=max_batch_tokens, max_requests_per_batch=len(prompts))
    manager = model.init_continuous_batching(generation_config=gen_cfg, continuous_batching_config=cb_cfg)
    holder = {}
    cls = continuous_api.ContinuousBatchingManager
    real_loop = cls._run_generation_loop

    def profiled_loop(self):                   # CB's generation thread, under the profiler
        with profile(activities=[ProfilerActivity.CPU]) as p:
            holder["t0"] = time.perf_counter()
            real_loop(self)
            holder["t1"] = time.perf_counter()
        holder["prof"] = p

    cls._run_generation_loop = profiled_loop
    try:
        manager.start()
        t0 = time.perf_counter()
        for i, p in enumerate(prompts):
            manager.add_request(p, request_id=f"r{i}", max_new_tokens=decode + 1, eos_token_id=-1)
        got, firsts = 0, set()
        while got < len(prompts):
            r = manager.get_result(timeout=300)
            if r.generated_tokens:
                firsts.add(r.request_id)
                if len(firsts) == len(prompts) and "first_round_s" not in holder:
                    holder["first_round_s"] = time.perf_counter() - t0
            got += r.is_finished()
        wall = time.perf_counter() - t0
        manager.stop(block=True, timeout=60)
    finally:
        cls._run_generation_loop = real_loop
    timing = {"wall": wall, "first_round_s": holder["first_round_s"]}
    return buckets(holder["prof"], holder["t1"] - holder["t0"]), timing


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=360)
    ap.add_argument("--decode", type=int, default=23, help="decode steps after the prompts' first token")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--max-batch-tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--engine-threads", type=engine_threads, default="auto")
    ap.add_argument("--neighbour", default="quiet")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = build_model(args.layers)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 16000, (args.prompt_len,), generator=g).tolist() for _ in range(args.prompts)]
    rows = args.prompts * args.prompt_len + args.prompts * args.decode
    flop = linear_flop(model, rows, args.prompts * (args.decode + 1))
    cfg = model.config
    shapes = [(args.max_batch_tokens, cfg.hidden_size, n) for n in
              (cfg.hidden_size, 2 * 256, cfg.intermediate_size * 2)] + [(args.max_batch_tokens, cfg.intermediate_size,
                                                                          cfg.hidden_size)]
    with torch.inference_mode(), Neighbours(args.neighbour):
        load = os.getloadavg()
        rate = gemm_rate(shapes)
        print(f"{torch.get_num_threads()} torch threads, neighbours {args.neighbour}, load {load[0]:.1f}; "
              f"GEMM rate at [{args.max_batch_tokens}, 768] x [768, n]: {rate:.1f} GFLOP/s; "
              f"linear work of the round {flop / 1e9:.1f} GFLOP = {flop / 1e9 / rate:.2f} s at that rate")
        model.generate(torch.tensor([prompts[0][:16]]), max_new_tokens=2, do_sample=False, pad_token_id=0)
        out = {"gemm_gflops": rate, "linear_gflop": flop / 1e9, "load_start": load}
        for name, fn in (("cb", lambda: profile_cb(model, prompts, args.decode, args.max_batch_tokens)),
                         ("engine", lambda: profile_engine(model, prompts, args.decode, args.max_batch_tokens,
                                                           args.engine_threads))):
            b, timing = fn()
            out[name] = {"buckets_s": b, **timing}
            print(f"{name:>7}: wall {timing['wall']:.2f} s, all first tokens after {timing['first_round_s']:.2f} s"
                  + (f", {timing['steps']} steps {timing.get('steps_by_threads', '')}" if "steps" in timing else "")
                  + "; profiled thread s: " + ", ".join(f"{k} {v:.2f}" for k, v in b.items()), flush=True)
        out["load_end"] = os.getloadavg()
        print(f"load at end {out['load_end'][0]:.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
