"""The store's doors: one `Protocol` per consumer, with what that consumer needs of the store and no more, each
method saying what it reads and what it changes. A consumer imports its door, never the store's parts.

- `engine.py`: `EngineStore`, the engine's (scheduler, admission, runner, layer offload, warm-ups, hints).
- `seam.py`: `SeamStore`, the transformers seam's (a stateful `generate`, a restore, `StatefulCache`).
- `server.py`: `ServerStore`, the server's (`serve/replica.py`, `serve/metrics.py`): usage, residency, deletes,
  statistics, the move ledger, the shutdown's flush; a migration's export and import besides.
- `migration.py`: `MigrationStore`, KV migration's (`serve/migrate.py`): a session out of one store, into another.
- `demo.py`: `DemoStore`, the chat demo's (`demo/backend.py`): prefix match, residency, statistics, delete.
"""
