"""Separate hosts on one machine: network namespaces joined by rate-limited veth links (#23).

Each host is a network namespace this run creates, with two interfaces on two
networks, as hosts with a data fabric and a management network have:
``eth0`` holds the host's data address (``address``: what UCX moves the KV
over) and ``eth1`` its control address (``control_address``: HTTP and the
NIXL side channel). The hosts meet in one more namespace, the switch, where
the other end of every host's veth pair is a port of one bridge per network;
no end of any link and no address lives in the root namespace, and no
namespace has a default route, so nothing the hosts send can leave them.
Every host interface and every switch port has a token-bucket shaper (tc
``tbf``) at the link rate, so the link between any two hosts is rate limited
in both directions.

Everything is made with ``ip`` and ``tc`` (iproute2) and removed on every
exit: ``Topology`` is a context manager, its namespaces are also removed at
interpreter exit and on SIGTERM/SIGHUP, and namespaces left by a run that was
killed outright (SIGKILL) carry the prefix ``NAME_PREFIX`` and the creating
process id, so the next run removes those whose process is gone
(``remove_stale``). Without the rights to create namespaces,
``NetworkNamespacesUnavailable`` says so in one line.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import ipaddress
import json
import os
import re
import signal
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

__all__ = [
    "DEFAULT_LINK_RATE",
    "NAME_PREFIX",
    "Host",
    "NetworkNamespacesUnavailable",
    "Topology",
    "enter",
    "entered",
    "parse_rate_bits",
    "remove_stale",
]

#: every namespace a run creates starts with this, then the creator's pid
NAME_PREFIX = "vnh"
#: what ``e2e --separate-hosts`` gives each link unless ``--link-rate`` says otherwise
DEFAULT_LINK_RATE = "10gbit"
#: how long one ``ip``/``tc`` command may take
COMMAND_TIMEOUT_S = 20.0

_RATE = re.compile(r"^(\d+(?:\.\d+)?)\s*([kmgt]?)(bit|bps)$", re.IGNORECASE)
_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


class NetworkNamespacesUnavailable(RuntimeError):
    """This process cannot create network namespaces or links (not root, no
    iproute2, or a kernel without them)."""


def parse_rate_bits(rate: str) -> int:
    """Bits per second of a tc rate such as ``10gbit``, ``500mbit`` or
    ``125mbps`` (bytes per second, as tc reads ``bps``); ValueError otherwise."""
    match = _RATE.match(rate.strip())
    if match is None:
        raise ValueError(f"link rate {rate!r}: expected a number and kbit/mbit/gbit (or ...bps)")
    number, prefix, unit = match.groups()
    bits = float(number) * _UNITS[prefix.lower()] * (8 if unit.lower() == "bps" else 1)
    if bits < 8000:
        raise ValueError(f"link rate {rate!r}: below 8 kbit/s")
    return int(bits)


def _run(*argv: str, namespace: str | None = None, check: bool = True) -> str:
    command = list(argv) if namespace is None else ["ip", "netns", "exec", namespace, *argv]
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, check=False
        )
    except FileNotFoundError as e:
        raise NetworkNamespacesUnavailable(f"{argv[0]} is not installed (iproute2)") from e
    if check and done.returncode != 0:
        raise subprocess.CalledProcessError(
            done.returncode, command, done.stdout, done.stderr.strip()
        )
    return done.stdout


def _namespaces() -> list[str]:
    try:
        listed = _run("ip", "-j", "netns", "list")
    except subprocess.CalledProcessError:
        return []
    return [entry["name"] for entry in json.loads(listed or "[]")]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale() -> list[str]:
    """Remove the namespaces of earlier runs whose creating process is gone;
    return their names."""
    removed = []
    for name in _namespaces():
        match = re.match(rf"^{NAME_PREFIX}(\d+)-", name)
        if match and not _pid_alive(int(match.group(1))):
            _run("ip", "netns", "del", name, check=False)
            removed.append(name)
    return removed


#: setns(2)'s flag for a network namespace
_CLONE_NEWNET = 0x40000000


def _setns(fd: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, _CLONE_NEWNET) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"setns: {os.strerror(errno)}")


def enter(namespace: str) -> None:
    """Move the calling thread into network namespace ``namespace`` for good:
    for a process's first step, before it opens a socket or starts a thread
    (threads it starts afterwards are born there too). ``OSError`` if the
    namespace does not exist or cannot be entered."""
    target = os.open(f"/run/netns/{namespace}", os.O_RDONLY)
    try:
        _setns(target)
    finally:
        os.close(target)


@contextlib.contextmanager
def entered(namespace: str) -> Iterator[None]:
    """The calling thread in network namespace ``namespace`` (made by ``ip
    netns add``) until the block ends, then back in the one it was in: the
    sockets it opens meanwhile belong to that namespace (a driver that talks
    HTTP to hosts whose addresses exist only there). Other threads, and
    processes started from other threads, are not moved."""
    original = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        enter(namespace)
        try:
            yield
        finally:
            _setns(original)
    finally:
        os.close(original)


@dataclass(frozen=True)
class Host:
    """One host of the topology: its namespace, interface and address."""

    name: str
    namespace: str
    address: str
    #: the host's port on the switch (the other end of its veth pair)
    switch_port: str
    interface: str = "eth0"
    #: on the control network (HTTP, side channel): address, switch port, interface
    control_address: str = ""
    control_port: str = ""
    control_interface: str = "eth1"

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.namespace, *argv]


class Topology:
    """Hosts in their own network namespaces on one rate-limited switch.

    ``Topology(["prefill0", "decode0", "router"], link_rate="10gbit")`` makes
    the namespaces on ``__enter__`` (or ``create()``) and removes them on
    ``__exit__`` (or ``remove()``), also when creation failed half-way.
    """

    def __init__(
        self,
        host_names: Sequence[str],
        *,
        link_rate: str = DEFAULT_LINK_RATE,
        subnet: str | None = None,
    ):
        if len(set(host_names)) != len(host_names) or not host_names:
            raise ValueError(f"host names must be distinct and non-empty: {list(host_names)}")
        for name in host_names:
            if not re.fullmatch(r"[a-z][a-z0-9]{0,7}", name):
                raise ValueError(f"host name {name!r}: up to 8 lowercase letters and digits")
        self.link_rate = link_rate
        self.link_rate_bits = parse_rate_bits(link_rate)
        tag = f"{NAME_PREFIX}{os.getpid()}"
        # a private /24 chosen by pid, so that concurrent runs do not share one
        network = ipaddress.ip_network(
            subnet or f"10.{200 + os.getpid() % 50}.{os.getpid() % 250}.0/24"
        )
        addresses = list(network.hosts())
        if len(host_names) > len(addresses):
            raise ValueError(f"subnet {network} has room for {len(addresses)} hosts")
        # the control network: the data network's /24 moved 50 up in the second octet
        octets = str(network.network_address).split(".")
        control = ipaddress.ip_network(
            f"{octets[0]}.{(int(octets[1]) - 50) % 256}.{octets[2]}.0/{network.prefixlen}"
        )
        control_addresses = list(control.hosts())
        self.network = network
        self.control_network = control
        self.switch_namespace = f"{tag}-switch"
        self.hosts: dict[str, Host] = {
            name: Host(
                name=name,
                namespace=f"{tag}-{name}",
                address=str(addresses[index]),
                switch_port=f"p{index}",
                control_address=str(control_addresses[index]),
                control_port=f"c{index}",
            )
            for index, name in enumerate(host_names)
        }
        self._created: list[str] = []
        self._previous_handlers: dict[int, object] = {}

    # ------------------------------------------------------------ life cycle

    def __enter__(self) -> Topology:
        self.create()
        return self

    def __exit__(self, *exc_info) -> None:
        self.remove()

    def create(self) -> None:
        if os.geteuid() != 0:
            raise NetworkNamespacesUnavailable(
                "separate hosts need network namespaces, which only root can create here"
            )
        remove_stale()
        atexit.register(self.remove)
        for signum in (signal.SIGTERM, signal.SIGHUP):
            self._previous_handlers[signum] = signal.signal(signum, self._on_signal)
        try:
            self._create()
        except subprocess.CalledProcessError as e:
            self.remove()
            raise NetworkNamespacesUnavailable(
                f"could not build the hosts' network: {' '.join(e.cmd)}: {e.stderr}"
            ) from e
        except BaseException:
            self.remove()
            raise

    def _add_namespace(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        self._created.append(name)
        _run("ip", "link", "set", "lo", "up", namespace=name)

    def _shape(self, namespace: str, device: str) -> None:
        # burst: at least one MTU and about 1 ms at the rate; latency bounds the queue
        burst_bytes = max(self.link_rate_bits // 8 // 1000, 16 * 1024)
        _run(
            "tc", "qdisc", "add", "dev", device, "root", "tbf",
            "rate", self.link_rate, "burst", str(burst_bytes), "latency", "50ms",
            namespace=namespace,
        )  # fmt: skip

    def _create(self) -> None:
        self._add_namespace(self.switch_namespace)
        for bridge in ("br0", "br1"):  # data, control
            _run("ip", "link", "add", bridge, "type", "bridge", namespace=self.switch_namespace)
            _run("ip", "link", "set", bridge, "up", namespace=self.switch_namespace)
        for host in self.hosts.values():
            self._add_namespace(host.namespace)
            for port, interface, address, network, bridge in (
                (host.switch_port, host.interface, host.address, self.network, "br0"),
                (
                    host.control_port,
                    host.control_interface,
                    host.control_address,
                    self.control_network,
                    "br1",
                ),
            ):
                self._plug(host, port, interface, f"{address}/{network.prefixlen}", bridge)

    def _plug(self, host: Host, port: str, interface: str, address: str, bridge: str) -> None:
        # both ends are made inside the switch namespace, then one is moved:
        # no link ever exists in the root namespace
        _run(
            "ip", "link", "add", port, "type", "veth",
            "peer", "name", interface, "netns", host.namespace,
            namespace=self.switch_namespace,
        )  # fmt: skip
        _run("ip", "link", "set", port, "master", bridge, namespace=self.switch_namespace)
        _run("ip", "link", "set", port, "up", namespace=self.switch_namespace)
        _run("ip", "addr", "add", address, "dev", interface, namespace=host.namespace)
        _run("ip", "link", "set", interface, "up", namespace=host.namespace)
        self._shape(host.namespace, interface)
        self._shape(self.switch_namespace, port)

    def remove(self) -> None:
        """Remove every namespace this topology made (their links go with
        them); safe to call more than once."""
        while self._created:
            _run("ip", "netns", "del", self._created.pop(), check=False)
        for signum, handler in self._previous_handlers.items():
            signal.signal(signum, handler)
        self._previous_handlers.clear()
        atexit.unregister(self.remove)

    def _on_signal(self, signum, frame) -> None:
        self.remove()
        previous = self._previous_handlers.get(signum)
        if callable(previous):
            previous(signum, frame)
        else:
            raise SystemExit(128 + signum)

    # ------------------------------------------------------------ what a run uses

    def set_link(
        self, host_name: str, up: bool, networks: Sequence[str] = ("data", "control")
    ) -> None:
        """Take a host's links down (unplug them at the switch) or up again:
        on both networks (the host is gone), or on ``("data",)`` alone (its
        side channel and HTTP still answer, nothing reaches its KV)."""
        host = self.hosts[host_name]
        ports = {"data": host.switch_port, "control": host.control_port}
        for network in networks:
            _run("ip", "link", "set", ports[network], "up" if up else "down",
                 namespace=self.switch_namespace)  # fmt: skip

    def counters(self, host_name: str, network: str = "data") -> dict[str, int]:
        """Bytes the host's interface on ``network`` sent and received so far."""
        host = self.hosts[host_name]
        interface = host.interface if network == "data" else host.control_interface
        stats = {}
        for direction in ("tx_bytes", "rx_bytes"):
            path = f"/sys/class/net/{interface}/statistics/{direction}"
            stats[direction] = int(_run("cat", path, namespace=host.namespace).strip())
        return stats

    def shaper_rate_bits(self, host_name: str) -> int:
        """The rate tc reports for the shaper on the host's interface, bits/s."""
        host = self.hosts[host_name]
        qdiscs = json.loads(
            _run("tc", "-j", "qdisc", "show", "dev", host.interface, namespace=host.namespace)
        )
        for qdisc in qdiscs:
            if qdisc.get("kind") == "tbf":
                return int(qdisc["options"]["rate"]) * 8  # tc -j reports bytes per second
        raise LookupError(f"no tbf shaper on {host.interface} of {host.namespace}")
