"""API keys: the keys file, its reload on SIGHUP in a real server process, and refusing an open bind."""

from __future__ import annotations

import os
import pickle
import signal
import socket
import subprocess
import sys
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from conftest import wait_healthy  # noqa: E402

from stateful_hf.serve.auth import Access, KeyRing, parse_keys_file  # noqa: E402
from stateful_hf.serve.limits import Limits  # noqa: E402

K1, K2, K3 = "first-key-of-tenant-a-000000", "only-key-of-tenant-b-000000", "second-key-of-tenant-a-00000"


def test_keys_file_and_reload(tmp_path):
    path = tmp_path / "keys"
    path.write_text(f"{K1} a   # comment\n\n# a line of comment\n{K2} b\n")
    ring = KeyRing("the-default-key-0123456789", path)
    assert ring.tenant(K1) == "a" and ring.tenant(K2) == "b" and ring.tenant("the-default-key-0123456789") == "default"
    for wrong in (None, "", K1[:-1], K1 + "0", "a", K1.upper()):
        assert ring.tenant(wrong) is None
    for text, message in ((f"{K1}\n", "expected `key tenant`"), (f"{K1} a b\n", "expected `key tenant`"),
                          (f"{K1} a/b\n", "tenant names"), (f"{K1} a\n{K1} b\n", "listed twice")):
        path.write_text(text)
        with pytest.raises(ValueError, match=message):
            parse_keys_file(path)
        assert not ring.reload()                 # a broken file: the keys in force stay
        assert ring.tenant(K1) == "a" and ring.tenant(K3) is None
    path.write_text(f"{K3} a\n{K2} b\n")
    assert ring.reload()
    assert ring.tenant(K1) is None and ring.tenant(K3) == "a" and ring.tenant(K2) == "b"
    path.unlink()
    assert not ring.reload() and ring.tenant(K3) == "a"
    with pytest.raises(ValueError, match="empty"):
        KeyRing("  ")
    path.write_text(f"{K1} a\n")
    with pytest.raises(ValueError, match="another tenant"):
        KeyRing(K1, path)
    # crossing to a Ray actor (the cluster's ingress) re-reads the file there
    path.write_text(f"{K2} b\n")
    access = pickle.loads(pickle.dumps(Access(KeyRing("the-default-key-0123456789", path), "m", Limits(10))))
    assert access.keys.tenant(K2) == "b" and access.keys.tenant("the-default-key-0123456789") == "default"
    assert access.limits.max_body_bytes == 10 and access.metrics_key == "m"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "STATEFUL_HF_API_KEY"}
    return {**env, "OMP_NUM_THREADS": "1"}


def test_non_loopback_host_without_a_key_exits_2(monkeypatch, capsys):
    """`python -m stateful_hf.serve` refuses these before loading anything (argparse: exit status 2)."""
    from stateful_hf.serve.__main__ import main
    monkeypatch.delenv("STATEFUL_HF_API_KEY", raising=False)
    for args, says in ((["--host", "0.0.0.0"], "--allow-unauthenticated"), (["--host", "example.org"], "--api-key"),
                       (["--api-keys-file", "/nonexistent/keys"], "API keys"),
                       (["--max-body-bytes", "0"], "--max-body-bytes"), (["--tenant-share", "a=0"], "TENANT=WEIGHT")):
        with pytest.raises(SystemExit) as e:
            main(args)
        assert e.value.code == 2, args
        assert says in capsys.readouterr().err
    from stateful_hf.serve.__main__ import _announce
    from stateful_hf.serve.auth import Access
    _announce(Access(), "127.0.0.1")
    assert "no API key configured" in capsys.readouterr().out


def test_sighup_reloads_keys_in_a_running_server(tmp_path):
    """A removed key is refused from the reload on; a turn it started keeps running to its end; its
    tenant's sessions stay (the tenant's new key continues them with their history reused)."""
    keys = tmp_path / "keys"
    keys.write_text(f"{K1} a\n{K2} b\n")
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "server.log", "w")  # noqa: SIM115 - closed in the finally below
    proc = subprocess.Popen([sys.executable, "-m", "stateful_hf.serve", "--model", "tiny-random", "--port", str(port),
                             "--api-keys-file", str(keys), "--default-max-tokens", "8", "--dtype", "float32"],
                            stdout=log, stderr=subprocess.STDOUT, env=_env())
    try:
        wait_healthy(proc, url, tmp_path / "server.log")
        a1 = openai.OpenAI(base_url=url + "/v1", api_key=K1, timeout=60, max_retries=0)
        msgs = [{"role": "user", "content": "Hello, remember this conversation please."}]
        first = a1.chat.completions.create(model="stateful-hf/tiny-llama-random", messages=msgs, max_tokens=4,
                                           temperature=0, extra_body={"session_id": "conv"})
        body = {"model": "stateful-hf/tiny-llama-random", "messages": msgs, "max_tokens": 1900, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120,
                          headers={"Authorization": f"Bearer {K1}", "X-Session-Id": "long"}) as running:
            assert running.status_code == 200
            lines = running.iter_lines()
            assert next(lines).startswith("data:")
            keys.write_text(f"{K3} a\n{K2} b\n")
            proc.send_signal(signal.SIGHUP)
            deadline = time.monotonic() + 30
            old = {"Authorization": f"Bearer {K1}"}
            while httpx.get(url + "/v1/models", headers=old, timeout=10).status_code != 401:
                assert time.monotonic() < deadline, "the removed key is still accepted"
                time.sleep(0.05)
            rest = [line for line in lines if line.startswith("data:")]
        assert rest[-1] == "data: [DONE]" and '"finish_reason":"length"' in rest[-2], rest[-3:]
        assert len(rest) > 10                            # the turn was still running at the reload
        with pytest.raises(openai.AuthenticationError):
            a1.models.list()
        a3 = openai.OpenAI(base_url=url + "/v1", api_key=K3, timeout=60, max_retries=0)
        msgs += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "What did I say?"}]
        again = a3.chat.completions.create(model="stateful-hf/tiny-llama-random", messages=msgs, max_tokens=4,
                                           temperature=0, extra_body={"session_id": "conv"})
        assert again.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens
        keys.write_text("this line is broken\n")     # a broken file: the keys in force stay
        proc.send_signal(signal.SIGHUP)
        time.sleep(0.5)
        assert [m.id for m in a3.models.list().data] == ["stateful-hf/tiny-llama-random"]
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()
    out = (tmp_path / "server.log").read_text()
    assert "2 API keys, tenants ['a', 'b']" in out and "API keys reloaded: 2 keys" in out
    assert "API keys NOT reloaded" in out
    assert K1 not in out and K3 not in out                     # keys are never logged
