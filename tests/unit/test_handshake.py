"""The handshake record (vllm_nixl_hma.core.handshake): parsing, validation, refusals."""

from __future__ import annotations

import msgspec
import pytest

from vllm_nixl_hma.core import handshake
from vllm_nixl_hma.core.blocks import GroupKind
from vllm_nixl_hma.core.errors import IncompatibleRemoteError
from vllm_nixl_hma.core.handshake import GroupRecord, HandshakeError, MalformedHandshakeError

RATIO = 5


def record(**overrides) -> handshake.HandshakeRecord:
    fields = {
        "protocol": handshake.PROTOCOL,
        "version": handshake.RECORD_VERSION,
        "plugin_version": "0.1.0",
        "groups": [GroupRecord("mamba", 1), GroupRecord("full_attention", RATIO)],
        "kernel_block_tokens": 16,
        "logical_block_tokens": 16 * RATIO,
        "regions_mamba": [True, True],
        "kv_cache_layout": "HND",
        "kv_cache_dtype": "torch.bfloat16",
        "mamba_state_dtypes": ["torch.bfloat16", "torch.bfloat16"],
        "mamba_conv_state_layout": "DS",
        "prefix_caching": False,
        "mamba_cache_mode": "none",
        "tp_size": 1,
    }
    fields.update(overrides)
    return handshake.HandshakeRecord(**fields)


def payload(rec: object = None, **outer) -> bytes:
    fields = {"compatibility_hash": "abc", "agent_metadata_bytes": b"meta"}
    if rec is not None:
        fields[handshake.PAYLOAD_FIELD] = (
            handshake.encode_record(rec) if isinstance(rec, handshake.HandshakeRecord) else rec
        )
    fields.update(outer)
    return msgspec.msgpack.encode(fields)


def test_round_trip():
    parsed = handshake.parse_payload(payload(record()))
    assert parsed.record == record()
    assert (parsed.compatibility_hash, parsed.agent_metadata_bytes) == ("abc", b"meta")


def test_a_stock_payload_parses_to_vllms_fields_and_no_record():
    parsed = handshake.parse_payload(payload(None))
    assert parsed.record is None
    assert (parsed.compatibility_hash, parsed.agent_metadata_bytes) == ("abc", b"meta")


def test_a_compatibility_hash_mismatch_says_what_upstream_says():
    error = handshake.CompatibilityHashMismatch("local-hash", "remote-hash")
    assert isinstance(error, HandshakeError) and isinstance(error, RuntimeError)
    assert str(error).startswith(
        "NIXL compatibility hash mismatch. Local: local-hash, Remote: remote-hash."
    )
    assert '"enforce_handshake_compat": false' in str(error)
    assert (error.field, error.local, error.remote) == (
        "compatibility_hash",
        "local-hash",
        "remote-hash",
    )


def stock_facts(**overrides):
    facts = {
        "remote_tp_size": 2,
        "block_size": 16,
        "physical_blocks_per_logical": RATIO,
        "kv_cache_layout": "HND",
    }
    facts.update(overrides)
    return facts


def test_a_stock_peer_whose_metadata_fixes_every_byte_gets_the_local_record():
    remote = handshake.record_for_stock_peer(record(), **stock_facts())
    assert remote == record(plugin_version="stock", tp_size=2)
    handshake.validate_remote(record(), remote)


@pytest.mark.parametrize(
    ("override", "field", "local", "remote"),
    [
        ({"physical_blocks_per_logical": 9}, "physical_blocks_per_logical_kv_block", RATIO, 9),
        ({"block_size": 32}, "block_size (kernel block tokens)", 16, 32),
        ({"kv_cache_layout": "NHD"}, "kv_cache_layout", "HND", "NHD"),
    ],
)
def test_a_stock_peer_is_refused_where_its_metadata_is_not_enough(override, field, local, remote):
    with pytest.raises(HandshakeError, match="runs stock NixlConnector") as info:
        handshake.record_for_stock_peer(record(), **stock_facts(**override))
    assert (info.value.field, info.value.local, info.value.remote) == (field, local, remote)
    assert f"local={local!r}, remote={remote!r}" in str(info.value)


def test_other_protocol_version_is_refused_before_its_body_is_read():
    newer = msgspec.msgpack.encode({"protocol": handshake.PROTOCOL, "version": 2, "x": [1]})
    with pytest.raises(HandshakeError, match="handshake protocol") as info:
        handshake.parse_payload(payload(newer))
    assert info.value.remote == "vllm_nixl_hma v2"


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        (b"\xc1garbage", "payload"),
        (msgspec.msgpack.encode([1, 2]), "payload"),
        (
            msgspec.msgpack.encode({"compatibility_hash": 3, "agent_metadata_bytes": b""}),
            "compatibility_hash",
        ),
        (payload(b"\x00\x01"), handshake.PAYLOAD_FIELD),
        (payload(record(kernel_block_tokens=-16)), "kernel_block_tokens"),
        (payload(record(groups=[])), "groups"),
        (payload(record(logical_block_tokens=81)), "logical_block_tokens"),
        (payload(record(groups=[GroupRecord("lstm", 1)])), "groups[0].kind"),
        (
            payload(record(groups=[GroupRecord("full_attention", 0)], logical_block_tokens=16)),
            "groups[0].physical_per_logical",
        ),
    ],
)
def test_malformed_payloads_name_the_field(raw, field):
    with pytest.raises(MalformedHandshakeError) as info:
        handshake.parse_payload(raw)
    assert info.value.field == field


@pytest.mark.parametrize(
    ("override", "field"),
    [
        (
            {"groups": [GroupRecord("full_attention", RATIO)], "regions_mamba": [False, False]},
            "KV cache group kinds",
        ),
        ({"regions_mamba": [False, True]}, "regions_mamba"),
        ({"kernel_block_tokens": 32, "logical_block_tokens": 32 * RATIO}, "kernel_block_tokens"),
        ({"kv_cache_layout": "NHD"}, "kv_cache_layout"),
        ({"kv_cache_dtype": "torch.float16"}, "kv_cache_dtype"),
        ({"mamba_state_dtypes": ["torch.bfloat16", "torch.float32"]}, "mamba_state_dtypes"),
        ({"mamba_conv_state_layout": "SD"}, "mamba_conv_state_layout"),
        ({"mamba_cache_mode": "align"}, "mamba_cache_mode"),
    ],
)
def test_every_mismatch_names_field_local_and_remote(override, field):
    remote = record(**override)
    with pytest.raises(HandshakeError) as info:
        handshake.validate_remote(record(), remote)
    assert info.value.field.startswith(field)
    message = str(info.value)
    assert "local=" in message and "remote=" in message


def test_unequal_ratios_pass_without_prefix_caching_and_fail_with_it():
    remote = record(
        groups=[GroupRecord("mamba", 1), GroupRecord("full_attention", 3)],
        logical_block_tokens=48,
        tp_size=2,
    )
    handshake.validate_remote(record(), remote)
    with pytest.raises(HandshakeError, match="--no-enable-prefix-caching"):
        handshake.validate_remote(record(), msgspec.structs.replace(remote, prefix_caching=True))
    with pytest.raises(HandshakeError, match="--no-enable-prefix-caching"):
        handshake.validate_remote(record(prefix_caching=True), remote)


def test_equal_records_validate():
    handshake.validate_remote(record(), record(tp_size=4, plugin_version="0.1.1"))


def agent(**overrides):
    fields = {
        "num_blocks": 256 * RATIO,
        "block_lens": [1024, 1024],
        "kv_caches_base_addr": [4096, 8192],
        "block_size": 16,
        "physical_blocks_per_logical": RATIO,
        "ssm_sizes": [10, 20],
    }
    fields.update(overrides)
    return fields


def test_consistent_agent_metadata_passes():
    handshake.check_agent_metadata(record(), **agent())


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ({"num_blocks": -5}, "num_blocks"),
        ({"num_blocks": 1 << 60}, "num_blocks"),
        ({"num_blocks": 256 * RATIO + 1}, "num_blocks"),
        ({"num_blocks": "many"}, "num_blocks"),
        ({"block_lens": [1024]}, "block_lens"),
        ({"block_lens": [1024, 0]}, "block_lens[1]"),
        ({"kv_caches_base_addr": [4096, None]}, "kv_caches_base_addr[1]"),
        ({"block_size": 32}, "block_size"),
        (
            {"physical_blocks_per_logical": 3, "num_blocks": 256 * 15},
            "physical_blocks_per_logical_kv_block",
        ),
        ({"physical_blocks_per_logical": 0}, "physical_blocks_per_logical_kv_block"),
        ({"ssm_sizes": [1]}, "ssm_sizes"),
    ],
)
def test_bad_agent_metadata_is_refused_naming_the_field(override, field):
    with pytest.raises(MalformedHandshakeError) as info:
        handshake.check_agent_metadata(record(), **agent(**override))
    assert info.value.field == field


# ---------------------------------------------------- vLLM 0.33: before loading

HYBRID = [GroupKind.MAMBA, GroupKind.FULL_ATTENTION]


def facts(**overrides) -> handshake.AgentFacts:
    fields = {
        "kv_cache_layout": "LBHNC",
        "num_regions": 4,
        "physical_per_logical": 9,
        "ssm_sizes": (1920, 8192),
    }
    fields.update(overrides)
    return handshake.AgentFacts(**fields)


def test_a_peer_decode_can_read_passes_before_loading():
    handshake.refuse_before_loading(facts(), facts(), HYBRID, local_prefix_caching=False)
    # unequal ratios pair leading blocks when neither prefix caching nor a window is involved
    handshake.refuse_before_loading(
        facts(), facts(physical_per_logical=5), HYBRID, local_prefix_caching=False
    )
    # equal ratios keep prefix caching
    handshake.refuse_before_loading(facts(), facts(), HYBRID, local_prefix_caching=True)


@pytest.mark.parametrize(
    ("remote", "field", "local_value", "remote_value"),
    [
        ({"kv_cache_layout": "LBNHC"}, "kv_cache_layout", "'LBHNC'", "'LBNHC'"),
        ({"num_regions": 3}, "kv_caches_base_addr (registered KV regions)", "4", "3"),
        ({"ssm_sizes": (1920, 4096)}, "ssm_sizes", "(1920, 8192)", "(1920, 4096)"),
    ],
)
def test_each_mismatch_before_loading_names_field_local_and_remote(
    remote, field, local_value, remote_value
):
    with pytest.raises(HandshakeError) as info:
        handshake.refuse_before_loading(
            facts(), facts(**remote), HYBRID, local_prefix_caching=False
        )
    message = str(info.value)
    assert message.startswith(field)
    assert f"local={local_value}" in message and f"remote={remote_value}" in message


def test_a_layout_vllm_converts_on_receive_is_accepted():
    handshake.refuse_before_loading(
        facts(kv_cache_layout="LBNHC"),
        facts(),
        HYBRID,
        local_prefix_caching=False,
        layout_conversion=True,
    )


def test_prefix_caching_across_unequal_ratios_is_refused_saying_what_to_change():
    with pytest.raises(IncompatibleRemoteError) as info:
        handshake.refuse_before_loading(
            facts(), facts(physical_per_logical=5), HYBRID, local_prefix_caching=True
        )
    message = str(info.value)
    assert "physical_blocks_per_logical_kv_block" in message
    assert "local=9" in message and "remote=5" in message
    assert "--no-enable-prefix-caching" in message and "equal ratios" in message


def test_a_sliding_window_group_across_unequal_ratios_is_refused():
    kinds = [GroupKind.SLIDING_WINDOW, GroupKind.FULL_ATTENTION]
    with pytest.raises(IncompatibleRemoteError, match="sliding-window"):
        handshake.refuse_before_loading(
            facts(ssm_sizes=None, physical_per_logical=2),
            facts(ssm_sizes=None, physical_per_logical=1),
            kinds,
            local_prefix_caching=False,
        )


# --- the one check framework both releases use (refuse_mismatches)


def test_the_first_differing_check_in_order_is_the_refusal():
    checks = [
        handshake.FieldCheck("first", 1, 1, "r1"),
        handshake.FieldCheck("second", "a", "b", "r2"),
        handshake.FieldCheck("third", 1, 2, "r3"),
    ]
    with pytest.raises(HandshakeError, match="second") as excinfo:
        handshake.refuse_mismatches(checks)
    assert "third" not in str(excinfo.value)
    assert "'a'" in str(excinfo.value) and "'b'" in str(excinfo.value)
    handshake.refuse_mismatches(checks[:1])  # all equal: no refusal


@pytest.mark.parametrize(
    ("local_pc", "remote_pc", "field"),
    [
        (False, True, "prefix_caching"),  # the peer says it caches prefixes
        (True, False, "prefix_caching"),
        (True, None, None),  # the peer says nothing: decode's own setting refuses
    ],
)
def test_unequal_ratios_with_prefix_caching_on_either_side_are_refused(local_pc, remote_pc, field):
    pairing = handshake.Pairing(
        [GroupKind.MAMBA, GroupKind.FULL_ATTENTION],
        4,
        8,
        local_prefix_caching=local_pc,
        remote_prefix_caching=remote_pc,
    )
    with pytest.raises(IncompatibleRemoteError) as excinfo:
        handshake.refuse_mismatches([], pairing)
    if field is not None:
        assert excinfo.value.field == field
    assert "no-enable-prefix-caching" in str(excinfo.value)


def test_unequal_ratios_without_prefix_caching_pair():
    handshake.refuse_mismatches(
        [],
        handshake.Pairing(
            [GroupKind.MAMBA, GroupKind.FULL_ATTENTION],
            4,
            8,
            local_prefix_caching=False,
            remote_prefix_caching=False,
        ),
    )
