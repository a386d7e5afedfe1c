"""Pools: the preallocated block pool and the one K/V writer (`pool.py`), what every tier's pool declares
(`tier.py`), and the pools per tier with their room (`tier_pools.py`). Import the module you need."""
