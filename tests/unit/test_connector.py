"""NixlHMAConnector as vLLM sees it: class relations, signatures, constructor state."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1 import supports_hma
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import connector as upstream_connector
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlConnector
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.worker import NixlConnectorWorker
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
)

from vllm_nixl_hma import NixlHMAConnector, NixlHMAConnectorWorker

DENSE = Path(__file__).resolve().parent.parent / "fixtures" / "tiny_dense"


def test_class_relations_vllm_relies_on():
    assert issubclass(NixlHMAConnector, NixlConnector)
    assert issubclass(NixlHMAConnector, KVConnectorBase_V1)
    assert issubclass(NixlHMAConnector, SupportsHMA)
    assert supports_hma(NixlHMAConnector)
    assert issubclass(NixlHMAConnectorWorker, NixlConnectorWorker)
    assert NixlHMAConnector.worker_cls is NixlHMAConnectorWorker


@pytest.mark.parametrize(
    "name",
    ["_logical_to_remote_kernel_block_ids", "_read_blocks", "_validate_remote_agent_handshake"],
)
def test_overrides_keep_upstream_names_and_signatures(name):
    ours = getattr(NixlHMAConnectorWorker, name)
    upstream = getattr(NixlConnectorWorker, name)
    assert ours is not upstream
    assert list(inspect.signature(ours).parameters) == list(inspect.signature(upstream).parameters)


def small_configs():
    vllm_config = VllmConfig(
        model_config=ModelConfig(model=str(DENSE), skip_tokenizer_init=True, max_model_len=1024),
        cache_config=CacheConfig(),
        device_config=DeviceConfig("cpu"),
        kv_transfer_config=KVTransferConfig(kv_connector="NixlHMAConnector", kv_role="kv_both"),
    )
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=16, dtype=torch.bfloat16)
    kv_cache_config = KVCacheConfig(
        num_blocks=8,
        kv_cache_tensors=[KVCacheTensor(size=1 << 16, shared_by=["layers.0"])],
        kv_cache_groups=[KVCacheGroupSpec(layer_names=["layers.0"], kv_cache_spec=spec)],
    )
    return vllm_config, kv_cache_config


@pytest.mark.parametrize("role", [KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER])
def test_constructor_leaves_the_same_state_as_upstream(role, mocker):
    """We do not call NixlConnector.__init__ (it hard-codes its worker); this
    catches an upstream constructor that starts setting something we miss."""
    upstream_worker = mocker.patch.object(upstream_connector, "NixlConnectorWorker")
    our_worker = mocker.patch.object(NixlHMAConnector, "worker_cls")
    vllm_config, kv_cache_config = small_configs()
    stock = NixlConnector(vllm_config, role, kv_cache_config)
    ours = NixlHMAConnector(vllm_config, role, kv_cache_config)
    # ours adds only its ticket book, on the scheduler side, and the tokens each
    # request reads (between update_state_after_alloc and build_connector_meta)
    ours_only = {"_external_tokens"} | (
        {"_tickets"} if role == KVConnectorRole.SCHEDULER else set()
    )
    assert set(vars(ours)) == set(vars(stock)) | ours_only
    if role == KVConnectorRole.WORKER:
        upstream_worker.assert_called_once()
        our_worker.assert_called_once_with(vllm_config, ours.engine_id, kv_cache_config)
        assert ours.connector_worker is our_worker.return_value
        assert ours.connector_scheduler is None
    else:
        our_worker.assert_not_called()
        assert ours.connector_worker is None
        assert ours.connector_scheduler is not None
    for name in ("engine_id", "kv_cache_config", "kv_transfer_config", "_role"):
        assert getattr(ours, name) == getattr(stock, name), name
