"""Gradio multi-turn chat on the stateful-hf engine.

    python -m demo                       # offline tiny model with random weights
    python demo/app.py --model PATH      # a local (or cached hub) checkpoint via from_pretrained

Each browser user gets their own session (per-user gr.State); replies stream; retry, undo and
editing an earlier message send the edited conversation, and the store reuses its longest valid
prefix. The side panel shows each turn's TTFT and where its tokens came from, and the store's tiers.
"""

import argparse
import inspect
import os
import sys

if __package__ in (None, ""):           # run as a script: make `demo` and `stateful_hf` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import gradio as gr  # noqa: E402

from demo.backend import ChatBackend  # noqa: E402

RANDOM_NOTE = ("**Note:** this demo runs an offline tiny Llama whose weights are *random*: its replies are "
               "gibberish. What to watch is the side panel — from the second turn on, the history is reused, "
               "not recomputed. Start it with `--model PATH` for a real checkpoint.")
CSS = """
.shf-tiers {font-size: 0.9em} .shf-tier {display:flex; align-items:center; gap:8px; margin:4px 0}
.shf-name {width:64px; font-weight:600} .shf-num {font-size:0.85em; opacity:0.8}
.shf-bar {position:relative; flex:0 0 45%; height:14px; background:#e5e7eb; border-radius:4px; overflow:hidden}
.shf-all {position:absolute; left:0; top:0; bottom:0; background:#93c5fd}
.shf-mine {position:absolute; left:0; top:0; bottom:0; background:#2563eb}
.shf-traffic, .shf-note {font-size:0.8em; opacity:0.8; margin-top:6px}
table.shf-turns {font-size:0.85em; border-collapse:collapse} table.shf-turns td, table.shf-turns th
{border:1px solid #d1d5db; padding:2px 4px; text-align:right; white-space:nowrap}
"""


def _capacity(text: str | None):
    if text is None:
        return None
    return int(text) if text.isdigit() else text


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="checkpoint path or hub id (from_pretrained); default: the offline tiny model")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=7860)
    p.add_argument("--device-capacity", default="4096", help="device KV: tokens or a size like 2GiB")
    p.add_argument("--host-capacity", default="16384", help="host tier: tokens or a size; 0 = no host tier")
    p.add_argument("--disk-dir", help="directory of a disk tier (none by default)")
    p.add_argument("--disk-capacity", help="disk tier size (tokens or a size)")
    p.add_argument("--chunk-size", type=int, default=32, help="tokens per chunk")
    p.add_argument("--hidden-states", help="hidden-state tier mode, if this stateful_hf supports it")
    p.add_argument("--hidden-capacity", help="hidden-state tier size (tokens or a size)")
    p.add_argument("--backend", default="auto", help="attention backend: auto, torch, triton, flashinfer, flash_attn")
    p.add_argument("--policy", default="pensieve", choices=["pensieve", "lru"])
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--max-batch-tokens", type=int, default=512)
    p.add_argument("--device", default="cpu", help="torch device for --model (default cpu)")
    p.add_argument("--dtype", default="float32", help="torch dtype for --model")
    p.add_argument("--no-hints", action="store_true", help="do not prefetch a session when its user types")
    return p.parse_args(argv)


def build_engine(args):
    import torch

    import stateful_hf
    from stateful_hf import Engine

    if args.model:
        from transformers import AutoModelForCausalLM, AutoTokenizer
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype)).to(args.device)
        tokenizer = AutoTokenizer.from_pretrained(args.model)
        if getattr(tokenizer, "chat_template", None) is None:
            raise SystemExit(f"{args.model}: its tokenizer has no chat template; the demo needs one")
    else:
        from stateful_hf.testing import tiny_llama, tiny_tokenizer
        model, tokenizer = tiny_llama(), tiny_tokenizer()
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


def build_app(backend: ChatBackend, random_weights: bool, hints: bool = True):
    def fresh(st):
        return st if st is not None else {"sid": backend.new_session_id(), "messages": [], "turns": []}

    def panels(st):
        return backend.turns_html(st["turns"]), backend.tiers_html(st["sid"]), (st["turns"][-1] if st["turns"] else {})

    def reply(st, max_new, temperature, box=""):
        """Stream the assistant's answer to st["messages"] (which ends with a user message)."""
        turn = len(st["turns"]) + 1
        shown = [dict(m) for m in st["messages"]]
        yield (shown, box, st, *panels(st))
        for text, info in backend.stream(st["sid"], st["messages"], turn, int(max_new), float(temperature)):
            if info is None:
                yield (shown + [{"role": "assistant", "content": text}], box, st, *panels(st))
            else:
                st["messages"].append({"role": "assistant", "content": text})
                st["turns"].append(info.as_dict())
                yield ([dict(m) for m in st["messages"]], box, st, *panels(st))

    def send(message, st, max_new, temperature):
        st = fresh(st)
        if not message or not message.strip():
            yield ([dict(m) for m in st["messages"]], message, st, *panels(st))
            return
        st["messages"].append({"role": "user", "content": message})
        yield from reply(st, max_new, temperature)

    def retry(st, max_new, temperature):
        st = fresh(st)
        while st["messages"] and st["messages"][-1]["role"] == "assistant":
            st["messages"].pop()
        if not st["messages"]:
            yield ([], "", st, *panels(st))
            return
        yield from reply(st, max_new, temperature)

    def undo(st):
        st = fresh(st)
        text = ""
        while st["messages"]:
            m = st["messages"].pop()
            if m["role"] == "user":
                text = m["content"]
                break
        return [dict(m) for m in st["messages"]], text, st, *panels(st)

    def edit(st, max_new, temperature, data: gr.EditData):
        st = fresh(st)
        i = data.index if isinstance(data.index, int) else data.index[0]
        if i >= len(st["messages"]) or st["messages"][i]["role"] != "user":
            yield ([dict(m) for m in st["messages"]], "", st, *panels(st))
            return
        value = data.value if isinstance(data.value, str) else str(data.value)
        st["messages"] = st["messages"][:i] + [{"role": "user", "content": value}]
        yield from reply(st, max_new, temperature)

    def typing(st):
        if hints and st is not None:
            backend.hint(st["sid"])

    with gr.Blocks(title="stateful-hf chat") as app:
        gr.Markdown("# stateful-hf chat\nEvery turn sends the whole conversation; the session store keeps its "
                    "attention state, so only the new tokens are computed.")
        if random_weights:
            gr.Markdown(RANDOM_NOTE, elem_id="shf-random-note")
        state = gr.State(None)
        with gr.Row():
            with gr.Column(scale=3):
                chatbot = gr.Chatbot(editable="user", height=440, elem_id="shf-chat", label="Chat")
                box = gr.Textbox(placeholder="Type a message and press Enter", show_label=False,
                                 elem_id="shf-input")
                with gr.Row():
                    send_btn = gr.Button("Send", variant="primary", elem_id="shf-send")
                    retry_btn = gr.Button("Retry", elem_id="shf-retry")
                    undo_btn = gr.Button("Undo", elem_id="shf-undo")
                with gr.Accordion("Generation", open=False):
                    max_new = gr.Slider(1, 512, value=backend.max_new_tokens, step=1, label="max new tokens")
                    temperature = gr.Slider(0.0, 2.0, value=0.0, step=0.05, label="temperature (0 = greedy)")
            with gr.Column(scale=2):
                turns = gr.HTML(backend.turns_html([]), elem_id="shf-turns")
                tiers = gr.HTML(backend.tiers_html(), elem_id="shf-tiers")
                raw = gr.JSON(label="last turn", elem_id="shf-raw")
        outputs = [chatbot, box, state, turns, tiers, raw]
        gen = [max_new, temperature]
        box.submit(send, [box, state, *gen], outputs, api_name="send")
        send_btn.click(send, [box, state, *gen], outputs, api_visibility="private")
        retry_btn.click(retry, [state, *gen], outputs, api_name="retry")
        undo_btn.click(undo, [state], outputs, api_name="undo")
        chatbot.edit(edit, [state, *gen], outputs, api_visibility="private")
        box.input(typing, [state], None, queue=False, show_progress="hidden", trigger_mode="once",
                  api_visibility="private")
    return app


def main(argv=None) -> None:
    args = parse_args(argv)
    engine = build_engine(args)
    backend = ChatBackend(engine, max_new_tokens=args.max_new_tokens)
    app = build_app(backend, random_weights=args.model is None, hints=not args.no_hints)
    app.queue(default_concurrency_limit=32)
    engine.start()
    try:
        app.launch(server_name=args.host, server_port=args.port, css=CSS, show_error=True)
    finally:
        engine.stop(cancel=True, timeout=10)
        engine.store.close()


if __name__ == "__main__":
    main()
