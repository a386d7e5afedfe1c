"""Before/after one change: a benchmark run under two git revisions (or two configurations of one), interleaved,
in one invocation.

    python -m benchmarks.ab --before 39c8717 --after HEAD --rounds 3 -- bench_engine --skip a,b,b+
    python -m benchmarks.ab --before 39c8717 --after HEAD --rounds 3 -- bench_tiers --lengths 512 1024 --reps 3
    python -m benchmarks.ab --before HEAD --before-args "--disk-write evict" --after-args "--disk-write behind" \
        --rounds 3 -- bench_engine --skip a,b,b+ --disk-dir /tmp/ab-disk

`--before-args` / `--after-args` (shell words, shlex-split) are appended to that side's benchmark
arguments; with either given, `--after` defaults to `--before`: two configurations of one revision.

Each revision gets a detached git worktree and a venv (`--system-site-packages`, the package installed
editable with no dependencies) under ~/.cache/stateful_hf/ab/<commit>, made once and reused. Rounds
alternate the order (before, after), (after, before), ... so load drift on a shared machine hits both
sides alike; every run is a fresh interpreter running that revision's own benchmark with `--json`.
Reported: each figure's median over the rounds per revision and after / before (for times, > 1 is
slower; for throughput, < 1 is slower). The JSON (every run, the medians, the ratios, the load) goes
to --json (default benchmarks/results/ab_<benchmark>.json), with each side's revision and arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

CACHE = Path(os.environ.get("STATEFUL_HF_AB_DIR", Path.home() / ".cache" / "stateful_hf" / "ab"))
REPO = Path(__file__).resolve().parent.parent


def _git(*args: str, cwd: Path = REPO) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def checkout(rev: str) -> tuple[str, Path]:
    """(commit, python) of a worktree + venv at `rev`, made on first use."""
    sha = _git("rev-parse", "--verify", f"{rev}^{{commit}}")
    tree = CACHE / sha[:12]
    python = tree / ".venv" / "bin" / "python"
    if not python.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        if not tree.exists():
            _git("worktree", "add", "--detach", str(tree), sha)
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(tree / ".venv")], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "-e", str(tree)], check=True,
                       stdout=subprocess.DEVNULL)
    return sha, python


def figures(bench: str, out: dict) -> dict[str, float]:
    """The comparable numbers of one run's JSON: name -> value."""
    if bench == "bench_engine":     # one condition (older JSON: top level; newer: "conditions" by neighbour)
        cond = out if "median_runs" in out else next(iter(out["conditions"].values()))
        keys = ("tok_per_s", "ttft_p50_s", "ttft_p90_s", "returning_ttft_p90_s")
        return {f"{r['name']} {k}": r[k] for r in cond["median_runs"] for k in keys if k in r}
    if bench == "bench_tiers":
        return {f"N={row['tokens']} {k} s": v for row in out["rows"] for k, v in row.items() if k != "tokens"}
    if bench == "bench_scale":
        keys = ("generate_median_ms", "generate_p99_ms", "engine_median_ms", "engine_p99_ms")
        return {f"{row['sessions']} sessions {k}": row[k] for row in out["rows"] for k in keys}
    raise SystemExit(f"no figure extraction for {bench}: add it to benchmarks/ab.py")


FIGURED = ("bench_engine", "bench_tiers", "bench_scale")    # the benchmarks `figures` reads


def run(python: Path, bench: str, args: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "out.json")
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        tree = python.parent.parent.parent
        subprocess.run([str(python), "-m", f"benchmarks.{bench}", *args, "--json", path], cwd=tree, env=env, check=True)
        with open(path) as fh:
            return json.load(fh)


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, dict[str, str], dict[str, list[str]]]:
    """(the parsed options, each side's revision, each side's benchmark arguments): the common ones after `--`,
    then that side's `--before-args` / `--after-args`."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", required=True, help="a git revision")
    ap.add_argument("--after", help="a git revision (default HEAD, or --before with --before-args / --after-args; "
                    "commit your changes first)")
    ap.add_argument("--before-args", default="", help="more benchmark arguments for the before side (shlex-split)")
    ap.add_argument("--after-args", default="", help="more benchmark arguments for the after side (shlex-split)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", help="default benchmarks/results/ab_<benchmark>.json")
    ap.add_argument("bench", help="a module of benchmarks/ (bench_engine, bench_tiers, bench_scale)")
    ap.add_argument("args", nargs=argparse.REMAINDER, help="its arguments (after --)")
    a = ap.parse_args(argv)
    if a.bench not in FIGURED:
        ap.error(f"no figure extraction for {a.bench}: add it to benchmarks/ab.py (it reads {', '.join(FIGURED)})")
    common = a.args[1:] if a.args[:1] == ["--"] else a.args
    try:
        extra = {"before": shlex.split(a.before_args), "after": shlex.split(a.after_args)}
    except ValueError as e:
        ap.error(f"--before-args / --after-args: {e}")
    revs = {"before": a.before, "after": a.after or (a.before if a.before_args or a.after_args else "HEAD")}
    if revs["before"] == revs["after"] and extra["before"] == extra["after"]:
        ap.error("both sides are the same revision with the same arguments: nothing to compare")
    return a, revs, {side: common + extra[side] for side in extra}


def main() -> None:
    a, revs, side_args = parse_args()
    sides = {side: checkout(rev) for side, rev in revs.items()}
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    load_start = os.getloadavg()
    for r in range(a.rounds):
        for side in ("before", "after") if r % 2 == 0 else ("after", "before"):
            print(f"round {r + 1}/{a.rounds}: {side} ({sides[side][0][:12]} {shlex.join(side_args[side])}), "
                  f"1-min load {os.getloadavg()[0]:.1f}", flush=True)
            runs[side].append(run(sides[side][1], a.bench, side_args[side]))
    medians = {side: {k: statistics.median(figures(a.bench, o)[k] for o in runs[side])
                      for k in figures(a.bench, runs[side][0])} for side in runs}
    common = [k for k in medians["before"] if k in medians["after"]]
    ratios = {k: medians["after"][k] / medians["before"][k] for k in common if medians["before"][k]}
    print(f"\n{'figure':<44}{'before':>12}{'after':>12}{'after/before':>14}")
    for k in common:
        print(f"{k:<44}{medians['before'][k]:12.4g}{medians['after'][k]:12.4g}{ratios.get(k, float('nan')):14.3f}")
    load_end = os.getloadavg()
    print(f"load average at start / end (1 min): {load_start[0]:.1f} / {load_end[0]:.1f}")
    out = {"command": "python -m benchmarks.ab " + shlex.join(sys.argv[1:]),
           "before": sides["before"][0], "after": sides["after"][0], "rounds": a.rounds,
           "args": {side: side_args[side] for side in sides},
           "load_start": load_start, "load_end": load_end, "medians": medians, "after_over_before": ratios,
           "runs": runs}
    path = a.json or str(REPO / "benchmarks" / "results" / f"ab_{a.bench}.json")
    with open(path, "w") as fh:
        json.dump(out, fh, indent=1)
    print(f"saved {path}")


if __name__ == "__main__":
    main()
