"""The upstream tests that pass on stock vLLM and fail on ours, on purpose.

The one place that lists them. Each encodes a bug this plugin fixes; each
names the upstream release that fixed the bug and changed the test, where
there is one (tests/upstream/test_upstream_suite.py checks ours against that
release's version of the test).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Departure:
    #: vLLM release whose suite holds the test
    release: str
    #: pytest node id, relative to the release's source root
    node_id: str
    #: why ours fails it, and rightly
    reason: str
    #: the upstream release that fixed the bug and changed the test (or None)
    fixed_in: str | None


DEPARTURES = (
    Departure(
        release="0.21.0",
        node_id=(
            "tests/v1/kv_connector/unit/test_nixl_connector_hma.py::"
            "test_read_blocks_for_req_expands_remote_ids[mamba_fa_ssm]"
        ),
        reason=(
            "expects remote logical block L to become kernel blocks "
            "L*remote_ratio + [0, local_ratio): the 0.21.0 expansion that reads the "
            "wrong remote pages whenever the kernel-per-logical ratios differ "
            "(docs/design.md section 3). Ours expands with the remote ratio on both counts."
        ),
        fixed_in="0.22.0",
    ),
    *(
        Departure(
            release="0.21.0",
            node_id=(
                "tests/v1/kv_connector/unit/test_nixl_connector.py::"
                f"test_compatibility_hash_validation[{case}]"
            ),
            reason=(
                "hands decode a made-up prefill payload that vLLM's own validation "
                "refuses (kv_cache_layout HND against decode's NHD; 1 KV region against "
                "decode's 4), and passes on stock only because it replaces "
                "add_remote_agent, where 0.21.0 validates, after loading the remote "
                "agent. Ours validates at the handshake, before any agent is loaded, "
                "and refuses the payload naming the field."
            ),
            fixed_in=None,
        )
        for case in (
            "block_size-config_overrides8-version_override8-False-True",
            "matching_config-config_overrides9-version_override9-False-True",
            "escape_hatch-config_overrides10-version_override10-False-False",
        )
    ),
)


DEPARTURES += tuple(
    Departure(
        release="0.34.0",
        node_id=(
            "tests/v1/kv_connector/unit/test_nixl_connector_hma.py::"
            f"test_dcp_pull_reads_replicated_draft_group_from_one_rank[True-{rank}]"
        ),
        reason=(
            "expects the pairing assert 'decode needs 3 blocks' to escape "
            "_read_blocks_for_req (in an engine: out of start_load_kv, taking the engine "
            "and every request in it down). Ours fails that request alone "
            "(ReadPath._read_blocks_for_req), which reaches for the test's fake worker's "
            "missing _recving_metadata."
        ),
        fixed_in=None,
    )
    for rank in (0, 3)
)


def departures_for(release: str) -> dict[str, Departure]:
    return {d.node_id: d for d in DEPARTURES if d.release == release}


def fixing_releases() -> set[str]:
    return {d.fixed_in for d in DEPARTURES if d.fixed_in is not None}
