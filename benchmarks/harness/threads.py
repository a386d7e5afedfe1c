"""The thread state every benchmarked system starts from.

Systems that step on a background thread run slower while another thread holds an idle OpenMP pool
(stateful_hf/engine/openmp.py), and a pool once made lives as long as its thread. So the order in which
systems run in one process would change their speed: each run starts with the main thread holding a
pool, as it does after a user loaded and warmed up a model there.
"""

from __future__ import annotations

import torch


def hold_main_pool() -> None:
    """Run a parallel op on the calling (main) thread, so that it holds an OpenMP worker pool."""
    a = torch.randn(512, 512)
    for _ in range(3):
        a @ a
