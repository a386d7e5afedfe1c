"""The README runs as written: its Python blocks, in order, in one fresh interpreter, on the real model
(SmolLM2-135M-Instruct, as the README says). A block preceded by `<!-- not run: reason -->` is left out.
Also: every relative link in README.md and docs/ points at a file that exists."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"(?:<!--\s*not run:(?P<why>[^>]*)-->\s*\n)?```python\n(?P<code>.*?)```", re.S)
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def python_blocks(text: str) -> tuple[list[str], list[str]]:
    """(blocks to run, reasons of the blocks left out)."""
    run, skipped = [], []
    for m in BLOCK.finditer(text):
        (skipped.append(m["why"].strip()) if m["why"] is not None else run.append(m["code"]))
    return run, skipped


def test_block_extraction_honours_the_opt_out():
    text = "a\n```python\nx = 1\n```\n<!-- not run: a server -->\n```python\nserve()\n```\n```bash\nls\n```\n"
    assert python_blocks(text) == (["x = 1\n"], ["a server"])


def test_readme_python_blocks_run_on_the_real_model(tmp_path):
    from stateful_hf.models import DEFAULT_MODEL, ModelUnavailableError, fetch
    try:
        fetch(DEFAULT_MODEL)
    except ModelUnavailableError as e:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true and {DEFAULT_MODEL} cannot be fetched: {e}")
        pytest.skip(f"{DEFAULT_MODEL} cannot be fetched here (run `python -m stateful_hf.models fetch`): {e}")
    run, skipped = python_blocks((ROOT / "README.md").read_text())
    assert len(run) >= 2 and len(skipped) <= 1, (len(run), skipped)
    script = tmp_path / "readme_blocks.py"
    script.write_text("\n".join(run))
    # The store measures Cost(l) once per model and machine and keeps it under $STATEFUL_HF_CACHE; the
    # README is run as a user runs it, with the default cache (conftest points this process elsewhere).
    env = {k: v for k, v in os.environ.items() if k != "STATEFUL_HF_CACHE"}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=1200)
    assert proc.returncode == 0, f"a README block failed:\n{proc.stderr[-4000:]}"
    assert "Paris" in proc.stdout, proc.stdout[-2000:]
    assert re.search(r"\[prompt \d+: ([1-9]\d*) reused", proc.stdout), "the second turn reused nothing:\n" + proc.stdout
    for prompt, reused, computed in re.findall(r"\[prompt (\d+): (\d+) reused \+ (\d+) computed", proc.stdout):
        assert int(reused) + int(computed) == int(prompt), proc.stdout        # the counters add up


def test_relative_links_point_at_files():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    missing = []
    for page in pages:
        for target in LINK.findall(page.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            path = (page.parent / target).resolve()
            if not path.exists():
                missing.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not missing, missing
