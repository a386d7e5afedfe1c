"""The engine's loop thread with and without the caller's OpenMP pool released, quiet and next to
CPU-bound processes, in one run.

    python -m benchmarks.bench_threads                 # ~100M Llama, 12 sessions x 2 turns, 16 tokens
    python -m benchmarks.bench_threads --hogs 0,1 --repeats 3

`Engine(release_openmp_pool=True)` (the default) frees the calling thread's idle libgomp workers at
start(): the loop's own pool then spins between parallel regions instead of sleeping (see
stateful_hf/engine/openmp.py). Spinning wins on cores the engine has to itself and loses next to other
busy processes; `--hogs N` starts N busy-looping processes for the second case. Before every run the
main thread runs a parallel op (benchmarks/threads.py). Not run by CI.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

import torch

from .bench_engine import Workload, build_model, run_engine
from .threads import hold_main_pool


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, default=12)
    ap.add_argument("--turns", type=int, default=2)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hogs", default="0,1", help="comma-separated counts of busy processes to run beside")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    wl = Workload(args.sessions, args.turns, 48, 16, args.new, vocab=16000)
    model = build_model(args.layers)
    with torch.inference_mode():
        model.generate(torch.tensor([wl.user_tokens(0, 0)]), max_new_tokens=2, do_sample=False, pad_token_id=0)
    print(f"workload: {wl}; {torch.get_num_threads()} torch threads, {os.cpu_count()} CPUs, "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset)')}")
    print("load average at start (1/5/15 min): {:.1f} {:.1f} {:.1f}".format(*os.getloadavg()))
    rows = []
    for hogs in map(int, args.hogs.split(",")):
        procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(hogs)]
        try:
            walls = {True: [], False: []}
            for r in range(args.repeats):
                for release in (True, False) if r % 2 == 0 else (False, True):
                    hold_main_pool()
                    res, _ = run_engine(model, wl, 256, release_openmp_pool=release)
                    walls[release].append(res.wall)
                    print(f"  {hogs} busy processes, release={release}: {res.wall:.2f} s", flush=True)
        finally:
            for p in procs:
                p.kill()
                p.wait()
        rows.append((hogs, statistics.median(walls[True]), statistics.median(walls[False])))
    print("load average at end (1/5/15 min): {:.1f} {:.1f} {:.1f}".format(*os.getloadavg()))
    print(f"\n{'busy processes':>14}{'released s':>12}{'kept s':>10}{'kept / released':>17}")
    for hogs, a, b in rows:
        print(f"{hogs:>14}{a:>12.2f}{b:>10.2f}{b / a:>17.2f}")


if __name__ == "__main__":
    main()
