"""How loaded the machine was around a benchmark: absolute times on a shared machine are noisy, so each table says
what the cores carried (the 1-minute load average) when it started and when it ended."""

from __future__ import annotations

import os


class MachineLoad:
    """The load average when made; `line()` adds the one at the end."""

    def __init__(self) -> None:
        self.at_start = os.getloadavg()[0]

    def line(self) -> str:
        at_end = os.getloadavg()[0]
        return f"load average (1 min): {self.at_start:.2f} at the start, {at_end:.2f} at the end (compare ratios)"
