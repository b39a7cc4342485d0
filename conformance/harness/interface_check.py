"""Does an area module provide what its protocol in ``reference.contract.interfaces`` asks for?

The suite (``test_area_interfaces.py``) and the contract self-test run :func:`interface_problems` on an area
module; it returns one line per problem (a missing name, a class that is not the contract's, a signature that
refuses a call the contract makes), empty when the module conforms. Names the implementation declares
unsupported are not checked. The rules of compatibility are the module docstring of
``reference.contract.interfaces``.
"""

from __future__ import annotations

import ast
import inspect
import re
import typing
from collections.abc import Collection
from types import ModuleType
from typing import Any

from reference.contract import interfaces
from reference.contract.capabilities import Capabilities

_P = inspect.Parameter
_POSITIONAL = (_P.POSITIONAL_ONLY, _P.POSITIONAL_OR_KEYWORD)
_UNREADABLE_DEFAULT = object()  # a default a docstring shows but Python cannot read back: not compared


def interface_problems(module: ModuleType, area: str, capabilities: Capabilities | None = None,
                       unsupported: Collection[str] = ()) -> list[str]:
    """What ``module`` (implementing ``area``) lacks or gets wrong, as ``"<area>.<name>: <problem>"`` lines.
    ``capabilities`` (default: none declared) adds the protocols of declared capabilities."""
    capabilities = capabilities or Capabilities()
    namespace = interfaces.contract_namespace()
    required = [interfaces.AREA_INTERFACES[area]]
    required += [p for (a, flag), p in interfaces.CAPABILITY_INTERFACES.items()
                 if a == area and capabilities.declares(flag)]
    required += [p for (a, flag), p in interfaces.UNLESS_CAPABILITY_INTERFACES.items()
                 if a == area and not capabilities.declares(flag)]
    checks = [(p, True) for p in required]
    checks += [(p, False) for p in interfaces.OPTIONAL_INTERFACES.get(area, ()) if p not in required]
    problems = []
    for protocol, must in checks:
        hints = typing.get_type_hints(protocol, globalns=namespace, localns=namespace)
        for name in interfaces.protocol_members(protocol):
            if f"{area}.{name}" in unsupported:
                continue
            if not hasattr(module, name):
                if must:
                    problems.append(f"{area}.{name}: missing from {module.__name__}")
                continue
            value = getattr(module, name)
            if name in hints:
                problem = _annotation_problem(value, hints[name], namespace)
            else:
                problem = _callable_problem(value, getattr(protocol, name), bound=True)
            if problem:
                problems.append(f"{area}.{name}: {problem}")
    return problems


def _annotation_problem(value: Any, hint: Any, namespace: dict[str, Any]) -> str | None:
    if typing.get_origin(hint) is type:
        (target,) = typing.get_args(hint)
        if not isinstance(value, type):
            return f"is {type(value).__name__} {value!r}, not a class"
        if getattr(target, "_is_protocol", False):
            return _class_problem(value, target, namespace)
        if not issubclass(value, target):
            return f"is {value.__module__}.{value.__qualname__}, not {target.__module__}.{target.__qualname__} " \
                   "(or a subclass): contract types are shared, import it from reference.contract"
        return None
    expected = typing.get_origin(hint) or hint
    if not isinstance(value, expected):
        return f"is {type(value).__name__}, the contract says {getattr(hint, '__name__', hint)}"
    return None


def _class_problem(cls: type, protocol: type, namespace: dict[str, Any]) -> str | None:
    hints = typing.get_type_hints(protocol, globalns=namespace, localns=namespace)
    for name in interfaces.protocol_members(protocol):
        if name in hints:
            continue  # data attributes and properties: set per instance, documented by the protocol
        method = getattr(cls, name, None)
        if method is None:
            return f"class {cls.__name__} has no method {name}"
        problem = _callable_problem(method, getattr(protocol, name), bound=False)
        if problem:
            return f"{cls.__name__}.{name}: {problem}"
    return None


def _callable_problem(value: Any, contract: Any, *, bound: bool) -> str | None:
    """``bound``: ``value`` is a module-level function (the protocol's ``self`` is the module); otherwise an
    attribute of a class, whose own first parameter is ``self`` too."""
    if not callable(value):
        return f"is {type(value).__name__}, not callable"
    expected = _drop_first(inspect.signature(contract))
    actual = signature_of(value)
    if actual is None:
        return "its signature cannot be read (no inspect.signature, no 'name(args)' first docstring line)"
    if not bound:
        actual = _drop_first(actual)
    problem = signature_incompatibility(expected, actual)
    return f"{problem} (contract: {expected}, here: {actual})" if problem else None


def _drop_first(sig: inspect.Signature) -> inspect.Signature:
    params = list(sig.parameters.values())
    if params and params[0].kind in _POSITIONAL:
        params = params[1:]
    return sig.replace(parameters=params)


def signature_of(value: Any) -> inspect.Signature | None:
    """``inspect.signature``, else the one a native function's docstring states on its first line."""
    try:
        return inspect.signature(value)
    except (TypeError, ValueError):
        pass
    doc = (getattr(value, "__doc__", None) or "").strip().splitlines()
    match = re.match(r"^[\w.]+\((.*)\)\s*(->.*)?$", doc[0]) if doc else None
    if match is None:
        return None
    try:
        args = ast.parse(f"def f({match.group(1)}): pass").body[0].args  # type: ignore[attr-defined]
    except SyntaxError:
        return None
    return _signature_from_ast(args)


def _signature_from_ast(args: ast.arguments) -> inspect.Signature:
    def default(node: ast.expr | None) -> Any:
        if node is None:
            return _P.empty
        try:
            return ast.literal_eval(node)
        except ValueError:
            return _UNREADABLE_DEFAULT

    params = []
    positional = [*args.posonlyargs, *args.args]
    defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    for i, (arg, d) in enumerate(zip(positional, defaults, strict=True)):
        kind = _P.POSITIONAL_ONLY if i < len(args.posonlyargs) else _P.POSITIONAL_OR_KEYWORD
        params.append(_P(arg.arg, kind, default=default(d)))
    if args.vararg:
        params.append(_P(args.vararg.arg, _P.VAR_POSITIONAL))
    for arg, d in zip(args.kwonlyargs, args.kw_defaults, strict=True):
        params.append(_P(arg.arg, _P.KEYWORD_ONLY, default=default(d)))
    if args.kwarg:
        params.append(_P(args.kwarg.arg, _P.VAR_KEYWORD))
    return inspect.Signature(params)


def signature_incompatibility(expected: inspect.Signature, actual: inspect.Signature) -> str | None:
    """Why a callable with ``actual`` refuses some call ``expected`` allows (or gives it other defaults)."""
    act = list(actual.parameters.values())
    act_positional = [p for p in act if p.kind in _POSITIONAL]
    act_keyword = {p.name: p for p in act if p.kind in (_P.POSITIONAL_OR_KEYWORD, _P.KEYWORD_ONLY)}
    has_var_positional = any(p.kind is _P.VAR_POSITIONAL for p in act)
    has_var_keyword = any(p.kind is _P.VAR_KEYWORD for p in act)
    used: set[str] = set()
    position = 0
    for p in expected.parameters.values():
        match: inspect.Parameter | None = None
        if p.kind in _POSITIONAL:
            if position < len(act_positional):
                match = act_positional[position]
                if p.kind is _P.POSITIONAL_OR_KEYWORD and (match.name != p.name or match.kind is _P.POSITIONAL_ONLY):
                    return f"parameter {position + 1} is {match.name!r}, the contract's is {p.name!r} (by keyword too)"
            elif not has_var_positional:
                return f"takes no parameter {p.name!r} at position {position + 1}"
            position += 1
        elif p.kind is _P.VAR_POSITIONAL:
            if not has_var_positional:
                return f"takes no *{p.name}"
        elif p.kind is _P.KEYWORD_ONLY:
            match = act_keyword.get(p.name)
            if match is None and not has_var_keyword:
                return f"takes no keyword {p.name!r}"
        elif not has_var_keyword:
            return f"takes no **{p.name}"
        if match is not None:
            used.add(match.name)
            problem = _default_problem(p, match)
            if problem:
                return problem
    for q in act:
        if q.kind in (*_POSITIONAL, _P.KEYWORD_ONLY) and q.name not in used and q.default is _P.empty:
            return f"requires {q.name!r}, which the contract never passes"
    return None


def _default_problem(contract: inspect.Parameter, actual: inspect.Parameter) -> str | None:
    if contract.default is _P.empty:
        return None
    if actual.default is not _P.empty and contract.default is Ellipsis:
        return None  # the contract asks for a default, of the implementation's choosing
    if actual.default is _P.empty:
        return f"{actual.name!r} is required, the contract's {contract.name!r} defaults to {contract.default!r}"
    if actual.default is _UNREADABLE_DEFAULT:
        return None
    if type(actual.default) is not type(contract.default) or actual.default != contract.default:
        return f"{actual.name!r} defaults to {actual.default!r}, the contract's to {contract.default!r}"
    return None
