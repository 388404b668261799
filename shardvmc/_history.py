"""The statistics of every step of a :func:`shardvmc.driver.run` with a checkpoint directory: ``DIR/log.jsonl``.

A checkpoint holds the state, the key, the step count and the run's settings, not the statistics: with them, its
size and its save time grew with the run (3.6 MB and about a second at step 40,000 of a trivial step). The run's
own JSON-lines log holds them instead, a line per step in exact floats, appended as the run goes and flushed
before each checkpoint is saved, so it holds at least the steps of the newest checkpoint. A run that resumes at
step ``s`` reads the lines of steps below ``s`` back, on every process (the directory is shared, as the
checkpoints' is), for its result's history; process 0 then rewrites the file with those lines, each step once,
before it appends the steps it runs. Checkpoints written before (shardvmc 0.4.0 in development), whose metadata
carries every step's statistics (``"history"``), give their history from there.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

from ._errors import warn_at_user
from ._loggers import JsonLog, json_step, lines_before

__all__ = ["LOG_NAME", "RunLog", "merge"]

LOG_NAME = "log.jsonl"
"""The run's log, and the store of its history, in its checkpoint directory."""


def _columns(rows: Mapping[int, Mapping[str, float]], n: int) -> dict[str, list[float]]:
    """``{name: [value of step 0 .. n - 1]}`` of ``rows`` (by step), NaN where a step or a name is missing."""
    names = list(dict.fromkeys(name for row in rows.values() for name in row if name != "step"))
    return {name: [float(rows[t].get(name, math.nan)) if t in rows else math.nan for t in range(n)] for name in names}


def merge(restored: Mapping[str, Sequence[float]], rows: Sequence[Mapping[str, float]]) -> dict[str, list[float]]:
    """Every step's statistics, the restored ones first: ``{name: [value per step]}``, NaN where a name is missing."""
    names = list(restored) + [k for row in rows[:1] for k in row if k not in restored]
    n_restored = len(next(iter(restored.values()))) if restored else 0
    return {
        name: list(restored.get(name, [math.nan] * n_restored)) + [row.get(name, math.nan) for row in rows]
        for name in names
    }


def _gaps(steps: Sequence[int]) -> str:
    """``"3, 7-9"`` for steps 3, 7, 8, 9 (sorted)."""
    spans: list[list[int]] = []
    for t in steps:
        if spans and t == spans[-1][1] + 1:
            spans[-1][1] = t
        else:
            spans.append([t, t])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


class RunLog(JsonLog):
    """``DIR/log.jsonl``: the run's log (a :class:`JsonLog`) and the store of its history.

    Call :meth:`history` on every process before process 0 opens it, with the step the run resumes at.
    """

    def __init__(self, path: str | Path) -> None:
        super().__init__(path)
        self._start = -1
        self._lines: list[str] = []  # the lines of the steps before _start, as history() read them
        self._saved: dict[str, list[float]] | None = None  # an earlier checkpoint's own history

    def history(
        self, start: int, saved: Mapping[str, Sequence[float]] | None = None, *, warn: bool = True
    ) -> dict[str, list[float]]:
        """The statistics of steps ``0 .. start - 1``: from the log, or ``saved`` (an earlier checkpoint's).

        A step the log lacks (the file deleted, or cut short) has NaN statistics, with a ``UserWarning``
        (``warn=False``: none, as on the processes other than 0).
        """
        self._start, self._saved = start, None
        self._lines = lines_before(self.path, start, json_step)
        if saved is not None:
            self._saved = {name: list(values) for name, values in saved.items()}
            return self._saved
        rows = {}
        for line in self._lines:
            row = json.loads(line)
            step = row.get("step") if isinstance(row, dict) else None
            if isinstance(step, int) and not isinstance(step, bool):
                rows[step] = row
        missing = [t for t in range(start) if t not in rows]
        if missing and warn:
            warn_at_user(
                f"shardvmc.driver.run: {str(self.path)!r} lacks the statistics of steps {_gaps(missing)} of the "
                f"{start} the checkpoint holds: the resumed history has NaN there (the state and the trajectory "
                "are not affected).",
                UserWarning,
            )
        return _columns(rows, start)

    def _kept(self, start: int) -> list[str]:
        lines = self._lines if start == self._start else super()._kept(start)
        if self._saved is None or start != self._start:
            return lines
        # A checkpoint that carried its history: the steps the log lacks are written from it, in step order.
        have = {json_step(line): line for line in lines}
        names = list(self._saved)
        for t in range(start):
            if t not in have:
                have[t] = json.dumps({"step": t, **{name: self._saved[name][t] for name in names}}) + "\n"
        return [have[t] for t in range(start)] + [line for step, line in have.items() if step is None]
