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
``{"state": state, "key": key data}`` with the step count and the run's ``metadata`` every ``checkpoint_every``
steps, every ``checkpoint_seconds`` (process 0's clock decides; the save is at the next step), at the end, when a
callback stops the run (unless it says not to), and at a preemption notice
(:func:`shardvmc.distributed.reached_preemption`, called before the first step and after every step; its signal
handlers are installed before the restore, so a notice while restoring or compiling is answered as a later one).
The statistics are not in the checkpoint but in ``DIR/log.jsonl`` (see :mod:`shardvmc._history`), flushed before
each save: a save costs the same at step 100 and at step 100,000. The same call with the same directory resumes
from the newest intact step, onto the mesh of ``state`` (any device count), with the history of the steps before
it read back from the log.

A call runs in phases: :func:`_plan` (the arguments checked), :func:`_resume` (the newest intact checkpoint and the
history before it), :meth:`_Loop.steps` (the steps, the reads, the callbacks' decisions, :meth:`_Loop.save`) and
:func:`_leave` (the exit at a preemption notice).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
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
from ._history import LOG_NAME, RunLog, merge
from ._loggers import JsonLog, Logger
from ._persistent_cache import enable_compilation_cache
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


@dataclasses.dataclass(frozen=True)
class _Plan:
    """The checked arguments of one call of :func:`run`."""

    n_steps: int
    key: jax.Array
    key_data: np.ndarray  # saved as host data: the same on every process, whichever device holds the key
    directory: Path | None
    every: int | None  # checkpoint_every
    seconds: float | None  # checkpoint_seconds
    ahead: int
    on_preemption: str
    callbacks: list[Any]
    loggers: list[Logger]
    log: RunLog | None  # DIR/log.jsonl, the first of loggers: the run's log and its history
    user: dict[str, Any]  # the metadata, as a checkpoint gives it back
    mesh: Mesh | None
    lead: bool  # process 0: it prints and logs


def _plan(
    step: Any,
    n_steps: Any,
    key: Any,
    checkpoint: Any,
    checkpoint_every: Any,
    checkpoint_seconds: Any,
    out: Any,
    callbacks: Any,
    metadata: Any,
    on_preemption: Any,
    ahead: Any,
    mesh: Mesh | None,
) -> _Plan:
    """The arguments of :func:`run` checked (a ``CallError`` naming the first bad one) and put in order."""
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
    try:
        user = json.loads(json.dumps(dict(metadata or {})))  # as a checkpoint gives it back
    except (TypeError, ValueError) as err:
        raise _error("metadata must be JSON data (numbers, strings, lists, dicts).", got=str(err)) from None
    log = loggers[0] if directory is not None and isinstance(loggers[0], RunLog) else None
    return _Plan(
        n_steps, key, _key_data(key), directory, checkpoint_every, checkpoint_seconds, ahead, on_preemption,
        callbacks, loggers, log, user, mesh, jax.process_index() == 0,
    )  # fmt: skip


def _loggers(out: Any, directory: Path | None) -> list[Logger]:
    """The run's own log (``DIR/log.jsonl``) first, then those of ``out`` (less a second logger of that file)."""
    own: list[Logger] = [] if directory is None else [RunLog(directory / LOG_NAME)]
    if out is None:
        return own
    if isinstance(out, (str, os.PathLike)):
        out = JsonLog(out)
    loggers = list(out) if isinstance(out, Iterable) else [out]
    for logger in loggers:
        if not all(callable(getattr(logger, m, None)) for m in ("open", "write", "flush", "close")):
            raise _error(
                "out must be a path (a JSON-lines log), a logger or a sequence of loggers.",
                got=repr(logger),
                expected="objects with open(start, total), write(step, stats), flush() and close()",
                fix="pass e.g. out=[sv.driver.JsonLog(path), sv.driver.CSVLog(path2)].",
            )
    if directory is not None:  # two writers of one file would write each step twice
        mine = (directory / LOG_NAME).resolve()
        loggers = [x for x in loggers if not (isinstance(x, JsonLog) and Path(x.path).resolve() == mine)]
    return own + loggers


class _Loop:
    """The steps of one call of :func:`run`: the fetched statistics, the processing cursor, the sinks, the saves."""

    def __init__(self, plan: _Plan, saves: Checkpointer | None, state: Any, start: int, bar: Progress | None) -> None:
        self.plan, self.saves, self.state, self.bar = plan, saves, state, bar
        self.loggers, self.callbacks, self.lead = plan.loggers, plan.callbacks, plan.lead
        self.pending: collections.deque[tuple[int, Any]] = collections.deque()  # dispatched, not read
        self.rows: list[dict[str, float]] = []  # read, this call's steps
        self.processed = 0  # rows given to loggers, bar and callbacks
        self.first = start  # the first step of this call
        self.clock = time.perf_counter()  # when the last read returned
        self.stop: tuple[str, bool] | None = None  # (reason, save) of the first callback that stopped the run
        self.last_save = time.monotonic()
        # every process must take process 0's decisions where they may differ (a callback may read its own clock)
        self.agree = jax.process_count() > 1 and (bool(plan.callbacks) or plan.seconds is not None)

    def steps(self, step: Callable[[Any, jax.Array], tuple[Any, Any]]) -> tuple[str, str | None]:
        """Steps ``first .. n_steps - 1`` with their reads, callbacks and saves: ``(status, reason)``."""
        plan, n = self.plan, self.plan.n_steps
        watch = self.saves is not None
        if watch and self.first < n and distributed.reached_preemption(self.first):
            self.save(self.first)  # a notice before the first step (while restoring or compiling)
            return "preempted", f"preemption notice at step {self.first}"
        status, reason, timed = "finished", None, False  # timed: a timed save agreed at the previous step
        for t, step_key in zip(range(self.first, n), _step_keys(plan.key, self.first, n), strict=True):
            self.state, stats = step(self.state, step_key)
            _start_copy(stats)
            self.pending.append((t, stats))
            done = t + 1
            preempted = watch and distributed.reached_preemption(done)
            due = watch and (preempted or timed or done == n or bool(plan.every and done % plan.every == 0))
            self.read(0 if due else plan.ahead)  # a save holds the statistics of every step up to it
            self.process()
            stop_flag, stop_save, timed = self.decisions()
            if stop_flag:
                reason = self.stop[0] if self.stop else "a callback of process 0 stopped the run"
                self.read(0)
                self.process(run_callbacks=False)
            if (due or stop_flag) and stop_save:
                self.save(done)
                timed = False
            if preempted or stop_flag:
                status = "preempted" if preempted and stop_save else "stopped"
                reason = reason if stop_flag else f"preemption notice at step {done}"
                break
        self.read(0)
        self.process(run_callbacks=status == "finished")
        return status, reason

    def decisions(self) -> tuple[bool, bool, bool]:
        """``(stop, save at the stop, a timed save is due)``: process 0's, on every process."""
        local_timed = self.plan.seconds is not None and time.monotonic() - self.last_save >= self.plan.seconds
        flags = [self.stop is not None, self.stop is None or self.stop[1], local_timed]
        stop, save, timed = _broadcast(flags) if self.agree else flags
        return stop, save, timed

    def save(self, done: int) -> None:
        """The state after ``done`` steps into the checkpoint directory (nothing without one)."""
        if self.saves is None:
            return
        self.flush()  # the log first: it holds the statistics of every step the checkpoint has
        meta = {"step": done, "user": self.plan.user}
        self.saves.save(done, {"state": self.state, "key": self.plan.key_data}, metadata=meta)
        self.last_save = time.monotonic()

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

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.lead:
            for logger in self.loggers:
                logger.close()


def _resume(plan: _Plan, saves: Checkpointer | None, state: Any) -> tuple[Any, int, int | None, dict[str, list[float]]]:
    """``(state, start, start or None, history before start)``: the newest intact checkpoint's, else a new run's."""
    if saves is None:
        return state, 0, None, {}
    restore_mesh, axis = (plan.mesh, "walkers") if plan.mesh is not None else _placement(state)
    try:
        # The newest intact step (an older one, with a warning, when the newest is damaged).
        saved, meta = saves.restore({"state": state, "key": plan.key_data}, mesh=restore_mesh, axis_name=axis)
    except CheckpointNotFoundError:
        return state, 0, None, {}
    start = int(meta["step"])
    _check_resumable(plan, saved, meta, start)
    assert plan.log is not None  # (a checkpoint directory has its log)
    # Checkpoints of 0.4.0 in development carried the history in their metadata; the log holds it since.
    history = plan.log.history(start, meta.get("history"), warn=plan.lead)
    if plan.lead:
        print(f"{_WHERE}: resumed from {str(plan.directory)!r} at step {start}", file=sys.stderr)
    return saved["state"], start, start, history


def _check_resumable(plan: _Plan, saved: Any, meta: Mapping[str, Any], start: int) -> None:
    """A ``CallError`` unless the checkpoint continues this call's run: its key, its settings, ``start <= n_steps``."""
    where = repr(str(plan.directory))
    if not np.array_equal(saved["key"], plan.key_data):
        raise _error(
            f"{where} holds a run of another key: resuming it with this key would not continue its trajectory.",
            fix="pass the key the run started with, or another checkpoint directory for a new run.",
        )
    if start > plan.n_steps:
        raise _error(
            f"{where} holds step {start}, beyond n_steps={plan.n_steps}.",
            fix=f"pass n_steps >= {start} to go on, or another checkpoint directory.",
        )
    saved_user, user = meta.get("user", {}), plan.user
    differ = sorted(k for k in set(saved_user) | set(user) if saved_user.get(k) != user.get(k))
    if differ:
        raise _error(
            f"{where} holds a run of other settings: {', '.join(map(str, differ))}.",
            got=", ".join(f"{k}={user.get(k)!r}" for k in differ),
            expected=", ".join(f"{k}={saved_user.get(k)!r}" for k in differ),
            fix="run with the checkpoint's settings, or use another checkpoint directory for a new run.",
        )


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
    compilation_cache: bool | str | os.PathLike[str] = True,
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
            :class:`JsonLog`, written on process 0 besides the loggers of ``out``), which also keeps the
            statistics a resume gives back in the result's history.
        checkpoint_every: save every this many steps (``None``: not by step count).
        checkpoint_seconds: also save once this many seconds have passed since the last save.
        keep: the checkpoints kept (``None``: all).
        out: loggers: a path (a :class:`JsonLog` there), a logger, or a sequence of them.
        callbacks: a callback or a sequence of them (see :class:`Callback`); default
            ``(StopOnNonFinite(),)``; ``()`` for none.
        metadata: JSON data saved with every checkpoint (the run's settings, say): a resume
            refuses a checkpoint whose metadata differs, naming the keys.
        progress: a tqdm progress bar (``pip install -e ".[progress]"``): ``True`` on standard
            error, a file object to write it there, ``False`` for none; ``None`` (default): on
            standard error when it is a terminal and tqdm is installed.
        description: the progress bar's label.
        on_preemption: ``"exit"`` (default) or ``"return"``; see above.
        ahead: steps dispatched before the statistics of a step are read (0: each step's
            statistics read right after it; a callback's stop takes effect after the steps in flight).
        mesh: the mesh to restore a checkpoint onto (default: the mesh of ``state``'s walkers).
        compilation_cache: keep the compiled programs on disk for the next run of the job (a resumed
            one loads them instead of compiling): ``True`` (default) in the directory
            :func:`shardvmc.enable_compilation_cache` picks, a directory, or ``False`` to leave JAX's
            setting as it is.

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
    plan = _plan(step, n_steps, key, checkpoint, checkpoint_every, checkpoint_seconds, out, callbacks, metadata,
                 on_preemption, ahead, mesh)  # fmt: skip
    if compilation_cache is not False:  # before the first step compiles
        enable_compilation_cache(None if compilation_cache is True else compilation_cache)
    saves = None if plan.directory is None else Checkpointer(plan.directory / "state", keep=keep)
    try:
        if saves is not None:  # from now on, not at the first step: a notice while compiling must not kill the job
            distributed._watch_preemption(where=_WHERE)
        state, start, resumed, restored = _resume(plan, saves, state)
        if plan.lead:
            for logger in plan.loggers:
                logger.open(start, plan.n_steps)
        for callback in plan.callbacks:
            if callable(getattr(callback, "start", None)):
                callback.start(start)
        bar_file = wants_bar(progress) if plan.lead else None
        bar = None if bar_file is None else Progress(bar_file, plan.n_steps, start, description)
        loop = _Loop(plan, saves, state, start, bar)
        try:
            status, reason = loop.steps(step)
        finally:
            loop.close()
        if saves is not None:
            saves.wait()
    finally:
        if saves is not None:
            saves.close()
    history = {k: np.asarray(v, np.float64) for k, v in merge(restored, loop.rows).items()}
    result = RunResult(loop.state, start + len(loop.rows), history, status, reason, resumed,
                       time.perf_counter() - started)  # fmt: skip
    _leave(result, plan)
    return result


def _leave(result: RunResult, plan: _Plan) -> None:
    """At a preemption notice with ``on_preemption="exit"``: the requeue exit (its state is saved), else nothing."""
    if result.preempted and plan.on_preemption == "exit":
        code = distributed.PREEMPTED_EXIT_CODE
        if plan.lead:
            print(f"{_WHERE}: {result.reason}; saved to {str(plan.directory)!r}, exiting with {code}: run the same "
                  "command again to resume", file=sys.stderr)  # fmt: skip
        sys.exit(code)
