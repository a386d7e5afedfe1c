"""`python -m stateful_hf.serve [--model NAME|PATH] [--port 8000] [--ray --replicas N] [--api-keys-file FILE]`."""

from __future__ import annotations

import argparse
import ipaddress
import os
import signal

from ..cache import parse_capacity
from ..models import DEFAULT_MODEL, TINY_MODEL

CAPACITY = "tokens (digits) or a size such as 2GiB"


def _share(v: str) -> tuple[str, float]:
    from ..cache.tenant import check_tenant
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
    from .auth import Access, KeyRing
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
    except ValueError as e:
        p.error(str(e))
    return Access(keys, a.metrics_key, limits)


def _announce(access, host: str) -> None:
    if access.keys is None:
        where = "on loopback only" if is_loopback(host) else f"OPEN on {host} (--allow-unauthenticated)"
        print(f"stateful-hf: no API key configured: serving without authentication {where}; every caller "
              "is tenant 'default' (see --api-key / --api-keys-file)", flush=True)
    else:
        print(f"stateful-hf: {len(access.keys)} API keys, tenants {sorted(access.keys.tenants)}; /v1/* needs "
              f"'Authorization: Bearer KEY'" + (" (SIGHUP reloads the keys file)" if access.keys.keys_file else ""),
              flush=True)


def reload_keys_on_sighup(keys) -> None:
    """SIGHUP re-reads the keys file (`KeyRing.reload`)."""
    signal.signal(signal.SIGHUP, lambda *_: keys.reload())


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m stateful_hf.serve", description=__doc__,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"a named model ({DEFAULT_MODEL}, fetched once into $STATEFUL_HF_MODELS; {TINY_MODEL}: the "
                   "offline fixture with RANDOM weights) or a Hugging Face model directory or hub id")
    p.add_argument("--served-model-name", help="the `model` clients send (none: --model)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port")
    p.add_argument("--dtype", default="float32", help="torch dtype of the model and its KV")
    p.add_argument("--device", default="cpu", help="torch device of the model and the device KV tier")
    p.add_argument("--device-capacity", type=parse_capacity, default="256MiB", help=f"device KV tier: {CAPACITY}")
    p.add_argument("--host-capacity", type=parse_capacity,
                   help=f"host KV tier: {CAPACITY}; none: no host tier (memory is taken as it is used)")
    p.add_argument("--disk-dir", help="disk tier directory (persistent; one server per directory); none: no disk tier")
    p.add_argument("--disk-capacity", type=parse_capacity, help=f"disk tier: {CAPACITY}; none: 1GiB with --disk-dir")
    p.add_argument("--chunk-size", type=int, default=32, help="tokens per KV chunk")
    p.add_argument("--max-batch-tokens", type=int, default=512, help="rows per forward")
    p.add_argument("--default-max-tokens", type=int,
                   help="cap on a chat's max_tokens when the request has none; none: the room left in the context")
    p.add_argument("--session-wait-timeout", type=float, default=30.0,
                   help="seconds a turn waits for its session's previous turn before a 409 (Retry-After: 1)")
    p.add_argument("--ray", action="store_true", help="cluster mode: engine replicas on Ray Serve")
    p.add_argument("--replicas", type=int, default=2, help="with --ray: engine replicas")
    p.add_argument("--ray-address", default="auto", help="with --ray: the cluster (`ray start --head` first)")
    p.add_argument("--replica-cpus", type=float, default=1.0, help="with --ray: CPUs per replica")
    p.add_argument("--replica-gpus", type=float, default=0.0, help="with --ray: GPUs per replica (1 = one device)")
    p.add_argument("--log-format", choices=("text", "json"), default="text", help="log lines as text or JSON objects")
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--log-prompts", action="store_true", help="log prompt and completion text (off: never logged)")
    g = p.add_argument_group("access (docs/security.md)")
    g.add_argument("--api-key", default=os.environ.get("STATEFUL_HF_API_KEY"),
                   help="the API key of tenant 'default' ($STATEFUL_HF_API_KEY)")
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
    return p


def main(argv=None) -> None:
    p = parser()
    a = p.parse_args(argv)
    if a.default_max_tokens is not None and a.default_max_tokens < 1:
        p.error("--default-max-tokens must be >= 1")
    if not a.session_wait_timeout > 0:
        p.error("--session-wait-timeout must be > 0")
    from .logs import configure
    configure(a.log_format, a.log_level.upper(), a.log_prompts)
    access = _access(p, a)
    from .server import EngineOptions
    options = EngineOptions(device_capacity=a.device_capacity, host_capacity=a.host_capacity, disk_dir=a.disk_dir,
                            disk_capacity=a.disk_capacity, chunk_size=a.chunk_size,
                            max_batch_tokens=a.max_batch_tokens, session_wait_timeout=a.session_wait_timeout,
                            tenant_shares=dict(a.tenant_share))
    if a.ray:
        from .cluster import run_cluster
        _announce(access, a.host)
        run_cluster(a.model, options, a.replicas, host=a.host, port=a.port, address=a.ray_address,
                    served_name=a.served_model_name, default_max_tokens=a.default_max_tokens,
                    replica_cpus=a.replica_cpus, replica_gpus=a.replica_gpus, dtype=a.dtype, device=a.device,
                    access=access)
        return
    import uvicorn

    from .server import build_local, load_model
    model, tokenizer, name = load_model(a.model, a.dtype, a.device)
    app, _ = build_local(model, tokenizer, a.served_model_name or name, options, a.default_max_tokens, access)
    _announce(access, a.host)
    if access.keys is not None and access.keys.keys_file is not None:
        reload_keys_on_sighup(access.keys)
    print(f"stateful-hf serving {a.served_model_name or name!r} on http://{a.host}:{a.port}/v1", flush=True)
    uvicorn.run(app, host=a.host, port=a.port, log_level=a.log_level.lower(), log_config=None)   # our handler


if __name__ == "__main__":
    main()
