"""The engine's threading designs, quiet and beside other processes, in one run.

    python -m benchmarks.bench_threads                          # ~100M Llama, 12 sessions x 2 turns, 16 tokens
    python -m benchmarks.bench_threads --neighbour quiet,busy:1,busy:2,bursty --repeats 3

Designs (stateful_hf/engine/openmp.py, thread_sizing.py):
  auto     release the caller's OpenMP pool at start(); full team, waits throttled while others are busy (default)
  shrink   release the caller's pool; the loop's team sized to the free cores
  spin     release the caller's pool; the loop's team = torch's thread count (the previous default)
  keep     the caller's pool kept (the loop's workers run throttled: they sleep between regions)
  one      release; a team of one thread
  passive  as spin, in a fresh interpreter with OMP_WAIT_POLICY=PASSIVE set before torch starts
Every design runs beside the same neighbours (benchmarks/harness/neighbours.py; `--neighbour` as in
bench_engine). Before every run the main thread runs a parallel op (benchmarks/harness/threads.py). Not run by CI.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

import torch

from .bench_engine import Workload, build_model, run_engine
from .harness.neighbours import Neighbours, parse
from .harness.threads import hold_main_pool

DESIGNS = {"auto": (True, "auto"), "shrink": (True, "shrink"), "spin": (True, None), "keep": (False, None),
           "one": (True, 1)}


def run_design(model, wl: Workload, design: str) -> float:
    """Wall seconds of one engine run with `design` (in this process)."""
    release, threads = DESIGNS[design]
    hold_main_pool()
    res, _ = run_engine(model, wl, 256, release_openmp_pool=release, step_threads=threads)
    return res.wall


def run_passive(args) -> float:
    """Wall seconds of one `spin` run in a fresh interpreter with OMP_WAIT_POLICY=PASSIVE."""
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cmd = [sys.executable, "-m", "benchmarks.bench_threads", "--designs", "spin", "--repeats", "1",
               "--neighbour", "quiet", "--sessions", str(args.sessions), "--turns", str(args.turns),
               "--first", str(args.first), "--user", str(args.user), "--new", str(args.new),
               "--layers", str(args.layers), "--json", f.name]
        subprocess.run(cmd, check=True, env=dict(os.environ, OMP_WAIT_POLICY="PASSIVE"), stdout=subprocess.DEVNULL)
        with open(f.name) as g:
            return json.load(g)["conditions"]["quiet"]["spin"][0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, default=12)
    ap.add_argument("--turns", type=int, default=2)
    ap.add_argument("--first", type=int, default=48)
    ap.add_argument("--user", type=int, default=16)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--designs", default="auto,shrink,spin,keep,one,passive")
    ap.add_argument("--neighbour", default="quiet,busy:1",
                    help="comma-separated conditions (benchmarks/harness/neighbours.py)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", help="write the per-run walls to this file")
    args = ap.parse_args()
    designs = [d for d in args.designs.split(",") if d]
    for d in designs:
        if d not in DESIGNS and d != "passive":
            raise SystemExit(f"unknown design {d!r}: {', '.join([*DESIGNS, 'passive'])}")
    conditions = [c for c in args.neighbour.split(",") if c]
    for c in conditions:
        parse(c)
    wl = Workload(args.sessions, args.turns, args.first, args.user, args.new, vocab=16000)
    model = build_model(args.layers)
    with torch.inference_mode():
        model.generate(torch.tensor([wl.user_tokens(0, 0)]), max_new_tokens=2, do_sample=False, pad_token_id=0)
    print(f"workload: {wl}; {torch.get_num_threads()} torch threads, {os.cpu_count()} CPUs, "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset)')}")
    out = {"command": "python -m benchmarks.bench_threads " + " ".join(sys.argv[1:]), "conditions": {}}
    for condition in conditions:
        walls: dict[str, list[float]] = {d: [] for d in designs}
        with Neighbours(condition):
            load_start = os.getloadavg()
            for r in range(args.repeats):
                for d in designs[r % len(designs):] + designs[:r % len(designs)]:     # rotate the order
                    walls[d].append(run_passive(args) if d == "passive" else run_design(model, wl, d))
                    print(f"  {condition}, {d}: {walls[d][-1]:.2f} s, 1-min load {os.getloadavg()[0]:.1f}",
                          flush=True)
            load_end = os.getloadavg()
        out["conditions"][condition] = {**walls, "load_start": load_start, "load_end": load_end}
        print(f"{condition}: load {load_start[0]:.1f} -> {load_end[0]:.1f}; median wall s: "
              + ", ".join(f"{d} {statistics.median(w):.2f}" for d, w in walls.items()), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
