"""The link benchmark (``python benchmarks/run.py --only link [--link-rate R ...]``, root).

One request of 70 MiB and more moved from a prefill host to a decode host
across a rate-limited link, the way ``e2e --separate-hosts`` joins them
(``vllm_nixl_hma.e2e.netns``: one network namespace per host, veth links
through a switch namespace, ``tbf`` at the link rate on every link end, UCX
over TCP on the data interface, the side channel on the control network).
Side by side, in one run and on one topology per link rate:

- ``ours`` and ``stock``: the check harness's real engines (one rank process
  per engine, each inside its host's namespace; the release's KV layout,
  connector worker and side-channel handshake), prefill TP 1 -> decode TP 1,
  a layout both connectors read right (every slot is checked); one warm-up
  batch that also makes the handshake and UCX's connection, then one request
  of 3600 logical blocks per repeat. Time: from decode's post to the last
  completion.
- ``raw_nixl``: two bare NIXL agents, one per host, reading the same number
  of bytes with one descriptor (what the link allows NIXL with no connector).
- ``tcp``: one TCP stream of the same bytes between the two hosts' data
  addresses, Python sockets, the receiver asking for each copy (what the link
  allows any TCP reader on this machine).
- ``link``: the shaper's rate.

``link_bytes_over_kv``: what prefill's data interface sent while the
connector cells ran, over the KV bytes decode read (above 1: the KV crossed
the link, plus TCP/IP headers and UCX's own messages).
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import statistics
import tempfile
import time
import uuid
from pathlib import Path

#: every agent's NIXL threads, as benchmarks/run.py configures them
NIXL_THREADS = int(os.environ.get("BENCH_NIXL_THREADS", "4"))
DEFAULT_LINK_RATES = ("10gbit", "1gbit")
#: (layout, --block-size of both engines): None is the attention backend's choice
LINK_CELLS = (("hybrid", None), ("dense", 128))
#: how long one raw read or one TCP copy may take before the benchmark gives up
COPY_TIMEOUT_S = 120.0
#: UCX as a host without RDMA talks to another: TCP on the data interface (on
#: one machine UCX would otherwise copy through shared memory, past the link)
UCX_ACROSS_HOSTS = {"UCX_NET_DEVICES": "eth0", "UCX_TLS": "tcp"}
TCP_CHUNK_BYTES = 4 << 20


def _raw_owner(namespace: str, num_bytes: int, connection) -> None:
    """Prefill's side of raw NIXL: register twice ``num_bytes`` of ones, hand
    out the agent's metadata and the buffer's address, wait for the reader."""
    from vllm_nixl_hma.e2e import netns

    netns.enter(namespace)
    os.environ.update(UCX_ACROSS_HOSTS)
    import torch
    from nixl._api import nixl_agent, nixl_agent_config

    agent = nixl_agent(f"link-owner-{uuid.uuid4()}", nixl_agent_config(num_threads=NIXL_THREADS))
    source = torch.ones(2 * num_bytes, dtype=torch.uint8)
    registered = agent.register_memory(agent.get_reg_descs([source]))
    connection.send((agent.get_agent_metadata(), source.data_ptr()))
    connection.recv()  # the reader is done
    agent.deregister_memory(registered)


def _descriptors(address: int, num_bytes: int, chunk_bytes: int):
    """``num_bytes`` from ``address`` as one descriptor (``chunk_bytes`` 0), or
    as descriptors of ``chunk_bytes`` with a gap of the same size after each
    (NIXL merges descriptors that are contiguous on both sides)."""
    import numpy as np

    if not chunk_bytes:
        return np.array([[address, num_bytes, 0]], dtype=np.int64)
    count = -(-num_bytes // chunk_bytes)
    descs = np.zeros((count, 3), dtype=np.int64)
    descs[:, 0] = address + 2 * chunk_bytes * np.arange(count)
    descs[:, 1] = chunk_bytes
    descs[-1, 1] = num_bytes - chunk_bytes * (count - 1)
    return descs


def _raw_reader(
    namespace: str, num_bytes: int, owner, repeats: int, chunk_bytes: int, connection
) -> None:
    """Decode's side of raw NIXL: read ``num_bytes`` of the owner's buffer
    ``repeats`` times (after one warm-up read that also connects), in one
    descriptor per side or in descriptors of ``chunk_bytes``; send back the
    seconds of each read."""
    from vllm_nixl_hma.e2e import netns

    netns.enter(namespace)
    os.environ.update(UCX_ACROSS_HOSTS)
    import torch
    from nixl._api import nixl_agent, nixl_agent_config

    metadata, address = owner
    agent = nixl_agent(f"link-reader-{uuid.uuid4()}", nixl_agent_config(num_threads=NIXL_THREADS))
    target = torch.zeros(2 * num_bytes, dtype=torch.uint8)
    registered = agent.register_memory(agent.get_reg_descs([target]))
    owner_name = None
    seconds = []
    try:
        owner_name = agent.add_remote_agent(metadata)
        local_descs = _descriptors(target.data_ptr(), num_bytes, chunk_bytes)
        local = agent.get_xfer_descs(local_descs, "DRAM")
        remote = agent.get_xfer_descs(_descriptors(address, num_bytes, chunk_bytes), "DRAM")
        for index in range(repeats + 1):
            target.zero_()
            started = time.perf_counter()
            handle = agent.initialize_xfer("READ", local, remote, owner_name)
            agent.transfer(handle)
            try:
                deadline = started + COPY_TIMEOUT_S
                while (state := agent.check_xfer_state(handle)) == "PROC":
                    if time.perf_counter() > deadline:
                        raise TimeoutError(f"raw NIXL read not done in {COPY_TIMEOUT_S:.0f} s")
                if state != "DONE":
                    raise RuntimeError(f"raw NIXL read ended {state}")
            finally:
                agent.release_xfer_handle(handle)
            if index:
                seconds.append(time.perf_counter() - started)
            moved = sum(int(target[a - target.data_ptr() :][:n].sum()) for a, n, _ in local_descs)
            if moved != num_bytes:
                raise RuntimeError(f"raw NIXL read moved {moved} of {num_bytes} bytes")
        connection.send(("ok", seconds))
    except Exception as e:  # reported to the parent, which raises
        connection.send(("error", f"{type(e).__name__}: {e}"))
    finally:
        if owner_name is not None:
            agent.remove_remote_agent(owner_name)
        agent.deregister_memory(registered)


def _tcp_sender(namespace: str, address: str, num_bytes: int, connection) -> None:
    """Prefill's side of the TCP copy: listen on the data address, send
    ``num_bytes`` each time the receiver asks, until it closes."""
    from vllm_nixl_hma.e2e import netns

    netns.enter(namespace)
    payload = memoryview(b"\x01" * num_bytes)
    with socket.create_server((address, 0)) as server:
        server.settimeout(COPY_TIMEOUT_S)
        connection.send(server.getsockname()[1])
        peer, _ = server.accept()
        with peer:
            peer.settimeout(COPY_TIMEOUT_S)
            while peer.recv(1):
                peer.sendall(payload)


def _tcp_receiver(
    namespace: str, address: str, port: int, num_bytes: int, repeats: int, connection
):
    """Decode's side: ask for the bytes ``repeats`` times after one warm-up;
    send back the seconds from each request to its last byte."""
    from vllm_nixl_hma.e2e import netns

    netns.enter(namespace)
    buffer = bytearray(num_bytes)
    view = memoryview(buffer)
    seconds = []
    try:
        with socket.create_connection((address, port), timeout=COPY_TIMEOUT_S) as stream:
            for index in range(repeats + 1):
                started = time.perf_counter()
                stream.sendall(b"g")
                received = 0
                while received < num_bytes:
                    count = stream.recv_into(
                        view[received:], min(TCP_CHUNK_BYTES, num_bytes - received)
                    )
                    if not count:
                        raise ConnectionError("the sender closed mid-copy")
                    received += count
                if index:
                    seconds.append(time.perf_counter() - started)
        connection.send(("ok", seconds))
    except Exception as e:
        connection.send(("error", f"{type(e).__name__}: {e}"))


def _answer(end, process, timeout_s: float, who: str):
    """The first message on ``end`` from ``process``; raises once the process
    has ended without one, or after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not end.poll(0.5):
        if not process.is_alive():
            raise RuntimeError(f"{who}'s process ended (exit code {process.exitcode}) unanswered")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{who} did not answer in {timeout_s:.0f} s")
    return end.recv()


def _pair(owner_target, owner_args, reader_target, reader_args_of) -> list[float]:
    """Run the owner's process, hand what it sends first to the reader's, and
    return the reader's seconds (both processes ended, whatever happened)."""
    context = multiprocessing.get_context("spawn")
    owner_end, owner_child = context.Pipe()
    reader_end, reader_child = context.Pipe()
    owner = context.Process(target=owner_target, args=(*owner_args, owner_child), daemon=True)
    owner.start()
    reader = None
    try:
        first = _answer(owner_end, owner, COPY_TIMEOUT_S, "the owner")
        reader = context.Process(
            target=reader_target, args=(*reader_args_of(first), reader_child), daemon=True
        )
        reader.start()
        status, reply = _answer(reader_end, reader, COPY_TIMEOUT_S * 4, "the reader")
        if status != "ok":
            raise RuntimeError(reply)
        return reply
    finally:
        try:
            owner_end.send("done")
        except (BrokenPipeError, OSError):
            pass
        for process in (reader, owner):
            if process is not None:
                process.join(timeout=30)
                if process.is_alive():
                    process.kill()
                    process.join(timeout=10)


def raw_nixl_seconds(topology, num_bytes: int, repeats: int, chunk_bytes: int = 0) -> list[float]:
    """Seconds of raw NIXL reads of ``num_bytes`` from the prefill host to the
    decode host: one descriptor, or descriptors of ``chunk_bytes``."""
    prefill, decode = topology.hosts["prefill"], topology.hosts["decode"]
    return _pair(
        _raw_owner,
        (prefill.namespace, num_bytes),
        _raw_reader,
        lambda owner: (decode.namespace, num_bytes, owner, repeats, chunk_bytes),
    )


def tcp_seconds(topology, num_bytes: int, repeats: int) -> list[float]:
    prefill, decode = topology.hosts["prefill"], topology.hosts["decode"]
    return _pair(
        _tcp_sender,
        (prefill.namespace, prefill.address, num_bytes),
        _tcp_receiver,
        lambda port: (decode.namespace, prefill.address, port, num_bytes, repeats),
    )


def link_rows(quick: bool, progress, rates=DEFAULT_LINK_RATES) -> list[dict]:
    """One row per (link rate, layout): ours, stock, raw NIXL and TCP across it."""
    import harness_cells  # benchmarks/harness_cells.py

    from vllm_nixl_hma.e2e import netns
    from vllm_nixl_hma.harness import coordinator
    from vllm_nixl_hma.harness.model_shapes import installed_layouts

    repeats = 2 if quick else 5
    scenarios = [coordinator.Scenario("mid-block")] + [
        coordinator.Scenario("one-long") for _ in range(repeats)
    ]
    layouts = installed_layouts()
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-link-") as root:
        model_dirs = {
            layout: coordinator.model_dir_for(layouts[layout], Path(root))
            for layout, _ in LINK_CELLS
        }
        for rate in rates:
            with netns.Topology(["prefill", "decode"], link_rate=rate) as topology:
                prefill, decode = topology.hosts["prefill"], topology.hosts["decode"]
                before = topology.counters("prefill")["tx_bytes"]
                results = coordinator.run_cells(
                    harness_cells.one_to_one_cells(
                        LINK_CELLS,
                        model_dirs,
                        scenarios,
                        prefill_host=prefill.control_address,
                        decode_host=decode.control_address,
                    ),
                    progress,
                    env=UCX_ACROSS_HOSTS,
                    namespaces=[prefill.namespace, decode.namespace],
                )
                link_tx_bytes = topology.counters("prefill")["tx_bytes"] - before
                kv_bytes = sum(r.bytes for r in results)
                by_layout = harness_cells.measured_by_layout(
                    results, LINK_CELLS, repeats + 1, f" at {rate}"
                )
                for layout, _ in LINK_CELLS:
                    measured = by_layout[layout]
                    num_bytes = measured["ours"][0].bytes
                    progress(f"link {rate}: raw NIXL and TCP, {num_bytes / 2**20:.0f} MiB")
                    seconds = {name: [r.seconds for r in rs] for name, rs in measured.items()}
                    seconds["raw_nixl"] = raw_nixl_seconds(topology, num_bytes, repeats)
                    # raw NIXL in as many descriptors as NIXL moved for ours
                    chunk_bytes = -(-num_bytes // measured["ours"][0].descriptors)
                    seconds["raw_nixl_ours_descs"] = raw_nixl_seconds(
                        topology, num_bytes, repeats, chunk_bytes
                    )
                    seconds["tcp"] = tcp_seconds(topology, num_bytes, repeats)
                    rows.append(
                        link_row(
                            rate,
                            topology.link_rate_bits,
                            layout,
                            num_bytes,
                            {name: rs[0].descriptors for name, rs in measured.items()},
                            seconds,
                            link_tx_bytes / kv_bytes,
                        )
                    )
    return rows


def link_row(rate, rate_bits, layout, num_bytes, descriptors, seconds, link_bytes_over_kv) -> dict:
    """A table row: GB/s per mover (bytes over the median seconds) and the ratios;
    ``descriptors``: what NIXL moved per request for ours and stock."""
    gb_s = {name: num_bytes / statistics.median(s) / 1e9 for name, s in seconds.items()}
    link_gb_s = rate_bits / 8 / 1e9
    return {
        "link_rate": rate,
        "layout": layout,
        "MiB": round(num_bytes / 2**20, 1),
        "descs_ours": descriptors["ours"],
        "descs_stock": descriptors["stock"],
        "link_GB_s": round(link_gb_s, 3),
        "ours_GB_s": round(gb_s["ours"], 3),
        "stock_GB_s": round(gb_s["stock"], 3),
        "raw_nixl_GB_s": round(gb_s["raw_nixl"], 3),
        "raw_nixl_ours_descs_GB_s": round(gb_s["raw_nixl_ours_descs"], 3),
        "tcp_GB_s": round(gb_s["tcp"], 3),
        "ours_over_stock": round(gb_s["ours"] / gb_s["stock"], 3),
        "ours_over_raw_nixl": round(gb_s["ours"] / gb_s["raw_nixl"], 3),
        "ours_over_raw_nixl_ours_descs": round(gb_s["ours"] / gb_s["raw_nixl_ours_descs"], 3),
        "ours_over_link": round(gb_s["ours"] / link_gb_s, 3),
        "tcp_over_link": round(gb_s["tcp"] / link_gb_s, 3),
        "link_bytes_over_kv": round(link_bytes_over_kv, 3),
    }
