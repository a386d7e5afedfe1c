"""The step context (stateful_hf/integration/context.py): one current step per thread, set for exactly one
forward. A forward that raises ends and takes back its step; another thread's forward never sees it;
the engine's thread and a plain `generate` on another thread stay exact together."""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import FAMILIES, Conversation, greedy
from test_hidden import hidden_store, lay_out

from stateful_hf import Engine, SamplingParams
from stateful_hf.integration.adapter import decoder_layers
from stateful_hf.integration.context import get_step


def test_before_layer_runs_each_layer_once_in_order_before_it(make_store, tmp_path):
    """A returning session whose chunks are hidden states: when decoder layer l starts, the step's
    before_layer has rebuilt layers 0..l of its chunks and no later one (layer-wise, not ahead)."""
    model, oracle = FAMILIES["llama"](), FAMILIES["llama"]()
    store = hidden_store(make_store, model, tmp_path, hidden_layers=1)
    cache = store.cache("a")
    conv = Conversation(seed=7, first=70, turn=20)
    conv.reply(greedy(model, conv.ids, cache=cache))
    lay_out(store, "a", ["hidden"])
    seen: list[tuple[int, list[int]]] = []

    def spy(idx):
        def hook(module, args, kwargs):       # runs after the enable()'s pre-hook of the same layer
            step = get_step()
            if step is not None and step.hidden is not None and step.hidden.restore is not None:
                seen.append((idx, sorted(step.hidden.restore.done)))
        return hook
    layers = decoder_layers(model)
    hooks = [layer.register_forward_pre_hook(spy(i), with_kwargs=True) for i, layer in enumerate(layers)]
    try:
        out = greedy(model, conv.ids, cache=cache)
    finally:
        for h in hooks:
            h.remove()
    assert torch.equal(out, greedy(oracle, conv.ids))
    assert seen == [(i, list(range(i + 1))) for i in range(len(layers))]
    assert store.stats("a").last_turn.restored_hidden > 0


def test_layer_hooks_only_while_a_step_has_per_layer_work(make_store, tmp_path):
    """A step without per-layer work runs its decoder layers without the seam's pre-hook; a step with it (a
    store that captures hidden states) has it during its forward, first of the layer's pre-hooks; none is
    left after either. The control: the spy sees the seam's hook when the step has per-layer work."""
    counts: list[int] = []

    def spy(module, args, kwargs):
        counts.append(len(module._forward_pre_hooks))
    for store_of in (lambda m: make_store(m), lambda m: hidden_store(make_store, m, tmp_path, hidden_layers=1)):
        model, oracle = FAMILIES["llama"](), FAMILIES["llama"]()
        store = store_of(model)
        layer = decoder_layers(model)[0]
        hook = layer.register_forward_pre_hook(spy, with_kwargs=True)
        counts.clear()
        ids = torch.arange(3, 40)[None]
        out = greedy(model, ids, n=3, cache=store.cache("a"))
        assert torch.equal(out, greedy(oracle, ids, n=3))
        assert len(layer._forward_pre_hooks) == 1          # the spy alone: the seam's hook is gone
        hook.remove()
        assert len(layer._forward_pre_hooks) == 0
        expected = 2 if store.keeps_hidden else 1
        assert counts and set(counts) == {expected}, (store.keeps_hidden, counts)


def test_a_forward_that_raises_ends_and_takes_back_its_step(make_store):
    model, oracle = FAMILIES["llama"](), FAMILIES["llama"]()
    store = make_store(model)
    cache = store.cache("a")
    ids = torch.arange(3, 43)[None]
    with torch.no_grad():
        model(ids[:, :30], past_key_values=cache)
    before = list(store.session("a").token_ids)

    def fail(module, args, kwargs):
        assert get_step() is not None       # inside the stateful forward, its step is current
        raise RuntimeError("injected")
    hook = decoder_layers(model)[1].register_forward_pre_hook(fail, with_kwargs=True)
    with torch.no_grad(), pytest.raises(RuntimeError, match="injected"):
        model(ids[:, 30:], past_key_values=cache)
    hook.remove()
    assert get_step() is None and cache.pending is None           # ended and taken back at once
    assert list(store.session("a").token_ids) == before
    store.check_integrity()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, oracle(ids).logits)   # an ordinary call: no stale step
        got = model(ids[:, 30:], past_key_values=cache).logits
    torch.testing.assert_close(got, oracle(ids).logits[:, 30:], rtol=1e-4, atol=1e-4)


def test_generate_interrupted_mid_forward_ends_and_takes_back_its_step(make_store):
    """A KeyboardInterrupt is no Exception: torch's always_call hook does not run, generate's finally does."""
    model, oracle = FAMILIES["opt"](), FAMILIES["opt"]()
    store = make_store(model)
    cache = store.cache("a")
    ids = torch.arange(3, 40)[None]
    greedy(model, ids[:, :20], n=4, cache=cache)
    before = list(store.session("a").token_ids)

    def interrupt(module, args, kwargs):
        raise KeyboardInterrupt
    hook = decoder_layers(model)[0].register_forward_pre_hook(interrupt, with_kwargs=True)
    with pytest.raises(KeyboardInterrupt):
        greedy(model, ids, n=4, cache=cache)
    hook.remove()
    assert get_step() is None and cache.pending is None
    assert list(store.session("a").token_ids) == before[: len(store.session("a").token_ids)]
    store.check_integrity()
    assert torch.equal(greedy(model, ids, n=6), greedy(oracle, ids, n=6))
    assert torch.equal(greedy(model, ids, n=6, cache=cache), greedy(oracle, ids, n=6))


def test_another_threads_forward_never_sees_the_step(make_store):
    """Thread A stops inside its stateful forward (step current); meanwhile this thread's ordinary
    forward is plain SDPA, exactly the oracle's, and A's forward then finishes exactly."""
    model, oracle = FAMILIES["llama"](), FAMILIES["llama"]()
    store = make_store(model)
    cache = store.cache("a")
    ids = torch.arange(3, 43)[None]
    inside, release, got, errors = threading.Event(), threading.Event(), {}, []

    def pause(module, args, kwargs):
        if threading.current_thread().name == "stepper":
            inside.set()
            assert release.wait(60)

    def stepper():
        try:
            with torch.no_grad():
                got["a"] = model(ids, past_key_values=cache).logits
        except BaseException as e:     # surfaced below
            errors.append(e)

    hook = decoder_layers(model)[1].register_forward_pre_hook(pause, with_kwargs=True)
    thread = threading.Thread(target=stepper, name="stepper")
    thread.start()
    try:
        assert inside.wait(60)
        assert get_step() is None
        with torch.no_grad():
            plain = model(ids[:, :17]).logits
        assert torch.equal(plain, oracle(ids[:, :17]).logits)
    finally:
        release.set()
        thread.join(60)
        hook.remove()
    assert not errors, errors
    with torch.no_grad():
        torch.testing.assert_close(got["a"], oracle(ids).logits, rtol=1e-4, atol=1e-4)
    assert cache.get_seq_length() == ids.shape[1] and cache.pending is None


def test_engine_thread_and_plain_generate_together_exact():
    """The engine steps on its thread while this thread runs plain `generate` of the same model:
    every output is the stateless oracle's."""
    model, oracle = FAMILIES["opt"](), FAMILIES["opt"]()
    engine = Engine(model, device_capacity=1024, chunk_size=16, max_batch_tokens=64).start()
    try:
        convs = [Conversation(seed=40 + i, first=24) for i in range(4)]
        prompts = [c.ids[0].tolist() for c in convs]
        handles = [engine.submit(f"e{i}", p, SamplingParams(max_new_tokens=12)) for i, p in enumerate(prompts)]
        for k in range(3):
            x = torch.arange(5 + k, 30 + k)[None]
            assert torch.equal(greedy(model, x, n=6), greedy(oracle, x, n=6))
        for p, h in zip(prompts, handles, strict=True):
            x = torch.tensor([p])
            assert list(h.result(timeout=300).token_ids) == greedy(oracle, x, n=12)[0, len(p):].tolist()
    finally:
        engine.stop()
    engine.store.check_integrity()
