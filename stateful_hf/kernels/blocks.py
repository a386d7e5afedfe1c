"""`blocks_for`: how many blocks of `block_size` tokens hold `tokens` tokens, the paged layout's one ceiling
division (a chunk of a session is one block: the store, the engine and the kernels count with it)."""

from __future__ import annotations


def blocks_for(tokens: int, block_size: int) -> int:
    """ceil(tokens / block_size) for tokens >= 0 and block_size >= 1: the blocks (chunks) `tokens` tokens fill."""
    assert tokens >= 0 and block_size >= 1, (tokens, block_size)
    return -(-tokens // block_size)
