"""Fault injection in the oracle harness: what decode does when prefill is wrong.

Each fault is a cell with one thing broken. A fault passes when decode
reports every affected request failed (within the transfer timeout), no
delivered request holds a wrong slot, nothing was written outside requests,
and no NIXL transfer handle or refused remote agent stays behind.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
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
    prefill_layout: str | None = None
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


FAULTS = (
    Fault(
        "stock-prefill",
        "prefill runs stock NixlConnector (no handshake record) at P TP 2 -> D TP 1, "
        "where the kernel-per-logical ratios differ",
        prefill_connector="NixlConnector",
    ),
    Fault(
        "dead-side-channel",
        "the prefill side channel named in kv_transfer_params is not listening; "
        "then a batch to the live one must still succeed",
        p_tp=1,
        dead_side_channel=True,
    ),
    Fault(
        "mismatched-layout",
        "prefill serves another model layout (one SSM group, other state size)",
        prefill_layout="hybrid-1group",
    ),
    Fault(
        "prefill-killed",
        "prefill processes are killed (SIGKILL) after the handshake, before decode reads",
        p_tp=1,
        kill_prefill=True,
    ),
    Fault(
        "prefill-killed-mid-read",
        "prefill processes are killed (SIGKILL) while decode's reads are in flight "
        "(UCX over TCP, so that the reads take long enough to be interrupted)",
        p_tp=1,
        kill_prefill_mid_read=True,
    ),
    Fault(
        "expired-lease",
        "prefill's lease runs out and it reuses the blocks before decode reads",
        p_tp=1,
        expire_lease=True,
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

    @property
    def ok(self) -> bool:
        if self.requests == 0 or self.silently_wrong_slots or self.leaked_handles:
            return False
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

    if _compat.adapter() != "v033":
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


def _judge(fault: Fault, result: ScenarioResult) -> FaultResult:
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
    )


KILL_AFTER_S = 0.05


def _scenarios(fault: Fault) -> list[Scenario]:
    if fault.kill_prefill_mid_read:
        return [Scenario("mid-block"), Scenario("long", kill_prefill_after_s=KILL_AFTER_S)]
    if fault.kill_prefill:
        return [Scenario("mid-block"), Scenario("mid-block")]
    if fault.dead_side_channel:
        return [Scenario("mid-block", dead_side_channel=True), Scenario("mid-block")]
    return [Scenario("mid-block")]


def run_faults(
    faults: tuple[Fault, ...],
    connector: str,
    workdir: Path,
    progress: Callable[[str], None],
    env: dict[str, str] | None = None,
    layout: str = "hybrid",
) -> list[FaultResult]:
    """``env``: extra environment of the rank processes (e.g. their log file)."""
    layouts = installed_layouts()
    model_dirs = {name: model_dir_for(layouts[name], workdir) for name in layouts}
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
        for fault in map(for_installed_vllm, faults):
            progress(f"fault {fault.name}: {fault.description}")
            cell = Cell(
                layout=layout,
                model_dir=model_dirs[layout],
                p_tp=fault.p_tp,
                d_tp=fault.d_tp,
                connector=connector,
                scenarios=_scenarios(fault),
                prefill_connector=fault.prefill_connector,
                prefill_model_dir=model_dirs[fault.prefill_layout]
                if fault.prefill_layout
                else None,
                kill_prefill_before_scenario=1 if fault.kill_prefill else None,
                expire_lease=fault.expire_lease,
                lose_notifications=fault.lose_notifications,
                remote_agents_must_be_gone=not (
                    fault.expire_lease
                    or fault.lose_notifications
                    or fault.expect_served
                    or fault.dead_engine_kept
                ),
            )
            if fault.kill_prefill_mid_read:
                cell.num_gpu_blocks = 4096
            batches = run_cell(tcp_pool if fault.kill_prefill_mid_read else pool, cell, progress)
            if fault.kill_prefill or fault.kill_prefill_mid_read:
                # a first batch establishes the handshake
                warmup, result = batches
                if not warmup.ok:
                    result.error = f"the batch before the fault failed: {warmup.error}"
                    result.requests_failed = 0
                elif fault.kill_prefill_mid_read and result.seconds <= KILL_AFTER_S:
                    result.error = "the reads finished before prefill was killed"
                    result.requests_failed = 0
            elif fault.dead_side_channel:  # decode must go on serving the live engine
                result, after = batches
                if not after.ok:
                    result.error = f"the batch after the fault failed: {after.error}"
                    result.requests_failed = 0
            else:
                (result,) = batches
            results.append(_judge(fault, result))
    finally:
        pool.close()
        if tcp_pool is not None:
            tcp_pool.close()
    return results


FAULT_COLUMNS = (
    ("fault", 23, lambda r: r.name),
    ("reqs", 4, lambda r: r.requests),
    ("failed", 6, lambda r: r.requests_failed),
    ("recovered", 9, lambda r: r.requests_recovered),
    ("silently wrong slots", 20, lambda r: r.silently_wrong_slots),
    ("seconds", 7, lambda r: f"{r.seconds:.2f}"),
    ("leaked", 6, lambda r: r.leaked_handles),
    ("verdict", 7, lambda r: "ok" if r.ok else "FAILED"),
)
