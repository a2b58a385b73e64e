"""vLLM 0.21.0's NIXL scheduler side with a side-channel listener that survives
hostile peers (issue #25): ``NixlHMAConnectorScheduler``.

The listener's logic is ``core.listener``; this module hands it the 0.21 wire
and reports its giving up to the engine.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from vllm_nixl_hma._compat import require_adapter

require_adapter("v021", "vllm_nixl_hma.v021.listener")

from vllm import envs  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (  # noqa: E402
    GET_META_MSG,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.scheduler import (  # noqa: E402
    NixlConnectorScheduler,
)
from vllm.utils.network_utils import make_zmq_path  # noqa: E402

from vllm_nixl_hma.core import listener, upstream_contract  # noqa: E402

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput

__all__ = ["NixlHMAConnectorScheduler"]

WIRE = listener.wire_v021(GET_META_MSG)
LISTENER_PARAMETERS = ("encoded_data", "ready_event", "stop_event", "port")


class NixlHMAConnectorScheduler(NixlConnectorScheduler):
    """``NixlConnectorScheduler`` whose side-channel listener survives bad
    queries, and which stops the engine when that listener gives up."""

    def __init__(self, *args: Any, **kwargs: Any):
        contract = upstream_contract.V021
        upstream_contract.require(
            NixlConnectorScheduler,
            contract.listener_overrides,
            owner_name="NixlConnectorScheduler",
            release=contract.release,
        )
        contract.require_signatures(NixlConnectorScheduler, "listener", contract.listener_overrides)
        listener.require_upstream_listener(
            NixlConnectorScheduler,
            LISTENER_PARAMETERS,
            owner_name="NixlConnectorScheduler",
            release=contract.release,
        )
        super().__init__(*args, **kwargs)
        contract.require_state(
            self, contract.listener_state, NixlConnectorScheduler, "its constructor"
        )

    @staticmethod
    def _nixl_handshake_listener(
        encoded_data: dict[int, Any],
        ready_event: threading.Event,
        stop_event: threading.Event,
        port: int,
    ) -> None:
        """vLLM 0.21.0 ``NixlConnectorScheduler._nixl_handshake_listener``: the
        thread that answers decode's ``(GET_META_MSG, tp_rank)`` queries on a
        ZMQ ROUTER at ``VLLM_NIXL_SIDE_CHANNEL_HOST:port``.

        Why: upstream unpacks each message and looks up its rank with nothing
        caught: one malformed frame, wrong frame count or unknown rank ends
        the thread silently, and no decode can handshake with this prefill
        again. What changes (``core.listener.run_listener``): a bad query is
        dropped unanswered and logged, at most once per peer address per
        30 s; a query of another message type is dropped too (upstream
        warned and answered it); a frame over 64 KiB makes ZMQ drop its peer;
        send and receive queues are bounded (upstream's are not); an
        unexpected error restarts the listener, 5 times a minute at most,
        then it gives up and ``build_connector_meta`` raises. Answers are
        upstream's. Remove when: upstream's listener survives bad queries.
        """
        path = make_zmq_path("tcp", envs.VLLM_NIXL_SIDE_CHANNEL_HOST, port)
        listener.run_listener(path, WIRE, encoded_data, ready_event, stop_event)

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        """vLLM 0.21.0's, then ``ListenerFailedError`` if the listener gave up
        (it could not bind): engine startup fails instead of waiting forever
        for a listener thread that died (upstream's waits on its ready event)."""
        super().set_xfer_handshake_metadata(metadata)
        self.require_listener()

    def build_connector_meta(self, scheduler_output: SchedulerOutput):
        """vLLM 0.21.0's, after ``require_listener``: each scheduler step
        calls it, and an error raised here ends the engine core, whose
        front end then fails ``/health``. Remove with the listener."""
        self.require_listener()
        return super().build_connector_meta(scheduler_output)

    def require_listener(self) -> None:
        """Raise ``core.listener.ListenerFailedError`` when this engine's
        side-channel listener gave up."""
        listener.health_of(self._stop_event).require()
