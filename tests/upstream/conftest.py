"""Prints what vLLM's own suite did on stock and on ours, after the run."""

from __future__ import annotations


def pytest_terminal_summary(terminalreporter):
    from tests.upstream.test_upstream_suite import SUMMARY

    for line in SUMMARY:
        terminalreporter.write_line(line)
