"""Separate hosts on one machine (``e2e.netns``), with real namespaces, links
and a real TCP transfer between two hosts (#23). Runs as root, as CI does
here; the namespaces exist only while a test runs."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from vllm_nixl_hma.e2e import netns

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="network namespaces need root (CI runs as root)"
)

SERVER = textwrap.dedent(
    """
    import socket, sys
    listener = socket.create_server((sys.argv[1], 40123))
    print("listening", flush=True)
    connection, _ = listener.accept()
    received = 0
    while chunk := connection.recv(1 << 16):
        received += len(chunk)
    print(received, flush=True)
    """
)
CLIENT = textwrap.dedent(
    """
    import socket, sys
    connection = socket.create_connection((sys.argv[1], 40123), timeout=10)
    connection.sendall(b"x" * int(sys.argv[2]))
    connection.close()
    """
)


def ours() -> set[str]:
    listed = subprocess.run(["ip", "-j", "netns", "list"], capture_output=True, text=True)
    return {
        entry["name"]
        for entry in json.loads(listed.stdout or "[]")
        if entry["name"].startswith(f"{netns.NAME_PREFIX}{os.getpid()}-")
    }


@contextlib.contextmanager
def serving(host: netns.Host, address: str | None = None):
    """SERVER listening in ``host``'s namespace (on ``address``, by default its
    data address) until the block ends; yields its process."""
    server = subprocess.Popen(
        host.command([sys.executable, "-c", SERVER, address or host.address]),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout.readline().strip() == "listening"
        yield server
    finally:
        server.kill()
        server.wait(10)


def root_addresses() -> str:
    return subprocess.run(["ip", "-j", "addr"], capture_output=True, text=True).stdout


@pytest.mark.parametrize(
    ("rate", "bits"),
    [("10gbit", 10 * 10**9), ("500mbit", 500 * 10**6), ("125mbps", 10**9), ("1.5gbit", 15 * 10**8)],
)
def test_link_rates_parse_as_tc_reads_them(rate, bits):
    assert netns.parse_rate_bits(rate) == bits


@pytest.mark.parametrize("rate", ["fast", "10", "10gb", "1bit"])
def test_a_rate_tc_would_not_read_is_refused(rate):
    with pytest.raises(ValueError, match="link rate"):
        netns.parse_rate_bits(rate)


def test_bytes_between_two_hosts_cross_the_shaped_link_and_nothing_else():
    size = 3 << 20
    with netns.Topology(["prefill0", "decode0"], link_rate="200mbit") as topology:
        prefill, decode = topology.hosts["prefill0"], topology.hosts["decode0"]
        assert ours() == {prefill.namespace, decode.namespace, topology.switch_namespace}
        # the hosts' addresses exist only inside their namespaces
        assert prefill.address not in root_addresses()
        assert decode.address not in root_addresses()
        # no route leaves a host
        out = subprocess.run(
            decode.command(["ip", "route", "get", "8.8.8.8"]), capture_output=True, text=True
        )
        assert out.returncode != 0 and "unreachable" in out.stderr
        assert topology.shaper_rate_bits("decode0") == 200 * 10**6
        before = topology.counters("decode0")
        with serving(prefill) as server:
            subprocess.run(
                decode.command([sys.executable, "-c", CLIENT, prefill.address, str(size)]),
                check=True,
                timeout=60,
            )
            assert int(server.stdout.readline()) == size
        after = topology.counters("decode0")
        # every byte went out of decode's interface (plus TCP/IP headers)
        assert size <= after["tx_bytes"] - before["tx_bytes"] < size * 1.1
        # with its link unplugged, the prefill host is unreachable
        topology.set_link("prefill0", up=False)
        out = subprocess.run(
            decode.command(
                [
                    sys.executable,
                    "-c",
                    CLIENT.replace("timeout=10", "timeout=2"),
                    prefill.address,
                    "1",
                ]
            ),
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert out.returncode != 0
    assert ours() == set()


def test_the_namespaces_go_when_creation_or_the_body_fails():
    with pytest.raises(RuntimeError, match="boom"), netns.Topology(["a", "b"]):
        assert len(ours()) == 3
        raise RuntimeError("boom")
    assert ours() == set()


def test_a_run_stopped_by_sigterm_removes_its_namespaces():
    script = textwrap.dedent(
        """
        import sys, time
        sys.path.insert(0, sys.argv[1])
        from vllm_nixl_hma.e2e import netns
        with netns.Topology(["a", "b"]):
            print("up", flush=True)
            time.sleep(60)
        """
    )
    child = subprocess.Popen(
        [sys.executable, "-c", script, os.getcwd()], stdout=subprocess.PIPE, text=True
    )
    assert child.stdout.readline().strip() == "up"
    prefix = f"{netns.NAME_PREFIX}{child.pid}-"
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert prefix in listed
    child.send_signal(signal.SIGTERM)
    child.wait(20)
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert prefix not in listed


def test_namespaces_of_a_killed_run_are_removed_by_the_next():
    script = textwrap.dedent(
        """
        import sys, time
        sys.path.insert(0, sys.argv[1])
        from vllm_nixl_hma.e2e import netns
        topology = netns.Topology(["a"])
        topology.create()
        print("up", flush=True)
        time.sleep(60)
        """
    )
    child = subprocess.Popen(
        [sys.executable, "-c", script, os.getcwd()], stdout=subprocess.PIPE, text=True
    )
    assert child.stdout.readline().strip() == "up"
    child.kill()  # SIGKILL: no handler runs
    child.wait(10)
    prefix = f"{netns.NAME_PREFIX}{child.pid}-"
    time.sleep(0.2)
    assert prefix in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    removed = netns.remove_stale()
    assert sorted(removed) == sorted([f"{prefix}a", f"{prefix}switch"])
    assert (
        prefix not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    )


def test_without_root_one_line_says_why(mocker):
    mocker.patch.object(netns.os, "geteuid", return_value=1000)
    with pytest.raises(netns.NetworkNamespacesUnavailable, match="only root"):
        netns.Topology(["a"]).create()
    assert ours() == set()


def test_the_driver_thread_reaches_a_host_only_from_inside_a_namespace():
    import socket

    with netns.Topology(["prefill0", "client"]) as topology:
        prefill, client = topology.hosts["prefill0"], topology.hosts["client"]
        root = os.readlink("/proc/thread-self/ns/net")
        with serving(prefill) as server:
            # (never dialled from the root namespace: there the address would
            # take the machine's own default route out)
            with netns.entered(client.namespace):
                assert os.readlink("/proc/thread-self/ns/net") != root
                connection = socket.create_connection((prefill.address, 40123), timeout=10)
                connection.sendall(b"y" * 1000)
                connection.close()
            assert int(server.stdout.readline()) == 1000
        # and back in the root namespace afterwards
        assert os.readlink("/proc/thread-self/ns/net") == root
    assert ours() == set()


def test_entering_a_namespace_that_does_not_exist_leaves_the_thread_where_it_was():
    before = os.readlink("/proc/thread-self/ns/net")
    with pytest.raises(FileNotFoundError), netns.entered(f"{netns.NAME_PREFIX}0-absent"):
        pass
    assert os.readlink("/proc/thread-self/ns/net") == before


def send(from_host: netns.Host, to_address: str, size: int, timeout_s: int) -> int:
    """CLIENT's exit code, sending ``size`` bytes from ``from_host``."""
    client = CLIENT.replace("timeout=10", f"timeout={timeout_s}")
    return subprocess.run(
        from_host.command([sys.executable, "-c", client, to_address, str(size)]),
        capture_output=True,
        timeout=60,
    ).returncode


def test_with_the_data_link_unplugged_the_control_network_still_answers():
    """``prefill-data-path-cut``: a host's data link down, its control
    address (HTTP, side channel) still reached; both networks exist only in
    the namespaces."""
    with netns.Topology(["prefill0", "decode0"], link_rate="200mbit") as topology:
        prefill, decode = topology.hosts["prefill0"], topology.hosts["decode0"]
        assert prefill.control_address not in (prefill.address, decode.control_address)
        assert prefill.control_address not in root_addresses()
        topology.set_link("prefill0", up=False, networks=("data",))
        with serving(prefill, prefill.control_address) as server:
            assert send(decode, prefill.control_address, 1000, 10) == 0
            assert int(server.stdout.readline()) == 1000
        with serving(prefill) as server:
            assert send(decode, prefill.address, 1000, 2) != 0
        topology.set_link("prefill0", up=True, networks=("data",))
        with serving(prefill) as server:
            # plugged back in: reached again (ARP re-resolved after the failed try;
            # on a loaded 2-CPU machine one 10 s try once was not enough)
            assert any(send(decode, prefill.address, 1000, 10) == 0 for _ in range(3))
            assert int(server.stdout.readline()) == 1000
        # unplugged on both networks, the host is gone
        topology.set_link("prefill0", up=False)
        with serving(prefill, prefill.control_address):
            assert send(decode, prefill.control_address, 1, 2) != 0
    assert ours() == set()
