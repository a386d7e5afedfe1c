"""GPU paths. Tests marked `cuda` run only on a CUDA machine (`python -m benchmarks.gpu_check` runs
them), on tiny models of head_dim 64 (a size every GPU backend takes): tiers, side-stream copies,
hidden capture and layer-wise staging exact against stateless generate in float32, and the bf16
agreement rate with the backend `auto` picks and with Triton. The others run everywhere: FlashInfer's wrapper
and workspace are made once per store and planned once per step (with a recording stand-in for the
flashinfer package, which needs CUDA), and the GPU check's CPU behaviour."""

from __future__ import annotations

import json
import subprocess
import sys
import types
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from conftest import Conversation, greedy

from stateful_hf import Engine, SamplingParams
from stateful_hf.cache import CostProfile
from stateful_hf.kernels import KernelState, PagedBatch, available_backends, flashinfer_backend
from stateful_hf.testing import tiny_llama, tiny_opt

PROFILE = CostProfile()
# head_dim 64: FlashInfer takes 64/128/256 and Triton 64/80/96/128/256; the conftest FAMILIES' 16 neither
GPU_FAMILIES = {"llama": lambda: tiny_llama(num_attention_heads=2, num_key_value_heads=1, head_dim=64),
                "opt": lambda: tiny_opt(num_attention_heads=1)}


def cuda(f):
    return pytest.mark.cuda(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")(f))



def _turns(store, model, oracle, moves, n_turns=3) -> list[bool]:
    """Turns of two sessions; after each, `moves(store, sid, turn)` moves chunks. Per output: equal
    to stateless generate?"""
    convs = [Conversation(seed=7 + i, first=70, turn=20) for i in range(2)]
    same = []
    for turn in range(n_turns):
        for i, conv in enumerate(convs):
            ids = conv.ids.to(model.device)
            out = greedy(model, ids, cache=store.cache(f"s{i}"))
            same.append(torch.equal(out, greedy(oracle, ids)))
            conv.reply(out.cpu())
            moves(store, f"s{i}", turn)
        store.check_integrity()
    return same


def _tiers(store, sid, turn):
    n = len(store.session(sid).chunks)
    store.move(sid, range(0, n, 2), ("host", "disk", "dropped")[turn % 3])
    store.move(sid, range(1, n, 2), ("disk", "host", "device")[turn % 3])


@cuda
@pytest.mark.parametrize("family", ["llama", "opt"])
def test_cuda_tiers_and_side_stream_copies_exact(family, make_store, tmp_path):
    model, oracle = GPU_FAMILIES[family]().cuda(), GPU_FAMILIES[family]().cuda()
    store = make_store(model, 256, host_capacity=512, disk_dir=tmp_path / "d", disk_capacity=512,
                       cost_profile=PROFILE, swap_out_threshold=0.5, attn_backend="torch")
    assert all(_turns(store, model, oracle, _tiers))
    c = store.stats().counters
    assert c.swapped_in_host and c.swapped_in_disk and c.swapped_out_host


@cuda
def test_cuda_hidden_capture_exact(make_store):
    model, oracle = GPU_FAMILIES["llama"]().cuda(), GPU_FAMILIES["llama"]().cuda()
    store = make_store(model, 512, host_capacity=1024, hidden_states="always", hidden_layers=1,
                       cost_profile=PROFILE, attn_backend="torch")

    def moves(st, sid, turn):     # every turn: all to hidden (a KV swap-in's blocks could not go hidden again)
        st.move(sid, range(len(st.session(sid).chunks)), "hidden")

    assert all(_turns(store, model, oracle, moves))
    c = store.stats().counters
    assert c.swapped_out_hidden and c.restored_hidden    # captured on the side stream, then rebuilt from it


@cuda
@pytest.mark.parametrize("stage", [None, True])
def test_cuda_layerwise_staging_exact(stage, make_store):
    model, oracle = GPU_FAMILIES["llama"]().cuda(), GPU_FAMILIES["llama"]().cuda()
    store = make_store(model, 256, chunk_size=16, host_capacity=8192, cost_profile=PROFILE, layerwise_kv=True,
                       attn_backend="torch")
    store.layered.stage = stage
    engine = Engine(model, store=store, max_batch_tokens=128, layerwise_kv=True)
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, 200, (n,), generator=g).tolist() for n in (400, 90, 300)]
    outs = engine.generate([f"s{i}" for i in range(3)], prompts, SamplingParams(max_new_tokens=8))
    for p, o in zip(prompts, outs):
        ids = torch.tensor([p], device="cuda")
        assert o.error is None and list(o.token_ids) == greedy(oracle, ids, n=8)[0, len(p):].tolist()


@cuda
@pytest.mark.parametrize("backend", ["auto", "triton"])
def test_cuda_bf16_agreement_rate(backend, make_store, record_property):
    """bf16 is not exact (kernels differ in summation order): report the share of greedy tokens equal
    to stateless bf16 generate; a rate far below 1 means a wrong path, not rounding. With the backend
    `auto` picks (the first installed of flashinfer, flash_attn, triton) and with Triton by name."""
    if backend == "triton":
        pytest.importorskip("triton")
    model, oracle = (GPU_FAMILIES["llama"]().cuda().to(torch.bfloat16) for _ in range(2))
    store = make_store(model, 256, host_capacity=512, cost_profile=PROFILE, attn_backend=backend)
    # head_dim 64, bf16, 32-token blocks: every installed GPU backend serves it, so auto takes the first
    assert store.attn_backend == (backend if backend != "auto" else available_backends("cuda", torch.bfloat16)[0])
    record_property("attn_backend", store.attn_backend)
    agree = total = 0
    convs = [Conversation(seed=40 + i, first=60, turn=16) for i in range(3)]
    for _ in range(3):
        for i, conv in enumerate(convs):
            ids = conv.ids.cuda()
            out, ref = greedy(model, ids, cache=store.cache(f"b{i}")), greedy(oracle, ids)
            agree += int((out[0, ids.shape[1]:] == ref[0, ids.shape[1]:]).sum())
            total += out.shape[1] - ids.shape[1]
            conv.reply(out.cpu())
            store.move(f"b{i}", range(len(store.session(f"b{i}").chunks)), "host")
    record_property("bf16_agreement", agree / total)
    print(f"bf16_agreement={agree / total:.4f}")
    assert agree / total > 0.8


class _FakeWrapper:
    made, plans = 0, 0

    def __init__(self, workspace, layout):
        type(self).made += 1

    def plan(self, *args, **kwargs):
        type(self).plans += 1

    def run(self, query, caches):
        return torch.zeros_like(query)


def test_flashinfer_one_wrapper_per_store_planned_once_per_step(monkeypatch):
    """The wiring only (FlashInfer itself needs CUDA): a recording stand-in for the package counts
    wrappers made and plan() calls over 3 steps of 4 layers each, with a window change in step 3."""
    fake = types.SimpleNamespace(BatchPrefillWithPagedKVCacheWrapper=_FakeWrapper)
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    monkeypatch.setattr(flashinfer_backend, "WORKSPACE_BYTES", 1024)
    state = KernelState()
    batch = PagedBatch(torch.tensor([0, 3]), torch.tensor([0, 1, 2]), torch.tensor([3]), torch.tensor([[0]]))
    q, kc = torch.zeros(3, 2, 8, dtype=torch.float16), torch.zeros(2, 4, 1, 8, dtype=torch.float16)
    for step in range(3):
        plan = flashinfer_backend.FlashInferPlan(batch, 4, shared=state.flashinfer("cpu"))
        for layer in range(4):
            plan.run(q, kc, kc, 0.5, window=2 if step == 2 and layer % 2 else None)
    assert _FakeWrapper.made == 1
    assert _FakeWrapper.plans == 2 + 4     # once in steps 1 and 2; step 3 alternates windows every layer
    assert state.flashinfer("cpu") is state.flashinfer("cpu")


def test_gpu_check_on_cpu_says_it_needs_cuda(tmp_path):
    out = tmp_path / "o.json"
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the check would run for real")
    r = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--json", str(out)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "needs CUDA" in r.stdout and "gpu_bundle" in r.stdout and not out.exists()
    h = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--help"], capture_output=True, text=True,
                       timeout=120)
    assert h.returncode == 0 and "CUDA build of torch" in h.stdout and '.[dev,gpu]' in h.stdout
    assert "benchmarks.gpu_bundle DIR" in h.stdout and "Exit status" in h.stdout


# Absent on a GPU image (docs/gpu.md): nothing the check imports may need them.
NOT_ON_A_GPU_IMAGE = ("fastapi", "uvicorn", "pydantic", "gguf", "gradio", "ray", "openai")


def test_gpu_check_smoke_writes_every_figure(tmp_path):
    """--smoke runs every benchmark step at tiny sizes (heads of 64, as the GPU backends need) on this
    device, with the web stack and gguf made unimportable: every section passed, each outcome printed as
    it ends, skips listed apart from failures, and what the figures were measured on (commit, versions,
    device, date) recorded."""
    out = tmp_path / "smoke.json"
    code = (f"import sys\nfor name in {NOT_ON_A_GPU_IMAGE!r}:\n    sys.modules[name] = None\n"
            "from benchmarks.gpu_check import main\n"
            f"sys.exit(main(['--smoke', '--no-tests', '--json', {str(out)!r}]))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(out.read_text())
    assert report["device"] and report["smoke"] is True and report["status"] == "passed"
    assert report["date"] and report["commit"] and report["torch"] == torch.__version__ and report["transformers"]
    assert "triton" in report and "python" in report
    for section in ("kernels", "model", "tiers", "hidden", "engine"):
        assert report[section]["status"] == "passed", report[section]
        assert f"{section}: passed" in r.stdout
    assert report["failed"] == {} and report["tests"] == {"status": "skipped", "reason": "--no-tests"}
    skipped = report["skipped"]
    assert skipped["tests"] == "--no-tests" and "tests: skipped" in r.stdout
    if not torch.cuda.is_available():
        assert {k: skipped[k] for k in skipped if k.startswith("kernels/")} == {
            "kernels/triton": "needs CUDA", "kernels/flashinfer": "needs CUDA", "kernels/flash_attn": "needs CUDA"}
    assert report["kernels"]["shape"]["head_dim"] == 64
    assert report["model"]["hidden_size"] // report["model"]["num_attention_heads"] == 64
    assert report["tiers"]["swap_in_host_s"] > 0 and report["engine"]["turn2"]["tokens_per_s"] > 0


def test_gpu_check_a_failed_request_fails_the_engine_section_and_the_exit_status(tmp_path, monkeypatch, capsys):
    """A request that fails in the engine (its step raises for one session: the stepper reruns the step
    one request at a time, so only that one fails) makes the engine section failed with its reason and
    no figure, and main() return 1. The same run without the fault is the control: passed, figures, 0."""
    from benchmarks import gpu_check
    from stateful_hf.engine.runner import ModelRunner

    def check(name: str) -> tuple[int, dict]:
        path = tmp_path / f"{name}.json"
        code = gpu_check.main(["--smoke", "--sections", "engine", "--json", str(path)])
        return code, json.loads(path.read_text())

    code, ok = check("control")
    assert code == 0 and ok["status"] == "passed" and ok["failed"] == {}
    assert ok["engine"]["status"] == "passed" and ok["engine"]["turn2"]["tokens_per_s"] > 0
    assert ok["skipped"] == {name: "not in --sections" for name in ("tests", "kernels", "tiers", "hidden")}

    execute = ModelRunner.execute

    def fail_e1(self, items):
        if any(it.request.session_id == "e1" for it in items):
            raise RuntimeError("injected kernel fault")
        return execute(self, items)

    monkeypatch.setattr(ModelRunner, "execute", fail_e1)
    capsys.readouterr()
    code, bad = check("fault")
    out = capsys.readouterr().out
    engine = bad["engine"]
    assert code == 1 and bad["status"] == "failed" and bad["failed"] == {"engine": engine["reason"]}
    assert engine["status"] == "failed" and "1 of 2 requests failed" in engine["reason"]
    assert "injected kernel fault" in engine["reason"] and engine["errors"][0].startswith("e1: ")
    assert not {"turn1", "turn2"} & set(engine) and "tokens_per_s" not in json.dumps(engine)
    assert "engine" not in bad["skipped"] and bad["model"]["status"] == "passed"
    assert "engine: failed" in out and "gpu_check: FAILED" in out


def test_gpu_check_cuda_test_run_outcomes(tmp_path):
    """The `pytest -m cuda` step on a probe file: a failing test fails the section naming it, a skip is
    listed apart with its reason, a recorded property is kept; the same file without the failing test
    passes (the control); a hang is killed at the timeout; no cuda test collected fails on CUDA only."""
    from benchmarks.gpu_check import SectionFailed, run_tests, tests_status

    head = "import time\n\nimport pytest\n\n\n"
    hangs = tmp_path / "hangs" / "test_hangs.py"
    hangs.parent.mkdir()
    hangs.write_text(head + "@pytest.mark.cuda\ndef test_hangs():\n    time.sleep(120)\n")
    with ThreadPoolExecutor(1) as pool:       # the hang's 20 s run beside the others
        hung = pool.submit(run_tests, 20, True, paths=(str(hangs),))
        _outcomes(tmp_path / "test_probe.py", head)
        # 20 s: pytest's start reaches the test's name in ~3 s here, past 5 s on a loaded machine (CI saw it)
        with pytest.raises(SectionFailed, match="timed out after 20 s; output ends: .*test_hangs"):
            hung.result()
    assert tests_status(0, {"a": {"outcome": "skipped"}}, False) == ("skipped", "all 1 cuda tests skipped")
    assert tests_status(0, {"a": {"outcome": "skipped"}}, True) == ("failed", "all 1 cuda tests skipped")
    assert tests_status(2, {}, True)[0] == tests_status(4, {}, True)[0] == "failed"


def _outcomes(probe, head: str) -> None:
    """A failing, a passing and an empty probe file through `run_tests` (the rest of the test above)."""
    from benchmarks.gpu_check import SectionFailed, run_tests

    ok = ("@pytest.mark.cuda\ndef test_ok(record_property):\n    record_property('rate', 0.9)\n\n\n"
          "@pytest.mark.cuda\ndef test_absent():\n    pytest.skip('flashinfer is not installed')\n\n\n"
          "def test_unmarked():\n    raise AssertionError\n\n\n")
    probe.write_text(head + ok + "@pytest.mark.cuda\ndef test_broken():\n    raise AssertionError\n")
    with pytest.raises(SectionFailed) as failed:
        run_tests(120, True, paths=(str(probe),))
    assert failed.value.reason.startswith("exit 1: tests failed") and "test_broken" in failed.value.reason
    cases = {name.split("::")[1]: case for name, case in failed.value.detail["tests"].items()}
    assert {name: case["outcome"] for name, case in cases.items()} == {
        "test_ok": "passed", "test_absent": "skipped", "test_broken": "failed"}
    probe.write_text(head + ok)
    out = run_tests(120, True, paths=(str(probe),))
    assert out["returncode"] == 0 and "reason" not in out
    assert [why for name, why in out["skipped"].items() if name.endswith("::test_absent")] == [
        "flashinfer is not installed"]
    assert [case["rate"] for name, case in out["tests"].items() if name.endswith("::test_ok")] == ["0.9"]
    probe.write_text(head + "def test_unmarked():\n    pass\n")
    with pytest.raises(SectionFailed, match="collected no test"):
        run_tests(120, True, paths=(str(probe),))
    assert run_tests(120, False, paths=(str(probe),))["reason"] == "no cuda test collected"


def test_gpu_check_records_the_commit_without_git(tmp_path):
    """A copied checkout git refuses (or no git): the commit comes from .git's files; no .git: unknown."""
    from benchmarks.gpu_check import checkout_commit

    sha = "0123456789abcdef0123456789abcdef01234567"
    assert checkout_commit(tmp_path) == ("unknown", None)
    (tmp_path / ".git" / "refs" / "heads").mkdir(parents=True)
    (tmp_path / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (tmp_path / ".git" / "packed-refs").write_text(f"# pack-refs with: peeled\n{sha} refs/heads/main\n")
    assert checkout_commit(tmp_path) == (sha, None)
    (tmp_path / ".git" / "refs" / "heads" / "main").write_text(sha[::-1] + "\n")
    assert checkout_commit(tmp_path) == (sha[::-1], None)
    (tmp_path / ".git" / "HEAD").write_text(sha + "\n")
    assert checkout_commit(tmp_path) == (sha, None)
