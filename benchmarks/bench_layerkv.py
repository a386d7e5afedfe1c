"""LayerKV on the CPU: long-prompt arrivals under a tight device budget, four engines in one run.

    python -m benchmarks.bench_layerkv --quick     # 10 prompts of 1K-2K tokens, ~2.5 min on 2 cores
    python -m benchmarks.bench_layerkv             # 16 prompts of 1K-8K tokens, 0.3/s, 256 new tokens (~6 min)

Workload: `requests` single-turn requests, prompt lengths uniform in [min_prompt, max_prompt], Poisson
arrivals at `rate` per second (open loop, same schedule for every engine), `new` greedy tokens each
(EOS off). The device holds `device_tokens` of KV (default 1.25 x the longest prompt), the host tier
enough for all of it. Long answers keep decodes holding device blocks while the next long prompts
arrive: LayerKV's setting, where a prefill waits for blocks rather than for compute.
Engines (same model, fresh store each):

  base      Engine as it is (chunked prefill, suspension when blocks run out)
  layerkv   Engine(layerwise_kv=True): a prefill that does not fit keeps fewer layers on the device
  slo       Engine(ttft_slo=, tpot_slo=): SLO-aware admission only
  layerkv+slo  both

TTFT = arrival -> first token (queueing included). Ratios are base / engine for TTFT (higher is
better) and engine / base for throughput (generated tokens / wall time from first arrival to last
finish). SLOs default to multiples of an isolated run's TTFT and TPOT (measured first, after a warm-up
request). Outputs of all engines must be identical (greedy). Not run by CI.
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
from dataclasses import dataclass

import torch
import transformers

from stateful_hf import Engine, SamplingParams, SessionStore
from stateful_hf.profile.cost import measure_cost_profile

ENGINES = ("base", "layerkv", "slo", "layerkv+slo")


def build_model(layers: int, max_positions: int) -> transformers.LlamaForCausalLM:
    """A small Llama (GQA 4:2, head dim 64), random weights, EOS off."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                                   tie_word_embeddings=False, eos_token_id=2, bos_token_id=1, pad_token_id=0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = None
    return model


@dataclass(frozen=True, slots=True)
class Run:
    name: str
    wall: float
    generated: int
    ttft: list[float]
    tpot: list[float]
    outputs: list[tuple[int, ...]]
    failed: int
    layered: int
    pushed: int
    suspensions: int

    @property
    def throughput(self) -> float:
        return self.generated / self.wall

    def p(self, xs: list[float], q: float) -> float:
        return statistics.quantiles(xs, n=100, method="inclusive")[q - 1] if len(xs) > 1 else xs[0]


def workload(args) -> list[tuple[float, list[int]]]:
    g = torch.Generator().manual_seed(args.seed)
    t, out = 0.0, []
    for _ in range(args.requests):
        n = int(torch.randint(args.min_prompt, args.max_prompt + 1, (), generator=g))
        out.append((t, torch.randint(3, 4096, (n,), generator=g).tolist()))
        t += float(torch.empty(()).exponential_(args.rate, generator=g))
    return out


def make_engine(name: str, model, profile, args, ttft_slo: float | None, tpot_slo: float | None) -> Engine:
    layerwise = name.startswith("layerkv")
    store = SessionStore(model, args.device_tokens, chunk_size=32, host_capacity=args.host_tokens,
                         cost_profile=profile, attn_backend="torch", layerwise_kv=layerwise, swap_out_threshold=0.0)
    slo = name.endswith("slo")
    return Engine(model, store=store, max_batch_tokens=args.max_batch_tokens, layerwise_kv=layerwise,
                  ttft_slo=ttft_slo if slo else None, tpot_slo=tpot_slo if slo else None)


def run(name: str, model, profile, args, jobs, ttft_slo, tpot_slo) -> Run:
    engine = make_engine(name, model, profile, args, ttft_slo, tpot_slo).start()
    handles: list = [None] * len(jobs)
    t0 = time.monotonic()

    def submit():
        for i, (at, ids) in enumerate(jobs):
            time.sleep(max(0.0, t0 + at - time.monotonic()))
            handles[i] = engine.submit(f"r{i}", ids, SamplingParams(max_new_tokens=args.new))

    feeder = threading.Thread(target=submit)
    feeder.start()
    feeder.join()
    outs = [h.result(timeout=3600) for h in handles]
    wall = max(o.metrics.arrival_time + o.metrics.latency for o in outs) - t0
    engine.stop()
    engine.store.check_integrity()
    st = engine.stats()
    ok = [o for o in outs if o.error is None]
    return Run(name, wall, sum(len(o.token_ids) for o in ok), [o.metrics.ttft for o in ok],
               [o.metrics.tpot for o in ok if o.metrics.tpot is not None], [tuple(o.token_ids) for o in outs],
               len(outs) - len(ok), st.layered_admissions, st.pushed_blocks, sum(o.metrics.suspensions for o in outs))


def calibrate(model, profile, args) -> tuple[float, float]:
    """(isolated TTFT of the longest prompt, mean TPOT of 4 lone decodes) on an idle engine."""
    engine = make_engine("base", model, profile, args, None, None)
    ids = torch.randint(3, 4096, (args.max_prompt,), generator=torch.Generator().manual_seed(1)).tolist()
    engine.generate(["warm"], [ids[:256]], SamplingParams(max_new_tokens=4))      # first-call costs off the clock
    long = engine.generate(["cal"], [ids], SamplingParams(max_new_tokens=2))[0]
    short = engine.generate([f"d{i}" for i in range(4)], [ids[:64 + i] for i in range(4)],
                            SamplingParams(max_new_tokens=16))
    return long.metrics.ttft, statistics.mean(o.metrics.tpot for o in short)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--quick", action="store_true",
                    help="10 requests of 1K-2K tokens, 96 new tokens, 0.4/s (~2.5 min on 2 cores)")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--min-prompt", type=int, default=1024)
    ap.add_argument("--max-prompt", type=int, default=8192)
    ap.add_argument("--new", type=int, default=256, help="generated tokens per request")
    ap.add_argument("--rate", type=float, default=0.3, help="arrivals per second")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--device-tokens", type=int, default=None, help="device KV budget (default 1.25 x max prompt)")
    ap.add_argument("--max-batch-tokens", type=int, default=512)
    ap.add_argument("--ttft-slo", type=float, default=None, help="seconds (default 2 x isolated max-prompt TTFT)")
    ap.add_argument("--tpot-slo", type=float, default=None, help="seconds (default 3 x isolated TPOT)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip", default="", help="comma-separated engines to skip, e.g. slo,layerkv+slo")
    args = ap.parse_args(argv)
    if args.quick:
        args.requests, args.min_prompt, args.max_prompt, args.new, args.rate = 10, 1024, 2048, 96, 0.4
    torch.set_num_threads(args.threads)
    args.device_tokens = args.device_tokens or int(1.25 * args.max_prompt)
    args.host_tokens = args.requests * (args.max_prompt + args.new) + args.device_tokens
    model = build_model(args.layers, args.max_prompt + args.new + 64)
    load0 = os.getloadavg()
    t_start = time.time()
    profile = measure_cost_profile(model, SessionStore(model, 64, chunk_size=32, policy="lru").spec)
    iso_ttft, iso_tpot = calibrate(model, profile, args)
    ttft_slo = args.ttft_slo or 2 * iso_ttft
    tpot_slo = args.tpot_slo or 3 * iso_tpot
    jobs = workload(args)
    print(f"model: Llama {args.layers} layers, hidden 256, GQA 4:2; prompts {args.min_prompt}-{args.max_prompt} "
          f"tokens, {args.requests} requests at {args.rate:.3f}/s, {args.new} new tokens each; device budget "
          f"{args.device_tokens} tokens; threads {args.threads}")
    print(f"isolated: max-prompt TTFT {iso_ttft:.2f} s, TPOT {iso_tpot * 1e3:.1f} ms -> SLOs TTFT {ttft_slo:.2f} s, "
          f"TPOT {tpot_slo * 1e3:.1f} ms")
    skip = {s for s in args.skip.split(",") if s}
    runs = {}
    for name in ENGINES:
        if name in skip:
            continue
        runs[name] = run(name, model, profile, args, jobs, ttft_slo, tpot_slo)
        print(f"  {name}: done in {runs[name].wall:.1f} s", flush=True)
    load1 = os.getloadavg()
    base = runs.get("base")
    print()
    print("| engine | mean TTFT s | p99 TTFT s | mean TTFT ratio | p99 TTFT ratio | TTFT SLO viol. | TPOT SLO viol. "
          "| tok/s | throughput vs base | layered adm. | pushed blocks | suspensions | failed |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, r in runs.items():
        mean, p99 = statistics.mean(r.ttft), r.p(r.ttft, 99)
        ratio = (f"x{statistics.mean(base.ttft) / mean:.2f}", f"x{base.p(base.ttft, 99) / p99:.2f}",
                 f"{r.throughput / base.throughput:.1%}") if base else ("-", "-", "-")
        ttft_v = sum(t > ttft_slo for t in r.ttft) / len(r.ttft)
        tpot_v = sum(t > tpot_slo for t in r.tpot) / max(len(r.tpot), 1)
        print(f"| {name} | {mean:.2f} | {p99:.2f} | {ratio[0]} | {ratio[1]} | {ttft_v:.0%} | {tpot_v:.0%} | "
              f"{r.throughput:.1f} | {ratio[2]} | {r.layered} | {r.pushed} | {r.suspensions} | {r.failed} |")
    same = len({tuple(r.outputs) for r in runs.values()}) == 1
    print(f"\nidentical answers across engines: {'yes' if same else 'NO'}; wall {time.time() - t_start:.0f} s; "
          f"load average before {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f}, after {load1[0]:.2f} {load1[1]:.2f} "
          f"{load1[2]:.2f} (os.getloadavg, 1/5/15 min)")


if __name__ == "__main__":
    main()
