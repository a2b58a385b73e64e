"""The glue fails loudly when vLLM's internals drift (#22).

On the installed release: every method the glue's worker and connector
define that upstream also defines is in the release's ``Contract`` (so a new
override cannot go unlisted), every listed name exists upstream, and taking
one listed name away from upstream stops the worker, connector or scheduler
at startup with ``UpstreamDriftError`` naming it (before #22: the override of
a method upstream no longer calls was dead code, and ``getattr`` defaults
turned checks off). And the parameters: each listed method's, read from
the installed vLLM, is the one recorded for the tested release (what the
glue's overrides were written against), and a changed one stops startup
naming it; on vLLM 0.34.0 the 0.33 glue's contract names both signatures
0.34.0 changed. Runs in the vLLM 0.21.0, 0.33 and 0.34 environments.
"""

from __future__ import annotations

import gc
import importlib

import pytest

from vllm_nixl_hma import _compat
from vllm_nixl_hma.core import signatures, upstream_contract
from vllm_nixl_hma.core.errors import UpstreamDriftError

ADAPTER = _compat.adapter()
CONTRACT = upstream_contract.installed()


def upstream_class(dotted: str) -> type:
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


def glue():
    """(our worker, upstream worker, our connector, upstream connector)."""
    ours = importlib.import_module(_compat.glue_module(ADAPTER, "connector"))
    return (
        ours.NixlHMAConnectorWorker,
        upstream_class(CONTRACT.worker_class),
        ours.NixlHMAConnector,
        upstream_class(CONTRACT.connector_class),
    )


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


def test_the_recorded_signatures_are_the_installed_releases():
    """``vllm_nixl_hma/snapshots`` was read from each release's source by
    ``vllm-nixl-hma drift --record``; startup compares them with the live
    classes (``inspect``), so the two readings must agree for every name."""
    owners = {"worker": CONTRACT.worker_class, "connector": CONTRACT.connector_class}
    owners["listener"] = CONTRACT.listener_class
    if CONTRACT.scheduler_class:
        owners["scheduler"] = CONTRACT.scheduler_class
    assert CONTRACT.snapshot["release"] == _compat.TESTED[ADAPTER]
    checked = 0
    for owner, path in owners.items():
        cls = upstream_class(path)
        for name, recorded in CONTRACT.snapshot["owners"][owner]["methods"].items():
            assert recorded is not None, (owner, name)
            assert signatures.of_function(getattr(cls, name)) == recorded["signature"], name
            checked += 1
    assert checked >= len(CONTRACT.worker_overrides) + len(CONTRACT.connector_overrides)
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import metadata

    assert metadata.NIXL_CONNECTOR_VERSION == CONTRACT.snapshot["wire_version"]


def test_our_overrides_take_the_parameters_upstream_passes():
    """Each override of ours accepts what upstream's method accepts: the same
    parameters, or a ``*args, **kwargs`` pass-through."""
    ours, upstream, our_connector, upstream_connector = glue()
    for mine, theirs, names in (
        (ours, upstream, CONTRACT.worker_overrides),
        (our_connector, upstream_connector, CONTRACT.connector_overrides),
    ):
        for name in names:
            found = signatures.of_function(getattr(mine, name))
            if "*" in found and "**" in found:
                continue
            assert found == signatures.of_function(getattr(theirs, name)), name


def test_a_changed_signature_stops_the_worker_naming_it(monkeypatch):
    """An upstream method of the contract that takes one more parameter (as
    vLLM 0.34.0's ``_build_mamba_remote`` did) stops the worker before
    upstream's constructor runs, naming both parameter lists."""
    ours, upstream, _, _ = glue()
    name = "_build_mamba_remote"
    original = getattr(upstream, name)

    def changed(self, nixl_agent_meta, tp_ratio, transfer_info, pairs, extra=None):
        return original(self, nixl_agent_meta, tp_ratio, transfer_info)

    monkeypatch.setattr(upstream, name, changed)
    constructed = []
    monkeypatch.setattr(
        upstream, "__init__", lambda self, *args, **kwargs: constructed.append(self)
    )
    monkeypatch.setattr(ours, "shutdown", lambda self: None)
    with pytest.raises(UpstreamDriftError) as refusal:
        ours(None, "engine", None)
    assert refusal.value.changed[0][0] == name
    assert "extra=)" in str(refusal.value) and CONTRACT.signature_of("worker", name) in str(
        refusal.value
    )
    assert constructed == []
    gc.collect()


def test_another_wire_version_stops_the_worker(monkeypatch):
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import metadata

    expected = CONTRACT.snapshot["wire_version"]
    monkeypatch.setattr(metadata, "NIXL_CONNECTOR_VERSION", expected + 1)
    with pytest.raises(UpstreamDriftError, match=f"NIXL_CONNECTOR_VERSION = {expected}"):
        CONTRACT.require_wire_version()


@pytest.mark.skipif(ADAPTER != "v034", reason="vLLM 0.34.0 only: the 0.33 glue pointed at it")
def test_the_033_contract_on_034_names_both_changed_signatures():
    """The port's first finding, at startup: vLLM 0.34.0 added
    ``local_region_ids`` to ``_validate_remote_agent_handshake`` and ``pairs``
    to ``_build_mamba_remote``; the 0.33 glue's overrides would raise
    ``TypeError`` on the first handshake. Its contract refuses to start."""
    _, upstream, _, _ = glue()
    with pytest.raises(UpstreamDriftError) as refusal:
        upstream_contract.V033.require_worker_class(upstream)
    assert [c[0] for c in refusal.value.changed] == [
        "_build_mamba_remote",
        "_validate_remote_agent_handshake",
    ]
    assert "transfer_info, pairs)" in str(refusal.value)
    with pytest.raises(UpstreamDriftError, match="NIXL_CONNECTOR_VERSION = 15"):
        upstream_contract.V033.require_wire_version()
