"""Gradio multi-turn chat on the stateful-hf engine.

    python -m demo                       # SmolLM2-135M-Instruct (stateful_hf.models; fetched once)
    python -m demo --model tiny-random   # the offline tiny fixture (random weights: gibberish replies)
    python demo/app.py --model PATH      # a local (or cached hub) checkpoint via from_pretrained

Each browser user gets their own session (per-user gr.State); replies stream; retry, undo and
editing an earlier message send the edited conversation, and the store reuses its longest valid
prefix. The side panel shows each turn's TTFT and where its tokens came from, and the store's tiers.
"""

import argparse
import inspect
import os
import signal
import sys

if __package__ in (None, ""):           # run as a script: make `demo` and `stateful_hf` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


from stateful_hf.models import DEFAULT_MODEL, TINY_MODEL  # noqa: E402


def _capacity(text: str | int | None):
    """A capacity flag's value: tokens (digits) or a size such as 2GiB (the server's parser)."""
    from stateful_hf.cache import parse_capacity
    return None if text is None else parse_capacity(text)


def parse_args(argv=None) -> argparse.Namespace:
    from stateful_hf.cache import parse_capacity
    p = argparse.ArgumentParser(prog="python -m demo", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"a named model ({DEFAULT_MODEL}, fetched once; {TINY_MODEL}: the offline fixture with random "
                   "weights), or a checkpoint path or hub id (from_pretrained)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=7860, help="HTTP port")
    p.add_argument("--device-capacity", type=parse_capacity, default=4096,
                   help="device KV tier: tokens (digits) or a size such as 2GiB")
    p.add_argument("--host-capacity", type=parse_capacity, default=16384,
                   help="host KV tier: tokens (digits) or a size such as 2GiB; 0 = no host tier (memory is taken "
                   "as it is used)")
    p.add_argument("--disk-dir", help="directory of a disk tier; none: no disk tier")
    p.add_argument("--disk-capacity", type=parse_capacity,
                   help="disk tier: tokens (digits) or a size such as 2GiB; none: 1GiB with --disk-dir")
    p.add_argument("--chunk-size", type=int, default=32, help="tokens per chunk")
    p.add_argument("--hidden-states", help="hidden-state tier mode, if this stateful_hf supports it")
    p.add_argument("--hidden-capacity", type=parse_capacity,
                   help="hidden-state tier: tokens (digits) or a size such as 2GiB; none: --host-capacity")
    p.add_argument("--backend", default="auto", help="attention backend: auto, torch, triton, flashinfer, flash_attn")
    p.add_argument("--policy", default="recency_cost", choices=["recency_cost", "return_aware", "pensieve", "lru"],
                   help="eviction policy (stateful_hf.cache.policy)")
    p.add_argument("--max-new-tokens", type=int, default=48, help="the reply length slider's start value")
    p.add_argument("--max-batch-tokens", type=int, default=512, help="rows per forward")
    p.add_argument("--device", default="cpu", help="torch device of --model and the device KV tier")
    p.add_argument("--dtype", default="float32", help="torch dtype of --model and its KV")
    p.add_argument("--no-hints", action="store_true", help="do not prefetch a session when its user types")
    return p.parse_args(argv)


def build_engine(args):
    import torch

    import stateful_hf
    from stateful_hf import Engine
    from stateful_hf.models import ModelUnavailableError, load

    try:
        model, tokenizer = load(args.model, dtype=getattr(torch, args.dtype), device=args.device)
    except ModelUnavailableError as e:
        raise SystemExit(f"{args.model}: {e}\n(--model {TINY_MODEL} runs offline on random weights)") from e
    if getattr(tokenizer, "chat_template", None) is None:
        raise SystemExit(f"{args.model}: its tokenizer has no chat template; the demo needs one")
    store_kwargs = dict(chunk_size=args.chunk_size, policy=args.policy, attn_backend=args.backend,
                        disk_dir=args.disk_dir, disk_capacity=_capacity(args.disk_capacity))
    host = _capacity(args.host_capacity)
    if host not in (0, "0"):
        store_kwargs["host_capacity"] = host
    if args.hidden_states is not None:
        params = inspect.signature(stateful_hf.SessionStore.__init__).parameters
        if "hidden_states" not in params:
            raise SystemExit("--hidden-states: this version of stateful_hf has no hidden-state tier")
        store_kwargs["hidden_states"] = args.hidden_states
        if args.hidden_capacity is not None:
            store_kwargs["hidden_capacity"] = _capacity(args.hidden_capacity)
    store = stateful_hf.SessionStore(model, _capacity(args.device_capacity), **store_kwargs)
    return Engine(model, tokenizer, store=store, max_batch_tokens=args.max_batch_tokens)


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv=None) -> None:
    args = parse_args(argv)
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    from demo.backend import ChatBackend
    from demo.ui import CSS, build_app

    engine = build_engine(args)
    backend = ChatBackend(engine, max_new_tokens=args.max_new_tokens)
    app = build_app(backend, random_weights=args.model == TINY_MODEL, hints=not args.no_hints)
    app.queue(default_concurrency_limit=32)
    engine.start()
    signal.signal(signal.SIGTERM, _interrupt)    # terminate = Ctrl+C: Gradio closes, then the engine stops
    try:
        app.launch(server_name=args.host, server_port=args.port, css=CSS, show_error=True)
    finally:
        engine.stop(cancel=True, timeout=10)
        engine.store.close()
        print("stateful-hf demo: engine stopped, store closed", flush=True)


if __name__ == "__main__":
    main()
