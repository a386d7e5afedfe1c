"""One command to check a GPU machine: the `cuda` tests plus kernel, tier, hidden-state and engine
figures at GPU sizes, in one JSON file.

    python -m benchmarks.gpu_check --json gpu.json

Runs from a plain checkout (no install of stateful-hf) on a Python with a CUDA build of torch and the
model stack (transformers in pyproject's range, accelerate, safetensors, tokenizers, xxhash,
threadpoolctl, sortedcontainers, pytest, hypothesis); `pip install -e ".[dev,gpu]"` brings them on a networked machine.
Offline: `python -m benchmarks.gpu_bundle DIR` on a networked machine, copy DIR and the checkout,
then `bash DIR/run.sh` (docs/gpu.md). On a machine without CUDA it says so and exits 0.

Sections, in order: tests (`pytest -m cuda`), kernels, model, tiers, hidden, engine. Each prints
passed / failed / skipped (with its reason) as it ends, and the JSON is rewritten after each. A
section that raised, or any of whose requests failed, is failed and keeps no figure. Skips (an
optional backend not installed, a test skipped) are listed apart from failures. Exit status 1 when
any section failed, else 0. Model shapes are Llama-3.2-1B-like (16 layers, hidden 2048, 32 query /
8 KV heads of 64, random weights, vocab 32000, built on the device in bf16) with 4K contexts;
`--smoke` runs every step at tiny sizes (heads of 64 still) on any device, to test this script: its
figures mean nothing.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import xml.etree.ElementTree as ET
from collections import deque
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parent.parent

DESCRIPTION = __doc__.split("\n\n")[0] + """

Needs a CUDA build of torch; runs from a plain checkout. Networked: pip install -e ".[dev,gpu]" (optional:
the [flash-attn] extra, a source build). Offline: python -m benchmarks.gpu_bundle DIR on a networked
machine, then bash DIR/run.sh on this one. Without CUDA it prints that it needs CUDA and exits 0.
Exit status: 1 when any section failed (the cuda tests included), else 0."""

SECTIONS = ("tests", "kernels", "tiers", "hidden", "engine")     # what --sections picks from; model follows
GPU_SHAPE = {"num_hidden_layers": 16, "hidden_size": 2048, "intermediate_size": 8192, "num_attention_heads": 32,
             "num_key_value_heads": 8, "vocab_size": 32000}
# head_dim 64 (128 / 2): the smallest the GPU backends accept, so --smoke on CUDA runs them too
SMOKE_SHAPE = {"num_hidden_layers": 2, "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 2,
               "num_key_value_heads": 1, "vocab_size": 256}
GPU_BACKENDS = ("triton", "flashinfer", "flash_attn")
BENCH_RESERVE_S = 180.0        # of --budget, kept from the cuda tests for the benchmarks (full sizes)


class SectionFailed(Exception):
    """A section's runs failed: `reason` says why; `detail` is what to keep of it (errors, never a figure)."""

    def __init__(self, reason: str, detail: dict | None = None):
        super().__init__(reason)
        self.reason = reason
        self.detail = detail or {}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_s(fn, reps: int, device: torch.device) -> float:
    times = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _prefill(model, store, sid: str, ids: torch.Tensor) -> None:
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False, pad_token_id=0,
                   past_key_values=store.cache(sid))


# ---- what ran where ----------------------------------------------------------------------------------

def checkout_commit(root: Path = ROOT) -> tuple[str, bool | None]:
    """(commit of the checkout, whether tracked files differ from it): from git, else from .git's files
    (a copied checkout git refuses, or no git installed; dirty is then None); ("unknown", None) without .git."""
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=20)
        if head.returncode == 0:
            status = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                                    capture_output=True, text=True, timeout=60)
            return head.stdout.strip(), (bool(status.stdout.strip()) if status.returncode == 0 else None)
    except (OSError, subprocess.SubprocessError):
        pass
    git = root / ".git"
    try:
        ref = (git / "HEAD").read_text().strip()
        if not ref.startswith("ref: "):
            return ref, None                                   # a detached HEAD holds the commit itself
        name = ref.removeprefix("ref: ")
        if (git / name).is_file():
            return (git / name).read_text().strip(), None
        for line in (git / "packed-refs").read_text().splitlines():
            if line.endswith(" " + name):
                return line.split()[0], None
    except OSError:
        pass
    return "unknown", None


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment(device: torch.device) -> dict:
    """What the figures were measured on and with: device, versions, checkout commit, date (UTC)."""
    try:
        import transformers

        tf_version = transformers.__version__
    except Exception as e:                 # the model section then fails with the same error
        tf_version = f"import failed: {type(e).__name__}: {e}"
    commit, dirty = checkout_commit()
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.machine()})",
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "commit": commit, "dirty": dirty,
        "python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "triton": _version("triton"), "transformers": tf_version,
    }


# ---- the tests ---------------------------------------------------------------------------------------

def tests_status(returncode: int | None, cases: dict[str, dict], on_cuda: bool) -> tuple[str, str]:
    """(status, reason) of a `pytest -m cuda` run. passed: exit 0 and a test not skipped. failed: a timeout
    (returncode None), exit 1 (a test failed), 2 (interrupted: a collection error), 3 (internal error),
    4 (usage error); on a CUDA machine also exit 5 (no test collected) or every test skipped: the
    repository has cuda tests, so none run means nothing was checked. Without CUDA those two are skipped."""
    if returncode is None:
        return "failed", "timed out"
    if returncode == 5:
        return ("failed", "pytest -m cuda collected no test") if on_cuda else ("skipped", "no cuda test collected")
    if returncode != 0:
        bad = [name for name, case in cases.items() if case["outcome"] in ("failed", "error")]
        what = {1: "tests failed", 2: "interrupted (a collection error?)", 3: "pytest internal error",
                4: "pytest usage error"}.get(returncode, "pytest failed")
        return "failed", f"exit {returncode}: {what}" + (f": {', '.join(bad[:5])}" if bad else "")
    if cases and all(case["outcome"] == "skipped" for case in cases.values()):
        return ("failed" if on_cuda else "skipped"), f"all {len(cases)} cuda tests skipped"
    return "passed", ""


def _junit_cases(xml: Path) -> dict[str, dict]:
    """Per test (`classname::name`): outcome, seconds, recorded properties, and message if not passed."""
    cases: dict[str, dict] = {}
    if not xml.exists():
        return cases
    for case in ET.parse(xml).getroot().iter("testcase"):
        entry: dict = {"outcome": "passed", "seconds": float(case.get("time", 0))}
        for tag, outcome in (("failure", "failed"), ("error", "error"), ("skipped", "skipped")):
            node = case.find(tag)
            if node is not None:
                entry["outcome"], entry["message"] = outcome, (node.get("message") or "")[:300]
        entry.update({p.get("name"): p.get("value") for p in case.iter("property")})
        cases[f"{case.get('classname')}::{case.get('name')}"] = entry
    return cases


def run_tests(timeout: float, on_cuda: bool, paths: tuple[str, ...] = ("tests",)) -> dict:
    """`pytest -m cuda paths` from the checkout, its output streamed as it runs: per test its outcome,
    seconds and recorded properties (the bf16 agreement rate); killed (its process group) past `timeout`
    seconds. Raises SectionFailed when `tests_status` says failed; the reason then ends with the output's
    last line (a timeout's: the test that was running)."""
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "junit.xml"
        # one process (`-o addopts=` drops the suite's two workers: a GPU image need not have pytest-xdist)
        cmd = [sys.executable, "-m", "pytest", "-o", "addopts=", "-m", "cuda", "-v", "-p", "no:cacheprovider",
               f"--junitxml={xml}", *paths]
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
        chunks: deque[bytes] = deque(maxlen=64)      # the output's last reads, for its tail

        def pump() -> None:
            while data := os.read(proc.stdout.fileno(), 65536):
                sys.stdout.write(data.decode(errors="replace"))
                sys.stdout.flush()
                chunks.append(data)

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            returncode: int | None = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            returncode = None
        reader.join(timeout=10)
        proc.stdout.close()
        cases = _junit_cases(xml)
    tail = [line.rstrip() for line in b"".join(chunks).decode(errors="replace").splitlines() if line.strip()][-30:]
    status, reason = tests_status(returncode, cases, on_cuda)
    if returncode is None:
        reason = f"timed out after {timeout:.0f} s"
    out = {"returncode": returncode, "summary": tail[-1] if tail else "", "tests": cases,
           "skipped": {name: case.get("message", "") for name, case in cases.items() if case["outcome"] == "skipped"}}
    if status == "failed":
        last = f"; output ends: {tail[-1][:200]}" if tail and (returncode is None or not cases) else ""
        raise SectionFailed(reason + last, {**out, "output_tail": tail})
    if status == "skipped":
        out["reason"] = reason
    return out


# ---- the benchmarks ----------------------------------------------------------------------------------

def gpu_backends(device: torch.device, head_dim: int, block_size: int) -> tuple[list[str], dict[str, str]]:
    """The GPU backends that serve fp16 at this head_dim and block size here, and why each other is
    skipped (kernels.select_backend's reason: a package or device missing). A backend refusing these
    sizes (ValueError) fails the section: they are chosen to be ones every GPU backend serves."""
    from stateful_hf import kernels

    usable, skips = [], {}
    for backend in GPU_BACKENDS:
        if device.type != "cuda":
            skips[backend] = "needs CUDA"
            continue
        try:
            kernels.select_backend(backend, device, torch.float16, head_dim, block_size)
        except RuntimeError as e:
            skips[backend] = str(e)
        except ValueError as e:
            raise SectionFailed(f"{backend} refuses the check's sizes: {e}") from e
        else:
            usable.append(backend)
    return usable, skips


def bench_kernels(device: torch.device, smoke: bool) -> dict:
    """benchmarks/bench_kernels.py's paths at 1B attention shapes (ms per call, one layer; GPU backends
    in fp16)."""
    from benchmarks import bench_kernels

    args = SimpleNamespace(seqs=2 if smoke else 16, queries=2 if smoke else 8, heads=2 if smoke else 32,
                           kv_heads=1 if smoke else 8, head_dim=64, block_size=16, reps=2 if smoke else 7)
    gpu, skips = gpu_backends(device, args.head_dim, args.block_size)
    out = {"shape": vars(args), "backends": gpu, "ms": {}, "skipped": skips}
    for ctx in ((64,) if smoke else (1024, 4096)):
        times, plan_ms = bench_kernels.measure(ctx, args, device, gpu)
        out["ms"][ctx] = {**{n: round(t * 1e3, 4) for n, t in times.items()}, "plan+first": round(plan_ms, 3)}
    return out


def build_model(shape: dict, device: torch.device, dtype: torch.dtype, ctx: int) -> tuple[torch.nn.Module, dict]:
    """A random-weight Llama of `shape`, made on `device` in `dtype` (no host copy first), and its figures."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**shape, max_position_embeddings=8192, tie_word_embeddings=True)
    t0 = time.perf_counter()
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    _sync(device)
    wrong = {(p.device.type, p.dtype) for p in model.parameters()} - {(device.type, dtype)}
    if wrong:
        raise SectionFailed(f"parameters came out as {sorted(map(str, wrong))}, not {device.type}/{dtype}")
    info = {**shape, "dtype": str(dtype).removeprefix("torch."), "context": ctx,
            "parameters": sum(p.numel() for p in model.parameters()), "build_s": round(time.perf_counter() - t0, 2)}
    if device.type == "cuda":
        info["device_bytes"] = torch.cuda.memory_allocated(device)
    return model, info


def bench_tiers(model, device: torch.device, ctx: int, reps: int) -> dict:
    """One ctx-token session: seconds to bring it back to the device from each tier (swap-in),
    to push it down (swap-out, landed), and to recompute it (prefill)."""
    from stateful_hf import SessionStore

    ids = torch.randint(3, model.config.vocab_size, (1, ctx), generator=torch.Generator().manual_seed(0)).to(device)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        store = SessionStore(model, device_capacity=2 * ctx + 64, host_capacity=2 * ctx + 64, disk_dir=tmp,
                             disk_capacity=2 * ctx + 64, policy="lru")
        try:
            _prefill(model, store, "s", ids)
            chunks = range(len(store.session("s").chunks))
            for tier in ("host", "disk"):
                def down(tier=tier):
                    store.move("s", chunks, tier)
                    store.transfer.synchronize()

                def up():
                    store.move("s", chunks, "device")

                downs, ups = [], []
                for _ in range(reps):
                    downs.append(_median_s(down, 1, device))
                    ups.append(_median_s(up, 1, device))
                out[f"swap_out_{tier}_s"] = round(statistics.median(downs), 5)
                out[f"swap_in_{tier}_s"] = round(statistics.median(ups), 5)
            store.delete("s")
            out["recompute_s"] = round(_median_s(lambda: (_prefill(model, store, "r", ids), store.delete("r")),
                                                 reps, device), 5)
            out["kv_bytes"] = store.spec.bytes_per_block * len(chunks)
        finally:
            store.close()
    return out


def bench_hidden(model, device: torch.device, ctx: int, reps: int) -> dict:
    """HCache: seconds to restore a ctx-token session from hidden states (projection) vs its K/V
    from the host, and the prefill time with capture on vs off."""
    from stateful_hf import SessionStore
    from stateful_hf.cache import CostProfile

    ids = torch.randint(3, model.config.vocab_size, (1, ctx), generator=torch.Generator().manual_seed(1)).to(device)
    cap = 2 * ctx + 64
    out = {}
    for mode in ("never", "always"):
        store = SessionStore(model, device_capacity=cap, host_capacity=cap, hidden_states=mode,
                             hidden_layers=None if mode == "never" else model.config.num_hidden_layers // 2,
                             policy="lru", cost_profile=CostProfile())
        try:
            out[f"prefill_capture_{mode}_s"] = round(_median_s(
                lambda store=store: (_prefill(model, store, "p", ids), store.delete("p")), reps, device), 5)
            _prefill(model, store, "s", ids)
            chunks = range(len(store.session("s").chunks))
            tier = "host" if mode == "never" else "hidden"
            times = []
            for _ in range(reps):
                store.move("s", chunks, tier)
                store.transfer.synchronize()
                times.append(_median_s(lambda store=store, chunks=chunks: store.move("s", chunks, "device"), 1,
                                       device))
            out[f"restore_from_{tier}_s"] = round(statistics.median(times), 5)
        finally:
            store.close()
    return out


def bench_engine(model, device: torch.device, sessions: int, prompt: int, new: int) -> dict:
    """Engine throughput: `sessions` sessions, two turns each, exactly `new` tokens per turn (EOS
    ignored). Any failed or short request fails the section (SectionFailed): no figure is kept."""
    from stateful_hf import Engine, SamplingParams, SessionStore

    store = SessionStore(model, device_capacity=sessions * (2 * prompt + 2 * new) + 256,
                         host_capacity=sessions * (2 * prompt + 2 * new), policy="lru")
    engine = Engine(model, store=store)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, model.config.vocab_size, (prompt,), generator=g).tolist() for _ in range(sessions)]
    sids = [f"e{i}" for i in range(sessions)]
    out = {"sessions": sessions, "prompt_tokens": prompt, "new_tokens": new}
    try:
        for turn in range(1, 3):
            _sync(device)
            t0 = time.perf_counter()
            outs = engine.generate(sids, prompts, SamplingParams(max_new_tokens=new, ignore_eos=True))
            _sync(device)
            dt = time.perf_counter() - t0
            errors = [f"{sid}: {o.error!r}" for sid, o in zip(sids, outs) if o.error is not None]
            errors += [f"{sid}: {len(o.token_ids)} tokens, not {new}" for sid, o in zip(sids, outs)
                       if o.error is None and len(o.token_ids) != new]
            if errors:
                raise SectionFailed(f"turn {turn}: {len(errors)} of {sessions} requests failed; first: {errors[0]}",
                                    {"errors": errors[:8]})
            out[f"turn{turn}"] = {"seconds": round(dt, 3), "tokens_per_s": round(sessions * new / dt, 1)}
            prompts = [p + list(o.token_ids) + p[:16] for p, o in zip(prompts, outs)]
    finally:
        engine.stop()
        store.close()
    return out


# ---- running the sections ----------------------------------------------------------------------------

class Check:
    """Runs sections into `report`: each ends as passed, failed or skipped (printed at once); a failed one
    keeps `reason` and its detail but no figure; skips inside a section go to `report["skipped"]`."""

    def __init__(self, report: dict, path: Path, deadline: float):
        self.report, self.path, self.deadline = report, path, deadline

    def left(self) -> float:
        return self.deadline - time.perf_counter()

    def record(self, name: str, status: str, reason: str = "", body: dict | None = None,
               seconds: float = 0.0) -> None:
        body = dict(body or {})
        for item, why in body.pop("skipped", {}).items():
            self.report["skipped"][f"{name}/{item}"] = why
            print(f"  skipped {name}/{item}: {why}", flush=True)
        self.report[name] = {"status": status, **({"reason": reason} if reason else {}), **body}
        if status == "failed":
            self.report["failed"][name] = reason
        elif status == "skipped":
            self.report["skipped"][name] = reason
        print(f"{name}: {status} ({seconds:.1f} s){': ' + reason if reason else ''}", flush=True)
        self.write()

    def run(self, name: str, fn, *, needs: str | None = None) -> dict | None:
        """Run `fn() -> dict` as section `name` unless the budget is spent or section `needs` did not pass;
        returns its dict (None when it did not run to the end)."""
        if needs is not None and self.report.get(needs, {}).get("status") != "passed":
            self.record(name, "failed", f"not run: {needs} did not pass")
            return None
        if self.left() <= 0:
            self.record(name, "failed", f"not run: the budget of {self.report['budget_s']:.0f} s was spent")
            return None
        print(f"{name}: running", flush=True)
        t0 = time.perf_counter()
        try:
            result = fn()
        except SectionFailed as e:
            self.record(name, "failed", e.reason, e.detail, time.perf_counter() - t0)
            return None
        except Exception as e:             # one failing section does not hide the others' figures
            tb = traceback.format_exc().strip().splitlines()[-12:]
            self.record(name, "failed", f"{type(e).__name__}: {e}", {"traceback": tb}, time.perf_counter() - t0)
            return None
        body = dict(result)
        reason = body.pop("reason", "")          # a section that ran but checked nothing says why
        self.record(name, "skipped" if reason else "passed", reason, body, time.perf_counter() - t0)
        return result

    def write(self) -> None:
        self.report["status"] = "failed" if self.report["failed"] else "passed"
        self.path.write_text(json.dumps(self.report, indent=1, default=str))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=DESCRIPTION,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default="gpu_check.json", help="where to write the report (default gpu_check.json)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on any device, to test this script")
    ap.add_argument("--sections", default=",".join(SECTIONS),
                    help=f"comma-separated subset of {','.join(SECTIONS)} (default all; the others are skipped)")
    ap.add_argument("--no-tests", action="store_true", help="skip `pytest -m cuda` (same as leaving out tests)")
    ap.add_argument("--test-timeout", type=float, default=300.0,
                    help="seconds for the cuda tests (default 300; also capped by --budget)")
    ap.add_argument("--budget", type=float, default=540.0,
                    help="seconds for the whole check (default 540): a section not started by then is failed")
    args = ap.parse_args(argv)
    chosen = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = sorted(set(chosen) - set(SECTIONS))
    if unknown:
        ap.error(f"--sections: unknown {unknown}; choose from {','.join(SECTIONS)}")
    if args.no_tests and "tests" in chosen:
        chosen.remove("tests")
    if not torch.cuda.is_available() and not args.smoke:
        print("gpu_check needs CUDA: torch.cuda.is_available() is False here (a CPU build of torch, or no GPU). "
              "Nothing was run; run it where a CUDA build of torch sees a GPU (offline: python -m "
              "benchmarks.gpu_bundle DIR on a networked machine, then bash DIR/run.sh there).")
        return 0
    t_start = time.perf_counter()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    report: dict = {"status": "passed", "smoke": args.smoke, **environment(device), "budget_s": args.budget,
                    "failed": {}, "skipped": {}}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    check = Check(report, Path(args.json), t_start + args.budget)
    print(f"gpu_check on {report['device']}: commit {report['commit']}, torch {report['torch']}, "
          f"triton {report['triton']}, transformers {report['transformers']}", flush=True)
    for name in SECTIONS:
        if name not in chosen:
            check.record(name, "skipped", "--no-tests" if name == "tests" and args.no_tests else "not in --sections")
    if "tests" in chosen:
        reserve = 0.0 if args.smoke else BENCH_RESERVE_S
        timeout = max(min(args.test_timeout, check.left() - reserve), 1.0)
        check.run("tests", lambda: run_tests(timeout, device.type == "cuda"))
    shape, ctx, reps = (SMOKE_SHAPE, 64, 2) if args.smoke else (GPU_SHAPE, 4096, 3)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    if "kernels" in chosen:
        check.run("kernels", lambda: bench_kernels(device, args.smoke))
    if {"tiers", "hidden", "engine"} & set(chosen):
        built: dict = {}

        def make_model() -> dict:
            built["model"], info = build_model(shape, device, dtype, ctx)
            return info

        check.run("model", make_model)
        model = built.get("model")
        if "tiers" in chosen:
            check.run("tiers", lambda: bench_tiers(model, device, ctx, reps), needs="model")
        if "hidden" in chosen:
            check.run("hidden", lambda: bench_hidden(model, device, ctx, reps), needs="model")
        if "engine" in chosen:
            check.run("engine", lambda: bench_engine(model, device, 2 if args.smoke else 16,
                                                     32 if args.smoke else 1024, 4 if args.smoke else 64),
                      needs="model")
    report["seconds"] = round(time.perf_counter() - t_start, 1)
    check.write()
    failed, skipped = report["failed"], report["skipped"]
    print(f"gpu_check: {'FAILED' if failed else 'passed'} in {report['seconds']:.0f} s; "
          f"{len(failed)} failed{' (' + ', '.join(failed) + ')' if failed else ''}, {len(skipped)} skipped; "
          f"wrote {args.json}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
