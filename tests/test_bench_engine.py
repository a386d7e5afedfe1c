"""benchmarks/bench_engine.py compares equal work: every system produces the same greedy tokens."""

from __future__ import annotations

import torch

from benchmarks.bench_engine import Workload, build_model, run_engine, run_stateless, run_transformers_cb
from benchmarks.harness.threads import hold_main_pool
from stateful_hf.engine import openmp


def test_every_system_generates_the_same_tokens():
    wl = Workload(sessions=3, turns=2, first=12, user=5, new=4, vocab=16000, seed=3)
    results = [run_stateless(build_model(1), wl)]
    hold_main_pool()
    results.append(run_transformers_cb(build_model(1), wl, max_batch_tokens=64))
    if openmp.can_release() and torch.get_num_threads() > 1:
        hold_main_pool()
        results.append(run_transformers_cb(build_model(1), wl, max_batch_tokens=64, release_pool=True))
    hold_main_pool()
    engine_result, engine = run_engine(build_model(1), wl, max_batch_tokens=64)   # checks the store's integrity
    results.append(engine_result)
    for r in results:
        assert sorted(r.outputs) == [(s, t) for s in range(3) for t in range(2)]
        assert all(len(ids) == wl.new for ids in r.outputs.values())
        assert r.outputs == results[0].outputs, r.name
        assert sorted(r.ttft) == sorted(r.outputs) and min(r.ttft.values()) > 0
        assert r.returning_ttft_p90() > 0
    assert engine.stats().finished_requests == 6
    tl = engine_result.returning_timeline()      # queue + own steps = TTFT, per returning turn
    assert 0 <= tl["queue_p50_s"] <= tl["queue_p90_s"] and 0 < tl["own_steps_p50_s"] <= tl["own_steps_p90_s"]
    assert all(0 <= engine_result.queue[k] < engine_result.ttft[k] for k in engine_result.ttft)
    assert results[0].returning_timeline() is None      # only the engine reports when a turn was first scheduled


def test_neighbour_specs_parse_and_bad_ones_fail():
    from benchmarks.harness.neighbours import Neighbours, parse

    assert parse("quiet") == [] and parse("busy:2+bursty") == [("busy", 2), ("bursty", 1)]
    for bad in ("busy:x", "loud", "bursty:"):
        try:
            parse(bad)
        except ValueError:
            continue
        raise AssertionError(bad)
    with Neighbours("busy:1") as n:
        assert len(n.procs) == 1 and n.procs[0].poll() is None
    assert n.procs == []


def test_llama_server_is_optional_and_refused_clearly_when_absent(tmp_path):
    import pytest

    from benchmarks.llama_server import LlamaServer, gguf_format

    assert [gguf_format(p) for p in ("a/smollm2-q8_0.gguf", "b-BF16.gguf", "c-q4_0.gguf", "odd.gguf")] == \
        ["Q8_0", "BF16", "Q4_0", "odd.gguf"]
    wl = Workload(sessions=2, turns=1, first=4, user=2, new=2, vocab=100)
    with pytest.raises(FileNotFoundError, match="--llama-server .*not an executable"):
        LlamaServer(str(tmp_path / "llama-server"), str(tmp_path / "m.gguf"), wl, 1)
    exe = tmp_path / "llama-server"
    exe.write_text("#!/bin/sh\nexit 3\n")
    exe.chmod(0o755)
    with pytest.raises(FileNotFoundError, match="--gguf .*no such file"):
        LlamaServer(str(exe), str(tmp_path / "m.gguf"), wl, 1)
    (tmp_path / "m.gguf").write_bytes(b"")
    server = LlamaServer(str(exe), str(tmp_path / "m.gguf"), wl, 1)
    with pytest.raises(RuntimeError, match="llama-server exited with 3"), server:
        pass


def test_ab_compares_two_configurations_of_one_revision():
    import pytest

    from benchmarks.ab import parse_args

    a, revs, args = parse_args(["--before", "HEAD", "--before-args", "--disk-write evict", "--after-args",
                                "--disk-write behind --write-behind-delay '0'", "bench_engine", "--", "--layers", "2"])
    assert revs == {"before": "HEAD", "after": "HEAD"} and a.rounds == 3       # --after defaults to --before
    assert args == {"before": ["--layers", "2", "--disk-write", "evict"],
                    "after": ["--layers", "2", "--disk-write", "behind", "--write-behind-delay", "0"]}
    _, revs, args = parse_args(["--before", "abc123", "bench_tiers", "--", "--reps", "3"])   # two revisions
    assert revs == {"before": "abc123", "after": "HEAD"} and args["before"] == args["after"] == ["--reps", "3"]
    for bad in (["--before", "HEAD", "--after", "HEAD", "bench_engine"],           # nothing differs
                ["--before", "HEAD", "--after-args", "--x 'open", "bench_engine"],  # unbalanced quote
                ["--before", "HEAD", "--after-args", "--x", "bench_nothing"]):       # no figures for it
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_engine_disk_tier_runs_each_in_a_fresh_directory_and_says_what_it_wrote(tmp_path):
    wl = Workload(sessions=2, turns=2, first=12, user=5, new=4, vocab=16000, seed=3)
    reference = run_stateless(build_model(1), wl).outputs
    got = {}
    for mode in ("behind", "evict"):
        hold_main_pool()
        r, _ = run_engine(build_model(1), wl, max_batch_tokens=64,
                          store_options={"disk_dir": str(tmp_path), "disk_write": mode, "write_behind_delay": 0})
        assert r.outputs == reference and list(tmp_path.iterdir()) == []      # its directory removed after it
        got[mode] = r.disk
    assert [got[m]["disk_write"] for m in got] == ["behind", "evict"]   # the store's options, as it resolved them
    assert all(got[m]["write_behind_delay"] == 0.0 for m in got)
    behind = got["behind"]      # its copies race the stop (it lands those queued): only the sum with the flush is fixed
    assert behind["write_behind_at_close"]["written"] + behind["close_flush"]["chunks_written"] > 0
    assert behind["write_behind_at_close"]["written"] >= behind["write_behind"]["written"]
    assert got["evict"]["write_behind"]["written"] == 0                  # evict copies nothing behind ...
    assert got["evict"]["close_flush"]["chunks_written"] > 0             # ... until the close flushes


def test_think_time_pauses_later_turns_seeded_and_in_range():
    """`--think S`: a session's first turn never waits, each later one waits 0.5-1.5 x S s, the same for the same
    seed (each system of a run sees one workload); 0 is the closed loop. Control: another seed, other pauses."""
    wl = Workload(sessions=3, turns=4, first=4, user=2, new=2, vocab=100, seed=1, think=2.0)
    pauses = [[wl.think_before(s, t) for t in range(4)] for s in range(3)]
    assert all(p[0] == 0.0 and all(1.0 <= x <= 3.0 for x in p[1:]) for p in pauses)
    assert pauses == [[Workload(3, 4, 4, 2, 2, 100, seed=1, think=2.0).think_before(s, t) for t in range(4)]
                      for s in range(3)]
    assert pauses != [[Workload(3, 4, 4, 2, 2, 100, seed=2, think=2.0).think_before(s, t) for t in range(4)]
                      for s in range(3)]
    assert Workload(3, 4, 4, 2, 2, 100).think_before(1, 2) == 0.0 and "think" not in repr(Workload(3, 4, 4, 2, 2, 100))
