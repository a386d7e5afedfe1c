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
