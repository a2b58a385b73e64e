"""Signed transfer tickets: the arithmetic of issue #25 (no vLLM import).

``kv_transfer_params`` travel in the OpenAI request body, so any client that
reaches a decode engine can write its own: a prefill host and port, an engine
id, block ids. A ticket binds what prefill granted: a keyed MAC (HMAC-SHA256)
over the prefill engine id, its request id, its side-channel host and port,
the block ids of every group, the lease and the ticket's expiry, under a key
prefill and decode share. Decode checks it before it dials, loads an agent or
reads (``verify``); a ticket checked once is consumed (``ConsumedTickets``),
so a replayed one is refused too.

Keys come from a file or an environment variable (``load_keys``): one key a
line, ``ID SECRET``; the first line signs, every line verifies, so a key is
rotated by adding the new one second on every engine, then moving it first.
A ``Key`` never shows its secret (``repr``, errors, logs).

Not wired into the connectors yet: issue #25 stays open for that (prefill's
``request_finished`` signs, decode verifies before its handshake, e2e fault
cells ending in ``-ticket``).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "MIN_SECRET_CHARS",
    "PARAM",
    "ConsumedTickets",
    "Key",
    "TicketError",
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
#: the kv_transfer_params fields a ticket binds, and the lease (``lease.PARAM``)
BOUND_FIELDS = (
    "remote_engine_id",
    "remote_request_id",
    "remote_host",
    "remote_port",
    "remote_block_ids",
    "vllm_nixl_hma_lease_deadline",
)


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
    every bound field as the params carry it (absent fields as null)."""
    bound = {name: params.get(name) for name in BOUND_FIELDS}
    return json.dumps(
        [VERSION, key_id, expires_at, bound], sort_keys=True, separators=(",", ":")
    ).encode()


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
