"""Load: 200 concurrent streaming clients against `python -m stateful_hf.serve` (a subprocess on
127.0.0.1), 2 turns each. Every reply must equal its own session's greedy output (computed here
with a separate engine), none lost; the server's memory (RSS) stays flat from round to round."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
psutil = pytest.importorskip("psutil")

from stateful_hf import Engine, SamplingParams  # noqa: E402
from stateful_hf.serve.server import TINY_NAME  # noqa: E402
from stateful_hf.testing import tiny_llama, tiny_tokenizer  # noqa: E402

CLIENTS = int(os.environ.get("SERVE_LOAD_CLIENTS", 200))
MAX_TOKENS = 8
WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "sea", "stars", "night", "weather",
         "mountains"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _question(i: int, turn: int) -> str:
    return f"{WORDS[i % len(WORDS)]} {WORDS[(i // 7 + turn) % len(WORDS)]} {i} turn {turn}?"


@pytest.fixture(scope="module")
def server_process(tmp_path_factory):
    port = _free_port()
    log = open(tmp_path_factory.mktemp("serve") / "server.log", "w+")  # noqa: SIM115 - a file: a full pipe blocks
    proc = subprocess.Popen([sys.executable, "-m", "stateful_hf.serve", "--port", str(port), "--max-batch-tokens",
                             "1024", "--model", "tiny-random", "--dtype", "float32"], stdout=log,
                            stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            log.seek(0)
            pytest.fail(f"server did not start: {log.read()[-2000:]}")
        time.sleep(0.2)
    yield url, proc
    proc.terminate()
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)
    log.close()


async def _one(http: httpx.AsyncClient, url: str, sid: str, messages: list[dict]) -> tuple[str, str, float]:
    body = {"model": TINY_NAME, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    text, finish, done, t0, ttft = [], None, False, time.monotonic(), None
    async with http.stream("POST", url + "/v1/chat/completions", json=body, headers={"X-Session-Id": sid}) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            choice = chunk["choices"][0]
            if choice["delta"].get("content"):
                ttft = ttft if ttft is not None else time.monotonic() - t0
                text.append(choice["delta"]["content"])
            finish = choice["finish_reason"] or finish
    assert done and finish in ("stop", "length"), (sid, finish)
    return sid, "".join(text), ttft if ttft is not None else time.monotonic() - t0


async def _round(url: str, convs: dict[str, list[dict]]) -> tuple[dict[str, str], list[float], float]:
    limits = httpx.Limits(max_connections=CLIENTS + 10, max_keepalive_connections=CLIENTS + 10)
    timeout = httpx.Timeout(60.0, connect=20.0)
    t0 = time.monotonic()
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as http:
        results = await asyncio.wait_for(asyncio.gather(*(_one(http, url, sid, m) for sid, m in convs.items())), 120)
    return {sid: text for sid, text, _ in results}, sorted(t for *_, t in results), time.monotonic() - t0


def test_200_concurrent_streaming_clients(server_process):
    url, proc = server_process
    rss = lambda: psutil.Process(proc.pid).memory_info().rss
    reference = Engine(tiny_llama(), tiny_tokenizer(), device_capacity="256MiB", max_batch_tokens=1024)
    greedy = SamplingParams(max_new_tokens=MAX_TOKENS)
    sids = [f"load-{i}" for i in range(CLIENTS)]
    convs = {sid: [] for sid in sids}
    # warm-up round on other sessions (first-use allocations), then measure
    warm = {f"warm-{i}": [{"role": "user", "content": _question(i, 9)}] for i in range(CLIENTS)}
    asyncio.run(_round(url, warm))
    rss_start, report = rss(), []
    for turn in range(2):
        for i, sid in enumerate(sids):
            convs[sid].append({"role": "user", "content": _question(i, turn)})
        got, ttfts, wall = asyncio.run(_round(url, convs))
        outs = reference.generate(sids, [list(convs[s]) for s in sids], greedy)
        assert len(got) == CLIENTS
        mismatched = [s for s, o in zip(sids, outs) if got[s] != o.text]
        assert not mismatched, f"turn {turn + 1}: {len(mismatched)} replies differ, e.g. {mismatched[:3]}"
        for sid in sids:
            convs[sid].append({"role": "assistant", "content": got[sid]})
        report.append(f"turn {turn + 1}: {CLIENTS} clients in {wall:.2f} s, TTFT p50 {ttfts[len(ttfts) // 2]:.3f} s "
                      f"p99 {ttfts[int(len(ttfts) * 0.99) - 1]:.3f} s, server RSS {rss() / 2**20:.0f} MiB")
    metrics = httpx.get(url + "/metrics", timeout=10).text
    reused = sum(float(line.split()[-1]) for line in metrics.splitlines()
                 if line.startswith("stateful_hf_turns_with_reuse_total"))
    assert reused >= CLIENTS                              # every second turn reused its first turn's KV
    growth = rss() - rss_start
    print("\n" + "\n".join(report) + f"\nRSS growth over the measured rounds: {growth / 2**20:.1f} MiB")
    assert growth < 64 * 2**20, f"server RSS grew {growth / 2**20:.1f} MiB"
