"""The disk tier: chunks' KV (and, with hidden states, their hidden states) kept in memory-mapped
files under `disk_dir`, listed in a SQLite index committed in crash order, so a restarted store
finds its sessions again; every chunk is proven by checksum before it is read. A feature: it exists
only when the store is given a `disk_dir` (then `store.tiers.disk` is a `DiskTier` and `store.disk_state` a
`DiskState`); without one both are None and no module here runs.
"""

from .directory import DiskDirectory, saved_hidden_layers
from .file import DiskFile, identity_tags
from .index import DiskIndex
from .pool import DiskHiddenPool, DiskPool
from .state import DiskState
from .tier import DiskTier

__all__ = ["DiskDirectory", "DiskFile", "DiskHiddenPool", "DiskIndex", "DiskPool", "DiskState", "DiskTier",
           "identity_tags", "saved_hidden_layers"]
