"""The glue fails loudly when vLLM's internals drift (#22).

On the installed release: every method the glue's worker and connector
define that upstream also defines is in the release's ``Contract`` (so a new
override cannot go unlisted), every listed name exists upstream, and taking
one listed name away from upstream stops the worker, connector or scheduler
at startup with ``UpstreamDriftError`` naming it (before #22: the override of
a method upstream no longer calls was dead code, and ``getattr`` defaults
turned checks off). Runs in the vLLM 0.21.0 and the 0.33 environment.
"""

from __future__ import annotations

import gc

import pytest

from vllm_nixl_hma import _compat
from vllm_nixl_hma.core import upstream_contract
from vllm_nixl_hma.core.errors import UpstreamDriftError

ADAPTER = _compat.adapter()
CONTRACT = upstream_contract.V021 if ADAPTER == "v021" else upstream_contract.V033


def glue():
    """(our worker, upstream worker, our connector, upstream connector)."""
    if ADAPTER == "v021":
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlConnector
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.worker import (
            NixlConnectorWorker,
        )

        from vllm_nixl_hma.v021.connector import NixlHMAConnector
        from vllm_nixl_hma.v021.worker import NixlHMAConnectorWorker

        return NixlHMAConnectorWorker, NixlConnectorWorker, NixlHMAConnector, NixlConnector
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlPullConnector
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import (
        NixlPullConnectorWorker,
    )

    from vllm_nixl_hma.v033.connector import NixlHMAConnector
    from vllm_nixl_hma.v033.worker import NixlHMAConnectorWorker

    return NixlHMAConnectorWorker, NixlPullConnectorWorker, NixlHMAConnector, NixlPullConnector


def overrides(ours: type, upstream: type) -> set[str]:
    """Methods our classes (the worker and the mixins it is made of) define
    that upstream's class has too."""
    own = [cls for cls in ours.__mro__ if cls.__module__.startswith("vllm_nixl_hma.")]
    return {
        name
        for cls in own
        for name, value in vars(cls).items()
        if (callable(value) or isinstance(value, classmethod))
        and name != "__init__"
        and hasattr(upstream, name)
    }


def test_every_override_is_in_the_contract():
    ours, upstream, our_connector, upstream_connector = glue()
    assert overrides(ours, upstream) == set(CONTRACT.worker_overrides)
    assert overrides(our_connector, upstream_connector) == set(CONTRACT.connector_overrides)


def test_every_listed_name_exists_on_the_installed_release():
    _, upstream, _, upstream_connector = glue()
    for name in CONTRACT.worker_overrides + CONTRACT.worker_calls:
        assert callable(getattr(upstream, name)), name
    for name in CONTRACT.connector_overrides:
        assert callable(getattr(upstream_connector, name)), name


def test_require_names_every_missing_name_and_both_releases():
    class Upstream:
        present = 1

    with pytest.raises(UpstreamDriftError) as refusal:
        upstream_contract.require(
            Upstream, ["present", "_gone", "_also_gone"], owner_name="Upstream", release="9.9.9"
        )
    message = str(refusal.value)
    assert refusal.value.missing == ["_gone", "_also_gone"]
    assert "glue for vLLM 9.9.9 relies on Upstream._gone" in message
    assert f"installed vLLM {_compat.installed_vllm_version()}" in message
    assert "missing: _gone, _also_gone" in message
    upstream_contract.require(Upstream, ["present"], owner_name="Upstream", release="9.9.9")


@pytest.mark.parametrize("name", CONTRACT.worker_overrides[:3] + CONTRACT.worker_calls[:1])
def test_a_method_gone_upstream_stops_the_worker_before_it_starts(monkeypatch, name):
    ours, upstream, _, _ = glue()
    owners = [cls for cls in upstream.__mro__ if name in vars(cls)]
    assert owners, name
    for owner in owners:  # gone upstream: from the class and every base that has it
        monkeypatch.delattr(owner, name)
    constructed = []
    monkeypatch.setattr(
        upstream, "__init__", lambda self, *args, **kwargs: constructed.append(self)
    )
    monkeypatch.setattr(ours, "shutdown", lambda self: None)  # the half-built worker's __del__
    with pytest.raises(UpstreamDriftError, match=name):
        ours(None, "engine", None)
    assert constructed == []  # refused before upstream's constructor ran
    gc.collect()  # while shutdown is still the no-op


@pytest.mark.parametrize("name", CONTRACT.worker_state[:2] + CONTRACT.worker_state[-1:])
def test_state_upstream_no_longer_sets_stops_the_worker(monkeypatch, name):
    ours, upstream, _, _ = glue()

    def upstream_init(self, *args, **kwargs):
        for state in CONTRACT.worker_state:
            if state != name:
                setattr(self, state, None)

    monkeypatch.setattr(upstream, "__init__", upstream_init)
    if ADAPTER == "v021":
        from vllm_nixl_hma.v021 import worker as worker_module

        monkeypatch.setattr(worker_module.read_threads, "split_batch_size_from", lambda _: 32)
    vllm_config = type("Config", (), {"kv_transfer_config": None})()
    monkeypatch.setattr(ours, "shutdown", lambda self: None)  # the half-built worker's __del__
    with pytest.raises(UpstreamDriftError, match=f"after its constructor.*{name}"):
        ours(vllm_config, "engine", None)
    gc.collect()  # while shutdown is still the no-op


def test_a_connector_method_gone_upstream_stops_the_connector(monkeypatch):
    _, _, our_connector, upstream_connector = glue()
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    name = CONTRACT.connector_overrides[0]
    # upstream's implementation goes; the abstract interface's method stays
    for cls in upstream_connector.__mro__:
        if cls is not KVConnectorBase_V1 and name in vars(cls):
            monkeypatch.delattr(cls, name)
    assert hasattr(upstream_connector, name)
    with pytest.raises(UpstreamDriftError, match=name):
        our_connector(None, None, None)


if ADAPTER == "v021":  # our schedulers are vLLM 0.21.0 glue (0.33 needs none)

    def test_a_scheduler_method_gone_upstream_stops_our_scheduler(monkeypatch):
        from vllm.v1.core.sched.scheduler import Scheduler

        from vllm_nixl_hma.v021.scheduler import NixlHMAScheduler

        monkeypatch.delattr(Scheduler, "_update_requests_with_invalid_blocks")
        with pytest.raises(UpstreamDriftError, match="_update_requests_with_invalid_blocks"):
            NixlHMAScheduler()
