"""Gradio multi-turn chat on the stateful-hf engine.

    python -m demo                       # SmolLM2-135M-Instruct (stateful_hf.models; fetched once)
    python -m demo --model tiny-random   # the offline tiny fixture (random weights: gibberish replies)
    python demo/app.py --model PATH      # a local (or cached hub) checkpoint via from_pretrained

Each browser user gets their own session (per-user gr.State); replies stream; retry, undo and
editing an earlier message send the edited conversation, and the store reuses its longest valid
prefix. The side panel shows each turn's TTFT and where its tokens came from, and the store's tiers.
"""

import argparse
import os
import signal
import sys

if __package__ in (None, ""):           # run as a script: make `demo` and `stateful_hf` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


from stateful_hf.models import DEFAULT_MODEL, SOURCES, TINY_MODEL  # noqa: E402
from stateful_hf.options import SessionStoreOptions  # noqa: E402
from stateful_hf.serve import flags  # noqa: E402


def parser() -> argparse.ArgumentParser:
    """The demo's flags: the model's and the store's are the server's (`stateful_hf.serve.flags`)."""
    p = argparse.ArgumentParser(prog="python -m demo", description=__doc__.split("\n\n")[0],
                                usage="%(prog)s [options]   (--help lists them)",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    flags.add_model_flags(p, DEFAULT_MODEL, f"{DEFAULT_MODEL}, fetched once; {TINY_MODEL}: the offline fixture with "
                          "random weights")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=7860, help="HTTP port")
    flags.add_store_flags(p, device_capacity=4096, host_capacity=16384)
    p.add_argument("--max-new-tokens", type=int, default=48, help="the reply length slider's start value")
    flags.add_engine_flags(p)
    p.add_argument("--no-hints", action="store_true", help="do not prefetch a session when its user types")
    return p


def build_engine(p: argparse.ArgumentParser, args: argparse.Namespace):
    """The engine over the store the flags describe; a bad flag exits with status 2 and one line."""
    flags.read_chat_template(p, args.chat_template)        # the file, before torch is imported
    flags.check_device(p, args.device)
    dtype, line = flags.resolve_dtype(args.dtype, args.device)
    if line:
        print(f"stateful-hf demo: {line}", flush=True)
    store_kwargs, scheduling = flags.store_options(p, args), flags.engine_options(p, args)

    import stateful_hf
    from stateful_hf import Engine
    from stateful_hf.models import ModelUnavailableError, load
    from stateful_hf.serve.chat_template import load_chat_template

    try:
        model, tokenizer = load(args.model, dtype=dtype, device=args.device, revision=args.revision,
                                trust_remote_code=args.trust_remote_code, quantization=args.quantization)
    except (OSError, ValueError, ImportError, ModelUnavailableError) as e:
        p.error(f"--model {args.model}: {' '.join(str(e).split())} (--model {TINY_MODEL} runs offline on random "
                "weights)")
    try:
        load_chat_template(args.chat_template, tokenizer)
    except ValueError as e:
        p.error(f"--chat-template {args.chat_template}: {e}")
    if getattr(tokenizer, "chat_template", None) is None:
        p.error(f"--model {args.model}: its tokenizer has no chat template; the demo needs one (--chat-template)")
    try:
        store = stateful_hf.SessionStore(model, **store_kwargs)
    except (ValueError, RuntimeError) as e:        # the store refused its options (a backend missing, ...)
        p.error(flags.as_flags(" ".join(str(e).split()), SessionStoreOptions))
    return Engine(model, tokenizer, store=store, **scheduling)


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv=None) -> None:
    p = parser()
    args = p.parse_args(argv)
    if args.max_new_tokens < 1 or args.max_batch_tokens < 1:
        p.error("--max-new-tokens and --max-batch-tokens must be >= 1")
    flags.check_model(p, args.model, (*SOURCES, TINY_MODEL), args.revision)
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    engine = build_engine(p, args)
    from demo.backend import ChatBackend
    from demo.ui import CSS, build_app

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
