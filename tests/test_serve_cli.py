"""`python -m stateful_hf.serve` starts like vLLM's: bad flags exit with status 2 and one line (most before
torch is imported), the new flags work on a real server subprocess, and the event loop keeps answering
/health while a near-limit body is parsed and tokenized."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import fields
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from conftest import stop_server, wait_healthy  # noqa: E402

from stateful_hf.serve import flags  # noqa: E402
from stateful_hf.serve.app import request_seeds  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ERROR = "python -m stateful_hf.serve: error: "
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
CONTEXT = 256
SEED = 7


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "STATEFUL_HF_API_KEY"}
    return {**env, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Before torch: the run ends with what the process had imported by then.
PROBE = ("import runpy, sys\nsys.argv = ['stateful_hf.serve', *sys.argv[1:]]\ntry:\n"
         "    runpy.run_module('stateful_hf.serve', run_name='__main__')\nexcept SystemExit as e:\n"
         "    print('exit', e.code, 'torch' in sys.modules, 'transformers' in sys.modules)\n")


def _exits_2(args: list[str], says: str, timeout: float = 300, env: dict | None = None) -> tuple[float, str]:
    """Run the server with `args`: exit status 2, its last stderr line names the error, no traceback.
    Returns (seconds from start to exit, stdout)."""
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "stateful_hf.serve", *args], cwd=ROOT, capture_output=True, text=True,
                         timeout=timeout, env={**_env(), **(env or {})})
    took = time.perf_counter() - t0
    last = out.stderr.strip().splitlines()[-1]
    assert out.returncode == 2, (args, out.stderr[-2000:])
    assert last.startswith(ERROR) and says in last, (args, last)
    assert "Traceback" not in out.stderr + out.stdout, out.stderr
    assert out.stderr.strip().splitlines()[-2].startswith("usage: python -m stateful_hf.serve [MODEL] [options]")
    return took, out.stdout


@pytest.fixture(scope="module")
def not_a_model(tmp_path_factory) -> tuple[str, str]:
    d = tmp_path_factory.mktemp("not_a_model")
    (d / "weights.bin").write_bytes(b"x")
    return str(d), str(d / "weights.bin")


PRE_IMPORT = [
    (["--dtype", "bf17"], "argument --dtype: unknown dtype 'bf17'; choose from auto, float32"),
    (["--device", "cuda:x"], "argument --device: expected one of cpu, cuda, mps, xpu"),
    (["--log-level", "loud"], "argument --log-level: unknown log level 'loud'"),
    (["--model", "/nonexistent/model"], "--model /nonexistent/model: no such model path or known model: not a "
     "directory, not a named model (smollm2-135m-instruct, tiny-random, tiny-qwen3) nor a hub id"),
    (["--model", "no-such-org/no-such-model"], "no such model path or known model: not a directory, not a named "
     "model (smollm2-135m-instruct, tiny-random, tiny-qwen3), and as a hub id not in the local cache while the hub "
     "is offline"),
    (["--model", "SmolLM2-135M"], "did you mean smollm2-135m-instruct?"),
    (["--model", "DIR"], "the directory has no config.json"),
    (["--model", "FILE"], "a file, not a model directory"),
    (["--chat-template", "/nonexistent.jinja"], "--chat-template /nonexistent.jinja: [Errno 2]"),
    (["--max-model-len", "1"], "--max-model-len must be >= 2, got 1"),
    (["--seed", "-1"], "--seed must be >= 0, got -1"),
    (["--policy", "nope"], "argument --policy: unknown 'nope'; choose from recency_cost, return_aware, pensieve, lru"),
    (["--hidden-states", "sometimes"], "argument --hidden-states: unknown 'sometimes'; choose from auto, always, "
     "never"),
    (["--backend", "nope"], "argument --attention-backend/--backend: unknown 'nope'; choose from auto, torch"),
    (["--allowed-origins", "[1]"], "argument --allowed-origins: expected a JSON list of non-empty strings"),
    (["--responses-ttl", "0"], "--responses-ttl must be a number of seconds > 0, got 0.0"),
    (["--responses-cap", "0"], "--responses-cap must be an int >= 1, got 0"),
    (["--quantization", "awq"], "argument --quantization/-q: invalid choice: 'awq'"),
]


@pytest.mark.parametrize(("args", "says"), PRE_IMPORT, ids=[" ".join(a) for a, _ in PRE_IMPORT])
def test_bad_flag_exits_2_before_torch_is_imported(args, says, not_a_model):
    args = [{"DIR": not_a_model[0], "FILE": not_a_model[1]}.get(a, a) for a in args]
    took, _ = _exits_2(args, says)
    assert took < 5.0, f"{took:.2f} s"           # ~0.1 s measured (the checks run before torch is imported)
    probe = subprocess.run([sys.executable, "-c", PROBE, *args], cwd=ROOT, capture_output=True, text=True,
                           timeout=60, env=_env())
    assert probe.stdout.split() == ["exit", "2", "False", "False"], probe.stdout + probe.stderr


POST_TORCH = [
    (["--device-capacity", "12XB"], "--device-capacity: cannot parse capacity '12XB'"),
    (["--disk-capacity", "1GiB"], "--disk-capacity needs a --disk-dir"),        # the options' check, as flags
    (["--chunk-size", "0"], "--chunk-size must be >= 1, got 0"),
    (["--max-body-bytes", "-1"], "--max-body-bytes must be a positive int"),            # the limits', as flags
]


@pytest.mark.parametrize(("args", "says"), POST_TORCH, ids=[" ".join(a) for a, _ in POST_TORCH])
def test_bad_store_flag_exits_2_before_the_model_loads(args, says):
    took, stdout = _exits_2(["--model", "tiny-random", *args], says)
    assert "serving" not in stdout and took < 60, f"{took:.2f} s"     # ~1.7 s quiet: torch, not transformers


def test_device_without_its_backend_exits_2():
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    _exits_2(["--model", "tiny-random", "--device", "cuda"], "--device cuda: this torch")


def test_bad_values_found_after_loading_exit_2(tmp_path):
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}{{ m['content'] }")          # a Jinja syntax error
    # a hub id the offline cache holds passes the check before torch (the control of the refusal above) and loads
    cache = tmp_path / "hub"
    snapshot = cache / "models--test-org--tiny" / "snapshots" / ("0" * 40)
    from stateful_hf.testing import tiny_llama, tiny_tokenizer
    tiny_llama().save_pretrained(snapshot)
    tiny_tokenizer().save_pretrained(snapshot)
    (cache / "models--test-org--tiny" / "refs").mkdir()
    (cache / "models--test-org--tiny" / "refs" / "main").write_text("0" * 40)
    cases = [
        (["--model", "tiny-random", "--chat-template", str(bad)], f"--chat-template {bad}: the chat template "
         "does not render a one-message chat: TemplateSyntaxError", None),
        (["--model", "tiny-random", "--max-model-len", "100000"],
         "--max-model-len 100000 is more than the model's context of 2048 tokens", None),
        (["--model", "test-org/tiny", "--max-model-len", "100000"], "--max-model-len 100000 is more than the "
         "model's context of 2048 tokens", {"HF_HUB_CACHE": str(cache)}),
        # the store's own check, its options named as flags
        (["--model", "tiny-random", "--hidden-states", "always"],
         "--hidden-states 'always' needs room for hidden states: give --hidden-capacity (or --host-capacity", None),
    ]
    with ThreadPoolExecutor(2) as pool:                 # two servers at a time: each start is one core's work
        for done in [pool.submit(_exits_2, args, says, env=env) for args, says, env in cases]:
            done.result()


def test_load_chat_template_is_the_one_loader(tmp_path):
    """`--chat-template`'s file is read and installed by one function (the server, the demo): None keeps
    the tokenizer's own; a bad file is a ValueError that leaves the tokenizer unchanged."""
    from stateful_hf.serve.chat_template import load_chat_template
    from stateful_hf.testing import tiny_tokenizer
    tok = tiny_tokenizer()
    own = tok.chat_template
    assert own and own != TEMPLATE
    assert load_chat_template(None, tok) is None and tok.chat_template == own
    bad, empty, good = tmp_path / "bad.jinja", tmp_path / "empty.jinja", tmp_path / "good.jinja"
    bad.write_text("{% for m in messages %}")                  # unclosed: does not render
    empty.write_text(" \n")
    good.write_text(TEMPLATE)
    for path, says in ((bad, "does not render a one-message chat"), (empty, "the file is empty"),
                       (tmp_path / "missing.jinja", "No such file")):
        with pytest.raises(ValueError, match=says):
            load_chat_template(path, tok)
        assert tok.chat_template == own
    assert load_chat_template(good, tok) == TEMPLATE and tok.chat_template == TEMPLATE
    rendered = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False)
    assert rendered == "<|user|>Hi\n<|assistant|>"


def test_dtype_names_are_vllms_and_the_default_is_auto():
    for names, torch_name in ((("float32", "fp32", "float", "FP32"), "float32"), (("bfloat16", "bf16"), "bfloat16"),
                              (("float16", "fp16", "half"), "float16"), (("auto", "AUTO"), "auto")):
        assert {flags.dtype(n) for n in names} == {torch_name}
    assert flags.log_level("WARNING") == "warning" and flags.device("cuda:1") == "cuda:1"
    assert flags.name_list('["http://a", "http://b"]') == flags.name_list("http://a, http://b") == ["http://a",
                                                                                                      "http://b"]
    sys.path.insert(0, str(ROOT))
    from demo.app import parser as demo_parser
    from stateful_hf.serve.__main__ import parser as server_parser
    for p in (server_parser(), demo_parser()):       # auto since batch invariance is the default
        assert p.parse_args([]).dtype == "auto" and p.parse_args(["--dtype", "float32"]).dtype == "float32"
        assert p.parse_args([]).batch_invariant is None and p.parse_args(["--no-batch-invariant"]).batch_invariant \
            is False
    assert flags.resolve_dtype("float32", "cpu") == ("float32", None)       # a named dtype: no start-up line
    from stateful_hf.dtypes import resolve_dtype
    chosen, reason = resolve_dtype("auto", "cpu")
    assert flags.resolve_dtype("auto", "cpu") == (str(chosen).removeprefix("torch."),
                                                  f"--dtype auto loads {str(chosen).removeprefix('torch.')} ({reason})")


def test_dtype_auto_parses_before_torch_is_imported():
    probe = subprocess.run([sys.executable, "-c", PROBE, "--dtype", "auto", "--help"], cwd=ROOT, capture_output=True,
                           text=True, timeout=60, env=_env())
    assert "float16/fp16/half. Default: auto" in " ".join(probe.stdout.split()), probe.stdout
    assert probe.stdout.splitlines()[-1].split() == ["exit", "0", "False", "False"], probe.stdout + probe.stderr


def test_dtype_auto_says_what_it_chose_at_start():
    """The start-up line comes once torch is imported, before the store's flags are checked."""
    from stateful_hf.dtypes import resolve_dtype
    chosen, reason = resolve_dtype("auto", "cpu")
    _, stdout = _exits_2(["--model", "tiny-random", "--dtype", "auto", "--chunk-size", "0"],
                         "--chunk-size must be >= 1")
    assert f"stateful-hf: --dtype auto loads {str(chosen).removeprefix('torch.')} ({reason})" in stdout, stdout


def test_help_names_the_stores_own_choices():
    from stateful_hf.cache import POLICY_NAMES
    from stateful_hf.cache.hidden import HIDDEN_MODES
    from stateful_hf.kernels import BACKENDS
    stores = {"policy": tuple(POLICY_NAMES), "hidden_states": tuple(HIDDEN_MODES), "attn_backend": tuple(BACKENDS)}
    assert stores == flags.STORE_NAMES


def test_the_demo_shares_the_store_and_model_flags():
    sys.path.insert(0, str(ROOT))
    from demo.app import parser as demo_parser
    from stateful_hf.options import SchedulingOptions
    from stateful_hf.serve.__main__ import parser as server_parser
    model = {"--model", "--revision", "--trust-remote-code", "--dtype", "--device", "--chat-template", "--quantization"}
    store = {name for f in flags.store_flag_fields() for name in flags.flag_names(f)}   # the option list's
    engine = {name for f in fields(SchedulingOptions) if f.metadata.get("flag") for name in flags.flag_names(f)}
    assert {"--hidden-states", "--policy", "--attention-backend", "--backend", "--host-capacity"} <= store
    for p in (demo_parser(), server_parser()):
        offered = set(p._option_string_actions)
        assert model | store | engine <= offered, sorted((model | store | engine) - offered)
    a = server_parser().parse_args(["--hidden-states", "always", "--policy", "lru", "--backend", "torch",
                                    "--host-capacity", "0", "--hidden-capacity", "2GiB"])
    assert flags.store_options(server_parser(), a) == {
        "device_capacity": "256MiB", "host_capacity": None, "disk_dir": None, "disk_capacity": None, "chunk_size": 32,
        "attn_backend": "torch", "policy": "lru", "hidden_states": "always", "hidden_capacity": "2GiB",
        "max_sessions": None, "session_ttl": None, "max_retain": 600.0, "write_behind_delay": 1.0,
        "batch_invariant": None}


# ---- a real server ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A checkpoint directory of the tiny model served with the new flags; yields (url, log path, tokenizer)."""
    from stateful_hf.testing import tiny_llama, tiny_tokenizer
    d = tmp_path_factory.mktemp("serve_cli")
    model_dir = d / "tiny-model"
    tiny_llama().save_pretrained(model_dir)
    tok = tiny_tokenizer()
    tok.save_pretrained(model_dir)
    (d / "chat.jinja").write_text(TEMPLATE)
    port, log = _free_port(), d / "server.log"
    url = f"http://127.0.0.1:{port}"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "stateful_hf.serve", "--model", str(model_dir), "--port", str(port),
             "--dtype", "float32", "--revision", "main", "--trust-remote-code", "--max-model-len", str(CONTEXT),
             "--seed", str(SEED), "--chat-template", str(d / "chat.jinja"), "--allowed-origins", "http://app.example",
             "--hidden-states", "always", "--host-capacity", "4096", "--policy", "lru", "--backend", "torch",
             "--log-level", "WARNING"], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=_env())
    try:
        wait_healthy(proc, url, log)
        tok.chat_template = TEMPLATE
        yield url, log, tok, str(model_dir).rstrip("/")
    finally:
        stop_server(proc)


def _chat(url: str, body: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", json=body, headers=headers or {}, timeout=60)


def test_seed_gives_unseeded_requests_the_servers_seeds(server):
    """Runs first on the server: its first unseeded request samples with the first seed of --seed 7."""
    url, _, _, model = server
    body = {"model": model, "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 12,
            "temperature": 1.0, "ignore_eos": True}
    first = _chat(url, body).json()["choices"][0]["message"]["content"]
    seeds = request_seeds(SEED)
    assert _chat(url, {**body, "seed": next(seeds)}).json()["choices"][0]["message"]["content"] == first
    second = _chat(url, body).json()["choices"][0]["message"]["content"]            # the second seed
    assert _chat(url, {**body, "seed": next(seeds)}).json()["choices"][0]["message"]["content"] == second
    assert first != second


def test_model_dir_revision_template_and_store_flags(server):
    url, log, tok, model = server
    text = log.read_text()
    assert "--dtype auto" not in text                  # --dtype float32 was given
    assert re.search(rf"context {CONTEXT} tokens; store: attention backend (torch|cpu|cpu for sub-requests of <= "
                     r"\d+ query rows, torch for longer), eviction policy fair_share\(lru\), hidden states on", text)
    models = httpx.get(url + "/v1/models", timeout=10).json()["data"]
    assert models[0]["id"] == model and models[0]["max_model_len"] == CONTEXT
    msgs = [{"role": "user", "content": "What is the sea?"}]
    r = _chat(url, {"model": model, "messages": msgs, "max_tokens": 3, "seed": 1, "return_token_ids": True})
    want = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(want)    # the --chat-template's


def test_max_model_len_is_enforced_naming_the_param(server):
    url, _, tok, model = server
    msgs = [{"role": "user", "content": "Hi"}]
    n = len(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)["input_ids"])
    ok = _chat(url, {"model": model, "messages": msgs, "max_tokens": CONTEXT - n, "seed": 1})
    assert ok.status_code == 200
    over = _chat(url, {"model": model, "messages": msgs, "max_tokens": CONTEXT - n + 1, "seed": 1})
    err = over.json()["error"]
    assert over.status_code == 400 and err["code"] == "context_length_exceeded" and err["param"] == "max_tokens"
    assert f"maximum context length is {CONTEXT} tokens" in err["message"]
    over = _chat(url, {"model": model, "messages": msgs, "max_completion_tokens": CONTEXT, "seed": 1})
    assert over.json()["error"]["param"] == "max_completion_tokens"
    long = [{"role": "user", "content": "word " * CONTEXT}]
    err = _chat(url, {"model": model, "messages": long, "seed": 1}).json()["error"]
    assert err["code"] == "context_length_exceeded" and err["param"] == "messages"
    r = httpx.post(url + "/v1/completions", json={"model": model, "prompt": "word " * CONTEXT}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=msgs, max_tokens=CONTEXT, seed=1)
    assert e.value.code == "context_length_exceeded" and e.value.param == "max_tokens"


def test_cors_preflight_and_simple_requests(server):
    url, _, _, model = server
    pre = {"Origin": "http://app.example", "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "content-type, authorization, x-session-id"}
    r = httpx.options(url + "/v1/chat/completions", headers=pre, timeout=10)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://app.example"
    assert "POST" in r.headers["access-control-allow-methods"]
    assert "x-session-id" in r.headers["access-control-allow-headers"]
    r = httpx.options(url + "/v1/chat/completions", headers={**pre, "Origin": "http://evil.example"}, timeout=10)
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
    assert r.json()["error"]["param"] == "Origin" and r.json()["error"]["code"] == "cors_not_allowed"
    r = httpx.get(url + "/v1/models", headers={"Origin": "http://app.example"}, timeout=10)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://app.example"
    assert "x-session-id" in r.headers["access-control-expose-headers"].lower()
    r = httpx.get(url + "/v1/models", headers={"Origin": "http://evil.example"}, timeout=10)
    assert "access-control-allow-origin" not in r.headers


def test_health_answers_while_a_near_limit_body_is_tokenized(server):
    """A 7 MB chat (the limit is 8 MiB) is parsed, rendered and tokenized in a worker thread: /health
    answers within 50 ms meanwhile (the issue measured 3.6 s; max ~11 ms, median ~2 ms here).

    Negative control: with `chat_turn` called on the event loop instead of `run_in_threadpool` (tried
    once by hand), the one probe sent during the request waited 8.2 s for the whole parse, so the
    latency check below fails (and so does the count: a blocked loop answers no probe until the body is
    done). The test cannot pass vacuously: the body must end as a 400 `context_length_exceeded` naming
    `messages` (so it was parsed, rendered and tokenized to the end, not refused early by size, JSON or
    schema), and at least 10 probes must have been answered while it was in flight (so the window in
    which /health was measured is the parse, not the time after it)."""
    url, _, _, model = server
    text = ("The quick brown fox jumps over the lazy dog. " * 160_000)[:7_000_000]
    raw = json.dumps({"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 4}).encode()
    assert 7_000_000 < len(raw) < 8 * 2**20                 # just under --max-body-bytes' default
    result = {}

    def big():
        t0 = time.perf_counter()
        r = httpx.post(url + "/v1/chat/completions", content=raw, headers={"Content-Type": "application/json"},
                       timeout=120)
        result.update(status=r.status_code, error=r.json()["error"], seconds=time.perf_counter() - t0)

    sender = threading.Thread(target=big)
    waits = []
    with httpx.Client(timeout=30) as http:
        http.get(url + "/health")
        sender.start()
        time.sleep(0.3)                            # the body is sent; the server is parsing it
        while sender.is_alive():
            t0 = time.perf_counter()
            assert http.get(url + "/health").status_code == 200
            waits.append(time.perf_counter() - t0)
            time.sleep(0.01)
    sender.join()
    assert result["status"] == 400 and result["error"]["code"] == "context_length_exceeded", result
    assert result["error"]["param"] == "messages"
    waits.sort()
    print(f"\n/health under a 7 MB body: {len(waits)} answered, max {1e3 * waits[-1]:.1f} ms, "
          f"p99 {1e3 * waits[int(0.99 * (len(waits) - 1))]:.1f} ms, median {1e3 * waits[len(waits) // 2]:.1f} ms; "
          f"the body refused in {result['seconds']:.2f} s")
    # 50 ms for all but 1% of the probes (a probe of a 2-core machine shared with other work may wait for
    # a core); none anywhere near the parse's seconds
    assert waits[int(0.99 * (len(waits) - 1))] < 0.050 and waits[-1] < 0.5, [round(w, 3) for w in waits[-5:]]
    assert len(waits) >= 10, f"only {len(waits)} probes during the {result['seconds']:.2f} s request"
