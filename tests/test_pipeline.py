"""The drop-in pipeline: outputs equal transformers' own text-generation pipeline (greedy) on the same
inputs, while a session's growing chat reuses its state across calls."""

from __future__ import annotations

import pytest
import transformers
from conftest import FAMILIES

import stateful_hf
from stateful_hf.testing import tiny_tokenizer

GREEDY = dict(max_new_tokens=12, do_sample=False)
USER = ["Hello! How are you today?", "Tell me about the sea.", "Summarize that in one sentence."]


def _pair(family: str = "llama", **store):
    tok = tiny_tokenizer()
    ours = stateful_hf.pipeline("text-generation", model=FAMILIES[family](), tokenizer=tok,
                                device_capacity=2048, **store)
    ref = transformers.pipeline("text-generation", model=FAMILIES[family](), tokenizer=tok)
    return ours, ref


@pytest.mark.parametrize("family", ["llama", "opt"])
def test_multiturn_chat_equals_transformers_and_reuses(family):
    ours, ref = _pair(family)
    assert isinstance(ours, transformers.TextGenerationPipeline)
    messages = [{"role": "system", "content": "Be brief."}]
    for turn, user in enumerate(USER):
        messages = messages + [{"role": "user", "content": user}]
        got = ours(messages, session_id="alice", **GREEDY)
        want = ref(messages, **GREEDY)
        assert got == want
        stats = ours.store.stats("alice").last_turn
        assert stats.generated_tokens == 12
        if turn:        # everything before the last reply's text is reused
            assert stats.reused_tokens > 0 and stats.recomputed_tokens == 0
        messages = got[0]["generated_text"]
    ours.store.check_integrity()


def test_text_kwargs_and_return_types_equal_transformers():
    ours, ref = _pair()
    prompt = "Tell me about the weather, the sea"
    for kwargs in (dict(return_full_text=False), dict(return_tensors=True),
                   dict(max_new_tokens=5, repetition_penalty=1.3, skip_special_tokens=False)):
        kw = {**GREEDY, **kwargs}
        assert ours(prompt, session_id="t", **kw) == ref(prompt, **kw), kwargs
    assert ours(prompt, **GREEDY) == ref(prompt, **GREEDY)      # stateless without a session
    assert ours.store.stats("t").last_turn.reused_tokens > 0   # the same prompt again: reused


def test_batches_one_session_per_input():
    ours, ref = _pair()
    chats = [[{"role": "user", "content": u}] for u in USER]
    want = ref(chats, **GREEDY)
    got = ours(chats, session_id=["a", "b", "c"], batch_size=2, **GREEDY)
    assert got == want
    # Second turn of every session, as a batch again: each reuses its own history.
    chats2 = [g[0]["generated_text"] + [{"role": "user", "content": "And then?"}] for g in got]
    assert ours(chats2, session_id=["a", "b", "c"], **GREEDY) == ref(chats2, **GREEDY)
    assert all(ours.store.stats(s).last_turn.reused_tokens > 0 for s in "abc")
    texts = ["Hello!", "The quick brown fox"]
    assert ours(texts, session_id=["x", "y"], **GREEDY) == ref(texts, **GREEDY)


def test_registered_task_and_store_options(tmp_path):
    tok = tiny_tokenizer()
    model = FAMILIES["llama"]()
    store = stateful_hf.SessionStore(model, 1024, host_capacity=1024)
    pipe = transformers.pipeline("stateful-text-generation", model=model, tokenizer=tok, store=store)
    assert type(pipe).__name__ == "StatefulTextGenerationPipeline" and pipe.store is store
    ref = transformers.pipeline("text-generation", model=FAMILIES["llama"](), tokenizer=tok)
    msgs = [{"role": "user", "content": USER[0]}]
    assert pipe(msgs, session_id="s", **GREEDY) == ref(msgs, **GREEDY)
    # The session parked on the host tier comes back exactly.
    store.move("s", range(len(store.session("s").chunks)), "host")
    msgs2 = pipe(msgs, session_id="s", **GREEDY)[0]["generated_text"] + [{"role": "user", "content": USER[1]}]
    store.move("s", range(len(store.session("s").chunks)), "host")
    assert pipe(msgs2, session_id="s", **GREEDY) == ref(msgs2, **GREEDY)
    assert store.stats("s").last_turn.swapped_in_host > 0
    store.check_integrity()


def test_errors_are_clear():
    ours, _ = _pair()
    chats = [[{"role": "user", "content": u}] for u in USER[:2]]
    with pytest.raises(ValueError, match="one session id per input"):
        ours(chats, session_id="a", **GREEDY)
    with pytest.raises(ValueError, match="3 session ids for 2"):
        ours(chats, session_id=["a", "b", "c"], **GREEDY)
    with pytest.raises(ValueError, match="appears twice"):
        ours(chats, session_id=["a", "a"], **GREEDY)
    with pytest.raises(ValueError, match="num_return_sequences"):
        ours("Hello", session_id="a", num_return_sequences=2, do_sample=True)
    with pytest.raises(ValueError, match="text-generation"):
        stateful_hf.pipeline("summarization", model=FAMILIES["llama"](), tokenizer=tiny_tokenizer())
    with pytest.raises(ValueError, match="either store="):
        stateful_hf.pipeline(model=ours.model, tokenizer=tiny_tokenizer(), store=ours.store, device_capacity=64)
