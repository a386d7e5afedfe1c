"""llama.cpp's `llama-server` as a system of `bench_engine` (`--llama-server PATH --gguf FILE[,FILE]`): the
same closed-loop multi-turn workload through its HTTP API, one slot per session (`id_slot`), token-id
prompts, greedy (temperature 0), EOS ignored, `cache_prompt` on, `--threads` the machine's cores.
TTFT is a turn's arrival to its first streamed token.

Build it from source (no downloaded binary); llama-cpp-python's sdist vendors llama.cpp:

    pip download llama-cpp-python==0.3.36 --no-deps --no-binary :all: -d /tmp/lcpp
    tar xzf /tmp/lcpp/llama_cpp_python-0.3.36.tar.gz -C /tmp/lcpp
    cd /tmp/lcpp/llama_cpp_python-0.3.36/vendor/llama.cpp
    cmake -B build -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DGGML_NATIVE=ON \\
          -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
    cmake --build build --target llama-server llama-quantize -j2

GGUFs of the project's SmolLM2 checkpoint (`python -m stateful_hf.models fetch` writes it under
~/.cache/stateful_hf/models/smollm2-135m-instruct), with the same tree's converter and quantizer (the converter
needs `pip install sentencepiece`):

    M=~/.cache/stateful_hf/models/smollm2-135m-instruct
    python convert_hf_to_gguf.py $M --outtype bf16 --outfile /tmp/lcpp/smollm2-bf16.gguf
    python convert_hf_to_gguf.py $M --outtype q8_0 --outfile /tmp/lcpp/smollm2-q8_0.gguf
    build/bin/llama-quantize /tmp/lcpp/smollm2-bf16.gguf /tmp/lcpp/smollm2-q4_0.gguf Q4_0
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from .harness.closed_loop import closed_loop


def gguf_format(path: str) -> str:
    """A GGUF's weight format, read from its name (smollm2-q8_0.gguf -> Q8_0)."""
    stem = Path(path).stem.lower()
    for fmt in ("bf16", "f16", "f32", "q8_0", "q4_0", "q4_1", "q4_k_m", "q5_k_m", "q6_k"):
        if stem.endswith(fmt):
            return fmt.upper()
    return Path(path).name


class LlamaServer:
    """A `llama-server` subprocess on a free local port, stopped on exit; its log in a temp file."""

    def __init__(self, binary: str, gguf: str, wl, threads: int):
        if not os.access(binary, os.X_OK):
            raise FileNotFoundError(f"--llama-server {binary}: not an executable (see benchmarks/llama_server.py "
                                    "for how to build it)")
        if not Path(gguf).is_file():
            raise FileNotFoundError(f"--gguf {gguf}: no such file")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        slot = -(-(wl.max_context + 64) // 256) * 256
        self.cmd = [binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(self.port), "--parallel",
                    str(wl.sessions), "--ctx-size", str(slot * wl.sessions), "--threads", str(threads),
                    "--threads-batch", str(threads), "--batch-size", "256", "--no-webui"]
        self.log = tempfile.NamedTemporaryFile(prefix="llama-server-", suffix=".log", delete=False)  # noqa: SIM115 - kept for the user to read

    def __enter__(self) -> LlamaServer:
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode}; log: {self.log.name}")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    return self
            except OSError:
                pass
            time.sleep(0.2)
        self.__exit__()
        raise RuntimeError(f"llama-server did not become healthy in 120 s; log: {self.log.name}")

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()

    def complete(self, slot: int, ids: list[int], new: int) -> tuple[list[int], float]:
        """(generated ids, seconds to the first streamed token) of one greedy turn in `slot`."""
        body = {"prompt": ids, "n_predict": new, "temperature": 0, "ignore_eos": True, "cache_prompt": True,
                "id_slot": slot, "stream": True, "return_tokens": True}
        start = time.perf_counter()
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        conn.request("POST", "/completion", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"llama-server: {resp.status} {resp.read()[:300]!r}")
        out, first = [], None
        for line in resp:
            if not line.startswith(b"data: "):
                continue
            event = json.loads(line[6:])
            if event.get("tokens") and first is None:
                first = time.perf_counter() - start
            out += event.get("tokens") or []
            if event.get("stop"):
                break
        conn.close()
        return out, first if first is not None else time.perf_counter() - start


def run_llama_server(binary: str, gguf: str, wl, threads: int) -> tuple[float, dict, dict]:
    """(wall seconds, TTFT by (session, turn), generated ids by (session, turn)) of `wl` (bench_engine's
    Workload) through llama-server on `gguf`, every session's turns back to back (think time 0)."""
    ttft: dict[tuple[int, int], float] = {}
    with LlamaServer(binary, gguf, wl, threads) as server:
        def turn(s: int, t: int, ids: list[int]) -> list[int]:
            out, ttft[(s, t)] = server.complete(s, ids, wl.new)
            return out

        server.complete(0, wl.user_tokens(0, 0), 2)              # warm up, as the other systems are
        wall, outputs = closed_loop(wl, turn)
    return wall, ttft, outputs
