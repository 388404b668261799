"""shardvmc's exception classes, the one message format they share, and warnings attributed to the user's line."""

from __future__ import annotations

import importlib.util
import os
import sys
import warnings
from types import FrameType
from typing import Any

import jax
import numpy as np

__all__ = [
    "ArgumentsError",
    "CallError",
    "CheckpointNotFoundError",
    "DamagedCheckpointError",
    "DecorationError",
    "ShardvmcError",
    "UnhashableStaticError",
    "describe",
    "message",
    "user_frame",
    "warn_at_user",
]


class ShardvmcError(Exception):
    """Base class of every error shardvmc raises on purpose."""


class DecorationError(ShardvmcError, TypeError):
    """A function cannot be made walker-parallel as written (raised when decorating).

    Raised for a parameter without a marker, a marker in the wrong place, a parameter
    named ``n_valid``, or an annotation that cannot be resolved.
    """


class CallError(ShardvmcError, ValueError):
    """The arguments of a call do not fit the walker layout (raised when calling).

    Raised for walker axes of different sizes, zero walkers, ``n_valid`` out of range,
    keys that are not keys, meshes without the walker axis, and walker counts that a
    mesh cannot split evenly.
    """


class CheckpointNotFoundError(ShardvmcError, FileNotFoundError):
    """No checkpoint at the path, or not the step asked for (a ``FileNotFoundError``: catch it to start afresh)."""


class DamagedCheckpointError(CallError):
    """A checkpoint's files are damaged: a checksum that does not match, a file missing, truncated or malformed.

    Raised when restoring that checkpoint; the message names it, its step and, for array data, the pytree
    path. A directory of steps restored without a step skips damaged steps (with a
    :class:`~shardvmc.DamagedCheckpointWarning`) and raises this only when no step is intact.
    """


class ArgumentsError(CallError, TypeError):
    """The arguments of a call do not bind to the function's parameters (a missing or unknown one)."""


class UnhashableStaticError(CallError, TypeError):
    """A ``Static`` argument is not hashable, so it cannot key the compilation cache."""


def install(extra: str) -> str:
    """The command that installs ``extra``, as the documentation gives it: in the clone, editable.

    Example:
        >>> from shardvmc._errors import install
        >>> install("checkpoint")
        'pip install -e ".[checkpoint]" in the shardvmc clone'
    """
    return f'pip install -e ".[{extra}]" in the shardvmc clone'


def message(
    where: str,
    problem: str,
    *,
    got: str | None = None,
    expected: str | None = None,
    fix: str | None = None,
) -> str:
    """Format an error message in the sections every shardvmc error uses.

    Args:
        where: the function (qualified name) or toolkit entry point concerned.
        problem: one sentence naming the parameter or pytree path at fault.
        got: what was received (shapes, types, mesh).
        expected: what was expected instead.
        fix: how to fix it.
    """
    lines = [f"{where}: {problem}"]
    for label, text in (("got", got), ("expected", expected), ("fix", fix)):
        if text is not None:
            lines.append(f"  {label + ':':<9} {text}")
    return "\n".join(lines)


def describe(tree: Any) -> str:
    """A pytree with each leaf shown as ``dtype[shape]`` (or its type name), for messages.

    Example:
        >>> import numpy as np
        >>> from shardvmc._errors import describe
        >>> describe({"r": np.zeros((8, 3), np.float32), "label": "H2"})
        "{'label': 'str', 'r': 'float32[8, 3]'}"
    """

    def one(x: Any) -> str:
        dtype = getattr(x, "dtype", None)
        return f"{dtype}{list(np.shape(x))}" if dtype is not None else type(x).__name__

    return str(jax.tree_util.tree_map(one, tree))


def _package_dirs(*names: str) -> tuple[str, ...]:
    dirs = []
    for name in names:
        found = importlib.util.find_spec(name)
        if found is not None:
            dirs += [os.path.join(d, "") for d in found.submodule_search_locations or ()]
    return tuple(dirs)


# The code between a user's call and a warning about it: shardvmc's, and JAX's (a kernel warns while its
# jax.jit traces, also inside the user's own jax.jit, grad, scan...). Frames of these files are not the user's.
_INTERNAL_DIRS = (os.path.join(os.path.dirname(os.path.abspath(__file__)), ""), *_package_dirs("jax", "jaxlib"))


def user_frame() -> FrameType | None:
    """The innermost frame outside shardvmc and JAX: the user's line that called into shardvmc.

    ``warnings.warn(skip_file_prefixes=...)`` does this on Python 3.12+; shardvmc supports 3.11.
    ``None`` when every frame is internal.
    """
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_INTERNAL_DIRS):
        frame = frame.f_back
    return frame


def warn_at_user(text: str, category: type[Warning]) -> None:
    """``warnings.warn(text, category)`` attributed to the user's line (:func:`user_frame`), with its filters."""
    frame = user_frame()
    if frame is None:
        warnings.warn(text, category, stacklevel=2)
        return
    globals_ = frame.f_globals
    warnings.warn_explicit(
        text,
        category,
        filename=frame.f_code.co_filename,
        lineno=frame.f_lineno,
        module=globals_.get("__name__", "<unknown>"),
        registry=globals_.setdefault("__warningregistry__", {}),  # the "default" action: once per line, as warn's
    )  # (no module_globals: on Python 3.13 a script's, without __spec__, makes importlib warn DeprecationWarning)
