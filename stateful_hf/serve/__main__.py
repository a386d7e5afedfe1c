"""`python -m stateful_hf.serve [MODEL] [--port 8000] [--ray --replicas N] [--api-keys-file FILE]`.

MODEL (or --model): a named model, a model directory or a hub id, as `vllm serve MODEL`; vLLM's common
flags work too (`vllm_flags.py`). Flags are checked before torch and transformers are imported where
they can be (`flags.py`); a bad one exits with status 2 and one line, an unknown one with "did you mean"."""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import re
import signal
import sys

from ..models import DEFAULT_MODEL, SOURCES, TINY_MODEL, TINY_MODELS, TINY_QWEN3
from ..options import SchedulingOptions, SessionStoreOptions
from . import flags, vllm_flags
from .response_store import DEFAULT_CAP, DEFAULT_TTL, ResponseRetention


def _share(v: str) -> tuple[str, float]:
    from ..cache.sessions.tenant import check_tenant
    tenant, _, weight = v.partition("=")
    try:
        w = float(weight)
        if not w > 0:
            raise ValueError(f"the weight must be > 0, got {weight}")
        return check_tenant(tenant), w
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected TENANT=WEIGHT, got {v!r}: {e}") from None


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False                       # a name: it may resolve to anything


def _access(p: argparse.ArgumentParser, a: argparse.Namespace):
    """The server's `Access` from the options; exits with status 2 on a bad keys file or an open bind."""
    from .auth import Access, CorsPolicy, KeyRing
    from .limits import Limits
    keys = None
    if a.api_key is not None or a.api_keys_file is not None:
        try:
            keys = KeyRing(a.api_key, a.api_keys_file)
        except (OSError, ValueError) as e:
            p.error(f"API keys: {e}")
    elif not is_loopback(a.host) and not a.allow_unauthenticated:
        p.error(f"--host {a.host} is reachable from other machines and no API key is configured: anyone could "
                "read and cut every session. Give --api-key KEY (or STATEFUL_HF_API_KEY) or --api-keys-file FILE, "
                "or pass --allow-unauthenticated to serve it open anyway")
    try:
        limits = Limits(a.max_body_bytes, a.max_prompt_tokens, a.max_sessions_per_tenant,
                        a.max_stored_tokens_per_tenant)
    except ValueError as e:                 # Limits names its fields: say the flags
        p.error(re.sub(r"\b(max_[a-z_]+)\b", lambda m: "--" + m.group(1).replace("_", "-"), str(e)))
    cors = CorsPolicy(tuple(a.allowed_origins), tuple(a.allowed_methods), tuple(a.allowed_headers), a.allow_credentials)
    return Access(keys, a.metrics_key, limits, cors)


def _announce(access, host: str) -> None:
    if access.keys is None:
        where = "on loopback only" if is_loopback(host) else f"OPEN on {host} (--allow-unauthenticated)"
        print(f"stateful-hf: no API key configured: serving without authentication {where}; every caller "
              "is tenant 'default' (see --api-key / --api-keys-file)", flush=True)
    else:
        print(f"stateful-hf: {len(access.keys)} API keys, tenants {sorted(access.keys.tenants)}; /v1/* needs "
              f"'Authorization: Bearer KEY'" + (" (SIGHUP reloads the keys file)" if access.keys.keys_file else ""),
              flush=True)


def _describe(store, context: int) -> None:
    """One line: what the store was built with (the flags' effect, resolved: `auto` named)."""
    hidden = "on" if store.hidden_plan is not None else "off"
    print(f"stateful-hf: context {context} tokens; store: attention backend {store.step_backends.describe()}, "
          f"eviction policy {store.policy.describe()}, hidden states {hidden}", flush=True)


def reload_keys_on_sighup(keys) -> None:
    """SIGHUP re-reads the keys file (`KeyRing.reload`)."""
    signal.signal(signal.SIGHUP, lambda *_: keys.reload())


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m stateful_hf.serve", description=__doc__, allow_abbrev=False,
                                usage="%(prog)s [MODEL] [options]   (--help lists them)",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("model_tag", nargs="?", metavar="MODEL", default=None,
                   help="the model, as `vllm serve MODEL` (the same as --model)")
    flags.add_model_flags(p, DEFAULT_MODEL, f"{DEFAULT_MODEL}, fetched once into $STATEFUL_HF_MODELS; {TINY_MODEL}: "
                          f"the offline fixture with RANDOM weights; {TINY_QWEN3}: a random Qwen3 with Qwen3's "
                          "chat template that thinks (<think>) first")
    p.add_argument("--served-model-name", help="the `model` clients send (none: --model)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port")
    p.add_argument("--max-model-len", type=int,
                   help="context length in tokens: a request whose prompt + max_tokens exceeds it gets 400 "
                   "(none: the model's max_position_embeddings)")
    p.add_argument("--seed", type=int, help="requests without a `seed` take theirs from a generator seeded with "
                   "this, in the order the server takes them (none: a fresh random seed each)")
    flags.add_store_flags(p, device_capacity=flags.SERVER_DEFAULTS["device_capacity"], host_capacity=None)
    flags.add_engine_flags(p, max_num_seqs=flags.SERVER_DEFAULTS["max_num_seqs"])
    p.add_argument("--default-max-tokens", type=int,
                   help="cap on a chat's max_tokens when the request has none; none: the room left in the context")
    p.add_argument("--responses-ttl", type=float, default=DEFAULT_TTL,
                   help="seconds a stored response of /v1/responses can be fetched and continued")
    p.add_argument("--responses-cap", type=int, default=DEFAULT_CAP,
                   help="stored responses at most, all tenants together (past it the oldest are forgotten)")
    p.add_argument("--compile", choices=("auto", "on", "off"), default="auto",
                   help="the engine's steps without per-layer work through torch.compile: on (an error where the model "
                        "or store cannot compile), off (eager; vLLM's --enforce-eager), auto (eager on the CPU and "
                        "under batch invariance for now; the reason is in the engine's stats)")
    p.add_argument("--strict-fields", action="store_true", help="an unknown request field is a 400 naming it "
                   "(OpenAI's behaviour; off: dropped with a warning, vLLM's); docs/server-api.md lists the fields")
    p.add_argument("--session-wait-timeout", type=float, default=30.0,
                   help="seconds a turn waits for its session's previous turn before a 409 (Retry-After: 1)")
    p.add_argument("--shutdown-flush-timeout", type=float, default=4.0, metavar="SECONDS",
                   help="on SIGTERM or Ctrl-C, after the turns in flight are cancelled: seconds each replica gives "
                   "writing what is not on disk yet to --disk-dir, so a restart keeps the sessions; 0: nothing "
                   "(write-behind's copies only); docs/durability.md")
    p.add_argument("--ray", action="store_true", help="cluster mode: engine replicas on Ray Serve")
    p.add_argument("--replicas", type=int, default=2, help="with --ray: engine replicas")
    p.add_argument("--ray-address", default="auto", help="with --ray: the cluster (`ray start --head` first)")
    p.add_argument("--replica-cpus", type=float, default=1.0, help="with --ray: CPUs per replica")
    p.add_argument("--replica-gpus", type=float, default=0.0, help="with --ray: GPUs per replica (1 = one device)")
    p.add_argument("--router-db", metavar="PATH", help="with --ray: the router's session -> replica directory, kept "
                   "in this SQLite file, so that a restarted router sends each returning turn to its replica")
    p.add_argument("--log-format", choices=("text", "json"), default="text", help="log lines as text or JSON objects")
    p.add_argument("--log-level", type=flags.log_level, default="info", help=f"one of {', '.join(flags.LOG_LEVELS)}")
    p.add_argument("--log-prompts", action="store_true", help="log prompt and completion text (off: never logged)")
    g = p.add_argument_group("access (docs/security.md)")
    g.add_argument("--api-key", default=os.environ.get("STATEFUL_HF_API_KEY") or os.environ.get("VLLM_API_KEY"),
                   help="the API key of tenant 'default' ($STATEFUL_HF_API_KEY, else $VLLM_API_KEY)")
    g.add_argument("--api-keys-file", help="`key tenant` per line; SIGHUP reloads it")
    g.add_argument("--metrics-key", help="a key /metrics then needs (none: /metrics is open)")
    g.add_argument("--allow-unauthenticated", action="store_true",
                   help="serve a non-loopback --host without any API key")
    g.add_argument("--max-body-bytes", type=int, default=8 * 2**20, help="larger request bodies get 413")
    g.add_argument("--max-prompt-tokens", type=int, help="longer prompts get 400 (none: the context)")
    g.add_argument("--max-sessions-per-tenant", type=int, help="none: unlimited; beyond it 429")
    g.add_argument("--max-stored-tokens-per-tenant", type=int,
                   help="history tokens kept per tenant (none: unlimited; beyond it 429)")
    g.add_argument("--tenant-share", type=_share, action="append", default=[], metavar="TENANT=WEIGHT",
                   help="weight of a tenant's fair share of each tier under eviction (default 1: equal)")
    g = p.add_argument_group("CORS: which web pages may call the API from a browser (none: no CORS headers)")
    g.add_argument("--allowed-origins", type=flags.name_list, default=[], metavar="LIST",
                   help='origins, as a JSON list (\'["https://app.example"]\') or comma-separated; "*" is any')
    g.add_argument("--allowed-methods", type=flags.name_list, default=["*"], metavar="LIST",
                   help="methods a cross-origin request may use (with --allowed-origins)")
    g.add_argument("--allowed-headers", type=flags.name_list, default=["*"], metavar="LIST",
                   help="request headers a cross-origin request may send (with --allowed-origins)")
    g.add_argument("--allow-credentials", action="store_true",
                   help="let browsers send cookies and Authorization to the allowed origins")
    vllm_flags.add_vllm_flags(p)
    return p


def parse(p: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """The command line: MODEL or --model (not two different ones); an unknown flag exits with status 2
    naming the closest known ones (`vllm_flags.did_you_mean`). Sets `a.argv`."""
    argv = sys.argv[1:] if argv is None else list(argv)
    a, unknown = p.parse_known_args(argv)
    if unknown:
        vllm_flags.did_you_mean(p, unknown)
    if a.model_tag is not None:
        if any(x == "--model" or x.startswith("--model=") for x in argv) and a.model != a.model_tag:
            p.error(f"the model is given twice: {a.model_tag} and --model {a.model}; give one")
        a.model = a.model_tag
    a.argv = argv
    return a


def _check(p: argparse.ArgumentParser, a: argparse.Namespace) -> str | None:
    """The checks that need neither torch nor transformers; returns the chat template's text. Sets
    `a.responses` (the `ResponseRetention` of --responses-ttl and --responses-cap), `a.notes` (lines to
    log: vLLM flags that change nothing, a hub id served from the bundled copy) and what the vLLM flags
    set (`vllm_flags.check_vllm_flags`); a hub id of a named model becomes that model, served under the
    hub id (unless --served-model-name)."""
    try:
        a.responses = ResponseRetention(a.responses_ttl, a.responses_cap)
    except ValueError as e:
        p.error(re.sub(r"\b(responses_[a-z]+)\b", lambda m: "--" + m.group(1).replace("_", "-"), str(e)))
    for flag, value, least in (("--default-max-tokens", a.default_max_tokens, 1),
                               ("--max-model-len", a.max_model_len, 2), ("--replicas", a.replicas, 1),
                               ("--seed", a.seed, 0)):
        if value is not None and value < least:
            p.error(f"{flag} must be >= {least}, got {value}")
    if not a.session_wait_timeout > 0:
        p.error("--session-wait-timeout must be > 0")
    if not 0 <= a.shutdown_flush_timeout < float("inf"):
        p.error(f"--shutdown-flush-timeout must be a number of seconds >= 0, got {a.shutdown_flush_timeout}")
    if not 0 < a.port < 65536:
        p.error(f"--port must be in 1..65535, got {a.port}")
    a.notes = vllm_flags.check_vllm_flags(p, a, a.argv)
    flags.engine_options(p, a)
    model = flags.check_model(p, a.model, (*SOURCES, *TINY_MODELS), a.revision)
    if model != a.model:
        a.notes.append(f"{a.model} is the bundled {model} (loaded from {SOURCES[model].package}, offline)")
        a.served_model_name = a.served_model_name or a.model
        a.model = model
    return flags.read_chat_template(p, a.chat_template)


def _one_line(e: BaseException) -> str:
    return " ".join(f"{type(e).__name__}: {e}".split())


def main(argv=None) -> None:
    p = parser()
    a = parse(p, argv)
    template = _check(p, a)
    from .logs import REQUESTS, configure
    configure(a.log_format, a.log_level.upper(), a.log_prompts)
    log = logging.getLogger("stateful_hf.serve")
    for line in a.notes:
        log.warning("%s", line)
    if "--disable-log-requests" in vllm_flags.given(a):
        REQUESTS.setLevel(logging.WARNING)
    flags.check_device(p, a.device)         # imports torch
    dtype, line = flags.resolve_dtype(a.dtype, a.device)
    if line:
        print(f"stateful-hf: {line}", flush=True)
    store, scheduling = flags.store_options(p, a), flags.engine_options(p, a)
    access = _access(p, a)                  # imports the engine (transformers)
    from .server import EngineOptions
    shared = {} if a.prefix_sharing is None else {"prefix_sharing": a.prefix_sharing}
    try:
        options = EngineOptions(**store, **scheduling, **shared, session_wait_timeout=a.session_wait_timeout,
                                tenant_shares=dict(a.tenant_share), shutdown_flush_timeout=a.shutdown_flush_timeout,
                                compile={"auto": "auto", "on": True, "off": False}[a.compile])
    except ValueError as e:
        p.error(flags.as_flags(" ".join(str(e).split()), SessionStoreOptions, SchedulingOptions))
    hub = {"revision": a.revision, "trust_remote_code": a.trust_remote_code, "quantization": a.quantization}
    if a.ray:
        from .cluster import run_cluster
        _announce(access, a.host)
        run_cluster(a.model, options, a.replicas, host=a.host, port=a.port, address=a.ray_address,
                    served_name=a.served_model_name, default_max_tokens=a.default_max_tokens,
                    replica_cpus=a.replica_cpus, replica_gpus=a.replica_gpus, dtype=dtype, device=a.device,
                    access=access, load=dict(hub, chat_template=template), max_model_len=a.max_model_len, seed=a.seed,
                    router_db=a.router_db, responses=a.responses, strict_fields=a.strict_fields)
        return
    from ..models import ModelUnavailableError
    from .chat_template import load_chat_template
    from .reasoning import reasons
    from .server import build_local, load_model, serve
    try:
        model, tokenizer, name = load_model(a.model, dtype, a.device, **hub)
    except (OSError, ValueError, ImportError, ModelUnavailableError) as e:
        p.error(f"--model {a.model}: {_one_line(e)}")
    try:
        load_chat_template(a.chat_template, tokenizer)
    except ValueError as e:
        p.error(f"--chat-template {a.chat_template}: {e}")
    if "--reasoning-parser" in vllm_flags.given(a) and not reasons(tokenizer):
        log.warning("--reasoning-parser %s: this model's chat template has no <think> block; replies are not "
                    "split into reasoning and answer", vllm_flags.given(a)["--reasoning-parser"])
    if a.gpu_memory_utilization is not None:
        try:
            size = vllm_flags.device_tier(a.gpu_memory_utilization, a.device)
        except ValueError as e:
            p.error(str(e))
        options = EngineOptions(**{**options.as_dict(), "device_capacity": size})
        log.warning("--gpu-memory-utilization %s: device tier %.2f GiB", a.gpu_memory_utilization,
                    int(size.removesuffix("B")) / 2**30)
    try:
        app, router = build_local(model, tokenizer, a.served_model_name or name, options, a.default_max_tokens,
                                  access, max_model_len=a.max_model_len, seed=a.seed, responses=a.responses)
    except (ValueError, RuntimeError) as e:     # the store refused its options (a backend missing, ...)
        p.error(flags.as_flags(" ".join(str(e).split()), SessionStoreOptions, SchedulingOptions))
    app.state.config.strict_fields = a.strict_fields
    _describe(router.clients[0].replica.store, app.state.config.max_model_len)
    _announce(access, a.host)
    if access.keys is not None and access.keys.keys_file is not None:
        reload_keys_on_sighup(access.keys)
    print(f"stateful-hf serving {a.served_model_name or name!r} on http://{a.host}:{a.port}/v1", flush=True)
    serve(app, router, a.host, a.port, a.log_level)     # our log handler; SIGTERM: cancel, flush, exit


if __name__ == "__main__":
    main()
