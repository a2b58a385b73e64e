"""Faults through real engines: what a decode engine answers when the KV it was
promised does not arrive, under each ``kv_load_failure_policy``.

Each fault takes a request prefill has just computed (its ``kv_transfer_params``)
and breaks the transfer before decode reads:

* ``prefill-killed``: the prefill engine's process group is SIGKILLed;
* ``side-channel-unreachable``: the params name a prefill engine decode has not
  met, at a side-channel port nobody listens on, so the handshake cannot complete;
* ``lease-expired``: the params carry a prefill lease that ended a minute ago
  (as prefill's own would after ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``), so the
  blocks may hold another request's KV;
* ``unpairable-block-lists``: every block list of the params is cut to its
  first block (as a client may send them: ``kv_transfer_params`` is part of
  the request body), so decode's blocks cannot be paired with prefill's.

Ours runs with a ticket key (``tickets``): the faults above stand for a
prefill that signed what it should not have, so their edited params are
signed again with the run's key and reach the check behind the ticket. The
ticket's own faults (``TICKET_FAULTS``) are what a client without the key
can send:

* ``other-request-ticket``: prefill computes another prompt (the victim, left
  in flight), and this request's params carry the victim's block ids under
  this request's ticket. Then the victim's own request must get its tokens.
* ``edited-ticket``: the params' lease end moved an hour later (a harmless
  edit without tickets: the read would succeed).
* ``replayed-ticket``: the params are sent twice; the first must get the
  reference tokens (and a NIXL read), the second is the fault.
* ``fake-prefill-ticket``: the params name an engine and a side channel of
  the test's own (a TCP listener that counts who dials it), with a made-up
  ticket under the run's key id.

For each, decode's NIXL transfer counters (``vllm:nixl_xfer_time_seconds``
and ``vllm:nixl_num_failed_transfers``) must not move while it answers: no
read ended, so none was posted that could have. Stock, without tickets, is
sent the same ``other-request-ticket`` request once (``e2e``'s
``forged_read_probe``) and decodes this prompt on the victim's KV.

With ``--separate-hosts`` (``NETWORK_FAULTS``), faults of the network between
the hosts:

* ``prefill-link-flap``: after prefill answered, the prefill host's data link
  is unplugged as decode's request goes out and plugged back
  ``LINK_FLAP_S`` later, while decode's read waits on it (the side channel
  stays up). A read that rides through the flap delivers the whole KV, so
  under ``fail`` the reference tokens are right too; an error is right as
  well. Wrong tokens never are.
* ``prefill-host-gone``: after prefill answered, its host's link is unplugged
  at the switch (no RST, no FIN: the host is simply gone) and stays unplugged
  until both decode engines have answered and served their next request.
* ``prefill-data-path-cut``: the same with the prefill host's data link alone
  (the network UCX moves the KV over): its side channel and HTTP still
  answer, so a decode engine that handshakes afresh loads prefill's agent
  and then cannot read.

A read that finishes after the lease cannot be arranged through engines on
one host (loopback reads finish within a step); the check harness injects it
(``vllm-nixl-hma check --faults``: ``late-read``).

Under ``fail`` the answer must be an error (or, after ``prefill-link-flap``,
the reference tokens); under ``recompute`` the reference tokens. Never HTTP
200 with other tokens. Then the same decode engine must serve the next request
correctly (a P/D request while prefill lives, else a plain one).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from vllm_nixl_hma import proxy
from vllm_nixl_hma.core import lease, tickets
from vllm_nixl_hma.e2e.servers import HTTPResult, post_json

__all__ = [
    "ALL_FAULTS",
    "FAULTS",
    "NEEDS_OURS",
    "NETWORK_FAULTS",
    "POLICIES",
    "TICKET_FAULTS",
    "FakePrefill",
    "forged_params",
    "victim_prompt_tokens",
    "LINK_FLAP_S",
    "MAY_DELIVER",
    "FaultResult",
    "broken_params",
    "decode",
    "skipped",
    "prefill",
    "verdict",
    "wanted_outcomes",
]

#: what a client without the ticket key can send (``forged_params``)
TICKET_FAULTS = (
    "other-request-ticket",
    "edited-ticket",
    "replayed-ticket",
    "fake-prefill-ticket",
)
FAULTS = (
    "side-channel-unreachable",
    "lease-expired",
    "unpairable-block-lists",
    *TICKET_FAULTS,
    "prefill-killed",
)
#: faults that need what only ours puts in ``kv_transfer_params``, and why a
#: stock ``NixlConnector`` run skips them (``e2e --connector NixlConnector``)
NEEDS_OURS = {
    "lease-expired": "stock's kv_transfer_params carry no lease to let expire "
    "(its prefill frees blocks after VLLM_NIXL_ABORT_REQUEST_TIMEOUT, 480 s, and decode "
    "is never told when)",
    "edited-ticket": "stock's kv_transfer_params carry no lease to edit and no ticket",
}
#: faults of the link between hosts: ``e2e --separate-hosts`` only
NETWORK_FAULTS = ("prefill-link-flap", "prefill-host-gone", "prefill-data-path-cut")
#: how long ``prefill-link-flap`` keeps the data link down, seconds: longer
#: than TCP's first retransmissions, well under e2e's ``read_timeout_s``
LINK_FLAP_S = 5.0
#: faults after which the KV may still arrive whole: the reference tokens are
#: a right answer under either policy
MAY_DELIVER = frozenset({"prefill-link-flap"})
#: the order faults run in (prefill-killed last: it kills prefill)
ALL_FAULTS = (*FAULTS[:-1], *NETWORK_FAULTS, FAULTS[-1])
POLICIES = ("fail", "recompute")


@dataclass
class FaultResult:
    name: str
    policy: str
    http_status: int = 0
    #: "error", "reference tokens", "wrong tokens", "no answer"; "skipped"
    #: (``error`` says why: a stock run and a fault in ``NEEDS_OURS``)
    outcome: str = ""
    #: seconds decode took to answer the broken request
    elapsed_s: float = 0.0
    next_request_ok: bool = False
    ok: bool = False
    error: str | None = None
    #: wall-clock seconds the cell's broken request went out and its next
    #: request's answer ended (what engine log lines are matched against)
    sent_at: float = 0.0
    answered_at: float = 0.0
    #: ticket faults: NIXL transfers of decode that ended (done or failed)
    #: while it answered the broken request (None: no metric)
    nixl_reads: int | None = None
    #: other-request-ticket: the victim's own request got its reference tokens
    victim_ok: bool | None = None
    #: replayed-ticket: the first use got the reference tokens, with this
    #: many NIXL transfers ended (the counters' control: they do move)
    first_use_ok: bool | None = None
    first_use_nixl_reads: int | None = None
    #: fake-prefill-ticket: connections the fake prefill's listener accepted
    #: (None: decode is on another host and could not reach it anyway)
    dialed: int | None = None
    #: what decode's plugin counters on /metrics grew by over the cell (#27),
    #: and whether that is the fault's own class (None: stock, no counters)
    records: dict[str, int] | None = None
    records_ok: bool | None = None
    #: the cell's decode engine died (and was started again for the next fault)
    decode_died: bool = False

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def skipped(name: str, policy: str, connector: str) -> FaultResult | None:
    """Fault ``name``'s cell under ``policy`` as a run of ``connector`` skips
    it (a stock run, a fault that needs our params), or None: it runs."""
    if connector == "NixlHMAConnector" or name not in NEEDS_OURS:
        return None
    return FaultResult(name, policy, outcome="skipped", error=NEEDS_OURS[name])


def broken_params(
    name: str,
    params: dict[str, Any],
    dead_port: int,
    keys: Sequence[tickets.Key] | None = None,
) -> dict[str, Any]:
    """``params`` as decode will see them after fault ``name`` (prefill-killed
    breaks the engine, not the params), signed again with ``keys`` when
    given and the fault edited them: the check behind the ticket is meant."""
    edited = _edited(name, dict(params), dead_port)
    if keys is None or edited == params:
        return edited
    unsigned = {k: v for k, v in edited.items() if k != tickets.PARAM}
    return tickets.sign(unsigned, keys, time.time() + 60.0)


def _edited(name: str, params: dict[str, Any], dead_port: int) -> dict[str, Any]:
    if name == "side-channel-unreachable":
        # an engine decode has not met, whose side channel nobody serves (with
        # the live engine's id decode would read over the agent it already has)
        params["remote_engine_id"] = f"unreachable-{uuid.uuid4()}"
        params["remote_port"] = dead_port
    elif name == "lease-expired":
        params[lease.PARAM] = time.time() - 60.0
    elif name == "unpairable-block-lists":
        # one group (no HMA) is a flat list of ids, several a list per group
        ids = params["remote_block_ids"]
        if ids and all(isinstance(group, list) for group in ids):
            params["remote_block_ids"] = [group[:1] for group in ids]
        else:
            params["remote_block_ids"] = ids[:1]
    return params


def victim_prompt_tokens(fault_prompt_tokens: int) -> int:
    """The victim's prompt length for ``other-request-ticket``: one token off
    the fault's own, in as many logical blocks of any multiple of 16 tokens
    (decode pairs its blocks with the victim's one for one)."""
    return fault_prompt_tokens + 1 if fault_prompt_tokens % 16 else fault_prompt_tokens - 1


def forged_params(
    name: str,
    params: dict[str, Any],
    victim_params: dict[str, Any] | None = None,
    fake_prefill: tuple[str, int] | None = None,
) -> dict[str, Any]:
    """What a client without the key sends for ticket fault ``name``, made
    of ``params`` prefill signed for this request."""
    if name == "other-request-ticket":
        return {**params, "remote_block_ids": victim_params["remote_block_ids"]}
    if name == "edited-ticket":
        if lease.PARAM not in params:
            raise ValueError(f"{name}: {NEEDS_OURS[name]}")
        return {**params, lease.PARAM: params[lease.PARAM] + 3600.0}
    if name == "replayed-ticket":
        return dict(params)
    if name == "fake-prefill-ticket":
        host, port = fake_prefill
        ticket = params.get(tickets.PARAM) or {}
        made_up = {"v": 1, "kid": ticket.get("kid", "e2e"), "exp": time.time() + 60.0}
        return {
            **params,
            "remote_engine_id": f"fake-prefill-{uuid.uuid4()}",
            "remote_host": host,
            "remote_port": port,
            tickets.PARAM: {**made_up, "mac": "00" * 32},
        }
    raise ValueError(f"not a ticket fault: {name}")


class FakePrefill:
    """A TCP listener standing in for a prefill engine's side channel: it
    accepts and counts connections, and answers nothing."""

    def __init__(self, host: str = "127.0.0.1"):
        self._sock = socket.create_server((host, 0))
        self._sock.settimeout(0.2)
        self.address = (host, self._sock.getsockname()[1])
        self.connections = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.connections += 1
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)
        self._sock.close()


@contextlib.contextmanager
def fake_prefill(host: str = "127.0.0.1") -> Iterator[FakePrefill]:
    listener = FakePrefill(host)
    try:
        yield listener
    finally:
        listener.close()


def verdict(
    result: FaultResult, answer: HTTPResult, expected_tokens: list[int], tokens: list[int]
) -> None:
    """Fill ``outcome`` and ``ok`` from decode's answer to the broken request."""
    result.http_status = answer.status
    if answer.status == 200:
        result.outcome = "reference tokens" if tokens == expected_tokens else "wrong tokens"
    elif answer.status == 0:
        result.outcome = "no answer"
        result.error = answer.error
    else:
        result.outcome = "error"
        result.error = answer.error
    result.ok = result.outcome in wanted_outcomes(result.name, result.policy)


def wanted_outcomes(name: str, policy: str) -> frozenset[str]:
    """The answers fault ``name`` may get under ``policy``: an error under
    ``fail`` (and the reference tokens where the KV may still arrive whole),
    the reference tokens under ``recompute``."""
    if policy == "recompute":
        return frozenset({"reference tokens"})
    return frozenset({"error", "reference tokens"} if name in MAY_DELIVER else {"error"})


def prefill(prefill_url: str, body: dict[str, Any], timeout_s: float) -> dict[str, Any] | None:
    """The ``kv_transfer_params`` prefill returns for ``body``, or None."""
    answer = post_json(prefill_url, "/v1/completions", proxy.prefill_request(body), timeout_s)
    params = (answer.body or {}).get("kv_transfer_params") if answer.status == 200 else None
    return params or None


def decode(
    decode_url: str,
    name: str,
    body: dict[str, Any],
    params,
    dead_port: int,
    timeout_s: float,
    keys: Sequence[tickets.Key] | None = None,
) -> HTTPResult:
    """Decode's answer to ``body`` with the params fault ``name`` left it."""
    return post_json(
        decode_url,
        "/v1/completions",
        {**body, "kv_transfer_params": broken_params(name, params, dead_port, keys)},
        timeout_s,
    )
