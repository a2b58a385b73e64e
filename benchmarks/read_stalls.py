"""Stalled KV reads over UCX TCP, counted over repeated e2e runs (#43; not part of the suite).

    $(bash tools/env.sh cpu)/bin/python benchmarks/read_stalls.py \
        [--model hybrid|dense|...] [--prefill-tp 2] [--decode-tp 1] [--runs 20] \
        [--faults] [--prefix-caching] [--router proxy|vllm-router] \
        [--env NAME=VALUE ...] [--json out.json]

Runs ``e2e --separate-hosts`` (``e2e.run.run_e2e``: every engine on a host of
its own: network namespaces on 10 Gbit/s links, UCX over TCP on the data
network, as between hosts without RDMA) ``--runs`` times in a row, each a
fresh set of engines, and prints one row per run: whether every prompt
matched the one-engine reference, how many reads decode's engines made, the
slowest read (decode's per-request records: ``read_s``, the request's
wall-clock wait for its KV from the first read posted to the step that saw
it end), how many reads took longer than ``--stall-s`` (2 s by default) and
how many were abandoned at ``read_timeout_s``. A read of this
test's prompts moves at most a few MB, milliseconds on this link: one over
``--stall-s`` is a stall, not a slow link. ``host_wait_s`` is the longest
a 1 ms sleeper elsewhere on the host waited for a core during the run
(``host_starvation.py``): a stalled read beside a wait as long is the host's
CPU starved, not the network.

``--env NAME=VALUE`` adds to every engine's environment (the e2e engines
inherit this process's environment), for experiments on UCX's settings such
as ``UCX_ADAPTIVE_PROGRESS=y``; the plugin's own defaults apply otherwise.
Root is needed (network namespaces). The machine's two cores run one e2e at
a time: nothing else heavy should run beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from host_starvation import StarvationProbe  # noqa: E402

#: a read of these prompts moves a few MB at most; longer than this is a stall
DEFAULT_STALL_S = 2.0
COLUMNS = (
    "run",
    "ok",
    "prompts",
    "reads",
    "slowest_s",
    "over",
    "timeouts",
    "host_wait_s",
    "wall_s",
)


def parse_env(pairs: list[str]) -> dict[str, str]:
    env = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise SystemExit(f"--env {pair!r}: expected NAME=VALUE")
        env[name] = value
    return env


def summarize(report: dict, stall_s: float) -> dict:
    """One run's row from its e2e report."""
    reads = [read for engine in (report.get("reads") or {}).values() for read in engine]
    # the request's wall-clock wait for its KV (NIXL's summed time where a record has none)
    times = [
        t
        for t in (r["read_s"] if r.get("read_s") is not None else r["transfer_s"] for r in reads)
        if isinstance(t, (int, float))
    ]
    prompts = [*report.get("prompts", []), *report.get("turns", [])]
    matched = sum(1 for p in prompts if p.get("match") and p.get("http_status") == 200)
    return {
        "ok": bool(report.get("ok")),
        "prompts": f"{matched}/{len(prompts)}",
        "reads": len(reads),
        "slowest_s": round(max(times), 3) if times else None,
        "over": sum(1 for t in times if t > stall_s),
        "timeouts": sum(1 for r in reads if r.get("reason") == "timeout"),
        "error": report.get("error"),
    }


def e2e_options(args):
    from vllm_nixl_hma.e2e import faults
    from vllm_nixl_hma.e2e.run import E2EOptions

    return E2EOptions(
        model=args.model,
        p_tp=args.prefill_tp,
        d_tp=args.decode_tp,
        router=args.router,
        separate_hosts=True,
        # CI's cells: the network faults (a link down, a host gone) stall
        # reads on purpose, so they are left out of a count of stalls
        faults=faults.FAULTS if args.faults else (),
        prefix_caching=args.prefix_caching,
    )


def run_once(args, log_dir: Path, index: int, probe: StarvationProbe) -> dict:
    from vllm_nixl_hma.e2e.run import run_e2e

    workdir = log_dir / f"run-{index}"
    workdir.mkdir()
    started, started_at = time.monotonic(), time.time()
    with open(workdir / "progress.log", "w", buffering=1) as progress:
        try:
            report = run_e2e(e2e_options(args), workdir, lambda line: print(line, file=progress))
        except Exception as e:  # one broken run is a row, not the end of the loop
            report = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    (workdir / "report.json").write_text(json.dumps(report, indent=1))
    row = {"run": index, **summarize(report, args.stall_s)}
    row["wall_s"] = round(time.monotonic() - started, 1)
    # the longest a 1 ms sleeper elsewhere on the host waited for a core meanwhile
    row["host_wait_s"] = probe.longest(started_at, time.time())
    row["slowest"] = (report.get("slowest_reads") or [])[:3]
    row["logs"] = str(workdir)
    return row


def render(rows: list[dict]) -> str:
    lines = ["  ".join(f"{c:>10}" for c in COLUMNS)]
    for row in rows:
        lines.append("  ".join(f"{str(row.get(c, '')):>10}" for c in COLUMNS))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="hybrid")
    parser.add_argument("--prefill-tp", type=int, default=2)
    parser.add_argument("--decode-tp", type=int, default=1)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--router", default="proxy", choices=("proxy", "vllm-router"))
    parser.add_argument("--faults", action="store_true")
    parser.add_argument("--prefix-caching", action="store_true")
    parser.add_argument("--stall-s", type=float, default=DEFAULT_STALL_S)
    parser.add_argument("--run-timeout-s", type=float, default=1800.0)
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args(argv)
    env = parse_env(args.env)
    # stopped with SIGTERM, the run's engines and namespaces are still removed
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    os.environ.update(env)  # the engines inherit this process's environment
    log_dir = Path(tempfile.mkdtemp(prefix="read-stalls-"))
    print(f"e2e: {e2e_options(args)}; env {env or 'as is'}; logs {log_dir}", file=sys.stderr)
    rows = []
    probe = StarvationProbe(log_dir / "host-waits.txt")
    with probe:
        for index in range(1, args.runs + 1):
            rows.append(run_once(args, log_dir, index, probe))
            print(render(rows[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
            if args.json:
                arguments = {**vars(args), "json": str(args.json)}
                args.json.write_text(json.dumps({"env": env, "args": arguments, "rows": rows}))
    print(render(rows))
    stalled = [r for r in rows if r.get("over") or r.get("timeouts")]
    slowest = max((r["slowest_s"] for r in rows if r.get("slowest_s") is not None), default=None)
    print(
        f"{len(rows)} runs: {sum(r['ok'] for r in rows)} ok, {len(stalled)} with a read over "
        f"{args.stall_s} s or abandoned; slowest read {slowest} s"
    )
    return 0 if not stalled and all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
