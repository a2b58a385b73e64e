"""``core.tickets``: what a ticket binds, and every way one is refused."""

from __future__ import annotations

import copy

import pytest

from vllm_nixl_hma.core import lease
from vllm_nixl_hma.core.tickets import (
    DEFAULT_TTL_S,
    PARAM,
    ConsumedTickets,
    Key,
    TicketBook,
    TicketError,
    configured_ttl_s,
    load_keys,
    parse_keys,
    refusals,
    sign,
    verify,
)

SECRET_A = "a" * 40
SECRET_B = "b" * 40
KEYS = (Key("k1", SECRET_A.encode()),)
NOW = 1_000_000.0
PARAMS = {
    "do_remote_prefill": True,
    "remote_engine_id": "prefill-engine-1",
    "remote_request_id": "cmpl-42-0",
    "remote_host": "10.0.0.3",
    "remote_port": 5600,
    "remote_block_ids": [[3, 4, 5], [9]],
    lease.PARAM: NOW + 480.0,
}


def signed(params=PARAMS, keys=KEYS, expires_at=NOW + 60.0):
    return sign(params, keys, expires_at)


def reason_of(params, keys=KEYS, now=NOW, consumed=None) -> str:
    with pytest.raises(TicketError) as refused:
        verify(params, keys, now, consumed)
    return refused.value.reason


def test_a_ticket_prefill_signed_verifies_once():
    params = signed()
    consumed = ConsumedTickets()
    verify(params, KEYS, NOW, consumed)
    assert reason_of(params, consumed=consumed) == "replayed"
    assert len(consumed) == 1


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("remote_engine_id", "prefill-engine-2"),  # another engine's
        ("remote_request_id", "cmpl-43-0"),  # another request's
        ("remote_host", "10.9.9.9"),  # a fake prefill
        ("remote_port", 5601),
        ("remote_block_ids", [[3, 4, 6], [9]]),  # one block of another request
        ("remote_block_ids", [[3, 4, 5], [9, 10]]),
        ("remote_block_ids", [3, 4, 5, 9]),  # the groups flattened
        (lease.PARAM, NOW + 4800.0),  # a longer lease
    ],
)
def test_a_ticket_edited_in_any_bound_field_is_refused(field, value):
    params = signed()
    params[field] = value
    assert reason_of(params) == "forged or edited"


def test_a_bound_field_removed_or_added_is_an_edit():
    params = signed()
    del params["remote_port"]
    assert reason_of(params) == "forged or edited"
    unleased = {k: v for k, v in PARAMS.items() if k != lease.PARAM}
    params = signed(unleased)
    params[lease.PARAM] = NOW + 480.0
    assert reason_of(params) == "forged or edited"


def test_fields_a_ticket_does_not_bind_may_change():
    params = signed()
    params["do_remote_prefill"] = "anything"
    verify(params, KEYS, NOW)


def test_the_tickets_own_fields_are_bound_too():
    params = signed()
    params[PARAM] = {**params[PARAM], "exp": NOW + 3600.0}  # a longer life
    assert reason_of(params) == "forged or edited"
    params = signed()
    params[PARAM] = {**params[PARAM], "mac": "0" * 64}
    assert reason_of(params) == "forged or edited"


def test_a_ticket_past_its_expiry_is_refused():
    params = signed(expires_at=NOW + 1.0)
    verify(copy.deepcopy(params), KEYS, NOW + 0.5)
    assert reason_of(params, now=NOW + 1.0) == "expired"


def test_a_ticket_forged_without_the_key_is_refused():
    forged = signed(keys=(Key("k1", SECRET_B.encode()),))  # same id, another secret
    assert reason_of(forged) == "forged or edited"
    assert reason_of(signed(keys=(Key("k9", SECRET_A.encode()),))) == "unknown key"


@pytest.mark.parametrize(
    "ticket",
    [None, "text", {"v": 1}, {"v": 2, "kid": "k1", "exp": NOW + 9, "mac": "00"}],
)
def test_a_missing_or_malformed_ticket_is_refused(ticket):
    params = dict(PARAMS)
    if ticket is not None:
        params[PARAM] = ticket
    assert reason_of(params) == ("missing" if ticket is None else "malformed")


def test_two_keys_let_a_key_be_rotated_without_downtime():
    old, new = Key("old", SECRET_A.encode()), Key("new", SECRET_B.encode())
    by_old_prefill = signed(keys=(old,))
    by_new_prefill = signed(keys=(new, old))
    for decode_keys in [(old, new), (new, old)]:  # decode during the rotation
        verify(by_old_prefill, decode_keys, NOW)
        verify(by_new_prefill, decode_keys, NOW)
    assert reason_of(by_old_prefill, keys=(new,)) == "unknown key"  # after it


def test_no_secret_appears_in_a_key_or_an_error():
    [key] = parse_keys(f"k1 {SECRET_A}\n", "test")
    assert SECRET_A not in repr(key) and SECRET_A not in str(key)
    for text in [f"k1 {SECRET_A} extra", f"k1 {SECRET_A[:10]}", f"k1 {SECRET_A}\nk1 {SECRET_B}"]:
        with pytest.raises(ValueError) as refused:
            parse_keys(text, "test")
        assert SECRET_A not in str(refused.value) and SECRET_A[:10] not in str(refused.value)


def test_one_or_two_keys_a_file_or_a_variable(tmp_path):
    path = tmp_path / "keys"
    path.write_text(f"# rotated 2026-12\nnew {SECRET_B}\n\nold {SECRET_A}\n")
    keys = load_keys({"ticket_keys_file": str(path)})
    assert [key.key_id for key in keys] == ["new", "old"]
    assert load_keys({"ticket_keys_env": "KEYS"}, {"KEYS": f"k1 {SECRET_A}"}) == KEYS
    assert load_keys({}) is None and load_keys(None) is None
    with pytest.raises(ValueError, match="keep one"):
        load_keys({"ticket_keys_file": str(path), "ticket_keys_env": "KEYS"})
    with pytest.raises(ValueError, match=r"\$NOPE, which is not set"):
        load_keys({"ticket_keys_env": "NOPE"}, {})
    with pytest.raises(ValueError, match="No such file"):
        load_keys({"ticket_keys_file": str(tmp_path / "absent")})
    three = "\n".join(f"k{n} {SECRET_A}" for n in range(3))
    with pytest.raises(ValueError, match="3 keys"):
        parse_keys(three, "test")


def test_consumed_tickets_are_forgotten_only_once_expired():
    consumed = ConsumedTickets(capacity=2)
    assert consumed.consume("m1", NOW + 1, NOW) and consumed.consume("m2", NOW + 100, NOW)
    assert not consumed.consume("m3", NOW + 100, NOW)  # full of live tickets: refused
    assert consumed.consume("m3", NOW + 100, NOW + 2)  # m1 expired: room again
    assert not consumed.consume("m2", NOW + 100, NOW + 2)


def test_the_fields_vllms_decode_scheduler_rewrites_are_not_bound_and_every_other_is():
    """vLLM's ``update_state_after_alloc`` sets ``do_remote_prefill`` false
    (and 0.33 adds ``_remote_blocks_processed``) before decode judges the
    ticket; a field a client adds (0.33's ``tp_size``, a DP rank) is an edit."""
    params = signed()
    params["do_remote_prefill"] = False
    params["_remote_blocks_processed"] = True
    verify(params, KEYS, NOW)
    for field, value in (("tp_size", 2), ("remote_dp_rank", 1), ("do_remote_decode", True)):
        assert reason_of({**signed(), field: value}) == "forged or edited", field


def test_params_json_cannot_carry_are_malformed_not_a_crash():
    params = signed()
    params["remote_block_ids"] = {1, 2}  # a set: no JSON for it
    assert reason_of(params) == "malformed"


def test_a_book_without_keys_signs_nothing_and_refuses_nothing():
    book = TicketBook(None)
    assert not book.enabled
    assert book.signed(dict(PARAMS)) == PARAMS
    assert book.refusal({"anything": 1}) is None and book.refusal(None) is None


def test_a_book_signs_for_its_ttl_and_consumes_only_when_asked():
    clock = [NOW]
    book = TicketBook(KEYS, ttl_s=30.0, clock=lambda: clock[0])
    params = book.signed(dict(PARAMS))
    assert params[PARAM]["exp"] == NOW + 30.0
    assert book.refusal(params, consume=False) is None  # a look: not consumed
    assert book.refusal(params) is None
    assert book.refusal(params).reason == "replayed"
    assert book.refusal(None).reason == "missing"
    clock[0] = NOW + 30.0
    assert book.refusal(book.signed(dict(PARAMS)) | {PARAM: params[PARAM]}).reason in {
        "expired",
        "replayed",
    }


def test_refusals_judges_each_request_and_names_only_the_refused():
    book = TicketBook(KEYS, clock=lambda: NOW)
    good, bad = book.signed(dict(PARAMS)), {**book.signed(dict(PARAMS)), "remote_port": 1}
    entries = [("r-good", good, True), ("r-bad", bad, True), ("r-none", None, True)]
    refused = refusals(book, entries)
    assert {k: e.reason for k, e in refused.items()} == {
        "r-bad": "forged or edited",
        "r-none": "missing",
    }


def test_a_request_that_reads_nothing_may_use_a_consumed_ticket_but_not_a_forged_one():
    """vLLM's notify-only copy of a failed request carries the params its read
    consumed; its notification frees prefill's blocks and must still go."""
    book = TicketBook(KEYS, clock=lambda: NOW)
    params = book.signed(dict(PARAMS))
    assert refusals(book, [("read", params, True)]) == {}
    assert refusals(book, [("notify", params, False)]) == {}
    assert refusals(book, [("notify", params, False)]) == {}  # not consumed either
    assert refusals(book, [("again", params, True)])["again"].reason == "replayed"
    forged = {**params, "remote_host": "10.9.9.9"}
    assert refusals(book, [("notify", forged, False)])["notify"].reason == "forged or edited"


@pytest.mark.parametrize(
    ("value", "ok"),
    [(1, True), (0.5, True), (0, False), (-1, False), (True, False), ("60", False), (None, False)],
)
def test_configured_ttl_s_takes_positive_numbers_only(value, ok):
    if ok:
        assert configured_ttl_s({"ticket_ttl_s": value}) == float(value)
    else:
        with pytest.raises(ValueError, match="ticket_ttl_s"):
            configured_ttl_s({"ticket_ttl_s": value})
    assert configured_ttl_s({}) == DEFAULT_TTL_S


def _off_by_one_ulp(value: float) -> float:
    import math

    return math.nextafter(value, math.inf)


def test_floats_a_ticket_binds_are_cut_to_milliseconds_that_any_json_parser_reads_exactly():
    """vllm-router re-serializes ``kv_transfer_params`` with a float parser
    that may move a 17-digit float by one unit in the last place (seen: 3 of
    9 P/D requests refused as edited). A float of at most 15 significant
    digits is read exactly by a fast-path parser (one correctly rounded
    division), so prefill signs only such floats."""
    import json

    lease_end = 1_764_762_540.123_456_7  # time.time() + 480, as repr writes it: 17 digits
    book = TicketBook(KEYS, ttl_s=480.0, clock=lambda: 1_764_762_060.987_654_3)
    params = book.signed(
        {**PARAMS, lease.PARAM: lease_end, "remote_blocks_expiry_time": 12.3456789}
    )
    for value in (params[lease.PARAM], params[PARAM]["exp"], params["remote_blocks_expiry_time"]):
        digits = json.dumps(value).replace(".", "").lstrip("0")
        assert len(digits) <= 15, value
        assert float(json.dumps(value)) == value
    assert params[lease.PARAM] == 1_764_762_540.123  # cut down, never up
    assert params["remote_blocks_expiry_time"] == 12.345
    assert book.refusal(params, consume=False) is None
    # the failure the cut avoids: one unit in the last place is an edit
    moved = {**params, lease.PARAM: _off_by_one_ulp(params[lease.PARAM])}
    assert book.refusal(moved).reason == "forged or edited"
