"""The e2e ticket faults' own parts (``e2e.faults``): what each forged
request carries, that the re-signed transfer faults still reach the check
behind the ticket, the victim's prompt length and the fake prefill."""

from __future__ import annotations

import socket
import time

import pytest

from vllm_nixl_hma.core import lease, tickets
from vllm_nixl_hma.e2e import faults

KEYS = tickets.parse_keys("e2e " + "k" * 64, "test")
BOOK = tickets.TicketBook(KEYS)


def signed(request_id="p-1", blocks=((3, 4, 5), (9,))):
    return BOOK.signed(
        {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": "prefill",
            "remote_request_id": request_id,
            "remote_host": "10.0.0.2",
            "remote_port": 5600,
            "remote_block_ids": [list(group) for group in blocks],
            "tp_size": 1,
            lease.PARAM: time.time() + 480.0,
        }
    )


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("other-request-ticket", "forged or edited"),
        ("edited-ticket", "forged or edited"),
        ("fake-prefill-ticket", "forged or edited"),
    ],
)
def test_each_forged_request_fails_the_ticket_for_the_reason_the_e2e_test_expects(name, reason):
    own, victim = signed(), signed("p-victim", ((7, 8, 9), (12,)))
    forged = faults.forged_params(name, own, victim, ("127.0.0.1", 1))
    assert BOOK.refusal(forged).reason == reason
    if name == "other-request-ticket":
        assert forged["remote_block_ids"] == victim["remote_block_ids"]
        assert forged["remote_request_id"] == own["remote_request_id"]
    if name == "fake-prefill-ticket":
        assert (forged["remote_host"], forged["remote_port"]) == ("127.0.0.1", 1)


def test_a_replayed_ticket_is_the_very_params_and_fails_only_the_second_time():
    params = signed()
    replay = faults.forged_params("replayed-ticket", params)
    assert replay == params
    assert BOOK.refusal(params) is None
    assert BOOK.refusal(replay).reason == "replayed"


@pytest.mark.parametrize(
    "name", ["side-channel-unreachable", "lease-expired", "unpairable-block-lists"]
)
def test_the_transfer_faults_are_signed_again_so_the_check_behind_the_ticket_is_reached(name):
    params = signed()
    broken = faults.broken_params(name, params, dead_port=1, keys=KEYS)
    assert broken != params
    assert tickets.TicketBook(KEYS).refusal(broken) is None
    unsigned = faults.broken_params(name, params, dead_port=1)
    assert tickets.TicketBook(KEYS).refusal(unsigned).reason == "forged or edited"


def test_an_unedited_fault_keeps_prefills_own_ticket():
    params = signed()
    assert faults.broken_params("prefill-killed", params, 1, KEYS) == params


@pytest.mark.parametrize("n", [600, 607, 608, 639, 640, 641])
def test_the_victims_prompt_fills_as_many_blocks_of_any_multiple_of_16(n):
    victim = faults.victim_prompt_tokens(n)
    assert victim != n
    for block in (16, 32, 48, 64, 160, 1024):
        assert -(-victim // block) == -(-n // block), block


def test_the_fake_prefill_counts_who_dials_it_and_closes():
    with faults.fake_prefill() as fake:
        for _ in range(3):
            with socket.create_connection(fake.address, timeout=5):
                pass
        deadline = time.monotonic() + 5
        while fake.connections < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert fake.connections == 3
        address = fake.address
    with pytest.raises(OSError):
        socket.create_connection(address, timeout=2).close()


def stock_params():
    """What a stock NixlConnector prefill returns: no lease, no ticket."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "prefill",
        "remote_request_id": "p-1",
        "remote_host": "127.0.0.1",
        "remote_port": 5600,
        "remote_block_ids": [3, 4, 5],
        "tp_size": 1,
    }


@pytest.mark.parametrize("name", faults.FAULTS)
def test_a_stock_run_runs_every_fault_its_params_can_carry_and_says_why_it_skips_the_others(name):
    """#41: ``e2e --faults --connector NixlConnector`` stopped with a
    KeyError on the lease field; now each fault either runs on stock's
    params or is skipped under both policies with its reason."""
    cells = [faults.skipped(name, policy, "NixlConnector") for policy in faults.POLICIES]
    if name in faults.NEEDS_OURS:
        assert all(c.outcome == "skipped" and "stock" in c.error and not c.ok for c in cells)
    else:
        assert cells == [None, None]
        own, victim = stock_params(), {**stock_params(), "remote_block_ids": [7, 8, 9]}
        if name in faults.TICKET_FAULTS:
            faults.forged_params(name, own, victim, ("127.0.0.1", 1))
        else:
            faults.broken_params(name, own, dead_port=1)
    # ours runs every fault
    assert faults.skipped(name, "fail", "NixlHMAConnector") is None


def test_editing_a_lease_stock_never_sent_says_so():
    with pytest.raises(ValueError, match="no lease to edit"):
        faults.forged_params("edited-ticket", stock_params())


class _Engine:
    def __init__(self, alive: bool, health: int = 200):
        self._alive, self._health = alive, health

    def alive(self) -> bool:
        return self._alive

    def get(self, path: str):
        assert path == "/health"
        return self._health, ""


def test_a_decode_engine_a_cell_took_down_is_marked_and_started_again():
    """#41: stock's decode engines died on the first refused handshake and
    every later stock cell had nobody to answer; the dead one is now marked
    in its cell and replaced before the next fault, the live one kept."""
    from vllm_nixl_hma.e2e.run import _replace_dead_decodes

    results = [
        faults.FaultResult("side-channel-unreachable", policy, ok=True)
        for policy in faults.POLICIES
    ]
    live, dead, fresh = _Engine(True), _Engine(False), _Engine(True)
    by_policy = {"fail": live, "recompute": dead}
    started = []
    _replace_dead_decodes(results, by_policy, lambda p: started.append(p) or fresh, lambda _: None)
    assert started == ["recompute"] and by_policy == {"fail": live, "recompute": fresh}
    assert [(c.policy, c.decode_died, c.ok) for c in results] == [
        ("fail", False, True),
        ("recompute", True, False),
    ]
    # a process still up whose engine core died (its /health an error) is down too
    dying = _Engine(True, health=500)
    by_policy = {"fail": dying, "recompute": fresh}
    _replace_dead_decodes(results, by_policy, lambda p: started.append(p) or live, lambda _: None)
    assert started == ["recompute", "fail"] and by_policy["fail"] is live
