"""Signed tickets through vLLM 0.21.0's real connector classes (#25, item 1).

Prefill's ``NixlHMAConnector`` (scheduler role) signs what it returns; the
params cross JSON as they cross HTTP; decode's ``NixlHMAConnector`` takes
them through upstream's ``update_state_after_alloc`` and our
``build_connector_meta``; its worker (real ``NixlHMAConnectorWorker``
methods, a fake NIXL agent) fails each refused request without a handshake.
e2e (``-ticket`` fault cells) proves the same through real engines.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import queue

import pytest
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlConnectorMetadata
from vllm.sampling_params import SamplingParams
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.request import Request, RequestStatus

from tests.reference import FULL, MAMBA
from tests.unit.test_connector import small_configs
from tests.unit.test_worker_failures import request_meta, worker_for
from vllm_nixl_hma import NixlHMAConnector
from vllm_nixl_hma.core import lease, tickets

KEY_LINE_1 = "k1 " + "s" * 40
KEY_LINE_2 = "k2 " + "t" * 40


def connector(monkeypatch, keys: str | None, **extra) -> NixlHMAConnector:
    extra_config = dict(extra)
    if keys is not None:
        monkeypatch.setenv("TEST_TICKET_KEYS", keys)
        extra_config["ticket_keys_env"] = "TEST_TICKET_KEYS"
    vllm_config, kv_cache_config = small_configs()
    vllm_config.kv_transfer_config = KVTransferConfig(
        kv_connector="NixlHMAConnector",
        kv_role="kv_both",
        kv_connector_extra_config=extra_config,
    )
    return NixlHMAConnector(vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config)


def prefill_params(prefill: NixlHMAConnector, request_id: str, blocks=(3, 4)) -> dict:
    """What prefill's engine answers, after a trip through JSON (as over HTTP)."""
    request = Request(
        request_id=request_id,
        prompt_token_ids=list(range(40)),
        sampling_params=SamplingParams(
            max_tokens=1, extra_args={"kv_transfer_params": {"do_remote_decode": True}}
        ),
        pooling_params=None,
    )
    request.status = RequestStatus.FINISHED_LENGTH_CAPPED
    delay_free, params = prefill.request_finished_all_groups(request, (list(blocks),))
    assert delay_free
    return json.loads(json.dumps(params))


def decode_metadata(
    decode: NixlHMAConnector, params_by_request: dict[str, dict], external_tokens: int = 40
):
    """Decode's connector metadata after upstream's ``update_state_after_alloc``
    took each request (three local blocks each; none with ``external_tokens``
    0, as for vLLM's notify-only copy of a request)."""
    for number, (request_id, params) in enumerate(params_by_request.items()):
        request = Request(
            request_id=request_id,
            prompt_token_ids=list(range(40)),
            sampling_params=SamplingParams(max_tokens=4, extra_args={"kv_transfer_params": params}),
            pooling_params=None,
        )
        blocks = KVCacheBlocks(
            blocks=([KVCacheBlock(block_id=10 * (number + 1) + i) for i in range(3)],)
        )
        decode.update_state_after_alloc(request, blocks, num_external_tokens=external_tokens)
    return decode.build_connector_meta(None)


def refused_of(metadata) -> dict:
    return getattr(metadata, tickets.METADATA_ATTR)


def test_a_ticket_prefill_signed_is_honoured_once_then_refused_as_replayed(monkeypatch, caplog):
    prefill, decode = connector(monkeypatch, KEY_LINE_1), connector(monkeypatch, KEY_LINE_1)
    params = prefill_params(prefill, "p-1")
    assert params[tickets.PARAM]["kid"] == "k1" and lease.PARAM in params
    metadata = decode_metadata(decode, {"d-1": dict(params)})
    assert list(metadata.reqs_to_recv) == ["d-1"] and refused_of(metadata) == {}
    with caplog.at_level(logging.ERROR):
        metadata = decode_metadata(decode, {"d-2": dict(params)})
    assert metadata.reqs_to_recv == {} and list(refused_of(metadata)) == ["d-2"]
    assert "request d-2: transfer ticket refused (replayed)" in caplog.text


def test_a_notify_only_copy_may_reuse_its_consumed_ticket_and_a_forged_one_is_dropped(
    monkeypatch,
):
    """After an error answer vLLM's serving layer sends a copy of the request
    with no block to read, only so that prefill frees its blocks: it carries
    the params the read consumed, and must notify; a forged one notifies no
    one."""
    prefill, decode = connector(monkeypatch, KEY_LINE_1), connector(monkeypatch, KEY_LINE_1)
    params = prefill_params(prefill, "p-1")
    assert list(decode_metadata(decode, {"d-1": dict(params)}).reqs_to_recv) == ["d-1"]
    metadata = decode_metadata(decode, {"d-1-copy": dict(params)}, external_tokens=0)
    assert list(metadata.reqs_to_recv) == ["d-1-copy"] and refused_of(metadata) == {}
    forged = {**params, "remote_host": "10.9.9.9"}
    metadata = decode_metadata(decode, {"d-2-copy": forged}, external_tokens=0)
    assert metadata.reqs_to_recv == {} and list(refused_of(metadata)) == ["d-2-copy"]


def edited(params: dict, **fields) -> dict:
    return {**params, **fields}


@pytest.mark.parametrize(
    ("fault", "reason"),
    [
        # another in-flight request's blocks under this request's ticket
        ("other-request-blocks", "forged or edited"),
        ("edited-port", "forged or edited"),
        ("edited-tp-size", "forged or edited"),
        ("added-field", "forged or edited"),
        ("fake-prefill-no-ticket", "missing"),
        ("fake-prefill-made-up-ticket", "unknown key"),
        ("another-keys-ticket", "unknown key"),
        ("expired", "expired"),
        ("malformed", "malformed"),
    ],
)
def test_each_bad_ticket_is_refused_for_its_reason_and_the_good_one_beside_it_is_not(
    monkeypatch, caplog, fault, reason
):
    prefill, decode = connector(monkeypatch, KEY_LINE_1), connector(monkeypatch, KEY_LINE_1)
    victim = prefill_params(prefill, "p-victim", blocks=(7, 8))
    own = prefill_params(prefill, "p-own", blocks=(3, 4))
    bad = {
        "other-request-blocks": edited(own, remote_block_ids=victim["remote_block_ids"]),
        "edited-port": edited(own, remote_port=own["remote_port"] + 1),
        "edited-tp-size": edited(own, tp_size=2),
        "added-field": edited(own, remote_dp_rank=1),
        "fake-prefill-no-ticket": {
            k: v for k, v in edited(own, remote_host="10.9.9.9").items() if k != tickets.PARAM
        },
        "fake-prefill-made-up-ticket": edited(
            own,
            remote_host="10.9.9.9",
            **{tickets.PARAM: {"v": 1, "kid": "mine", "exp": 4e9, "mac": "00" * 32}},
        ),
        "another-keys-ticket": prefill_params(
            connector(monkeypatch, KEY_LINE_2), "p-other", blocks=(3, 4)
        ),
        "expired": tickets.sign(
            {k: v for k, v in own.items() if k != tickets.PARAM},
            tickets.parse_keys(KEY_LINE_1, "test"),
            expires_at=1.0,
        ),
        "malformed": edited(own, **{tickets.PARAM: "not an object"}),
    }[fault]
    with caplog.at_level(logging.ERROR):
        metadata = decode_metadata(decode, {"d-bad": bad, "d-victim": victim})
    assert list(metadata.reqs_to_recv) == ["d-victim"]
    refused = refused_of(metadata)
    assert list(refused) == ["d-bad"]
    assert list(map(list, refused["d-bad"].local_block_ids)) == [[10, 11, 12]]  # to fail
    assert f"request d-bad: transfer ticket refused ({reason})" in caplog.text
    assert "s" * 40 not in caplog.text  # the secret never


def test_a_key_being_rotated_in_verifies_old_tickets_and_signs_new_ones(monkeypatch):
    """Rotation: every engine gets the new key second, then first; prefill and
    decode may be a step apart and nothing is refused."""
    old_prefill = connector(monkeypatch, KEY_LINE_1)
    new_prefill = connector(monkeypatch, f"{KEY_LINE_2}\n{KEY_LINE_1}")
    decode = connector(monkeypatch, f"{KEY_LINE_1}\n{KEY_LINE_2}")
    old, new = prefill_params(old_prefill, "p-1"), prefill_params(new_prefill, "p-2")
    assert (old[tickets.PARAM]["kid"], new[tickets.PARAM]["kid"]) == ("k1", "k2")
    metadata = decode_metadata(decode, {"d-1": old, "d-2": new})
    assert sorted(metadata.reqs_to_recv) == ["d-1", "d-2"] and refused_of(metadata) == {}


def test_without_a_key_nothing_is_signed_or_checked_and_startup_says_what_is_exposed(
    monkeypatch, caplog
):
    with caplog.at_level(logging.WARNING):
        prefill = connector(monkeypatch, None)
    assert "kv_transfer_params are not authenticated" in caplog.text
    params = prefill_params(prefill, "p-1")
    assert tickets.PARAM not in params
    metadata = decode_metadata(connector(monkeypatch, None), {"d-1": params})
    assert list(metadata.reqs_to_recv) == ["d-1"] and refused_of(metadata) == {}


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"ticket_keys_env": "NOT_SET_ANYWHERE"}, "ticket_keys_env names $NOT_SET_ANYWHERE"),
        ({"ticket_keys_file": "/nonexistent/keys"}, "ticket_keys_file '/nonexistent/keys'"),
        ({"ticket_ttl_s": 0}, "ticket_ttl_s=0"),
        ({"ticket_ttl_s": "60"}, "ticket_ttl_s='60'"),
    ],
)
def test_a_bad_ticket_setting_stops_startup_naming_it(monkeypatch, extra, message):
    monkeypatch.delenv("NOT_SET_ANYWHERE", raising=False)
    with pytest.raises(ValueError, match=message.replace("$", r"\$")):
        connector(monkeypatch, None, **extra)


def test_a_short_secret_stops_startup_without_quoting_it(monkeypatch):
    with pytest.raises(ValueError) as refused:
        connector(monkeypatch, "k1 tooshortsecret")
    assert "tooshortsecret" not in str(refused.value)


def stepping_worker(mocker, kinds, hma):
    """``worker_for``'s worker with the rest of the state upstream's
    ``start_load_kv`` and ``get_finished`` step through."""
    worker = worker_for(mocker, kinds, hma)
    worker._ready_requests = queue.Queue()
    worker._reqs_to_process = set()
    worker._reqs_to_send = {}
    return worker


@pytest.mark.parametrize(
    ("kinds", "hma", "local_block_ids"),
    [
        ([FULL], False, [[3, 4, 5]]),
        ([FULL, MAMBA], True, [[3, 4, 5], [11]]),
    ],
)
@pytest.mark.parametrize("engine_id", ["prefill-engine", "an-engine-decode-never-met"])
def test_the_worker_fails_a_refused_request_without_dialing_and_reports_every_block(
    mocker, kinds, hma, local_block_ids, engine_id
):
    """A refused request names a registered engine (a forged ticket for a real
    prefill) or one decode never met (a fake prefill): either way no
    handshake, no read, every local block reported invalid, the request
    reported done once, and nothing left behind."""
    worker = stepping_worker(mocker, kinds, hma)
    dial = mocker.patch.object(worker, "_background_nixl_handshake")
    read = mocker.patch.object(worker, "_read_blocks")
    metadata = NixlConnectorMetadata()
    metadata.vllm_nixl_hma_lease_deadlines = {}
    setattr(metadata, tickets.METADATA_ATTR, {"req-1": request_meta(local_block_ids, engine_id)})
    worker.start_load_kv(metadata)
    dial.assert_not_called()
    read.assert_not_called()
    worker.nixl_wrapper.make_prepped_xfer.assert_not_called()
    mocker.patch.object(worker, "_get_new_notifs", return_value=set())
    _, done_recving = worker.get_finished()
    assert done_recving == {"req-1"}
    assert worker._invalid_block_ids == {b for g in local_block_ids for b in g}
    assert worker._recving_metadata == {} and worker._refused_by_ticket == set()
    assert worker.get_finished()[1] == set()


def test_a_refused_notify_only_request_is_dropped_without_notifying_anyone(mocker):
    worker = stepping_worker(mocker, [FULL], False)
    dial = mocker.patch.object(worker, "_background_nixl_handshake")
    metadata = NixlConnectorMetadata()
    setattr(metadata, tickets.METADATA_ATTR, {"req-1": request_meta([])})
    metadata.vllm_nixl_hma_lease_deadlines = {}
    worker.start_load_kv(metadata)
    mocker.patch.object(worker, "_get_new_notifs", return_value=set())
    assert worker.get_finished()[1] == set()
    dial.assert_not_called()
    worker.nixl_wrapper.send_notif.assert_not_called()
    assert worker._recving_metadata == {} and worker._refused_by_ticket == set()


def test_the_metadata_attribute_survives_pickling_to_the_workers():
    """vLLM's multiprocessing executor pickles the metadata to each worker."""
    import pickle

    metadata = NixlConnectorMetadata()
    setattr(metadata, tickets.METADATA_ATTR, {"req-1": request_meta([[3]])})
    copy = pickle.loads(pickle.dumps(metadata))
    meta = getattr(copy, tickets.METADATA_ATTR)["req-1"]
    assert dataclasses.asdict(meta) == dataclasses.asdict(request_meta([[3]]))
