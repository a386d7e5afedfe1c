"""`python -m benchmarks.bench_shared_prefix` past a full device: sessions that share a system prompt's chunk,
one turn each, every sampled answer equal to stateless `generate` (its figures are measurements, not asserted
here: docs/scale.md). Control: without a system prompt nothing is shared. `--fair`: under the fair share."""

from __future__ import annotations

import pytest

from benchmarks.bench_shared_prefix import main


@pytest.mark.parametrize("system, fair", [(32, False), (0, False), (32, True)])
def test_bench_shared_prefix_runs_past_a_full_device_and_its_answers_are_exact(tmp_path, system, fair):
    out = main(["--sessions", "90", "--every", "30", "--device-tokens", "1024", "--system", str(system),
                "--verify", "30", "--json", str(tmp_path / "shared.json"), *(["--fair"] if fair else [])])
    assert out["wrong"] == 0 and out["verified"] == 30
    assert out["shared_tokens"] == system            # one chunk every session names (none: the control)
    assert [b["sessions"] for b in out["blocks"]] == [30, 60, 90] and all(b["turn_ms_mean"] > 0 for b in out["blocks"])
    assert (tmp_path / "shared.json").exists()
