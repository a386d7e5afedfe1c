"""The disk tier's directory: its lock, its index's header, and which data file of each form is current.

Owns: the directory (created if missing, probed for writing), its `lock` file (one store per
directory, held for the store's life), the `DiskIndex` (`index.sqlite`, opened here, header checked
against the KV geometry, the format and the model's fingerprint) and the data files
(`kv.<gen>.bin`, `hidden.<gen>.bin`: `files`, one `DiskFile` per form). It may mutate: the files on
disk (creating, relocating, deleting leftovers) and the index's header and rows only while a data
file is switched (`_switch`: relocation keeps the rows, a new file forgets that form's rows). The
running tier (`disk/tier.py`'s `DiskTier`) writes rows and checksums; this part is done once a file is
open.

Relocation (a different `disk_capacity` at open): the chunks are copied into a new file of the new
size, which is flushed, then one index transaction switches to it, then the old file is deleted
(files not named by the index are leftovers of a crash and are deleted at open: `remove_leftovers`).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import sqlite3
from pathlib import Path

from ..errors import StoreError
from ..spec import KVSpec
from . import index
from .file import DiskFile
from .index import FORMAT, DiskIndex, read_meta

_DATA_FILE = re.compile(r"(kv|hidden)\.\d+\.bin")


def _geometry(spec: KVSpec) -> dict:
    return {"num_layers": spec.num_layers, "num_kv_heads": spec.num_kv_heads, "head_dim": spec.head_dim,
            "block_size": spec.block_size, "dtype": str(spec.dtype).removeprefix("torch.")}


class DiskDirectory:
    """Opens (or creates) the tier's directory for `spec` and the model `fingerprint`, with its KV
    file of `num_blocks` slots (`kv`; relocated if the saved file has another size). Raises
    StoreError, leaving nothing behind that it created, when the directory cannot be used."""

    def __init__(self, spec: KVSpec, directory: str | os.PathLike, num_blocks: int, fingerprint: str = ""):
        self.path, self.spec, self.fingerprint = Path(directory), spec, fingerprint
        self.files: dict[str, DiskFile] = {}     # form ("kv", "hidden") -> its current data file
        self.index: DiskIndex | None = None
        self._lock_file, self._locked = None, False
        created = self._make_dir()
        fresh = not (self.path / "index.sqlite").exists()
        try:
            self._lock()
            if fresh and (self.path / "index.json").exists():
                raise StoreError(f"disk tier {str(self.path)!r} holds a tier of an older format (index.json); "
                                 "use another disk_dir or delete it")
            self.index = DiskIndex(self.path / "index.sqlite")
            self._check_header()
            self.kv = self.open_file("kv", self._kv_shapes, num_blocks, {})
        except BaseException:
            locked = self._locked
            self.close()
            if fresh and locked:          # what this call created, never another store's files
                for name in ("index.sqlite", "index.sqlite-wal", "index.sqlite-shm", "lock"):
                    (self.path / name).unlink(missing_ok=True)
                for d in reversed(created):
                    with contextlib.suppress(OSError):
                        d.rmdir()
            raise

    def _make_dir(self) -> list[Path]:
        if self.path.exists() and not self.path.is_dir():
            raise StoreError(f"disk tier directory {str(self.path)!r} is not writable: it is a file, not a directory")
        created = [p for p in [self.path, *self.path.parents] if not p.exists()][::-1]
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            probe = self.path / ".write-probe"
            probe.touch()
            probe.unlink()
        except OSError as e:
            for d in reversed(created):
                with contextlib.suppress(OSError):
                    d.rmdir()
            raise StoreError(f"disk tier directory {str(self.path)!r} is not writable: {e}") from e
        return created

    def _lock(self) -> None:
        try:
            self._lock_file = open(self.path / "lock", "a+")   # noqa: SIM115 (held for the store's life)
        except OSError as e:
            raise StoreError(f"disk tier directory {str(self.path)!r} is not writable: {e}") from e
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            self._lock_file.close()
            self._lock_file = None
            raise StoreError(f"disk tier {str(self.path)!r} is in use by another store") from e
        self._locked = True

    def _check_header(self) -> None:
        meta, where = self.index.meta, repr(str(self.path))
        header = {"format": FORMAT, "geometry": json.dumps(_geometry(self.spec), sort_keys=True),
                  "model": self.fingerprint}
        if "format" not in meta and not self.index.digests:    # never finished creating: a new tier
            try:
                self.index.commit(header, {}, {})
            except (OSError, sqlite3.Error) as e:
                raise StoreError(f"cannot create the disk tier index in {where}: {e}") from e
            return
        if meta.get("format") != FORMAT:
            raise StoreError(f"disk tier {where} holds format {meta.get('format')!r}, this version reads "
                             f"{FORMAT!r}; use another disk_dir")
        try:
            saved = json.loads(meta["geometry"])
        except (KeyError, ValueError) as e:
            raise StoreError(f"disk tier {where}: its index header is damaged ({e!r}); use another disk_dir") from e
        if saved != _geometry(self.spec):
            raise StoreError(f"disk tier {where} holds KV of another geometry {saved}, this model needs "
                             f"{_geometry(self.spec)}; use another disk_dir")
        if meta.get("model") != self.fingerprint:
            raise StoreError(f"disk tier {where} was made for another model (fingerprint {meta.get('model')!r}, "
                             f"this one is {self.fingerprint!r}): its KV would be wrong here; use another disk_dir")

    def _kv_shapes(self, n: int) -> list[tuple[int, ...]]:
        s = self.spec
        return [(s.num_layers, n, 2, s.block_size, s.num_kv_heads, s.head_dim)]

    def open_file(self, form: str, shapes_of, slots: int, extra: dict[str, str]) -> DiskFile:
        """The data file of `form` with `slots` slots: the saved one if it matches, relocated if only
        its slot count differs, else a new one (the index then forgets that form's chunks)."""
        meta = self.index.meta
        name = meta.get(f"{form}.file")
        if name is not None and _DATA_FILE.fullmatch(name) and all(meta.get(k) == v for k, v in extra.items()):
            try:
                old_slots = int(meta[f"{form}.slots"])
            except (KeyError, ValueError) as e:
                raise StoreError(f"disk tier {str(self.path)!r}: its index header is damaged ({e!r})") from e
            old = DiskFile(self.path / name, shapes_of(old_slots), self.spec.dtype, create=False)
            if old_slots == slots:
                self.files[form] = old
                return old
            return self._relocate(form, old, shapes_of, slots, extra)
        new = self._new_file(form, shapes_of(slots))
        rows = {key: r for key, r in self.index.read()[1].items() if r[0] != form}
        self._switch(form, new, extra, rows, old=self.path / name if name and _DATA_FILE.fullmatch(name) else None)
        return new

    def _new_file(self, form: str, shapes) -> DiskFile:
        gen = int(self.index.meta.get("generation", "0")) + 1
        return DiskFile(self.path / f"{form}.{gen}.bin", shapes, self.spec.dtype, create=True)

    def _switch(self, form: str, new: DiskFile, extra: dict[str, str], rows: dict, old: Path | None) -> None:
        """Make `new` the file of `form` in one index transaction (it is flushed first), then delete `old`."""
        try:
            new.flush()
            _fsync_dir(self.path)
            index.durability_point("relocate-copied")
            gen = new.path.name.split(".")[1]
            self.index.commit({f"{form}.file": new.path.name, f"{form}.slots": str(new.slots), "generation": gen,
                               **extra}, self.index.read()[0], rows)
        except (OSError, sqlite3.Error) as e:
            new.close()
            new.path.unlink(missing_ok=True)
            raise StoreError(f"cannot set up the disk tier file {str(new.path)!r}: {e}") from e
        index.durability_point("relocate-committed")
        self.files[form] = new
        if old is not None and old != new.path:
            old.unlink(missing_ok=True)

    def _relocate(self, form: str, old: DiskFile, shapes_of, slots: int, extra: dict[str, str]) -> DiskFile:
        """Copy the chunks of `form` into a new file of `slots` slots, each old slot once (rows of
        sessions sharing a chunk name one slot: they name one new slot). When they do not all fit,
        the ones of lowest value go: the lowest chunk indices (Cost(l) of recomputing grows with the
        position; the index keeps no idle times)."""
        named: dict[int, int] = {}                 # old slot -> its highest chunk index
        saved = self.index.read()[1]
        for (_, k), r in saved.items():
            if r[0] == form and 0 <= r[1] < old.slots:
                named[r[1]] = max(named.get(r[1], k), k)
        keep = sorted(named, key=lambda slot: (-named[slot], slot))[:slots]
        new_slot = {slot: i for i, slot in enumerate(keep)}
        try:
            new = self._new_file(form, shapes_of(slots))
        except StoreError:
            old.close()
            raise
        new.copy_from(old, keep, list(range(len(keep))))
        rows = {key: r for key, r in saved.items() if r[0] != form}
        rows.update({key: (form, new_slot[r[1]], r[2]) for key, r in saved.items()
                     if r[0] == form and r[1] in new_slot})
        old.close()
        self._switch(form, new, extra, rows, old=old.path)
        return new

    def remove_leftovers(self) -> None:
        named = {self.index.meta.get("kv.file"), self.index.meta.get("hidden.file")}
        for p in self.path.iterdir():
            if _DATA_FILE.fullmatch(p.name) and p.name not in named:
                p.unlink(missing_ok=True)

    def close(self) -> None:
        """Close the data files and the index and release the directory's lock (the caller unmapped
        every pool over the files first)."""
        for f in self.files.values():
            f.close()
        if self.index is not None:
            self.index.close()
            self.index = None
        if self._lock_file is not None and not self._lock_file.closed:
            fcntl.flock(self._lock_file, fcntl.LOCK_UN)
            self._lock_file.close()
        self._locked = False


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def saved_hidden_layers(directory: str | os.PathLike) -> int | None:
    """The hidden split (layers kept as hidden states) recorded in the index of `directory`, if
    any: a restarted store that keeps this split can use its hidden chunks."""
    meta, hidden_chunks = read_meta(Path(directory))
    geometry = meta.get("hidden.geometry")
    if not hidden_chunks:
        return None
    try:
        return int(json.loads(geometry)["hidden_layers"]) if geometry else None
    except (ValueError, KeyError, TypeError):
        return None
