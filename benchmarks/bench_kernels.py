"""Paged attention microbenchmark: 32 sub-requests x 8 query tokens over 256..8192 context tokens.

    python -m benchmarks.bench_kernels [--contexts 256 1024 4096] [--reps 7] [--device cpu]

Side by side in one run, for each context length (times are the median of --reps calls, one layer):
  contiguous   SDPA over per-sub-request contiguous K/V [S, Hkv, ctx, D] with enable_gqa (the ideal:
               no paging at all; ratios are against it)
  contig fold  the same contiguous K/V with the GQA trick the torch paged path uses (query heads of one
               KV head folded into query rows): the fastest contiguous call we know; the last column
               is the torch paged path against it
  gather+sdpa  the naive paged path: a fresh gather of every sub-request's blocks, then SDPA
  torch paged  kernels.paged_attention(backend="torch") with the step's plan (made once, as a step does
               for all its layers; the plan's own one-off cost is printed separately)
  loop         the per-sub-request reference loop (torch_backend.torch_paged_attention)
  cpu          on the CPU, kernels.paged_attention(backend="cpu"): the C++ kernel reading blocks in place
               with a fixed split (kernels/cpu_backend.py; built on first use, not timed)
  on CUDA also triton / flashinfer / flash_attn when installed (fp16 there, as those kernels need).
The pool is a strided [1, blocks, 2, block_size, Hkv, D] tensor and
block tables are a random permutation, as in the store.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from stateful_hf import kernels
from stateful_hf.kernels import PagedBatch, cpu_backend, paged_attention
from stateful_hf.kernels.torch_backend import torch_paged_attention


def timed(fn, reps: int, device: torch.device) -> float:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def case(ctx: int, args, device: torch.device, dtype: torch.dtype):
    s, q, bs = args.seqs, args.queries, args.block_size
    g = torch.Generator().manual_seed(ctx)
    nbl = -(-ctx // bs)
    num_blocks = s * nbl + 1
    pool = torch.randn(1, num_blocks, 2, bs, args.kv_heads, args.head_dim, generator=g).to(device, dtype)
    table = torch.randperm(num_blocks, generator=g)[: s * nbl].view(s, nbl)
    batch = PagedBatch(cu_q=torch.arange(s + 1) * q, q_pos=(torch.arange(q) + ctx - q).repeat(s),
                       kv_len=torch.full((s,), ctx), block_table=table).to(device)
    query = torch.randn(s * q, args.heads, args.head_dim, generator=g).to(device, dtype)
    return pool[0, :, 0], pool[0, :, 1], batch, query


def measure(ctx: int, args, device: torch.device, gpu: list[str]) -> tuple[dict[str, float], float]:
    """Median seconds per call of every path at one context length, and the plan's one-off ms."""
    s, q, hq, d = args.seqs, args.queries, args.heads, args.head_dim
    kc, vc, batch, query = case(ctx, args, device, torch.float32)
    scale = d ** -0.5
    mask = torch.arange(ctx, device=device)[None, :] <= batch.q_pos[:q, None]        # [q, ctx], same for all
    qs = query.view(s, q, hq, d).transpose(1, 2)                                       # [S, Hq, q, D]
    k_cont = kc[batch.block_table].flatten(1, 2)[:, :ctx].transpose(1, 2).contiguous()   # [S, Hkv, ctx, D]
    v_cont = vc[batch.block_table].flatten(1, 2)[:, :ctx].transpose(1, 2).contiguous()

    def contiguous():
        return F.scaled_dot_product_attention(qs, k_cont, v_cont, attn_mask=mask, scale=scale, enable_gqa=True)

    rep = hq // args.kv_heads
    q_fold = qs.reshape(s, args.kv_heads, rep * q, d)                                  # rows (head in group, row)
    mask_fold = mask.repeat(rep, 1)

    def contiguous_folded():
        return F.scaled_dot_product_attention(q_fold, k_cont, v_cont, attn_mask=mask_fold, scale=scale)

    def gather_sdpa():
        k = kc[batch.block_table].flatten(1, 2)[:, :ctx].transpose(1, 2)
        v = vc[batch.block_table].flatten(1, 2)[:, :ctx].transpose(1, 2)
        return F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=scale, enable_gqa=True)

    t0 = time.perf_counter()
    plan = kernels.plan(batch, args.block_size, backend="torch")
    paged_attention(query, kc, vc, batch, plan=plan)          # first layer of a step: allocates the workspace
    plan_ms = (time.perf_counter() - t0) * 1e3
    fns = {
        "contiguous": contiguous,
        "contig fold": contiguous_folded,
        "torch paged": lambda: paged_attention(query, kc, vc, batch, plan=plan),
        "gather+sdpa": gather_sdpa,
        "loop": lambda: torch_paged_attention(query, kc, vc, batch, scale),
    }
    expect = contiguous().transpose(1, 2).reshape(s * q, hq, d)
    torch.testing.assert_close(fns["torch paged"](), expect, atol=1e-5, rtol=0)
    torch.testing.assert_close(contiguous_folded().reshape(s, hq, q, d), contiguous(), atol=1e-5, rtol=0)
    if device.type == "cpu" and cpu_backend.available(device):
        cpu_plan = kernels.plan(batch, args.block_size, backend="cpu")
        fns["cpu"] = lambda: paged_attention(query, kc, vc, batch, plan=cpu_plan)
        torch.testing.assert_close(fns["cpu"](), expect, atol=1e-5, rtol=0)
    times = {n: timed(fn, args.reps, device) for n, fn in fns.items()}
    if gpu:
        kh, vh, bh, qh = case(ctx, args, device, torch.float16)
        for name in gpu:
            p = kernels.plan(bh, args.block_size, backend=name, dtype=torch.float16)
            times[name] = timed(lambda p=p: paged_attention(qh, kh, vh, bh, plan=p), args.reps, device)
    return times, plan_ms


def run(args) -> None:
    device = torch.device(args.device)
    print(f"paged attention, {args.seqs} sub-requests x {args.queries} query rows, Hq={args.heads} "
          f"Hkv={args.kv_heads} D={args.head_dim} block_size={args.block_size}, {device}, torch {torch.__version__}, "
          f"threads {torch.get_num_threads()}, median of {args.reps}; ratios vs contiguous SDPA")
    gpu = [b for b in ("triton", "flashinfer", "flash_attn")
           if device.type == "cuda" and b in kernels.available_backends(device, torch.float16)]
    cpu = ["cpu"] if device.type == "cpu" and cpu_backend.available(device) else []
    names = ["contig fold", "torch paged", "gather+sdpa", "loop"] + cpu + gpu
    print(f"{'context':>8} {'contiguous ms':>14} " + " ".join(f"{n:>12}" for n in names)
          + "   paged/fold   plan+1st ms")
    for ctx in args.contexts:
        times, plan_ms = measure(ctx, args, device, gpu)
        base = times["contiguous"]
        print(f"{ctx:>8} {base * 1e3:>14.2f} " + " ".join(f"{times[n] / base:>11.2f}x" for n in names)
              + f"   {times['torch paged'] / times['contig fold']:9.2f}x   {plan_ms:10.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096, 8192])
    ap.add_argument("--seqs", type=int, default=32)
    ap.add_argument("--queries", type=int, default=8)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    run(ap.parse_args())


if __name__ == "__main__":
    main()
