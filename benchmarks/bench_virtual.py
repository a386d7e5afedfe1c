"""Decode-step attention: vAttention's contiguous layout (dense SDPA, no block table) vs the paged
pool (the torch paged path), side by side in one run.

    python -m benchmarks.bench_virtual [--contexts 1024 4096 16384] [--batches 1 4 16] [--reps 5]

Both read the same KV (Hq=32, Hkv=8, D=128, fp32, block 32) for `batch` sessions decoding one token
each at `context` tokens; times are the median of --reps calls of one layer.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from stateful_hf.cache import KVSpec
from stateful_hf.cache.virtual.pool import VirtualPool
from stateful_hf.kernels import PagedBatch, paged_attention
from stateful_hf.kernels.dense import dense_attention

HQ, HKV, D, BS = 32, 8, 128, 32


def timed(fn, reps: int) -> float:
    fn()
    runs = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - t0)
    return statistics.median(runs)


@torch.inference_mode()
def case(ctx: int, b: int, reps: int) -> tuple[float, float]:
    """(dense ms, paged ms) for `b` sessions decoding one token each at `ctx` tokens of context."""
    pool = VirtualPool(KVSpec(1, HKV, D, block_size=BS), capacity_blocks=b * (-(-ctx // BS)), max_context=ctx)
    n_blocks = -(-ctx // BS)
    tables = [pool.allocate(n_blocks, [(f"s{i}", k) for k in range(n_blocks)]) for i in range(b)]
    kc, vc = pool.layer(0)
    kc.normal_()
    vc.normal_()
    batch = PagedBatch(torch.arange(b + 1, dtype=torch.int32), torch.full((b,), ctx - 1),
                       torch.full((b,), ctx, dtype=torch.int32), torch.tensor(tables, dtype=torch.int32))
    q = torch.randn(b, HQ, D)
    slots = [pool.slot_of(f"s{i}") for i in range(b)]
    ks, vs = pool.dense(0)

    def dense():
        return dense_attention(q, ks, vs, batch, slots, D ** -0.5)

    def paged():
        return paged_attention(q, kc, vc, batch, backend="torch")

    torch.testing.assert_close(dense(), paged(), rtol=1e-4, atol=1e-4)
    return timed(dense, reps) * 1e3, timed(paged, reps) * 1e3


def bench(contexts: list[int], batches: list[int], reps: int) -> None:
    print(f"{'context':>8} {'batch':>5} {'virtual ms':>11} {'paged ms':>9} {'paged/virtual':>14}")
    for ctx in contexts:
        for b in batches:
            dense, paged = case(ctx, b, reps)
            print(f"{ctx:>8} {b:>5} {dense:>11.2f} {paged:>9.2f} {paged / dense:>13.2f}x", flush=True)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32, CPU")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    bench(args.contexts, args.batches, args.reps)


if __name__ == "__main__":
    main()
