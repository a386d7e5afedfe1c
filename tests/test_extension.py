"""C++ extensions (kernels/extension.py): built once, imported without a lock, and a builder killed mid-build,
its lock file left behind, or a damaged module cost the next process a rebuild, never a hang. Each process is a
fresh interpreter (never a fork of one that ran torch)."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import time

import pytest

from stateful_hf.kernels.extension import intact, versioned_name

SOURCE = """#include <pybind11/pybind11.h>
int add(int a, int b) { return a + b; }
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("add", &add); }
"""
FLAGS = ["-O0"]
SCRIPT = f"""import sys
from stateful_hf.kernels.extension import load_or_build
print(load_or_build("tiny_add", [sys.argv[1]], cflags={FLAGS!r}, root=sys.argv[2]).add(2, 3))
"""


def _start(src, root):
    return subprocess.Popen([sys.executable, "-c", SCRIPT, str(src), str(root)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _run(src, root, timeout):
    p = _start(src, root)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        pytest.fail(f"loading the extension hung past {timeout} s")
    assert p.returncode == 0, err[-2000:]
    return out.strip()


def test_a_killed_builder_and_a_damaged_module_cost_a_rebuild_never_a_hang(tmp_path):
    src = tmp_path / "add.cpp"
    src.write_text(SOURCE)
    root = tmp_path / "ext"
    full = versioned_name("tiny_add", [src], FLAGS, [])
    so, baton = root / f"{full}.so", root / f"{full}.build" / "lock"

    builder = _start(src, root)                   # killed while torch's build holds its lock file
    deadline = time.monotonic() + 60
    while not baton.exists():
        assert builder.poll() is None and time.monotonic() < deadline, "the build never took torch's lock"
        time.sleep(0.02)
    os.kill(builder.pid, signal.SIGKILL)
    builder.wait()
    assert baton.exists() and not so.exists()     # the fault as torch leaves it: its load() would wait forever

    assert _run(src, root, timeout=120) == "5"
    assert so.exists() and not baton.exists()

    with open(root / f"{full}.lock", "a") as lock:   # a build in progress elsewhere: a built module needs no lock
        fcntl.flock(lock, fcntl.LOCK_EX)
        assert _run(src, root, timeout=60) == "5"

    so.write_bytes(so.read_bytes()[:4096])        # damaged on disk (importing it would crash with SIGBUS)
    assert not intact(so)                         # so it is rebuilt, as after the kill above


def test_negative_control_torch_load_waits_on_a_stale_lock(tmp_path):
    src = tmp_path / "add.cpp"
    src.write_text(SOURCE)
    build = tmp_path / "build"
    build.mkdir()
    (build / "lock").touch()
    code = ("import sys; from torch.utils.cpp_extension import load; print('loading', flush=True); "
            "load(name='tiny_add_control', sources=[sys.argv[1]], build_directory=sys.argv[2])")
    p = subprocess.Popen([sys.executable, "-c", code, str(src), str(build)], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "loading"
        time.sleep(2)
        assert p.poll() is None                   # still waiting on the lock file, building nothing
        assert not list(build.glob("*.so"))
    finally:
        p.kill()
        p.wait()
