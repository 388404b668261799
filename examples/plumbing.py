"""What the examples share and a research script does not need to read: devices, command line, progress, output.

Copy it beside the example you copy. It holds nothing about the physics:

- :func:`start`: fake CPU devices (when there is no accelerator), joining the other processes
  of a ``python -m shardvmc.launch`` run, and the mesh;
- :func:`add_arguments`: the options every example has (devices, JSON, plot, progress,
  checkpoints);
- :class:`Progress`: a tqdm bar, or a line every few steps;
- :class:`Checkpoints`: ``sv.Checkpointer`` at a cadence, the per-step statistics as an
  append-only CSV beside it, and preemption (save at the step every process agrees on,
  then stop with ``sv.distributed.PREEMPTED_EXIT_CODE``);
- :func:`plot` and :func:`write_json`.
"""

from __future__ import annotations

import argparse
import csv
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

import shardvmc as sv
import shardvmc.testing


def start(devices: int) -> Any:
    """The mesh of the run: ``devices`` fake CPU devices on a host without accelerator, or every device.

    Call it before any JAX array exists (``set_cpu_devices`` edits ``XLA_FLAGS``, and sets
    the XLA CPU scheduler flag without which larger programs deadlock). Under
    ``python -m shardvmc.launch`` it joins the other processes first; the mesh then spans
    every device of every process.
    """
    try:
        sv.testing.set_cpu_devices(devices)
    except RuntimeError:  # JAX has started already (a notebook, a test): the devices it has
        pass
    import jax

    if sv.distributed.is_launched():
        sv.distributed.initialize()
    chosen = jax.devices()
    if chosen[0].platform == "cpu" and jax.process_count() == 1:
        chosen = chosen[:devices]
    return sv.create_mesh(chosen)


def add_arguments(parser: argparse.ArgumentParser, *, checkpoints: bool = True) -> None:
    """The options every example has."""
    parser.add_argument(
        "--devices",
        type=int,
        default=8,
        help="CPU devices when there is no accelerator: created as fake devices unless XLA_FLAGS\n"
        "already sets a count (then the first N); ignored on accelerators and under shardvmc.launch",
    )
    parser.add_argument("--json", metavar="PATH", default=None, help="write a JSON summary here")
    parser.add_argument("--plot", metavar="PNG", default=None, help="plot energy vs step (needs matplotlib)")
    parser.add_argument("--print-every", type=int, default=None, help="progress line period without tqdm")
    parser.add_argument("--no-bar", action="store_true", help="progress lines even when tqdm is installed")
    if checkpoints:
        parser.add_argument("--checkpoint", metavar="DIR", default=None, help="checkpoint directory")
        parser.add_argument("--checkpoint-every", type=int, default=100, help="steps between checkpoints")
        parser.add_argument("--resume", action="store_true", help="continue from the latest step in --checkpoint")
        parser.add_argument("--stop-after", type=int, default=None, help="stop (with a checkpoint) after this step")


def is_lead() -> bool:
    """Whether this process prints and writes files (process 0)."""
    import jax

    return jax.process_index() == 0


def to_host(x: Any) -> np.ndarray:
    """This process's copy of a replicated array, as NumPy (also in multi-process runs)."""
    import jax

    return np.asarray(x.addressable_shards[0].data) if isinstance(x, jax.Array) else np.asarray(x)


class Progress:
    """A tqdm bar when tqdm is installed (and ``bar``), else a line every ``every`` steps."""

    def __init__(self, total: int, start: int, walkers: int, printer: Callable[[str], Any], every: int, bar: bool):
        self.total, self.walkers, self.printer, self.every = total, walkers, printer, every
        self.first, self.t0 = start, None
        self.bar = None
        if bar:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True)
            except ImportError:
                pass

    def update(self, t: int, phase: str, energy: float, variance: float, acceptance: float) -> None:
        """Report step ``t`` (0-based, just finished)."""
        now = time.perf_counter()
        if self.t0 is None:  # the first step compiles: rates count from its end
            self.t0, self.first = now, t + 1
        done = t + 1 - self.first
        rate = done / (now - self.t0) if done and now > self.t0 else float("nan")
        eta = (self.total - t - 1) / rate if rate > 0 else float("nan")
        if self.bar is not None:
            self.bar.set_postfix_str(
                f"{phase} E={energy:+.5f} var={variance:.3f} acc={acceptance:.2f} walkers/s={rate * self.walkers:.0f}"
            )
            self.bar.update(1)
        elif self.every and (t + 1 == self.first or (t + 1) % self.every == 0 or t + 1 == self.total):
            self.printer(
                f"{phase} step {t + 1:5d}/{self.total}  E = {energy:+.5f}  var = {variance:.4f}  "
                f"acc = {acceptance:.3f}  walkers/s = {rate * self.walkers:7.0f}  ETA {_duration(eta)}"
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _duration(seconds: float) -> str:
    if not np.isfinite(seconds):
        return "--:--"
    s = int(seconds)
    return f"{s // 60:02d}:{s % 60:02d}" if s < 3600 else f"{s // 3600}h{s // 60 % 60:02d}"


class Checkpoints:
    """``sv.Checkpointer`` every ``every`` steps, a CSV of the per-step statistics, and preemption.

    ``directory/state`` holds the last three states (``sv.Checkpointer``: asynchronous,
    atomic, restorable on any device or process count); ``directory/stats.csv`` one row
    per step, appended by process 0 (shortest round-trip floats: a resumed run reads its
    history back exactly). Without a directory nothing is written, and a preemption
    notice still stops the run cleanly.
    """

    def __init__(self, directory: str | None, every: int, columns: Sequence[str]):
        self.every, self.columns = every, list(columns)
        self.directory = None if directory is None else Path(directory)
        self.manager = None if self.directory is None else sv.Checkpointer(self.directory / "state")
        self._length = -1  # rows in stats.csv as this process last wrote it (-1: not written yet)

    def restore(self, like: Any, mesh: Any) -> tuple[Any, dict[str, Any], list[list[float]]] | None:
        """``(state, metadata, history)`` of the latest step, or ``None`` when there is none."""
        if self.manager is None or self.manager.latest_step() is None:
            return None
        state, metadata = self.manager.restore(like, mesh=mesh)
        rows = self._rows()[: metadata["step"]]
        if len(rows) != metadata["step"]:
            raise SystemExit(f"{self.directory}/stats.csv holds {len(rows)} steps, the state {metadata['step']}")
        return state, metadata, rows

    def _rows(self) -> list[list[float]]:
        assert self.directory is not None
        with open(self.directory / "stats.csv", newline="") as f:
            return [[float(v) for v in row] for row in list(csv.reader(f))[1:]]

    def record(self, history: list[list[float]]) -> None:
        """Append the last row of ``history`` (process 0; the file is rewritten when it is longer, after a resume)."""
        if self.directory is None or not is_lead():
            return
        path = self.directory / "stats.csv"
        if self._length != len(history) - 1:
            with open(path, "w", newline="") as f:  # a new run, or a resume that drops the steps after it
                csv.writer(f).writerows([self.columns, *([repr(v) for v in row] for row in history)])
        else:
            with open(path, "a", newline="") as f:
                csv.writer(f).writerow([repr(v) for v in history[-1]])
        self._length = len(history)

    def after_step(self, step: int, state: Callable[[], Any], metadata: dict[str, Any], last: bool) -> bool:
        """Save at the cadence, at the ``last`` step, or on a preemption notice; ``True``: stop now (preempted).

        ``state`` is called only when a save is due. Call it on every process at every step.
        """
        preempted = sv.distributed.reached_preemption(step)
        if self.manager is not None and (preempted or last or (self.every and step % self.every == 0)):
            self.manager.save(step, state(), metadata={**metadata, "step": step})
            if preempted or last:
                self.manager.wait()
        return preempted

    def close(self) -> None:
        if self.manager is not None:
            self.manager.close()


def plot(path: str, energies: Sequence[float], *, exact: float, hf: float | None, title: str, phases: int) -> bool:
    """Energy per step (and its 50-step average) with the exact and Hartree-Fock lines; ``False`` without matplotlib.

    The y-range covers the data (its 2nd to 98th percentile and the reference lines), so a
    short run's curve is inside the frame; ``phases`` marks where the evaluation starts.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("--plot needs matplotlib: pip install matplotlib (or pip install -e '.[examples]'); no plot written")
        return False
    e = np.asarray(energies, dtype=np.float64)
    steps = np.arange(1, e.size + 1)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, e, lw=0.6, label="E (per step)")
    window = 50
    if e.size >= window:
        ax.plot(steps[window - 1 :], np.convolve(e, np.ones(window) / window, mode="valid"), lw=1.5,
                label=f"{window}-step average")  # fmt: skip
    ax.axhline(exact, color="k", ls="--", label=f"exact {exact}")
    if hf is not None:
        ax.axhline(hf, color="r", ls=":", label=f"Hartree-Fock {hf}")
    if 0 < phases < e.size:
        ax.axvline(phases + 0.5, color="gray", lw=0.5)
    finite = e[np.isfinite(e)]
    low, high = np.percentile(finite, [2, 98]) if finite.size else (exact, exact)
    low, high = min(low, exact), max(high, exact if hf is None else hf)
    margin = 0.05 * (high - low) or 0.01
    ax.set_ylim(low - margin, high + margin)
    ax.set_xlabel("step")
    ax.set_ylabel("energy (Ha)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write_json(path: str | None, summary: dict[str, Any]) -> None:
    """Write ``summary`` as JSON (process 0)."""
    if path and is_lead():
        with open(path, "w") as f:
            json.dump(summary, f, indent=2)
