"""`python -m stateful_hf.serve [--model NAME|PATH] [--port 8000] [--ray --replicas N]`."""

from __future__ import annotations

import argparse
import logging

from ..models import DEFAULT_MODEL, TINY_MODEL


def _size(v: str) -> int | str:
    return int(v) if v.isdigit() else v


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m stateful_hf.serve", description=__doc__)
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"a named model ({DEFAULT_MODEL}, fetched once into $STATEFUL_HF_MODELS; {TINY_MODEL}: the "
                   f"offline fixture with RANDOM weights) or a Hugging Face model directory or hub id (Llama family "
                   f"or OPT); default: {DEFAULT_MODEL}")
    p.add_argument("--served-model-name", help="the `model` clients send (default: --model)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--device-capacity", type=_size, default="256MiB", help="KV on the device: tokens or a size")
    p.add_argument("--host-capacity", type=_size, help="host tier: tokens or a size (default: none)")
    p.add_argument("--disk-dir", help="disk tier directory (persistent; one server per directory)")
    p.add_argument("--disk-capacity", type=_size)
    p.add_argument("--chunk-size", type=int, default=32)
    p.add_argument("--max-batch-tokens", type=int, default=512)
    p.add_argument("--default-max-tokens", type=int, default=256, help="chat max_tokens when the request has none")
    p.add_argument("--ray", action="store_true", help="cluster mode: engine replicas on Ray Serve")
    p.add_argument("--replicas", type=int, default=2, help="with --ray: engine replicas")
    p.add_argument("--ray-address", default="auto", help="with --ray: the cluster (`ray start --head` first)")
    p.add_argument("--replica-cpus", type=float, default=1.0, help="with --ray: CPUs per replica")
    p.add_argument("--replica-gpus", type=float, default=0.0, help="with --ray: GPUs per replica (1 = one device)")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from .server import EngineOptions
    options = EngineOptions(device_capacity=a.device_capacity, host_capacity=a.host_capacity, disk_dir=a.disk_dir,
                            disk_capacity=a.disk_capacity, chunk_size=a.chunk_size,
                            max_batch_tokens=a.max_batch_tokens)
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
