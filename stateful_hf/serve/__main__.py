"""`python -m stateful_hf.serve [--model PATH] [--port 8000] [--ray --replicas N]`."""

from __future__ import annotations

import argparse
import logging

from ..cache import parse_capacity

CAPACITY = "tokens (digits) or a size such as 2GiB"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m stateful_hf.serve", description=__doc__,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", help="a Hugging Face model directory or hub id (Llama family or OPT); none: the "
                   "offline tiny fixture with RANDOM weights")
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
    return p


def main(argv=None) -> None:
    p = parser()
    a = p.parse_args(argv)
    if a.default_max_tokens is not None and a.default_max_tokens < 1:
        p.error("--default-max-tokens must be >= 1")
    if not a.session_wait_timeout > 0:
        p.error("--session-wait-timeout must be > 0")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from .server import EngineOptions
    options = EngineOptions(device_capacity=a.device_capacity, host_capacity=a.host_capacity, disk_dir=a.disk_dir,
                            disk_capacity=a.disk_capacity, chunk_size=a.chunk_size,
                            max_batch_tokens=a.max_batch_tokens, session_wait_timeout=a.session_wait_timeout)
    if a.ray:
        from .cluster import run_cluster
        run_cluster(a.model, options, a.replicas, host=a.host, port=a.port, address=a.ray_address,
                    served_name=a.served_model_name, default_max_tokens=a.default_max_tokens,
                    replica_cpus=a.replica_cpus, replica_gpus=a.replica_gpus, dtype=a.dtype, device=a.device)
        return
    import uvicorn

    from .server import build_local, load_model
    model, tokenizer, name = load_model(a.model, a.dtype, a.device)
    app, _ = build_local(model, tokenizer, a.served_model_name or name, options, a.default_max_tokens)
    print(f"stateful-hf serving {a.served_model_name or name!r} on http://{a.host}:{a.port}/v1", flush=True)
    uvicorn.run(app, host=a.host, port=a.port, log_level="info")


if __name__ == "__main__":
    main()
