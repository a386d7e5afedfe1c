"""Linear layers at the engine's row counts: `F.linear` beside the packed kernels (kernels/linear.py).

    python -m benchmarks.bench_linear                              # SmolLM2's shapes, fp32 and bf16
    python -m benchmarks.bench_linear --rows 1 24 40 256 --json benchmarks/results/linear.json

For each dtype, row count M and SmolLM2-135M's projection shapes (K x N = 576 x 1536, 1536 x 576,
576 x 576, 576 x 192, and the LM head 576 x 49152), the time of `F.linear` and of the packed kernel
this CPU would use (`choose`), interleaved in one run, and whether the two agree bitwise. bf16 is
run again in a fresh interpreter with `ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16`, which keeps oneDNN off
AMX: on an AMX CPU that is the AVX512-BF16 path an AMD Zen 4 takes (on a CPU without bf16 units it
changes nothing, and the report says so). The CPU's features are reported first.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from stateful_hf.kernels.cpu_features import CpuFeatures
from stateful_hf.kernels.linear import LinearKernel, apply, choose, pack

SHAPES = ((576, 1536), (1536, 576), (576, 576), (576, 192), (576, 49152))   # (in K, out N)


def timed(fn, seconds: float) -> float:
    """Median seconds of `fn` over ~`seconds` of calls (after one warm-up)."""
    fn()
    times, t0 = [], time.perf_counter()
    while time.perf_counter() - t0 < seconds or len(times) < 5:
        a = time.perf_counter()
        fn()
        times.append(time.perf_counter() - a)
    times.sort()
    return times[len(times) // 2]


def measure(dtype: torch.dtype, rows: list[int], seconds: float) -> list[dict]:
    features = CpuFeatures.detect()
    kernel = choose(dtype, torch.device("cpu"), features)
    if kernel is LinearKernel.STOCK and dtype == torch.bfloat16 and features.onednn:
        kernel = LinearKernel.ONEDNN_PACKED       # measured anyway: shows why auto leaves it off here
    out = []
    g = torch.Generator().manual_seed(0)
    for k, n in SHAPES:
        w = torch.randn(n, k, generator=g).to(dtype)
        packed = pack(w, kernel, max(rows)) if kernel is not LinearKernel.STOCK else None
        for m in rows:
            x = torch.randn(m, k, generator=g).to(dtype)
            stock = timed(lambda: F.linear(x, w), seconds)                                       # noqa: B023
            fast = timed(lambda: apply(x, packed, w, None, kernel), seconds) if packed is not None else stock  # noqa: B023
            same = packed is None or torch.equal(F.linear(x, w), apply(x, packed, w, None, kernel))
            flop = 2 * m * k * n
            out.append({"dtype": str(dtype).removeprefix("torch."), "kernel": str(kernel), "k": k, "n": n,
                        "rows": m, "stock_ms": stock * 1e3, "packed_ms": fast * 1e3, "speedup": stock / fast,
                        "stock_gflops": flop / stock / 1e9, "packed_gflops": flop / fast / 1e9, "bitwise": same})
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 24, 40, 128, 256])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--seconds", type=float, default=0.3, help="per measurement")
    ap.add_argument("--json")
    ap.add_argument("--no-isa-run", action="store_true", help="(internal) skip the ONEDNN_MAX_CPU_ISA rerun")
    a = ap.parse_args(argv)
    features = CpuFeatures.detect()
    report = {"cpu": features.describe(), "features": {f: getattr(features, f) for f in features.__slots__},
              "torch": torch.__version__, "threads": torch.get_num_threads(),
              "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA"), "load_start": os.getloadavg(),
              "command": " ".join(["python -m benchmarks.bench_linear", *(argv or sys.argv[1:])]), "runs": []}
    print(f"CPU: {report['cpu']}; {report['threads']} threads; ONEDNN_MAX_CPU_ISA={report['onednn_max_cpu_isa']}")
    for name in a.dtypes:
        for r in measure(getattr(torch, name), a.rows, a.seconds):
            report["runs"].append(r)
            print(f"{r['dtype']:>8} {r['kernel']:>13} K={r['k']:>4} N={r['n']:>5} M={r['rows']:>4}: F.linear "
                  f"{r['stock_ms']:7.3f} ms ({r['stock_gflops']:6.1f} GFLOP/s), packed {r['packed_ms']:7.3f} ms "
                  f"({r['packed_gflops']:6.1f}) x{r['speedup']:.2f}{'' if r['bitwise'] else ', not bitwise'}",
                  flush=True)
    if "bfloat16" in a.dtypes and not a.no_isa_run:
        env = dict(os.environ, ONEDNN_MAX_CPU_ISA="AVX512_CORE_BF16")
        cmd = [sys.executable, "-m", "benchmarks.bench_linear", "--dtypes", "bfloat16", "--no-isa-run",
               "--seconds", str(a.seconds), "--rows", *map(str, a.rows), "--json", "/dev/stdout"]
        print("bf16 again with ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 (no AMX)" +
              ("" if features.amx_bf16 else ": this CPU has no AMX, so it is the same path"), flush=True)
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
        report["avx512_bf16_run"] = json.loads(done.stdout[done.stdout.index("{"):])
        for r in report["avx512_bf16_run"]["runs"]:
            print(f"   AVX512_CORE_BF16 K={r['k']:>4} N={r['n']:>5} M={r['rows']:>4}: F.linear {r['stock_ms']:7.3f} "
                  f"ms, packed {r['packed_ms']:7.3f} ms x{r['speedup']:.2f}")
    report["load_end"] = os.getloadavg()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
