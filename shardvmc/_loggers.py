"""Loggers of :func:`shardvmc.driver.run`: JSON lines (the default), CSV, TensorBoard, and lines on a terminal.

A logger implements the :class:`Logger` protocol: ``open(start, total)`` before the first step of a run
(``start`` is where the run starts: rows of an earlier run at steps ``>= start`` are dropped, so a resumed run
writes every step once), ``write(step, stats)`` after each step in order, ``flush()`` before every checkpoint, and
``close()`` at the end. The loop calls loggers on process 0 only.
"""

from __future__ import annotations

import csv
import importlib
import io
import json
import math
import os
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any, Protocol, runtime_checkable

import numpy as np

from ._errors import CallError, install, message

__all__ = ["CSVLog", "JsonLog", "Logger", "PrintLog", "TensorBoardLog", "read_log"]

TENSORBOARD_INSTALL = install("tensorboard")


@runtime_checkable
class Logger(Protocol):
    """What :func:`shardvmc.driver.run` writes each step's statistics to (on process 0 only).

    ``stats`` maps names to Python floats: the step's own statistics and the loop's ``step_time``.
    """

    def open(self, start: int, total: int) -> None:
        """Called once before the first step: ``start`` is the first step of this run, ``total`` the run's end."""
        ...

    def write(self, step: int, stats: Mapping[str, float]) -> None:
        """The statistics of step ``step`` (from 0), in step order."""
        ...

    def flush(self) -> None:
        """Make what was written durable (called before every checkpoint is saved)."""
        ...

    def close(self) -> None:
        """Flush and release the file (called at the end of the run, also after an error)."""
        ...


def lines_before(path: Path, start: int, read_step: Callable[[str], int | None]) -> list[str]:
    """The lines of ``path`` a run that starts at ``start`` keeps: each step below ``start`` once, and the header.

    ``read_step(line)`` is the line's step, ``None`` for a line without one (a header, kept as it is), or raises
    ``ValueError`` for a line that cannot be read. Dropped: the lines of steps at or after ``start`` (the run
    redoes them), an unterminated last line or one that cannot be read (a process killed while writing it). A
    step written twice keeps its last line, in the place of its first.
    """
    if start <= 0 or not path.exists():
        return []
    kept: list[str] = []
    where: dict[int, int] = {}  # step -> its line's index in kept
    with open(path, newline="") as f:
        for line in f:
            if not line.endswith("\n"):
                continue  # every line is written whole with its newline: this one was cut off
            try:
                step = read_step(line)
            except ValueError:
                continue
            if step is None:
                kept.append(line)
            elif step in where:
                kept[where[step]] = line
            elif step < start:
                where[step] = len(kept)
                kept.append(line)
    return kept


def replace_lines(path: Path, lines: list[str]) -> None:
    """``path`` rewritten with ``lines``, atomically: a run killed here leaves the old file or the new one."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", newline="") as f:
        f.writelines(lines)
    os.replace(tmp, path)


def json_step(line: str) -> int | None:
    """The step of a :class:`JsonLog` line (``None`` for a blank line or one without a step; ``ValueError`` if torn)."""
    if not line.strip():
        return None
    row = json.loads(line)
    step = row.get("step") if isinstance(row, dict) else None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


class JsonLog:
    """One JSON object per step and line, ``{"step": 0, "energy": -2.9, ...}``: the default logger.

    :func:`shardvmc.driver.run` writes ``<checkpoint>/log.jsonl`` with it when given a checkpoint
    directory. Floats are written in their shortest round-trip form (read back exactly);
    ``nan`` and infinities as JSON's ``NaN`` and ``Infinity`` (which Python's ``json`` reads).
    A resumed run drops the lines of steps it redoes. :func:`read_log` reads the file back.

    Args:
        path: the file (created with its folder; rewritten by a run that starts at step 0).
        flush_seconds: write to the file at least this often (and at every checkpoint).

    Example:
        >>> import os, tempfile, shardvmc as sv
        >>> path = os.path.join(tempfile.mkdtemp(), "log.jsonl")
        >>> log = sv.driver.JsonLog(path)
        >>> log.open(0, 2); log.write(0, {"energy": -2.5}); log.write(1, {"energy": -2.75}); log.close()
        >>> sv.driver.read_log(path)["energy"]
        array([-2.5 , -2.75])
    """

    def __init__(self, path: str | os.PathLike[str], *, flush_seconds: float = 10.0) -> None:
        self.path = Path(path)
        self.flush_seconds = flush_seconds
        self._file: IO[str] | None = None
        self._flushed = 0.0

    def open(self, start: int, total: int) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if start > 0:
            replace_lines(self.path, self._kept(start))
        self._file = open(self.path, "a" if start > 0 else "w")
        self._flushed = time.monotonic()

    def _kept(self, start: int) -> list[str]:
        """The lines a run that starts at ``start`` keeps (see :func:`lines_before`)."""
        return lines_before(self.path, start, json_step)

    def write(self, step: int, stats: Mapping[str, float]) -> None:
        assert self._file is not None, "JsonLog.write before open"
        self._file.write(json.dumps({"step": step, **stats}) + "\n")
        if time.monotonic() - self._flushed > self.flush_seconds:
            self.flush()

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()
            self._flushed = time.monotonic()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __repr__(self) -> str:
        return f"JsonLog({str(self.path)!r})"


class CSVLog:
    """A CSV table, a row per step: ``step`` then the statistics, in the order of the first step's (FermiNet's way).

    Floats in their shortest round-trip form. A resumed run keeps the header and drops the rows
    of the steps it redoes.

    Args:
        path: the file (created with its folder).

    Example:
        >>> import os, tempfile, shardvmc as sv
        >>> from pathlib import Path
        >>> path = os.path.join(tempfile.mkdtemp(), "stats.csv")
        >>> log = sv.driver.CSVLog(path)
        >>> log.open(0, 1); log.write(0, {"energy": -2.5, "variance": 0.125}); log.close()
        >>> Path(path).read_text().split()
        ['step,energy,variance', '0,-2.5,0.125']
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._file: IO[str] | None = None
        self._writer: Any = None
        self._columns: list[str] | None = None

    def open(self, start: int, total: int) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)

        def step_of(line: str) -> int | None:
            first = line.split(",", 1)[0].strip()
            return int(first) if first.lstrip("-").isdigit() else None  # the header has no step

        kept = lines_before(self.path, start, step_of)
        if start > 0:
            replace_lines(self.path, kept)
        self._columns = next(csv.reader(io.StringIO(kept[0]))) if kept else None
        self._file = open(self.path, "a" if kept else "w", newline="")
        self._writer = csv.writer(self._file)

    def write(self, step: int, stats: Mapping[str, float]) -> None:
        assert self._file is not None, "CSVLog.write before open"
        if self._columns is None:
            self._columns = ["step", *stats]
            self._writer.writerow(self._columns)
        row = {"step": step, **stats}
        self._writer.writerow(
            [repr(row[c]) if isinstance(row.get(c), float) else row.get(c, "") for c in self._columns]
        )

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __repr__(self) -> str:
        return f"CSVLog({str(self.path)!r})"


class TensorBoardLog:
    """Every statistic as a TensorBoard scalar (through tensorboardX; ``pip install -e ".[tensorboard]"``).

    A resumed run purges the events of the steps it redoes (tensorboardX's ``purge_step``).

    Args:
        logdir: the folder of the event files (``tensorboard --logdir`` it).
        **kwargs: passed to ``tensorboardX.SummaryWriter`` (e.g. ``flush_secs``).

    Raises:
        ImportError: at ``open`` when tensorboardX is not installed.
    """

    def __init__(self, logdir: str | os.PathLike[str], **kwargs: Any) -> None:
        self.logdir = Path(logdir)
        self.kwargs = kwargs
        self._writer: Any = None

    def open(self, start: int, total: int) -> None:
        try:
            summary_writer = importlib.import_module("tensorboardX").SummaryWriter  # optional: the tensorboard extra
        except ImportError as err:
            raise ImportError(
                f"sv.driver.TensorBoardLog writes through tensorboardX, which is not installed: {TENSORBOARD_INSTALL}"
            ) from err
        self._writer = summary_writer(str(self.logdir), purge_step=start if start > 0 else None, **self.kwargs)

    def write(self, step: int, stats: Mapping[str, float]) -> None:
        for name, value in stats.items():
            self._writer.add_scalar(name, value, step)

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def __repr__(self) -> str:
        return f"TensorBoardLog({str(self.logdir)!r})"


def format_stats(stats: Mapping[str, float]) -> str:
    """``energy = -2.90012 ± 0.00031  variance = 0.0123  acceptance = 0.512  step_time = 3.1 ms``."""
    parts = []
    for name, value in stats.items():
        if name == "error" and ("energy" in stats or "mean" in stats):
            continue  # shown with its mean
        if name in ("energy", "mean") and "error" in stats:
            error = stats["error"]
            digits = max(2, 1 - math.floor(math.log10(error))) if math.isfinite(error) and error > 0 else 5
            parts.append(f"{name} = {value:.{digits}f} ± {error:.{digits}f}")
        elif name == "step_time":
            parts.append(f"step_time = {value * 1e3:.3g} ms" if value < 1 else f"step_time = {value:.3g} s")
        else:
            parts.append(f"{name} = {value:.6g}")
    return "  ".join(parts)


class PrintLog:
    """A line every ``every`` steps (and at the last step), for job logs where a progress bar does not show.

    ``step 100/1000  energy = -2.90012 ± 0.00031  variance = 0.0123  acceptance = 0.512  step_time = 3.1 ms``

    Args:
        every: steps between lines.
        file: where the lines go (default: standard output).

    Example:
        >>> import shardvmc as sv
        >>> log = sv.driver.PrintLog(every=2)
        >>> log.open(0, 3)
        >>> for t in range(3):
        ...     log.write(t, {"energy": -2.0 - t / 10, "error": 0.01})
        step 2/3  energy = -2.100 ± 0.010
        step 3/3  energy = -2.200 ± 0.010
    """

    def __init__(self, every: int = 10, file: IO[str] | None = None) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise CallError(message("PrintLog", "every must be a positive int.", got=repr(every)))
        self.every, self.file, self.total = every, file, 0

    def open(self, start: int, total: int) -> None:
        self.total = total

    def write(self, step: int, stats: Mapping[str, float]) -> None:
        if (step + 1) % self.every == 0 or step + 1 == self.total:
            width = len(str(self.total))
            print(f"step {step + 1:>{width}}/{self.total}  {format_stats(stats)}", file=self.file or sys.stdout)

    def flush(self) -> None:
        (self.file or sys.stdout).flush()

    def close(self) -> None:
        self.flush()

    def __repr__(self) -> str:
        return f"PrintLog(every={self.every})"


def read_log(path: str | os.PathLike[str]) -> dict[str, np.ndarray]:
    """The columns of a :class:`JsonLog` or :class:`CSVLog` file: ``{"step": ints, name: floats, ...}``.

    Example:
        >>> import os, tempfile, shardvmc as sv
        >>> path = os.path.join(tempfile.mkdtemp(), "stats.csv")
        >>> log = sv.driver.CSVLog(path)
        >>> log.open(0, 1); log.write(0, {"energy": -2.5}); log.close()
        >>> sv.driver.read_log(path)
        {'step': array([0]), 'energy': array([-2.5])}
    """
    path = Path(path)
    if path.suffix == ".csv":
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
    else:
        with open(path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    columns: dict[str, list[Any]] = {}
    for row in rows:
        for name, value in row.items():
            columns.setdefault(name, []).append(value)
    return {
        name: np.asarray(values, dtype=np.int64 if name == "step" else np.float64) for name, values in columns.items()
    }
