"""The Triton kernel compiles for the GPUs it targets, checked on the CPU.

CPU tests run `paged_attention_kernel` under Triton's interpreter, which skips the compiler's type
checks: a kernel can pass them all and still fail to compile on its first GPU launch. Here
`triton.compile` builds it for sm_80 and sm_90 down to a cubin (Triton's own ptxas) with the arguments
`kernel_launch` makes (the helper every launch uses), specialised by Triton's own launch binder, over a
pairwise cover of: target, dtype, head_dim, block size, GQA group, window (0, 1, 33, 64: Triton makes 1
a constant and marks multiples of 16), int32/int64 for every index tensor, unit and non-unit strides.
Each cubin's shared memory must fit the target's per-block limit (a launch would fail otherwise).

It runs in a fresh interpreter with TRITON_INTERPRET unset (other test modules set it at import):
`python tests/test_triton_compile.py [SHARD SHARDS]` prints one JSON line per case.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SHARED_LIMIT = {80: 163 * 1024, 90: 227 * 1024}   # max dynamic shared memory per block (A100, H100)
FACTORS: dict[str, tuple] = {
    "cc": (80, 90),
    "dtype": ("float32", "float16", "bfloat16"),
    "head_dim": (64, 80, 96, 128, 256),
    "block_size": (16, 32, 64, 128),
    "window": (0, 1, 33, 64),
    "group": (1, 4),
    "strides": ("unit", "non-unit"),
    "cu_q": ("int32", "int64"),
    "q_pos": ("int32", "int64"),
    "kv_len": ("int32", "int64"),
    "block_table": ("int32", "int64"),
    "tiles": ("int32", "int64"),
}


def _pair(a: str, x, b: str, y, names: list[str]) -> tuple:
    return ((a, x), (b, y)) if names.index(a) < names.index(b) else ((b, y), (a, x))


def pairwise(factors: dict[str, tuple]) -> list[dict]:
    """A deterministic greedy cover: every pair of values of any two factors appears in some case."""
    names = list(factors)
    uncovered = {((a, x), (b, y)) for a, b in itertools.combinations(names, 2)
                 for x in factors[a] for y in factors[b]}
    cases = []
    while uncovered:
        (a, x), (b, y) = min(uncovered, key=lambda p: (names.index(p[0][0]), names.index(p[1][0]), str(p)))
        case = {a: x, b: y}
        for name in names:
            if name not in case:
                gains = [sum(_pair(n, case[n], name, v, names) in uncovered for n in case) for v in factors[name]]
                case[name] = factors[name][gains.index(max(gains))]
        cases.append({n: case[n] for n in names})
        uncovered -= {((p, case[p]), (q, case[q])) for p, q in itertools.combinations(names, 2)}
    return cases


# The largest tile of each dtype (shared memory grows with head_dim x block size), on the smaller sm_80 limit.
COVER = pairwise(FACTORS)
CORNERS = [{**COVER[0], "cc": 80, "dtype": dt, "head_dim": 256, "block_size": 128} for dt in FACTORS["dtype"]]
CASES = COVER + CORNERS


def launch_for(case: dict):
    """`kernel_launch` of a small batch on the CPU shaped as `case` says (data is never read)."""
    import torch

    from stateful_hf.kernels import triton_backend
    from stateful_hf.kernels.batch import PagedBatch

    dtype, d, bs = getattr(torch, case["dtype"]), case["head_dim"], case["block_size"]
    hkv = 2
    hq = hkv * case["group"]
    step = 1 if case["strides"] == "unit" else 2       # non-unit: every head_dim stride is 2
    t, blocks = 20, 8
    query = torch.zeros(t, hq, d * step, dtype=dtype)[..., ::step]
    out = torch.zeros(t, hq, d * step, dtype=dtype)[..., ::step]
    pool = torch.zeros(2, blocks, 2, bs, hkv, d * step, dtype=dtype)[..., ::step]   # [layers, blocks, 2, bs, Hkv, D]
    ix = {k: getattr(torch, case[k]) for k in ("cu_q", "q_pos", "kv_len", "block_table", "tiles")}
    table = torch.arange(2 * 3, dtype=ix["block_table"]).reshape(2, 3)
    if case["strides"] != "unit":
        table = table.t().contiguous().t()            # column-major: neither table stride is 1
    batch = PagedBatch(torch.tensor([0, 12, 20], dtype=ix["cu_q"]),
                       torch.cat([torch.arange(12), torch.arange(30, 38)]).to(ix["q_pos"]),
                       torch.tensor([12, 38], dtype=ix["kv_len"]), table)
    tiles = tuple(x.to(ix["tiles"]) for x in triton_backend.query_tiles(batch))
    return triton_backend.kernel_launch(query, pool[1, :, 0], pool[1, :, 1], out, batch, 0.125, case["window"],
                                        0.0, tiles, interpret=False)


def compile_launch(kernel, launch, cc: int):
    """`triton.compile` of `kernel` for sm_`cc` with the signature, constants and alignment attributes
    that a launch with these arguments would get (Triton's binder, as `JITFunction.run` calls it)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", cc, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*launch.args, **launch.constexprs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, dict(launch.constexprs), bound,
                                                              specialization, options)
    return triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target, options=options.__dict__)


def main(shard: int = 0, shards: int = 1) -> None:
    """Compile every `shards`-th case from `shard` on, one JSON line each."""
    from stateful_hf.kernels import triton_backend

    kernel = triton_backend.kernel()
    for case in CASES[shard::shards]:
        t0 = time.perf_counter()
        try:
            compiled = compile_launch(kernel, launch_for(case), case["cc"])
            result = {"ok": True, "shared": compiled.metadata.shared, "cubin": "cubin" in compiled.asm}
        except Exception as e:       # the report names the case; the test asserts on it
            result = {"ok": False, "error": f"{type(e).__name__}: {str(e)[-600:]}"}
        print(json.dumps({"case": case, **result, "seconds": round(time.perf_counter() - t0, 2)}), flush=True)


def _env(tmp_path: Path, **extra_env: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]),
               TRITON_CACHE_DIR=str(tmp_path / "triton-cache"),
               TRITON_DEFAULT_FP_FUSION=env.get("TRITON_DEFAULT_FP_FUSION", "1"), **extra_env)
    return env


def _run(tmp_path: Path, script: list[str], **extra_env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *script], capture_output=True, text=True, env=_env(tmp_path, **extra_env),
                          timeout=600)


def test_pairwise_cover_is_complete_and_small():
    names = list(FACTORS)
    for a, b in itertools.combinations(names, 2):
        seen = {(c[a], c[b]) for c in CASES}
        assert seen == set(itertools.product(FACTORS[a], FACTORS[b])), (a, b)
    assert len(CASES) <= 40, len(CASES)
    assert any(c["q_pos"] == "int64" and c["window"] == 33 for c in CASES)   # the store's q_pos, a window


def test_paged_attention_kernel_compiles_for_sm80_and_sm90(tmp_path):
    pytest.importorskip("triton")
    # two shards side by side (the compiler and ptxas are single-threaded), each with its own cache
    procs = [subprocess.Popen([sys.executable, str(Path(__file__)), str(i), "2"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=_env(tmp_path / str(i))) for i in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(err[-3000:] for _, err in outs)
    results = [json.loads(line) for out, _ in outs for line in out.splitlines() if line.startswith("{")]
    assert len(results) == len(CASES), "\n".join(out[-2000:] + err[-2000:] for out, err in outs)
    failed = [x for x in results if not x["ok"]]
    assert not failed, "\n".join(f"{x['case']}: {x['error']}" for x in failed)
    assert all(x["cubin"] for x in results)
    too_big = [x for x in results if x["shared"] > SHARED_LIMIT[x["case"]["cc"]]]
    assert not too_big, "shared memory over the per-block limit:\n" + "\n".join(
        f"{x['case']}: {x['shared']} bytes" for x in too_big)


# The bug class this catches, in miniature: the interpreter runs it, the compiler refuses it.
NEGATIVE_CONTROL = """
import sys, torch, triton, triton.language as tl
from test_triton_compile import compile_launch
from stateful_hf.kernels.triton_backend import KernelLaunch

@triton.jit
def f(X, n):
    lo = 0
    if n > 0:
        lo = tl.load(X)          # X is int64: the branch redefines an int32 as int64
    tl.store(X + 1, lo)

x = torch.tensor([7, 0], dtype=torch.int64)
if sys.argv[1] == "interpret":
    f[(1,)](x, 3)
    print("ran", x.tolist())
else:
    try:
        compile_launch(f, KernelLaunch(grid=(1,), args=(x, 3), constexprs={}), 90)
        print("compiled")
    except Exception as e:
        print("refused", type(e).__name__)
"""


def test_negative_control_a_type_error_the_interpreter_misses_is_caught(tmp_path):
    pytest.importorskip("triton")
    script = tmp_path / "control.py"
    script.write_text(NEGATIVE_CONTROL)
    interpreted = _run(tmp_path, [str(script), "interpret"], TRITON_INTERPRET="1")
    assert interpreted.stdout.strip() == "ran [7, 7]", interpreted.stdout + interpreted.stderr[-2000:]
    compiled = _run(tmp_path, [str(script), "compile"])
    assert compiled.stdout.startswith("refused"), compiled.stdout + compiled.stderr[-2000:]


if __name__ == "__main__":
    main(*map(int, sys.argv[1:3]))
