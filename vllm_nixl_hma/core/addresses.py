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
setting. No vLLM import.
"""

from __future__ import annotations

import ipaddress

from vllm_nixl_hma.core.handshake import HandshakeError

__all__ = ["SETTING", "check_remote_host", "is_local_only"]

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
    elsewhere. Raises ``HandshakeError`` naming the setting and both values."""
    if not isinstance(remote_host, str):
        raise HandshakeError(
            "remote_host (kv_transfer_params)",
            "a host name or address",
            remote_host,
            "the request's kv_transfer_params carry no usable prefill host",
        )
    if not is_local_only(remote_host) or is_local_only(local_host):
        return
    raise HandshakeError(
        f"remote_host (prefill's {SETTING})",
        local_host,
        remote_host,
        f"{remote_host or 'an empty host'} names decode's own machine, not the prefill host: "
        f"set {SETTING} on each prefill engine to its address on the network decode reaches "
        f"(this decode engine's is {local_host})",
    )
