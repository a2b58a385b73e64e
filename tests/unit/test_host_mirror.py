"""The host mirror a --device cuda rank uses for the oracle, exercised on CPU
tensors (the copy logic is device-independent; no GPU in CI)."""

from __future__ import annotations

import torch

from vllm_nixl_hma.harness.rank import HostMirror


def shared_buffer_views():
    raw = torch.zeros(4 * 64, dtype=torch.int8)
    kv = raw.view(torch.bfloat16).view(4, 2, 4, 4).permute(0, 1, 3, 2)  # strided, like HND
    conv = raw.view(torch.bfloat16).view(4, 32)[:, :12].view(4, 4, 3)
    ssm = torch.as_strided(raw.view(torch.float32), (4, 2, 2), (16, 2, 1), storage_offset=6)
    return {"attn": kv, "mamba": [conv, ssm]}


def test_host_views_address_the_same_slots_and_copies_go_both_ways():
    caches = shared_buffer_views()
    mirror = HostMirror(caches)
    assert len(mirror.host_bytes) == 1  # one shared buffer, seen once
    kv, (conv, ssm) = caches["attn"], caches["mamba"]
    host_kv, host_conv, host_ssm = (mirror.host_view(t) for t in (kv, conv, ssm))
    for device_view, host_view in ((kv, host_kv), (conv, host_conv), (ssm, host_ssm)):
        assert host_view.shape == device_view.shape
        assert host_view.stride() == device_view.stride()
        assert host_view.storage_offset() == device_view.storage_offset()
        assert host_view.untyped_storage().data_ptr() != device_view.untyped_storage().data_ptr()

    host_kv[2, 1, 3, 0] = 7.0
    host_ssm[3, 1, 1] = 3.5
    assert kv[2, 1, 3, 0] == 0  # not pushed yet
    mirror.push()
    assert kv[2, 1, 3, 0] == 7.0 and ssm[3, 1, 1] == 3.5

    conv[1, 2, 2] = -2.0
    mirror.pull()
    assert host_conv[1, 2, 2] == -2.0
