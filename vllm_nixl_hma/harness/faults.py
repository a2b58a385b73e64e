"""Fault injection in the oracle harness: what decode does when prefill is wrong.

Each fault is a cell with one thing broken. A fault passes when decode
reports every affected request failed (within the transfer timeout), no
delivered request holds a wrong slot, nothing was written outside requests,
and no NIXL transfer handle or refused remote agent stays behind.

Every fault runs on every model kind of ``MODEL_KINDS``: dense, sliding
window with and without the hybrid KV cache manager, and the Mamba hybrid
(which needs it). "Failed" means what vLLM's scheduler is told: on vLLM
0.21.0 every local block of the request reported invalid (one group without
HMA, every group with it), on 0.33 the request in ``failed_recving``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from vllm_nixl_hma.harness.coordinator import (
    Cell,
    RankPool,
    Scenario,
    ScenarioResult,
    model_dir_for,
    run_cell,
)
from vllm_nixl_hma.harness.model_shapes import installed_layouts


@dataclass(frozen=True)
class Fault:
    name: str
    description: str
    p_tp: int = 2
    d_tp: int = 1
    prefill_connector: str | None = None
    #: prefill serves another model layout (``MISMATCHED``)
    mismatched_prefill: bool = False
    dead_side_channel: bool = False
    kill_prefill: bool = False
    expire_lease: bool = False
    lose_notifications: bool = False
    kill_prefill_mid_read: bool = False
    #: the fault must not cost decode anything: every request delivered intact
    expect_delivered: bool = False
    #: not a fault for ours: every request is read, intact (prefill frees on notification)
    expect_served: bool = False
    #: decode may keep the dead prefill engine's agent (vLLM 0.33: until engine_ttl)
    dead_engine_kept: bool = False
    #: the reads start inside the lease and are first looked at after it ended
    late_read: bool = False
    #: the first request's attention list is cut to one block: it alone must fail
    unpairable: bool = False
    #: prefix caching on, lists paired by token position, and decode's scheduler
    #: hands the first request a token span its lists do not fit: it alone must fail
    bad_span: bool = False
    #: how many prefill logical blocks the bad span claims beyond the prompt
    bad_span_blocks: int = 2
    #: what decode's records (#27) must say of each request the fault stops
    #: (``"outcome/reason"``; the harness runs kv_load_failure_policy "fail")
    records: tuple[str, ...] = ()

    @property
    def first_request_alone(self) -> bool:
        """The fault breaks the first request of a batch, which alone must fail;
        a whole batch follows."""
        return self.unpairable or self.bad_span


@dataclass(frozen=True)
class ModelKind:
    """A layout of the check and whether its engines run the hybrid KV cache
    manager (``hma``): vLLM 0.21.0 turns it off for a model without Mamba
    layers when a connector is configured, and a user can turn it back on."""

    layout: str
    hma: bool

    @property
    def name(self) -> str:
        return f"{self.layout}{'' if self.hma else ' (no HMA)'}"


#: every fault runs on each: dense (one group, with or without HMA alike),
#: sliding window beside full attention with and without HMA, every layer
#: sliding-window (one group, HMA or not), the Mamba hybrid (HMA only)
MODEL_KINDS = (
    ModelKind("dense", hma=False),
    ModelKind("swa", hma=True),
    ModelKind("swa", hma=False),
    # every layer sliding-window: one window group, its blocks before the window null (#41)
    ModelKind("swa-only", hma=False),
    ModelKind("hybrid", hma=True),
)
#: the prefill model of the mismatched-layout fault, per decode layout: one
#: SSM group instead of two, or attention pages of another head size
MISMATCHED = {"hybrid": "hybrid-1group", "dense": ("dense", {"head_dim": 32})}
MISMATCHED["swa"] = ("swa", {"head_dim": 32})
MISMATCHED["swa-only"] = ("swa-only", {"head_dim": 32})
#: layouts without a full-attention or Mamba group: no group pairs by a token span
WINDOW_ONLY_LAYOUTS = frozenset({"swa-only"})
#: why the mid-read kill does not run on them
NO_LONG_READ = "no read of a window shorter than a block lasts long enough to be cut off"


RATIOS_DIFFER = ", where the kernel-per-logical ratios differ"
FAULTS = (
    Fault(
        "stock-prefill",
        "prefill runs stock NixlConnector (no handshake record) at P TP 2 -> D TP 1"
        + RATIOS_DIFFER,
        prefill_connector="NixlConnector",
        records=("refused/stock_peer",),
    ),
    Fault(
        "dead-side-channel",
        "the prefill side channel named in kv_transfer_params is not listening; "
        "then a batch to the live one must still succeed",
        p_tp=1,
        dead_side_channel=True,
        records=("failed/unreachable",),
    ),
    Fault(
        "mismatched-layout",
        "prefill serves another model layout (hybrid: one SSM group, other state size; "
        "dense and sliding window: another head size)",
        mismatched_prefill=True,
        records=("refused/handshake",),
    ),
    Fault(
        "prefill-killed",
        "prefill processes are killed (SIGKILL) after the handshake, before decode reads",
        p_tp=1,
        kill_prefill=True,
        records=("failed/transfer",),
    ),
    Fault(
        "prefill-killed-mid-read",
        "prefill processes are killed (SIGKILL) while decode's reads are in flight "
        "(UCX over TCP, so that the reads take long enough to be interrupted)",
        p_tp=1,
        kill_prefill_mid_read=True,
        records=("failed/transfer",),
    ),
    Fault(
        "expired-lease",
        "prefill's lease runs out and it reuses the blocks before decode reads",
        p_tp=1,
        expire_lease=True,
        records=("expired/lease",),
    ),
    Fault(
        "late-read",
        "decode's reads start inside prefill's lease but are first seen finished after it "
        "ended (a decode step that ran long): the KV is not trusted",
        p_tp=1,
        late_read=True,
        records=("expired/late_read",),
    ),
    Fault(
        "unpairable",
        "the first request's attention block list from prefill is cut to one block, which no "
        "rounding explains: that request fails alone, the other two arrive intact",
        unpairable=True,
        records=("refused/unpairable",),
    ),
    Fault(
        "bad-token-span",
        "prefix caching on (lists paired by token position) and decode's scheduler side "
        "hands the first request a token span two prefill blocks longer than its lists: "
        "that request fails alone, the other two arrive intact",
        bad_span=True,
        records=("refused/unpairable",),
    ),
    Fault(
        "lost-notification",
        "decode's read notifications never reach prefill, which frees on its lease",
        p_tp=1,
        lose_notifications=True,
        expect_delivered=True,
    ),
    Fault(
        "stock-prefill-served",
        "prefill runs stock NixlConnector at decode's TP (P TP 1 -> D TP 1: equal ratios, "
        "kernel blocks and layout, all vLLM's metadata says); decode serves it",
        p_tp=1,
        prefill_connector="NixlConnector",
        expect_served=True,
    ),
)


@dataclass
class FaultResult:
    name: str
    requests_failed: int
    requests_recovered: int
    silently_wrong_slots: int
    seconds: float
    leaked_handles: int
    requests: int = 0
    error: str | None = None
    expect_delivered: bool = False
    expect_served: bool = False
    prefill_released: int = 0
    slots_checked: int = 0
    #: the model kind it ran on (``ModelKind.name``)
    model: str = "hybrid"
    #: how many requests must fail, at least and at most (None: every request
    #: of the batch); the others must arrive intact
    expect_failed: tuple[int, int] | None = None
    #: decode's records of the batch (``"outcome/reason": requests``; empty for
    #: stock NixlConnector, which keeps none) and what the fault allows
    outcomes: dict[str, int] = field(default_factory=dict)
    records_allowed: tuple[str, ...] = ()
    records_kept: bool = False

    @property
    def records_ok(self) -> bool:
        """One record per request: ``read`` for each request that arrived,
        one of the fault's own outcomes for each it stopped (#27)."""
        if not self.records_kept:
            return True
        not_read = {k: n for k, n in self.outcomes.items() if k != "read/none"}
        return (
            sum(self.outcomes.values()) == self.requests
            and sum(not_read.values()) == self.requests_failed
            and set(not_read) <= set(self.records_allowed)
        )

    @property
    def ok(self) -> bool:
        if self.requests == 0 or self.silently_wrong_slots or self.leaked_handles:
            return False
        if not self.records_ok:
            return False
        if self.expect_failed is not None:
            # that many fail, every other request arrives intact and is checked
            least, most = self.expect_failed
            return least <= self.requests_failed <= most and self.slots_checked > 0
        if self.expect_served:
            return self.error is None and self.requests_failed == 0 and self.slots_checked > 0
        if self.expect_delivered:
            # nothing failed, and prefill freed every request's blocks itself
            return (
                self.error is None
                and self.requests_failed == 0
                and self.prefill_released == self.requests
            )
        return self.requests_failed + self.requests_recovered == self.requests

    def as_json(self) -> dict[str, Any]:
        row = asdict(self)
        for internal in (
            "requests",
            "error",
            "expect_delivered",
            "expect_served",
            "prefill_released",
            "slots_checked",
            "expect_failed",
            "records_allowed",
            "records_kept",
        ):
            row.pop(internal)
        return row


def for_installed_vllm(fault: Fault) -> Fault:
    """The fault as judged on the installed vLLM. On 0.33 a stock prefill at
    unequal ratios is served (0.33's agent metadata says all decode must
    check, ``handshake.refuse_before_loading``), and decode keeps the agent of
    a prefill engine that died until upstream's ``engine_ttl`` (3600 s by
    default) or until NIXL drops its metadata: upstream's rule, not redone."""
    from vllm_nixl_hma import _compat

    if not _compat.builds_on("v033"):
        return fault
    if fault.name == "stock-prefill":
        return replace(
            fault,
            description=fault.description + "; vLLM 0.33's metadata is enough: decode serves it",
            expect_served=True,
        )
    if fault.kill_prefill or fault.kill_prefill_mid_read:
        return replace(fault, dead_engine_kept=True)
    return fault


def for_model_kind(fault: Fault, kind: ModelKind) -> Fault:
    """The fault as judged on a model kind. A stock prefill of a model
    without Mamba layers has the kernel-per-logical ratio 1 at every TP, like
    decode's: vLLM's metadata fixes every byte decode reads, and decode
    serves it (``handshake.record_for_stock_peer``)."""
    if fault.name == "stock-prefill" and kind.layout != "hybrid":
        return replace(
            fault,
            description=fault.description.replace(RATIOS_DIFFER, "")
            + "; without Mamba layers the ratios are equal: decode serves it",
            expect_served=True,
        )
    if fault.bad_span and kind.layout in WINDOW_ONLY_LAYOUTS:
        # a window list clipped to cdiv(window, block) + 1 blocks is as long
        # for every prompt that fills them, so a span longer than the prompt
        # may fit it (and is served right: both tails end at the prompt's last
        # token); a span two blocks shorter than a 3-block prompt fits no list
        return replace(
            fault,
            description="decode's scheduler side hands the first request a token span two "
            "prefill blocks shorter than its lists: prefill's window list is longer than the "
            "span's tokens fill, so that request fails alone, the other two arrive intact",
            bad_span_blocks=-2,
        )
    return fault


def _judge(
    fault: Fault, result: ScenarioResult, kind: ModelKind, records_kept: bool = False
) -> FaultResult:
    return FaultResult(
        name=fault.name,
        requests_failed=result.requests_failed,
        requests_recovered=0,  # the harness has no scheduler to recompute
        silently_wrong_slots=result.silently_wrong_slots,
        seconds=result.seconds,
        leaked_handles=result.leaked_handles,
        requests=result.requests,
        error=result.error,
        expect_delivered=fault.expect_delivered,
        expect_served=fault.expect_served,
        prefill_released=result.prefill_released_by_expiry,
        slots_checked=result.slots_checked,
        model=kind.name,
        expect_failed=_expect_failed(fault, result),
        outcomes=dict(result.outcomes),
        records_allowed=fault.records,
        records_kept=records_kept,
    )


def _expect_failed(fault: Fault, result: ScenarioResult) -> tuple[int, int] | None:
    if fault.first_request_alone and not fault.expect_served:  # the cut request alone
        return (1, 1)
    if fault.kill_prefill_mid_read:
        # a read that finished before the kill landed arrives intact: at least
        # one must have been cut off (else the fault did not happen)
        return (1, result.requests)
    return None


#: seconds after decode posted its reads (on loopback over TCP a sliding-window
#: batch of 3 x 1200 blocks under HMA is read in about 0.05 s)
KILL_AFTER_S = 0.02


def _scenarios(fault: Fault) -> list[Scenario]:
    if fault.kill_prefill_mid_read:
        return [Scenario("mid-block"), Scenario("long", kill_prefill_after_s=KILL_AFTER_S)]
    if fault.kill_prefill:
        return [Scenario("mid-block"), Scenario("mid-block")]
    if fault.dead_side_channel:
        return [Scenario("mid-block", dead_side_channel=True), Scenario("mid-block")]
    if fault.late_read:  # the first batch makes the handshake
        return [Scenario("mid-block"), Scenario("mid-block", late_read=True)]
    if fault.first_request_alone:  # then a batch that must arrive whole
        return [
            Scenario(
                "mid-block",
                unpairable_first_request=fault.unpairable,
                bad_span_first_request=fault.bad_span,
                bad_span_blocks=fault.bad_span_blocks,
            ),
            Scenario("boundary"),
        ]
    return [Scenario("mid-block")]


def _model_dirs(workdir: Path) -> dict[str, str]:
    """Every installed layout's directory, and ``mismatched:LAYOUT`` for the
    mismatched-layout fault's prefill model of each."""
    layouts = installed_layouts()
    dirs = {name: model_dir_for(config, workdir) for name, config in layouts.items()}
    for layout, other in MISMATCHED.items():
        if isinstance(other, str):
            dirs[f"mismatched:{layout}"] = dirs[other]
        else:
            base, changes = other
            dirs[f"mismatched:{layout}"] = model_dir_for({**layouts[base], **changes}, workdir)
    return dirs


def run_faults(
    faults: tuple[Fault, ...],
    connector: str,
    workdir: Path,
    progress: Callable[[str], None],
    env: dict[str, str] | None = None,
    kinds: tuple[ModelKind, ...] = MODEL_KINDS,
) -> list[FaultResult]:
    """Every fault on every model kind, in that order. ``env``: extra
    environment of the rank processes (e.g. their log file)."""
    model_dirs = _model_dirs(workdir)
    size = max(f.p_tp + f.d_tp for f in faults)
    pool = RankPool(size, env)
    # reads slow enough (UCX over TCP) to be interrupted; its own processes
    tcp_pool = (
        RankPool(2, env={**(env or {}), "UCX_TLS": "tcp"})
        if any(f.kill_prefill_mid_read for f in faults)
        else None
    )
    results = []
    try:
        for kind, fault in (
            (kind, for_model_kind(for_installed_vllm(f), kind)) for f in faults for kind in kinds
        ):
            if fault.kill_prefill_mid_read and kind.layout in WINDOW_ONLY_LAYOUTS:
                # decode reads one block per layer of an 8-token window: the
                # batch's reads end within about 30 ms over TCP, before or after
                # the kill by chance (prefill-killed covers a dead prefill there)
                progress(f"fault {fault.name} on {kind.name}: not run, {NO_LONG_READ}")
                continue
            progress(f"fault {fault.name} on {kind.name}: {fault.description}")
            cell = Cell(
                layout=kind.layout,
                model_dir=model_dirs[kind.layout],
                hma=kind.hma,
                p_tp=fault.p_tp,
                d_tp=fault.d_tp,
                connector=connector,
                scenarios=_scenarios(fault),
                prefill_connector=fault.prefill_connector,
                prefill_model_dir=model_dirs[f"mismatched:{kind.layout}"]
                if fault.mismatched_prefill
                else None,
                kill_prefill_before_scenario=1 if fault.kill_prefill else None,
                expire_lease=fault.expire_lease,
                lose_notifications=fault.lose_notifications,
                prefix_caching=fault.bad_span,
                remote_agents_must_be_gone=not (
                    fault.expire_lease
                    or fault.late_read
                    or fault.first_request_alone
                    or fault.lose_notifications
                    or fault.expect_served
                    or fault.dead_engine_kept
                ),
            )
            if fault.kill_prefill_mid_read:
                # room for the long prompts in every group (two with sliding window)
                cell.num_gpu_blocks = 8192
            batches = run_cell(tcp_pool if fault.kill_prefill_mid_read else pool, cell, progress)
            if fault.kill_prefill or fault.kill_prefill_mid_read:
                # a first batch establishes the handshake
                warmup, result = batches
                if not warmup.ok:
                    result.error = f"the batch before the fault failed: {warmup.error}"
                    result.requests_failed = 0
                elif fault.kill_prefill_mid_read and (
                    result.seconds <= KILL_AFTER_S or result.requests_failed == 0
                ):
                    result.error = "the reads finished before prefill was killed"
                    result.requests_failed = 0
            elif fault.dead_side_channel or fault.first_request_alone:
                # decode must go on serving the live engine, whole batches too
                result, after = batches
                if not after.ok:
                    result.error = f"the batch after the fault failed: {after.error}"
                    result.requests_failed = 0
            elif fault.late_read:
                warmup, result = batches
                if not warmup.ok:
                    result.error = f"the batch before the fault failed: {warmup.error}"
                    result.requests_failed = 0
            else:
                (result,) = batches
            results.append(_judge(fault, result, kind, connector == "NixlHMAConnector"))
    finally:
        pool.close()
        if tcp_pool is not None:
            tcp_pool.close()
    return results


FAULT_COLUMNS = (
    ("fault", 23, lambda r: r.name),
    ("model", 14, lambda r: r.model),
    ("reqs", 4, lambda r: r.requests),
    ("failed", 6, lambda r: r.requests_failed),
    ("recovered", 9, lambda r: r.requests_recovered),
    ("silently wrong slots", 20, lambda r: r.silently_wrong_slots),
    ("seconds", 7, lambda r: f"{r.seconds:.2f}"),
    ("leaked", 6, lambda r: r.leaked_handles),
    ("records", 24, lambda r: ", ".join(f"{n} {k}" for k, n in sorted(r.outcomes.items())) or "-"),
    ("verdict", 7, lambda r: "ok" if r.ok else "FAILED"),
)
