"""The policy replay (policy.py) over a grid of workload seeds, think times and device budgets.

    python -m benchmarks.multiturn.policy_grid --cost-profile benchmarks/multiturn/results/policy.json \\
        --seeds 0,1,2 --think-times 30,60 --fractions 0.25,0.5,0.75 --json grid.json

Each cell is exactly what `python -m benchmarks.multiturn --seed S --policy-think-time T
--policy-fraction F` replays (same workload, schedule and budget), with one fixed Cost profile for
every cell so the counts are reproducible. Prints a markdown table of recomputed tokens (and modeled
recompute seconds) per policy per cell, and whether the default policy recomputed fewer than LRU.
Not run by CI.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from stateful_hf.testing import tiny_llama

from .bench import policy_budget_for
from .policy import ORACLE, POLICIES, compare, load_cost_profile, replay_workload

SHORT = {"stateful_hf": "default", "stateful_hf_return_aware": "return_aware", "stateful_hf_pensieve": "pensieve",
         "stateful_hf_lru": "lru", ORACLE: "oracle"}


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.multiturn.policy_grid", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="0,1,2", help="workload seeds (as --seed of the main benchmark)")
    ap.add_argument("--think-times", default="30,60", help="mean think times, virtual seconds")
    ap.add_argument("--fractions", default="0.25,0.5,0.75", help="device budgets as a share of all KV")
    ap.add_argument("--conversations", type=int, default=24)
    ap.add_argument("--scale", type=float, default=1.0, help="length scale (1 = the dataset's lengths)")
    ap.add_argument("--rate", type=float, default=0.2, help="conversations per virtual second")
    ap.add_argument("--dataset", choices=("sharegpt", "ultrachat"), default="sharegpt")
    ap.add_argument("--cost-profile", help="Cost(l) JSON (lengths, seconds) or a results JSON; default: "
                                           "measured on the benchmark's 100M model")
    ap.add_argument("--no-oracle", action="store_true")
    ap.add_argument("--no-model", action="store_true",
                    help="count only (policy.replay_counts: the same store calls without a model, seconds per "
                         "replay instead of minutes; identical counts, no same-tokens check)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", help="write every cell here (rewritten after each cell)")
    return ap.parse_args(argv)


def measured_profile(max_context: int):
    """Cost(l) of the main benchmark's model, as `python -m benchmarks.multiturn` measures it."""
    from ..harness.models import llama_100m
    from .bench import Bench, Config

    return Bench(llama_100m(), Config(budget_tokens=64), progress=False).cost_profile(max_context)


def table(cells: list[dict]) -> str:
    names = [n for n in SHORT if any(n in c["recomputed"] for c in cells)]
    head = "| seed | think s | budget | tokens | " + " | ".join(SHORT[n] for n in names) + \
           " | default < lru | modeled s: " + " / ".join(SHORT[n] for n in names) + " |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for c in cells:
        rec, cost = c["recomputed"], c["modeled_s"]
        lines.append(f"| {c['seed']} | {c['think_s']:g} | {c['fraction']:.0%} | {c['budget_tokens']} | "
                     + " | ".join(str(rec[n]) for n in names)
                     + f" | {'yes' if rec['stateful_hf'] < rec['stateful_hf_lru'] else 'no'} | "
                     + " / ".join(f"{cost[n]:.1f}" for n in names) + " |")
    return "\n".join(lines)


def summary(cells: list[dict]) -> str:
    """Per policy, against LRU: in how many cells it recomputed fewer / as many / more tokens, and its
    total over all cells relative to LRU's."""
    lines = []
    for n in SHORT:
        if n == "stateful_hf_lru" or not all(n in c["recomputed"] for c in cells):
            continue
        pairs = [(c["recomputed"][n], c["recomputed"]["stateful_hf_lru"]) for c in cells]
        total_lru = sum(b for _, b in pairs)
        rel = (sum(a for a, _ in pairs) / total_lru - 1) if total_lru else 0.0
        lines.append(f"{SHORT[n]} vs lru: fewer in {sum(a < b for a, b in pairs)}, as many in "
                     f"{sum(a == b for a, b in pairs)}, more in {sum(a > b for a, b in pairs)} of {len(pairs)} "
                     f"cells; total {rel:+.2%}")
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    args = parse(argv)
    torch.set_num_threads(args.threads)
    seeds = [int(x) for x in args.seeds.split(",") if x]
    workloads = {(s, t): replay_workload(args.conversations, t, args.rate, s, args.dataset, args.scale)
                 for s in seeds for t in _floats(args.think_times)}
    longest = max(c.max_context for wl in workloads.values() for c in wl.conversations)
    profile = load_cost_profile(args.cost_profile) if args.cost_profile else measured_profile(longest)
    model = None if args.no_model else tiny_llama(max_position_embeddings=max(2048, 2 * longest))
    cells, t0 = [], time.monotonic()
    for (seed, think), wl in workloads.items():
        for fraction in _floats(args.fractions):
            budget = policy_budget_for(wl, fraction)
            r = compare(model, wl, budget, profile, oracle=not args.no_oracle, log=lambda m: None)
            sys_ = r["systems"]
            cells.append({"seed": seed, "think_s": think, "fraction": fraction, "budget_tokens": budget,
                          "turns": r["turns"], "same_tokens": r["same_tokens"],
                          "recomputed": {n: x["recomputed_tokens"] for n, x in sys_.items()},
                          "dropped": {n: x["dropped_tokens"] for n, x in sys_.items()},
                          "modeled_s": {n: x["modeled_recompute_cost_s"] for n, x in sys_.items()}})
            print(f"seed {seed} think {think:g} s budget {fraction:.0%} ({budget} tokens): "
                  + ", ".join(f"{SHORT[n]} {v}" for n, v in cells[-1]["recomputed"].items())
                  + f"; same tokens {r['same_tokens']} ({time.monotonic() - t0:.0f} s)", flush=True)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump({"command": "python -m benchmarks.multiturn.policy_grid "
                               + " ".join(sys.argv[1:] if argv is None else argv),
                               "policies": {n: SHORT[n] for n in POLICIES}, "conversations": args.conversations,
                               "scale": args.scale, "rate": args.rate, "cost_profile": r["cost_profile"],
                               "cells": cells}, f, indent=1)
    print("\n" + table(cells) + "\n\n" + summary(cells))
    return cells


if __name__ == "__main__":
    main()
