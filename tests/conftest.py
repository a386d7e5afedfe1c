"""Shared fixtures. Every store a test makes through `make_store` is integrity-checked at teardown."""

from __future__ import annotations

import os

# OpenMP workers sleep at once at a barrier instead of spinning ~300k iterations first. Set before torch
# loads libgomp (it reads this once), and inherited by every subprocess a test starts. On a busy host a
# spinning thread holds the core its team-mate waits for, so each parallel region of a tiny model's op
# waits out a scheduler slice: 1000 [16, 64] x [64, 128] linears took 14-20 s on 2 threads beside other
# processes (load 6-8 on 2 cores), 0.07-0.18 s with passive waits; tests/test_tiers.py 467 s -> 92 s
# (user CPU 175 s -> 41 s). Thread counts, and so every code path, are unchanged; a run may override it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import signal
import subprocess
import time
import zlib
from pathlib import Path

import pytest
import torch

import stateful_hf
from stateful_hf.testing import tiny_llama, tiny_opt

FAMILIES = {
    "llama": lambda: tiny_llama("llama"),
    "mistral": lambda: tiny_llama("mistral"),
    "qwen2": lambda: tiny_llama("qwen2"),
    "opt": lambda: tiny_opt(),
    "opt-post-ln": lambda: tiny_opt(do_layer_norm_before=False),
    "opt-proj": lambda: tiny_opt(word_embed_proj_dim=32),
}


@pytest.fixture(autouse=True, scope="session")
def _private_profile_cache(tmp_path_factory):
    """Measured cost profiles go to a per-run directory, not the user's ~/.cache."""
    os.environ["STATEFUL_HF_CACHE"] = str(tmp_path_factory.mktemp("stateful_hf_cache"))


@pytest.fixture(autouse=True)
def _scripted_step_backends(request, monkeypatch):
    """`attn_backend="auto"` on the CPU decides its kernels by timing (`kernels/step_backends.py`); in tests by
    scripted times, the same in every run whatever the host's load: decodes on the C++ kernel, longer runs on
    torch, so every float32 engine test mixes the two in split steps. A test marked `measured_backends` times them."""
    if request.node.get_closest_marker("measured_backends") is not None:
        return
    from stateful_hf.integration import session_store
    from stateful_hf.kernels import step_backends

    def scripted(makers, query, *args) -> list[float]:   # (torch or the split step, the C++ kernel) seconds
        return [2.0, 1.0] if query.shape[0] == step_backends.DECODES else [0.5, 1.0]

    monkeypatch.setattr(step_backends, "_step_seconds", scripted)
    monkeypatch.setattr(session_store, "measure_step_backends", step_backends.measure.__wrapped__)


@pytest.fixture
def make_store():
    stores = []

    def make(model, *args, **kwargs):
        store = stateful_hf.SessionStore(model, *args, **kwargs)
        stores.append(store)
        return store

    yield make
    for store in stores:
        store.check_integrity()
        assert not any(store.session(s).busy for s in store.session_ids()), "a session was left busy"


def greedy(model, ids: torch.Tensor, n: int = 10, **kwargs) -> torch.Tensor:
    """Greedy generate. The explicit all-ones mask matters: without it transformers treats every
    occurrence of the pad id inside the sequence as padding, which is not the oracle we want."""
    kwargs.setdefault("attention_mask", torch.ones_like(ids))
    return model.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=0, **kwargs)


def store_turn(model, oracle, store, sid: str, ids: torch.Tensor, n: int = 10) -> torch.Tensor:
    """One turn of `sid` through `store.cache(sid)`: must equal stateless greedy generate on `ids`;
    the store's integrity holds after it. Returns the conversation with the reply."""
    out = greedy(model, ids, n=n, cache=store.cache(sid))
    assert torch.equal(out, greedy(oracle, ids, n=n)), sid
    store.check_integrity()
    return out


def seed_of(name: str) -> int:
    """A stable seed from a name (hash() of a str changes between processes)."""
    return zlib.crc32(name.encode())


class Conversation:
    """Random user turns appended to the model's replies: the stateless oracle sees the whole thing."""

    def __init__(self, seed: int, first: int = 20, turn: int = 9, vocab: int = 300):
        self.gen = torch.Generator().manual_seed(seed)
        self.turn, self.vocab = turn, vocab
        self.ids = self._user(first)

    def _user(self, n: int) -> torch.Tensor:
        return torch.randint(3, self.vocab, (1, n), generator=self.gen)

    def reply(self, out: torch.Tensor) -> None:
        self.ids = torch.cat([out, self._user(self.turn)], dim=1)


def engine_round(engine, convs: dict[str, Conversation], oracle, n: int) -> None:
    """One turn of every conversation through `engine.generate` together; each reply must equal
    stateless greedy generate on the whole conversation; then the replies join the conversations."""
    from stateful_hf import SamplingParams

    sids = list(convs)
    outs = engine.generate(sids, [convs[s].ids[0].tolist() for s in sids], SamplingParams(max_new_tokens=n))
    for sid, out in zip(sids, outs):
        want = greedy(oracle, convs[sid].ids.to(oracle.device), n=n).cpu()
        assert list(out.token_ids) == want[0, convs[sid].ids.shape[1]:].tolist(), sid
        convs[sid].reply(want)


def engine_round_ids(engine, oracle, convs: dict[str, torch.Tensor], sids: list[str], n: int, next_user) -> None:
    """`engine_round` for conversations kept as [1, T] id tensors: one turn of the sessions `sids`
    through `engine.generate` together; each must succeed and equal stateless greedy generate on the
    whole conversation; then the reply and `next_user(sid)` (a [1, k] tensor) join the conversation."""
    from stateful_hf import SamplingParams

    outs = engine.generate(sids, [convs[s][0].tolist() for s in sids], SamplingParams(max_new_tokens=n))
    for sid, out in zip(sids, outs):
        assert out.error is None, (sid, out.error)
        want = greedy(oracle, convs[sid], n=n)
        assert list(out.token_ids) == want[0, convs[sid].shape[1]:].tolist(), sid
        convs[sid] = torch.cat([want, next_user(sid)], 1)


def slow_schema() -> dict:
    """A JSON schema no grammar cache holds yet (fresh property names) that compiles in ~80 ms with the tiny
    tokenizer (4 properties with a repeated pattern; an AVX2 EPYC): ~80x a 1 ms compile limit. A long
    maxLength alone no longer does (xgrammar compiles maxLength 35 to 3000 in ~1.5 ms there)."""
    import uuid
    pattern = {"type": "string", "pattern": "^([a-z]{3,9}-[0-9]{2,5}_){5,40}$"}
    return {"type": "object", "properties": {f"k{i}_{uuid.uuid4().hex}": pattern for i in range(4)}}


def wait_healthy(proc, url: str, log_path, timeout: float = 300) -> None:
    """Wait until server subprocess `proc` answers `url`/health with 200; fail with its log if it exits
    first or `timeout` seconds pass (httpx imported here: collection needs no web stack)."""
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, Path(log_path).read_text()[-3000:]
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.2)


def stop_server(proc) -> None:
    """Stop server subprocess `proc` as Ctrl-C would (its graceful shutdown), killing it after 30 s."""
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=15)


def steady_threads(quiet: float = 0.5, timeout: float = 10.0) -> int:
    """The process's thread count once it has not changed for `quiet` s: threads an earlier test left (an engine
    loop thread's OpenMP team, tqdm's monitor) exit on their own time, and one exiting inside a count reads as a
    worker short."""
    import gc
    import os
    import time

    gc.collect()
    deadline = time.monotonic() + timeout
    count, since = len(os.listdir("/proc/self/task")), time.monotonic()
    while time.monotonic() - since < quiet and time.monotonic() < deadline:
        time.sleep(0.02)
        if (now := len(os.listdir("/proc/self/task"))) != count:
            count, since = now, time.monotonic()
    return count
