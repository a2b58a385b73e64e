"""How much CPU a NIXL agent's own threads use while idle (Linux ``/proc``):
the progress-thread tests of both releases measure with this."""

from __future__ import annotations

import os
import time
from pathlib import Path

#: how long an idle agent is watched, seconds
IDLE_S = 1.5


def thread_ids() -> set[str]:
    return set(os.listdir("/proc/self/task"))


def threads_cpu_s(ids: set[str]) -> float:
    """CPU seconds these threads of this process used (gone ones count 0)."""
    ticks = 0
    for tid in ids:
        try:
            stat = Path(f"/proc/self/task/{tid}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()  # after the name: state is field 3
        ticks += int(fields[11]) + int(fields[12])  # utime, stime: fields 14 and 15
    return ticks / os.sysconf("SC_CLK_TCK")


def idle_cpu_share(build):
    """Cores the threads ``build()`` started used while nothing ran: only the
    new agent's threads count, not other agents earlier tests left in this
    process (they spin too). Returns the share and what ``build`` returned."""
    before = thread_ids()
    agent = build()
    started = thread_ids() - before
    time.sleep(0.3)  # past the agent's start
    cpu, wall = threads_cpu_s(started), time.monotonic()
    time.sleep(IDLE_S)
    return (threads_cpu_s(started) - cpu) / (time.monotonic() - wall), agent
