"""Prefix sharing: full chunks of a prefix identical across sessions (same tenant and `cache_salt`)
held once, found by a chained content key and verified id by id. Part of the core, not an optional
feature: it is on by default (`prefix_sharing=None`: wherever the layout allows it), so these
modules run on every turn; `prefix_sharing=False` turns the index off but the part stays.
"""

from .index import PrefixEntry, PrefixIndex, PrefixKeys, PrefixScope, xxh3_128
from .sharing import PrefixSharing

__all__ = ["PrefixEntry", "PrefixIndex", "PrefixKeys", "PrefixScope", "PrefixSharing", "xxh3_128"]
