"""The disk tier: a preallocated memory-mapped file of blocks plus a JSON index of sessions.

Layout in `disk_dir`: `kv.bin` (the pool's tensor, layer-major like every pool, so one layer of a
chunk set is read together), `hidden.bin` (with hidden states in use: a HiddenPool's two tensors,
hidden layers then K/V layers, each layer-major; HCache on disk), `index.json` (geometries, and per
session its token ids and which chunks are on disk at which slot, in which form), `lock` (one
store per directory). The index is rewritten
atomically (temp file + rename) whenever the disk state changes, so a restarted store sees the
sessions it left.
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import math
import os
from pathlib import Path

import torch

from .errors import StoreError
from .hidden import HiddenPool, HiddenSpec
from .pool import BlockPool
from .spec import KVSpec


def _geometry(spec: KVSpec) -> dict:
    return {"num_layers": spec.num_layers, "num_kv_heads": spec.num_kv_heads, "head_dim": spec.head_dim,
            "block_size": spec.block_size, "dtype": str(spec.dtype).removeprefix("torch.")}


class DiskTier:
    def __init__(self, spec: KVSpec, directory: str | os.PathLike, num_blocks: int):
        self.dir = Path(directory)
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._lock_file = open(self.dir / "lock", "a+")   # noqa: SIM115 (held for the store's life)
        except OSError as e:
            raise StoreError(f"disk tier directory {str(self.dir)!r} is not writable: {e}") from e
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            self._lock_file.close()
            raise StoreError(f"disk tier {str(self.dir)!r} is in use by another store") from e
        self.index_path = self.dir / "index.json"
        self._maps: list[tuple[Path, torch.Tensor]] = []    # (file, its whole mapping as a flat tensor)
        saved = self._read_index()
        if saved and saved["geometry"] != _geometry(spec):
            self.close()
            raise StoreError(f"disk tier {str(self.dir)!r} holds KV of another geometry {saved['geometry']}, "
                             f"this model needs {_geometry(spec)}; use another disk_dir")
        if saved:
            num_blocks = max(num_blocks, saved["num_blocks"])
        shape = (spec.num_layers, num_blocks, 2, spec.block_size, spec.num_kv_heads, spec.head_dim)
        try:
            data = self._map("kv.bin", [shape], spec.dtype)[0]
        except StoreError:
            self.close()
            raise
        self.pool = BlockPool(spec, num_blocks, data=data)
        self.saved_sessions: dict[str, dict] = saved["sessions"] if saved else {}
        self._saved_hidden: dict | None = saved.get("hidden") if saved else None
        self._geometry = _geometry(spec)
        self.hidden_pool: HiddenPool | None = None
        self._hidden_geometry: dict | None = None

    def _map(self, name: str, shapes: list[tuple[int, ...]], dtype: torch.dtype) -> list[torch.Tensor]:
        """Tensors of `shapes`, one after the other in the preallocated, memory-mapped file `name`."""
        sizes = [math.prod(sh) for sh in shapes]
        path = self.dir / name
        nbytes = sum(sizes) * torch.empty((), dtype=dtype).element_size()
        try:
            with open(path, "ab") as f:
                if f.tell() < nbytes:
                    os.posix_fallocate(f.fileno(), 0, nbytes)   # ENOSPC now, not SIGBUS later
            flat = torch.from_file(str(path), shared=True, size=sum(sizes), dtype=dtype)
        except OSError as e:
            raise StoreError(f"cannot create the disk tier file {str(path)!r} of {nbytes} bytes: {e}") from e
        self._maps.append((path, flat))
        return [part.view(sh) for part, sh in zip(flat.split(sizes), shapes)]

    def open_hidden(self, spec: HiddenSpec, num_blocks: int) -> bool:
        """Map `hidden.bin`: slots of hidden chunks of `spec`'s split (`self.hidden_pool`). Returns
        True when the index's hidden chunks were saved in this same geometry (so they are usable);
        otherwise they are not, and the file is reused for the new geometry."""
        geometry = {"hidden_size": spec.hidden_size, "hidden_layers": spec.hidden_layers}
        saved = self._saved_hidden
        same = saved is not None and {k: saved.get(k) for k in geometry} == geometry
        if same:
            num_blocks = max(num_blocks, saved["num_blocks"])
        kv, bs = spec.kv, spec.kv.block_size
        shapes = [(spec.hidden_layers, num_blocks, bs, spec.hidden_size),
                  (spec.kv_layers, num_blocks, 2, bs, kv.num_kv_heads, kv.head_dim)]
        self.hidden_pool = HiddenPool(spec, num_blocks, data=tuple(self._map("hidden.bin", shapes, kv.dtype)))
        self._hidden_geometry = {**geometry, "num_blocks": num_blocks}
        return same

    def _read_index(self) -> dict | None:
        if not self.index_path.exists():
            return None
        try:
            return json.loads(self.index_path.read_text())
        except (OSError, ValueError) as e:
            raise StoreError(f"disk tier index {str(self.index_path)!r} is unreadable: {e}") from e

    def drop_page_cache(self) -> bool:
        """Write the tier's files back and evict them from the OS page cache, so the next reads come
        from the device (for profiling and benchmarks). Pages mapped into this process are not
        evicted by posix_fadvise alone: they are unmapped first (madvise MADV_DONTNEED; a shared file
        mapping keeps its data in the file). Returns False where that is not available (reads of
        mapped pages may then stay warm)."""
        unmapped = True
        for path, flat in self._maps:
            try:
                libc = ctypes.CDLL(None, use_errno=True)
                libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
                unmapped &= libc.madvise(flat.data_ptr(), flat.numel() * flat.element_size(), 4) == 0
            except (OSError, AttributeError):
                unmapped = False
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        return unmapped

    def write_index(self, sessions: dict[str, dict]) -> None:
        """sessions: {session_id: {"token_ids": [...], "disk_chunks": {chunk_index: slot},
        "hidden_chunks": {chunk_index: slot of hidden.bin}}}."""
        body = {"geometry": self._geometry, "num_blocks": self.pool.num_blocks, "sessions": sessions}
        if self._hidden_geometry is not None:
            body["hidden"] = self._hidden_geometry
        tmp = self.index_path.with_suffix(".tmp")
        try:
            tmp.write_text(json.dumps(body))
            os.replace(tmp, self.index_path)
        except OSError as e:
            raise StoreError(f"cannot write the disk tier index {str(self.index_path)!r}: {e}") from e

    def close(self) -> None:
        if not self._lock_file.closed:
            fcntl.flock(self._lock_file, fcntl.LOCK_UN)
            self._lock_file.close()


def saved_hidden_layers(directory: str | os.PathLike) -> int | None:
    """The hidden split (layers kept as hidden states) of the hidden chunks recorded in the index of
    `directory`, if it records any: a restarted store that keeps this split can use them."""
    path = Path(directory) / "index.json"
    try:
        body = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    hidden = body.get("hidden")
    if hidden is None or not any(s.get("hidden_chunks") for s in body.get("sessions", {}).values()):
        return None
    return hidden.get("hidden_layers")
