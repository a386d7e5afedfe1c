"""One forward's time by its rows and the loop thread's OpenMP team, quiet and beside other processes.

    python -m benchmarks.bench_team                                   # busy:2, rows 4..512
    python -m benchmarks.bench_team --neighbour quiet,busy:2,bursty --rows 8,16,64,256,384 --reps 9

What `ThreadSizer.shrink_rows` (stateful_hf/engine/thread_sizing.py) is chosen from: on a background
thread whose caller's pool was released (as the engine's loop), the ~100M Llama of bench_engine (12 layers) runs
one forward of `rows` new tokens (a step's rows; no cache) on each team, interleaved per repetition
with the order alternating: "one" (a team of one thread), "throttled" (torch's thread count, waits
throttled by `SpinSwitch`: the engine's full team on a busy host) and "spin" (the same team spinning:
the engine's full team on a quiet host). Reported: the median seconds per team and row count, and
one / throttled. Not run by CI.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time

import torch

from stateful_hf.engine.openmp import SpinSwitch, release_thread_pool, set_thread_team

from .bench_engine import build_model
from .harness.neighbours import Neighbours, parse

TEAMS = ("one", "throttled", "spin")


def measure(model, rows_list: list[int], reps: int, switch: SpinSwitch) -> dict[int, dict[str, float]]:
    """{rows: {team: median seconds}}; runs on a fresh thread (its own OpenMP pool)."""
    out: dict[int, dict[str, float]] = {}
    full = torch.get_num_threads()

    def run() -> None:
        torch.get_num_threads()             # the thread's team is initialised before it is set
        with torch.inference_mode():
            model(torch.randint(0, 1000, (1, 64)))
            for rows in rows_list:
                ids = torch.randint(0, 1000, (1, rows))
                seconds: dict[str, list[float]] = {t: [] for t in TEAMS}
                for r in range(reps):
                    for team in (TEAMS if r % 2 == 0 else TEAMS[::-1]):
                        switch.set(team == "throttled")
                        time.sleep(0.05)    # the switch applies on its own thread
                        set_thread_team(1 if team == "one" else full)
                        t0 = time.perf_counter()
                        model(ids)
                        seconds[team].append(time.perf_counter() - t0)
                out[rows] = {t: statistics.median(v) for t, v in seconds.items()}

    th = threading.Thread(target=run)
    th.start()
    th.join()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--neighbour", default="busy:2", help="comma-separated specs (benchmarks/harness/neighbours.py)")
    ap.add_argument("--rows", default="4,8,16,32,64,128,256,384,512")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--json", default="benchmarks/results/bench_team.json")
    a = ap.parse_args()
    specs = [s.strip() for s in a.neighbour.split(",")]
    for s in specs:
        parse(s)
    rows_list = [int(x) for x in a.rows.split(",")]
    model = build_model(a.layers)
    release_thread_pool()
    switch = SpinSwitch()
    result = {"threads": torch.get_num_threads(), "reps": a.reps, "conditions": {}}
    try:
        for spec in specs:
            with Neighbours(spec):
                load = os.getloadavg()[0]
                res = measure(model, rows_list, a.reps, switch)
            result["conditions"][spec] = {"load_start": load, "ms": {
                str(r): {t: round(v * 1e3, 2) for t, v in d.items()} for r, d in res.items()}}
            print(f"{spec} (load {load:.1f}): rows  " + "  ".join(f"{t:>9}" for t in TEAMS) + "  one/throttled")
            for r, d in res.items():
                print(f"  {r:>18}  " + "  ".join(f"{d[t] * 1e3:8.1f}ms" for t in TEAMS)
                      + f"  {d['one'] / d['throttled']:8.2f}", flush=True)
    finally:
        switch.close()
    with open(a.json, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
