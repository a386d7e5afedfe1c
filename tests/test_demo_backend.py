"""The demo's chat logic without Gradio: retry, undo and edit reuse exactly the longest valid prefix,
replies equal the engine on a fresh session, and a typing hint prefetches a parked session."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import stateful_hf
from stateful_hf import Engine, SamplingParams
from stateful_hf.testing import tiny_llama, tiny_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))      # demo/ is not an installed package
from demo.backend import ChatBackend  # noqa: E402

USER = ["Hello! How are you today?", "Tell me about the sea.", "Summarize that in one sentence."]


@pytest.fixture
def backend():
    model = tiny_llama()
    store = stateful_hf.SessionStore(model, 2048, chunk_size=16, host_capacity=2048, policy="lru")
    engine = Engine(model, tiny_tokenizer(), store=store)
    ref_model = tiny_llama()
    oracle = Engine(ref_model, tiny_tokenizer(), store=stateful_hf.SessionStore(ref_model, 4096, policy="lru"))
    yield ChatBackend(engine, max_new_tokens=12), oracle
    engine.stop()
    store.check_integrity()
    assert not any(store.session(s).busy for s in store.session_ids())


def _turn(b: ChatBackend, oracle: Engine, sid: str, messages: list[dict], turn: int):
    """Run one turn; check it against the engine on a fresh session and against the store's history."""
    ids = b.encode(messages)
    known = sid in b.store
    history = list(b.store.session(sid).token_ids) if known else []
    keep = min(b.store.match_prefix(sid, ids), len(ids) - 1) if known else 0
    *_, (text, info) = b.stream(sid, messages, turn)
    want = oracle.generate([f"ref-{sid}-{turn}"], [ids], SamplingParams(max_new_tokens=12))[0]
    assert text == want.text
    assert info.reused_tokens == keep and info.truncated_tokens == max(len(history) - keep, 0)
    assert info.recomputed_tokens == 0 and info.prompt_tokens == len(ids)
    # the table's counts add up: reused + computed = the prompt; generated apart (TurnStats' own counts)
    assert info.reused_tokens + info.computed_tokens == len(ids) and info.generated_tokens == info.output_tokens > 1
    return text, info


def test_retry_undo_edit_reuse_the_longest_valid_prefix(backend):
    b, oracle = backend
    sid, msgs = b.new_session_id(), []
    for i, u in enumerate(USER):
        msgs.append({"role": "user", "content": u})
        text, info = _turn(b, oracle, sid, msgs, i + 1)
        assert (info.reused_tokens > 0) == (i > 0)
        msgs.append({"role": "assistant", "content": text})
    # Retry: the last reply again. Everything up to it is reused, the old reply is cut.
    _, info = _turn(b, oracle, sid, msgs[:-1], 4)
    assert info.reused_tokens >= len(b.encode(msgs[:-2])) - 1 and info.truncated_tokens > 0
    # Undo the last exchange and say something else: the first two exchanges are reused.
    undone = msgs[:-2] + [{"role": "user", "content": "Tell me about the stars at night."}]
    _, info = _turn(b, oracle, sid, undone, 5)
    assert info.reused_tokens > 0 and info.truncated_tokens > 0
    # Edit the second user message: only what precedes the edit is reused.
    edited = msgs[:2] + [{"role": "user", "content": "Tell me about the mountains."}]
    _, info = _turn(b, oracle, sid, edited, 6)
    assert 0 < info.reused_tokens < len(b.encode(msgs[:3]))
    # Edit the very first message: almost nothing (the template's opening tokens) is reusable.
    _, info = _turn(b, oracle, sid, [{"role": "user", "content": "Please summarize."}], 7)
    assert info.reused_tokens < 8


def test_typing_hint_prefetches_a_parked_session(backend):
    b, oracle = backend
    sid, msgs = b.new_session_id(), [{"role": "user", "content": USER[0]}]
    assert b.hint(sid) is None                         # unknown session: nothing to prefetch
    text, _ = _turn(b, oracle, sid, msgs, 1)
    msgs += [{"role": "assistant", "content": text}, {"role": "user", "content": USER[1]}]
    n = len(b.store.session(sid).chunks)
    b.store.move(sid, range(n), "host")
    h = b.hint(sid)
    assert h is not None and b.hint(sid) is None       # once per turn
    assert h.wait(30) and h.stopped == "done" and h.moved_tokens == b.store.session(sid).num_tokens
    _, info = _turn(b, oracle, sid, msgs, 2)
    assert info.hint_moved_tokens == h.moved_tokens
    assert info.at_send_host == 0 and info.at_send_device == info.reused_tokens > 0
    html = b.tiers_html(sid) + b.turns_html([info.as_dict()])
    assert "device" in html and "host" in html and "TTFT" in html
    b.forget(sid)                                      # the browser session ended
    assert sid not in b.store
    b.forget(sid)


def test_no_hit_rate_until_a_turn_has_needed_history(backend):
    b, oracle = backend
    assert "hit rate <span id='shf-hit-rate'>—" in b.tiers_html() and "100%" not in b.tiers_html()
    sid, msgs = b.new_session_id(), [{"role": "user", "content": USER[0]}]
    text, info = _turn(b, oracle, sid, msgs, 1)
    assert "hit rate <span id='shf-hit-rate'>—" in b.tiers_html(sid)      # the first turn had no history
    msgs += [{"role": "assistant", "content": text}, {"role": "user", "content": USER[1]}]
    _turn(b, oracle, sid, msgs, 2)
    assert "hit rate <span id='shf-hit-rate'>100%" in b.tiers_html(sid)
    html = b.turns_html([{**info.as_dict(), "reply": 1}])
    assert f"<td class='shf-end'>{info.finish_reason}</td>" in html and "end = why the reply ended" in html
