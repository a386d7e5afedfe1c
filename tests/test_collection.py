"""`pytest -m cuda` collects on a machine without the web stack (an air-gapped GPU node: no fastapi,
pydantic, ...): in a fresh interpreter where importing the server's packages fails as if they were
absent, collecting the `cuda` tests raises no error and finds some. Test modules that need the server
import it lazily or `pytest.importorskip` it at module level."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BLOCKED = ("fastapi", "uvicorn", "gradio", "ray", "httpx", "openai", "prometheus_client", "pydantic")
# Loaded by `site` at interpreter start (its folder first on PYTHONPATH): a meta path finder that makes
# every import of a blocked top-level package (and its submodules) fail as a missing module does.
SITECUSTOMIZE = f'''
import sys

BLOCKED = {BLOCKED!r}


class BlockWebStack:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked by tests/test_collection.py)", name=name)
        return None


sys.meta_path.insert(0, BlockWebStack())
'''


def _run_blocked(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """`python *args` from the repository root in a fresh interpreter with BLOCKED unimportable."""
    (tmp_path / "sitecustomize.py").write_text(SITECUSTOMIZE)
    path = [str(tmp_path), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_blocker_makes_the_web_stack_unimportable(tmp_path):
    """The negative control: under the blocker each blocked package fails to import (fastapi at least
    is installed here, so its failure is the blocker's doing), and an unblocked one still imports."""
    if importlib.util.find_spec("fastapi") is None:
        pytest.skip("fastapi is not installed here: the control needs a package the blocker must hide")
    r = _run_blocked(tmp_path, "-c", "import fastapi")
    assert r.returncode != 0 and "No module named 'fastapi' (blocked" in r.stderr, r.stderr
    probe = f"import importlib\nfor n in {BLOCKED!r} + ('fastapi.responses',):\n" \
            "    try:\n        importlib.import_module(n)\n        print('imported', n)\n" \
            "    except ModuleNotFoundError:\n        pass\nimport torch, stateful_hf\nprint('ok')"
    r = _run_blocked(tmp_path, "-c", probe)
    assert r.returncode == 0 and r.stdout.split() == ["ok"], r.stdout + r.stderr


def test_cuda_tests_collect_without_the_web_stack(tmp_path):
    r = _run_blocked(tmp_path, "-m", "pytest", "-o", "addopts=", "--collect-only", "-q", "-m", "cuda",   # as gpu_check
                     "-p", "no:cacheprovider", str(ROOT / "tests"))
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert not re.search(r"\berrors?\b", out.strip().splitlines()[-1]), out[-4000:]
    collected = re.search(r"(\d+)(?:/\d+)? tests? collected", out)
    assert collected and int(collected.group(1)) >= 1, out[-4000:]
