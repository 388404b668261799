"""The markers (``PerWalker``, ``Replicated``, ...) and the parsing of annotations into a layout.

Each marker is a ``typing.Annotated`` alias, so a type checker sees ``PerWalker[Array]``
as ``Array``; shardvmc reads the metadata once, at decoration time.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import inspect
import typing
from collections.abc import Callable
from typing import Annotated, Any, TypeVar

import jax

from ._errors import DecorationError, message

__all__ = ["Kind", "Layout", "Mean", "Param", "PerWalker", "Replicated", "Static", "Sum", "WalkerKey", "parse"]

T = TypeVar("T")


class Kind(enum.Enum):
    """How one parameter or output is laid out over the walkers."""

    PER_WALKER = "PerWalker"
    REPLICATED = "Replicated"
    KEY = "WalkerKey"
    STATIC = "Static"
    MEAN = "Mean"
    SUM = "Sum"

    def __repr__(self) -> str:
        return self.value


@dataclasses.dataclass(frozen=True)
class _Marker:
    kind: Kind

    def __repr__(self) -> str:
        return f"shardvmc.{self.kind.value}"


PARAM_KINDS = frozenset({Kind.PER_WALKER, Kind.REPLICATED, Kind.KEY, Kind.STATIC})
OUTPUT_KINDS = frozenset({Kind.PER_WALKER, Kind.MEAN, Kind.SUM, Kind.REPLICATED})

PerWalker = Annotated[T, _Marker(Kind.PER_WALKER)]
Replicated = Annotated[T, _Marker(Kind.REPLICATED)]
Static = Annotated[T, _Marker(Kind.STATIC)]
WalkerKey = Annotated[jax.Array, _Marker(Kind.KEY)]
Mean = Annotated[T, _Marker(Kind.MEAN)]
Sum = Annotated[T, _Marker(Kind.SUM)]

# Each alias gets its own docstring (``help(sv.PerWalker)``), not typing's generic one.
PerWalker.__doc__ = "Every leaf carries the walker axis first; the function body sees one walker."
Replicated.__doc__ = (
    "The same value on every device (parameters); the body sees all of it. As a return marker: a value a "
    "batched=True block function made equal on every device (e.g. with sv.all_walkers)."
)
Static.__doc__ = "A hashable Python value, a static argument of the compiled kernel."
WalkerKey.__doc__ = "One PRNG key from the caller; walker ``i`` sees ``jax.random.fold_in(key, i)``."
Mean.__doc__ = "Output averaged over the valid walkers, replicated on every device."
Sum.__doc__ = "Output summed over the valid walkers, replicated on every device."


@dataclasses.dataclass(frozen=True)
class Param:
    """One parameter of a walker-parallel function."""

    name: str
    kind: Kind


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where every parameter and output of a function lives.

    ``output`` is one kind for the whole output pytree, or a tuple of kinds, one per
    element of a tuple output.
    """

    params: tuple[Param, ...]
    output: Kind | tuple[Kind, ...]
    signature: inspect.Signature

    @functools.cached_property
    def keyword_only(self) -> tuple[str, ...]:
        """The names of the keyword-only parameters (the last ones, in order)."""
        return tuple(n for n, p in self.signature.parameters.items() if p.kind is p.KEYWORD_ONLY)


def _markers_of(hint: Any) -> list[Kind]:
    if typing.get_origin(hint) is Annotated:
        return [m.kind for m in hint.__metadata__ if isinstance(m, _Marker)]
    return []


def _kind(hint: Any, allowed: frozenset[Kind], qualname: str, what: str, fix: str) -> Kind | None:
    kinds = _markers_of(hint)
    if not kinds:
        return None
    if len(kinds) > 1:
        raise DecorationError(
            message(qualname, f"{what} has several markers: {', '.join(k.value for k in kinds)}.", fix=fix)
        )
    if kinds[0] not in allowed:
        raise DecorationError(
            message(
                qualname,
                f"{what} is marked {kinds[0].value}, which is not allowed there.",
                expected=" or ".join(sorted(k.value for k in allowed)),
                fix=fix,
            )
        )
    return kinds[0]


def _resolve_hints(fn: Callable[..., Any], qualname: str) -> dict[str, Any]:
    try:
        return typing.get_type_hints(fn, include_extras=True)
    except Exception as err:  # NameError for an unknown name, others for bad strings
        raise DecorationError(
            message(
                qualname,
                "an annotation could not be resolved, and shardvmc decides sharding from annotations.",
                got=f"{type(err).__name__}: {err}",
                fix="define or import every name used in the annotations at module level (also under "
                "`from __future__ import annotations`), or use sv.replicated_args for unannotated functions.",
            )
        ) from err


def parse(fn: Callable[..., Any], qualname: str, replicated: frozenset[str] = frozenset()) -> tuple[Layout, list[str]]:
    """Read the layout of ``fn`` from its annotations.

    Args:
        fn: the per-walker function.
        qualname: its name, for messages.
        replicated: names given to ``replicated_args``; when any are given, the other
            unannotated parameters default to ``PerWalker``.

    Returns:
        The layout, and the names of parameters that have no marker (empty when the
        layout is complete).

    Raises:
        DecorationError: for markers in the wrong place, a parameter named ``n_valid``,
            ``*args``/``**kwargs`` parameters, or unresolvable annotations.
    """
    signature = inspect.signature(fn)
    hints = _resolve_hints(fn, qualname)
    unknown = replicated - set(signature.parameters)
    if unknown:
        raise DecorationError(
            message(
                qualname,
                f"replicated_args names {sorted(unknown)}, which are not parameters.",
                got=f"parameters {list(signature.parameters)}",
                fix="name parameters of the function exactly.",
            )
        )
    params: list[Param] = []
    missing: list[str] = []
    for name, p in signature.parameters.items():
        where = f"parameter {name!r}"
        if name == "n_valid":
            raise DecorationError(
                message(
                    qualname,
                    "a parameter is named 'n_valid', which every walker-parallel function takes as its own keyword.",
                    fix="rename the parameter.",
                )
            )
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise DecorationError(
                message(
                    qualname,
                    f"{where} is *args or **kwargs, which cannot carry a marker.",
                    fix="list the parameters explicitly, each with a marker.",
                )
            )
        kind = _kind(
            hints.get(name),
            PARAM_KINDS,
            qualname,
            where,
            "mark parameters PerWalker[...], Replicated[...], WalkerKey or Static[...]; Mean and Sum are for returns.",
        )
        if name in replicated:
            if kind not in (None, Kind.REPLICATED):
                raise DecorationError(
                    message(
                        qualname,
                        f"{where} is named in replicated_args but annotated {kind.value}.",
                        fix="drop one of the two.",
                    )
                )
            kind = Kind.REPLICATED
        if kind is None:
            if replicated:
                kind = Kind.PER_WALKER
            else:
                missing.append(name)
                continue
        params.append(Param(name, kind))
    output = _parse_output(hints.get("return"), qualname)
    return Layout(tuple(params), output, signature), missing


def _parse_output(hint: Any, qualname: str) -> Kind | tuple[Kind, ...]:
    """The output layout; the rule for a return without a marker is ``PerWalker``.

    ``tuple[A, B]`` marks each element (an unmarked element is ``PerWalker``); a marker
    around the whole annotation (``Mean[tuple[...]]``) applies to every leaf.
    """
    fix = (
        "mark returns PerWalker[...], Mean[...] or Sum[...] (Replicated[...] for batched=True block functions); "
        "WalkerKey and Static are for parameters."
    )
    kind = _kind(hint, OUTPUT_KINDS, qualname, "the return annotation", fix)
    if kind is not None:
        return kind
    if typing.get_origin(hint) is tuple:
        elements = typing.get_args(hint)
        if elements and elements[-1] is Ellipsis:
            marked = _kind(elements[0], OUTPUT_KINDS, qualname, "the elements of the return annotation", fix)
            if marked is not None and marked is not Kind.PER_WALKER:
                raise DecorationError(
                    message(
                        qualname,
                        f"the return annotation is a tuple of any length marked {marked.value}, but a marker inside "
                        "a variadic tuple cannot say how many outputs there are.",
                        got=f"{hint}",
                        fix=f"mark the whole output: {marked.value}[tuple[...]] (every leaf), or list the elements: "
                        f"tuple[{marked.value}[...], {marked.value}[...]].",
                    )
                )
        elif elements:
            return tuple(
                _kind(h, OUTPUT_KINDS, qualname, f"element {i} of the return annotation", fix) or Kind.PER_WALKER
                for i, h in enumerate(elements)
            )
    return Kind.PER_WALKER


def missing_markers_error(qualname: str, missing: list[str]) -> DecorationError:
    """The error for parameters that carry no marker."""
    names = ", ".join(repr(m) for m in missing)
    subject = f"parameter {names} has" if len(missing) == 1 else f"parameters {names} have"
    return DecorationError(
        message(
            qualname,
            f"{subject} no shardvmc marker, so their sharding is unknown.",
            expected="PerWalker[...], Replicated[...], WalkerKey or Static[...] on every parameter",
            fix="annotate them, e.g. `r: PerWalker[jax.Array]`, or decorate with "
            "@sv.replicated_args('params', ...) so that the others default to PerWalker.",
        )
    )
