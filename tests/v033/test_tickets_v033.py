"""Signed tickets through vLLM 0.33.0's real connector classes (#25, item 1).

Prefill's ``NixlHMAConnector`` (scheduler role) signs what it returns; the
params cross JSON; decode's takes them through upstream's
``on_new_request`` and ``update_state_after_alloc`` and our
``build_connector_meta``; its worker fails a refused request the way it
fails a transfer it declines, without a handshake or read.

Runs in the vLLM 0.33 environment (tools/env.sh v033).
"""

from __future__ import annotations

import json
import logging
import types

import pytest

from vllm_nixl_hma.core import lease, tickets

pytestmark = pytest.mark.vllm033

KEY_LINE = "k1 " + "s" * 40
DENSE_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 1,
    "vocab_size": 256,
    "max_position_embeddings": 1024,
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("dense")
    (root / "config.json").write_text(json.dumps(DENSE_CONFIG))
    return str(root)


def connector(model_dir, monkeypatch, keys: str | None):
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
    )

    from vllm_nixl_hma.harness import layout
    from vllm_nixl_hma.v033.connector import NixlHMAConnector

    vllm_config = layout.build_vllm_config(
        model_dir, 1, "NixlHMAConnector", "engine-0", "kv_both", 64, 512
    )
    extra = vllm_config.kv_transfer_config.kv_connector_extra_config
    extra.pop("ticket_keys_env", None)
    if keys is not None:
        monkeypatch.setenv("TEST_TICKET_KEYS", keys)
        extra["ticket_keys_env"] = "TEST_TICKET_KEYS"
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=16, dtype=torch.bfloat16)
    # the scheduler side reads the groups only; no tensor is allocated
    kv_cache_config = KVCacheConfig(
        num_blocks=64,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(layer_names=["layers.0"], kv_cache_spec=spec)],
    )
    return NixlHMAConnector(vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config)


def request(request_id: str, params: dict, max_tokens: int):
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    return Request(
        request_id=request_id,
        prompt_token_ids=list(range(40)),
        sampling_params=SamplingParams(
            max_tokens=max_tokens, extra_args={"kv_transfer_params": params}
        ),
        pooling_params=None,
    )


def prefill_params(prefill, request_id: str, blocks=(3, 4)) -> dict:
    from vllm.v1.request import RequestStatus

    finished = request(request_id, {"do_remote_decode": True}, max_tokens=1)
    prefill.update_state_after_alloc(finished, _blocks([]), 0)  # registers its lease
    finished.status = RequestStatus.FINISHED_LENGTH_CAPPED
    delay_free, params = prefill.request_finished_all_groups(finished, (list(blocks),))
    assert delay_free
    return json.loads(json.dumps(params))


def _blocks(ids):
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    return KVCacheBlocks(blocks=([KVCacheBlock(block_id=i) for i in ids],))


def decode_metadata(decode, params_by_request: dict[str, dict]):
    for number, (request_id, params) in enumerate(params_by_request.items()):
        arriving = request(request_id, params, max_tokens=4)
        decode.on_new_request(arriving)
        decode.update_state_after_alloc(
            arriving, _blocks([10 * (number + 1) + i for i in range(3)]), 39
        )
    # a step that schedules nothing else (what upstream reads of it)
    step = types.SimpleNamespace(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=types.SimpleNamespace(
            req_ids=[], new_block_ids=[], resumed_req_ids=set()
        ),
    )
    return decode.build_connector_meta(step)


def test_prefill_signs_over_vllms_own_lease_and_a_good_ticket_reaches_the_worker_once(
    model_dir, monkeypatch, caplog
):
    prefill = connector(model_dir, monkeypatch, KEY_LINE)
    decode = connector(model_dir, monkeypatch, KEY_LINE)
    params = prefill_params(prefill, "p-1")
    assert params[tickets.PARAM]["kid"] == "k1"
    assert params["remote_blocks_expiry_time"] is not None and lease.EXTENSION_PARAM in params
    metadata = decode_metadata(decode, {"d-1": dict(params)})
    assert list(metadata.reqs_to_recv) == ["d-1"]
    assert getattr(metadata, tickets.METADATA_ATTR) == {}
    with caplog.at_level(logging.ERROR):
        metadata = decode_metadata(decode, {"d-2": dict(params)})
    assert metadata.reqs_to_recv == {} and list(getattr(metadata, tickets.METADATA_ATTR)) == ["d-2"]
    assert "request d-2: transfer ticket refused (replayed)" in caplog.text


@pytest.mark.parametrize(
    ("fault", "reason"),
    [
        ("other-request-blocks", "forged or edited"),
        ("edited-expiry", "forged or edited"),  # vLLM's own lease field
        ("fake-prefill", "missing"),
    ],
)
def test_a_bad_ticket_is_refused_its_heartbeat_stopped_and_the_victim_read(
    model_dir, monkeypatch, caplog, fault, reason
):
    prefill = connector(model_dir, monkeypatch, KEY_LINE)
    decode = connector(model_dir, monkeypatch, KEY_LINE)
    victim = prefill_params(prefill, "p-victim", blocks=(7, 8))
    own = prefill_params(prefill, "p-own")
    bad = {
        "other-request-blocks": {**own, "remote_block_ids": victim["remote_block_ids"]},
        "edited-expiry": {
            **own,
            "remote_blocks_expiry_time": own["remote_blocks_expiry_time"] + 3600,
        },
        "fake-prefill": {
            **{k: v for k, v in own.items() if k != tickets.PARAM},
            "remote_host": "10.9.9.9",
            "remote_engine_id": "fake",
        },
    }[fault]
    with caplog.at_level(logging.ERROR):
        metadata = decode_metadata(decode, {"d-bad": bad, "d-victim": victim})
    assert list(metadata.reqs_to_recv) == ["d-victim"]
    assert list(getattr(metadata, tickets.METADATA_ATTR)) == ["d-bad"]
    assert f"request d-bad: transfer ticket refused ({reason})" in caplog.text
    heartbeats = decode.connector_scheduler._heartbeat_req_engine
    assert "d-bad" not in heartbeats and "d-victim" in heartbeats


def test_without_a_key_nothing_is_signed_and_startup_says_what_is_exposed(
    model_dir, monkeypatch, caplog
):
    with caplog.at_level(logging.WARNING):
        prefill = connector(model_dir, monkeypatch, None)
    assert "kv_transfer_params are not authenticated" in caplog.text
    params = prefill_params(prefill, "p-1")
    assert tickets.PARAM not in params
    metadata = decode_metadata(connector(model_dir, monkeypatch, None), {"d-1": params})
    assert list(metadata.reqs_to_recv) == ["d-1"]


def test_the_worker_fails_a_refused_request_without_dialing_or_reading(mocker):
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlConnectorMetadata

    from vllm_nixl_hma.v033.worker import NixlHMAConnectorWorker

    worker = object.__new__(NixlHMAConnectorWorker)
    worker._recving_metadata = {}
    worker._recv_failures = set()
    worker._failed_remote_engines = set()
    worker.xfer_stats = mocker.Mock()
    upstream_start = mocker.patch(
        "vllm_nixl_hma.v033.lease_checks.LeaseChecks.start_load_kv", autospec=True
    )
    dial = mocker.patch.object(worker, "_background_nixl_handshake", create=True)
    read = mocker.patch.object(worker, "_read_blocks_for_req", create=True)
    awaited = types.SimpleNamespace(awaiting_kvs=True, local_block_ids=([3, 4],), remote=None)
    notify_only = types.SimpleNamespace(awaiting_kvs=False, local_block_ids=([],), remote=None)
    metadata = NixlConnectorMetadata()
    setattr(metadata, tickets.METADATA_ATTR, {"req-1": awaited, "req-2": notify_only})
    worker.start_load_kv(metadata)
    assert worker._recv_failures == {"req-1"}
    assert worker._recving_metadata == {"req-1": awaited}
    assert worker._failed_remote_engines == set()  # a refusal is not the engine's failure
    worker.xfer_stats.record_failed_transfer.assert_not_called()
    dial.assert_not_called()
    read.assert_not_called()
    upstream_start.assert_called_once_with(worker, metadata)


def test_a_failing_ticket_gets_no_heartbeat_from_its_arrival_and_a_good_one_is_not_consumed(
    model_dir, monkeypatch
):
    """Upstream heartbeats the remote request a new request names as soon as
    it arrives, extending that request's lease on prefill; the look at
    arrival must not consume a good ticket (the read is decided later)."""
    prefill = connector(model_dir, monkeypatch, KEY_LINE)
    decode = connector(model_dir, monkeypatch, KEY_LINE)
    victim = prefill_params(prefill, "p-victim", blocks=(7, 8))
    own = prefill_params(prefill, "p-own")
    forged = {**own, "remote_block_ids": victim["remote_block_ids"]}
    decode.on_new_request(request("d-bad", forged, max_tokens=4))
    decode.on_new_request(request("d-good", dict(victim), max_tokens=4))
    heartbeats = decode.connector_scheduler._heartbeat_req_engine
    assert "d-bad" not in heartbeats and "d-good" in heartbeats
    assert decode._tickets.refusal(victim) is None  # still unconsumed
