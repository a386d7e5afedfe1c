"""Restore cost of a returning session, per tier, vs recomputing its history.

    python -m benchmarks.bench_tiers [--lengths 512 1024 2048 4096] [--reps 3] [--json FILE]

For each history length N, one session's N tokens are placed wholly in one tier, then the time to
make them usable on the device again is measured (median of --reps): `host` and `disk` copy the
chunks up (the disk file's pages are unmapped and evicted from the page cache first,
`DiskTier.drop_page_cache`, so reads are cold), `recompute` runs the model over the N tokens (the
dropped-history path). `ttft` adds the forward of a 16-token new prompt with its next-token logits:
the returning turn's time to first token. Ratios are against recompute, measured side by side in one run.
The disk restore is the one after a restart: every chunk's checksum is verified on its first read
(`docs/durability.md`); `checksum` is that verification alone (xxh3 over the chunks, warm pages), and
its share of the disk restore is reported (target: < 10%).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

import stateful_hf
from stateful_hf.cache import CostProfile
from stateful_hf.cache.disk.file import identity_tags
from stateful_hf.integration.hooks import restore, run_step

from .harness.models import llama_100m, n_params


def _new_turn(model, store, sid: str, ids: list[int]) -> None:
    n = store.session(sid).num_tokens
    step = store.plan_step([(sid, ids, range(n, n + len(ids)))])
    run_step(model, step, step.last_rows())
    store.abort(step)


def _checksum_seconds(store, sid: str) -> float:
    """Time to checksum the session's disk chunks (their pages warm): the verification's own cost."""
    s, f = store.session(sid), store.tiers.disk.files["kv"]
    tags = identity_tags(s.token_ids, store.block_size)
    t0 = time.perf_counter()
    for k, c in enumerate(s.chunks):
        f.checksum(tags[k], c.loc)
    return time.perf_counter() - t0


@torch.inference_mode()
def bench(lengths: list[int], reps: int) -> list[dict]:
    model = llama_100m()
    total = max(lengths) + 64
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        store = stateful_hf.SessionStore(model, device_capacity=total, host_capacity=total, disk_dir=tmp,
                                         disk_capacity=total, cost_profile=CostProfile(), swap_out_threshold=0)
        prompt = torch.randint(0, 32000, (16,)).tolist()
        for n in lengths:
            ids = torch.randint(0, 32000, (n,)).tolist()
            store.open("s")
            step = store.plan_step([("s", ids, range(n))])
            run_step(model, step)
            store.commit(step)
            chunks = range(len(store.session("s").chunks))
            cache = store.cache("s")
            names = [f"{t}{x}" for t in ("host", "disk", "recompute") for x in ("", "_ttft")] + ["checksum"]
            times: dict[str, list[float]] = {name: [] for name in names}
            for _ in range(reps):
                for tier in ("host", "disk", "recompute"):
                    store.move("s", chunks, "dropped" if tier == "recompute" else tier)
                    if tier == "disk":   # unmapped and evicted: posix_fadvise alone keeps mapped pages
                        times["checksum"].append(_checksum_seconds(store, "s"))
                        sums = store.tiers.disk.pool.checksums        # as after a restart: proven on first read
                        for slot in sums.slots():
                            sums.set(slot, sums[slot])          # known, not proven
                        store.tiers.disk.drop_page_cache()
                    t0 = time.perf_counter()
                    if tier == "recompute":
                        restore(model, cache)
                    else:
                        store.move("s", chunks, "device")
                    t1 = time.perf_counter()
                    _new_turn(model, store, "s", prompt)
                    t2 = time.perf_counter()
                    times[tier].append(t1 - t0)
                    times[f"{tier}_ttft"].append(t2 - t0)
            store.check_integrity()
            store.delete("s")
            row = {"tokens": n, **{k: statistics.median(v) for k, v in times.items()}}
            rows.append(row)
            print(f"N={n:5d}  restore: host {row['host'] * 1e3:8.1f} ms  disk {row['disk'] * 1e3:8.1f} ms  "
                  f"recompute {row['recompute'] * 1e3:8.1f} ms   "
                  f"recompute/host {row['recompute'] / row['host']:6.1f}x  "
                  f"recompute/disk {row['recompute'] / row['disk']:6.1f}x   TTFT ratio recompute/host "
                  f"{row['recompute_ttft'] / row['host_ttft']:5.1f}x  recompute/disk "
                  f"{row['recompute_ttft'] / row['disk_ttft']:5.1f}x   checksum {row['checksum'] * 1e3:6.2f} ms "
                  f"= {row['checksum'] / row['disk']:.1%} of the disk restore", flush=True)
        store.close()
    print(f"model: {n_params(model) / 1e6:.0f}M params, float32, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}; KV {store.spec.bytes_per_token} B/token; "
          f"load average {os.getloadavg()[0]:.2f}")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", help="write the rows (seconds, medians of --reps) and the environment to this file")
    args = ap.parse_args()
    load_start = os.getloadavg()
    rows = bench(args.lengths, args.reps)
    if args.json:
        import json
        import sys
        out = {"command": "python -m benchmarks.bench_tiers " + " ".join(sys.argv[1:]), "torch": torch.__version__,
               "threads": torch.get_num_threads(), "cpus": os.cpu_count(), "load_start": load_start,
               "load_end": os.getloadavg(), "rows": rows}
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
