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


@pytest.mark.parametrize(
    ("value", "names"),
    [
        (None, None),
        ("", None),
        ("all", None),
        ("^mlx5_1", None),
        ("lo", ["lo"]),
        ("mlx5_0:1,eth0", ["mlx5_0", "eth0"]),
        (" eth1 , ", ["eth1"]),
    ],
)
def test_ucx_net_devices_parse_to_device_names(value, names):
    assert addresses.ucx_devices(value) == names


DEVICES = {"lo": True, "eth0": False, "mlx5_0": False}


@pytest.mark.parametrize("value", [None, "all", "eth0", "mlx5_0:1", "lo,eth0"])
def test_devices_this_host_has_start(value):
    addresses.check_ucx_devices_exist(value, DEVICES)


def test_a_device_this_host_lacks_stops_startup_naming_the_setting_and_the_devices():
    with pytest.raises(ValueError) as refused:
        addresses.check_ucx_devices_exist("eth9,mlx5_0:1", DEVICES)
    assert str(refused.value).startswith("UCX_NET_DEVICES='eth9,mlx5_0:1' names eth9, which")
    assert "it has lo, eth0, mlx5_0" in str(refused.value)


def test_loopback_only_ucx_cannot_reach_a_prefill_on_another_host():
    with pytest.raises(HandshakeError) as refused:
        addresses.check_ucx_reaches("lo", "10.200.1.2", ["lo"])
    assert "UCX_NET_DEVICES" in str(refused.value) and "10.200.1.2" in str(refused.value)


@pytest.mark.parametrize(
    ("value", "remote"),
    [
        ("lo", "127.0.0.1"),  # one host
        ("lo", "prefill-0"),  # a host name may be this host: not judged
        ("lo,eth0", "10.200.1.2"),
        ("eth0", "10.200.1.2"),
        (None, "10.200.1.2"),
    ],
)
def test_ucx_that_can_reach_the_prefill_host_is_left_alone(value, remote):
    addresses.check_ucx_reaches(value, remote, ["lo"])


def test_this_hosts_devices_are_read_from_sys(tmp_path):
    for name, kind in (("lo", "772"), ("eth0", "1")):
        (tmp_path / "net" / name).mkdir(parents=True)
        (tmp_path / "net" / name / "type").write_text(kind + "\n")
    (tmp_path / "infiniband" / "mlx5_0").mkdir(parents=True)
    assert addresses.host_devices(str(tmp_path)) == {"eth0": False, "lo": True, "mlx5_0": False}
