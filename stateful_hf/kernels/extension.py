"""C++ extensions built once per machine and loaded without torch's lock file.

torch's `cpp_extension.load` guards its build directory with a lock *file* that a killed process leaves
behind, and every later `load` of that extension then waits on it forever. Here:
- a built module is `<root>/<name>_<hash>.so`, placed by an atomic rename after its digest
  (`.sha256`), and imported directly once the digest matches (no lock, no ninja check: milliseconds; a
  damaged file would crash the import with SIGBUS); the hash covers the sources, flags, key, torch and
  Python;
- a build holds `<root>/<name>_<hash>.lock` with flock(2), which the kernel drops when its holder dies, so
  under it a torch lock file left in the build directory is known stale and removed: a killed builder
  costs the next process a rebuild, never a hang.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import torch


def default_root() -> Path:
    from torch.utils.cpp_extension import get_default_build_root  # honours TORCH_EXTENSIONS_DIR
    return Path(get_default_build_root()) / "stateful_hf"


def versioned_name(name: str, sources: Sequence[Path], cflags: Sequence[str], ldflags: Sequence[str],
                   key: str = "") -> str:
    h = hashlib.sha256()
    for part in (*(Path(s).read_bytes() for s in sources), repr((list(cflags), list(ldflags), key)).encode(),
                 torch.__version__.encode(), sys.implementation.cache_tag.encode()):
        h.update(hashlib.sha256(part).digest())
    return f"{name}_{h.hexdigest()[:12]}"


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def intact(so: Path) -> bool:
    """Whether the built module at `so` is whole: its digest file matches it."""
    digest = so.with_suffix(".sha256")
    return so.exists() and digest.exists() and digest.read_text() == _digest(so)


def _place(src: Path, dst: Path) -> None:
    tmp = dst.with_name(f"{dst.name}.{os.getpid()}.tmp")
    shutil.copyfile(src, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, dst)                          # readers see no file or the whole file


def _import(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_or_build(name: str, sources: Sequence[Path], *, cflags: Sequence[str] = (), ldflags: Sequence[str] = (),
                  key: str = "", root: Path | None = None) -> ModuleType:
    """The extension, imported from the cache or built into it; raises what the build raised."""
    root = Path(root) if root is not None else default_root()
    full = versioned_name(name, sources, cflags, ldflags, key)
    so = root / f"{full}.so"
    if intact(so):
        return _import(full, so)
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{full}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)          # released by the kernel if this process dies
        if intact(so):
            return _import(full, so)              # another process built it while this one waited
        build = root / f"{full}.build"
        build.mkdir(exist_ok=True)
        (build / "lock").unlink(missing_ok=True)  # torch's baton: stale, as this process holds the flock
        from torch.utils.cpp_extension import load
        module = load(name=full, sources=[str(s) for s in sources], extra_cflags=list(cflags),
                      extra_ldflags=list(ldflags), build_directory=str(build), verbose=False)
        built = build / f"{full}.so"
        digest = build / f"{full}.sha256"
        digest.write_text(_digest(built))
        _place(digest, so.with_suffix(".sha256"))  # digest first: a reader of the old module sees a mismatch
        _place(built, so)
        shutil.rmtree(build, ignore_errors=True)
        return module
