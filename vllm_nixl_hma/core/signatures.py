"""One text for a function's parameters, read from a live function (at
startup) or from its source (``vllm-nixl-hma drift``, reading a release that
is not installed), so that the two can be compared.

The text keeps what a caller depends on: each parameter's name, its kind
(positional-only ``/``, keyword-only after ``*``, ``*args``, ``**kwargs``)
and whether it is required (an optional one ends in ``=``). Annotations and
default values are left out: vLLM changes them without breaking a caller.
``(self, nixl_agent_meta, remote_tp_size, remote_dcp_size=)`` is vLLM
0.33.0's ``_validate_remote_agent_handshake``.

Pure: no vLLM import; ``inspect`` and ``ast`` only.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
from collections.abc import Callable

__all__ = ["body_digest", "of_function", "of_source"]

#: what a class attribute is when it is not a plain function
STATIC, CLASS, PROPERTY = "staticmethod", "classmethod", "property"


def _text(
    positional_only: list[tuple[str, bool]],
    positional: list[tuple[str, bool]],
    var_positional: str | None,
    keyword_only: list[tuple[str, bool]],
    var_keyword: str | None,
) -> str:
    """The one text, from (name, optional) lists of each kind."""

    def one(name: str, optional: bool) -> str:
        return f"{name}=" if optional else name

    parts = [one(*p) for p in positional_only]
    if positional_only:
        parts.append("/")
    parts += [one(*p) for p in positional]
    if var_positional is not None:
        parts.append(f"*{var_positional}")
    elif keyword_only:
        parts.append("*")
    parts += [one(*p) for p in keyword_only]
    if var_keyword is not None:
        parts.append(f"**{var_keyword}")
    return f"({', '.join(parts)})"


def of_function(function: Callable) -> str:
    """The text of a live function or method, as looked up on its class
    (``getattr(cls, name)``: a plain method keeps ``self``, a classmethod is
    bound and loses ``cls``)."""
    kinds: dict[inspect._ParameterKind, list[tuple[str, bool]]] = {
        inspect.Parameter.POSITIONAL_ONLY: [],
        inspect.Parameter.POSITIONAL_OR_KEYWORD: [],
        inspect.Parameter.KEYWORD_ONLY: [],
    }
    var_positional = var_keyword = None
    for parameter in inspect.signature(function).parameters.values():
        if parameter.kind is inspect.Parameter.VAR_POSITIONAL:
            var_positional = parameter.name
        elif parameter.kind is inspect.Parameter.VAR_KEYWORD:
            var_keyword = parameter.name
        else:
            optional = parameter.default is not inspect.Parameter.empty
            kinds[parameter.kind].append((parameter.name, optional))
    return _text(
        kinds[inspect.Parameter.POSITIONAL_ONLY],
        kinds[inspect.Parameter.POSITIONAL_OR_KEYWORD],
        var_positional,
        kinds[inspect.Parameter.KEYWORD_ONLY],
        var_keyword,
    )


def decorator_kind(function: ast.FunctionDef | ast.AsyncFunctionDef) -> str | None:
    """``STATIC``, ``CLASS``, ``PROPERTY`` (also ``cached_property``) or None."""
    for decorator in function.decorator_list:
        name = (
            decorator.attr
            if isinstance(decorator, ast.Attribute)
            else getattr(decorator, "id", None)
        )
        if name == "staticmethod":
            return STATIC
        if name == "classmethod":
            return CLASS
        if name in ("property", "cached_property"):
            return PROPERTY
    return None


def of_source(function: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    """The text of a method defined in a class body, as ``of_function`` gives
    it for the method looked up on its class."""
    arguments = function.args
    ordered = [(a.arg, False) for a in arguments.posonlyargs + arguments.args]
    # defaults belong to the last positional parameters
    for index in range(len(ordered) - len(arguments.defaults), len(ordered)):
        ordered[index] = (ordered[index][0], True)
    positional_only = ordered[: len(arguments.posonlyargs)]
    positional = ordered[len(arguments.posonlyargs) :]
    if decorator_kind(function) == CLASS:  # bound on lookup: cls is gone
        if positional_only:
            positional_only = positional_only[1:]
        else:
            positional = positional[1:]
    keyword_only = [
        (a.arg, default is not None)
        for a, default in zip(arguments.kwonlyargs, arguments.kw_defaults, strict=True)
    ]
    return _text(
        positional_only,
        positional,
        arguments.vararg.arg if arguments.vararg else None,
        keyword_only,
        arguments.kwarg.arg if arguments.kwarg else None,
    )


def body_digest(function: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    """A digest of what a method does: its parameters and statements, without
    its docstring, comments, formatting or line numbers (12 hex digits)."""
    statements = function.body
    if (
        statements
        and isinstance(statements[0], ast.Expr)
        and isinstance(statements[0].value, ast.Constant)
        and isinstance(statements[0].value.value, str)
    ):
        statements = statements[1:]
    text = ast.dump(function.args) + "".join(ast.dump(s) for s in statements)
    return hashlib.sha256(text.encode()).hexdigest()[:12]
