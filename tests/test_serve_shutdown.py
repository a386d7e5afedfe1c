"""The server's SIGTERM (issue 52's shutdown, issue 53's restart): the turn streaming at the signal is cancelled
(its stream ends, finish_reason "cancelled"), the process exits within the 10 s budget, and a server restarted on
the same --disk-dir reopens clean and serves the session's retried turn from the flushed disk tier: every prompt
token but the last reused, the answer equal to stateless `generate`. The control: `--shutdown-flush-timeout 0`
(write-behind held off by `--write-behind-delay 60`) writes nothing, the flush's one log line says what it left,
and the retried turn reuses nothing (still exact).

Two server subprocesses on one --disk-dir (fresh interpreters): A (flush 4 s) is stopped during s1's turn; B
(flush 0) serves s1's retried turn, then is stopped during s2's; a store opened here on the directory is the
control's restart. Each server start costs an interpreter with torch (~4 s quiet, ~45 s at a load of 10)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from conftest import stop_server, wait_healthy  # noqa: E402

from stateful_hf.models import TINY_MODEL, load_tiny  # noqa: E402
from stateful_hf.serve.server import TINY_NAME  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BUDGET = 10.0           # cancel + flush + exit (issue 52); the drill measures it (benchmarks/restart_drill.py)
ANSWER = 8              # tokens of a compared answer


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(disk: Path, log: Path, flush: float) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    env.pop("STATEFUL_HF_API_KEY", None)
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "stateful_hf.serve", TINY_MODEL, "--dtype", "float32", "--port", str(port),
             "--disk-dir", str(disk), "--disk-capacity", "8192", "--write-behind-delay", "60",
             "--shutdown-flush-timeout", str(flush), "--log-format", "json"],
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(proc, url, log)
    return proc, url


def turn(url: str, sid: str, prompt: list[int]) -> dict:
    r = httpx.post(url + "/v1/completions", json={"model": TINY_NAME, "prompt": prompt, "max_tokens": ANSWER,
                                                  "temperature": 0, "session_id": sid, "return_token_ids": True},
                   timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def stopped_mid_stream(proc: subprocess.Popen, url: str, sid: str, prompt: list[int]) -> tuple[str | None, float]:
    """Stream a long turn of `sid`; SIGTERM the server after its 10th chunk. Returns (the stream's finish_reason,
    seconds from the signal to the process's exit)."""
    body = {"model": TINY_NAME, "prompt": prompt, "max_tokens": 1500, "temperature": 0, "session_id": sid,
            "stream": True, "ignore_eos": True}
    chunks, reason, t0 = 0, None, None
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunks += 1
            reason = json.loads(line[6:])["choices"][0]["finish_reason"] or reason
            if chunks == 10:
                t0 = time.monotonic()
                proc.send_signal(signal.SIGTERM)
    assert t0 is not None, f"the stream ended after {chunks} chunks, before the signal"
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("the server did not exit within 60 s of SIGTERM")
    return reason, time.monotonic() - t0


def records(log: Path) -> list[dict]:
    out = []
    for line in log.read_text().splitlines():
        with contextlib.suppress(ValueError):           # the lines printed, not logged
            out.append(json.loads(line))
    return out


def stateless(oracle, ids: list[int]) -> list[int]:
    t = torch.tensor([ids])
    out = oracle.generate(t, attention_mask=torch.ones_like(t), max_new_tokens=ANSWER, do_sample=False,
                          pad_token_id=0)
    return out[0, len(ids):].tolist()


def test_sigterm_cancels_flushes_exits_and_a_restart_reuses_the_session(tmp_path):
    oracle, _ = load_tiny(TINY_MODEL)
    disk = tmp_path / "disk"
    p1 = [5 + (7 * i) % 300 for i in range(40)]
    p2 = [9 + (11 * i) % 300 for i in range(40)]

    # A: s1's first turn, then its second turn streaming when SIGTERM comes; the 4 s flush writes s1
    proc, url = start(disk, tmp_path / "a.log", flush=4.0)
    try:
        first = turn(url, "s1", p1)
        g1 = first["choices"][0]["token_ids"]
        assert g1 == stateless(oracle, p1)
        retry1 = p1 + g1 + [17, 18, 19]
        reason, took = stopped_mid_stream(proc, url, "s1", retry1)
    finally:
        if proc.poll() is None:
            stop_server(proc)
    assert reason == "cancelled", reason
    assert took < BUDGET, f"exit {took:.2f} s after SIGTERM"
    down = [r for r in records(tmp_path / "a.log") if r.get("event") == "replica_shutdown"]
    assert len(down) == 1 and down[0]["cancelled"] == 1 and down[0]["chunks_written"] > 0, down
    assert down[0]["chunks_left"] == 0, down

    # B (flush 0): s1's retried turn comes from disk, exact; then s2 is stopped mid-stream with nothing flushed
    proc, url = start(disk, tmp_path / "b.log", flush=0)
    try:
        again = turn(url, "s1", retry1)
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == len(retry1) - 1, again["usage"]
        assert again["choices"][0]["token_ids"] == stateless(oracle, retry1)
        ends = [r for r in records(tmp_path / "b.log") if r.get("event") == "request_end"]
        assert ends[-1]["restored_tokens"].get("disk", 0) > 0, ends[-1]      # brought up from disk, not recomputed
        second = turn(url, "s2", p2)
        retry2 = p2 + second["choices"][0]["token_ids"] + [21, 22]
        reason, took = stopped_mid_stream(proc, url, "s2", retry2)
    finally:
        if proc.poll() is None:
            stop_server(proc)
    assert reason == "cancelled" and took < BUDGET, (reason, took)
    b = records(tmp_path / "b.log")
    down = [r for r in b if r.get("event") == "replica_shutdown"]
    assert down[0]["chunks_written"] == 0 and down[0]["chunks_left"] > 0, down
    assert any("disk flush left" in r.get("message", "") for r in b), "the flush's leftovers were not logged"

    # the control, on the directory B left (a store opened here, as a third server's would be): s2 was not
    # flushed, so its retried turn reuses nothing; still exact; the directory reopens clean
    import stateful_hf
    model, _ = load_tiny(TINY_MODEL)
    store = stateful_hf.SessionStore(model, "256MiB", disk_dir=str(disk), disk_capacity=8192)
    try:
        assert "s2" not in store
        ids = torch.tensor([retry2])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=ANSWER, do_sample=False,
                             pad_token_id=0, past_key_values=store.cache("s2"))
        assert out[0, len(retry2):].tolist() == stateless(oracle, retry2)
        assert store.stats("s2").last_turn.reused_tokens == 0
        store.check_integrity()
    finally:
        store.close(flush=False)


@pytest.mark.parametrize("value", ["-1", "nan"])
def test_a_bad_shutdown_flush_timeout_exits_2_before_torch(value):
    out = subprocess.run([sys.executable, "-m", "stateful_hf.serve", "--shutdown-flush-timeout", value], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--shutdown-flush-timeout" in out.stderr.strip().splitlines()[-1], out.stderr
    assert "Traceback" not in out.stderr


def test_the_server_freezes_its_startup_heap_before_serving():
    """`serve` and a Ray replica freeze what startup made (`freeze_heap`): a full collection while serving no
    longer walks it. Control: the objects made after the freeze are still collected."""
    import gc

    from stateful_hf.serve.replica import freeze_heap
    try:
        made_before = [object() for _ in range(1000)]
        frozen = freeze_heap()
        # a frozen object freed by reference counting leaves the permanent generation (another thread's
        # temporaries, pytest's frames): the count may fall a little after the freeze, never rise
        assert frozen >= len(made_before) and 0 <= frozen - gc.get_freeze_count() < 100
        cycle: list = []
        cycle.append(cycle)                                  # cyclic garbage made after the freeze
        del cycle
        assert gc.collect() >= 1 and len(made_before) <= gc.get_freeze_count() <= frozen
    finally:
        gc.unfreeze()
