"""``side_channel.ask`` against vLLM 0.33.0's own side-channel listener (issue #13).

Runs in the vLLM 0.33 environment. The listener is upstream's
(``NixlBaseConnectorScheduler._nixl_handshake_listener``) on a thread, bound
to 127.0.0.1. 0.33 changed the wire: the query names the PP and TP rank, and
the answer carries a second frame, prefill's ``perf_counter`` (its clock
offset estimate). ``ask`` returns the first frame, the payload;
``ask_frames`` both, for a 0.33 lease built on upstream's clock offset.
"""

from __future__ import annotations

import socket
import threading
import time

import msgspec
import pytest

from vllm_nixl_hma.core import side_channel

pytestmark = pytest.mark.vllm033

PAYLOADS = {(0, 0): b"payload of pp 0 tp 0", (0, 1): b"payload of pp 0 tp 1"}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def upstream_listener():
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_scheduler import (
        NixlBaseConnectorScheduler,
    )

    port = free_port()
    ready, stop = threading.Event(), threading.Event()
    thread = threading.Thread(
        target=NixlBaseConnectorScheduler._nixl_handshake_listener,
        args=(dict(PAYLOADS), ready, stop, "127.0.0.1", port),
        daemon=True,
    )
    thread.start()
    assert ready.wait(10)
    yield f"tcp://127.0.0.1:{port}", thread
    stop.set()
    thread.join(timeout=5)


def query(*fields) -> bytes:
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import GET_META_MSG

    return msgspec.msgpack.encode((GET_META_MSG, *fields))


@pytest.mark.parametrize("tp_rank", [0, 1])
def test_a_query_naming_pp_and_tp_rank_gets_that_ranks_payload(upstream_listener, tp_rank):
    path, _ = upstream_listener
    assert side_channel.ask(path, query(0, tp_rank), total_s=5) == PAYLOADS[(0, tp_rank)]


def test_the_answer_carries_prefills_perf_counter_as_a_second_frame(upstream_listener):
    """What 0.33's decode turns into a clock offset (the listener runs in this
    process, so its perf_counter is comparable with ours)."""
    path, _ = upstream_listener
    before = time.perf_counter()
    frames = side_channel.ask_frames(path, query(0, 0), total_s=5)
    after = time.perf_counter()
    assert frames is not None and len(frames) == 2
    assert frames[0] == PAYLOADS[(0, 0)]
    assert before <= msgspec.msgpack.decode(frames[1], type=float) <= after


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_0_21_query_kills_upstream_0_33s_listener(upstream_listener):
    """A vLLM 0.21-style query (no PP rank) is not answered, and 0.33's
    listener thread dies on it (its unpacking raises, nothing catches it):
    mixed 0.21/0.33 peers fail at the handshake, and nothing is read."""
    path, thread = upstream_listener
    assert side_channel.ask(path, query(0), total_s=1.5) is None
    thread.join(timeout=5)
    assert not thread.is_alive()
