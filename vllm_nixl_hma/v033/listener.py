"""vLLM 0.33.0's NIXL pull scheduler with a side-channel listener that survives
hostile peers (issue #25): ``NixlHMAConnectorScheduler``.

The listener's logic is ``core.listener``; this module hands it the 0.33 wire
and reports its giving up to the engine.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from vllm_nixl_hma._compat import require_adapter

require_adapter("v033", "vllm_nixl_hma.v033.listener")

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (  # noqa: E402
    GET_META_MSG,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import (  # noqa: E402
    NixlPullConnectorScheduler,
)
from vllm.utils.network_utils import make_zmq_path  # noqa: E402

from vllm_nixl_hma.core import listener, upstream_contract  # noqa: E402

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput

__all__ = ["NixlHMAConnectorScheduler"]

WIRE = listener.wire_v033(GET_META_MSG)
LISTENER_PARAMETERS = ("encoded_data", "ready_event", "stop_event", "host", "port")


class NixlHMAConnectorScheduler(NixlPullConnectorScheduler):
    """``NixlPullConnectorScheduler`` whose side-channel listener survives bad
    queries, and which stops the engine when that listener gives up."""

    def __init__(self, *args: Any, **kwargs: Any):
        contract = upstream_contract.installed()
        upstream_contract.require(
            NixlPullConnectorScheduler,
            contract.listener_overrides,
            owner_name="NixlPullConnectorScheduler",
            release=contract.release,
        )
        contract.require_signatures(
            NixlPullConnectorScheduler, "listener", contract.listener_overrides
        )
        listener.require_upstream_listener(
            NixlPullConnectorScheduler,
            LISTENER_PARAMETERS,
            owner_name="NixlPullConnectorScheduler",
            release=contract.release,
        )
        super().__init__(*args, **kwargs)
        contract.require_state(
            self, contract.listener_state, NixlPullConnectorScheduler, "its constructor"
        )

    @staticmethod
    def _nixl_handshake_listener(
        encoded_data: dict[tuple[int, int], Any],
        ready_event: threading.Event,
        stop_event: threading.Event,
        host: str,
        port: int,
    ) -> None:
        """vLLM 0.33.0 ``NixlBaseConnectorScheduler._nixl_handshake_listener``:
        the thread that answers decode's ``(GET_META_MSG, pp_rank, tp_rank)``
        queries on a ZMQ ROUTER at ``host:port`` with the payload and its
        ``perf_counter`` (decode's clock offset).

        Why: upstream unpacks each message and looks up its ranks with
        nothing caught: one malformed frame, wrong frame count, unknown rank
        or a vLLM 0.21 query ends the thread silently, and no decode can
        handshake with this prefill again. What changes
        (``core.listener.run_listener``): a bad query is dropped unanswered
        and logged, at most once per peer address per 30 s; a query of
        another message type is dropped too (upstream warned and answered
        it); a frame over 64 KiB makes ZMQ drop its peer; send and receive
        queues are bounded (upstream's are not); an unexpected error restarts
        the listener, 5 times a minute at most, then it gives up and
        ``build_connector_meta`` raises. Answers are upstream's, read from
        ``encoded_data`` at each query (the scheduler updates it). Remove
        when: upstream's listener survives bad queries.
        """
        path = make_zmq_path("tcp", host, port)
        listener.run_listener(path, WIRE, encoded_data, ready_event, stop_event)

    def set_xfer_handshake_metadata(self, metadata: dict[tuple[int, int], Any]) -> None:
        """vLLM 0.33.0's, then ``ListenerFailedError`` if the listener gave up
        (it could not bind): engine startup fails instead of waiting forever
        for a listener thread that died (upstream's waits on its ready event)."""
        super().set_xfer_handshake_metadata(metadata)
        self.require_listener()

    def build_connector_meta(self, scheduler_output: SchedulerOutput):
        """vLLM 0.33.0's, after ``require_listener``: each scheduler step
        calls it, and an error raised here ends the engine core, whose
        front end then fails ``/health``. Remove with the listener."""
        self.require_listener()
        return super().build_connector_meta(scheduler_output)

    def require_listener(self) -> None:
        """Raise ``core.listener.ListenerFailedError`` when this engine's
        side-channel listener gave up."""
        listener.health_of(self._stop_event).require()
