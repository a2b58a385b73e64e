"""Is the side-channel host a prefill engine advertised one decode can dial?

Prefill advertises ``VLLM_NIXL_SIDE_CHANNEL_HOST`` in every request's
``kv_transfer_params`` (``remote_host``) and decode dials it. Two values send
decode to its own host instead of prefill's: a wildcard (``0.0.0.0``, ``::``),
which is where a listener binds, not an address, and which Linux dials as the
local host; and a loopback address (``127.0.0.0/8``, ``::1``,
``localhost``). On one host both work. Across hosts decode then talks to
itself: no listener (the handshake times out) or its own listener (another
engine answers). Decode refuses them, before dialing, once its own side-channel
host says it is on a network (a routable address), naming the value and the
setting.

The same goes for UCX: ``UCX_NET_DEVICES`` naming a device this host does
not have is refused when the worker starts, and one naming only loopback
devices is refused at a handshake with a prefill on another host (UCX could
reach it through none of them). No vLLM import.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Iterable

from vllm_nixl_hma.core.handshake import AddressRefusedError

__all__ = [
    "SETTING",
    "UCX_SETTING",
    "check_at_start",
    "check_before_dialing",
    "check_remote_host",
    "check_ucx_devices_exist",
    "check_ucx_reaches",
    "host_devices",
    "is_local_only",
    "ucx_devices",
]

#: the environment variable both engines' side channels take their host from
SETTING = "VLLM_NIXL_SIDE_CHANNEL_HOST"
_LOCAL_NAMES = {"localhost", "localhost.localdomain", "ip6-localhost"}


def is_local_only(host: str) -> bool:
    """True for a host that names the dialing machine itself wherever it is
    dialed from: a wildcard, a loopback address, ``localhost``, or nothing."""
    text = host.strip().strip("[]").lower()
    if not text or text in _LOCAL_NAMES:
        return True
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return False  # a host name: whatever it resolves to on decode's host
    return address.is_unspecified or address.is_loopback


def check_remote_host(remote_host: str, local_host: str) -> None:
    """Refuse ``remote_host`` (from ``kv_transfer_params``) when it can only
    name decode's own machine while decode's own side-channel host
    (``local_host``) is an address on a network, i.e. prefill may be
    elsewhere. Raises ``AddressRefusedError`` naming the setting and both values."""
    if not isinstance(remote_host, str):
        raise AddressRefusedError(
            "remote_host (kv_transfer_params)",
            "a host name or address",
            remote_host,
            "the request's kv_transfer_params carry no usable prefill host",
        )
    if not is_local_only(remote_host) or is_local_only(local_host):
        return
    raise AddressRefusedError(
        f"remote_host (prefill's {SETTING})",
        local_host,
        remote_host,
        f"{remote_host or 'an empty host'} names decode's own machine, not the prefill host: "
        f"set {SETTING} on each prefill engine to its address on the network decode reaches "
        f"(this decode engine's is {local_host})",
    )


#: the environment variable UCX takes its network devices from
UCX_SETTING = "UCX_NET_DEVICES"
#: ``/sys/class/net/DEV/type`` of a loopback device (ARPHRD_LOOPBACK)
_ARPHRD_LOOPBACK = 772


def ucx_devices(value: str | None) -> list[str] | None:
    """The devices ``UCX_NET_DEVICES`` names, without a port (``mlx5_0:1`` ->
    ``mlx5_0``); None where it leaves the choice to UCX (unset, empty,
    ``all``, or an exclusion list starting with ``^``)."""
    if value is None or not value.strip() or value.strip().startswith("^"):
        return None
    names = [entry.strip().split(":")[0] for entry in value.split(",") if entry.strip()]
    return None if "all" in names else names


def host_devices(sys_class: str = "/sys/class") -> dict[str, bool]:
    """This host's network and RDMA devices: {name: is loopback}."""
    found: dict[str, bool] = {}
    net = os.path.join(sys_class, "net")
    for name in sorted(os.listdir(net)) if os.path.isdir(net) else ():
        try:
            with open(os.path.join(net, name, "type")) as kind:
                found[name] = int(kind.read().strip()) == _ARPHRD_LOOPBACK
        except (OSError, ValueError):
            found[name] = name == "lo"
    rdma = os.path.join(sys_class, "infiniband")
    for name in sorted(os.listdir(rdma)) if os.path.isdir(rdma) else ():
        found.setdefault(name, False)
    return found


def check_ucx_devices_exist(value: str | None, devices: dict[str, bool]) -> None:
    """Refuse a ``UCX_NET_DEVICES`` that names a device missing from
    ``devices`` (``host_devices``): UCX would find no transport on it.
    ValueError naming the setting, the value and the devices there are."""
    missing = [name for name in ucx_devices(value) or () if name not in devices]
    if missing:
        raise ValueError(
            f"{UCX_SETTING}={value!r} names {', '.join(missing)}, which this host does not "
            f"have (it has {', '.join(devices) or 'none'}); name the device that reaches the "
            "other engines, or leave it unset"
        )


def _is_remote_address(host: str) -> bool:
    """An address literal of another machine (a host name may resolve to
    this one: not judged)."""
    try:
        address = ipaddress.ip_address(host.strip().strip("[]"))
    except ValueError:
        return False
    return not (address.is_unspecified or address.is_loopback)


def check_ucx_reaches(value: str | None, remote_host: str, loopback: Iterable[str]) -> None:
    """Refuse a handshake with a prefill engine at ``remote_host``, an address
    of another machine, when ``UCX_NET_DEVICES`` names loopback devices only:
    UCX has no device that reaches another host. Raises ``AddressRefusedError``."""
    names = ucx_devices(value)
    if not names or not set(names) <= set(loopback) or not _is_remote_address(remote_host):
        return
    raise AddressRefusedError(
        UCX_SETTING,
        value,
        f"prefill at {remote_host}",
        f"{value} reaches this host only; name the device that reaches the prefill host "
        "(eth0, or an RDMA device such as mlx5_0:1) on every engine",
    )


def check_at_start(environ=os.environ) -> None:
    """The worker's start: ``UCX_NET_DEVICES`` names devices this host has
    (not judged where ``/sys`` shows none)."""
    devices = host_devices()
    if devices:
        check_ucx_devices_exist(environ.get(UCX_SETTING), devices)


def check_before_dialing(remote_host, local_host: str, environ=os.environ) -> None:
    """Decode's checks of a prefill side-channel host before dialing it, on
    both releases: ``check_remote_host``, then ``check_ucx_reaches``."""
    check_remote_host(remote_host, local_host)
    loopback = [name for name, is_loopback in host_devices().items() if is_loopback] or ["lo"]
    check_ucx_reaches(environ.get(UCX_SETTING), remote_host, loopback)
