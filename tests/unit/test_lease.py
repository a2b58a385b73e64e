"""The prefill lease: pure rule, and how the connector carries it (issue #4)."""

from __future__ import annotations

import time

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlConnector
from vllm.sampling_params import SamplingParams
from vllm.v1.request import Request, RequestStatus

from tests.unit.test_connector import small_configs
from vllm_nixl_hma import NixlHMAConnector
from vllm_nixl_hma.core import lease
from vllm_nixl_hma.v021.lease_checks import LEASE_DEADLINES_ATTR


@pytest.mark.parametrize(
    ("deadline", "now", "margin", "expected"),
    [
        (100.0, 90.0, 5.0, False),
        (100.0, 95.0, 5.0, False),  # exactly at the margin: still in time
        (100.0, 95.1, 5.0, True),
        (100.0, 130.0, 0.0, True),
        (None, 1e12, 5.0, False),  # a prefill without a lease
    ],
)
def test_expired(deadline, now, margin, expected):
    assert lease.expired(deadline, now, margin) is expected


def finished_prefill_request(request_id: str) -> Request:
    request = Request(
        request_id=request_id,
        prompt_token_ids=[1, 2, 3],
        sampling_params=SamplingParams(
            max_tokens=1, extra_args={"kv_transfer_params": {"do_remote_decode": True}}
        ),
        pooling_params=None,
    )
    request.status = RequestStatus.FINISHED_LENGTH_CAPPED
    return request


@pytest.mark.parametrize("connector_cls", [NixlHMAConnector, NixlConnector])
def test_prefill_puts_its_lease_end_into_kv_transfer_params(connector_cls):
    connector = connector_cls(*_scheduler_role_args())
    before = time.time()
    delay_free, params = connector.request_finished_all_groups(
        finished_prefill_request("r1"), ([3, 4],)
    )
    assert delay_free
    if connector_cls is NixlHMAConnector:
        # vLLM's default VLLM_NIXL_ABORT_REQUEST_TIMEOUT is 480 s
        assert before + 480 <= params[lease.PARAM] <= time.time() + 480
    else:
        assert lease.PARAM not in params


def test_decode_scheduler_hands_lease_ends_to_its_workers():
    connector = NixlHMAConnector(*_scheduler_role_args())
    request = finished_prefill_request("r2")
    request.kv_transfer_params = {
        "remote_block_ids": [[1]],
        "remote_engine_id": "prefill",
        "remote_request_id": "p-r2",
        "remote_host": "127.0.0.1",
        "remote_port": 5600,
        lease.PARAM: 1234.5,
    }
    connector.connector_scheduler._reqs_need_recv["r2"] = (request, ([7],))
    metadata = connector.build_connector_meta(None)
    assert "r2" in metadata.reqs_to_recv
    assert getattr(metadata, LEASE_DEADLINES_ATTR) == {"r2": 1234.5}


def _scheduler_role_args():
    vllm_config, kv_cache_config = small_configs()
    return vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config
