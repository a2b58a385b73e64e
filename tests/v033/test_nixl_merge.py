"""What NIXL >= 1.5 does with vLLM 0.33's descriptor ids (issue #13, item 3).

vLLM 0.33 posts one descriptor id per kernel page; our page runs would post
one per run of pages. NIXL 1.5's ``make_prepped_xfer`` merges ids that are
contiguous on both sides into one descriptor, so a logical block's pages
already move as one descriptor and runs would do that twice; the 0.33 glue
therefore keeps upstream's descriptors (``benchmarks/run.py``, tables
``harness`` and ``nixl_merge``). These tests pin that behaviour of the
installed NIXL: if a NIXL release stops merging, they fail, and page runs are
worth bringing back to 0.33. Two real agents in this process, DRAM, UCX on
127.0.0.1.
"""

from __future__ import annotations

import time
import uuid

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.vllm033

PAGE_BYTES = 256
PAGES_PER_BLOCK = 5
LOGICAL_BLOCKS = 12


@pytest.fixture
def agents():
    from nixl._api import nixl_agent, nixl_agent_config

    config = nixl_agent_config(capture_telemetry=True)
    reader = nixl_agent(f"merge-reader-{uuid.uuid4()}", config)
    owner = nixl_agent(f"merge-owner-{uuid.uuid4()}", config)
    num_bytes = LOGICAL_BLOCKS * PAGES_PER_BLOCK * PAGE_BYTES
    generator = torch.Generator().manual_seed(3)
    source = torch.randint(1, 256, (num_bytes,), dtype=torch.uint8, generator=generator)
    target = torch.zeros(num_bytes, dtype=torch.uint8)
    registered = [
        (owner, owner.register_memory(owner.get_reg_descs([source]))),
        (reader, reader.register_memory(reader.get_reg_descs([target]))),
    ]
    owner_name = reader.add_remote_agent(owner.get_agent_metadata())
    # vLLM 0.33's form: one strided row per region, a descriptor per kernel page
    lists = [
        reader.prep_xfer_dlist(
            agent_name,
            np.array(
                [[tensor.data_ptr(), PAGE_BYTES, 0, PAGE_BYTES, num_bytes // PAGE_BYTES]],
                dtype=np.uint64,
            ),
            mem_type="DRAM",
        )
        for agent_name, tensor in (("NIXL_INIT_AGENT", target), (owner_name, source))
    ]
    try:
        yield reader, lists, source, target
    finally:
        for handle in lists:
            reader.release_dlist_handle(handle)
        reader.remove_remote_agent(owner_name)
        for agent, descs in registered:
            agent.deregister_memory(descs)


def read(reader, lists, local_ids, remote_ids) -> int:
    """One READ of these page ids; the descriptors NIXL reports it moved."""
    handle = reader.make_prepped_xfer(
        "READ",
        lists[0],
        np.asarray(local_ids, dtype=np.int32),
        lists[1],
        np.asarray(remote_ids, dtype=np.int32),
    )
    try:
        reader.transfer(handle)
        deadline = time.monotonic() + 30
        while (state := reader.check_xfer_state(handle)) == "PROC":
            assert time.monotonic() < deadline, "NIXL read did not finish in 30 s"
        assert state == "DONE"
        return reader.get_xfer_telemetry(handle).descCount
    finally:
        reader.release_xfer_handle(handle)


def pages_of(logical_blocks, order=None) -> list[int]:
    order = range(PAGES_PER_BLOCK) if order is None else order
    return [block * PAGES_PER_BLOCK + page for block in logical_blocks for page in order]


def block_bytes(tensor, block) -> np.ndarray:
    logical = PAGES_PER_BLOCK * PAGE_BYTES
    return tensor[block * logical : (block + 1) * logical].numpy()


def test_nixl_moves_a_logical_blocks_pages_as_one_descriptor(agents):
    reader, lists, source, target = agents
    local_blocks, remote_blocks = [0, 4, 9], [7, 2, 10]  # no two adjacent on either side
    descriptors = read(reader, lists, pages_of(local_blocks), pages_of(remote_blocks))
    assert descriptors == len(local_blocks)  # 15 page ids, 3 descriptors
    for local, remote in zip(local_blocks, remote_blocks, strict=True):
        assert np.array_equal(block_bytes(target, local), block_bytes(source, remote))


def test_nixl_merges_only_what_is_contiguous_on_both_sides(agents):
    reader, lists, source, target = agents
    # the same pages, each block's pages in reverse order: nothing is contiguous
    reverse = range(PAGES_PER_BLOCK - 1, -1, -1)
    descriptors = read(reader, lists, pages_of([1, 6], reverse), pages_of([3, 8], reverse))
    assert descriptors == 2 * PAGES_PER_BLOCK
    assert np.array_equal(block_bytes(target, 1), block_bytes(source, 3))
    assert np.array_equal(block_bytes(target, 6), block_bytes(source, 8))
