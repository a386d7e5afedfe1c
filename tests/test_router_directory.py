"""The router's session -> replica directory (stateful_hf/serve/directory.py): kept in SQLite, so that a
restarted router sends every returning turn to the replica holding the session, without asking the
replicas (the negative control: a router without it asks them) and without moving any KV; every turn
equals stateless generate."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("fastapi")

from test_serve_cluster import _stateless, _turn  # noqa: E402

from stateful_hf.serve import LocalClient, Replica, Router  # noqa: E402
from stateful_hf.serve.directory import SessionDirectory  # noqa: E402
from stateful_hf.serve.server import EngineOptions  # noqa: E402
from stateful_hf.testing import tiny_llama, tiny_tokenizer  # noqa: E402

SESSIONS = [f"s{i}" for i in range(12)]


class CountingClient(LocalClient):
    """A replica's client that counts the router's questions about where sessions are."""

    def __init__(self, replica):
        super().__init__(replica)
        self.asked = 0

    async def session_tokens(self, session_id) -> int:
        self.asked += 1
        return await super().session_tokens(session_id)


def ids_of(i: int, turn: int) -> list[int]:
    return [5 + (7 * i + 3 * j + turn) % 250 for j in range(20 + 4 * turn)]


def test_a_restarted_router_sends_every_returning_turn_to_its_holder(tmp_path):
    tok, oracle = tiny_tokenizer(), tiny_llama()
    replicas = [Replica(EngineOptions(device_capacity=4096).build(tiny_llama(), tok), name=f"r{i}") for i in range(2)]
    clients = [CountingClient(r) for r in replicas]
    path = tmp_path / "router.sqlite"

    async def turns(router: Router, turn: int) -> None:
        for i, sid in enumerate(SESSIONS):
            ids = ids_of(i, 0) + ([] if turn == 0 else ids_of(i, turn))
            done = await _turn(router, sid, ids, n=3)
            assert done["token_ids"] == _stateless(oracle, ids, 3), sid

    first = Router(clients, directory=SessionDirectory(path, 2))
    asyncio.run(turns(first, 0))
    where = dict(first.location)
    assert sorted(where) == sorted(SESSIONS) and set(where.values()) == {0, 1}     # spread over both replicas
    first.location.close()

    restarted = Router(clients, directory=SessionDirectory(path, 2))
    assert dict(restarted.location) == where                             # read back before any request
    for c in clients:
        c.asked = 0
    asyncio.run(turns(restarted, 1))
    assert sum(c.asked for c in clients) == 0                            # nobody was asked where a session is
    assert dict(restarted.location) == where and restarted.stats["migrations"] == 0
    for i, r in enumerate(replicas):                                     # each turn ran where its KV was
        assert sorted(r.store.session_ids()) == sorted(s for s, at in where.items() if at == i)
        r.store.check_integrity()

    forgetful = Router(clients)                                          # negative control: no directory
    asyncio.run(turns(forgetful, 2))
    assert sum(c.asked for c in clients) > 0 and dict(forgetful.location) == where
    for r in replicas:
        r.shutdown()


def test_directory_rows_survive_reopening_and_stale_replicas_are_ignored(tmp_path):
    path = tmp_path / "dir.sqlite"
    d = SessionDirectory(path, 3)
    for i in range(10_000):
        d[f"@t{i}/c"] = i % 3
    del d["@t5/c"]
    d["@t6/c"] = 1
    d.close()
    again = SessionDirectory(path, 3)
    assert len(again) == 9_999 and "@t5/c" not in again and again["@t6/c"] == 1 and again["@t7/c"] == 1
    fewer = SessionDirectory(path, 2)                   # a replica gone: its rows are not trusted
    assert len(fewer) == sum(1 for i in range(10_000) if i != 5 and (i % 3 < 2 or i == 6))
    assert SessionDirectory().get("x") is None          # in memory only
