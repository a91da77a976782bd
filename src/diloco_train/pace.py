"""A worker's simulated speed (``train.speeds``) and the compute it spends: heterogeneous workers on one machine.

A worker of speed s < 1 waits (1/s - 1) times each step's compute after its backward pass, as a device 1/s times
slower would still be computing: four workers of speeds 1, 1, 0.5 and 0.25 fit on a 2-core machine, the slow
ones' waits leaving the cores to the others. Its busy time is its steps' compute plus those waits (a slow
device is busy all the while); what it waits for at a round's reduce is not. Goodput is the workers' busy
time over workers x wall time (``Pace.goodput``): 1 when no worker ever waits for another.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

__all__ = ["Pace", "speed_of"]


def speed_of(speeds: Sequence[float], shard: int) -> float:
    """The speed of the worker of data shard ``shard`` (its rank where ranks are fixed): ``speeds`` cycled; 1
    where empty."""
    return float(speeds[shard % len(speeds)]) if speeds else 1.0


class Pace:
    """One worker's speed and busy seconds."""

    def __init__(self, speed: float = 1.0) -> None:
        if not 0 < speed <= 1:
            raise ValueError(f"speed={speed!r} is invalid: expected a number in (0, 1]")
        self.speed = speed
        self.busy = 0.0
        """Seconds of compute so far: the steps' own (their wall time less the reduces they waited for), the
        simulated slowness included."""

    def slow_down(self, compute: float) -> None:
        """After a step's ``compute`` seconds (forward and backward): wait as a slower device would compute."""
        if self.speed < 1:
            time.sleep(compute * (1 / self.speed - 1))

    def count(self, seconds: float) -> None:
        """A step's busy seconds (``slow_down``'s wait included)."""
        self.busy += max(0.0, seconds)

    @staticmethod
    def goodput(busy: Sequence[float], wall: float) -> float:
        """The workers' ``busy`` seconds over their number times ``wall`` seconds (0 without a wall)."""
        return sum(busy) / (len(busy) * wall) if busy and wall > 0 else 0.0
