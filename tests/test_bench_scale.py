"""`python -m benchmarks.bench_scale` at 10^2 and 10^3 held sessions: it fills the stores through
export / import, runs returning turns through `generate` and `Engine`, and every answer equals stateless
`generate` (its figures are measurements, not asserted here: docs/scale.md)."""

from __future__ import annotations

from benchmarks.bench_scale import main


def test_bench_scale_runs_at_100_and_1000_sessions_and_every_answer_is_exact(tmp_path):
    out = main(["--sizes", "100", "1000", "--turns", "3", "--json", str(tmp_path / "scale.json")])
    assert out["wrong"] == 0
    assert [r["sessions"] for r in out["rows"]] == [100, 1000]
    for r in out["rows"]:
        assert r["generate_median_ms"] > 0 and r["engine_median_ms"] > 0 and r["heap_bytes_per_session"] > 0
    assert (tmp_path / "scale.json").exists()


def test_bench_scale_on_disk_restarts_and_every_answer_is_exact(tmp_path):
    """`--tier disk --restart` in the 4 KiB-a-chunk geometry of the 10^6-chunk run: the stores are filled
    straight to disk (one bulk import each), closed, reopened from their directories (every session
    restored but those the timed turns moved up) and turned again, every answer exact."""
    out = main(["--sizes", "50", "150", "--turns", "2", "--tier", "disk", "--host-tokens", "1024", "--restart",
                "--layers", "1", "--kv-heads", "1", "--tokens", "320", "--json", str(tmp_path / "disk.json")])
    assert out["wrong"] == 0 and [r["chunks"] for r in out["rows"]] == [500, 1500]
    for r, size in zip(out["restarts"], (50, 150)):
        assert r["sessions"] == size and size - 4 <= r["restored"] <= size and r["turns"] == 2
        assert r["history_tokens_from_disk"] > 0 and r["restart_s"] > 0
