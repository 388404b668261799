"""Measuring tools shared by the benchmarks: interleaved timing, the peer protocol, HLO collectives, the kernels.

Every time is turned into a RATIO of two variants measured side by side in one process:
the variants run in turn within each repetition (the order reversed every other
repetition), and the figure is the median over repetitions of the per-repetition ratio.
Load from other processes then slows both sides of a pair alike.

The ratios against other libraries (``netket.py``, ``deepqmc.py``) follow a stricter
protocol (:class:`Protocol`, :func:`measure`, :func:`independent_runs`): rounds lengthened
until the per-round ratio's quartiles lie within ``spread`` of its median, the load
recorded at every round, a run during which other processes took the CPU repeated, and
the median of several independent runs reported.
"""

import dataclasses
import datetime
import importlib.util
import math
import os
import re
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

AXIS = "walkers"


def examples_on_path() -> Path:
    """``examples/`` on the path (its ``network`` and ``plumbing`` importable, as the examples have them)."""
    examples = Path(__file__).resolve().parents[1] / "examples"
    if str(examples) not in sys.path:
        sys.path.insert(0, str(examples))
    return examples


def neural_example() -> Any:
    """``examples/neural_vmc.py`` loaded as the module ``neural_vmc``, with ``examples/`` on the path.

    As ``python examples/neural_vmc.py`` has it: the example imports its ``network`` and ``plumbing`` from there.
    """
    examples = examples_on_path()
    spec = importlib.util.spec_from_file_location("neural_vmc", examples / "neural_vmc.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["neural_vmc"] = module  # the example's dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def fill_defaults(args: Any, defaults: dict[str, Any], quick: dict[str, Any]) -> Any:
    """Set the options the command line left unset: ``quick``'s sizes with ``--quick``, else ``defaults``."""
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, quick[key] if args.quick else value)
    return args


# --------------------------------------------------------------------------------------------
# Timing


@dataclasses.dataclass(frozen=True)
class Ratio:
    """Median (and quartiles) over repetitions of ``time(a) / time(b)``, measured in pairs."""

    median: float
    q25: float
    q75: float
    reps: int

    def __str__(self) -> str:
        return f"{self.median:.3f} [{self.q25:.3f}, {self.q75:.3f}]"


def interleaved(thunks: dict[str, Callable[[], Any]], reps: int, number: int = 1) -> dict[str, list[float]]:
    """Seconds per call of each thunk, one entry per repetition, the thunks run in turn.

    Each repetition calls every thunk ``number`` times in a row and waits for the last
    result; the order of the thunks is reversed every other repetition. Two warm-up
    rounds run first.
    """
    names = list(thunks)
    for _ in range(2):
        for name in names:
            jax.block_until_ready(thunks[name]())
    times: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(reps):
        for name in names if rep % 2 == 0 else names[::-1]:
            thunk = thunks[name]
            start = time.perf_counter()
            for _ in range(number):
                out = thunk()
            jax.block_until_ready(out)
            times[name].append((time.perf_counter() - start) / number)
    return times


def ratio(times: dict[str, list[float]], a: str, b: str) -> Ratio:
    """The paired ratio ``a / b`` of an :func:`interleaved` measurement."""
    pairs = sorted(x / y for x, y in zip(times[a], times[b]))
    q = statistics.quantiles(pairs, n=4) if len(pairs) > 1 else [pairs[0]] * 3
    return Ratio(statistics.median(pairs), q[0], q[2], len(pairs))


# --------------------------------------------------------------------------------------------
# The protocol of the peer ratios (netket.py, deepqmc.py)
#
# A ratio against another library decides something only when it holds: (1) the per-round
# ratio's quartiles lie within ``spread`` of its median (rounds are lengthened, more calls of
# each side in a row, until they do: more rounds of the same length only estimate the same
# quartiles better); (2) no other process took the CPU while it was measured (the one-minute
# load average is recorded at every round, but on a small machine the benchmark's own device
# threads lift it above 1 by themselves, so the judge is the CPU time that processes outside
# the benchmark's own process tree took during the rounds, in cores); a run above ``max_load``
# is marked and repeated; (3) it holds over independent runs (fresh processes, compiled
# afresh): the figure is the median of their medians.


@dataclasses.dataclass(frozen=True)
class Protocol:
    """How a peer ratio is measured: see the comment above."""

    batch: int = 10  # rounds between two checks of the spread (and the fewest rounds a figure rests on)
    max_rounds: int = 60  # timed rounds of one measurement at most, every round length counted
    spread: float = 0.1  # the quartiles within +- spread of the median (in units of the ratio)
    grow: int = 2  # calls of each side per round multiplied by this while the quartiles are too wide
    max_calls: int = 16  # ... up to this many
    runs: int = 3  # independent runs the figure is the median of
    extra_runs: int = 3  # runs taken above max_load are repeated: at most this many more runs
    max_load: float = 0.5  # CPU (cores) taken by other processes during a run, on average, above which it is repeated


def settled(r: Ratio, spread: float) -> bool:
    """Both quartiles within ``spread`` of the median."""
    return r.q75 - r.median <= spread and r.median - r.q25 <= spread


def next_step(r: Ratio, rounds_at_length: int, rounds_total: int, calls: int, p: Protocol) -> str:
    """After a batch of rounds: ``'done'`` (settled), ``'cap'`` (``max_rounds`` reached, unsettled),
    ``'longer'`` (the next rounds make ``grow`` times the calls, the rounds so far set aside) or ``'more'``
    (another batch of the same length, once the length is at ``max_calls``)."""
    if settled(r, p.spread):
        return "done"
    if rounds_total + p.batch > p.max_rounds:
        return "cap"
    if rounds_at_length >= p.batch and calls * p.grow <= p.max_calls:
        return "longer"
    return "more"


def busy_ticks(stat: str) -> int:
    """CPU ticks not idle since boot, from ``/proc/stat``'s first line (user, nice, system, irq, softirq, steal)."""
    fields = [int(x) for x in stat.splitlines()[0].split()[1:]]
    return sum(fields[:3]) + sum(fields[5:8])


def tree_ticks(stats: dict[int, str], root: int) -> int:
    """CPU ticks of process ``root`` and its descendants (their own and their reaped children's), from the
    text of each process's ``/proc/<pid>/stat``."""
    parent, ticks = {}, {}
    for pid, text in stats.items():
        fields = text[text.rindex(")") + 2 :].split()  # after the command name, which may hold spaces
        parent[pid] = int(fields[1])
        ticks[pid] = sum(int(x) for x in fields[11:15])  # utime, stime, cutime, cstime
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        total += ticks.get(pid, 0)
        todo.extend(child for child, up in parent.items() if up == pid)
    return total


def read_proc(root: int) -> tuple[int, int] | None:
    """``(busy_ticks, tree_ticks)`` of this machine now, or None without ``/proc`` (not Linux)."""
    try:
        with open("/proc/stat") as f:
            busy = busy_ticks(f.read())
    except OSError:
        return None
    stats = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/stat") as f:
                    stats[int(entry.name)] = f.read()
            except OSError:  # the process ended meanwhile
                pass
    return busy, tree_ticks(stats, root)


class LoadMeter:
    """Each :meth:`reading`: the one-minute load average now (``load``), and the CPU (in cores) that processes
    outside this process's tree took since the previous reading (``others``), over ``span`` seconds."""

    def __init__(
        self,
        read: Callable[[], tuple[int, int] | None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        loadavg: Callable[[], tuple[float, float, float]] = os.getloadavg,
        ticks_per_second: float | None = None,
    ) -> None:
        root = os.getpid()
        self._read = read or (lambda: read_proc(root))
        self._clock, self._loadavg = clock, loadavg
        self._hz = ticks_per_second or os.sysconf("SC_CLK_TCK")
        self._last = (self._clock(), self._read())

    def reading(self) -> dict[str, Any]:
        now, ticks = self._clock(), self._read()
        (then, before), self._last = self._last, (now, ticks)
        others = None
        if ticks is not None and before is not None and now > then:
            others = max(0.0, ((ticks[0] - before[0]) - (ticks[1] - before[1])) / self._hz / (now - then))
        others = None if others is None else round(others, 3)
        return {"load": round(self._loadavg()[0], 2), "others": others, "span": round(now - then, 4)}


def utc_now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%H:%M:%S")


def load_summary(rounds: list[dict[str, Any]], max_load: float) -> dict[str, Any]:
    """The load average's range, the other processes' CPU (cores) over ``rounds`` (the mean weighted by the
    rounds' spans, and the largest), and whether that mean is above ``max_load`` (``None``: not known)."""
    loads = [r["load"] for r in rounds]
    known = [r for r in rounds if r.get("others") is not None]
    others = [r["others"] for r in known]
    span = sum(r["span"] for r in known)
    mean = sum(r["others"] * r["span"] for r in known) / span if span > 0 else None
    return {
        "load": [min(loads), max(loads)] if loads else None,
        "others": None if mean is None else round(mean, 3),
        "others_max": max(others) if others else None,
        "above": None if mean is None else mean > max_load,
    }


def measure(
    sides: dict[str, Callable[[int], float]],
    p: Protocol,
    meter: LoadMeter | None = None,
    warm_up: int = 2,
    order: Callable[[list[str], int], list[str]] | None = None,
) -> dict[str, Any]:
    """Interleaved rounds of ``sides`` (each called with ``calls``, returning the seconds those calls took,
    timed by the side itself) until the first side over the second settles (:func:`next_step`).

    ``warm_up`` rounds of one call each first. Each round calls every side in turn, the order reversed every
    other round, and records the seconds per call of each side, their ratio, the load average and the other
    processes' CPU (``meter``). With one side (a smoke run) one batch is run. Returns the ratio (of the
    rounds at the last length) with whether it settled, the calls per round, the median seconds per call of
    each side, the rounds and their load.
    """
    names = list(sides)
    meter = meter or LoadMeter()
    order = order or (lambda names, i: names if i % 2 == 0 else names[::-1])
    for _ in range(warm_up):
        for name in names:
            sides[name](1)
    meter.reading()  # the load from here on
    rounds: list[dict[str, Any]] = []
    calls, action, r = 1, "done", None
    while True:
        for _ in range(p.batch):
            seconds = {}
            for name in order(names, len(rounds)):
                seconds[name] = sides[name](calls) / calls
            row: dict[str, Any] = {"calls": calls, "seconds": seconds, "utc": utc_now(), **meter.reading()}
            if len(names) > 1:
                row["ratio"] = seconds[names[0]] / seconds[names[1]]
            rounds.append(row)
        current = [row for row in rounds if row["calls"] == calls]
        if len(names) == 1:
            break
        r = ratio({name: [row["seconds"][name] for row in current] for name in names}, names[0], names[1])
        action = next_step(r, len(current), len(rounds), calls, p)
        if action in ("done", "cap"):
            break
        if action == "longer":
            calls *= p.grow
    current = [row for row in rounds if row["calls"] == calls]
    result: dict[str, Any] = {
        "calls": calls,
        "rounds_at_length": len(current),
        "rounds": rounds,
        "seconds": {name: statistics.median(row["seconds"][name] for row in current) for name in names},
        **load_summary(rounds, p.max_load),
    }
    if r is not None:
        result["ratio"] = {**dataclasses.asdict(r), "settled": action == "done"}
    return result


def run_load(measurements: list[dict[str, Any]], max_load: float) -> dict[str, Any]:
    """:func:`load_summary` over every round of a run's measurements."""
    return load_summary([row for m in measurements for row in m["rounds"]], max_load)


def independent_runs(
    run_once: Callable[[int], dict[str, Any]], p: Protocol, log: Callable[[str], None] = print
) -> dict[str, Any]:
    """``p.runs`` runs taken below ``p.max_load``: ``run_once(i)`` is the i-th run (a fresh process), whose
    result holds ``"load"`` (:func:`run_load`); a run above the load is kept, marked and repeated, at most
    ``p.extra_runs`` times in all. If the repeats run out, runs above the load fill the count, and the result
    says so (``"above_load"``: how many of the counted runs were taken above it)."""
    taken: list[dict[str, Any]] = []
    while True:
        below = [i for i, run in enumerate(taken) if not run["load"]["above"]]
        if len(below) >= p.runs or len(taken) >= p.runs + p.extra_runs:
            break
        run = run_once(len(taken))
        taken.append(run)
        load, r = run["load"], run.get("ratio")
        mark = ""
        if load["above"]:
            repeats = len(taken) < p.runs + p.extra_runs
            mark = " (above the load limit: repeated)" if repeats else " (above the load limit; no repeat left)"
        figure = ""
        if r:
            how = "settled" if r.get("settled") else "NOT settled"
            figure = f"ratio {r['median']:.3f} [{r['q25']:.3f}, {r['q75']:.3f}] ({how}), "
        log(f"run {len(taken)}: {figure}load average {load['load']}, other processes {load['others']} cores{mark}")
    counted = below[: p.runs]
    counted += [i for i in range(len(taken)) if i not in below][: p.runs - len(counted)]
    above = sum(taken[i]["load"]["above"] is True for i in counted)
    return {"runs": taken, "counted": sorted(counted), "above_load": above}


def median_of_runs(ratios: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    """The median of the runs' medians, with the runs' medians and the medians of their quartiles."""
    known = [r for r in ratios if r]
    if not known:
        return None
    return {
        "median": statistics.median(r["median"] for r in known),
        "q25": statistics.median(r["q25"] for r in known),
        "q75": statistics.median(r["q75"] for r in known),
        "runs": [round(r["median"], 4) for r in known],
        "settled": sum(bool(r.get("settled")) for r in known),
        "n": len(known),
    }


def fmt_runs(r: dict[str, Any] | None) -> str:
    """``0.512 [0.47, 0.55] (runs 0.50, 0.51, 0.53; 3 settled)``: the median of the runs' medians, the
    medians of their quartiles, each run's median."""
    if not r:
        return "-"
    runs = ", ".join(f"{x:.3f}" for x in r["runs"])
    return f"{r['median']:.3f} [{r['q25']:.3f}, {r['q75']:.3f}] (runs {runs}; {r['settled']} of {r['n']} settled)"


def fmt_run(i: int, run: dict[str, Any], ratio_text: str, middle: str) -> str:
    """One protocol run's line: ``run I (counted), UTC: step RATIO, MIDDLE; load average ..., other processes ...``."""
    load, what = run["load"], "counted" if run["counted"] else "not counted"
    above = {True: ", ABOVE the load limit", False: "", None: ", load of others unknown"}[load["above"]]
    return (f"run {i + 1} ({what}{above}), {run['utc'][0]}-{run['utc'][1]} UTC: step {ratio_text}, {middle}; "
            f"load average {load['load'][0]}-{load['load'][1]}, other processes {load['others']} cores "
            f"(at most {load['others_max']})")  # fmt: skip


def add_protocol_args(parser: Any, batch: int) -> None:
    """The protocol's command-line options (``--rounds`` is the batch)."""
    d = Protocol()
    parser.add_argument("--rounds", type=int, default=batch, help="rounds between checks of the spread (>= 10)")
    parser.add_argument("--max-rounds", type=int, default=d.max_rounds, help="timed rounds of a measurement at most")
    parser.add_argument("--spread", type=float, default=d.spread, help="the quartiles within +- this of the median")
    parser.add_argument("--max-calls", type=int, default=d.max_calls, help="calls per side per round at most")
    parser.add_argument("--runs", type=int, default=d.runs, help="independent runs (the figure: their median)")
    parser.add_argument("--extra-runs", type=int, default=d.extra_runs, help="repeats of runs above --max-load")
    parser.add_argument("--max-load", type=float, default=d.max_load,
                        help="other processes' CPU (cores) during a run above which it is repeated")  # fmt: skip


def protocol_of(args: Any) -> Protocol:
    return Protocol(
        batch=args.rounds,
        max_rounds=max(args.rounds, args.max_rounds),
        spread=args.spread,
        max_calls=args.max_calls,
        runs=args.runs,
        extra_runs=args.extra_runs,
        max_load=args.max_load,
    )


def protocol_argv(args: Any) -> list[str]:
    """The protocol's options as a command line, for a child process."""
    return ["--rounds", str(args.rounds), "--max-rounds", str(args.max_rounds), "--spread", str(args.spread),
            "--max-calls", str(args.max_calls), "--runs", str(args.runs), "--extra-runs", str(args.extra_runs),
            "--max-load", str(args.max_load)]  # fmt: skip


# --------------------------------------------------------------------------------------------
# Compiled programs

COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter")
_COLLECTIVE_OP = re.compile(r"\s(" + "|".join(COLLECTIVES) + r")(?:-start)?\(")


def count_collectives(compiled: Any) -> dict[str, int]:
    """Collective instructions in a compiled program's HLO, by kind (each async start/done pair counts once).

    The count is static: a collective inside a loop body counts once.
    """
    counts = dict.fromkeys(COLLECTIVES, 0)
    for match in _COLLECTIVE_OP.finditer(compiled.as_text()):
        counts[match.group(1)] += 1
    return counts


def temp_bytes(compiled: Any) -> int:
    """Temporary bytes per device of a compiled SPMD program (``memory_analysis``)."""
    return int(compiled.memory_analysis().temp_size_in_bytes)


def fmt_error(mean: float, error: float) -> str:
    """``-2.90413(46)``: the error in units of the last two digits shown."""
    if not (error > 0 and math.isfinite(error)):
        return f"{mean:.6f}"
    digits = max(0, 1 - math.floor(math.log10(error)))
    return f"{mean:.{digits}f}({round(error * 10**digits):d})"


def fmt_collectives(counts: dict[str, int]) -> str:
    """``'none'`` or e.g. ``'1 all-reduce'``."""
    parts = [f"{n} {kind}" for kind, n in counts.items() if n]
    return ", ".join(parts) if parts else "none"


# --------------------------------------------------------------------------------------------
# Kernels


def decorated_energy(system: Any, mesh: Any, output: str = "walker", batch_size: int | None = None) -> Any:
    """The local energy as a ``walker_parallel`` kernel: per-walker (``'walker'``) or ``'mean'`` output."""
    import shardvmc as sv  # here, not at the top: deepqmc_pieces.py times with this module in DeepQMC's own venv

    if output == "walker":

        @sv.walker_parallel(mesh=mesh, batch_size=batch_size)
        def local_energy(params: sv.Replicated[dict], r: sv.PerWalker[jax.Array]) -> sv.PerWalker[jax.Array]:
            return system.local_energy(params, r)

    else:

        @sv.walker_parallel(mesh=mesh, batch_size=batch_size)
        def local_energy(params: sv.Replicated[dict], r: sv.PerWalker[jax.Array]) -> sv.Mean[jax.Array]:
            return system.local_energy(params, r)

    return local_energy


def hand_written(
    fn: Callable[[Any, Any], Any], mesh: Any, output: str = "walker", batch_size: int | None = None
) -> Callable[[Any, Any], Any]:
    """``jax.jit(shard_map(vmap(fn)))`` for ``fn(replicated, walker)``, written as an expert would.

    Under the same engine rule as shardvmc's kernels (``check_vma=False``: folx and
    jvp-of-grad Laplacians of real networks run, and per-walker gradients with respect
    to the replicated input are each walker's own); a ``'mean'`` output is one ``psum``
    of the local sums.
    """
    import folx

    size = mesh.shape[AXIS]
    mapped = jax.vmap(fn, (None, 0)) if batch_size is None else folx.batched_vmap(fn, batch_size, (None, 0))

    def body(params: Any, r: Any) -> Any:
        out = mapped(params, r)
        if output == "walker":
            return out
        return jax.lax.psum(jnp.sum(out, axis=0), AXIS) / (r.shape[0] * size)

    out_specs = P(AXIS) if output == "walker" else P()
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P(AXIS)), out_specs=out_specs, check_vma=False))


def rel_diff(a: Any, b: Any) -> float:
    """``max|a - b| / max|b|`` over all leaves (gathered to the host, in float64)."""
    num = den = 0.0
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        num, den = max(num, float(np.max(np.abs(x - y)))), max(den, float(np.max(np.abs(y))))
    return num / den if den else num
