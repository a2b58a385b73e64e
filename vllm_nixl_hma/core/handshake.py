"""The versioned record NixlHMAConnector adds to vLLM's NIXL handshake, and its checks.

No vLLM, no torch: msgspec (vLLM's wire codec) and the standard library only.

Prefill publishes, next to vLLM's ``compatibility_hash`` and
``agent_metadata_bytes``, a field ``vllm_nixl_hma`` holding a ``HandshakeRecord``:
what decode needs to validate prefill authoritatively instead of classifying
the remote's memory with its own local layout. Decode parses the payload in
phases (outer map, record version, record body, agent metadata), so that a
newer peer gets a readable refusal rather than a decoder traceback, and checks
every field against its own record before it registers the remote or reads a
byte. A stock peer (vLLM's fields only) is checked against the record its
metadata implies (``record_for_stock_peer``). Every refusal is a
``HandshakeError`` naming the field, the local value and the remote value;
vLLM's own compatibility-hash check comes first and keeps vLLM's message
(``CompatibilityHashMismatch``).

On vLLM 0.33 decode checks prefill's agent metadata itself, which carries
enough there (``AgentFacts``, ``refuse_before_loading``), before the agent is
loaded; no record travels.

One check serves both releases and the stock-peer record: a list of
``FieldCheck`` (field, local value, remote value, remedy) refused at the first
difference, then whether the two engines' kernel blocks can be paired
(``Pairing``), by ``refuse_mismatches``. ``record_checks`` and
``agent_fact_checks`` build the lists for 0.21 and 0.33.

Version history (``RECORD_VERSION``):
  1: groups (kind, kernel-per-logical ratio), kernel and logical block tokens,
     regions (is each registered region Mamba state), KV layout, dtypes, conv
     state layout, prefix caching, Mamba cache mode, TP size, plugin version;
     later, as a minor addition older peers ignore: ``model`` (the --model
     path, named when vLLM's compatibility hash differs).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from vllm_nixl_hma.core.blocks import GroupKind, check_alignable
from vllm_nixl_hma.core.errors import IncompatibleRemoteError
from vllm_nixl_hma.core.transfer_records import Reason

__all__ = [
    "PAYLOAD_FIELD",
    "AgentFacts",
    "FieldCheck",
    "Pairing",
    "PROTOCOL",
    "RECORD_VERSION",
    "CompatibilityHashMismatch",
    "HandshakeError",
    "HandshakeRecord",
    "MalformedHandshakeError",
    "ParsedPayload",
    "check_agent_metadata",
    "encode_record",
    "agent_fact_checks",
    "parse_payload",
    "record_checks",
    "refuse_mismatches",
    "record_for_stock_peer",
    "refuse_before_loading",
    "validate_remote",
]

PROTOCOL = "vllm_nixl_hma"
RECORD_VERSION = 1
#: key of the record in the handshake payload's msgpack map
PAYLOAD_FIELD = "vllm_nixl_hma"

#: bounds on peer-supplied counts: far above any real engine, far below what
#: could exhaust memory or time while validating
MAX_GROUPS = 64
MAX_REGIONS = 1 << 14
MAX_BLOCKS = 1 << 34
MAX_RATIO = 4096
MAX_BLOCK_TOKENS = 1 << 20
MAX_BLOCK_LEN = 1 << 40
MAX_PAYLOAD_BYTES = 64 << 20


class HandshakeError(IncompatibleRemoteError):
    """A remote engine refused at handshake (a RuntimeError); nothing was read."""


class NoAnswerError(HandshakeError):
    """The remote's side channel did not answer in time: not a refusal of
    the peer, an unreachable one (its records say ``unreachable``)."""

    record_reason = Reason.UNREACHABLE


class AddressRefusedError(HandshakeError):
    """Decode refused to dial the address it was given (``addresses``)."""

    record_reason = Reason.ADDRESS


class MalformedHandshakeError(HandshakeError):
    """The remote's payload does not parse, or contradicts itself."""

    def __init__(self, field: str, remote: object, reason: str):
        super().__init__(field, "a well-formed value", remote, reason)


class GroupRecord(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    kind: str
    physical_per_logical: int


class HandshakeRecord(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """What one engine's worker says about itself. Unknown fields are ignored
    (a newer minor addition); a different ``version`` is refused."""

    protocol: str
    version: int
    plugin_version: str
    groups: list[GroupRecord]
    kernel_block_tokens: int
    logical_block_tokens: int
    regions_mamba: list[bool]
    kv_cache_layout: str
    kv_cache_dtype: str
    mamba_state_dtypes: list[str]
    mamba_conv_state_layout: str
    prefix_caching: bool
    mamba_cache_mode: str
    tp_size: int
    #: ``--model`` as the engine was given it, which vLLM's compatibility hash
    #: includes (a minor addition: "" from a peer that does not send it)
    model: str = ""


class _Envelope(msgspec.Struct, forbid_unknown_fields=False):
    protocol: str
    version: int


class ParsedPayload(msgspec.Struct, frozen=True):
    compatibility_hash: str
    agent_metadata_bytes: bytes
    #: None: the peer sent vLLM's fields alone (stock ``NixlConnector``)
    record: HandshakeRecord | None


def encode_record(record: HandshakeRecord) -> bytes:
    return msgspec.msgpack.encode(record)


def _malformed(field: str, remote: object, reason: str) -> MalformedHandshakeError:
    shown = remote if not isinstance(remote, bytes | bytearray) else f"{len(remote)} bytes"
    return MalformedHandshakeError(field, shown, reason)


def parse_payload(payload_bytes: bytes) -> ParsedPayload:
    """Decode a handshake payload in phases: vLLM's fields, then our record if
    the peer sent one (``record`` None: it did not, a stock peer); raise a
    HandshakeError on anything else."""
    if not isinstance(payload_bytes, bytes | bytearray | memoryview):
        raise _malformed("payload", type(payload_bytes).__name__, "expected bytes")
    if len(payload_bytes) > MAX_PAYLOAD_BYTES:
        raise _malformed("payload", len(payload_bytes), f"larger than {MAX_PAYLOAD_BYTES} bytes")
    try:
        outer = msgspec.msgpack.decode(payload_bytes)
    except (msgspec.DecodeError, ValueError, RecursionError) as e:
        raise _malformed("payload", len(payload_bytes), f"not msgpack: {e}") from e
    if not isinstance(outer, dict):
        raise _malformed("payload", type(outer).__name__, "expected a map")
    compatibility_hash = outer.get("compatibility_hash")
    agent_metadata_bytes = outer.get("agent_metadata_bytes")
    if not isinstance(compatibility_hash, str):
        raise _malformed("compatibility_hash", compatibility_hash, "expected a string")
    if not isinstance(agent_metadata_bytes, bytes):
        raise _malformed("agent_metadata_bytes", agent_metadata_bytes, "expected bytes")
    if PAYLOAD_FIELD not in outer:
        return ParsedPayload(compatibility_hash, agent_metadata_bytes, None)
    record_bytes = outer[PAYLOAD_FIELD]
    if not isinstance(record_bytes, bytes):
        raise _malformed(PAYLOAD_FIELD, type(record_bytes).__name__, "expected bytes")
    try:
        envelope = msgspec.msgpack.decode(record_bytes, type=_Envelope)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as e:
        raise _malformed(PAYLOAD_FIELD, record_bytes, f"no protocol/version: {e}") from e
    if envelope.protocol != PROTOCOL or envelope.version != RECORD_VERSION:
        raise HandshakeError(
            "handshake protocol",
            f"{PROTOCOL} v{RECORD_VERSION}",
            f"{envelope.protocol} v{envelope.version}",
            "prefill and decode run incompatible vllm_nixl_hma releases; install the "
            "same release on both",
        )
    try:
        record = msgspec.msgpack.decode(record_bytes, type=HandshakeRecord)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as e:
        raise _malformed(PAYLOAD_FIELD, record_bytes, str(e)) from e
    _check_record_ranges(record)
    return ParsedPayload(compatibility_hash, agent_metadata_bytes, record)


class CompatibilityHashMismatch(HandshakeError):
    """vLLM's own check: the peers' compatibility hashes differ. The message
    is upstream's (operators and routers know it), the fields are ours; where
    both records carry the model path and the paths differ, the error names
    them (``field`` is then ``model``): the same weights under two paths are
    refused by vLLM's hash, and nothing in upstream's message says so."""

    def __init__(
        self, local_hash: str, remote_hash: str, local_model: str = "", remote_model: str = ""
    ):
        paths_differ = bool(local_model and remote_model and local_model != remote_model)
        super().__init__(
            "model (--model, part of vLLM's compatibility hash)"
            if paths_differ
            else "compatibility_hash",
            local_model if paths_differ else local_hash,
            remote_model if paths_differ else remote_hash,
            "prefill and decode must run the same vLLM, model and settings",
        )
        message = (
            f"NIXL compatibility hash mismatch. Local: {local_hash}, Remote: {remote_hash}. "
            "Prefill and decode instances have incompatible configurations. This may be due "
            "to: different vLLM versions, models, dtypes, KV cache layouts, attention "
            "backends, etc. Both instances must use identical configurations. Disable this "
            "check using --kv-transfer-config "
            '\'{"kv_connector_extra_config": {"enforce_handshake_compat": false}}\''
        )
        if paths_differ:
            message += (
                f" The engines were started with different --model paths (local={local_model!r}, "
                f"remote={remote_model!r}), which vLLM's compatibility hash includes: serve the "
                "model from the same path on both hosts."
            )
        self.args = (message,)


def record_for_stock_peer(
    local: HandshakeRecord,
    *,
    remote_tp_size: int,
    block_size: Any,
    physical_blocks_per_logical: Any,
    kv_cache_layout: Any,
) -> HandshakeRecord:
    """The record a peer without one (stock ``NixlConnector``) would have
    sent, from the facts vLLM's agent metadata carries, when those facts are
    enough to read correctly; raise a HandshakeError naming the field when
    they are not.

    vLLM's metadata says the kernel block size, the kernel-per-logical ratio
    and the KV layout; where prefill keeps each byte follows from those, the
    model (checked by vLLM's compatibility hash) and the TP sizes, whichever
    connector prefill runs. It does not say whether prefill caches prefixes,
    which decides how kernel blocks pair when the ratios differ: so unequal
    ratios need our record. Everything else is taken as the local engine's
    and checked as usual (``validate_remote``, ``check_agent_metadata``).
    """
    needs_record = (
        "the prefill engine runs stock NixlConnector, whose handshake does not say "
        "{what}; run NixlHMAConnector on the prefill engine too"
    )
    local_ratio = attention_ratio(local)
    refuse_mismatches(
        FieldCheck(field, local_value, remote_value, needs_record.format(what=what))
        for field, local_value, remote_value, what in (
            (
                "physical_blocks_per_logical_kv_block",
                local_ratio,
                physical_blocks_per_logical,
                "whether prefill caches prefixes, which decides how unequal ratios pair",
            ),
            (
                "block_size (kernel block tokens)",
                local.kernel_block_tokens,
                block_size,
                "enough to pair kernel blocks of different sizes",
            ),
            (
                "kv_cache_layout",
                local.kv_cache_layout,
                kv_cache_layout,
                "enough to convert layouts",
            ),
        )
    )
    return msgspec.structs.replace(local, plugin_version="stock", tp_size=remote_tp_size)


def _check_int(field: str, value: int, low: int, high: int) -> None:
    if not low <= value <= high:
        raise _malformed(field, value, f"outside [{low}, {high}]")


def _check_record_ranges(record: HandshakeRecord) -> None:
    _check_int("groups", len(record.groups), 1, MAX_GROUPS)
    _check_int("regions_mamba", len(record.regions_mamba), 1, MAX_REGIONS)
    _check_int("kernel_block_tokens", record.kernel_block_tokens, 1, MAX_BLOCK_TOKENS)
    _check_int("logical_block_tokens", record.logical_block_tokens, 1, MAX_BLOCK_TOKENS)
    _check_int("tp_size", record.tp_size, 1, 4096)
    kinds = {kind.value for kind in GroupKind}
    ratios = set()
    for index, group in enumerate(record.groups):
        if group.kind not in kinds:
            raise _malformed(f"groups[{index}].kind", group.kind, f"not one of {sorted(kinds)}")
        _check_int(
            f"groups[{index}].physical_per_logical", group.physical_per_logical, 1, MAX_RATIO
        )
        if group.kind != GroupKind.MAMBA.value:
            ratios.add(group.physical_per_logical)
    if len(ratios) > 1:
        raise _malformed("groups", sorted(ratios), "attention groups disagree on the ratio")
    ratio = ratios.pop() if ratios else 1
    if record.logical_block_tokens != ratio * record.kernel_block_tokens:
        raise _malformed(
            "logical_block_tokens",
            record.logical_block_tokens,
            f"is not ratio {ratio} x kernel_block_tokens {record.kernel_block_tokens}",
        )


def attention_ratio(record: HandshakeRecord) -> int:
    ratios = [g.physical_per_logical for g in record.groups if g.kind != GroupKind.MAMBA.value]
    return ratios[0] if ratios else 1


@dataclass(frozen=True)
class FieldCheck:
    """One fact decode and prefill must agree on: the field's name as a
    refusal shows it, the local and remote values, and what to do."""

    field: str
    local: Any
    remote: Any
    remedy: str


@dataclass(frozen=True)
class Pairing:
    """What decides whether kernel blocks of the two engines can be paired:
    the local group kinds, both kernel-per-logical ratios, and whether each
    engine caches prefixes (``remote_prefix_caching`` None: the peer does not
    say, as on vLLM 0.33, where only decode's own setting is known)."""

    group_kinds: Sequence[GroupKind]
    local_ratio: int
    remote_ratio: int
    local_prefix_caching: bool
    remote_prefix_caching: bool | None = None
    #: decode pairs by token position (``positions``; the Mamba prefix-caching
    #: opt-in): prefix caching on either side then pairs at any ratio
    pairs_by_position: bool = False
    #: vLLM pairs the lists from the prompt's last token (0.34.0's
    #: ``_pair_blocks_by_last_token``, for models without Mamba state): unequal
    #: ratios pair with prefix-cache hits and sliding windows alike
    pairs_by_last_token: bool = False


def refuse_mismatches(checks: Iterable[FieldCheck], pairing: Pairing | None = None) -> None:
    """The one check of this module: raise a HandshakeError for the first
    check whose values differ, in the given order; then, with ``pairing``,
    refuse block lists that could not be paired (ratios that differ while
    either engine caches prefixes; ``blocks.check_alignable``)."""
    for check in checks:
        if check.local != check.remote:
            raise HandshakeError(check.field, check.local, check.remote, check.remedy)
    if pairing is None:
        return
    # a peer that says whether it caches prefixes: either engine doing so
    # makes unequal ratios unpairable (without a word from the peer,
    # check_alignable refuses on decode's own setting)
    if (
        pairing.remote_prefix_caching is not None
        and not pairing.pairs_by_position
        and pairing.local_ratio != pairing.remote_ratio
        and (pairing.local_prefix_caching or pairing.remote_prefix_caching)
    ):
        raise HandshakeError(
            "prefix_caching",
            pairing.local_prefix_caching,
            pairing.remote_prefix_caching,
            f"kernel-per-logical ratios differ (local={pairing.local_ratio}, "
            f"remote={pairing.remote_ratio}) and kernel blocks cannot be aligned after a "
            "prefix-cache hit; restart both engines with --no-enable-prefix-caching",
        )
    if pairing.pairs_by_last_token:
        return
    check_alignable(
        pairing.group_kinds,
        pairing.local_ratio,
        pairing.remote_ratio,
        local_prefix_caching=pairing.local_prefix_caching,
        pairs_by_position=pairing.pairs_by_position,
    )


def record_checks(local: HandshakeRecord, remote: HandshakeRecord) -> list[FieldCheck]:
    """Every field of two records decode must agree on with prefill, in the
    order they are checked."""
    restart = "start both engines with the same model, dtype and cache settings"
    return [
        FieldCheck(
            "KV cache group kinds",
            [g.kind for g in local.groups],
            [g.kind for g in remote.groups],
            "prefill and decode must serve the same model architecture",
        ),
        FieldCheck(
            "regions_mamba (which registered regions hold Mamba state)",
            local.regions_mamba,
            remote.regions_mamba,
            "the engines lay out KV memory differently; " + restart,
        ),
        FieldCheck(
            "kernel_block_tokens",
            local.kernel_block_tokens,
            remote.kernel_block_tokens,
            "the attention kernels use different block sizes (attention backend or TP "
            "shape); pick an attention backend and --block-size that give both engines "
            "the same kernel block size",
        ),
        FieldCheck("kv_cache_layout", local.kv_cache_layout, remote.kv_cache_layout, restart),
        FieldCheck("kv_cache_dtype", local.kv_cache_dtype, remote.kv_cache_dtype, restart),
        FieldCheck(
            "mamba_state_dtypes", local.mamba_state_dtypes, remote.mamba_state_dtypes, restart
        ),
        FieldCheck(
            "mamba_conv_state_layout",
            local.mamba_conv_state_layout,
            remote.mamba_conv_state_layout,
            "set VLLM_SSM_CONV_STATE_LAYOUT=DS on both engines",
        ),
        FieldCheck(
            "mamba_cache_mode",
            local.mamba_cache_mode,
            remote.mamba_cache_mode,
            "the engines keep different numbers of Mamba state blocks per request; "
            "use the same --enable-prefix-caching / --mamba-cache-mode on both",
        ),
    ]


def validate_remote(
    local: HandshakeRecord, remote: HandshakeRecord, pairs_by_position: bool = False
) -> None:
    """vLLM 0.21 decode's check of prefill's record (``record_checks``, then
    the pairing of both records' ratios and prefix caching)."""
    refuse_mismatches(
        record_checks(local, remote),
        Pairing(
            [GroupKind(g.kind) for g in local.groups],
            attention_ratio(local),
            attention_ratio(remote),
            local_prefix_caching=local.prefix_caching,
            remote_prefix_caching=remote.prefix_caching,
            pairs_by_position=pairs_by_position,
        ),
    )


def check_agent_metadata(
    record: HandshakeRecord,
    *,
    num_blocks: Any,
    block_lens: Any,
    kv_caches_base_addr: Any,
    block_size: Any,
    physical_blocks_per_logical: Any,
    ssm_sizes: Sequence[Any],
) -> None:
    """vLLM's agent metadata must be well-formed and agree with the record."""
    for field, value in (
        ("num_blocks", num_blocks),
        ("block_size", block_size),
        ("physical_blocks_per_logical_kv_block", physical_blocks_per_logical),
    ):
        if not isinstance(value, int) or isinstance(value, bool):
            raise _malformed(field, value, "expected an integer")
    _check_int("num_blocks", num_blocks, 1, MAX_BLOCKS)
    _check_int("physical_blocks_per_logical_kv_block", physical_blocks_per_logical, 1, MAX_RATIO)
    if num_blocks % physical_blocks_per_logical:
        raise _malformed(
            "num_blocks",
            num_blocks,
            f"not a multiple of physical_blocks_per_logical_kv_block {physical_blocks_per_logical}",
        )
    if block_size != record.kernel_block_tokens:
        raise _malformed(
            "block_size", block_size, f"differs from the record's {record.kernel_block_tokens}"
        )
    if physical_blocks_per_logical != attention_ratio(record):
        raise _malformed(
            "physical_blocks_per_logical_kv_block",
            physical_blocks_per_logical,
            f"differs from the record's {attention_ratio(record)}",
        )
    regions = len(record.regions_mamba)
    for field, values in (("block_lens", block_lens), ("kv_caches_base_addr", kv_caches_base_addr)):
        if not isinstance(values, list) or len(values) != regions:
            raise _malformed(
                field,
                len(values) if isinstance(values, list) else values,
                f"expected one entry per registered region ({regions})",
            )
        for index, value in enumerate(values):
            if not isinstance(value, int) or isinstance(value, bool):
                raise _malformed(f"{field}[{index}]", value, "expected an integer")
    for index, value in enumerate(block_lens):
        _check_int(f"block_lens[{index}]", value, 1, MAX_BLOCK_LEN)
    for index, value in enumerate(kv_caches_base_addr):
        _check_int(f"kv_caches_base_addr[{index}]", value, 1, (1 << 64) - 1)
    if len(ssm_sizes) != 2 or not all(
        isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_BLOCK_LEN
        for v in ssm_sizes
    ):
        raise _malformed("ssm_sizes", list(ssm_sizes), "expected two sizes in bytes")


@dataclass(frozen=True)
class AgentFacts:
    """What decode checks about a vLLM 0.33 prefill rank before loading its
    agent, all from vLLM's own agent metadata (``NixlAgentMetadata``) or, for
    the local side, the worker. vLLM 0.33's metadata carries the layout, the
    regions and the state sizes itself; dtypes, model and cache dtype are
    covered by vLLM's compatibility hash, checked before this."""

    kv_cache_layout: str
    num_regions: int
    physical_per_logical: int
    #: (conv state, SSM state) bytes per block of that rank; None: no Mamba state
    ssm_sizes: tuple[int, int] | None


def agent_fact_checks(
    local: AgentFacts, remote: AgentFacts, *, layout_conversion: bool = False
) -> list[FieldCheck]:
    """What decode on vLLM 0.33 must agree on with a prefill rank, from vLLM's
    own agent metadata, in the order they are checked; ``remote.ssm_sizes``
    must equal ``local.ssm_sizes``, which the caller sets to what this
    model's state is at prefill's TP size. ``layout_conversion``: vLLM
    converts the remote layout on receive (its ``enable_permute_local_kv``),
    so a different layout counts as the same."""
    return [
        FieldCheck(
            "kv_cache_layout",
            local.kv_cache_layout,
            local.kv_cache_layout if layout_conversion else remote.kv_cache_layout,
            "serve both engines with the same kv_cache_layout (VLLM_KV_CACHE_LAYOUT; "
            "NIXL asks for LBHNC)",
        ),
        FieldCheck(
            "kv_caches_base_addr (registered KV regions)",
            local.num_regions,
            remote.num_regions,
            "the engines hold different numbers of KV cache layers; serve the same model on both",
        ),
        FieldCheck(
            "ssm_sizes (conv and SSM state bytes per block at prefill's TP size)",
            local.ssm_sizes,
            remote.ssm_sizes,
            "prefill's Mamba state has another shape or dtype than this model has "
            "there; serve the same model with the same --mamba-ssm-cache-dtype on both",
        ),
    ]


def refuse_before_loading(
    local: AgentFacts,
    remote: AgentFacts,
    group_kinds: Sequence[GroupKind],
    *,
    local_prefix_caching: bool,
    layout_conversion: bool = False,
    pairs_by_position: bool = False,
    pairs_by_last_token: bool = False,
) -> None:
    """vLLM 0.33 and 0.34 decode's check of a prefill rank before its agent is
    loaded (``agent_fact_checks``, then the pairing of the two ratios under
    decode's prefix caching, unless ``pairs_by_last_token``; prefill's is not
    in vLLM's metadata)."""
    refuse_mismatches(
        agent_fact_checks(local, remote, layout_conversion=layout_conversion),
        Pairing(
            group_kinds,
            local.physical_per_logical,
            remote.physical_per_logical,
            local_prefix_caching=local_prefix_caching,
            pairs_by_position=pairs_by_position,
            pairs_by_last_token=pairs_by_last_token,
        ),
    )
