"""``vllm-nixl-hma drift`` (#42): reading a release's source for what our glue
relies on, and naming what another release changed.

The parameter texts read from source (``signatures.of_source``) must be the
ones startup reads from live classes (``signatures.of_function``), or the
recorded snapshots would stop every engine; checked here on functions of
every kind, and on the installed vLLM's own classes. Then the comparison:
the installed release read against its recorded snapshot changes nothing,
and on vLLM 0.34.0 the 0.33 glue's snapshot names the port's work list.
Runs in every environment.
"""

from __future__ import annotations

import ast
import importlib
import json
import textwrap
from pathlib import Path

import pytest

from vllm_nixl_hma import _compat, drift
from vllm_nixl_hma.core import signatures, upstream_contract

SOURCE = textwrap.dedent(
    """
    import functools

    class Owner:
        def plain(self, a, b=1): ...
        def positional_only(self, a, /, b, *, c, d=2, **extra): ...
        def starred(self, *args, **kwargs): ...
        def keyword_only(self, a, *, b): ...
        @staticmethod
        def static(a, b=None): ...
        @classmethod
        def klass(cls, a, *rest): ...
        async def later(self, a=None, *, b=None): ...
    """
)


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("plain", "(self, a, b=)"),
        ("positional_only", "(self, a, /, b, *, c, d=, **extra)"),
        ("starred", "(self, *args, **kwargs)"),
        ("keyword_only", "(self, a, *, b)"),
        ("static", "(a, b=)"),
        ("klass", "(a, *rest)"),
        ("later", "(self, a=, *, b=)"),
    ],
)
def test_source_and_live_functions_read_alike(name, text):
    namespace: dict = {}
    exec(compile(SOURCE, "owner", "exec"), namespace)  # noqa: S102
    live = signatures.of_function(getattr(namespace["Owner"], name))
    [owner] = [n for n in ast.parse(SOURCE).body if isinstance(n, ast.ClassDef)]
    [node] = [n for n in owner.body if getattr(n, "name", None) == name]
    assert live == signatures.of_source(node) == text


def test_a_body_digest_ignores_docstrings_and_layout_but_not_code():
    def digest(source: str) -> str:
        return signatures.body_digest(ast.parse(textwrap.dedent(source)).body[0])

    base = digest("def f(self, a):\n    return a + 1\n")
    assert base == digest('def f(self, a):\n    """Doc."""\n    # note\n    return (a +\n 1)\n')
    assert base != digest("def f(self, a):\n    return a + 2\n")
    assert base != digest("def f(self, a, b=None):\n    return a + 1\n")


def installed_source() -> drift.SourceTree:
    import vllm

    return drift.SourceTree(Path(vllm.__file__).parent.parent)


def test_the_installed_release_read_from_its_files_is_its_recorded_snapshot():
    contract = upstream_contract.installed()
    current = drift.snapshot(installed_source(), contract)
    assert current["release"].split("+")[0] == _compat.TESTED[_compat.adapter()]
    assert drift.compare(contract.snapshot, current) == []
    # and each method read from source has the live class's parameters
    for owner, entry in current["owners"].items():
        module, _, name = entry["class"].rpartition(".")
        cls = getattr(importlib.import_module(module), name)
        for method, found in entry["methods"].items():
            assert found["signature"] == signatures.of_function(getattr(cls, method)), (
                owner,
                method,
            )


def test_a_changed_release_is_named_change_by_change():
    """The installed release's snapshot, altered as a release would alter
    it: every kind of change is one line, the most serious first."""
    contract = upstream_contract.installed()
    recorded = contract.snapshot
    changed = json.loads(json.dumps(recorded))
    changed["wire_version"] += 1
    worker = changed["owners"]["worker"]["methods"]
    first, second, third = contract.worker_overrides[:3]
    worker[first]["signature"] = worker[first]["signature"][:-1] + ", extra=)"
    worker[second]["body"] = "0" * 12
    worker[second]["calls"] = [*worker[second]["calls"], "_new_step"]
    worker[third] = None
    changed["owners"]["worker"]["missing_state"] = [contract.worker_state[0]]
    lines = drift.compare(recorded, changed)
    assert len(lines) == 5, lines
    assert lines[0].endswith(f"{third}: gone")
    assert lines[1].endswith(f"no longer sets {contract.worker_state[0]}")
    assert lines[2].startswith("wire version: NIXL_CONNECTOR_VERSION")
    assert f"{first}: signature" in lines[3] and "extra=)" in lines[3]
    assert f"{second}: body changed (overridden by the glue); now calls self._new_step" in lines[4]


@pytest.mark.skipif(_compat.adapter() != "v034", reason="vLLM 0.34.0 only: its port's work list")
def test_on_034_the_033_snapshot_names_the_ports_work_list():
    """What ``vllm-nixl-hma drift 0.34.0 --glue v033`` printed when the port
    began (docs/port-0.34.md): both signature changes, the wire version, and
    where upstream moved the pairing (``_pair_blocks_by_last_token``)."""
    current = drift.snapshot(installed_source(), upstream_contract.V033)
    lines = drift.compare(upstream_contract.V033.snapshot, current)
    text = "\n".join(lines)
    assert "NIXL_CONNECTOR_VERSION 15 -> 16" in text
    assert "_build_mamba_remote: signature" in text and "transfer_info, pairs)" in text
    assert "_validate_remote_agent_handshake: signature" in text
    assert "_read_blocks_for_req: body changed (overridden by the glue); now calls" in text
    assert "self._pair_blocks_by_last_token" in text
    assert not any(line.endswith("gone") for line in lines)
