"""e2e's host-memory ``batch_memcpy`` for vLLM's Mamba state copies (#26)."""

from __future__ import annotations

import pytest
import torch
from vllm.v1.worker import mamba_utils

from vllm_nixl_hma.e2e import cpu_mamba_copy


def test_copies_each_row_and_nothing_else():
    source = torch.arange(64, dtype=torch.float32)
    destination = torch.full((64,), -1.0)
    step = source.element_size()
    rows = [(0, 8, 4), (20, 40, 6)]  # (source element, destination element, elements)
    cpu_mamba_copy.batch_memcpy(
        torch.tensor([source.data_ptr() + s * step for s, _, _ in rows], dtype=torch.int64),
        torch.tensor([destination.data_ptr() + d * step for _, d, _ in rows], dtype=torch.int64),
        torch.tensor([n * step for _, _, n in rows], dtype=torch.int32),
    )
    expected = torch.full((64,), -1.0)
    expected[8:12] = source[0:4]
    expected[40:46] = source[20:26]
    assert torch.equal(destination, expected)


def test_rows_of_different_lengths_are_refused_before_copying():
    with pytest.raises(ValueError, match="rows differ"):
        cpu_mamba_copy.batch_memcpy(
            torch.tensor([1, 2]), torch.tensor([3]), torch.tensor([4, 5], dtype=torch.int32)
        )


def test_only_the_variable_installs_it(monkeypatch):
    shipped = mamba_utils.batch_memcpy
    monkeypatch.delenv(cpu_mamba_copy.ENV, raising=False)
    assert cpu_mamba_copy.apply_from_env() is False
    assert mamba_utils.batch_memcpy is shipped
    monkeypatch.setenv(cpu_mamba_copy.ENV, "1")
    monkeypatch.setattr(mamba_utils, "batch_memcpy", shipped)
    monkeypatch.setattr(mamba_utils, "_vllm_nixl_hma_cpu_mamba_copy", False, raising=False)
    assert cpu_mamba_copy.apply_from_env() is True
    assert mamba_utils.batch_memcpy is cpu_mamba_copy.batch_memcpy
    assert cpu_mamba_copy.apply_from_env() is True  # idempotent
    assert mamba_utils.batch_memcpy is cpu_mamba_copy.batch_memcpy
