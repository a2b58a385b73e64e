"""``vllm-nixl-hma``: command-line entry point.

Imports nothing heavy until a subcommand runs, so ``--help`` is instant.
Exit codes are ``ExitCode``.
"""

from __future__ import annotations

import argparse
import enum
import sys
from collections.abc import Sequence

from vllm_nixl_hma import __version__


class ExitCode(enum.IntEnum):
    OK = 0  #: every scenario passed
    MISMATCHES = 1  #: at least one scenario had mismatched slots or failed
    INTERRUPTED = 2  #: Ctrl-C
    INTERNAL_ERROR = 3  #: a bug in the check itself
    USAGE_ERROR = 4  #: bad command-line arguments
    NOTHING_RAN = 5  #: no scenario could run


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vllm-nixl-hma",
        description="NIXL P/D KV connector for hybrid models under vLLM's HMA.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    subcommands = parser.add_subparsers(dest="command", required=True)
    subcommands.add_parser(
        "check",
        help="move real KV bytes between prefill and decode engines and verify every slot",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return ExitCode.OK if e.code == 0 else ExitCode.USAGE_ERROR
    if args.command == "check":
        print(
            "vllm-nixl-hma check: not implemented yet; the multi-process NIXL "
            "oracle lands with the next release (issue #3). Nothing was checked.",
            file=sys.stderr,
        )
        return ExitCode.NOTHING_RAN
    return ExitCode.USAGE_ERROR
