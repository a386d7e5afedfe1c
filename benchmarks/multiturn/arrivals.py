"""When turns arrive: Poisson conversation starts (Pensieve) or a fixed number of users (Symphony).

Open loop (`rate` conversations/s): conversation i starts at the i-th event of a Poisson process.
Closed loop (`users` > 0): that many users each run conversations one after another, starting at 0.
Either way, a conversation's next turn is sent only after the previous answer is complete plus the
user's think time, drawn exponential with mean `think_s`. All draws are seeded and made once, so
every system sees the same schedule.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

from .workload import Workload


@dataclass(frozen=True, slots=True)
class Arrivals:
    rate: float = 0.0          # conversations per second (open loop); 0 with users > 0
    think_s: float = 0.0       # mean think time (exponential); 0 = next turn as soon as the answer ends
    users: int = 0             # closed loop: concurrent users (0 = open loop)
    seed: int = 0

    def describe(self) -> dict:
        mode = f"closed loop, {self.users} users" if self.users else f"Poisson, {self.rate:g} conversations/s"
        return {"mode": mode, "rate_conv_s": self.rate, "users": self.users, "think_time_mean_s": self.think_s}


def schedule(wl: Workload, arr: Arrivals) -> Workload:
    """The workload with start times (open loop) and think times set."""
    if arr.users <= 0 and arr.rate <= 0:
        raise ValueError("give a positive --rate (open loop) or --users (closed loop)")
    rng = random.Random(arr.seed + 7919)
    t, convs = 0.0, []
    for c in wl.conversations:
        if arr.users <= 0:
            t += rng.expovariate(arr.rate) if convs else 0.0
        turns = tuple(replace(turn, think_s=rng.expovariate(1 / arr.think_s) if arr.think_s > 0 else 0.0)
                      for turn in c.turns)
        convs.append(replace(c, turns=turns, start_s=t if arr.users <= 0 else 0.0))
    return replace(wl, conversations=tuple(convs))
