"""The offline bundle's rules, without the network: which version ranges an image's range meets, what a
bundle ships (planned against a fake index), and run.sh's syntax. `.ci/run` builds a real bundle from the
index and installs it with --no-index into a fresh venv."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from benchmarks import gpu_bundle
from benchmarks.gpu_bundle import Release, Target, covers, plan_bundle, pyproject_pin

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(("new", "old", "met"), [
    (">=1.31,<3", ">=1.5,<2", False),          # a higher floor: the image may hold 1.5
    (">=1.5", ">=1.5,<2", True),
    ("<0.24,>=0.23.1", "<0.24.0,>=0.23.1", True),
    (">=1.0,<2", ">=1.0", False),               # a new cap
    (">=1.0,<=2", ">=1.0,<2", True),
    (">=1.0,<2", ">=1.0,<=2", False),           # the image may hold 2 itself
    (">1.0", ">=1.0", False),
    ("~=1.4", ">=1.4.2,<1.9", True),            # ~=1.4 is >=1.4,<2
    ("==1.4.*", ">=1.4,<1.5", True),
    (">=1.0,!=1.3", ">=1.0,<2", False),         # excludes a version the image may hold
    (">=1.0,!=3.0", ">=1.0,<2", True),
    ("", None, True),                           # no range: anything serves
    (">=1.0", None, False),                     # the image was never asked for it
    (">=1.0", "", False),
])
def test_covers(new, old, met):
    assert covers(SpecifierSet(new), None if old is None else SpecifierSet(old)) is met


def test_target_platforms_and_markers():
    target = Target("3.12", "2.28", "x86_64")
    tags = target.platforms()
    assert tags[0] == "manylinux_2_28_x86_64" and "manylinux_2_17_x86_64" in tags and "manylinux2014_x86_64" in tags
    assert "manylinux_2_29_x86_64" not in tags and "manylinux1_x86_64" in tags
    assert Requirement('tomli; python_version < "3.11"').marker.evaluate(target.markers()) is False
    assert Requirement('hf-xet; platform_machine == "x86_64"').marker.evaluate(target.markers()) is True
    assert Requirement('x; extra == "torch"').marker.evaluate(target.markers()) is False
    flags = target.pip_flags()
    assert "--only-binary=:all:" in flags and flags[flags.index("--python-version") + 1] == "3.12"


def test_the_pin_comes_from_pyproject():
    pin = pyproject_pin(ROOT / "pyproject.toml")
    line = next(d for d in ROOT.joinpath("pyproject.toml").read_text().splitlines() if '"transformers' in d)
    assert str(pin) == str(Requirement(line.strip().strip(",").strip('"')).specifier)


FAKE_INDEX = {      # name -> version -> Requires-Dist
    "transformers": {"5.17.0": ["huggingface-hub<2.0,>=1.5.0", "numpy>=1.17", "typer"],
                     "5.23.0": ["huggingface-hub<3.0,>=1.31.0", "numpy>=1.17", "typer", "torch; extra == 'torch'"],
                     "5.24.0": ["huggingface-hub<3.0,>=1.40.0"]},
    "huggingface-hub": {"1.5.0": ["hf-xet<2,>=1.2", "typer"], "1.33.0": ["hf-xet<2,>=1.6", "click>=8.4.2"],
                        "2.4.0": ["hf-xet<2,>=1.7", "httpx2"]},
    "hf-xet": {"1.2.0": [], "1.8.0": []},
    "click": {"8.5.1": ['colorama; platform_system == "Windows"']},
}


def fake_resolve(requirement: str, target: Target) -> Release | None:
    req = Requirement(requirement)
    versions = [v for v in FAKE_INDEX.get(req.name, {}) if req.specifier.contains(v)]
    if not versions:
        return None
    version = max(versions, key=lambda v: tuple(map(int, v.split("."))))
    return Release(req.name, version, tuple(FAKE_INDEX[req.name][version]), None)


def test_plan_ships_what_the_image_may_lack(monkeypatch):
    """Against a fake index: transformers in the pin; the hub, whose floor rose, at the newest release
    inside both ranges (1.33, not 2.4); then the hub's own new needs (click: unknown to the image;
    hf-xet: a higher floor than the image's hub 1.5 asked). numpy and typer are left to the image."""
    monkeypatch.setattr(gpu_bundle, "resolve", fake_resolve)
    plan = plan_bundle(SpecifierSet(">=5.23,<5.24"), "5.17.0", Target(), log=lambda line: None)
    assert {name: s.version for name, s in plan.shipped.items()} == {
        "transformers": "5.23.0", "huggingface-hub": "1.33.0", "hf-xet": "1.8.0", "click": "8.5.1"}
    assert plan.shipped["huggingface-hub"].image_had == "<2.0,>=1.5.0" and "torch" not in plan.shipped
    assert plan.shipped["click"].image_had is None and "numpy>=1.17" in plan.kept and "typer" in plan.kept
    same = plan_bundle(SpecifierSet(">=5.17,<5.18"), "5.17.0", Target(), log=lambda line: None)
    assert list(same.shipped) == ["transformers"]        # the control: the image's own version needs nothing more
    with pytest.raises(RuntimeError, match="no wheel of transformers"):
        plan_bundle(SpecifierSet(">=9"), "5.17.0", Target(), log=lambda line: None)


def test_run_sh_parses(tmp_path):
    script = tmp_path / "run.sh"
    script.write_text(gpu_bundle.RUN_SH)
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    r = subprocess.run(["bash", str(script), "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "--install-only" in r.stdout and "set -e" not in r.stdout
    r = subprocess.run(["bash", str(script), str(tmp_path)], capture_output=True, text=True)
    assert r.returncode == 2 and "not a stateful-hf checkout" in r.stderr
