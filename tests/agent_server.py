"""A `python -m stateful_hf.serve` subprocess for the tools / Responses / Agents SDK tests
(tests/test_serve_tools.py, tests/test_serve_responses.py, tests/test_serve_agents.py)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from pathlib import Path

from conftest import stop_server, wait_healthy

ROOT = Path(__file__).resolve().parents[1]
KEYS = {"key-acme": "acme", "key-globex": "globex"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve(tmp: Path, *args: str, keys: bool = False):
    """Start the server with `args` (and two API keys of two tenants when `keys`); yields its URL."""
    port, log = _free_port(), tmp / "server.log"
    extra = []
    if keys:
        (tmp / "keys.txt").write_text("".join(f"{k} {t}\n" for k, t in KEYS.items()))
        extra = ["--api-keys-file", str(tmp / "keys.txt")]
    env = {k: v for k, v in os.environ.items() if k != "STATEFUL_HF_API_KEY"}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "stateful_hf.serve", "--port", str(port), "--dtype", "float32",
                                 "--log-level", "WARNING", *extra, *args],
                                cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, log)
        yield url
    finally:
        stop_server(proc)
