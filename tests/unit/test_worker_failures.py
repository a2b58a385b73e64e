"""What the 0.21.0 worker tells vLLM's scheduler about a request it will not
read, on one KV cache group (no HMA: every dense and sliding-window model
vLLM 0.21.0 runs with a connector) as on several.

Real ``NixlHMAConnectorWorker`` methods and vLLM 0.21.0's own
``start_load_kv`` / ``_background_nixl_handshake`` on a worker built around
real KV cache specs (``harness.read_path``); only the NIXL agent is a fake.
The harness (``check --faults``) and e2e prove the same paths on real bytes
and real engines.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
    NixlConnectorMetadata,
    RemoteMeta,
    ReqMeta,
)
from vllm.v1.core.sched.scheduler import Scheduler

from tests.reference import FULL, MAMBA, SWA
from vllm_nixl_hma import NixlHMAConnectorWorker
from vllm_nixl_hma.harness.read_path import build_read_path_worker
from vllm_nixl_hma.v021.scheduler import (
    FACTORY_PATH,
    NixlHMAScheduler,
    handles_multi_group_failures,
)


def worker_for(mocker, kinds, hma: bool, with_remote: bool = True):
    worker = build_read_path_worker(
        NixlHMAConnectorWorker,
        kinds,
        1,
        1,
        mocker.Mock(),
        logical_blocks=64,
        with_remote=with_remote,
    )
    worker._is_hma_required = hma
    worker.vllm_config = mocker.Mock()
    worker.vllm_config.scheduler_config.scheduler_cls = FACTORY_PATH
    return worker


def request_meta(local_block_ids, engine_id="prefill-engine") -> ReqMeta:
    return ReqMeta(
        local_block_ids=local_block_ids,
        local_physical_block_ids=[],
        tp_size=1,
        remote=RemoteMeta(
            block_ids=[[5, 6, 7]],
            host="127.0.0.1",
            port=5600,
            engine_id=engine_id,
            request_id="p-1",
        ),
    )


@pytest.mark.parametrize(
    ("kinds", "hma", "local_block_ids"),
    [
        ([FULL], False, [[3, 4, 5]]),  # dense, or sliding window folded into one group
        ([FULL, SWA], True, [[3, 4, 5], [0, 8, 9]]),  # sliding window under HMA
        ([FULL, MAMBA], True, [[3, 4, 5], [11]]),  # Mamba hybrid
    ],
)
def test_every_local_block_of_a_request_it_will_not_read_is_reported(
    mocker, kinds, hma, local_block_ids
):
    """Our own refusals (the lease, a late read, unpairable lists) rely on
    this report: without it vLLM 0.21.0 decodes the request on blocks nobody
    filled. Before the fix a one-group worker reported nothing."""
    worker = worker_for(mocker, kinds, hma)
    worker._recving_metadata["req-1"] = request_meta(local_block_ids)
    worker._report_invalid_blocks_of("req-1")
    expected = {b for group in local_block_ids for b in group} - {0}  # 0: the null block
    assert worker._invalid_block_ids == expected


def test_under_hma_a_foreign_scheduler_gets_no_report_and_a_warning(mocker):
    """vLLM 0.21.0's own scheduler raises on several groups' invalid blocks;
    the worker says once that it cannot report instead."""
    worker = worker_for(mocker, [FULL, MAMBA], True)
    worker.vllm_config.scheduler_config.scheduler_cls = "my.Scheduler"
    worker._recving_metadata["req-1"] = request_meta([[3], [11]])
    warning = mocker.patch("vllm_nixl_hma.v021.failures.logger.warning_once")
    worker._report_invalid_blocks_of("req-1")
    assert worker._invalid_block_ids == set()
    warning.assert_called_once()


class OwnScheduler(NixlHMAScheduler):
    """A user's scheduler built on ours (recognised by class, #22)."""


@pytest.mark.parametrize(
    "scheduler_cls",
    [
        FACTORY_PATH,
        "vllm_nixl_hma.v021.scheduler.NixlHMAScheduler",  # named explicitly: once refused
        "vllm_nixl_hma.v021.scheduler.NixlHMAAsyncScheduler",
        NixlHMAScheduler,
        OwnScheduler,
        f"{__name__}.OwnScheduler",
    ],
)
def test_under_hma_our_schedulers_get_the_report_however_they_are_named(mocker, scheduler_cls):
    """Before #22 the worker compared ``scheduler_cls`` with our factory's path as
    a string: naming our own scheduler class was taken for a foreign scheduler,
    and a hybrid request whose KV did not arrive was not reported."""
    worker = worker_for(mocker, [FULL, MAMBA], True)
    worker.vllm_config.scheduler_config.scheduler_cls = scheduler_cls
    worker._recving_metadata["req-1"] = request_meta([[3], [11]])
    worker._report_invalid_blocks_of("req-1")
    assert worker._invalid_block_ids == {3, 11}


@pytest.mark.parametrize(
    "scheduler_cls",
    ["my.Scheduler", "vllm.v1.core.sched.scheduler.Scheduler", Scheduler, "no_dots"],
)
def test_handles_multi_group_failures_refuses_other_schedulers(scheduler_cls):
    assert not handles_multi_group_failures(scheduler_cls)


def test_a_notify_only_request_whose_handshake_fails_leaves_nothing_behind(mocker):
    """vLLM hands over a request with no group at all (the serving layer's
    pre-aborted copy after an error answer). Upstream's handshake-failure
    callback indexes ``local_block_ids[0]`` without HMA: before the fix it
    raised ``IndexError`` there, the request never reached the failed set,
    and its metadata stayed in the worker for good."""
    worker = worker_for(mocker, [FULL], False, with_remote=False)
    worker._handshake_futures = {}
    worker._handshake_lock = threading.RLock()
    worker._handshake_initiation_executor = ThreadPoolExecutor(1)
    worker._ready_requests = queue.Queue()
    worker._reqs_to_process = set()
    worker._reqs_to_send = {}
    # what an unreachable side channel ends in
    mocker.patch.object(worker, "_nixl_handshake", side_effect=TimeoutError("no answer in 5 s"))
    metadata = NixlConnectorMetadata()
    metadata.reqs_to_recv["req-notify"] = request_meta([], engine_id="prefill-unmet")
    errors = []
    callback_logger = mocker.patch("concurrent.futures._base.LOGGER")
    callback_logger.exception.side_effect = lambda *args, **kwargs: errors.append(args)
    worker.start_load_kv(metadata)
    worker._handshake_initiation_executor.shutdown(wait=True)
    assert errors == []  # no callback raised
    # the callback ran to its end: the request is failed, so get_finished
    # (which drops a request the scheduler does not await) takes it out
    assert worker._failed_recv_reqs == {"req-notify"}
    assert not worker._kv_awaited("req-notify")
    assert worker._invalid_block_ids == set()


def test_a_read_in_flight_past_read_timeout_is_failed_and_its_engine_released(mocker):
    """A prefill host that vanished without a reset leaves reads in flight
    (``PROC``) for as long as UCX keeps the connection; upstream waits for
    ever (seen through real engines: ``e2e --separate-hosts``,
    prefill-host-gone). Past ``read_timeout_s`` the read is failed as a
    failed transfer is: handles released, every block reported invalid, the
    engine forgotten; a younger read stays in flight."""
    import time

    worker = worker_for(mocker, [FULL, MAMBA], True)
    worker.__dict__.update(_read_timeout_s=30.0, _lease_margin_s=5.0)
    worker._recving_metadata["req-1"] = request_meta([[3, 4, 5], [11]])
    worker._recving_metadata["req-2"] = request_meta([[6], [12]])
    worker.nixl_wrapper.check_xfer_state.return_value = "PROC"
    transfers = {"req-1": [71, 72], "req-2": [73]}
    worker._reads_posted_at.update({"req-1": time.monotonic() - 31, "req-2": time.monotonic()})
    assert worker._pop_done_transfers(transfers) == {"req-1"}
    assert transfers == {"req-2": [73]}
    released = [c.args[0] for c in worker.nixl_wrapper.release_xfer_handle.call_args_list]
    assert released == [71, 72]
    assert worker._invalid_block_ids == {3, 4, 5, 11}
    assert worker.__dict__["_failed_engine_ids"] == {"prefill-engine"}


def test_a_read_in_flight_when_the_lease_ends_is_failed_without_waiting_for_the_timeout(mocker):
    import time

    worker = worker_for(mocker, [FULL], False)
    worker.__dict__.update(_read_timeout_s=None, _lease_margin_s=5.0)
    worker._recving_metadata["req-1"] = request_meta([[3, 4]])
    worker._lease_deadlines["req-1"] = time.time() + 4.0  # inside the margin
    worker._reads_posted_at["req-1"] = time.monotonic()
    worker.nixl_wrapper.check_xfer_state.return_value = "PROC"
    transfers = {"req-1": [71]}
    assert worker._pop_done_transfers(transfers) == {"req-1"}
    assert transfers == {} and worker._invalid_block_ids == {3, 4}


def test_a_read_nixl_cannot_release_keeps_its_blocks_until_a_release_succeeds(mocker):
    """A handle NIXL did not release may still write into the request's
    blocks: the request stays in flight (its blocks held), and the next
    step releases it and ends the request."""
    import time

    worker = worker_for(mocker, [FULL], False)
    worker.__dict__.update(_read_timeout_s=30.0, _lease_margin_s=5.0)
    worker._recving_metadata["req-1"] = request_meta([[3, 4]])
    worker._reads_posted_at["req-1"] = time.monotonic() - 31
    worker.nixl_wrapper.check_xfer_state.return_value = "PROC"
    worker.nixl_wrapper.release_xfer_handle.side_effect = [RuntimeError("busy"), None]
    transfers = {"req-1": [71]}
    assert worker._pop_done_transfers(transfers) == set()
    assert transfers == {"req-1": [71]}
    assert worker._pop_done_transfers(transfers) == {"req-1"}
    assert transfers == {}


def test_a_read_in_flight_past_slow_read_s_is_counted_and_logged_once_and_kept(mocker):
    """#43: a read in flight longer than ``slow_read_s`` (but short of
    ``read_timeout_s``) stays in flight, and is counted in the connector
    stats, marked in its record and logged once, with NIXL's state of its
    handles; a younger read is neither."""
    import time
    import types

    from vllm_nixl_hma import request_records
    from vllm_nixl_hma.core.transfer_records import DECODE_SLOW_READS
    from vllm_nixl_hma.transfer_stats import NixlHMAKVConnectorStats

    worker = worker_for(mocker, [FULL, MAMBA], True)
    worker.__dict__.update(_read_timeout_s=30.0, _lease_margin_s=5.0, _slow_read_s=2.0)
    worker.xfer_stats = NixlHMAKVConnectorStats()
    warning = mocker.patch.object(request_records.logger, "warning")
    for request_id, blocks in (("req-1", [[3, 4, 5], [11]]), ("req-2", [[6], [12]])):
        worker._recving_metadata[request_id] = request_meta(blocks)
        spec = types.SimpleNamespace(remote_rank=1, local_block_ids=blocks)
        worker._note_read(spec, "prefill-engine", request_id)
    worker.nixl_wrapper.check_xfer_state.return_value = "PROC"
    transfers = {"req-1": [71], "req-2": [72]}
    worker._reads_posted_at.update({"req-1": time.monotonic() - 3, "req-2": time.monotonic()})
    for _ in range(3):  # three steps: found once
        assert worker._pop_done_transfers(transfers) == set()
    assert transfers == {"req-1": [71], "req-2": [72]}
    assert worker.xfer_stats.data[DECODE_SLOW_READS] == [1]
    assert worker._reads_by_request["req-1"].slow and not worker._reads_by_request["req-2"].slow
    (message,) = [call.args[0] for call in warning.call_args_list]
    assert "req-1" in message and "4 kernel blocks" in message and "PROC" in message
    assert "prefill-engine" in message and "[1]" in message
