"""``vllm-nixl-hma drift``: what a vLLM release changed of what our glue relies
on, read from its source without installing it: the work list of a port.

A glue's contract (``core.upstream_contract``) lists the upstream names it
overrides, calls and reads. ``snapshot`` reads, from a release's Python
source (a wheel, a directory holding ``vllm/``, or a version ``pip download``
fetches), each of those names with its parameters (``core.signatures``) and
a digest of its body, the state upstream's classes set, and the NIXL wire
version. ``--record`` writes that for the tested release into
``vllm_nixl_hma/snapshots/`` (what the startup check compares the installed
vLLM's signatures with); without it, the release given is compared with a
glue's recorded snapshot and every difference is printed:

* a name gone, or state no longer set: the glue cannot run there;
* a signature changed: the override or call must follow it;
* a body changed, of a method we override (our override may re-implement
  what upstream now does differently) or call, with the methods of its own
  class it now calls or no longer calls (where upstream moved a step);
* the wire version: the handshake's metadata changed.

Exit status 0 when nothing differs, 1 when something does. Classes are
followed through their bases as the source names them (``class A(B)`` with
``B`` imported from another vLLM module), in Python's method resolution order.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from vllm_nixl_hma.core import signatures, upstream_contract
from vllm_nixl_hma.core.upstream_contract import WIRE_MODULE, Contract

__all__ = ["SourceTree", "compare", "main", "snapshot"]

SNAPSHOTS = Path(__file__).parent / "snapshots"


class SourceTree:
    """A vLLM release's Python source: a wheel (read in place) or a directory
    that holds the ``vllm`` package (a site-packages, an unpacked sdist)."""

    def __init__(self, path: Path):
        self.path = path
        self._zip = zipfile.ZipFile(path) if path.is_file() else None
        self._modules: dict[str, ast.Module | None] = {}

    def _read(self, relative: str) -> str | None:
        if self._zip is not None:
            try:
                return self._zip.read(relative).decode()
            except KeyError:
                return None
        file = self.path / relative
        return file.read_text() if file.is_file() else None

    def module(self, dotted: str) -> ast.Module | None:
        """The parsed module ``dotted`` (``a.b.c``: ``a/b/c.py`` or its package)."""
        if dotted not in self._modules:
            base = dotted.replace(".", "/")
            text = self._read(f"{base}.py")
            if text is None:
                text = self._read(f"{base}/__init__.py")
            self._modules[dotted] = None if text is None else ast.parse(text)
        return self._modules[dotted]

    def version(self) -> str | None:
        """The release, from the wheel's metadata or ``vllm/_version.py``."""
        if self._zip is not None:
            for name in self._zip.namelist():
                if name.endswith(".dist-info/METADATA"):
                    match = re.search(r"^Version: (\S+)$", self._zip.read(name).decode(), re.M)
                    if match:
                        return match.group(1)
        text = self._read("vllm/_version.py") or ""
        match = re.search(r"""__version__\s*=\s*(?:version\s*=\s*)?['"]([^'"]+)""", text)
        return match.group(1) if match else None


@dataclass
class ClassSource:
    """One class of the tree and its bases, in method resolution order."""

    path: str  # dotted
    mro: list[tuple[str, ast.ClassDef]] = field(default_factory=list)  # (dotted, node)

    def method(self, name: str) -> tuple[str, ast.FunctionDef | ast.AsyncFunctionDef] | None:
        """(the class that defines it, its node), the first in the MRO."""
        for owner, node in self.mro:
            for item in node.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef) and item.name == name:
                    return owner, item
        return None

    def has(self, name: str) -> bool:
        """Whether the class defines ``name`` (a method, a class attribute) or
        any of its methods sets ``self.<name>``."""
        return self.method(name) is not None or name in self.state()

    def state(self) -> set[str]:
        names: set[str] = set()
        for _, node in self.mro:
            for item in node.body:
                if isinstance(item, ast.Assign):
                    names |= {t.id for t in item.targets if isinstance(t, ast.Name)}
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    names.add(item.target.id)
            for sub in ast.walk(node):
                targets = []
                if isinstance(sub, ast.Assign):
                    targets = sub.targets
                elif isinstance(sub, ast.AnnAssign | ast.AugAssign):
                    targets = [sub.target]
                for target in targets:
                    for leaf in ast.walk(target):
                        if (
                            isinstance(leaf, ast.Attribute)
                            and isinstance(leaf.value, ast.Name)
                            and leaf.value.id == "self"
                        ):
                            names.add(leaf.attr)
        return names


def _imported_names(module: ast.Module, dotted: str) -> dict[str, str]:
    """{local name: dotted path} of what ``module`` imports or defines at top level."""
    names: dict[str, str] = {}
    package = dotted.rsplit(".", 1)[0]
    for node in module.body:
        if isinstance(node, ast.ImportFrom):
            source = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                source = f"{base}.{source}" if source else base
            for alias in node.names:
                names[alias.asname or alias.name] = f"{source}.{alias.name}"
        elif isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            names[node.name] = f"{dotted}.{node.name}"
    return names


def module_names(tree: SourceTree, dotted: str) -> set[str]:
    """The names a module defines, assigns or imports at its top level."""
    module = tree.module(dotted)
    if module is None:
        return set()
    names = set(_imported_names(module, dotted))
    for node in module.body:
        if isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Import):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.Try):  # try: from nixl import ...
            for sub in ast.walk(node):
                if isinstance(sub, ast.ImportFrom | ast.Import):
                    names |= {a.asname or a.name for a in sub.names}
                elif isinstance(sub, ast.Assign):
                    names |= {t.id for t in sub.targets if isinstance(t, ast.Name)}
    return names


def _find_class(tree: SourceTree, dotted: str, depth: int = 0) -> tuple[str, ast.ClassDef] | None:
    """The class ``dotted``, following re-exports (``from .x import C``)."""
    module_path, _, name = dotted.rpartition(".")
    module = tree.module(module_path)
    if module is None or depth > 8:
        return None
    for node in module.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return dotted, node
    target = _imported_names(module, module_path).get(name)
    return None if target is None else _find_class(tree, target, depth + 1)


def load_class(tree: SourceTree, dotted: str) -> ClassSource | None:
    """The class and its vLLM bases in C3 order (bases outside vLLM skipped)."""

    def linearize(path: str, seen: tuple[str, ...]) -> list[tuple[str, ast.ClassDef]]:
        found = _find_class(tree, path)
        if found is None or path in seen:
            return []
        real, node = found
        module_path = real.rpartition(".")[0]
        names = _imported_names(tree.module(module_path), module_path)
        bases = []
        for base in node.bases:
            if isinstance(base, ast.Name) and base.id in names:
                bases.append(names[base.id])
            elif isinstance(base, ast.Attribute):
                bases.append(ast.unparse(base))
        chains = [linearize(b, (*seen, path)) for b in bases if b.startswith("vllm.")]
        chains = [c for c in chains if c] + [[c[0] for c in chains if c]]
        result = [(real, node)]
        while any(chains):  # C3 merge
            for chain in chains:
                if not chain:
                    continue
                head = chain[0]
                if not any(head in other[1:] for other in chains):
                    break
            else:  # inconsistent: fall back to depth-first order
                head = next(c[0] for c in chains if c)
            result.append(head)
            chains = [[c for c in chain if c[0] != head[0]] for chain in chains]
        return result

    mro = linearize(dotted, ())
    return ClassSource(dotted, mro) if mro else None


def _owners(contract: Contract) -> Iterator[tuple[str, str, tuple[str, ...], tuple[str, ...]]]:
    """(owner, class path, methods we override or call, state we read)."""
    yield (
        "worker",
        contract.worker_class,
        contract.worker_overrides + contract.worker_calls,
        contract.worker_state + contract.worker_registered_state,
    )
    yield "connector", contract.connector_class, contract.connector_overrides, ()
    yield "listener", contract.listener_class, contract.listener_overrides, contract.listener_state
    if contract.scheduler_class:
        yield (
            "scheduler",
            contract.scheduler_class,
            contract.scheduler_overrides,
            contract.scheduler_state,
        )


def _wire_version(tree: SourceTree) -> int | None:
    module = tree.module(WIRE_MODULE)
    for node in module.body if module else []:
        target = node.target if isinstance(node, ast.AnnAssign) else None
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
        if isinstance(target, ast.Name) and target.id == "NIXL_CONNECTOR_VERSION":
            value = node.value
            if isinstance(value, ast.Constant) and isinstance(value.value, int):
                return value.value
    return None


def snapshot(tree: SourceTree, contract: Contract) -> dict:
    """What ``tree`` holds of ``contract``'s names (see the module docstring)."""
    owners: dict[str, dict] = {}
    for owner, class_path, methods, state in _owners(contract):
        source = load_class(tree, class_path)
        entry: dict = {"class": class_path, "found": source is not None, "methods": {}}
        for name in dict.fromkeys(methods):
            found = source.method(name) if source else None
            if found is None:
                entry["methods"][name] = None
                continue
            defined_in, node = found
            kind = signatures.decorator_kind(node)
            calls = sorted(
                {
                    sub.func.attr
                    for sub in ast.walk(node)
                    if isinstance(sub, ast.Call)
                    and isinstance(sub.func, ast.Attribute)
                    and isinstance(sub.func.value, ast.Name)
                    and sub.func.value.id == "self"
                }
            )
            entry["methods"][name] = {
                "calls": calls,
                "signature": signatures.of_source(node),
                "body": signatures.body_digest(node),
                "defined_in": defined_in.rsplit(".", 1)[-1],
                "overridden": name not in contract.worker_calls or owner != "worker",
                **({"kind": kind} if kind else {}),
            }
        entry["missing_state"] = sorted(n for n in set(state) if not (source and source.has(n)))
        owners[owner] = entry
    module_names_found = module_names(tree, contract.worker_module_path)
    return {
        "release": tree.version(),
        "glue_release": contract.release,
        "wire_version": _wire_version(tree),
        "owners": owners,
        "worker_module": {
            "module": contract.worker_module_path,
            "missing": sorted(n for n in contract.worker_module if n not in module_names_found),
        },
    }


def compare(recorded: dict, current: dict) -> list[str]:
    """Every difference between a recorded snapshot and another release's,
    one line each, most serious first."""
    gone, shape, bodies = [], [], []
    if recorded["wire_version"] != current["wire_version"]:
        shape.append(
            f"wire version: NIXL_CONNECTOR_VERSION {recorded['wire_version']} -> "
            f"{current['wire_version']} (the handshake's metadata changed)"
        )
    for owner, was in recorded["owners"].items():
        now = current["owners"].get(owner) or {"found": False, "methods": {}, "missing_state": []}
        label = f"{owner} {was['class'].rsplit('.', 1)[-1]}"
        if not now["found"]:
            gone.append(f"{label}: class gone ({was['class']})")
            continue
        for name, old in was["methods"].items():
            new = now["methods"].get(name)
            if new is None:
                gone.append(f"{label}.{name}: gone")
                continue
            if old is None:
                continue
            if old["signature"] != new["signature"]:
                shape.append(f"{label}.{name}: signature {old['signature']} -> {new['signature']}")
            if old["body"] != new["body"]:
                role = "overridden by the glue" if old.get("overridden") else "called by the glue"
                added = sorted(set(new.get("calls", ())) - set(old.get("calls", ())))
                dropped = sorted(set(old.get("calls", ())) - set(new.get("calls", ())))
                bodies.append(
                    f"{label}.{name}: body changed ({role})"
                    + (f"; now calls self.{', self.'.join(added)}" if added else "")
                    + (f"; no longer calls self.{', self.'.join(dropped)}" if dropped else "")
                )
            if old["defined_in"] != new["defined_in"]:
                bodies.append(
                    f"{label}.{name}: now defined in {new['defined_in']} (was {old['defined_in']})"
                )
        for name in sorted(set(now["missing_state"]) - set(was["missing_state"])):
            gone.append(f"{label}: no longer sets {name}")
    for name in current["worker_module"]["missing"]:
        if name not in recorded["worker_module"]["missing"]:
            gone.append(f"module {current['worker_module']['module']}: no {name}")
    return gone + shape + bodies


def _fetch_wheel(version: str, cache: Path) -> Path:
    """vLLM ``version``'s wheel, downloaded once (``pip download --no-deps``)."""
    cache.mkdir(parents=True, exist_ok=True)
    found = sorted(cache.glob(f"vllm-{version}-*.whl"))
    if found:
        return found[0]
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "-q",
            "--no-deps",
            "-d",
            str(cache),
            f"vllm=={version}",
        ],
        check=True,
    )
    found = sorted(cache.glob(f"vllm-{version}-*.whl"))
    if not found:
        raise FileNotFoundError(f"pip download left no vllm-{version} wheel in {cache}")
    return found[0]


def source_of(spec: str, cache: Path) -> SourceTree:
    """A wheel file, a directory holding ``vllm/``, or a version to download."""
    path = Path(spec)
    if path.exists():
        return SourceTree(path)
    if re.fullmatch(r"\d+\.\d+\.\d+\S*", spec):
        return SourceTree(_fetch_wheel(spec, cache))
    raise FileNotFoundError(f"{spec}: not a wheel, a directory or a vLLM version")


def recorded(glue: str) -> dict:
    """The recorded snapshot of glue ``glue``'s tested release."""
    contract = upstream_contract.CONTRACTS[glue]
    return json.loads((SNAPSHOTS / f"vllm-{contract.release}.json").read_text())


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="vllm-nixl-hma drift",
        description=(
            "Compare a vLLM release (wheel, directory or version) with what a glue "
            "relies on: names, signatures, bodies of the methods it overrides or calls, "
            "the wire version. Exit 0: nothing changed; 1: the printed list is the port's "
            "work list."
        ),
    )
    parser.add_argument("source", help="a vLLM wheel, a directory holding vllm/, or a version")
    parser.add_argument(
        "--glue",
        choices=sorted(upstream_contract.CONTRACTS),
        default=sorted(upstream_contract.CONTRACTS)[-1],
        help="the glue whose contract to compare against (default: the newest)",
    )
    parser.add_argument(
        "--record",
        action="store_true",
        help="write the source's snapshot as the glue's tested release's (a maintainer's step)",
    )
    parser.add_argument("--json", action="store_true", help="print the snapshot as JSON")
    parser.add_argument(
        "--cache", type=Path, default=Path(tempfile.gettempdir()) / "vllm_nixl_hma_wheels"
    )
    args = parser.parse_args(argv)
    contract = upstream_contract.CONTRACTS[args.glue]
    tree = source_of(args.source, args.cache)
    current = snapshot(tree, contract)
    if args.json:
        print(json.dumps(current, indent=1, sort_keys=True))
    if args.record:
        if current["release"] != contract.release:
            print(
                f"refusing to record vLLM {current['release']} as glue {args.glue}'s "
                f"tested release {contract.release}",
                file=sys.stderr,
            )
            return 2
        target = SNAPSHOTS / f"vllm-{contract.release}.json"
        target.write_text(json.dumps(current, indent=1, sort_keys=True) + "\n")
        print(f"recorded {target}")
        return 0
    differences = compare(recorded(args.glue), current)
    print(
        f"vLLM {current['release']} against glue {args.glue} (tested on vLLM "
        f"{contract.release}): {len(differences)} difference(s)"
    )
    for line in differences:
        print(f"  {line}")
    return 1 if differences else 0


if __name__ == "__main__":
    sys.exit(main())
