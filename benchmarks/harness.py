"""Measuring tools shared by ``run.py`` and ``gpu.py``: interleaved timing, HLO collectives, the kernels.

Every time is turned into a RATIO of two variants measured side by side in one process:
the variants run in turn within each repetition (the order reversed every other
repetition), and the figure is the median over repetitions of the per-repetition ratio.
Load from other processes then slows both sides of a pair alike.
"""

import dataclasses
import importlib.util
import math
import re
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import folx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import shardvmc as sv

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
