"""The closed loop every `bench_engine` system runs: one thread per session sending its turns back to
back (think time 0, or the workload's `think_before` pause), each turn's prompt the conversation so far
plus the workload's next user tokens."""
from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager


def closed_loop(wl, turn: Callable[[int, int, list[int]], list[int]],
                around: AbstractContextManager | None = None) -> tuple[float, dict[tuple[int, int], list[int]]]:
    """(wall seconds, generated ids by (session, turn)) of `wl` (bench_engine's Workload), where
    `turn(session, t, prompt ids)` answers one turn; the clock starts before `around` is entered (an
    engine's start counts) and stops after it exits. The first error of any session is raised."""
    outputs: dict[tuple[int, int], list[int]] = {}
    errors: list[BaseException] = []

    def user(s: int) -> None:
        conv: list[int] = []
        try:
            for t in range(wl.turns):
                if (pause := wl.think_before(s, t)) > 0:
                    time.sleep(pause)
                ids = conv + wl.user_tokens(s, t)
                outputs[(s, t)] = turn(s, t, ids)
                conv = ids + outputs[(s, t)]
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=user, args=(s,)) for s in range(wl.sessions)]
    start = time.perf_counter()
    with around if around is not None else contextlib.nullcontext():
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    wall = time.perf_counter() - start
    if errors:
        raise errors[0]
    return wall, outputs
