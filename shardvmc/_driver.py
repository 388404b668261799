"""The run loop: ``run(step, state, n_steps, key=...)`` with statistics, progress, logs, callbacks, checkpoints, resume.

One path for every run: the user's jitted step ``step(state, key) -> (state, stats)`` (``stats`` a dict of
scalars: device values), called for steps ``t = start .. n_steps - 1`` with the key ``fold_in(key, t)``.

How the statistics reach the host without a round trip per step: right after a step is dispatched, each of its
statistics starts its copy to the host (``copy_to_host_async``), and the loop reads the values of step ``t`` only
after it has dispatched step ``t + ahead``: by then step ``t`` has finished and its values are on the host, and
the device still has ``ahead`` steps queued, so it never waits for the host's loggers, progress bar and
callbacks. The schedule depends on step numbers only, so every process of a multi-process run reads, logs and
decides at the same steps.

Checkpoints (``checkpoint=DIR``): a :class:`~shardvmc.Checkpointer` in ``DIR/state`` saves
``{"state": state, "key": key data}`` with the step count and every step's statistics (JSON metadata, exact floats)
every ``checkpoint_every`` steps, every ``checkpoint_seconds`` (process 0's clock decides; the save is at the
next step), at the end, when a callback stops the run (unless it says not to), and at a preemption notice
(:func:`shardvmc.distributed.reached_preemption`, called at every step). The same call with the same directory
resumes from the newest intact step, onto the mesh of ``state`` (any device count).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from . import distributed
from ._callbacks import StopOnNonFinite
from ._checkpoint import Checkpointer
from ._errors import CallError, CheckpointNotFoundError, message
from ._loggers import JsonLog, Logger
from ._progress import Progress, wants_bar
from ._walkerset import WalkerSet

__all__ = ["RunResult", "run"]

_WHERE = "shardvmc.driver.run"
STATUSES = ("finished", "stopped", "preempted")
_DEFAULT = object()  # run's default callbacks: (StopOnNonFinite(),)
_KEYS_AT_ONCE = 64  # the steps' keys are made this many at a time


@functools.partial(jax.jit, static_argnums=2)
def _fold_in_many(key: jax.Array, first: jax.Array, n: int) -> jax.Array:
    """``fold_in(key, t)`` for ``t = first .. first + n - 1``, the same bits as one call each: one dispatch for
    ``n`` steps, where an eager ``jax.random.fold_in`` costs about as much as dispatching a small step."""
    return jax.vmap(jax.random.fold_in, (None, 0))(key, first + jnp.arange(n, dtype=jnp.uint32))


def _step_keys(key: jax.Array, start: int, stop: int) -> Iterable[jax.Array]:
    """The keys of steps ``start .. stop - 1``: ``jax.random.fold_in(key, t)``, made a block at a time."""
    for first in range(start, stop, _KEYS_AT_ONCE):
        yield from _fold_in_many(key, np.uint32(first), min(_KEYS_AT_ONCE, stop - first))


@dataclasses.dataclass(frozen=True)
class RunResult:
    """What :func:`run` returns.

    Attributes:
        state: the state after ``step`` steps.
        step: the number of steps done (of the whole run, a resumed part included): the next step's index.
        history: every step's statistics, ``{name: array of shape (step,)}`` (float64), with the loop's
            ``step_time`` (seconds; the first step of a call includes compilation; steps whose
            values were read together share their time).
        status: ``"finished"`` (all ``n_steps``), ``"stopped"`` (by a callback) or ``"preempted"``.
        reason: why the run stopped early (the callback's reason or the preemption), else ``None``.
        resumed_from: the step this call resumed from (``None``: it started afresh).
        seconds: the wall time of this call.
    """

    state: Any
    step: int
    history: dict[str, np.ndarray]
    status: str
    reason: str | None = None
    resumed_from: int | None = None
    seconds: float = 0.0

    @property
    def preempted(self) -> bool:
        """Whether the run stopped at a preemption notice (its state is saved; exit with ``PREEMPTED_EXIT_CODE``)."""
        return self.status == "preempted"

    def __repr__(self) -> str:
        last = {k: float(v[-1]) for k, v in self.history.items() if len(v)}
        return f"RunResult(step={self.step}, status={self.status!r}, reason={self.reason!r}, last={last})"


def _error(problem: str, *, got: str | None = None, expected: str | None = None, fix: str | None = None) -> CallError:
    return CallError(message(_WHERE, problem, got=got, expected=expected, fix=fix))


def _check_int(name: str, value: Any, low: int, allow_none: bool = False) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise _error(f"{name} must be an int >= {low}" + (" or None." if allow_none else "."), got=repr(value))
    return int(value)


def _key_data(key: Any) -> np.ndarray:
    key = jax.numpy.asarray(key) if not isinstance(key, jax.Array) else key
    if jax.numpy.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    if not key.is_fully_addressable:
        key = key.addressable_data(0)
    return np.asarray(key)


def _check_key(key: Any) -> None:
    dtype = getattr(key, "dtype", None)
    typed = dtype is not None and jax.numpy.issubdtype(dtype, jax.dtypes.prng_key)
    if (typed and np.shape(key) == ()) or (not typed and dtype == np.uint32 and np.shape(key) == (2,)):
        return
    raise _error(
        "key must be ONE PRNG key; step t gets jax.random.fold_in(key, t).",
        got=repr(key) if dtype is None else f"{dtype}{list(np.shape(key))}",
        fix="pass key=jax.random.key(seed).",
    )


def _placement(state: Any) -> tuple[Mesh | None, str]:
    """The mesh and walker axis of ``state``'s walkers (its first ``WalkerSet``, else its first sharded leaf)."""
    sets = [x for x in jax.tree_util.tree_leaves(state, is_leaf=lambda x: isinstance(x, WalkerSet))]
    ordered = [leaf for x in sets if isinstance(x, WalkerSet) for leaf in jax.tree_util.tree_leaves(x.data)]
    ordered += [x for x in sets if not isinstance(x, WalkerSet)]
    for leaf in ordered:
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding) and isinstance(sharding.mesh, Mesh):
            spec = sharding.spec
            axis = spec[0] if len(spec) and isinstance(spec[0], str) else "walkers"
            return sharding.mesh, axis
    return None, "walkers"


def _host(x: Any) -> Any:
    """This process's copy of a replicated statistic (``x`` itself when every device of it is local)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return x.addressable_data(0)
    return x


def _start_copy(stats: Any) -> None:
    for leaf in jax.tree_util.tree_leaves(stats):
        if isinstance(leaf, jax.Array):
            _host(leaf).copy_to_host_async()


def _read(step: int, stats: Any) -> dict[str, float]:
    """The step's statistics as Python floats (checked: a mapping of real scalars)."""
    if not isinstance(stats, Mapping):
        raise _error(
            "the step must return (state, stats) with stats a dict of scalars.",
            got=f"stats of type {type(stats).__name__} at step {step}",
            fix='return e.g. (state, {"energy": e_mean, "variance": e_var}) from the jitted step.',
        )
    values = {}
    # energy (or mean) and its error first, the rest by name: jax.jit returns a dict's keys sorted anyway
    for name in sorted(stats, key=lambda k: (k not in ("energy", "mean"), k != "error", str(k))):
        value = stats[name]
        array = np.asarray(_host(value))
        if array.shape != () or array.dtype.kind not in "biuf" or not isinstance(name, str):
            raise _error(
                f"statistic {name!r} of step {step} is not a real scalar.",
                got=f"{array.dtype}{list(array.shape)}",
                fix="return one real number per statistic (a Mean output, jnp.mean(...), or x.real).",
            )
        values[name] = float(array)
    return values


def _broadcast(flags: Sequence[bool]) -> list[bool]:
    """Process 0's ``flags`` on every process (a no-op in one process)."""
    if jax.process_count() == 1:
        return list(flags)
    from jax.experimental import multihost_utils

    out = multihost_utils.broadcast_one_to_all(np.asarray(flags, dtype=np.int32))
    return [bool(v) for v in np.asarray(out)]


class _Loop:
    """One call of :func:`run`: the fetched statistics, the processing cursor, the sinks."""

    def __init__(self, loggers: list[Logger], callbacks: list[Any], bar: Progress | None, lead: bool) -> None:
        self.loggers, self.callbacks, self.bar, self.lead = loggers, callbacks, bar, lead
        self.pending: collections.deque[tuple[int, Any]] = collections.deque()  # dispatched, not read
        self.rows: list[dict[str, float]] = []  # read, this call's steps
        self.processed = 0  # rows given to loggers, bar and callbacks
        self.first = 0  # the first step of this call
        self.clock = time.perf_counter()  # when the last read returned
        self.stop: tuple[str, bool] | None = None  # (reason, save) of the first callback that stopped the run

    def read(self, keep: int) -> None:
        """Read the statistics of the oldest pending steps until ``keep`` are left in flight."""
        batch = []
        while len(self.pending) > keep:
            step, stats = self.pending.popleft()
            batch.append(_read(step, stats))
        if batch:
            now = time.perf_counter()
            share = (now - self.clock) / len(batch)
            self.clock = now
            for row in batch:
                row["step_time"] = share
            self.rows += batch

    def process(self, run_callbacks: bool = True) -> None:
        """Loggers, the bar and the callbacks for every read row not yet processed."""
        while self.processed < len(self.rows):
            step, row = self.first + self.processed, self.rows[self.processed]
            self.processed += 1
            if self.lead:
                for logger in self.loggers:
                    logger.write(step, row)
                if self.bar is not None:
                    self.bar.update(step, row)
            if run_callbacks and self.stop is None:
                for callback in self.callbacks:
                    said = callback(step, row)
                    if said:
                        reason = said if isinstance(said, str) else f"{callback!r} at step {step}"
                        self.stop = (reason, bool(getattr(callback, "save_on_stop", True)))
                        break

    def flush(self) -> None:
        if self.lead:
            for logger in self.loggers:
                logger.flush()


def _loggers(out: Any, directory: Path | None) -> list[Logger]:
    own: list[Logger] = [] if directory is None else [JsonLog(directory / "log.jsonl")]
    if out is None:
        return own
    if isinstance(out, (str, os.PathLike)):
        return [JsonLog(out)]
    loggers = [out] if not isinstance(out, Iterable) else list(out)
    for logger in loggers:
        if not all(callable(getattr(logger, m, None)) for m in ("open", "write", "flush", "close")):
            raise _error(
                "out must be a path (a JSON-lines log), a logger or a sequence of loggers.",
                got=repr(logger),
                expected="objects with open(start, total), write(step, stats), flush() and close()",
                fix="pass e.g. out=[sv.driver.JsonLog(path), sv.driver.CSVLog(path2)].",
            )
    return own + loggers


def run(
    step: Callable[[Any, jax.Array], tuple[Any, Mapping[str, Any]]],
    state: Any,
    n_steps: int,
    *,
    key: jax.Array,
    checkpoint: str | os.PathLike[str] | None = None,
    checkpoint_every: int | None = 100,
    checkpoint_seconds: float | None = None,
    keep: int | None = 3,
    out: Any = None,
    callbacks: Any = _DEFAULT,
    metadata: Mapping[str, Any] | None = None,
    progress: bool | IO[str] | None = None,
    description: str = "",
    on_preemption: str = "exit",
    ahead: int = 2,
    mesh: Mesh | None = None,
) -> RunResult:
    """Run ``step`` for ``n_steps`` steps: statistics, progress, logs, callbacks, checkpoints, preemption, resume.

    Step ``t`` (``t = 0 .. n_steps - 1``) is ``state, stats = step(state, jax.random.fold_in(key, t))``:
    a hand loop with those keys computes the same states, bit for bit. ``stats`` is a dict of
    real scalars (device values: the loop reads them ``ahead`` steps later, so the device
    never waits for the host; see the module). Only process 0 prints and logs; every process
    runs the callbacks on the same values, and process 0's decision to stop counts.

    With ``checkpoint=DIR`` the run is resumable: the same call with the same directory
    continues from the newest intact step (on any device count: the state is restored onto
    the mesh of ``state``'s walkers, or ``mesh``), and its statistics and keys make the
    resumed run equal the uninterrupted one (bit for bit on the same device count). A
    preemption notice (SIGTERM or SIGUSR1, see :func:`shardvmc.distributed.reached_preemption`)
    then saves the state and, by default, exits the process with
    :data:`shardvmc.distributed.PREEMPTED_EXIT_CODE` (75): a job about to be killed must not go on
    to the code after ``run`` (an evaluation, plots), and the batch script requeues on 75.
    ``on_preemption="return"`` returns a result with ``status == "preempted"`` instead.
    Without ``checkpoint`` no signal is intercepted.

    Args:
        step: ``step(state, key) -> (state, stats)``, jitted (or calling jitted functions).
        state: the initial state (a pytree: walkers in ``sv.WalkerSet``\\ s, other arrays replicated);
            on a resume, the structure to restore into.
        n_steps: the run's number of steps (a resumed run ends there too).
        key: ONE PRNG key; step ``t`` gets ``jax.random.fold_in(key, t)``.
        checkpoint: a directory for checkpoints (``DIR/state``) and the run's log (``DIR/log.jsonl``, a
            :class:`JsonLog`, written on process 0 besides the loggers of ``out``).
        checkpoint_every: save every this many steps (``None``: not by step count).
        checkpoint_seconds: also save once this many seconds have passed since the last save.
        keep: the checkpoints kept (``None``: all).
        out: loggers: a path (a :class:`JsonLog` there), a logger, or a sequence of them.
        callbacks: a callback or a sequence of them (see :class:`Callback`); default
            ``(StopOnNonFinite(),)``; ``()`` for none.
        metadata: JSON data saved with every checkpoint (the run's settings, say): a resume
            refuses a checkpoint whose metadata differs, naming the keys.
        progress: a tqdm progress bar (``pip install "shardvmc[progress]"``): ``True`` on standard
            error, a file object to write it there, ``False`` for none; ``None`` (default): on
            standard error when it is a terminal and tqdm is installed.
        description: the progress bar's label.
        on_preemption: ``"exit"`` (default) or ``"return"``; see above.
        ahead: steps dispatched before the statistics of a step are read (0: each step's
            statistics read right after it; a callback's stop takes effect after the steps in flight).
        mesh: the mesh to restore a checkpoint onto (default: the mesh of ``state``'s walkers).

    Returns:
        A :class:`RunResult`: the state, the steps done, every step's statistics, the status.

    Raises:
        CallError: for bad arguments, a step that returns no dict of real scalars, or a
            checkpoint of another key or beyond ``n_steps``.

    Example:
        >>> import jax, jax.numpy as jnp, shardvmc as sv
        >>> @jax.jit
        ... def step(x, key):  # an AR(1) chain as the "state"
        ...     x = 0.5 * x + jax.random.normal(key)
        ...     return x, {"energy": x}
        >>> result = sv.driver.run(step, jnp.float32(0.0), 20, key=jax.random.key(0), progress=False)
        >>> result.step, result.status, sorted(result.history), result.history["energy"].shape
        (20, 'finished', ['energy', 'step_time'], (20,))
    """
    started = time.perf_counter()
    n_steps = _check_int("n_steps", n_steps, 0)
    if checkpoint_every is not None:
        checkpoint_every = _check_int("checkpoint_every", checkpoint_every, 1, allow_none=True)
    ahead = _check_int("ahead", ahead, 0)
    _check_key(key)
    if on_preemption not in ("exit", "return"):
        raise _error("on_preemption must be 'exit' or 'return'.", got=repr(on_preemption))
    if checkpoint_seconds is not None and not (isinstance(checkpoint_seconds, (int, float)) and checkpoint_seconds > 0):
        raise _error("checkpoint_seconds must be a positive number or None.", got=repr(checkpoint_seconds))
    if not callable(step):
        raise _error("step must be a function step(state, key) -> (state, stats).", got=repr(step))
    directory = None if checkpoint is None else Path(checkpoint)
    callbacks = [StopOnNonFinite()] if callbacks is _DEFAULT else callbacks
    callbacks = [] if callbacks is None else [callbacks] if callable(callbacks) else list(callbacks)
    loggers = _loggers(out, directory)
    lead = jax.process_index() == 0

    try:
        user = json.loads(json.dumps(dict(metadata or {})))  # as a checkpoint gives it back
    except (TypeError, ValueError) as err:
        raise _error("metadata must be JSON data (numbers, strings, lists, dicts).", got=str(err)) from None
    saves = None if directory is None else Checkpointer(directory / "state", keep=keep)
    start, restored_rows, resumed, meta = 0, {}, None, {}
    key_data = _key_data(key)  # saved as host data: the same on every process, whichever device holds the key
    try:
        if saves is not None:
            restore_mesh, axis = (mesh, "walkers") if mesh is not None else _placement(state)
            try:
                # The newest intact step (an older one, with a warning, when the newest is damaged).
                like = {"state": state, "key": key_data}
                saved, meta = saves.restore(like, mesh=restore_mesh, axis_name=axis)
            except CheckpointNotFoundError:
                saved = None
            if saved is not None:
                if not np.array_equal(saved["key"], key_data):
                    raise _error(
                        f"{str(directory)!r} holds a run of another key: resuming it with this key would not "
                        "continue its trajectory.",
                        fix="pass the key the run started with, or another checkpoint directory for a new run.",
                    )
                start, resumed = int(meta["step"]), int(meta["step"])
                if start > n_steps:
                    raise _error(
                        f"{str(directory)!r} holds step {start}, beyond n_steps={n_steps}.",
                        fix=f"pass n_steps >= {start} to go on, or another checkpoint directory.",
                    )
                saved_user = meta.get("user", {})
                differ = sorted(k for k in set(saved_user) | set(user) if saved_user.get(k) != user.get(k))
                if differ:
                    raise _error(
                        f"{str(directory)!r} holds a run of other settings: {', '.join(map(str, differ))}.",
                        got=", ".join(f"{k}={user.get(k)!r}" for k in differ),
                        expected=", ".join(f"{k}={saved_user.get(k)!r}" for k in differ),
                        fix="run with the checkpoint's settings, or use another checkpoint directory for a new run.",
                    )
                state, restored_rows = saved["state"], meta["history"]
                if lead:
                    print(f"{_WHERE}: resumed from {str(directory)!r} at step {start}", file=sys.stderr)
        if lead:
            for logger in loggers:
                logger.open(start, n_steps)
        for callback in callbacks:
            if callable(getattr(callback, "start", None)):
                callback.start(start)
        bar_file = wants_bar(progress) if lead else None
        bar = None if bar_file is None else Progress(bar_file, n_steps, start, description)
        loop = _Loop(loggers, callbacks, bar, lead)
        loop.first = start
        status, reason, last_save = "finished", None, time.monotonic()
        timed = False  # a timed save agreed at the previous step
        agree = jax.process_count() > 1 and (bool(callbacks) or checkpoint_seconds is not None)
        try:
            for t, step_key in zip(range(start, n_steps), _step_keys(key, start, n_steps), strict=True):
                state, stats = step(state, step_key)
                _start_copy(stats)
                loop.pending.append((t, stats))
                done = t + 1
                preempted = saves is not None and distributed.reached_preemption(done)
                due = saves is not None and (
                    preempted or timed or done == n_steps or bool(checkpoint_every and done % checkpoint_every == 0)
                )
                loop.read(0 if due else ahead)  # a save holds the statistics of every step up to it
                loop.process()
                local_timed = checkpoint_seconds is not None and time.monotonic() - last_save >= checkpoint_seconds
                stop_flag, stop_save, timed = loop.stop is not None, loop.stop is None or loop.stop[1], local_timed
                if agree:  # process 0's decisions (a callback may read its own clock)
                    stop_flag, stop_save, timed = _broadcast([stop_flag, stop_save, local_timed])
                if stop_flag:
                    reason = loop.stop[0] if loop.stop else "a callback of process 0 stopped the run"
                    loop.read(0)
                    loop.process(run_callbacks=False)
                if saves is not None and (due or stop_flag) and stop_save:
                    history = _history(restored_rows, loop.rows)
                    meta = {"step": done, "history": history, "user": user}
                    saves.save(done, {"state": state, "key": key_data}, metadata=meta)
                    loop.flush()
                    last_save, timed = time.monotonic(), False
                if preempted or stop_flag:
                    status = "preempted" if preempted and stop_save else "stopped"
                    reason = reason if stop_flag else f"preemption notice at step {done}"
                    break
            loop.read(0)
            loop.process(run_callbacks=status == "finished")
        finally:
            if bar is not None:
                bar.close()
            if lead:
                for logger in loggers:
                    logger.close()
        if saves is not None:
            saves.wait()
    finally:
        if saves is not None:
            saves.close()
    history = {k: np.asarray(v, np.float64) for k, v in _history(restored_rows, loop.rows).items()}
    result = RunResult(state, start + len(loop.rows), history, status, reason, resumed, time.perf_counter() - started)
    if result.preempted and on_preemption == "exit":
        if lead:
            code = distributed.PREEMPTED_EXIT_CODE
            print(f"{_WHERE}: {reason}; saved to {str(directory)!r}, exiting with {code}: run the same command "
                  "again to resume", file=sys.stderr)  # fmt: skip
        sys.exit(distributed.PREEMPTED_EXIT_CODE)
    return result


def _history(restored: Mapping[str, Sequence[float]], rows: Sequence[Mapping[str, float]]) -> dict[str, list[float]]:
    """Every step's statistics, the restored ones first: ``{name: [value per step]}`` (JSON for the metadata)."""
    names = list(restored) + [k for row in rows[:1] for k in row if k not in restored]
    n_restored = len(next(iter(restored.values()))) if restored else 0
    return {
        name: list(restored.get(name, [math.nan] * n_restored)) + [row.get(name, math.nan) for row in rows]
        for name in names
    }
