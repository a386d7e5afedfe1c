"""Tenants: whose a session is. A tenant's sessions live in their own namespace inside one store.

The store knows sessions by one string key, and the disk index records those keys as they are, so a
session's tenant travels inside its key (across restarts, and across replicas when KV migrates):

    session_key("default", "alice")  -> "alice"            (the default tenant keeps plain ids)
    session_key("acme", "alice")     -> "@acme/alice"
    session_key("default", "@x/y")   -> "@default/@x/y"    (a plain id that looks qualified is escaped)

`session_key` is the only function that composes a key and `split_key` the only one that splits it:
split_key(session_key(t, s)) == (t, s) for every valid tenant t and every session id s, and two
different (tenant, session id) pairs never give the same key. A key `session_key` did not make
(a library user's own id) splits as: "@t/rest" with a valid tenant t -> (t, rest), else (DEFAULT, key).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

DEFAULT_TENANT = "default"
_TENANT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_MARK = "@"


def check_tenant(name: str) -> str:
    """A tenant name: 1-64 of letters, digits, '.', '_', '-', starting with a letter or digit."""
    if not isinstance(name, str) or not _TENANT.fullmatch(name):
        raise ValueError(f"tenant names are 1-64 letters, digits, '.', '_' or '-' (starting with a letter or "
                         f"digit), got {name!r}")
    return name


def session_key(tenant: str, session_id: str) -> str:
    """The store's key of `tenant`'s session `session_id`."""
    check_tenant(tenant)
    if not isinstance(session_id, str) or not session_id:
        raise ValueError(f"session id must be a non-empty string, got {session_id!r}")
    if tenant == DEFAULT_TENANT and not session_id.startswith(_MARK):
        return session_id
    return f"{_MARK}{tenant}/{session_id}"


def split_key(key: str) -> tuple[str, str]:
    """(tenant, session id) of a store key; the inverse of `session_key`."""
    if key.startswith(_MARK):
        tenant, sep, rest = key[1:].partition("/")
        if sep and rest and _TENANT.fullmatch(tenant):
            return tenant, rest
    return DEFAULT_TENANT, key


def tenant_of(key: str) -> str:
    return split_key(key)[0]


@dataclass(frozen=True, slots=True)
class TenantUsage:
    """What the store holds for one tenant: sessions, history tokens (ids, kept whatever the KV's
    fate), and tokens whose KV is stored in some tier (device, host, hidden, disk; not dropped)."""

    sessions: int = 0
    history_tokens: int = 0
    stored_tokens: int = 0
