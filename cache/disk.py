"""The disk tier: a preallocated memory-mapped file of blocks plus a JSON index of sessions.

Layout in `disk_dir`: `kv.bin` (the pool's tensor, layer-major like every pool, so one layer of a
chunk set is read together), `index.json` (geometry, and per session its token ids and which
chunks are on disk at which slot), `lock` (one store per directory). The index is rewritten
atomically (temp file + rename) whenever the disk state changes, so a restarted store sees the
sessions it left.
"""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path

import torch

from .errors import StoreError
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
        saved = self._read_index()
        if saved and saved["geometry"] != _geometry(spec):
            self.close()
            raise StoreError(f"disk tier {str(self.dir)!r} holds KV of another geometry {saved['geometry']}, "
                             f"this model needs {_geometry(spec)}; use another disk_dir")
        if saved:
            num_blocks = max(num_blocks, saved["num_blocks"])
        shape = (spec.num_layers, num_blocks, 2, spec.block_size, spec.num_kv_heads, spec.head_dim)
        numel = 1
        for d in shape:
            numel *= d
        path = self.dir / "kv.bin"
        nbytes = numel * torch.empty((), dtype=spec.dtype).element_size()
        try:
            with open(path, "ab") as f:
                if f.tell() < nbytes:
                    os.posix_fallocate(f.fileno(), 0, nbytes)   # ENOSPC now, not SIGBUS later
            data = torch.from_file(str(path), shared=True, size=numel, dtype=spec.dtype).view(shape)
        except OSError as e:
            self.close()
            raise StoreError(f"cannot create the disk tier file {str(path)!r} of {nbytes} bytes: {e}") from e
        self.pool = BlockPool(spec, num_blocks, data=data)
        self.saved_sessions: dict[str, dict] = saved["sessions"] if saved else {}
        self._geometry = _geometry(spec)

    def _read_index(self) -> dict | None:
        if not self.index_path.exists():
            return None
        try:
            return json.loads(self.index_path.read_text())
        except (OSError, ValueError) as e:
            raise StoreError(f"disk tier index {str(self.index_path)!r} is unreadable: {e}") from e

    def write_index(self, sessions: dict[str, dict]) -> None:
        """sessions: {session_id: {"token_ids": [...], "disk_chunks": {chunk_index: slot}}}."""
        body = {"geometry": self._geometry, "num_blocks": self.pool.num_blocks, "sessions": sessions}
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
