"""How long a sleeping thread on this host waits for a core (#43; not part of the suite).

A probe process, in a session of its own (so in a scheduling group of its own
where the kernel groups sessions, ``/proc/sys/kernel/sched_autogroup_enabled``),
sleeps 1 ms at a time and records every wait that ran past ``RECORD_OVER_S``.
On an idle host it wakes every 1 to 2 ms. A wait of seconds means that, for
that long, nothing on the host outside the busy programs got a core: not the
probe, and not prefill's NIXL progress thread either, which must run for a
read over UCX's TCP transport to be answered (docs/faults.md, "Slow and
stalled reads").

    python benchmarks/host_starvation.py --seconds 60     # the probe alone

``benchmarks/read_stalls.py`` runs it beside each e2e run and prints the
longest wait of each run beside its slowest read.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

#: waits shorter than this are not recorded (an idle host wakes a 1 ms sleeper in 1-2 ms)
RECORD_OVER_S = 0.1

_PROBE = """
import sys, time
out = open(sys.argv[1], "a", buffering=1)
last = time.time()
while True:
    time.sleep(0.001)
    now = time.time()
    if now - last > {record_over_s}:
        out.write(f"{{now:.3f}} {{now - last:.3f}}\\n")
    last = now
"""


class StarvationProbe:
    """The probe process, started on entry and stopped on exit; ``longest(t0, t1)``
    is the longest wait that ended between two ``time.time()`` stamps."""

    def __init__(self, path: Path | None = None):
        self.path = path or Path(tempfile.mkstemp(prefix="host-starvation-", suffix=".txt")[1])
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> StarvationProbe:
        code = _PROBE.format(record_over_s=RECORD_OVER_S)
        self.process = subprocess.Popen(
            [sys.executable, "-c", code, str(self.path)], start_new_session=True
        )
        return self

    def __exit__(self, *exc) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(timeout=10)

    def waits(self) -> list[tuple[float, float]]:
        """(ended_at, seconds) of every recorded wait."""
        rows = []
        for line in self.path.read_text().splitlines():
            ended_at, seconds = line.split()
            rows.append((float(ended_at), float(seconds)))
        return rows

    def longest(self, start: float, end: float) -> float | None:
        inside = [s for t, s in self.waits() if start <= t <= end + 1.0]
        return round(max(inside), 3) if inside else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    args = parser.parse_args(argv)
    start = time.time()
    with StarvationProbe() as probe:
        time.sleep(args.seconds)
    waits = probe.waits()
    print(
        f"{len(waits)} waits over {RECORD_OVER_S} s in {args.seconds:.0f} s; "
        f"longest {probe.longest(start, time.time())} s"
    )
    os.unlink(probe.path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
