"""Engine front-ends: sampling parameters, stop conditions, text streaming, chat, asyncio, metrics."""

from __future__ import annotations

import asyncio

import pytest
import test_engine
import torch
from conftest import FAMILIES, Conversation, greedy
from test_engine import expected

from stateful_hf import SamplingParams
from stateful_hf.engine import RequestFailed
from stateful_hf.testing import tiny_tokenizer

make_engine = test_engine.make_engine     # the fixture: engines are integrity-checked at teardown


def test_sampling_params_validate():
    for bad in (dict(max_new_tokens=0), dict(temperature=-1), dict(top_p=0.0), dict(top_k=-2), dict(stop=("",))):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    assert SamplingParams(stop="x").stop == ("x",)


def test_seeded_sampling_is_reproducible_and_top_k_1_is_greedy(make_engine):
    model, oracle = FAMILIES["llama"](), FAMILIES["llama"]()
    engine = make_engine(model, device_capacity=1024, chunk_size=16)
    ids = Conversation(seed=60).ids[0].tolist()
    hot = SamplingParams(max_new_tokens=10, temperature=1.5, top_p=0.9, top_k=50, seed=123, ignore_eos=True)
    a, b, c = engine.generate(["a", "b", "c"], [ids] * 3, [hot, hot, SamplingParams(
        max_new_tokens=10, temperature=1.5, seed=7, ignore_eos=True)])
    assert a.token_ids == b.token_ids and a.token_ids != c.token_ids
    k1 = engine.generate(["d"], [ids], SamplingParams(max_new_tokens=10, temperature=2.0, top_k=1, seed=1))[0]
    assert list(k1.token_ids) == expected(oracle, ids, 10)


def test_stop_tokens_max_tokens_and_eos(make_engine):
    model, oracle = FAMILIES["llama"](), FAMILIES["llama"]()
    engine = make_engine(model, device_capacity=1024, chunk_size=16)
    ids = Conversation(seed=61).ids[0].tolist()
    ref = expected(oracle, ids, 12, eos_token_id=None)
    (full,) = engine.generate(["s"], [ids], SamplingParams(max_new_tokens=12, ignore_eos=True))
    assert list(full.token_ids) == ref and full.finish_reason == "length"
    stop_at = ref[4]
    (cut,) = engine.generate(["s"], [ids], SamplingParams(max_new_tokens=12, stop_token_ids=(stop_at,)))
    assert list(cut.token_ids) == ref[: ref.index(stop_at) + 1] and cut.finish_reason == "stop"
    # EOS from the generation config ends a turn exactly where generate ends it (made a token that
    # greedy decoding reaches, so the stop really happens).
    eos = ref[3]
    model.generation_config.eos_token_id = eos
    with_eos = make_engine(model, device_capacity=1024, chunk_size=16)
    (out,) = with_eos.generate(["e"], [ids], SamplingParams(max_new_tokens=12))
    assert list(out.token_ids) == expected(oracle, ids, 12, eos_token_id=eos) == ref[: ref.index(eos) + 1]
    assert out.finish_reason == "stop"


def test_text_stream_and_stop_strings(make_engine):
    tok = tiny_tokenizer()
    model, oracle = FAMILIES["llama"](), FAMILIES["llama"]()
    engine = make_engine(model, tokenizer=tok, device_capacity=1024, chunk_size=16)
    ids = tok("Tell me about the weather, the sea")["input_ids"]
    ref = expected(oracle, ids, 20, eos_token_id=None)
    handle = engine.submit("t", ids, SamplingParams(max_new_tokens=20, ignore_eos=True))
    deltas = list(handle.text_deltas())
    out = handle.result()
    assert "".join(deltas) == out.text == tok.decode(ref, skip_special_tokens=True)
    text = out.text
    stop = text[len(text) // 2: len(text) // 2 + 2]
    assert len(stop) == 2
    h = engine.submit("t", ids, SamplingParams(max_new_tokens=20, ignore_eos=True, stop=(stop,)))
    streamed = "".join(h.text_deltas())
    cut = h.result()
    assert cut.finish_reason == "stop" and cut.text == text[: text.find(stop)] == streamed
    with pytest.raises(RequestFailed, match="tokenizer"):
        make_engine(FAMILIES["llama"]()).submit("x", [5, 6], SamplingParams(stop=("a",))).result()


def test_chat_keeps_the_conversation_and_reuses_it(make_engine):
    tok = tiny_tokenizer()
    model, oracle = FAMILIES["llama"](), FAMILIES["llama"]()
    engine = make_engine(model, tokenizer=tok, device_capacity=1024, chunk_size=16).start()
    params = SamplingParams(max_new_tokens=8)
    for i, msg in enumerate(["Hello! How are you today?", "Tell me about the sea.", "Please summarize."]):
        messages = engine.conversation("c") + [{"role": "user", "content": msg}]
        ids = list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"])
        reply = "".join(engine.chat("c", msg, params))
        assert reply == tok.decode(expected(oracle, ids, 8), skip_special_tokens=True)
        last = engine.chats.last("c").result()
        if i:
            assert last.metrics.reused_tokens > 0
    conv = engine.conversation("c")
    assert [m["role"] for m in conv] == ["user", "assistant"] * 3


def test_asyncio_api(make_engine):
    tok = tiny_tokenizer()
    model, oracle = FAMILIES["opt"](), FAMILIES["opt"]()
    engine = make_engine(model, tokenizer=tok, device_capacity=1024, chunk_size=16)
    prompts = [Conversation(seed=80 + i).ids[0].tolist() for i in range(3)]

    async def main():
        outs = await engine.agenerate(["a", "b", "c"], prompts, SamplingParams(max_new_tokens=6))
        h = engine.submit("d", prompts[0], SamplingParams(max_new_tokens=6))
        toks = [t async for t in h]
        deltas = [d async for d in engine.achat("e", "Hello!", SamplingParams(max_new_tokens=5))]
        return outs, toks, (await h.aresult()), deltas

    outs, toks, res, deltas = asyncio.run(main())
    for p, o in zip(prompts, outs, strict=True):
        assert list(o.token_ids) == expected(oracle, p, 6)
    assert toks == list(res.token_ids) == expected(oracle, prompts[0], 6)
    assert "".join(deltas) == engine.conversation("e")[-1]["content"]


def test_metrics_and_stats(make_engine):
    model = FAMILIES["llama"]()
    engine = make_engine(model, device_capacity=1024, chunk_size=16)
    prompts = [Conversation(seed=90 + i).ids[0].tolist() for i in range(4)]
    outs = engine.generate([f"m{i}" for i in range(4)], prompts,
                           SamplingParams(max_new_tokens=5, ignore_eos=True), use_tqdm=True)
    for p, o in zip(prompts, outs, strict=True):
        m = o.metrics
        assert m.prompt_tokens == len(p) and m.output_tokens == 5
        assert 0 <= m.queue_time <= m.ttft <= m.latency and m.tpot > 0
        assert m.reused_tokens == 0 and m.recomputed_tokens == 0 and m.swapped_tokens == 0
    st = engine.stats()
    assert st.finished_requests == 4 and st.generated_tokens == 20
    assert st.prompt_tokens == sum(map(len, prompts)) and st.tokens_per_second > 0
    assert 0 < st.mean_occupancy <= 1
    # Second turns reuse the first turns' KV.
    again = [p + list(o.token_ids) + [11, 12] for p, o in zip(prompts, outs, strict=True)]
    outs2 = engine.generate([f"m{i}" for i in range(4)], again, SamplingParams(max_new_tokens=3))
    assert all(o.metrics.reused_tokens == len(p) + 4 for p, o in zip(prompts, outs2, strict=True))
    assert torch.is_tensor(greedy(model, torch.tensor([prompts[0]]), 1))   # the engine's model still generates
