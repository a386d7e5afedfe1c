"""Multi-turn serving on the CPU: the same closed-loop workload through each system, in one run.

    python -m benchmarks.bench_engine                    # ~100M-parameter Llama, random weights
    python -m benchmarks.bench_engine --sessions 4 --turns 2 --new 8 --layers 2   # smoke run
    python -m benchmarks.bench_engine --model smollm2-135m-instruct   # real weights, real text prompts

Workload: `sessions` conversations (default 24) of `turns` turns (default 4), all starting at t=0. A session's next turn
arrives as soon as its previous answer is complete (think time 0; `--think S`: after a pause of 0.5-1.5 x S s,
seeded): the prompt is the whole
conversation so far plus `user` new tokens; every answer is exactly `new` greedy tokens (EOS off).
User tokens are random ids, or with --model (SmolLM2-135M-Instruct, stateful_hf.models) windows of the
bundled ShareGPT sample's text (benchmarks/multiturn/data), tokenized by the model's tokenizer.

  (a) stateless `model.generate`, one request at a time in arrival order (re-prefills everything);
  (b) transformers' continuous batching (`ContinuousBatchingManager`, block sharing = prefix caching);
  (b+) the same, with the main thread's idle OpenMP workers released before its loop starts: what
       (c) does in `Engine.start()` (stateful_hf/engine/openmp.py). Shows how much of (c)'s gain over
       (b) that alone explains.
  (c) stateful_hf.Engine (session KV kept across turns, unified prefill + decode steps).
  (l) llama.cpp's llama-server, with `--llama-server PATH --gguf FILE[,FILE...]` (one run per GGUF, after
      the others; benchmarks/llama_server.py says how to build it and make the GGUFs). Its answers are
      its own arithmetic: their agreement with the reference is reported, never required.

Both (b) and (c) step on a background thread. Before every run the main thread runs a parallel torch
op, as a user's main thread has after loading and warming up a model, so each run starts in that state.

Throughput = generated tokens / wall time. TTFT = arrival of a turn -> its first generated token
(queueing included). `--repeats N` runs (b) and (c) N times in alternating order and prints every
round's ratio: on a shared machine one pair of runs can swing by 30%. Not run by CI.

`--neighbour quiet,busy:2,bursty` runs the whole comparison once per condition, every system beside
the same neighbour processes (benchmarks/harness/neighbours.py: busy loops, a bursty second torch server),
started in fresh interpreters before the condition's first run and stopped after its last.
`--disk-dir DIR` gives the engine's store a disk tier, in a fresh subdirectory of DIR per run (removed after
it), with `--disk-write behind|evict` (the store's `disk_write`; default: the store's, behind) and
`--write-behind-delay S`: the wall is the serving only (the engine stops without the shutdown flush),
then the store closes with its flush, timed apart; each run's JSON says what write-behind wrote.
`--quantization` (with --model) loads every system's model quantized as the server's flag does.
`--dtype bfloat16` runs every system in bf16 and reports how many answers agree with (a) instead of
requiring them to be identical (exactness is promised in float32, where a mismatch fails the run).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import tempfile
import time
from collections import deque
from dataclasses import asdict, dataclass

import torch
import transformers
from transformers import GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from transformers.generation.streamers import BaseStreamer

from stateful_hf import Engine, SamplingParams, SessionStore
from stateful_hf.engine.openmp import release_thread_pool
from stateful_hf.models import SCHEMES
from stateful_hf.options import StoreOptions
from stateful_hf.options.store import DiskWrite

from .harness.closed_loop import closed_loop
from .harness.neighbours import Neighbours, parse
from .harness.threads import hold_main_pool


@dataclass(frozen=True, slots=True)
class Workload:
    sessions: int
    turns: int
    first: int           # tokens of the first user message
    user: int            # tokens of each later user message
    new: int             # generated tokens per turn
    vocab: int
    seed: int = 0
    text: tuple[int, ...] = ()   # a tokenized text: user tokens are windows of it instead of random ids
    think: float = 0.0   # mean seconds a session waits before each later turn (0: closed loop)

    def think_before(self, session: int, turn: int) -> float:
        """Seconds session `session` waits before turn `turn` (> 0): uniform in [0.5, 1.5] x think, seeded."""
        if turn == 0 or self.think <= 0:
            return 0.0
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + session * 1009 + turn + 7_919)
        return self.think * (0.5 + float(torch.rand((), generator=g)))

    def user_tokens(self, session: int, turn: int) -> list[int]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + session * 1009 + turn)
        n = self.first if turn == 0 else self.user
        if self.text:
            start = int(torch.randint(0, len(self.text), (1,), generator=g))
            return list((self.text[start:] + self.text * (1 + n // len(self.text)))[:n])
        return torch.randint(3, self.vocab, (n,), generator=g).tolist()

    def __repr__(self) -> str:
        return (f"Workload(sessions={self.sessions}, turns={self.turns}, first={self.first}, user={self.user}, "
                f"new={self.new}, {'text prompts' if self.text else f'random ids < {self.vocab}'}"
                + (f", think {self.think} s" if self.think else "") + ")")

    @property
    def max_context(self) -> int:
        return self.first + (self.turns - 1) * self.user + self.turns * self.new


@dataclass(frozen=True, slots=True)
class Result:
    name: str
    wall: float
    generated: int
    ttft: dict             # (session, turn) -> seconds from the turn's arrival to its first token
    outputs: dict          # (session, turn) -> generated ids
    queue: dict | None = None   # (session, turn) -> seconds from arrival to its first step (the engine only)
    disk: dict | None = None    # the engine's disk tier (--disk-dir): its options, what it wrote, the close's flush

    @property
    def throughput(self) -> float:
        return self.generated / self.wall

    def ttft_p(self, q: float, returning: bool = False) -> float:
        """The q-th percentile TTFT, of every turn or (`returning`) of the turns after the first."""
        values = [v for (_, t), v in self.ttft.items() if t > 0 or not returning]
        return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]

    def returning_ttft_p90(self) -> float:
        return self.ttft_p(90, returning=True)

    def returning_timeline(self) -> dict | None:
        """Returning turns' TTFT split (the engine only): arrival -> first scheduled in a step (queue:
        the step in flight, or a missed one) and first scheduled -> first token (its own steps), p50 / p90."""
        keys = [k for k in self.ttft if k[1] > 0]
        if not self.queue or len(keys) < 2:
            return None
        q = [self.queue[k] for k in keys]
        own = [self.ttft[k] - self.queue[k] for k in keys]
        p = lambda v, n: statistics.quantiles(v, n=100, method="inclusive")[n - 1]   # noqa: E731
        return {"queue_p50_s": p(q, 50), "queue_p90_s": p(q, 90), "own_steps_p50_s": p(own, 50),
                "own_steps_p90_s": p(own, 90)}


def build_model(layers: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> transformers.LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=16384, hidden_size=768, intermediate_size=2048, num_hidden_layers=layers,
                                   num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=4096,
                                   tie_word_embeddings=False, eos_token_id=2, bos_token_id=1, pad_token_id=0)
    model = transformers.LlamaForCausalLM(cfg).eval().to(dtype)
    model.generation_config.eos_token_id = None     # every answer is exactly `new` tokens
    return model


def load_named(name: str, dtype: torch.dtype = torch.float32, quantization: str | None = None):
    """(model, tokenizer) of a named model or path (stateful_hf.models), quantized with `quantization`."""
    from stateful_hf.models import load
    model, tokenizer = load(name, dtype=dtype, quantization=quantization)
    model.generation_config.eos_token_id = None     # every answer is exactly `new` tokens
    return model, tokenizer


class _FirstToken(BaseStreamer):
    """Records when generate emits its first generated token (the first `put` is the prompt)."""

    def __init__(self):
        self.calls, self.first = 0, None

    def put(self, value):
        self.calls += 1
        if self.calls == 2:
            self.first = time.perf_counter()

    def end(self):
        pass


def run_stateless(model, wl: Workload) -> Result:
    conv = {s: [] for s in range(wl.sessions)}
    start = time.perf_counter()
    queue = deque((start, s, 0) for s in range(wl.sessions))
    ttft, outputs = {}, {}
    with torch.inference_mode():
        while queue:
            arrival, s, t = queue.popleft()
            ids = conv[s] + wl.user_tokens(s, t)
            x = torch.tensor([ids])
            streamer = _FirstToken()
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=wl.new, min_new_tokens=wl.new,
                                 do_sample=False, pad_token_id=0, streamer=streamer)
            gen = out[0, len(ids):].tolist()
            ttft[(s, t)] = streamer.first - arrival
            outputs[(s, t)] = gen
            conv[s] = ids + gen
            if t + 1 < wl.turns:
                queue.append((time.perf_counter(), s, t + 1))
    wall = time.perf_counter() - start
    return Result("(a) stateless generate", wall, sum(map(len, outputs.values())), ttft, outputs)


def run_transformers_cb(model, wl: Workload, max_batch_tokens: int, page_size: int = 32,
                        release_pool: bool = False) -> Result:
    pages = wl.sessions * (-(-wl.max_context // page_size) + 2)
    gen_cfg = GenerationConfig(max_new_tokens=wl.new, do_sample=False, eos_token_id=-1, pad_token_id=0)
    cb_cfg = ContinuousBatchingConfig(allow_block_sharing=True, num_blocks=pages, page_size=page_size,
                                      max_batch_tokens=max_batch_tokens, max_requests_per_batch=wl.sessions)
    manager = model.init_continuous_batching(generation_config=gen_cfg, continuous_batching_config=cb_cfg)
    if release_pool and not release_thread_pool():
        raise RuntimeError("no libgomp pool to release: (b+) would be (b)")
    manager.start()
    conv = {s: [] for s in range(wl.sessions)}
    arrival, first, ttft, outputs = {}, {}, {}, {}

    def submit(s: int, t: int) -> None:
        ids = conv[s] + wl.user_tokens(s, t)
        conv[s] = ids
        arrival[f"{s}-{t}"] = time.perf_counter()
        manager.add_request(ids, request_id=f"{s}-{t}", max_new_tokens=wl.new, streaming=True, eos_token_id=-1)

    start = time.perf_counter()
    try:
        for s in range(wl.sessions):
            submit(s, 0)
        while len(outputs) < wl.sessions * wl.turns:
            r = manager.get_result(timeout=60)
            if r is None:
                raise RuntimeError("transformers continuous batching stopped producing results")
            if r.error:
                raise RuntimeError(f"transformers continuous batching failed: {r.error}")
            if r.request_id not in first and r.generated_tokens:
                first[r.request_id] = time.perf_counter()
                ttft[tuple(map(int, r.request_id.split("-")))] = first[r.request_id] - arrival[r.request_id]
            if r.is_finished():
                s, t = map(int, r.request_id.split("-"))
                outputs[(s, t)] = list(r.generated_tokens)
                conv[s] = conv[s] + outputs[(s, t)]
                if t + 1 < wl.turns:
                    submit(s, t + 1)
        wall = time.perf_counter() - start
    finally:
        manager.stop(block=True, timeout=30)
    name = "(b+) CB, pool released" if release_pool else "(b) transformers CB"
    return Result(name, wall, sum(map(len, outputs.values())), ttft, outputs)


def run_engine(model, wl: Workload, max_batch_tokens: int, layout: str = "paged",
               release_openmp_pool: bool = True, step_threads: int | str | None = "auto",
               batch_invariant: bool = False, store_options: dict | None = None,
               **engine_options) -> tuple[Result, Engine]:
    """`store_options`: more SessionStore options; a `disk_dir` there is a root: this run's tier is a fresh
    subdirectory of it, removed once the store closed (after the timed serving, with its flush)."""
    capacity = wl.sessions * (-(-(wl.max_context + 64) // 32) * 32)   # whole 32-token blocks (and slots)
    options = dict(store_options or {})
    root = options.pop("disk_dir", None)
    run_dir = tempfile.mkdtemp(prefix="bench-engine-", dir=root) if root is not None else None
    try:
        store = SessionStore(model, capacity, layout=layout, max_context=wl.max_context + 64,
                             batch_invariant=batch_invariant, disk_dir=run_dir, **options)
    except BaseException:
        if run_dir is not None:
            shutil.rmtree(run_dir, ignore_errors=True)
        raise
    engine = Engine(model, store=store, max_batch_tokens=max_batch_tokens, max_num_seqs=wl.sessions,
                    release_openmp_pool=release_openmp_pool, step_threads=step_threads, **engine_options)
    params = SamplingParams(max_new_tokens=wl.new, ignore_eos=True)
    ttft, queue = {}, {}

    def turn(s: int, t: int, ids: list[int]) -> list[int]:
        out = engine.submit(f"s{s}", ids, params).result()
        ttft[(s, t)], queue[(s, t)] = out.metrics.ttft, out.metrics.queue_time
        return list(out.token_ids)

    disk = None
    try:
        wall, outputs = closed_loop(wl, turn, around=engine if run_dir is None else _serving(engine))
        engine.store.check_integrity()
        if run_dir is not None:
            disk = _close_disk(store)
    finally:
        if run_dir is not None:
            shutil.rmtree(run_dir, ignore_errors=True)
    name = "(c') Engine, batch-invariant" if batch_invariant else "(c) stateful_hf.Engine"
    return Result(name, wall, sum(map(len, outputs.values())), ttft, outputs, queue, disk), engine


@contextlib.contextmanager
def _serving(engine: Engine):
    """The engine running; on exit stopped without the shutdown flush (`_close_disk` does it, untimed)."""
    engine.start()
    try:
        yield engine
    except BaseException:
        engine.stop(cancel=True, flush=None)
        raise
    engine.stop(flush=None)


def _close_disk(store: SessionStore) -> dict:
    """What the disk tier got while serving (write-behind's counters, the store's disk counters), then the
    store closed with its flush (what it wrote, its seconds) and write-behind's counters after the close (its stop
    lands the copies still queued: counted there, in neither of the others)."""
    o, c = store.options, store.stats().counters
    out = {"disk_write": o.disk_write.value, "write_behind_delay": o.write_behind_delay,
           "write_behind": asdict(store.writer.stats), "swapped_out_disk_tokens": c.swapped_out_disk,
           "swapped_in_disk_tokens": c.swapped_in_disk}
    start = time.perf_counter()
    report = store.close(flush=True)
    out["close_s"] = time.perf_counter() - start
    out["close_flush"] = asdict(report) if report is not None else None
    out["write_behind_at_close"] = asdict(store.writer.stats)   # + the copies the close's stop landed
    return out


def engine_threads(value: str) -> int | str | None:
    """--engine-threads: "auto", "shrink", "none" or an int."""
    return None if value == "none" else (value if value in ("auto", "shrink") else int(value))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, default=24, help="24 x 4 turns: the engine test's workload shape")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--first", type=int, default=48)
    ap.add_argument("--user", type=int, default=16)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--think", type=float, default=0.0,
                    help="mean seconds a session waits before each later turn (uniform 0.5-1.5x, seeded; 0: closed "
                         "loop): with --disk-dir, write-behind's default delay then finds idle sessions to copy")
    ap.add_argument("--model", help="a named model (smollm2-135m-instruct: fetched once; prompts are real text) or a "
                    "path; default: a random-weight Llama of --layers layers")
    ap.add_argument("--layers", type=int, default=12, help="12 layers of hidden 768 = ~100M parameters (no --model)")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--max-batch-tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    ap.add_argument("--engine-threads", type=engine_threads, default="auto",
                    help="Engine(step_threads=...): auto (free cores), an int, or none (torch's setting)")
    ap.add_argument("--arrival-window", type=float, default=0.005,
                    help="Engine(arrival_window=...): seconds the loop waits for next turns after a step that ended "
                         "requests (0: never)")
    ap.add_argument("--short-prefill", type=int, default=-1,
                    help="Engine(short_prefill_tokens=...): turns this short are served first; -1: the engine's "
                         "default, 0: plain arrival order")
    ap.add_argument("--skip", default="", help="comma-separated systems to skip: a,b,b+,c,c'")
    ap.add_argument("--batch-invariant", action="store_true",
                    help="also run (c'), the engine with batch_invariant=True, beside (c): its cost in one run")
    ap.add_argument("--layout", choices=("paged", "virtual"), default="paged",
                    help="the engine's device layout: paged blocks, or vAttention's contiguous slots")
    ap.add_argument("--attn-backend", choices=("auto", "torch", "cpu"), default="auto",
                    help="SessionStore(attn_backend=...): the engine's paged attention (cpu: the C++ kernel, built on "
                    "first use)")
    ap.add_argument("--neighbour", default="quiet",
                    help="comma-separated conditions, each run in full: quiet, busy:N, bursty[:N], joined by '+' "
                         "(benchmarks/harness/neighbours.py)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="rounds of (b), (b+) and (c), in rotating order; each system's median-throughput run is "
                         "reported, with the per-round throughput ratios of (c) and their medians")
    ap.add_argument("--compile", choices=("auto", "on", "off"), default="auto",
                    help="Engine(compile=...) of system (c): on = compile=True (inductor, compiled when each run's "
                    "engine is made, before its timed serving), off = False, auto = the engine's default")
    ap.add_argument("--json", help="write every figure, the per-round runs and the environment to this file")
    ap.add_argument("--llama-server", help="llama.cpp's llama-server binary: run the workload through it too")
    ap.add_argument("--gguf", default="", help="comma-separated GGUF files for --llama-server (one run each)")
    ap.add_argument("--disk-dir", help="give the engine's store a disk tier: each run in a fresh subdirectory of "
                    "this directory (removed after the run); the wall is the serving, the close's flush timed apart")
    ap.add_argument("--disk-write", choices=[m.value for m in DiskWrite],
                    help="SessionStore(disk_write=...) with --disk-dir: behind (write-behind) or evict; default: "
                    "the store's (behind)")
    ap.add_argument("--write-behind-delay", type=float, metavar="S",
                    help="SessionStore(write_behind_delay=...) with --disk-dir: seconds a finished turn waits before "
                    "its disk copies are queued; default: the store's")
    ap.add_argument("--quantization", choices=SCHEMES,
                    help="with --model: load it quantized (stateful_hf.models.load(quantization=...), as the "
                    "server's --quantization)")
    args = ap.parse_args()
    if args.quantization and not args.model:
        ap.error("--quantization needs --model (the random-weight Llama is not quantized)")
    if (args.disk_write or args.write_behind_delay is not None) and not args.disk_dir:
        ap.error("--disk-write and --write-behind-delay need --disk-dir")
    if args.disk_dir and not os.path.isdir(args.disk_dir):
        ap.error(f"--disk-dir {args.disk_dir}: not a directory")
    conditions = [c.strip() for c in args.neighbour.split(",") if c.strip()]
    if args.llama_server and not args.gguf or args.gguf and not args.llama_server:
        ap.error("--llama-server and --gguf go together")
    if args.llama_server and not os.access(args.llama_server, os.X_OK):
        print(f"(l) skipped: --llama-server {args.llama_server} is not an executable; "
              "benchmarks/llama_server.py says how to build it")
        args.llama_server = None
    for c in conditions:
        parse(c)                                   # an unknown neighbour fails before any model loads
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    skip = set(filter(None, args.skip.split(",")))
    systems = [x for x in ("b", "b+", "c'", "c") if x not in skip and (x != "c'" or args.batch_invariant)]
    if not systems:
        ap.error(f"--skip {args.skip} leaves no repeated system to run (b, b+, c; c' with --batch-invariant)")
    if args.model:
        from .multiturn.workload import text_ids
        loaded = {x: load_named(args.model, dtype, args.quantization) for x in ["a", *systems]}   # one per system
        models, tokenizer = {x: m for x, (m, _) in loaded.items()}, loaded["a"][1]
        wl = Workload(args.sessions, args.turns, args.first, args.user, args.new, vocab=tokenizer.vocab_size,
                      text=text_ids(tokenizer), think=args.think)
        c = models["a"].config
        described = f"{args.model}, {c.num_hidden_layers} layers, hidden {c.hidden_size}" + \
            (f", quantized {args.quantization}" if args.quantization else "")
    else:
        wl = Workload(args.sessions, args.turns, args.first, args.user, args.new, vocab=16000, think=args.think)
        models = {x: build_model(args.layers, dtype=dtype) for x in ["a", *systems]}   # identical weights
        described = f"Llama {args.layers} layers, hidden 768, random weights"
    n_params = sum(p.numel() for p in models["a"].parameters())
    print(f"model: {described}, {n_params / 1e6:.1f}M parameters, {args.dtype}, {torch.get_num_threads()} torch "
          f"threads; engine step_threads={args.engine_threads}")
    print(f"workload: {wl}; {wl.sessions * wl.turns} turns, {wl.sessions * wl.turns * wl.new} generated tokens")
    with torch.inference_mode():                                  # warm up torch's kernels once
        models["a"].generate(torch.tensor([wl.user_tokens(0, 0)]), max_new_tokens=2, do_sample=False, pad_token_id=0)
    report = {}
    for condition in conditions:
        print(f"\n== neighbours: {condition}", flush=True)
        with Neighbours(condition):
            report[condition] = run_condition(args, models, systems, skip, wl)
        if args.json:                              # after every condition: a cut-short run keeps what it measured
            _save(args, described, n_params, wl, report)
    if args.dtype == "float32":
        bad = {(cond, name): n for cond, r in report.items() for name, n in r["identical"].items() if n != r["answers"]}
        if bad:
            raise SystemExit(f"answers differ between systems in float32: {bad}")


def run_condition(args, models, systems, skip, wl) -> dict:
    """Every system under the current neighbours; prints the table, returns the figures."""
    load_start = os.getloadavg()
    print("load average at start (1/5/15 min): {:.1f} {:.1f} {:.1f}".format(*load_start))
    results = []
    if "a" not in skip:
        results.append(run_stateless(models["a"], wl))
        print(f"  {results[-1].name}: {results[-1].wall:.1f} s, 1-min load {os.getloadavg()[0]:.1f}", flush=True)
    runs: dict[str, list[Result]] = {x: [] for x in systems}
    engine = None
    for r in range(args.repeats):
        for system in systems[r % len(systems):] + systems[:r % len(systems)]:   # rotate: load drift hits all
            hold_main_pool()
            if system in ("c", "c'"):
                res, eng = run_engine(models[system], wl, args.max_batch_tokens, args.layout,
                                      step_threads=args.engine_threads, arrival_window=args.arrival_window,
                                      short_prefill_tokens=None if args.short_prefill < 0 else args.short_prefill,
                                      batch_invariant=system == "c'", store_options=store_options(args),
                                      compile={"on": True, "off": False}.get(args.compile, "auto")
                                      if system == "c" else "auto")
                engine = eng if system == "c" else engine
            else:
                res = run_transformers_cb(models[system], wl, args.max_batch_tokens, release_pool=system == "b+")
            runs[system].append(res)
            print(f"  {res.name}: {res.wall:.1f} s, 1-min load {os.getloadavg()[0]:.1f}", flush=True)
    for system in systems:
        ordered = sorted(runs[system], key=lambda x: x.throughput)
        results.append(ordered[len(ordered) // 2])
    external = []
    for gguf in filter(None, args.gguf.split(",")) if args.llama_server else ():
        from .llama_server import gguf_format, run_llama_server
        wall, ttft, outputs = run_llama_server(args.llama_server, gguf, wl, os.cpu_count() or 1)
        external.append(Result(f"(l) llama-server {gguf_format(gguf)}", wall, sum(map(len, outputs.values())),
                               ttft, outputs))
        print(f"  {external[-1].name}: {wall:.1f} s, 1-min load {os.getloadavg()[0]:.1f}", flush=True)
    ratios = {}
    for base in ("b", "b+"):
        if args.repeats > 1 and base in runs and "c" in runs:
            ratios[base] = [c.throughput / b.throughput for b, c in zip(runs[base], runs["c"], strict=True)]
            print(f"per-round engine/({base}) throughput: " + ", ".join(f"x{x:.2f}" for x in ratios[base])
                  + f"; median x{statistics.median(ratios[base]):.2f}")
    if "c'" in runs and "c" in runs:
        cost = [c.throughput / ci.throughput for ci, c in zip(runs["c'"], runs["c"], strict=True)]
        ratios["c'"] = cost
        print("batch invariance's cost, per round (c) / (c') throughput: " + ", ".join(f"x{x:.2f}" for x in cost)
              + f"; median x{statistics.median(cost):.2f}")
    # Systems run one after another: on a shared machine, other processes change the CPU they get.
    load_end = os.getloadavg()
    print("load average at end (1/5/15 min): {:.1f} {:.1f} {:.1f}".format(*load_end))
    print(f"\n{'system':<28}{'wall s':>8}{'tok/s':>8}{'TTFT p50':>10}{'TTFT p90':>10}{'ret. p90':>10}")
    for r in results + external:
        print(f"{r.name:<28}{r.wall:8.1f}{r.throughput:8.2f}{r.ttft_p(50):10.2f}{r.ttft_p(90):10.2f}"
              f"{r.returning_ttft_p90():10.2f}")
    reference = results[0]                  # (a) if it ran: the oracle; else the first system
    identical = {r.name: sum(r.outputs[k] == reference.outputs[k] for k in reference.outputs) for r in results[1:]}
    for r in results[1:]:
        print(f"answers of {r.name} identical to {reference.name}'s: {identical[r.name]}/{len(reference.outputs)}")
    agreement = {r.name: sum(r.outputs[k] == reference.outputs[k] for k in reference.outputs) for r in external}
    for name, n in agreement.items():
        print(f"answers of {name} equal to {reference.name}'s: {n}/{len(reference.outputs)} (not required)")
    if engine is not None:
        c = results[-1]
        for r in results[:-1] + external:
            print(f"engine vs {r.name}: throughput x{c.throughput / r.throughput:.2f}, "
                  f"TTFT p50 x{r.ttft_p(50) / c.ttft_p(50):.2f} lower, p90 x{r.ttft_p(90) / c.ttft_p(90):.2f} lower, "
                  f"returning turns' p90 x{r.returning_ttft_p90() / c.returning_ttft_p90():.2f}"
                  " lower")
        tl = c.returning_timeline()
        if tl is not None:
            print("engine's returning turns: arrival -> first step (queue) p50 {queue_p50_s:.3f} / p90 "
                  "{queue_p90_s:.3f} s, first step -> first token p50 {own_steps_p50_s:.3f} / p90 "
                  "{own_steps_p90_s:.3f} s".format(**tl))
        st = engine.stats()
        sizer = engine.thread_sizer
        if c.disk is not None:
            d, wb, fl = c.disk, c.disk["write_behind"], c.disk["close_flush"] or {}
            print(f"engine's disk tier (disk_write={d['disk_write']}, delay {d['write_behind_delay']} s): "
                  f"write-behind wrote {wb['written']} chunks in {wb['batches']} batches (skipped {wb['skipped']}, "
                  f"dropped {wb['dropped']}), {d['swapped_out_disk_tokens']} tokens evicted to disk while serving; "
                  f"the close flushed {fl.get('chunks_written', 0)} chunks in {d['close_s']:.2f} s (untimed)")
        print(f"engine: {st.steps} steps, mean {st.mean_batch_tokens:.1f} rows/step, prompt rows {st.prompt_tokens}, "
              f"recomputed {st.recomputed_tokens}, occupancy {st.mean_occupancy:.0%}"
              + (f", steps by team size {dict(sorted(sizer.steps_by_threads.items()))}" if sizer else "")
              + f"; {st.compiled_steps} steps compiled: {st.compile}; linear layers: {st.linear}")
    return {"load_start": load_start, "load_end": load_end, "median_runs": [_figures(r, wl) for r in results],
            "llama_server": [_figures(r, wl) for r in external], "llama_server_agreement": agreement,
            "rounds": {x: [_figures(r, wl) for r in rs] for x, rs in runs.items()},
            "engine_over": {b: {"per_round": v, "median": statistics.median(v)} for b, v in ratios.items()},
            "identical": identical, "reference": reference.name, "answers": len(reference.outputs),
            "engine_steps_by_threads": dict(engine.thread_sizer.steps_by_threads)
            if engine is not None and engine.thread_sizer else None,
            "engine_attention": None if engine is None else {
                "rule": engine.store.step_backends.describe(),
                "measured_rows_torch_s_cpp_s": engine.store.step_backends.measured},
            "engine_compile": None if engine is None else engine.stats().compile,
            "engine_linear": None if engine is None else engine.stats().linear,
            "engine_compiled_steps": None if engine is None else engine.stats().compiled_steps}


def store_options(args) -> dict:
    """The engine store's options from the command line (--disk-dir and what goes with it)."""
    out = {} if args.disk_dir is None else {"disk_dir": args.disk_dir}
    if args.attn_backend != "auto":
        out["attn_backend"] = args.attn_backend
    if args.disk_write is not None:
        out["disk_write"] = args.disk_write
    if args.write_behind_delay is not None:
        out["write_behind_delay"] = args.write_behind_delay
    return out


def _figures(r: Result, wl: Workload) -> dict:
    out = {"name": r.name, "wall_s": r.wall, "generated": r.generated, "tok_per_s": r.throughput,
           "ttft_p50_s": r.ttft_p(50), "ttft_p90_s": r.ttft_p(90),
           "returning_ttft_p90_s": r.returning_ttft_p90(), "returning_timeline": r.returning_timeline()}
    if r.disk is not None:
        out["disk"] = r.disk
    return out


def _save(args, described, n_params, wl, report) -> None:
    import json
    import platform
    import sys
    out = {"command": "python -m benchmarks.bench_engine " + " ".join(sys.argv[1:]),
           "model": described, "parameters": n_params, "dtype": args.dtype, "torch": torch.__version__,
           "transformers": transformers.__version__, "threads": torch.get_num_threads(),
           "engine_threads": args.engine_threads, "arrival_window": args.arrival_window,
           "short_prefill": args.short_prefill, "processor": platform.processor() or platform.machine(),
           "cpus": os.cpu_count(), "quantization": args.quantization, "attn_backend": args.attn_backend,
           "compile": args.compile,
           "disk": {"disk_dir": args.disk_dir, "disk_write": args.disk_write or StoreOptions.disk_write.value,
                    "write_behind_delay": StoreOptions.write_behind_delay if args.write_behind_delay is None
                    else args.write_behind_delay} if args.disk_dir else None,
           "workload": {k: getattr(wl, k) for k in ("sessions", "turns", "first", "user", "new")},
           "conditions": report}
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
