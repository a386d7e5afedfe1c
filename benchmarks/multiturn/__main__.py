"""Multi-turn serving benchmark: stateful_hf vs stateless generate vs transformers' continuous batching.

    python -m benchmarks.multiturn --quick --json multiturn.json --plots plots/
    python -m benchmarks.multiturn --data benchmarks/multiturn/data/sample_sharegpt.json --rate 0.5
    python -m benchmarks.multiturn --users 8 --think-time 2 --conversations 32
    python -m benchmarks.multiturn --quick --model smollm2-135m-instruct    # real weights, real text
    python -m benchmarks.multiturn --quick --system-prompt 512      # one 512-token prompt opens every conversation

Conversations (ShareGPT-format file via `datasets`, or synthesized with Pensieve's ShareGPT/UltraChat
statistics, lengths scaled by --scale) arrive as a Poisson process (--rate conversations/s) or through
--users concurrent users; a conversation's next turn is sent only after the previous answer plus an
exponential think time (--think-time mean). Every system serves the same schedule on the same model
(a ~100M-parameter Llama with random weights unless --layers changes it; --model smollm2-135m-instruct:
SmolLM2-135M-Instruct with real text prompts), float32, greedy, EOS
ignored so every answer has the workload's length, and the same device KV budget (--kv-budget).
With --system-prompt N every conversation opens with the same N tokens (a system prompt) and the
systems default to stateful_hf (prefix sharing), stateful_hf_unshared (each session its own copy) and
transformers' CB with block sharing; the summary adds the device tokens each held at peak and the
TTFT of first turns (docs/prefix-sharing.md).

Pensieve's think time is 60 s and its lengths are full size; on this CPU (a 100M model decodes a few
tens of tokens per second) both are scaled down: the values used are printed and stored in the JSON.
Not run by CI.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from ..harness.models import build, kv_bytes_per_token, n_params
from . import report
from .arrivals import Arrivals
from .bench import ALL_SYSTEMS, SHARING_SYSTEMS, Bench, Config, budget_for, experiment, policy_budget_for, warm_up
from .policy import load_cost_profile, replay_workload
from .workload import load_sharegpt, synthesize, text_ids, with_system_prompt

QUICK = dict(conversations=5, scale=0.12, max_turns=4, max_output=24, rate=4.0, think_time=0.5, rates="1",
             memory_fraction=0.5, sweep_systems="hf_continuous_batching,stateful_hf", policy_fraction=0.25,
             policy_conversations=12, policy_scale=0.5, profile_repeats=1)
FULL = dict(conversations=24, scale=0.5, max_turns=8, max_output=256, rate=0.5, think_time=2.0, rates="0.25,0.5,1,2",
            memory_fraction=0.5, sweep_systems="hf_stateless,hf_continuous_batching,stateful_hf", policy_fraction=0.25,
            policy_conversations=24, policy_scale=1.0, profile_repeats=3)


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.multiturn", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small run, under 3 minutes on a 2-core CPU")
    w = ap.add_argument_group("workload")
    w.add_argument("--data", help="ShareGPT-format JSON/JSONL file (loaded offline with datasets)")
    w.add_argument("--dataset", choices=("sharegpt", "ultrachat"), default="sharegpt",
                   help="statistics to synthesize from when no --data is given")
    w.add_argument("--conversations", type=int, help="number of conversations (limit for --data)")
    w.add_argument("--scale", type=float, help="multiply every input/output length by this (CPU scaling)")
    w.add_argument("--max-turns", type=int)
    w.add_argument("--max-input", type=int, default=512)
    w.add_argument("--max-output", type=int)
    w.add_argument("--system-prompt", type=int, default=0, metavar="N",
                   help="N tokens that open every conversation (the same for all: a shared system prompt)")
    a = ap.add_argument_group("arrivals")
    a.add_argument("--rate", type=float, help="Poisson conversation arrivals per second (open loop)")
    a.add_argument("--users", type=int, default=0, help="closed loop: this many concurrent users instead of --rate")
    a.add_argument("--think-time", type=float, help="mean exponential think time between turns, seconds")
    a.add_argument("--rates", help="comma-separated rates for the throughput-vs-latency sweep ('' = none)")
    a.add_argument("--sweep-systems", help="systems run in the sweep")
    s = ap.add_argument_group("systems")
    s.add_argument("--systems", help="comma-separated subset of " + ",".join(ALL_SYSTEMS) + " (default: all; "
                   "with --system-prompt: " + ",".join(SHARING_SYSTEMS) + ")")
    s.add_argument("--model", help="a named model (smollm2-135m-instruct, fetched once; real text prompts: the "
                   "--data file, else turns of Pensieve's lengths cut from the bundled ShareGPT sample) or a "
                   "path; default: a random-weight Llama of --layers layers")
    s.add_argument("--layers", type=int, default=12, help="Llama layers (12 = ~100M parameters); without --model")
    s.add_argument("--kv-budget", type=int, help="device KV budget in tokens, same for every system")
    s.add_argument("--memory-fraction", type=float,
                   help="without --kv-budget: budget = this share of the KV all conversations reach")
    s.add_argument("--policy-budget", type=int,
                   help="device tokens for the serial LRU vs cost-aware replay (0: skip)")
    s.add_argument("--policy-fraction", type=float, help="without --policy-budget: this share of all KV")
    s.add_argument("--policy-conversations", type=int, help="conversations of the policy replay")
    s.add_argument("--policy-scale", type=float,
                   help="length scale of the policy replay's conversations (1 = the dataset's real lengths)")
    s.add_argument("--policy-rate", type=float, default=0.2, help="policy replay: conversations per virtual second")
    s.add_argument("--policy-think-time", type=float, default=30.0,
                   help="policy replay: mean think time in virtual seconds (Pensieve: 60)")
    s.add_argument("--profile-repeats", type=int, help="timing repeats of the Cost(l) / HCache profiles")
    s.add_argument("--cost-profile", help="use this Cost(l) instead of measuring it (JSON with lengths and "
                                          "seconds, or a results JSON of this benchmark): reproducible replays")
    s.add_argument("--no-oracle", action="store_true", help="policy replay: skip the offline oracle run")
    s.add_argument("--max-batch-tokens", type=int, default=256)
    s.add_argument("--host-factor", type=float, default=4.0, help="host/disk tier size, times the device budget")
    o = ap.add_argument_group("output")
    o.add_argument("--json", help="write every figure and the environment here")
    o.add_argument("--plots", help="directory for PNG plots")
    o.add_argument("--markdown", help="write the README performance section (markdown) here")
    o.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    o.add_argument("--seed", type=int, default=0)
    o.add_argument("--repeats", type=int, default=1,
                   help="run the main comparison this many times, interleaved; report each system's median run")
    o.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    for k, v in (QUICK if args.quick else FULL).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.systems is None:
        args.systems = ",".join(SHARING_SYSTEMS if args.system_prompt else ALL_SYSTEMS)
    if args.system_prompt and args.max_input < args.system_prompt + 1:
        args.max_input = args.system_prompt + 512     # the prompt counts in the first turn's input
    return args


def main(argv=None) -> dict:
    args = parse(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    t_start = time.monotonic()
    env = report.environment()
    model, tokenizer, described = build(args.model, args.layers)
    vocab = model.config.vocab_size
    if args.data:
        wl = load_sharegpt(args.data, args.conversations, args.scale, args.max_turns, args.max_input,
                           args.max_output, vocab, tokenizer=tokenizer)
    else:        # Pensieve's statistics; with a real model's tokenizer, turns cut from the bundled sample's text
        wl = synthesize(args.conversations, args.dataset, args.scale, args.max_turns, args.max_input,
                        args.max_output, vocab, args.seed, text_ids(tokenizer) if tokenizer is not None else ())
    if args.system_prompt:
        wl = with_system_prompt(wl, args.system_prompt, vocab, args.seed,
                                text_ids(tokenizer) if tokenizer is not None else ())
    arr = Arrivals(rate=0.0 if args.users else args.rate, think_s=args.think_time, users=args.users, seed=args.seed)
    budget = args.kv_budget or budget_for(wl, args.memory_fraction)
    cfg = Config(budget, args.max_batch_tokens, max_seqs=max(len(wl.conversations), 1),
                 host_factor=args.host_factor, profile_repeats=args.profile_repeats)
    systems = [x for x in args.systems.split(",") if x]
    rates = [float(x) for x in args.rates.split(",") if x] if args.rates else []
    print(f"model: {described}; "
          f"{env['torch_threads']} torch threads; load average {env['load_average_at_start']}")
    print(f"workload: {wl.describe()}")
    print(f"arrivals: {arr.describe()} (scaled for this CPU; Pensieve uses a 60 s mean think time)")
    print(f"KV budget: {budget} tokens on the device for every system "
          f"({budget * kv_bytes_per_token(model) / 2**20:.0f} MiB); host/disk tiers of variants: x{args.host_factor:g}")
    warm_up(model, vocab)
    bench = Bench(model, cfg, progress=not args.no_progress,
                  cost_profile=load_cost_profile(args.cost_profile) if args.cost_profile else None)
    warm_up(bench.cb_model, vocab)
    # the policy replay: real lengths on a virtual clock, run on a small model (see policy.py)
    pwl = replay_workload(args.policy_conversations, args.policy_think_time, args.policy_rate, args.seed,
                          args.dataset, args.policy_scale, args.data)
    pbudget = policy_budget_for(pwl, args.policy_fraction) if args.policy_budget is None else args.policy_budget
    res = experiment(bench, wl, arr, systems, rates, [x for x in args.sweep_systems.split(",") if x], pbudget,
                     args.repeats, policy_wl=pwl, oracle=not args.no_oracle)
    out = {"command": "python -m benchmarks.multiturn " + " ".join(sys.argv[1:] if argv is None else argv),
           "environment": env, "model": {"name": args.model, "described": described,
                                             "layers": model.config.num_hidden_layers, "params": n_params(model),
                                             "dtype": "float32"},
           "workload": wl.describe(), "arrivals": arr.describe(), "kv_budget_tokens": budget,
           "kv_bytes_per_token": kv_bytes_per_token(model), "system_prompt_tokens": args.system_prompt,
           "max_batch_tokens": args.max_batch_tokens, "rates": rates, **res,
           "ratios_vs_baselines": report.ratios(res["systems"]),
           "load_average_at_end": os.getloadavg(), "elapsed_s": time.monotonic() - t_start}
    if args.plots:
        out["plots"] = report.plots(out, args.plots)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(report.markdown(out, args.plots) + "\n")
    print_summary(out)
    return out


def print_summary(out: dict) -> None:
    print("\n" + report.table(out["systems"]))
    print("\nTTFT by turn index (mean, s):\n" + report.ttft_by_turn_table(out["systems"]))
    if out.get("system_prompt_tokens"):
        print(f"\nshared system prompt of {out['system_prompt_tokens']} tokens:\n"
              + report.sharing_table(out["systems"], out["kv_bytes_per_token"]))
    for name, r in out["ratios_vs_baselines"].items():
        print(f"stateful_hf vs {name} (>1 = stateful_hf better): throughput x{r['throughput_x']:.2f}, "
              f"p90 TTFT x{r['ttft_p90_reduction_x']:.2f} (theirs / ours), "
              f"mean normalized latency x{r['norm_latency_mean_reduction_x']:.2f}")
    if "same_tokens_as_stateless" in out:
        print("identical greedy tokens vs hf_stateless (share of turns): "
              + ", ".join(f"{k} {v:.0%}" for k, v in out["same_tokens_as_stateless"].items()))
    if "policy" in out:
        p = out["policy"]
        print(f"policy replay at {p['budget_tokens']} device tokens ({p['turns']} turns served one at a time): "
              f"default ({p['default_policy']}) recomputed {p['cost_aware_recomputed']} tokens, LRU "
              f"{p['lru_recomputed']} ({p['reduction']:+.1%} fewer with the default), return-aware "
              f"{p['return_aware_recomputed']}, Pensieve's Cost/T {p['pensieve_recomputed']}, offline oracle "
              f"{p['oracle_recomputed']}; same tokens: {p['same_tokens']}")
    for name, pts in out.get("sweep", {}).items():
        print(f"sweep {name}: " + "; ".join(f"rate {p['rate_conv_s']:g}: {p['throughput_tok_s']:.2f} tok/s, "
                                            f"{p['norm_latency_mean_s']:.4f} s/tok" for p in pts))
    for name, runs in out.get("repeats", {}).items():
        print(f"repeats {name}: " + ", ".join(f"{r['throughput_tok_s']:.1f} tok/s (p90 TTFT {r['ttft_p90_s']:.3f} s)"
                                              for r in runs))
    for name, why in out.get("skipped", {}).items():
        print(f"skipped {name}: {why}")
    print(f"elapsed {out['elapsed_s']:.0f} s; load average at end {out['load_average_at_end']}")


if __name__ == "__main__":
    main()
