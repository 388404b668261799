"""Callbacks of :func:`shardvmc.driver.run`: stop a run on a non-finite statistic, a time limit, or your condition.

A callback is any callable ``callback(step, stats)`` (the :class:`Callback` protocol): ``step`` is the index of
the step just done (from 0), ``stats`` its statistics as Python floats (the step's own, and ``step_time``). A
true return stops the run (a string is the reason the result reports); ``None`` or ``False`` lets it go on. A
callback may also have a method ``start(step)``, called once before the first step of a run (``step``: where the
run starts, after a resume), and an attribute ``save_on_stop`` (default ``True``): whether the loop checkpoints
the state when this callback stops the run.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from typing import Protocol, runtime_checkable

from ._errors import CallError, message

__all__ = ["Callback", "StopOnNonFinite", "Timeout"]


@runtime_checkable
class Callback(Protocol):
    """What :func:`shardvmc.driver.run` calls after every step, in step order, on every process.

    Return a true value to stop the run: a string is reported as the reason
    (``result.reason``); any other true value reports the callback itself. Only the
    callable is required; ``start(step)`` and ``save_on_stop`` are optional (see the module).

    Example:
        >>> def converged(step, stats):  # a user condition: stop once the error bar is small
        ...     return stats["error"] < 1e-3 and f"converged at step {step}"
        >>> converged(7, {"error": 5e-4})
        'converged at step 7'
    """

    def __call__(self, step: int, stats: Mapping[str, float]) -> object: ...


class StopOnNonFinite:
    """Stop the run at the first step whose statistic is ``nan`` or infinite, without checkpointing that state.

    The default callback of :func:`shardvmc.driver.run` (as NetKet's ``InvalidLossStopping``).

    Args:
        *names: the statistics to watch (e.g. ``"energy"``); none: every statistic of the step.

    Example:
        >>> import shardvmc as sv
        >>> stop = sv.driver.StopOnNonFinite("energy")
        >>> stop(3, {"energy": -2.9}), stop(4, {"energy": float("nan")})
        (None, 'energy is nan at step 4')
    """

    save_on_stop = False  # a state reached through a non-finite statistic is not worth continuing from

    def __init__(self, *names: str) -> None:
        if not all(isinstance(n, str) for n in names):
            raise CallError(
                message("StopOnNonFinite", "the names must be strings.", got=repr(names), fix='e.g. ("energy",).')
            )
        self.names = names

    def __call__(self, step: int, stats: Mapping[str, float]) -> str | None:
        for name in self.names or tuple(stats):
            value = stats.get(name)
            if value is not None and not math.isfinite(value):
                return f"{name} is {value} at step {step}"
        return None

    def __repr__(self) -> str:
        return f"StopOnNonFinite({', '.join(map(repr, self.names))})"


class Timeout:
    """Stop the run once ``seconds`` of wall time have passed since it started (its state is checkpointed).

    The clock of process 0 decides for every process. Useful in a job with a time limit: the run
    stops with a checkpoint before the scheduler kills it, and the same call resumes it.

    Args:
        seconds: the time limit (from the start of :func:`shardvmc.driver.run`).

    Example:
        >>> import shardvmc as sv
        >>> timeout = sv.driver.Timeout(3600.0)
        >>> timeout.start(0)
        >>> timeout(0, {"energy": -2.9}) is None
        True
    """

    def __init__(self, seconds: float) -> None:
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
            raise CallError(message("Timeout", "seconds must be a positive number.", got=repr(seconds)))
        self.seconds = float(seconds)
        self._start = time.monotonic()

    def start(self, step: int) -> None:
        self._start = time.monotonic()

    def __call__(self, step: int, stats: Mapping[str, float]) -> str | None:
        if time.monotonic() - self._start >= self.seconds:
            return f"the time limit of {self.seconds:g} s was reached at step {step}"
        return None

    def __repr__(self) -> str:
        return f"Timeout({self.seconds:g})"
