"""The compiled step (stateful_hf/integration/compiled_step.py, step_ops.py; docs/step.md): every step without
per-layer work of the tiny families runs through `torch.compile(fullgraph=True)` (Dynamo only: backend "eager")
with no graph break, and the engine's tokens equal stateless greedy generate; a ContextVar read or a branch on a
tensor inside the graph is caught (negative controls) and the step falls back to eager, still exact; the
`compile` option's refusals; one full inductor compile (CI, or STATEFUL_HF_INDUCTOR=1)."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import FAMILIES, Conversation, engine_round

from stateful_hf import Engine
from stateful_hf.integration import attention
from stateful_hf.integration.compiled_step import CompileDecision, CompiledStep, GraphMode
from stateful_hf.integration.context import get_step
from stateful_hf.testing import TINY_FAMILIES

COMPILED = {**{f: FAMILIES[f] for f in ("llama", "mistral", "qwen2", "opt")}, **TINY_FAMILIES}


def dynamo_engine(model, store, **options) -> Engine:
    """An engine whose steps without per-layer work run through Dynamo alone, fullgraph: a graph break
    raises inside `CompiledStep`, which records it in `failed` and reruns the step eager."""
    engine = Engine(model, store=store, compile=False, **options)
    engine.runner.compile_with(CompiledStep(model, backend="eager", fullgraph=True),
                               CompileDecision(True, "test: Dynamo only, fullgraph"))
    return engine


def rounds(engine, oracle, family: str, turns: int = 3, seed: int = 70) -> None:
    convs = {f"{family}{i}": Conversation(seed=seed + i, first=25 + 9 * i, turn=7) for i in range(3)}
    for _ in range(turns):
        engine_round(engine, convs, oracle, n=5)


@pytest.mark.parametrize("family", sorted(COMPILED))
def test_every_step_compiles_fullgraph_and_is_exact(family, make_store):
    """Three sessions x three turns through the engine (mixed prefill + decode steps, a 40-row budget): every
    step runs compiled without a break (none fell back) and every reply equals stateless greedy generate."""
    model, oracle = COMPILED[family](), COMPILED[family]()
    store = make_store(model, device_capacity=2048)
    with dynamo_engine(model, store, max_batch_tokens=40) as engine:
        rounds(engine, oracle, family)
        compiled, stats = engine.runner.compiled, engine.stats()
    assert compiled.failed == {}, compiled.failed
    assert compiled.mode is GraphMode.ONE, compiled.guarded_because       # one graph, every token count
    assert compiled.steps == stats.steps > 9 and stats.compiled_steps == stats.steps
    assert stats.compile.startswith("inductor (test")


@pytest.mark.parametrize("refresh", [True, False])
def test_packed_weights_in_the_graph_follow_their_weights(refresh, make_store, monkeypatch):
    """With packed weights (MKL's, float32) the graph's linear layers multiply by the packed copies
    (`stateful_hf::packed_linear`): exact; after the weights change in place, fresh sessions equal stateless
    generate on the changed model, because the op finds its layer's copy when it runs and repacks it if the weight
    changed. Negative control (`refresh=False`: the op's check sees every copy as current): the graph multiplies
    by the old copies and the replies no longer equal the changed model's."""
    from stateful_hf.kernels.linear import LinearKernel, _PackedForward

    model, oracle = FAMILIES["llama"](), FAMILIES["llama"]()
    store = make_store(model, device_capacity=2048)
    with dynamo_engine(model, store, max_batch_tokens=40, prepack_weights="on") as engine:
        packed = engine.runner.packed
        if packed is None or packed.kernel is not LinearKernel.MKL_PACKED:
            pytest.skip(f"no MKL packed sgemm here ({packed and packed.kernel})")
        assert "linear layers on MKL's packed weights" in engine.stats().compile
        rounds(engine, oracle, "before", turns=2)
        if not refresh:
            monkeypatch.setattr(_PackedForward, "_current", lambda self, w: True)
        with torch.no_grad():
            for m in (model, oracle):
                for layer in m.model.layers:
                    layer.mlp.down_proj.weight.mul_(-4.0)
        if refresh:
            rounds(engine, oracle, "after", turns=2, seed=90)     # new prompts: no prefix computed before
        else:
            with pytest.raises(AssertionError):
                rounds(engine, oracle, "after", turns=2, seed=90)
        compiled = engine.runner.compiled
    assert compiled.failed == {} and compiled.steps == engine.stats().steps


def test_one_graph_serves_every_token_count_only_because_it_is_unbacked(make_store, monkeypatch):
    """Negative control of the test above: the step's one graph keeps no guards, so nothing would recompile it
    for another token count; it serves them all only because `CompiledStep._own` marks the token dimension
    unbacked. Without the mark the graph is specialized to the first count it saw, every other count raises in
    it and runs eager (recorded, logged once): the tokens stay exact, the compiled steps are lost."""
    monkeypatch.setattr(CompiledStep, "_own", staticmethod(lambda t: t.clone()))
    model, oracle = FAMILIES["llama"](), FAMILIES["llama"]()
    with dynamo_engine(model, make_store(model, device_capacity=2048), max_batch_tokens=40) as engine:
        rounds(engine, oracle, "llama", turns=2)
        compiled = engine.runner.compiled
    assert len(compiled.failed) >= 3 and "is invalid for input of size" in " ".join(compiled.failed.values())


def test_a_later_failure_keeps_the_one_graph_and_runs_that_count_eager(make_store):
    """Once the one graph has run (the warm-up), a compiled call that fails at some token count is that count's
    failure alone: it runs eager from then on (recorded), the graph and its mode stay, the tokens stay exact.
    Only a failure before any compiled call succeeded switches to GraphMode.GUARDED."""
    model, oracle = FAMILIES["llama"](), FAMILIES["llama"]()
    with dynamo_engine(model, make_store(model, device_capacity=2048), max_batch_tokens=40) as engine:
        compiled = engine.runner.compiled
        compiled.warm_up()
        graph = compiled.compiled

        def failing_at_three(ids, pos):
            if ids.shape[1] == 3:
                raise RuntimeError("an inductor assert at 3 tokens")
            return graph(ids, pos)
        compiled.compiled = failing_at_three
        rounds(engine, oracle, "llama", turns=2)          # 3 sessions decoding together: steps of 3 rows
    assert compiled.mode is GraphMode.ONE and compiled.guarded_because == ""
    assert set(compiled.failed) == {3} and "inductor assert" in compiled.failed[3]
    assert compiled.steps > 0


@pytest.mark.parametrize("break_kind", ["context_var", "tensor_branch"])
def test_a_graph_break_is_caught_and_the_step_runs_eager(break_kind, make_store, monkeypatch, caplog):
    """Negative controls of the test above: a ContextVar read, or a Python branch on a tensor's value, inserted
    into the traced attention breaks the graph; fullgraph turns it into an error, which CompiledStep records
    (logged once) and answers by rerunning the step eager: no compiled step, no failed request, same tokens."""
    traced = attention._traced

    def broken(module, query, key, value, scaling, kwargs):
        if break_kind == "context_var":
            get_step()
        elif query.sum() > 0:
            query = query + 0
        return traced(module, query, key, value, scaling, kwargs)
    monkeypatch.setattr(attention, "_traced", broken)
    torch._dynamo.reset()
    model, oracle = FAMILIES["llama"](), FAMILIES["llama"]()
    store = make_store(model, device_capacity=2048)
    with caplog.at_level("WARNING", logger="stateful_hf.integration.compiled_step"), \
            dynamo_engine(model, store, max_batch_tokens=40) as engine:
        rounds(engine, oracle, "llama", turns=2)
        compiled = engine.runner.compiled
    torch._dynamo.reset()
    assert compiled.steps == 0 and compiled.failed
    why = " ".join(compiled.failed.values())
    assert ("ContextVar" in why) if break_kind == "context_var" else ("data-dependent" in why.lower()
                                                                      or "Unsupported" in why), why
    assert sum("compiled step failed" in r.message for r in caplog.records) == 1


def test_steps_with_per_layer_work_run_eager(make_store):
    """A store keeping hidden states captures them in every layer of every step: compile=True refuses it by
    name at engine creation; 'auto' stays eager and says why."""
    model = FAMILIES["llama"]()
    store = make_store(model, device_capacity=1024, host_capacity=1024, hidden_states="always", hidden_layers=1)
    with pytest.raises(ValueError, match="compile=True is unsupported with a store that keeps hidden states"):
        Engine(model, store=store, compile=True)
    with Engine(model, store=store) as engine:
        assert engine.runner.compiled is None
        assert engine.stats().compile.startswith("eager (auto: a store that keeps hidden states")


def test_compile_option_refusals(make_store):
    model = FAMILIES["llama"]()
    for bad in ("yes", 1, None):
        with pytest.raises(ValueError, match="compile must be 'auto', True or False"):
            Engine(model, store=make_store(model, device_capacity=512), compile=bad)
    bf16 = FAMILIES["llama"]().to(torch.bfloat16)
    store = make_store(bf16, device_capacity=512, batch_invariant=True)
    with pytest.raises(ValueError, match="compile=True is unsupported with a batch-invariant store"):
        Engine(bf16, store=store, compile=True)
    with Engine(bf16, store=store) as engine:
        assert engine.stats().compile.startswith("eager (auto: a batch-invariant store")
    with Engine(model, store=make_store(model, device_capacity=512), compile=False) as engine:
        assert engine.stats().compile == "eager (compile=False)" and engine.stats().compiled_steps == 0


@pytest.mark.skipif(not (os.environ.get("CI") or os.environ.get("STATEFUL_HF_INDUCTOR")),
                    reason="a cold inductor compile takes ~90 s on 2 cores (~12 s from its disk cache): "
                           "runs in CI or with STATEFUL_HF_INDUCTOR=1")
def test_inductor_compiled_engine_is_exact(make_store):
    """compile=True: inductor compiles the tiny Llama's step at engine creation (1 token and a dynamic count);
    every step of three multi-turn sessions then runs compiled, no shape recompiled or fell back, and the
    float32 tokens equal stateless greedy generate (bits may differ by an ulp; tokens may not)."""
    model, oracle = FAMILIES["llama"](), FAMILIES["llama"]()
    store = make_store(model, device_capacity=2048)
    with Engine(model, store=store, compile=True, max_batch_tokens=40) as engine:
        compiled = engine.runner.compiled
        assert compiled.start_seconds is not None and compiled.steps == 0     # compiled before any request
        rounds(engine, oracle, "llama")
        stats = engine.stats()
    assert compiled.failed == {} and compiled.steps == stats.steps > 9
