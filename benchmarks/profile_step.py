"""Where a step's time goes, against this CPU's GEMM rate: the engine beside transformers' CB.

    python -m benchmarks.profile_step                       # 8 new 360-token prompts, then 23 decode steps
    python -m benchmarks.profile_step --prompts 8 --prompt-len 360 --decode 23 --threads 2
    python -m benchmarks.profile_step --model smollm2-135m-instruct --dtype bfloat16 --prompts 24 --prompt-len 64
    python -m benchmarks.profile_step --compute-free          # the step's host time: engine vs the model's forward
    python -m benchmarks.profile_step --compute-free --compile   # the same with the engine's compiled step too

The compute-free mode (`compute_free`): a 30-layer Llama of width 64 (compute ~0, so what a step costs is
host time: Python, dispatch, launches), ROWS sessions decoding one token a step. Reported at 1 and 2 threads:
the engine's decode step (`StepRecord.seconds`: planning, forward, sampling and commit; median) against the
model's own eager forward over the same rows (a fresh copy of the model, transformers' `DynamicCache`, the
ROWS sequences batched: median), and their ratio (issue 51's target: <= 1.1 eager, <= 0.5 compiled).

The roofline (`roofline`, after the profiled runs, without the profiler; CB needs the model before the
engine switches its attention): the engine's steps one at a time, each
followed by its floor, interleaved in the same process and neighbour condition. A step's floor is its
own linear layers (every decoder layer's projections at the step's row count, in step order, plus the
LM head on the sampled rows), run on the model's weights with the kernel the engine uses (packed where
it packs), plus the K/V the step's attention reads (every entry's context, every layer) at the read
bandwidth measured here. Reported: sum of steps / sum of floors over the run and per row-count bucket.

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
import contextlib
import json
import os
import sys
import threading
import time

import torch
from torch.profiler import ProfilerActivity, profile

from .bench_engine import build_model, engine_threads
from .harness.neighbours import Neighbours

ATTENTION = ("scaled_dot_product", "flash_attention", "index_select", "aten::index", "index_put", "index_copy",
             "_index_put_impl_")
LINEAR = ("aten::mm", "aten::addmm", "mkl::_mkl_linear", "mkldnn::_linear_pointwise")


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


def gemm_rate(shapes: list[tuple[int, int, int]], seconds: float = 2.0, dtype: torch.dtype = torch.float32) -> float:
    """GFLOP/s of back-to-back `F.linear`s of these (rows, in, out) shapes in `dtype` on a fresh thread."""
    xs = [(torch.randn(m, k, dtype=dtype), torch.randn(n, k, dtype=dtype)) for m, k, n in shapes]
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


BUCKETS = (1, 8, 32, 64, 128, 256, 1 << 30)       # row-count buckets: <= each bound


def read_bandwidth(nbytes: int = 256 << 20) -> float:
    """Bytes per second of a streaming read (a sum over a tensor larger than the caches), best of 5."""
    x = torch.ones(nbytes // 4)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best


def roofline(model, prompts, decode: int, max_batch_tokens: int, **engine_options) -> dict:
    """Σ step / Σ floor of the engine's steps on one thread, each step followed by its floor."""
    from stateful_hf import Engine, SamplingParams, SessionStore
    from stateful_hf.integration.adapter import decoder_layers

    store = SessionStore(model, len(prompts) * 1024, max_context=1024)
    engine = Engine(model, store=store, max_batch_tokens=max_batch_tokens, max_num_seqs=len(prompts),
                    **engine_options)
    packed = engine.runner.packed
    layers = decoder_layers(model)
    linears = [m for layer in layers for m in layer.modules() if isinstance(m, torch.nn.Linear)]
    head = model.get_output_embeddings()
    a = store.adapter
    kv_bytes_per_token = 2 * a.num_layers * a.num_kv_heads * a.head_dim * next(model.parameters()).element_size()
    bandwidth = read_bandwidth()
    dtype = next(model.parameters()).dtype
    xs = {}

    def floor(rows: int, sampled: int, context_tokens: int) -> float:
        if rows not in xs:
            xs[rows] = {m.in_features: torch.randn(rows, m.in_features, dtype=dtype) for m in linears}
        x = xs[rows]
        with torch.inference_mode(), (packed.active() if packed is not None else contextlib.nullcontext()):
            t0 = time.perf_counter()
            for m in linears:
                m(x[m.in_features])
            if sampled:
                head(x[head.in_features][:sampled] if rows >= sampled else torch.randn(sampled, head.in_features,
                                                                                         dtype=dtype))
            t = time.perf_counter() - t0
        return t + context_tokens * kv_bytes_per_token / bandwidth

    engine.submit("warm-up", prompts[0][:48], SamplingParams(max_new_tokens=3, ignore_eos=True))
    while engine.has_work():                       # first touch of the pool and workspaces
        engine.step()
    floor(8, 1, 0)
    handles = [engine.submit(f"s{i}", p, SamplingParams(max_new_tokens=decode + 1, ignore_eos=True))
               for i, p in enumerate(prompts)]
    rows_out: list[tuple[int, float, float]] = []
    while engine.has_work():
        t0 = time.perf_counter()
        record = engine.step()
        step_s = time.perf_counter() - t0
        if record is None:
            continue
        sampled = sum(1 for e in record.entries if e[3])
        context = sum(len(store.token_ids(e[0])) for e in record.entries)
        rows_out.append((record.num_tokens, step_s, floor(record.num_tokens, sampled, context)))
    assert all(h.done for h in handles)
    per_bucket = {}
    lo = 0
    for hi in BUCKETS:
        sel = [(s, f) for n, s, f in rows_out if lo < n <= hi]
        if sel:
            per_bucket[f"{lo + 1}-{hi}" if hi < 1 << 30 else f">{lo}"] = {
                "steps": len(sel), "step_s": sum(s for s, _ in sel), "floor_s": sum(f for _, f in sel),
                "ratio": sum(s for s, _ in sel) / sum(f for _, f in sel)}
        lo = hi
    total_s, total_f = sum(s for _, s, _ in rows_out), sum(f for _, _, f in rows_out)
    return {"steps": len(rows_out), "step_s": total_s, "floor_s": total_f, "ratio": total_s / total_f,
            "read_bandwidth_gbs": bandwidth / 1e9, "kernel": str(packed.kernel) if packed else "stock",
            "buckets": per_bucket}


def compute_free_model(seed: int = 0):
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=30,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                                   eos_token_id=2, bos_token_id=1, pad_token_id=0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = None
    return model


def compute_free(threads: int, rows: int = 16, context: int = 64, decode: int = 24, compile: bool = False) -> dict:
    """Median decode step (ms) of the engine and of the model's eager forward, `rows` sequences of `context`
    tokens decoding `decode` tokens, at `threads` torch threads; the engine steps on this thread."""
    from transformers import DynamicCache

    from stateful_hf import Engine, SamplingParams, SessionStore

    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(3, 512, (rows, context), generator=g)
    plain = compute_free_model()
    with torch.inference_mode():
        cache = DynamicCache(config=plain.config)
        out = plain(prompts, past_key_values=cache, use_cache=True)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        times = []
        for _ in range(decode):
            t0 = time.perf_counter()
            out = plain(nxt, past_key_values=cache, use_cache=True)
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            times.append(time.perf_counter() - t0)
    forward_ms = 1e3 * sorted(times)[len(times) // 2]
    result = {"threads": threads, "rows": rows, "context": context, "forward_ms": forward_ms}
    for name, option in (("eager", False), ("compiled", True)) if compile else (("eager", False),):
        model = compute_free_model()
        store = SessionStore(model, rows * (context + decode + 64))
        t0 = time.perf_counter()
        engine = Engine(model, store=store, max_batch_tokens=max(rows * context, 64), max_num_seqs=rows,
                        step_threads=None, compile=option, release_openmp_pool=False)
        start_s = time.perf_counter() - t0
        handles = [engine.submit(f"s{i}", prompts[i].tolist(), SamplingParams(max_new_tokens=decode + 1,
                                                                              ignore_eos=True)) for i in range(rows)]
        steps = []
        while engine.has_work():
            record = engine.step()
            if record is not None and record.num_decode == rows:
                steps.append(record.seconds)
        assert all(h.done for h in handles)
        step_ms = 1e3 * sorted(steps)[len(steps) // 2]
        result[name] = {"step_ms": step_ms, "ratio": step_ms / forward_ms, "decode_steps": len(steps),
                        "start_s": start_s, "compile": engine.stats().compile}
    return result


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
    ap.add_argument("--model", help="a named model (smollm2-135m-instruct) or a directory; default: a random "
                    "~100M Llama of --layers layers")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=360)
    ap.add_argument("--decode", type=int, default=23, help="decode steps after the prompts' first token")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--max-batch-tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--engine-threads", type=engine_threads, default="auto")
    ap.add_argument("--prepack", nargs="+", default=["auto", "off"], choices=("auto", "on", "off"),
                    help="the roofline once per engine prepack_weights mode, in this order")
    ap.add_argument("--no-profile", action="store_true", help="the roofline only (no profiler run, no CB)")
    ap.add_argument("--neighbour", default="quiet")
    ap.add_argument("--compute-free", action="store_true", help="the compute-free mode only (see above)")
    ap.add_argument("--compile", action="store_true", help="compute-free: the engine's compiled step too "
                    "(compile=True: inductor, compiled at engine start)")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.compute_free:
        out = {"command": "python -m benchmarks.profile_step " + " ".join(sys.argv[1:]), "load_start": os.getloadavg(),
               "runs": []}
        with Neighbours(args.neighbour):
            for threads in (1, 2):
                r = compute_free(threads, compile=args.compile)
                out["runs"].append(r)
                print(f"compute-free, {threads} thread(s), {r['rows']} rows of {r['context']}+ tokens: model's eager "
                      f"forward {r['forward_ms']:.2f} ms; " + "; ".join(
                          f"engine {k} step {r[k]['step_ms']:.2f} ms = x{r[k]['ratio']:.2f} ({r[k]['compile']}, "
                          f"engine made in {r[k]['start_s']:.1f} s)" for k in ("eager", "compiled") if k in r),
                      flush=True)
        out["load_end"] = os.getloadavg()
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    if args.model:
        from stateful_hf.models import load
        model = load(args.model, dtype=dtype)[0]
    else:
        model = build_model(args.layers, dtype=dtype)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, min(vocab, 16000), (args.prompt_len,), generator=g).tolist()
               for _ in range(args.prompts)]
    rows = args.prompts * args.prompt_len + args.prompts * args.decode
    flop = linear_flop(model, rows, args.prompts * (args.decode + 1))
    cfg = model.config
    shapes = [(args.max_batch_tokens, cfg.hidden_size, n) for n in
              (cfg.hidden_size, 2 * 256, cfg.intermediate_size * 2)] + [(args.max_batch_tokens, cfg.intermediate_size,
                                                                          cfg.hidden_size)]
    out = {"command": "python -m benchmarks.profile_step " + " ".join(sys.argv[1:]), "model": args.model or "random",
           "dtype": args.dtype}
    with torch.inference_mode(), Neighbours(args.neighbour):
        out["load_start"] = os.getloadavg()
        model.generate(torch.tensor([prompts[0][:16]]), max_new_tokens=2, do_sample=False, pad_token_id=0)
        if not args.no_profile:
            rate = gemm_rate([(m, k, n) for m, k, n in shapes], dtype=dtype)
            print(f"{torch.get_num_threads()} torch threads, neighbours {args.neighbour}; GEMM rate at "
                  f"[{args.max_batch_tokens}, {cfg.hidden_size}] x [{cfg.hidden_size}, n]: {rate:.1f} GFLOP/s; "
                  f"linear work of the round {flop / 1e9:.1f} GFLOP = {flop / 1e9 / rate:.2f} s at that rate")
            out.update(gemm_gflops=rate, linear_gflop=flop / 1e9)
            for name, fn in (("cb", lambda: profile_cb(model, prompts, args.decode, args.max_batch_tokens)),
                             ("engine", lambda: profile_engine(model, prompts, args.decode, args.max_batch_tokens,
                                                               args.engine_threads))):
                b, timing = fn()
                out[name] = {"buckets_s": b, **timing}
                print(f"{name:>7}: wall {timing['wall']:.2f} s, all first tokens after {timing['first_round_s']:.2f} "
                      "s" + (f", {timing['steps']} steps {timing.get('steps_by_threads', '')}" if "steps" in timing
                             else "") + "; profiled thread s: " + ", ".join(f"{k} {v:.2f}" for k, v in b.items()),
                      flush=True)
        for mode in args.prepack:
            r = roofline(model, prompts, args.decode, args.max_batch_tokens, prepack_weights=mode,
                         step_threads=args.engine_threads)
            out.setdefault("roofline", {})[mode] = r
            print(f"roofline, prepack_weights={mode} ({r['kernel']}): {r['steps']} steps, sum of steps "
                  f"{r['step_s']:.2f} s, sum of floors {r['floor_s']:.2f} s: step / floor {r['ratio']:.2f} "
                  f"(K/V read at {r['read_bandwidth_gbs']:.1f} GB/s)", flush=True)
            for name, b in r["buckets"].items():
                print(f"    rows {name:>9}: {b['steps']:>4} steps, {b['step_s']:.2f} s / floor {b['floor_s']:.2f} s = "
                      f"{b['ratio']:.2f}", flush=True)
        out["load_end"] = os.getloadavg()
        print(f"load at start {out['load_start'][0]:.1f}, at end {out['load_end'][0]:.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
