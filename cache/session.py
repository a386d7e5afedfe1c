"""A session (one conversation): its token ids and its chunk table."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field


class ChunkState(enum.Enum):
    DEVICE = "device"    # KV in a block of the device pool
    DROPPED = "dropped"  # only the token ids remain; recomputed when needed


@dataclass(slots=True)
class Chunk:
    """`block_size` consecutive tokens of a session; its KV lives in exactly one place."""

    state: ChunkState = ChunkState.DROPPED
    block: int | None = None    # device block id when state is DEVICE, else None


@dataclass(slots=True)
class TurnStats:
    """What the last turn of a session cost."""

    reused_tokens: int = 0       # history tokens whose KV was served from the cache
    computed_tokens: int = 0     # tokens the model ran on (prompt tail + generated, minus the last)
    recomputed_tokens: int = 0   # history tokens recomputed because their KV had been dropped
    generated_tokens: int = 0
    truncated_tokens: int = 0    # history tokens cut because the new prompt diverged from them


@dataclass(slots=True)
class Session:
    """Invariant: len(chunks) == ceil(len(token_ids) / block_size); chunk k holds the KV of
    token_ids[k * block_size : (k + 1) * block_size]. `token_ids` is the raw history whose KV
    (present or dropped) the session stands for; it is what makes recomputation possible."""

    session_id: str
    token_ids: list[int] = field(default_factory=list)
    chunks: list[Chunk] = field(default_factory=list)
    last_active: float = field(default_factory=time.monotonic)
    busy: bool = False
    last_turn: TurnStats = field(default_factory=TurnStats)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def chunk_range(self, k: int, block_size: int) -> range:
        return range(k * block_size, min((k + 1) * block_size, len(self.token_ids)))

    def tokens_in(self, state: ChunkState, block_size: int) -> int:
        return sum(len(self.chunk_range(k, block_size)) for k, c in enumerate(self.chunks) if c.state is state)
