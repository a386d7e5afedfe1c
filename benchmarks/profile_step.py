"""Where a step's time goes, against this CPU's GEMM rate: the engine beside transformers' CB.

    python -m benchmarks.profile_step                       # 8 new 360-token prompts, then 23 decode steps
    python -m benchmarks.profile_step --prompts 8 --prompt-len 360 --decode 23 --threads 2
    python -m benchmarks.profile_step --model smollm2-135m-instruct --dtype bfloat16 --prompts 24 --prompt-len 64
    python -m benchmarks.profile_step --compute-free          # the step's host time: engine vs the model's forward
    python -m benchmarks.profile_step --compute-free --compile   # the same with the engine's compiled step too
    python -m benchmarks.profile_step --compute-free --attn-backends cpu   # and an engine on the C++ attention kernel
    python -m benchmarks.profile_step --model smollm2-135m-instruct --prompts 24 --turns 4 --prompt-len 48 --user 16 \
        --decode 31 --no-profile --prepack on --compile     # the roofline of the eager and the compiled step

The compute-free mode (`compute_free`): a 30-layer Llama of width 64 (compute ~0, so what a step costs is
host time: Python, dispatch, launches), ROWS sessions decoding one token a step. Reported at 1 and 2 threads:
the engine's decode step (`StepRecord.seconds`: planning, forward, sampling and commit; median) against the
model's own eager forward over the same rows (a fresh copy of the model, transformers' `DynamicCache`, the
ROWS sequences batched: median), and their ratio (issue 51's target: <= 1.1 eager, <= 0.5 compiled).

The roofline (`roofline`, after the profiled runs, without the profiler; CB needs the model before the
engine switches its attention): the engine serves bench_engine's closed loop (`--prompts` sessions of `--turns`
turns: `--prompt-len` tokens first, `--user` tokens each later turn, `--decode` + 1 answer tokens; a session's
next turn is submitted when its answer ends), its steps run one at a time on this thread, and after each one its
GEMM shapes are timed with every kernel and dtype this CPU offers the engine (`harness/gemm_floor.py`: matmul
in float32, in bf16 where the CPU has bf16 units, MKL's and oneDNN's packed kernels), in the same process and
neighbour condition. A step's floor is its GEMM FLOPs (every decoder layer's projections at its row count, the
LM head on its sampled rows) at the best time measured for those shapes, whichever kernel the engine uses
(so a slower engine kernel does not lower the bar), plus the K/V its attention reads (every entry's context,
every layer, the model's dtype) at the read bandwidth measured here. Reported: Σ step / Σ floor over the run and
per row-count bucket, the floor's GFLOP/s and which kernel set it.

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
import statistics
import sys
import threading
import time
from collections import Counter

import torch
from torch.profiler import ProfilerActivity, profile

from .bench_engine import Workload, build_model, engine_threads
from .harness.gemm_floor import GemmFloor
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


def roofline(model, wl: Workload, max_batch_tokens: int, gemm: GemmFloor, bandwidth: float,
             **engine_options) -> dict:
    """Σ step / Σ floor of the engine's steps serving `wl` (bench_engine's closed loop, think time 0: a
    session's next turn is submitted as its answer ends), stepped on this thread. After each step its GEMM
    shapes are measured with every candidate kernel (`gemm`, the same neighbours); at the end each step's
    floor is its GEMM FLOPs at the best time measured for its row count and shapes, plus the K/V its
    attention read at `bandwidth`."""
    from stateful_hf import Engine, SamplingParams, SessionStore
    from stateful_hf.integration.adapter import decoder_layers

    capacity = wl.sessions * (-(-(wl.max_context + 64) // 32) * 32)
    store = SessionStore(model, capacity, max_context=wl.max_context + 64)
    engine = Engine(model, store=store, max_batch_tokens=max_batch_tokens, max_num_seqs=wl.sessions,
                    **engine_options)
    packed = engine.runner.packed
    shapes = Counter((m.in_features, m.out_features) for layer in decoder_layers(model) for m in layer.modules()
                     if isinstance(m, torch.nn.Linear))
    head = model.get_output_embeddings()
    head_shape = (head.in_features, head.out_features)
    a = store.adapter
    kv_bytes_per_token = 2 * a.num_layers * a.num_kv_heads * a.head_dim * next(model.parameters()).element_size()
    params = SamplingParams(max_new_tokens=wl.new, ignore_eos=True)
    engine.submit("warm-up", wl.user_tokens(0, 0)[:48], SamplingParams(max_new_tokens=3, ignore_eos=True))
    while engine.has_work():                       # first touch of the pool and workspaces
        engine.step()
    conv: dict[int, list[int]] = {s: [] for s in range(wl.sessions)}
    turns: dict[int, int] = dict.fromkeys(range(wl.sessions), 0)
    handles: dict = {}
    generated = 0

    def submit(s: int) -> None:
        conv[s] = conv[s] + wl.user_tokens(s, turns[s])
        handles[s] = engine.submit(f"s{s}", conv[s], params)

    for s in range(wl.sessions):
        submit(s)
    steps: list[tuple[int, int, int, int, float]] = []     # rows, sampled, context read, threads, seconds
    while handles:
        t0 = time.perf_counter()
        record = engine.step()
        step_s = time.perf_counter() - t0
        if record is not None:
            sampled = sum(1 for e in record.entries if e[3])
            context = sum(len(store.token_ids(e[0])) for e in record.entries)
            steps.append((record.num_tokens, sampled, context, torch.get_num_threads(), step_s))
            gemm.measure(record.num_tokens, shapes)
            gemm.measure(sampled, [head_shape])
        for s, h in list(handles.items()):
            if h.done:
                answer = list(h.result().token_ids)
                conv[s] = conv[s] + answer
                generated += len(answer)
                turns[s] += 1
                del handles[s]
                if turns[s] < wl.turns:
                    submit(s)
    engine.store.check_integrity()
    return {"steps_raw": steps, "shapes": shapes, "head_shape": head_shape, "kv_bytes_per_token": kv_bytes_per_token,
            "bandwidth": bandwidth, "kernel": str(packed.kernel) if packed else "stock",
            "generated": generated, "compile": engine.stats().compile}


def floors(run: dict, gemm: GemmFloor) -> dict:
    """Σ step / Σ floor of a `roofline` run, over the run and per row-count bucket, each step's GEMM floor at the
    best time `gemm` measured for its shapes (after every run: a later run's measurements count too)."""
    shapes, head_shape = run["shapes"], run["head_shape"]
    rows_out = []                                  # rows, step s, GEMM floor s, K/V floor s, GEMM FLOPs, kernels
    for rows, sampled, context, threads, step_s in run["steps_raw"]:
        won: Counter = Counter()
        gemm_s, flop = 0.0, 0
        for (k, n), count in shapes.items():
            t, kernel = gemm.best(rows, k, n, threads)
            gemm_s += count * t
            flop += 2 * count * rows * k * n
            won[kernel] += count
        if sampled:
            t, kernel = gemm.best(sampled, *head_shape, threads)
            gemm_s += t
            flop += 2 * sampled * head_shape[0] * head_shape[1]
            won[kernel] += 1
        rows_out.append((rows, step_s, gemm_s, context * run["kv_bytes_per_token"] / run["bandwidth"], flop, won))

    def summary(sel) -> dict:
        step_s, gemm_s, kv_s = (sum(r[i] for r in sel) for i in (1, 2, 3))
        won: Counter = sum((r[5] for r in sel), Counter())
        return {"steps": len(sel), "step_s": step_s, "floor_s": gemm_s + kv_s, "gemm_floor_s": gemm_s,
                "kv_floor_s": kv_s, "ratio": step_s / (gemm_s + kv_s),
                "gemm_gflops_at_floor": sum(r[4] for r in sel) / gemm_s / 1e9, "floor_kernels": dict(won)}

    per_bucket = {}
    lo = 0
    for hi in BUCKETS:
        sel = [r for r in rows_out if lo < r[0] <= hi]
        if sel:
            per_bucket[f"{lo + 1}-{hi}" if hi < 1 << 30 else f">{lo}"] = summary(sel)
        lo = hi
    return {**summary(rows_out), "read_bandwidth_gbs": run["bandwidth"] / 1e9, "kernel": run["kernel"],
            "compile": run["compile"],
            "generated": run["generated"], "steps_by_threads": dict(Counter(r[3] for r in run["steps_raw"])),
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


def compute_free(threads: int, rows: int = 16, context: int = 64, decode: int = 24, compile: bool = False,
                 attn_backends: tuple[str, ...] = ()) -> dict:
    """Median decode step (ms) of the engine and of the model's eager forward, `rows` sequences of `context`
    tokens decoding `decode` tokens, at `threads` torch threads, on this thread. Interleaved: each round is one
    step of every engine (eager, compiled with `compile`, and one eager engine per `attn_backends` name, keyed
    "eager[name]") then one forward of the model, so a neighbour's burst falls on both sides of the ratio."""
    from transformers import DynamicCache

    from stateful_hf import Engine, SamplingParams, SessionStore

    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(3, 512, (rows, context), generator=g)
    plain = compute_free_model()
    engines, start_s = {}, {}
    variants = [("eager", False, "auto")] + ([("compiled", True, "auto")] if compile else []) \
        + [(f"eager[{b}]", False, b) for b in attn_backends]
    for name, option, backend in variants:
        model = compute_free_model()
        store = SessionStore(model, rows * (context + decode + 64), attn_backend=backend)
        t0 = time.perf_counter()
        engines[name] = Engine(model, store=store, max_batch_tokens=max(rows * context, 64), max_num_seqs=rows,
                               step_threads=None, compile=option, release_openmp_pool=False)
        start_s[name] = time.perf_counter() - t0
        for i in range(rows):
            engines[name].submit(f"s{i}", prompts[i].tolist(), SamplingParams(max_new_tokens=decode + 1,
                                                                               ignore_eos=True))
    steps: dict[str, list[float]] = {name: [] for name in engines}
    times = []
    with torch.inference_mode():
        cache = DynamicCache(config=plain.config)
        nxt = plain(prompts, past_key_values=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
    while any(e.has_work() for e in engines.values()):
        for name, engine in engines.items():
            record = engine.step() if engine.has_work() else None
            if record is not None and record.num_decode == rows:
                steps[name].append(record.seconds)
        with torch.inference_mode():
            t0 = time.perf_counter()
            out = plain(nxt, past_key_values=cache, use_cache=True)
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            times.append(time.perf_counter() - t0)
    forward_ms = 1e3 * statistics.median(times)
    result = {"threads": threads, "rows": rows, "context": context, "forward_ms": forward_ms}
    for name, engine in engines.items():
        step_ms = 1e3 * statistics.median(steps[name])
        result[name] = {"step_ms": step_ms, "ratio": step_ms / forward_ms, "decode_steps": len(steps[name]),
                        "start_s": start_s[name], "compile": engine.stats().compile}
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
    ap.add_argument("--prompts", type=int, default=8, help="sessions (their first prompts served together)")
    ap.add_argument("--prompt-len", type=int, default=360, help="tokens of each session's first user message")
    ap.add_argument("--decode", type=int, default=23, help="decode steps of each turn after its first token")
    ap.add_argument("--turns", type=int, default=1, help="roofline: turns per session (bench_engine's closed loop)")
    ap.add_argument("--user", type=int, default=16, help="roofline: tokens of each later user message")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--max-batch-tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--engine-threads", type=engine_threads, default="auto")
    ap.add_argument("--prepack", nargs="+", default=["auto", "off"], choices=("auto", "on", "off"),
                    help="the roofline once per engine prepack_weights mode, in this order")
    ap.add_argument("--no-profile", action="store_true", help="the roofline only (no profiler run, no CB)")
    ap.add_argument("--neighbour", default="quiet")
    ap.add_argument("--compute-free", action="store_true", help="the compute-free mode only (see above)")
    ap.add_argument("--compile", action="store_true", help="the engine's compiled step too (compile=True: "
                    "inductor, compiled at engine start): beside the eager engines in the compute-free mode, and as "
                    "one more roofline after the --prepack ones (prepacked as the first of them)")
    ap.add_argument("--repeats", type=int, default=3, help="compute-free: runs at each thread count (medians)")
    ap.add_argument("--cf-threads", type=int, nargs="+", default=[1, 2], help="compute-free: the thread counts")
    ap.add_argument("--attn-backends", nargs="+", default=[], choices=("torch", "cpu"),
                    help="compute-free: an eager engine per paged attention backend too, beside the default's "
                    "(\"cpu\": the C++ kernel, built on first use)")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.compute_free:
        out = {"command": "python -m benchmarks.profile_step " + " ".join(sys.argv[1:]), "load_start": os.getloadavg(),
               "cpu": GemmFloor().describe(), "runs": []}
        names = ("eager", "compiled", *(f"eager[{b}]" for b in args.attn_backends))
        with Neighbours(args.neighbour):
            for _ in range(args.repeats):
                for threads in args.cf_threads:
                    r = compute_free(threads, compile=args.compile, attn_backends=tuple(args.attn_backends))
                    out["runs"].append(r)
                    print(f"compute-free, {threads} thread(s), {r['rows']} rows of {r['context']}+ tokens: model's "
                          f"eager forward {r['forward_ms']:.2f} ms; " + "; ".join(
                              f"engine {k} step {r[k]['step_ms']:.2f} ms = x{r[k]['ratio']:.2f} ({r[k]['compile']}, "
                              f"engine made in {r[k]['start_s']:.1f} s)" for k in names if k in r),
                          flush=True)
        out["median_ratio"] = {f"{k}_{t}": statistics.median(r[k]["ratio"] for r in out["runs"] if r["threads"] == t)
                               for t in args.cf_threads for k in names if k in out["runs"][0]}
        print("median ratios over the repeats: " + ", ".join(f"{k} thread(s) x{v:.2f}"
                                                            for k, v in out["median_ratio"].items()))
        out["load_end"] = os.getloadavg()
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    text: tuple[int, ...] = ()
    if args.model:
        from stateful_hf.models import load

        from .multiturn.workload import text_ids
        model, tokenizer = load(args.model, dtype=dtype)
        model.generation_config.eos_token_id = None
        text = text_ids(tokenizer)
    else:
        model = build_model(args.layers, dtype=dtype)
    wl = Workload(args.prompts, args.turns, args.prompt_len, args.user, args.decode + 1,
                  vocab=min(model.config.vocab_size, 16000), text=text)
    prompts = [wl.user_tokens(s, 0) for s in range(wl.sessions)]
    rows = args.prompts * args.prompt_len + args.prompts * args.decode
    flop = linear_flop(model, rows, args.prompts * (args.decode + 1))
    cfg = model.config
    shapes = [(args.max_batch_tokens, cfg.hidden_size, n) for n in
              (cfg.hidden_size, 2 * 256, cfg.intermediate_size * 2)] + [(args.max_batch_tokens, cfg.intermediate_size,
                                                                          cfg.hidden_size)]
    gemm = GemmFloor()
    out = {"command": "python -m benchmarks.profile_step " + " ".join(sys.argv[1:]), "model": args.model or "random",
           "dtype": args.dtype, "workload": repr(wl), "cpu": gemm.describe()}
    print(f"CPU: {gemm.describe()}; workload {wl}")
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
        bandwidth = read_bandwidth()
        variants = {mode: {"prepack_weights": mode} for mode in args.prepack}
        if args.compile:                           # the compiled step (inductor) beside them, prepacked as the first
            variants[f"{args.prepack[0]}, compiled"] = {"prepack_weights": args.prepack[0], "compile": True}
        runs = {name: roofline(model, wl, args.max_batch_tokens, gemm, bandwidth, step_threads=args.engine_threads,
                               **options) for name, options in variants.items()}
        for mode, run in runs.items():
            r = floors(run, gemm)
            out.setdefault("roofline", {})[mode] = r
            print(f"roofline, prepack_weights={mode} ({r['kernel']}): {r['steps']} steps {r['steps_by_threads']}, "
                  f"sum of steps {r['step_s']:.2f} s, sum of floors {r['floor_s']:.2f} s (GEMM {r['gemm_floor_s']:.2f} "
                  f"at {r['gemm_gflops_at_floor']:.0f} GFLOP/s, K/V {r['kv_floor_s']:.2f} at "
                  f"{r['read_bandwidth_gbs']:.1f} GB/s): step / floor {r['ratio']:.2f}", flush=True)
            for name, b in r["buckets"].items():
                print(f"    rows {name:>9}: {b['steps']:>4} steps, {b['step_s']:.2f} s / floor {b['floor_s']:.2f} s = "
                      f"{b['ratio']:.2f}; floor GEMMs {b['floor_kernels']}", flush=True)
        out["gemm_times"] = {f"{t} threads {kernel} {m}x{k}x{n}": s for (t, kernel, m, k, n), s in gemm.times.items()}
        out["load_end"] = os.getloadavg()
        print(f"load at start {out['load_start'][0]:.1f}, at end {out['load_end'][0]:.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
