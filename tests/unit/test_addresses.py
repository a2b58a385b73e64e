"""``core.addresses``: which advertised side-channel hosts decode refuses to
dial (vLLM-free: runs on every release's environment)."""

from __future__ import annotations

import pytest

from vllm_nixl_hma.core import addresses
from vllm_nixl_hma.core.handshake import HandshakeError


@pytest.mark.parametrize(
    "host",
    [
        "0.0.0.0",
        "::",
        "[::]",
        "127.0.0.1",
        "127.3.4.5",
        "::1",
        "[::1]",
        "localhost",
        "LOCALHOST",
        "",
    ],
)
def test_wildcards_loopback_and_nothing_name_the_dialing_machine(host):
    assert addresses.is_local_only(host)


@pytest.mark.parametrize("host", ["10.200.1.2", "192.0.2.7", "fd00::5", "prefill-0.svc", "host"])
def test_addresses_and_host_names_do_not(host):
    assert not addresses.is_local_only(host)


@pytest.mark.parametrize("remote", ["0.0.0.0", "127.0.0.1", "::1", "localhost"])
def test_decode_on_a_network_refuses_a_prefill_host_that_names_itself(remote):
    with pytest.raises(HandshakeError) as refused:
        addresses.check_remote_host(remote, "10.200.1.3")
    message = str(refused.value)
    assert "VLLM_NIXL_SIDE_CHANNEL_HOST" in message
    assert repr(remote) in message and "'10.200.1.3'" in message


@pytest.mark.parametrize(
    ("remote", "local"),
    [
        ("127.0.0.1", "127.0.0.1"),  # one host: loopback reaches prefill
        ("0.0.0.0", "localhost"),  # vLLM's default host on decode: one host
        ("10.200.1.2", "10.200.1.3"),
        ("prefill-0.svc", "10.200.1.3"),
    ],
)
def test_what_can_reach_prefill_is_dialed(remote, local):
    addresses.check_remote_host(remote, local)


@pytest.mark.parametrize("remote", [None, 5600, ["10.0.0.1"]])
def test_a_host_that_is_not_a_string_is_refused(remote):
    """``kv_transfer_params`` come from the request body."""
    with pytest.raises(HandshakeError, match="remote_host"):
        addresses.check_remote_host(remote, "127.0.0.1")
