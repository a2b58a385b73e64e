"""Fuzzing the decode side's handshake validation with malformed payloads.

Every payload goes through the worker's real ``_validated_agent_metadata``
(vllm_nixl_hma's phased parsing plus vLLM's own NixlAgentMetadata decoder):
it must be accepted, or refused with a HandshakeError that names a field.
Anything else (another exception type, a hang) is a failure. Under the "ci"
hypothesis profile each test runs 1000 payloads.
"""

from __future__ import annotations

import time

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlAgentMetadata

from tests.unit.test_handshake import record
from vllm_nixl_hma.core import handshake
from vllm_nixl_hma.v021.worker import NixlHMAConnectorWorker

ENGINE = "prefill-engine"
HASH = "c0ffee"
PER_PAYLOAD_SECONDS = 2.0


def valid_agent_fields() -> dict:
    return {
        "engine_id": ENGINE,
        "agent_metadata": b"nixl-agent-blob",
        "kv_caches_base_addr": [1 << 20, 2 << 20],
        "device_id": 0,
        "num_blocks": 256 * 5,
        "block_lens": [4096, 4096],
        "kv_cache_layout": "HND",
        "block_size": 16,
        "ssm_sizes": (1536, 8192),
        "attn_backend_name": "FLASHINFER",
        "physical_blocks_per_logical_kv_block": 5,
    }


def valid_outer() -> dict:
    return {
        "compatibility_hash": HASH,
        "agent_metadata_bytes": msgspec.msgpack.encode(valid_agent_fields()),
        handshake.PAYLOAD_FIELD: handshake.encode_record(record()),
    }


@pytest.fixture(scope="module")
def worker():
    w = object.__new__(NixlHMAConnectorWorker)
    w.compat_hash = HASH
    w.enforce_compat_hash = True
    w._handshake_record = record()
    return w


def judge(worker, payload_bytes: bytes) -> str:
    started = time.perf_counter()
    try:
        meta = worker._validated_agent_metadata(payload_bytes, ENGINE, 1)
    except handshake.HandshakeError as e:
        assert e.field, "a refusal must name the field"
        outcome = "refused"
    else:
        assert isinstance(meta, NixlAgentMetadata)
        assert meta.num_blocks > 0 and len(meta.block_lens) == len(meta.kv_caches_base_addr)
        outcome = "accepted"
    assert time.perf_counter() - started < PER_PAYLOAD_SECONDS
    return outcome


def test_the_valid_payload_is_accepted(worker):
    assert judge(worker, msgspec.msgpack.encode(valid_outer())) == "accepted"


def stock_payload(compatibility_hash: str = HASH, **agent_overrides) -> bytes:
    """What stock NixlConnector sends: vLLM's two fields, no record."""
    agent = {**valid_agent_fields(), **agent_overrides}
    return msgspec.msgpack.encode(
        {
            "compatibility_hash": compatibility_hash,
            "agent_metadata_bytes": msgspec.msgpack.encode(agent),
        }
    )


def test_a_stock_peer_whose_metadata_is_enough_is_served(worker):
    meta = worker._validated_agent_metadata(stock_payload(), ENGINE, 1)
    assert meta.engine_id == ENGINE and meta.block_lens == [4096, 4096]


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ({"physical_blocks_per_logical_kv_block": 4, "num_blocks": 256 * 4}, "physical_blocks"),
        ({"block_size": 32}, "block_size"),
        ({"kv_cache_layout": "NHD"}, "kv_cache_layout"),
        ({"block_lens": [4096]}, "block_lens"),
    ],
)
def test_a_stock_peer_is_refused_where_its_metadata_is_not_enough(worker, override, field):
    with pytest.raises(handshake.HandshakeError) as info:
        worker._validated_agent_metadata(stock_payload(**override), ENGINE, 1)
    assert info.value.field.startswith(field)


@pytest.mark.parametrize("with_record", [True, False], ids=["our peer", "stock peer"])
def test_upstreams_compatibility_check_comes_first_and_its_escape_hatch_works(worker, with_record):
    outer = valid_outer() if with_record else msgspec.msgpack.decode(stock_payload())
    outer["compatibility_hash"] = "another-model"
    payload_bytes = msgspec.msgpack.encode(outer)
    with pytest.raises(RuntimeError, match="compatibility hash mismatch") as info:
        worker._validated_agent_metadata(payload_bytes, ENGINE, 1)
    assert isinstance(info.value, handshake.CompatibilityHashMismatch)
    assert f"Local: {HASH}, Remote: another-model" in str(info.value)
    worker.enforce_compat_hash = False
    try:
        assert worker._validated_agent_metadata(payload_bytes, ENGINE, 1).engine_id == ENGINE
    finally:
        worker.enforce_compat_hash = True


anything = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(min_value=-(2**63), max_value=2**64 - 1),
        st.floats(allow_nan=True),
        st.text(max_size=20),
        st.binary(max_size=40),
    ),
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=8), children, max_size=5)
    ),
    max_leaves=20,
)


@settings(max_examples=1000)
@given(raw=st.binary(max_size=2048))
def test_random_bytes_are_refused_cleanly(worker, raw):
    assert judge(worker, raw) == "refused"


@st.composite
def mutated_payloads(draw) -> bytes:
    outer = valid_outer()
    agent = valid_agent_fields()
    rec = msgspec.to_builtins(record())
    target = draw(st.sampled_from(["agent", "record", "outer", "truncate", "flip"]))
    if target == "agent":
        key = draw(st.sampled_from(sorted(agent)))
        if draw(st.booleans()):
            agent[key] = draw(anything)
        else:
            del agent[key]
        outer["agent_metadata_bytes"] = msgspec.msgpack.encode(agent)
    elif target == "record":
        key = draw(st.sampled_from(sorted(rec)))
        if draw(st.booleans()):
            rec[key] = draw(anything)
        else:
            del rec[key]
        outer[handshake.PAYLOAD_FIELD] = msgspec.msgpack.encode(rec)
    elif target == "outer":
        key = draw(st.sampled_from(sorted(outer)))
        if draw(st.booleans()):
            outer[key] = draw(anything)
        else:
            del outer[key]
    encoded = msgspec.msgpack.encode(outer)
    if target == "truncate":
        encoded = encoded[: draw(st.integers(0, len(encoded) - 1))]
    elif target == "flip":
        position = draw(st.integers(0, len(encoded) - 1))
        encoded = (
            encoded[:position]
            + bytes([encoded[position] ^ draw(st.integers(1, 255))])
            + encoded[position + 1 :]
        )
    return encoded


@settings(max_examples=1000)
@given(payload_bytes=mutated_payloads())
def test_mutated_payloads_are_accepted_or_refused_naming_a_field(worker, payload_bytes):
    judge(worker, payload_bytes)
