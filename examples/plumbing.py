"""What the examples share and a research script need not read: devices, command line, progress, checkpoints, output.

Copy it beside the example you copy; it holds nothing about the physics.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

import shardvmc as sv
import shardvmc.testing


def start(devices: int) -> Any:
    """The mesh: ``devices`` fake CPU devices without an accelerator, else every device (of every launched process).

    Call it before any JAX array exists: ``set_cpu_devices`` edits ``XLA_FLAGS``.
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
    parser.add_argument("--devices", type=int, default=8, help="CPU devices when there is no accelerator: created as "
                        "fake devices unless XLA_FLAGS\nalready sets a count (then the first N); ignored on "
                        "accelerators and under shardvmc.launch")  # fmt: skip
    parser.add_argument("--json", metavar="PATH", default=None, help="write a JSON summary here")
    parser.add_argument("--plot", metavar="PNG", default=None, help="plot energy vs step (needs matplotlib)")
    parser.add_argument("--print-every", type=int, default=None, help="steps between progress lines")
    if checkpoints:
        parser.add_argument("--checkpoint", metavar="DIR", default=None, help="checkpoint directory")
        parser.add_argument("--checkpoint-every", type=int, default=100, help="steps between checkpoints")
        parser.add_argument("--resume", action="store_true", help="continue from the latest step in --checkpoint")
        parser.add_argument("--stop-after", type=int, default=None, help="stop (with a checkpoint) after this step")


def parse_args(
    argv: Sequence[str] | None, config: type, quick: dict[str, Any], description: str, choices: dict[str, Any]
) -> tuple[argparse.Namespace, Any]:
    """``(args, config)``: an option per field of the dataclass ``config`` (``--float32`` for ``x64``), ``--quick``
    (the defaults updated with ``quick``, then with the options given) and the options every example has."""
    p = argparse.ArgumentParser(description=description.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    types = {"int": int, "float": float, "str": str, "int | None": int}
    for field in dataclasses.fields(config):
        if field.name != "x64":
            p.add_argument(f"--{field.name.replace('_', '-')}", type=types[str(field.type)],
                           choices=choices.get(field.name), help=f"(default {field.default})")  # fmt: skip
    p.add_argument("--quick", action="store_true", help="a few steps of a tiny network (a smoke test)")
    p.add_argument("--float32", action="store_true", help="compute in float32")
    add_arguments(p)
    args = p.parse_args(argv)
    values = dict(quick) if args.quick else {}
    values.update({f.name: getattr(args, f.name) for f in dataclasses.fields(config) if f.name != "x64"
                   and getattr(args, f.name) is not None})  # fmt: skip
    return args, config(**values, x64=not args.float32)


def is_lead() -> bool:
    """Whether this process prints and writes files (process 0)."""
    import jax

    return jax.process_index() == 0


class Progress:
    """A line every ``every`` steps: the statistics, the walkers per second (after the first step: it compiles)."""

    def __init__(self, total: int, first: int, walkers: int, printer: Callable[[str], Any], every: int):
        self.total, self.first, self.walkers, self.printer, self.every = total, first, walkers, printer, every
        self.t0 = 0.0

    def update(self, t: int, phase: str, energy: float, variance: float, acceptance: float) -> None:
        if not self.t0:  # step t (from 0) has just finished
            self.t0, self.first = time.perf_counter(), t + 1
        rate = (t + 1 - self.first) / max(time.perf_counter() - self.t0, 1e-9)  # steps per second
        if self.every and (t + 1 == self.first or (t + 1) % self.every == 0 or t + 1 == self.total):
            eta = f"{(self.total - t - 1) / rate / 60:.1f} min" if rate else "--"
            self.printer(f"{phase} step {t + 1:5d}/{self.total}  E = {energy:+.5f}  var = {variance:.4f}  acc = "
                         f"{acceptance:.3f}  walkers/s = {rate * self.walkers:7.0f}  ETA {eta}")  # fmt: skip


class Checkpoints:
    """``sv.Checkpointer`` every ``every`` steps (``directory/state``, with the config), and on a preemption notice;
    ``directory/stats.csv``: a row per step in shortest round-trip floats (read back exactly on a resume)."""

    def __init__(self, directory: str | None, every: int, columns: Sequence[str]):
        self.every, self.columns = every, list(columns)
        self.directory = None if directory is None else Path(directory)
        self.manager = None if self.directory is None else sv.Checkpointer(self.directory / "state")
        self._length = -1  # rows in stats.csv as this process last wrote it (-1: not written yet)

    def restore(self, config: Any, like: Callable[[], Any], mesh: Any, printer: Callable[[str], Any]) -> Any:
        """``(state, history)`` of the latest step (``like()`` gives the state's structure); ``None`` without one.

        A checkpoint of other settings than the step counts and ``batch_size`` is refused.
        """
        if self.manager is None or self.manager.latest_step() is None:
            return None
        state, metadata = self.manager.restore(like(), mesh=mesh)
        differ = {k for k, v in metadata["config"].items() if k not in ("steps", "eval_steps", "batch_size")
                  and getattr(config, k) != v}  # fmt: skip
        if differ:
            raise SystemExit(f"{self.directory} was written with other settings: {sorted(differ)}")
        with open(self.directory / "stats.csv", newline="") as f:  # type: ignore[operator]
            rows = [[float(v) for v in row] for row in list(csv.reader(f))[1:]][: metadata["step"]]
        if len(rows) != metadata["step"]:
            raise SystemExit(f"{self.directory}/stats.csv holds {len(rows)} steps, the state {metadata['step']}")
        printer(f"resumed from {self.directory} at step {metadata['step']}")
        return state, rows

    def after_step(self, step: int, history: list[list[float]], state: Any, config: Any, last: bool) -> bool:
        """Append the step's statistics; save at the cadence, at the ``last`` step or on a preemption notice.

        Call it on every process at every step; ``True``: preempted, stop now.
        """
        if self.directory is not None and is_lead():
            rewrite = self._length != len(history) - 1  # a new run, or a resume that drops the steps after it
            rows = [[repr(v) for v in row] for row in (history if rewrite else history[-1:])]
            with open(self.directory / "stats.csv", "w" if rewrite else "a", newline="") as f:
                csv.writer(f).writerows([self.columns, *rows] if rewrite else rows)
            self._length = len(history)
        preempted = sv.distributed.reached_preemption(step)
        if self.manager is not None and (preempted or last or (self.every and step % self.every == 0)):
            self.manager.save(step, state, metadata={"config": dataclasses.asdict(config), "step": step})
            if preempted or last:
                self.manager.wait()
        return preempted

    def close(self) -> None:
        if self.manager is not None:
            self.manager.close()


def finish(args: argparse.Namespace, summary: dict[str, Any], *, title: str, phases: int) -> None:
    """``--json``: the summary; ``--plot``: the energy per step (and its 50-step average), the exact and HF lines."""
    if args.json and is_lead():
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    if not args.plot or not is_lead():
        return
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("--plot needs matplotlib: pip install matplotlib (or pip install -e '.[examples]'); no plot written")
        return
    e, exact, hf = np.asarray(summary["energies"], dtype=np.float64), summary["exact"], summary.get("hf")
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(np.arange(1, e.size + 1), e, lw=0.6, label="E (per step)")
    if e.size >= 50:
        ax.plot(np.arange(50, e.size + 1), np.convolve(e, np.ones(50) / 50, "valid"), lw=1.5, label="50-step average")
    ax.axhline(exact, color="k", ls="--", label=f"exact {exact}")
    if hf is not None:
        ax.axhline(hf, color="r", ls=":", label=f"Hartree-Fock {hf}")
    ax.axvline(phases + 0.5, color="gray", lw=0.5)  # where the evaluation starts
    low, high = np.nanpercentile(np.where(np.isfinite(e), e, np.nan), [2, 98]) if np.isfinite(e).any() else (exact,) * 2
    margin = 0.05 * (max(high, hf or exact) - min(low, exact)) or 0.01  # the data and the reference lines
    ax.set_ylim(min(low, exact) - margin, max(high, hf or exact) + margin)
    ax.set(xlabel="step", ylabel="energy (Ha)", title=title)
    ax.legend()
    fig.savefig(args.plot, dpi=120, bbox_inches="tight")
    plt.close(fig)
