"""pytest plugin (``-p nixl_hma_upstream_env``): run vLLM's own test suite on a
CPU host. Loaded in both runs, stock and ours, before vLLM's conftest.

vLLM's ``dist_init`` fixture asks for NCCL, which a CPU build of torch lacks:
``init_distributed_environment`` is wrapped to use gloo instead. vLLM 0.34's
CPU platform refuses, in ``check_and_update_config``, an x86 host without
Triton for CPUs (its CPU model runner needs it; the suite runs no model):
the check runs with ``HAS_TRITON`` true, and nothing else sees it. The offline
model configs come through ``HF_HUB_CACHE`` (set by the runner). Each
test's outcome goes to ``$NIXL_HMA_UPSTREAM_REPORT``.

Two selections for the runner: ``$NIXL_HMA_UPSTREAM_SHARD`` = ``K/N`` keeps
the collected tests whose index is K modulo N (the runner runs ours in N
children at once), and ``$NIXL_HMA_UPSTREAM_ONLY`` names a JSON list of node
ids to run (stock runs only what did not pass on ours); every other collected
test is reported as ``not selected``, so the runner sees what was there.
"""

from __future__ import annotations

import functools
import json
import os
import sys

import vllm.distributed
import vllm.distributed.parallel_state as parallel_state

_upstream_init = parallel_state.init_distributed_environment


@functools.wraps(_upstream_init)
def init_distributed_environment(*args, **kwargs):
    if kwargs.get("backend") == "nccl":
        kwargs["backend"] = "gloo"
    return _upstream_init(*args, **kwargs)


parallel_state.init_distributed_environment = init_distributed_environment
vllm.distributed.init_distributed_environment = init_distributed_environment


def _cpu_config_check_without_triton() -> None:
    import vllm.platforms.cpu as cpu
    import vllm.triton_utils as triton_utils

    upstream_check = cpu.CpuPlatform.check_and_update_config.__func__

    def check_and_update_config(cls, vllm_config):
        had, triton_utils.HAS_TRITON = triton_utils.HAS_TRITON, True
        try:
            return upstream_check(cls, vllm_config)
        finally:
            triton_utils.HAS_TRITON = had

    cpu.CpuPlatform.check_and_update_config = classmethod(check_and_update_config)


from vllm_nixl_hma import _compat  # noqa: E402

if os.environ.get("VLLM_TARGET_DEVICE") == "cpu" and _compat.builds_on("v034"):
    _cpu_config_check_without_triton()


# Each test's outcome, by node id, for the runner (tests/upstream): JSON at
# $NIXL_HMA_UPSTREAM_REPORT. A test failed if any of its phases failed.
_outcomes: dict[str, str] = {}


def pytest_collection_modifyitems(config, items):
    shard = os.environ.get("NIXL_HMA_UPSTREAM_SHARD")
    only_path = os.environ.get("NIXL_HMA_UPSTREAM_ONLY")
    keep = list(items)
    if shard:
        index, count = (int(part) for part in shard.split("/"))
        keep = keep[index::count]
    if only_path:
        with open(only_path) as listed:
            only = set(json.load(listed))
        keep = [item for item in keep if item.nodeid in only]
        for item in items:
            if item.nodeid not in only:
                _outcomes[item.nodeid] = "not selected"
    if len(keep) != len(items):
        kept = set(map(id, keep))
        config.hook.pytest_deselected(items=[item for item in items if id(item) not in kept])
        items[:] = keep


def pytest_runtest_logreport(report):
    if report.failed:
        _outcomes[report.nodeid] = "failed"
    elif report.skipped and report.nodeid not in _outcomes:
        _outcomes[report.nodeid] = "skipped"
    elif report.when == "call" and report.passed:
        _outcomes.setdefault(report.nodeid, "passed")


def _upstream_node_id(node_id: str) -> str:
    """``node_id`` with our class names in its parameters put back to
    upstream's (the swap plugin's ``NODE_ID_NAMES``; none in the stock run)."""
    swap = sys.modules.get("nixl_hma_upstream_swap")
    if swap is None or "[" not in node_id:
        return node_id
    function, params = node_id.split("[", 1)
    for ours in sorted(swap.NODE_ID_NAMES, key=len, reverse=True):
        params = params.replace(ours, swap.NODE_ID_NAMES[ours])
    return f"{function}[{params}"


def pytest_sessionfinish(session):
    path = os.environ.get("NIXL_HMA_UPSTREAM_REPORT")
    if path:
        outcomes = {_upstream_node_id(node): outcome for node, outcome in _outcomes.items()}
        with open(path, "w") as out:
            json.dump(outcomes, out, indent=1, sort_keys=True)
