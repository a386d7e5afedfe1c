"""The options, declared once (stateful_hf/options/): each store's and the engine's keyword arguments are
their option dataclass's fields (the TypedDicts IDEs read match them), an unknown name raises TypeError naming
the closest valid ones, a bad value raises ValueError naming the option before anything is allocated, and the
server's and the demo's store flags are the options marked as flags, with their defaults and help."""

from __future__ import annotations

import argparse
import inspect
import typing
from dataclasses import fields

import pytest

from stateful_hf import Engine, SessionStore
from stateful_hf.cache import KVSpec, KVStore
from stateful_hf.options import (
    EngineConfig,
    EngineConfigKwargs,
    EngineKwargs,
    KVStoreKwargs,
    Layout,
    SessionStoreKwargs,
    SessionStoreOptions,
    StoreConfig,
    StoreKwargs,
    StoreOptions,
    check_known,
)
from stateful_hf.serve import flags
from stateful_hf.testing import tiny_llama


def keys(td) -> set[str]:
    return set(typing.get_type_hints(td))


@pytest.mark.parametrize(("options", "kwargs"), [(StoreOptions, StoreKwargs), (SessionStoreOptions, SessionStoreKwargs),
                                                 (StoreConfig, KVStoreKwargs), (EngineConfig, EngineConfigKwargs)])
def test_keyword_types_are_the_fields(options, kwargs):
    """Each TypedDict of keyword arguments names exactly its dataclass's fields (device_capacity aside: the
    stores' positional argument), so `Unpack[...]` shows IDEs and help() the options there are."""
    names = {f.name for f in fields(options)} - {"device_capacity"}
    assert keys(kwargs) == names


def test_engine_keywords_are_its_options_and_its_stores():
    assert keys(EngineKwargs) == keys(EngineConfigKwargs) | keys(SessionStoreKwargs) | {"device_capacity"}
    assert not keys(EngineConfigKwargs) & keys(SessionStoreKwargs)        # one owner per option


def test_signatures_show_the_options():
    for cls, td in ((SessionStore, SessionStoreKwargs), (KVStore, KVStoreKwargs), (Engine, EngineKwargs)):
        p = inspect.signature(cls.__init__).parameters
        assert p["options"].kind is inspect.Parameter.VAR_KEYWORD
        assert str(p["options"].annotation) in (f"Unpack[{td.__name__}]", f"typing.Unpack[{td.__name__}]"), cls
    assert list(inspect.signature(SessionStore.__init__).parameters)[:3] == ["self", "model", "device_capacity"]


def test_unknown_option_names_the_closest():
    with pytest.raises(TypeError, match=r"unknown option 'host_capcity'; did you mean 'host_capacity'\?"):
        SessionStore(tiny_llama(), 64, host_capcity=128)
    with pytest.raises(TypeError, match=r"unknown option 'max_batch_token'; did you mean 'max_batch_tokens'"):
        Engine(tiny_llama(), max_batch_token=64)
    with pytest.raises(TypeError, match="unknown option 'zzz'; the options are"):
        check_known(["zzz"], ["alpha", "beta"])
    check_known(["alpha"], ["alpha", "beta"])                                 # negative control: a known name


BAD = [("chunk_size", 0), ("swap_out_threshold", 1.5), ("layout", "sparse"), ("hidden_states", "sometimes"),
       ("device_capacity", -1), ("host_capacity", True), ("max_context", 0)]


@pytest.mark.parametrize(("name", "value"), BAD, ids=[n for n, _ in BAD])
def test_bad_store_value_names_the_option(name, value):
    model = tiny_llama()
    given = {"device_capacity": 64, name: value} if name != "device_capacity" else {"device_capacity": value}
    with pytest.raises(ValueError, match=name):
        SessionStore(model, **given)


@pytest.mark.parametrize(("name", "value"), [("max_batch_tokens", 0), ("reserve_fraction", 1.0), ("on_busy", "maybe"),
                                             ("ttft_slo", -1), ("step_threads", "many"), ("arrival_window", 2)])
def test_bad_engine_value_names_the_option(name, value):
    with pytest.raises(ValueError, match=name):
        Engine(tiny_llama(), device_capacity=64, **{name: value})


def test_modes_take_strings_and_members():
    a = StoreOptions(layout="virtual")
    assert a.layout is Layout.VIRTUAL and a.layout == "virtual" and repr(a.layout) == "'virtual'"
    assert StoreOptions(layout=Layout.PAGED).layout is Layout.PAGED
    assert EngineConfig(on_busy="refuse").on_busy == "refuse"


def test_engine_store_options_go_to_the_store_it_makes():
    engine = Engine(tiny_llama(), device_capacity=64, chunk_size=8, host_capacity=128, max_batch_tokens=32)
    try:
        assert engine.store.block_size == 8 and engine.store.tiers.host is not None
        assert engine.config.max_batch_tokens == 32
    finally:
        engine.stop()
    model = tiny_llama()
    with pytest.raises(ValueError, match="host_capacity is a store option"):
        Engine(model, store=SessionStore(model, 64), host_capacity=128)


def test_store_flags_are_the_options_marked_as_flags():
    """Every option marked `flag` is a store flag of both command lines, with the option's help (or its
    command-line wording, `cli`); the defaults are the options' unless the command line gives its own."""
    p = argparse.ArgumentParser()
    flags.add_store_flags(p, device_capacity="1GiB", host_capacity=None)
    dests = {a.dest: a for a in p._actions}
    marked = [f for f in fields(SessionStoreOptions) if f.metadata.get("flag")]
    assert {f.name for f in marked} == {"device_capacity", "host_capacity", "disk_dir", "disk_capacity", "policy",
                                        "attn_backend", "hidden_states", "hidden_capacity", "chunk_size",
                                        "max_sessions", "session_ttl", "max_retain", "write_behind_delay",
                                        "batch_invariant"}
    for f in marked:
        action = dests[f.name]
        assert action.help.startswith(f.metadata.get("cli") or f.metadata["help"]), (f.name, action.help)
    assert dests["device_capacity"].default == "1GiB" and dests["chunk_size"].default == 32
    assert dests["hidden_states"].default == "never" and dests["attn_backend"].option_strings == [
        "--attention-backend", "--backend"]


def test_store_flags_build_valid_options():
    p = argparse.ArgumentParser()
    flags.add_store_flags(p, device_capacity=4096, host_capacity=None)
    out = flags.store_options(p, p.parse_args(["--chunk-size", "8", "--host-capacity", "2GiB", "--max-sessions", "5",
                                               "--session-ttl", "1.5", "--batch-invariant"]))
    SessionStoreOptions.build(**out)                    # the flags' dict is valid options, as given
    assert out["chunk_size"] == 8 and out["host_capacity"] == "2GiB" and out["batch_invariant"] is True
    assert flags.store_options(p, p.parse_args([]))["batch_invariant"] is None      # on where the store can keep it
    assert out["max_sessions"] == 5 and out["session_ttl"] == 1.5


def test_kv_store_refuses_an_unknown_option_before_allocating():
    spec = KVSpec(2, 1, 8, block_size=4)
    with pytest.raises(TypeError, match="did you mean 'disk_capacity'"):
        KVStore(spec, 16, disk_capcity=16)
    with pytest.raises(ValueError, match="disk_capacity needs a disk_dir"):
        KVStore(spec, 16, disk_capacity=16)
