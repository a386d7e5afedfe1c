"""Every script in examples/ runs offline on the tiny fixture (`tiny-random`; their default is the real
model, which tests/test_real_model.py covers) and prints what it promises."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXPECT = {
    "multiturn_generate.py": ["reused +", "StoreStats("],
    "pipeline_chat.py": ["prompt tokens reused +", "StatefulTextGenerationPipeline"],
    "engine_sessions.py": ["ttft", "18 turns", "traffic:"],
    "tier_movement.py": ["history came from    disk", "recomputed", "traffic:"],
}


def test_every_example_runs_offline():
    scripts = sorted(p.name for p in (ROOT / "examples").glob("*.py"))
    assert scripts == sorted(EXPECT), f"examples/ has {scripts}; list each one in EXPECT"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    start, out_of = time.monotonic(), {}
    procs = {name: subprocess.Popen([sys.executable, f"examples/{name}", "tiny-random"], cwd=ROOT, env=env, text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE) for name in scripts}
    for name, proc in procs.items():
        try:
            out, err = proc.communicate(timeout=max(120 - (time.monotonic() - start), 1))
            out_of[name] = out
        except subprocess.TimeoutExpired:
            for p in procs.values():
                p.kill()
            raise AssertionError(f"examples/{name} did not finish within 120 s") from None
        assert proc.returncode == 0, f"examples/{name} failed:\n{err[-3000:]}"
        for text in EXPECT[name]:
            assert text in out, f"examples/{name}: {text!r} not in its output:\n{out[-2000:]}"
    # the counts a turn prints add up: the prompt is reused + computed (generated tokens apart)
    printed = out_of["multiturn_generate.py"]
    sums = re.findall(r"\[prompt (\d+): (\d+) reused \+ (\d+) computed; (\d+) generated\]", printed)
    assert len(sums) == 3, printed
    for prompt, reused, computed, generated in sums:
        assert int(reused) + int(computed) == int(prompt) and int(generated) > 0, sums
    assert int(sums[1][1]) > 0                           # the second turn reused the first's history
