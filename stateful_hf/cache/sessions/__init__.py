"""Sessions and their indexes: `Session` / `Chunk` / `ChunkState` and the session table (`session.py`), its per-tier
orders and token counts (`tier_index.py`), expected turns (`expectations.py`), histories as callers edit them
(`history.py`) and tenants inside session keys (`tenant.py`). Import the module you need."""
