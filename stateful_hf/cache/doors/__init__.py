"""The store's doors: one `Protocol` per consumer, with what that consumer needs of the store and no more, each
method saying what it reads and what it changes. A consumer imports its door, never the store's parts.

- `engine.py`: `EngineStore`, the engine's (scheduler, admission, runner, layer offload, warm-ups, hints).
- `seam.py`: `SeamStore`, the transformers seam's (a stateful `generate`, a restore, `StatefulCache`).
"""
