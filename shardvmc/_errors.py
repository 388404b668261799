"""The two exception classes of shardvmc and the one message format they share."""

from __future__ import annotations

import sys
from pathlib import Path
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
    "user_stacklevel",
]

_PACKAGE = str(Path(__file__).resolve().parent)


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


def user_stacklevel() -> int:
    """The ``stacklevel`` of ``warnings.warn``, called here, that names the user's line: the first outside shardvmc.

    Frames of shardvmc's own modules (and of JAX's, where a warning is raised while a user's
    function traces) are skipped, so a warning names the call in the user's code.
    """
    frame, level = sys._getframe(1), 1
    while frame is not None and (
        frame.f_code.co_filename.startswith(_PACKAGE) or frame.f_globals.get("__name__", "").startswith("jax")
    ):
        frame, level = frame.f_back, level + 1
    return level
