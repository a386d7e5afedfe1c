"""The Gradio page: chat, buttons, the per-turn panel and the tiers chart (see demo/app.py)."""

import gradio as gr

from demo.backend import ChatBackend

RANDOM_NOTE = ("**Note:** this demo runs an offline tiny Llama whose weights are *random*: its replies are "
               "gibberish. What to watch is the side panel — from the second turn on, the history is reused, "
               "not recomputed. Start it with `--model PATH` for a real checkpoint.")
ERROR_NOTE = "This turn failed and was rolled back (it is not part of the conversation; edit and send again):"
LENGTH_NOTE = "*(stopped at the {n}-token limit: raise max new tokens under Generation)*"
CSS = """
.shf-tiers {font-size: 0.9em} .shf-tier {display:flex; flex-wrap:wrap; align-items:center; gap:4px 8px; margin:4px 0}
.shf-name {width:64px; font-weight:600} .shf-num {font-size:0.85em; opacity:0.8; min-width:0}
.shf-bar {position:relative; flex:1 1 120px; max-width:45%; height:14px; background:#e5e7eb; border-radius:4px;
 overflow:hidden}
.shf-all {position:absolute; left:0; top:0; bottom:0; background:#93c5fd}
.shf-mine {position:absolute; left:0; top:0; bottom:0; background:#2563eb}
.shf-traffic, .shf-note {font-size:0.8em; opacity:0.8; margin-top:6px; overflow-wrap:anywhere}
.shf-scroll {max-width:100%; overflow-x:auto}
table.shf-turns {font-size:0.85em; border-collapse:collapse; width:100%} table.shf-turns td, table.shf-turns th
{border:1px solid #d1d5db; padding:2px 3px; text-align:right}
table.shf-turns th {overflow-wrap:anywhere; vertical-align:bottom} table.shf-turns td {white-space:nowrap}
#shf-side {min-width:0}
#shf-error {color:#b91c1c}
"""

def shown(st) -> list[dict]:
    """The chat as displayed: copies of the conversation's messages, each reply that stopped at its
    token limit saying so (the conversation sent to the model stays as it was)."""
    out = [dict(m) for m in st["messages"]]
    for t in st["turns"]:
        if t["finish_reason"] == "length":
            out[t["reply"]]["content"] += "\n\n" + LENGTH_NOTE.format(n=t["output_tokens"])
    return out


def keep_turns(st) -> None:
    """Keep the rows of the turns whose reply is still in the conversation (undo, retry and edit drop
    the others), one per reply, the latest. A row's `reply` is its message's index in st["messages"]."""
    latest = {t["reply"]: t for t in st["turns"] if t["reply"] < len(st["messages"])}
    st["turns"] = [latest[i] for i in sorted(latest)]


def build_app(backend: ChatBackend, random_weights: bool, hints: bool = True):
    def fresh(st):
        return st if st is not None else {"sid": backend.new_session_id(), "messages": [], "turns": []}

    def panels(st):
        return backend.turns_html(st["turns"]), backend.tiers_html(st["sid"]), (st["turns"][-1] if st["turns"] else {})

    def saved(st) -> tuple[list[dict], list[dict]]:
        """The conversation and its rows before an action (what a failed turn goes back to)."""
        return [dict(m) for m in st["messages"]], list(st["turns"])

    def reply(st, max_new, temperature, rollback, box="", seed=0):
        """Stream the assistant's answer to st["messages"] (which ends with a user message). If the turn
        fails, st goes back to `rollback` (`saved` before this action), so later sends work; the failed
        message is shown with its error next to it, and `box` gets it back."""
        keep_turns(st)
        turn = sum(m["role"] == "assistant" for m in st["messages"]) + 1
        before = shown(st)
        yield (before, box, st, *panels(st))
        try:
            for text, info in backend.stream(st["sid"], st["messages"], turn, int(max_new), float(temperature),
                                             seed):
                if info is None:
                    yield (before + [{"role": "assistant", "content": text}], box, st, *panels(st))
                else:
                    st["messages"].append({"role": "assistant", "content": text})
                    st["turns"].append({**info.as_dict(), "reply": len(st["messages"]) - 1})
                    keep_turns(st)
                    yield (shown(st), box, st, *panels(st))
        except Exception as e:          # noqa: BLE001 - any failed turn: roll back, show it, keep going
            failed = st["messages"][-1]
            st["messages"], st["turns"] = rollback
            note = {"role": "assistant", "content": f"⚠️ {ERROR_NOTE} {type(e).__name__}: {e}"}
            yield (shown(st) + [dict(failed), note], failed["content"], st, *panels(st))

    def send(message, st, max_new, temperature):
        st = fresh(st)
        if not message or not message.strip():
            yield (shown(st), message, st, *panels(st))
            return
        before = saved(st)
        st["messages"].append({"role": "user", "content": message})
        yield from reply(st, max_new, temperature, before)

    def retry(st, max_new, temperature):
        """Answer the last user message again, at the Retry temperature (a fresh seed each time)."""
        st = fresh(st)
        before = saved(st)
        while st["messages"] and st["messages"][-1]["role"] == "assistant":
            st["messages"].pop()
        if not st["messages"]:
            keep_turns(st)
            yield ([], "", st, *panels(st))
            return
        yield from reply(st, max_new, temperature, before, seed=None)

    def undo(st):
        """Take back the last exchange: its user message returns to the box, its row leaves the table."""
        st = fresh(st)
        text = ""
        while st["messages"]:
            m = st["messages"].pop()
            if m["role"] == "user":
                text = m["content"]
                break
        keep_turns(st)
        return shown(st), text, st, *panels(st)

    def edit(st, max_new, temperature, data: gr.EditData):
        st = fresh(st)
        i = data.index if isinstance(data.index, int) else data.index[0]
        if i >= len(st["messages"]) or st["messages"][i]["role"] != "user":
            yield (shown(st), "", st, *panels(st))
            return
        value = data.value if isinstance(data.value, str) else str(data.value)
        before = saved(st)
        st["messages"] = st["messages"][:i] + [{"role": "user", "content": value}]
        yield from reply(st, max_new, temperature, before)

    def typing(st):
        if hints and st is not None:
            backend.hint(st["sid"])

    with gr.Blocks(title="stateful-hf chat") as app:
        gr.Markdown("# stateful-hf chat\nEvery turn sends the whole conversation; the session store keeps its "
                    "attention state, so only the new tokens are computed.")
        if random_weights:
            gr.Markdown(RANDOM_NOTE, elem_id="shf-random-note")
        # One chat per browser session; when Gradio drops it (tab closed, or an hour unused), so do we.
        state = gr.State(None, time_to_live=3600, delete_callback=lambda st: backend.forget(st and st["sid"]))
        with gr.Row(equal_height=False):
            with gr.Column(scale=4, min_width=360):
                chatbot = gr.Chatbot(editable="user", height=440, elem_id="shf-chat", label="Chat")
                box = gr.Textbox(placeholder="Type a message and press Enter", label="message", show_label=False,
                                 elem_id="shf-input")
                with gr.Row():
                    send_btn = gr.Button("Send", variant="primary", elem_id="shf-send")
                    retry_btn = gr.Button("Retry", elem_id="shf-retry")
                    undo_btn = gr.Button("Undo", elem_id="shf-undo")
                retry_temperature = gr.Slider(0.0, 2.0, value=0.8, step=0.05, elem_id="shf-retry-temperature",
                                              label="Retry temperature (0 = the same greedy reply again)")
                with gr.Accordion("Generation", open=False):
                    max_new = gr.Slider(1, 512, value=backend.max_new_tokens, step=1, label="max new tokens")
                    temperature = gr.Slider(0.0, 2.0, value=0.0, step=0.05, label="temperature (0 = greedy)")
            with gr.Column(scale=3, min_width=320, elem_id="shf-side"):
                # labels name them in the API (/send, /retry, /undo return them); the page shows none
                turns = gr.HTML(backend.turns_html([]), label="turns", show_label=False, elem_id="shf-turns")
                tiers = gr.HTML(backend.tiers_html(), label="store tiers", show_label=False, elem_id="shf-tiers")
                raw = gr.JSON(label="last turn", elem_id="shf-raw")
        outputs = [chatbot, box, state, turns, tiers, raw]
        gen = [max_new, temperature]
        box.submit(send, [box, state, *gen], outputs, api_name="send")
        send_btn.click(send, [box, state, *gen], outputs, api_visibility="private")
        retry_btn.click(retry, [state, max_new, retry_temperature], outputs, api_name="retry")
        undo_btn.click(undo, [state], outputs, api_name="undo")
        chatbot.edit(edit, [state, *gen], outputs, api_visibility="private")
        box.input(typing, [state], None, queue=False, show_progress="hidden", trigger_mode="once",
                  api_visibility="private")
    return app
