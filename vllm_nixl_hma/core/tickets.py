"""Signed transfer tickets: the arithmetic of issue #25 (no vLLM import).

``kv_transfer_params`` travel in the OpenAI request body, so any client that
reaches a decode engine can write its own: a prefill host and port, an engine
id, block ids. A ticket binds what prefill granted: a keyed MAC (HMAC-SHA256)
over every field prefill returned (its engine id, request id, side-channel
host and port, the block ids of every group, its TP size, the lease, ...)
but the ones vLLM's own scheduler rewrites on decode (``UNBOUND_FIELDS``),
and over the ticket's expiry, under a key prefill and decode share. A field
added, removed or changed on the way is an edit. Decode checks it before it dials, loads an agent or
reads (``verify``); a ticket checked once is consumed (``ConsumedTickets``),
so a replayed one is refused too.

Keys come from a file or an environment variable (``load_keys``): one key a
line, ``ID SECRET``; the first line signs, every line verifies, so a key is
rotated by adding the new one second on every engine, then moving it first.
A ``Key`` never shows its secret (``repr``, errors, logs).

``TicketBook`` is what both releases' connectors hold: it signs on prefill
(``request_finished``) and judges on decode (``build_connector_meta``, before
any handshake, agent load or read).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "MIN_SECRET_CHARS",
    "PARAM",
    "ConsumedTickets",
    "DEFAULT_TTL_S",
    "Key",
    "NO_KEY_WARNING",
    "REFUSED",
    "TicketBook",
    "TicketError",
    "METADATA_ATTR",
    "UNBOUND_FIELDS",
    "configured_ttl_s",
    "refusals",
    "whole_milliseconds",
    "load_keys",
    "parse_keys",
    "sign",
    "verify",
]

#: key in kv_transfer_params
PARAM = "vllm_nixl_hma_ticket"
#: the ticket format this module writes and reads
VERSION = 1
#: a secret shorter than this is refused (HMAC-SHA256 keys of 32 bytes and up)
MIN_SECRET_CHARS = 32
#: the kv_transfer_params fields a ticket does not bind: vLLM's decode
#: scheduler rewrites them before the ticket is judged (``do_remote_prefill``
#: set false, ``_remote_blocks_processed`` added on 0.33), and the ticket
#: itself; every other field is bound
UNBOUND_FIELDS = frozenset({"do_remote_prefill", "_remote_blocks_processed", PARAM})
#: how long a ticket is valid by default, seconds (``ticket_ttl_s``): as long
#: as vLLM 0.21's prefill keeps the blocks by default
DEFAULT_TTL_S = 480.0


class TicketError(ValueError):
    """A ticket that must not be honoured; ``reason`` says why in a few words
    (``missing``, ``malformed``, ``unknown key``, ``expired``, ``forged or
    edited``, ``replayed``) and the message adds the detail, never a secret."""

    def __init__(self, reason: str, detail: str):
        self.reason = reason
        super().__init__(f"transfer ticket refused ({reason}): {detail}")


@dataclass(frozen=True)
class Key:
    """One signing key: its id (sent with the ticket) and secret (never shown)."""

    key_id: str
    secret: bytes = field(repr=False)

    def __repr__(self) -> str:
        return f"Key({self.key_id!r}, secret=<{len(self.secret)} bytes>)"


def parse_keys(text: str, source: str) -> tuple[Key, ...]:
    """Keys from ``text``: one a line, ``ID SECRET``; blank lines and lines
    starting with ``#`` skipped. ``source`` names where the text came from in
    errors (which never quote a secret)."""
    keys: list[Key] = []
    for number, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) != 2:
            raise ValueError(
                f"{source} line {number}: expected 'ID SECRET', got {len(parts)} words"
            )
        key_id, secret = parts
        if len(secret) < MIN_SECRET_CHARS:
            raise ValueError(
                f"{source} line {number}: the secret of key {key_id!r} has {len(secret)} "
                f"characters; at least {MIN_SECRET_CHARS} are needed"
            )
        if any(key.key_id == key_id for key in keys):
            raise ValueError(f"{source} line {number}: key id {key_id!r} appears twice")
        keys.append(Key(key_id, secret.encode()))
    if not 1 <= len(keys) <= 2:
        raise ValueError(
            f"{source}: {len(keys)} keys; one, or two while one replaces the other, are needed"
        )
    return tuple(keys)


def load_keys(
    extra_config: Mapping[str, Any] | None, environ: Mapping[str, str] = os.environ
) -> tuple[Key, ...] | None:
    """The keys ``kv_connector_extra_config`` points at: ``ticket_keys_file``
    (a path) or ``ticket_keys_env`` (the name of an environment variable);
    ``None`` when neither is set (no tickets). Both set is an error."""
    config = extra_config or {}
    path, variable = config.get("ticket_keys_file"), config.get("ticket_keys_env")
    if path is not None and variable is not None:
        raise ValueError(
            "kv_connector_extra_config sets both ticket_keys_file and ticket_keys_env: keep one"
        )
    if path is not None:
        try:
            text = Path(str(path)).read_text()
        except OSError as e:
            raise ValueError(f"ticket_keys_file {str(path)!r}: {e.strerror}") from None
        return parse_keys(text, f"ticket_keys_file {str(path)!r}")
    if variable is not None:
        if str(variable) not in environ:
            raise ValueError(f"ticket_keys_env names ${variable}, which is not set")
        return parse_keys(environ[str(variable)], f"${variable}")
    return None


def _message(params: Mapping[str, Any], key_id: str, expires_at: float) -> bytes:
    """The bytes a ticket's MAC covers: its version, key id and expiry, and
    every bound field as JSON carries it (a tuple as a list)."""
    bound = {name: value for name, value in params.items() if name not in UNBOUND_FIELDS}
    try:
        return json.dumps(
            [VERSION, key_id, expires_at, bound], sort_keys=True, separators=(",", ":")
        ).encode()
    except (TypeError, ValueError, RecursionError) as e:
        raise TicketError("malformed", f"kv_transfer_params JSON cannot carry: {e}") from None


def _mac(secret: bytes, message: bytes) -> str:
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


def sign(params: Mapping[str, Any], keys: Sequence[Key], expires_at: float) -> dict[str, Any]:
    """``params`` with a ticket under the first key, valid until
    ``expires_at`` (wall-clock seconds)."""
    key = keys[0]
    ticket = {
        "v": VERSION,
        "kid": key.key_id,
        "exp": expires_at,
        "mac": _mac(key.secret, _message(params, key.key_id, expires_at)),
    }
    return {**params, PARAM: ticket}


def verify(
    params: Mapping[str, Any],
    keys: Sequence[Key],
    now: float,
    consumed: ConsumedTickets | None = None,
) -> None:
    """Raise ``TicketError`` unless ``params`` carry a ticket one of ``keys``
    signed over exactly these bound fields, not expired at ``now``, and (with
    ``consumed``) not checked before; a ticket that passes is consumed."""
    ticket = params.get(PARAM)
    if ticket is None:
        raise TicketError("missing", f"kv_transfer_params carry no {PARAM}")
    if not isinstance(ticket, Mapping) or set(ticket) != {"v", "kid", "exp", "mac"}:
        raise TicketError("malformed", "expected an object with v, kid, exp and mac")
    version, key_id, expires_at, mac = ticket["v"], ticket["kid"], ticket["exp"], ticket["mac"]
    if (
        version != VERSION
        or not isinstance(key_id, str)
        or isinstance(expires_at, bool)
        or not isinstance(expires_at, int | float)
        or not isinstance(mac, str)
    ):
        raise TicketError("malformed", f"version {version!r} or a field of the wrong type")
    key = next((key for key in keys if key.key_id == key_id), None)
    if key is None:
        raise TicketError("unknown key", f"signed with key {key_id[:40]!r}, not configured here")
    expected = _mac(key.secret, _message(params, key_id, expires_at))
    if not hmac.compare_digest(expected, mac):
        raise TicketError(
            "forged or edited", "its MAC does not match the fields it came with under that key"
        )
    if now >= expires_at:
        raise TicketError("expired", f"it expired {now - expires_at:.1f} s ago")
    if consumed is not None and not consumed.consume(mac, expires_at, now):
        raise TicketError("replayed", "a ticket with this MAC was checked before")


class ConsumedTickets:
    """The MACs of tickets already honoured, each kept until its ticket
    expires (later it is refused as expired anyway); at most ``capacity``
    (a full set refuses new tickets rather than forget live ones)."""

    def __init__(self, capacity: int = 1_000_000):
        self.capacity = capacity
        self._expiry_by_mac: dict[str, float] = {}

    def __len__(self) -> int:
        return len(self._expiry_by_mac)

    def consume(self, mac: str, expires_at: float, now: float) -> bool:
        """Whether ``mac`` was new (and is now consumed)."""
        if mac in self._expiry_by_mac:
            return False
        if len(self._expiry_by_mac) >= self.capacity:
            self._expiry_by_mac = {m: e for m, e in self._expiry_by_mac.items() if e > now}
            if len(self._expiry_by_mac) >= self.capacity:
                return False
        self._expiry_by_mac[mac] = expires_at
        return True


#: attribute of vLLM's connector metadata our scheduler side sets on both
#: releases: {request id: ReqMeta} of the requests whose ticket was refused,
#: taken out of ``reqs_to_recv`` (the worker fails them, reading nothing)
METADATA_ATTR = "vllm_nixl_hma_refused_tickets"

#: logged once by an engine whose connector has no ticket key
NO_KEY_WARNING = (
    "NixlHMAConnector: no ticket key is configured (kv_connector_extra_config "
    "ticket_keys_file or ticket_keys_env), so kv_transfer_params are not authenticated: "
    "any client that reaches a decode engine's API can make it read any block of any "
    "prefill engine it can reach (another request's KV), or load KV from a host of the "
    "client's choosing. See README, Security."
)
#: logged (request id, the refusal) when decode refuses a request's ticket
REFUSED = (
    "NixlHMAConnector: request %s: %s; nothing is read from the prefill engine its "
    "kv_transfer_params name, and the request fails as a failed transfer does "
    "(kv_load_failure_policy)"
)


def whole_milliseconds(seconds: float) -> float:
    """``seconds`` cut down to whole milliseconds: a float whose shortest
    decimal form has at most 3 decimals (13 significant digits for today's
    wall clock), which every JSON parser reads back exactly.

    Why: a router re-serializes ``kv_transfer_params``, and a parser that is
    not correctly rounded for long mantissas (vllm-router's serde_json
    without its ``float_roundtrip`` feature) may move a 17-digit float such
    as ``time.time() + 480`` by one unit in the last place, which is an edit
    to the MAC (seen through real engines: 3 of 9 requests refused). Cut
    down, never up: a deadline moves earlier by under a millisecond."""
    return math.floor(seconds * 1000) / 1000


def configured_ttl_s(extra_config: Mapping[str, Any] | None) -> float:
    """``ticket_ttl_s`` from ``kv_connector_extra_config`` (a positive number
    of seconds), or ``DEFAULT_TTL_S``; ValueError naming the key otherwise."""
    value = (extra_config or {}).get("ticket_ttl_s", DEFAULT_TTL_S)
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(
            f"kv_connector_extra_config ticket_ttl_s={value!r}: expected a positive number "
            "of seconds"
        )
    return float(value)


class TicketBook:
    """What a connector's scheduler side holds: the keys (None: no tickets),
    how long a ticket it signs lives, and the tickets it has honoured."""

    def __init__(
        self,
        keys: Sequence[Key] | None,
        ttl_s: float = DEFAULT_TTL_S,
        consumed: ConsumedTickets | None = None,
        clock=time.time,
    ):
        self.keys = tuple(keys) if keys else None
        self.ttl_s = ttl_s
        self.consumed = consumed if consumed is not None else ConsumedTickets()
        self._clock = clock

    @classmethod
    def from_extra_config(
        cls, extra_config: Mapping[str, Any] | None, environ: Mapping[str, str] = os.environ
    ) -> TicketBook:
        """The book ``kv_connector_extra_config`` configures (``load_keys``,
        ``configured_ttl_s``); ValueError for a bad setting, at start."""
        return cls(load_keys(extra_config, environ), configured_ttl_s(extra_config))

    @property
    def enabled(self) -> bool:
        return self.keys is not None

    def signed(self, params: dict[str, Any]) -> dict[str, Any]:
        """``params`` (what prefill returns) with a ticket, their floats cut
        to whole milliseconds first (``whole_milliseconds``); as they are
        without a key."""
        if self.keys is None:
            return params
        params = {
            name: whole_milliseconds(value) if type(value) is float else value
            for name, value in params.items()
        }
        return sign(params, self.keys, whole_milliseconds(self._clock() + self.ttl_s))

    def refusal(self, params: Mapping[str, Any] | None, consume: bool = True) -> TicketError | None:
        """Why decode must not honour ``params``, or None (also without a
        key: then nothing is checked). A ticket that passes is consumed,
        unless ``consume`` is false (a look before the read is decided)."""
        if self.keys is None:
            return None
        if not isinstance(params, Mapping):
            return TicketError("missing", "the request carries no kv_transfer_params object")
        try:
            verify(params, self.keys, self._clock(), self.consumed if consume else None)
        except TicketError as e:
            return e
        return None


def refusals(
    book: TicketBook, entries: Iterable[tuple[str, Mapping[str, Any] | None, bool]]
) -> dict[str, TicketError]:
    """Decode's judgement of the requests it is about to receive, as
    ``(request id, kv_transfer_params, reads)``: {request id: why it is
    refused} for each it must not go on with. A ticket judged for a read is
    consumed. One judged for a request that reads nothing (``reads`` false:
    vLLM's notify-only copy of a request that failed or hit decode's prefix
    cache, which only tells prefill to free the blocks) is not, and may have
    been consumed already: the notification is the ticket holder's due."""
    refused = {}
    for request_id, params, reads in entries:
        error = book.refusal(params, consume=reads)
        if error is not None:
            refused[request_id] = error
    return refused
