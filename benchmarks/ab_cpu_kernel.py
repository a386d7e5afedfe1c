"""Two revisions of the CPU attention kernel (`stateful_hf/kernels/csrc/paged_attention_cpu.cpp`) side by side in
one process: their bits compared, then their time per call, interleaved.

    python -m benchmarks.ab_cpu_kernel --before 2d55e7b --after HEAD [--threads 1] [--json out.json]
    python -m benchmarks.ab_cpu_kernel --before HEAD --after worktree     # an edit not yet committed

Each revision's source is read with `git show`, built as the store builds it (`cpu_backend`'s flags, cached by a
hash of the source: a revision built before loads in milliseconds) and imported under its own name.
- **Bits**: both builds attend the same random ragged batches (decodes and a 21-row prefill over 150 tokens; head
  dims 16, 32, 48, 64, 80, 96, 128, 256; splits 16, 32, 64; 1 to 5 query heads per KV head; float32 and bf16) and
  their outputs are compared with `torch.equal`: a change meant to keep the arithmetic must show 0 differing.
- **Time**: decode layers (one query row per sub-request) at a few model geometries; each shape alternates the
  two builds over --rounds rounds of --calls calls and reports the median per call and after / before.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from stateful_hf.kernels import cpu_backend
from stateful_hf.kernels.cpu_features import CpuFeatures
from stateful_hf.kernels.extension import load_or_build

REPO = Path(__file__).resolve().parent.parent
SOURCE = cpu_backend.SOURCE.relative_to(REPO)
# (name, rows, context, query heads, KV heads, head dim): decode layers of real geometries
TIMED = (("SmolLM2-135M", 32, 150, 9, 3, 64), ("SmolLM2-135M, long", 32, 600, 9, 3, 64),
         ("Llama-3.2-1B", 16, 500, 32, 8, 64), ("Llama 8B / Mistral", 16, 500, 32, 8, 128),
         ("Phi-3-mini", 16, 500, 32, 32, 96), ("compute-free", 16, 90, 4, 2, 16))


def build(rev: str):
    """The kernel of `rev` ("worktree": the file as it is on disk), built with the store's flags (or loaded from
    the cache)."""
    if rev == "worktree":
        text = (REPO / SOURCE).read_text()
    else:
        text = subprocess.run(["git", "show", f"{rev}:{SOURCE}"], cwd=REPO, check=True, capture_output=True,
                              text=True).stdout
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / SOURCE.name
        src.write_text(text)
        return load_or_build("stateful_hf_paged_attention", [src], cflags=["-O3", "-march=native", "-fopenmp"],
                             ldflags=["-fopenmp"], key=repr(CpuFeatures.detect()))


def decode_case(rows: int, ctx: int, hq: int, hkv: int, d: int, dtype: torch.dtype, block: int = 32, seed: int = 0):
    """The kernel's arguments for `rows` decodes of `ctx` tokens over a pool of blocks in random order."""
    g = torch.Generator().manual_seed(seed)
    nb = -(-ctx // block)
    kc = torch.randn(rows * nb, block, hkv, d, generator=g).to(dtype)
    vc = torch.randn(rows * nb, block, hkv, d, generator=g).to(dtype)
    q = torch.randn(rows, hq, d, generator=g).to(dtype)
    items = torch.tensor([(i, i, i + 1) for i in range(rows)], dtype=torch.long)
    q_pos = torch.full((rows,), ctx - 1, dtype=torch.long)
    kv_len = torch.full((rows,), ctx, dtype=torch.long)
    table = torch.randperm(rows * nb, generator=g).reshape(rows, nb)
    return q, kc, vc, items, q_pos, kv_len, table, d ** -0.5, 0, 0.0, block


def mixed_case(hq: int, hkv: int, d: int, block: int, dtype: torch.dtype, seed: int):
    """Five decodes and a 21-row prefill (two tiles: 16 + 5 rows) of one sub-request, 150 tokens each."""
    g = torch.Generator().manual_seed(seed)
    seqs, ctx = 6, 150
    nb = -(-ctx // block)
    kc = torch.randn(seqs * nb, block, hkv, d, generator=g).to(dtype)
    vc = torch.randn(seqs * nb, block, hkv, d, generator=g).to(dtype)
    q = torch.randn(26, hq, d, generator=g).to(dtype)
    items = torch.tensor([(i, i, i + 1) for i in range(5)] + [(5, 5, 21), (5, 21, 26)], dtype=torch.long)
    q_pos = torch.tensor([ctx - 1] * 5 + list(range(ctx - 21, ctx)), dtype=torch.long)
    kv_len = torch.full((seqs,), ctx, dtype=torch.long)
    table = torch.randperm(seqs * nb, generator=g).reshape(seqs, nb)
    return q, kc, vc, items, q_pos, kv_len, table, 0.1, 0, 0.0, block


def compare_bits(before, after) -> dict:
    shapes, differ = 0, []
    for hq, hkv in ((8, 2), (9, 3), (6, 3), (4, 4), (10, 2)):
        for d in (16, 32, 48, 64, 80, 96, 128, 256):
            for block in (16, 32, 64):
                for dtype in (torch.float32, torch.bfloat16):
                    args = mixed_case(hq, hkv, d, block, dtype, seed=shapes)
                    shapes += 1
                    if not torch.equal(before.paged_attention(*args), after.paged_attention(*args)):
                        differ.append(f"heads {hq}/{hkv} dim {d} split {block} {str(dtype).removeprefix('torch.')}")
    return {"shapes": shapes, "differ": differ}


def time_shapes(before, after, rounds: int, calls: int) -> list[dict]:
    out = []
    for name, rows, ctx, hq, hkv, d in TIMED:
        for dtype in (torch.float32, torch.bfloat16):
            args = decode_case(rows, ctx, hq, hkv, d, dtype)
            times: dict[str, list[float]] = {"before": [], "after": []}
            for r in range(rounds):
                order = (("before", before), ("after", after)) if r % 2 == 0 else (("after", after), ("before", before))
                for side, module in order:
                    module.paged_attention(*args)
                    start = time.perf_counter()
                    for _ in range(calls):
                        module.paged_attention(*args)
                    times[side].append((time.perf_counter() - start) / calls)
            b, a = statistics.median(times["before"]), statistics.median(times["after"])
            out.append({"shape": name, "rows": rows, "context": ctx, "heads": hq, "kv_heads": hkv, "head_dim": d,
                        "dtype": str(dtype).removeprefix("torch."), "before_us": b * 1e6, "after_us": a * 1e6,
                        "after_over_before": a / b})
            print(f"{name:<20} {out[-1]['dtype']:<9} {rows:>3} rows x {ctx:>4} tokens: {b * 1e6:9.1f} -> "
                  f"{a * 1e6:9.1f} us  x{a / b:.2f}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", required=True)
    ap.add_argument("--after", default="HEAD")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    before, after = build(args.before), build(args.after)
    bits = compare_bits(before, after)
    print(f"bits: {len(bits['differ'])} of {bits['shapes']} shapes differ" +
          (": " + "; ".join(bits["differ"][:10]) if bits["differ"] else ""))
    timed = time_shapes(before, after, args.rounds, args.calls)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": "python -m benchmarks.ab_cpu_kernel " + " ".join(sys.argv[1:]),
                       "before": args.before, "after": args.after, "threads": args.threads,
                       "cpu": repr(CpuFeatures.detect()), "load": os.getloadavg(), "bits": bits, "timed": timed},
                      f, indent=1)


if __name__ == "__main__":
    main()
