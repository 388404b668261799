"""The accelerator benchmark: every ratio that matters, on a TPU or GPU, in one table (``--smoke``: tiny, on CPU).

The rows, each speed a ratio of two variants timed in turn (``harness.interleaved``:
median over repetitions [quartiles]), all in ONE table, in the platform's dtype
(``sv.precision_policy``: float32 on a TPU, float64 where the platform has it):

- **11, local energies against float64**: the templates' and the corpus's Li networks
  (initial parameters, 512 walkers): ``sv.hamiltonian.local_energy`` in float32 on the
  platform, JAX's defaults there (plain folx), and float32 on the host's CPU, each against
  float64 on the host's CPU: median, 95th percentile, mean, rms and largest error, and the
  mean and rms without the 1 % of walkers of largest ``|E_L|`` (float32's error at a walker
  grows with it: those nearest a node or a nucleus set the mean and rms of all).
- **12, trained parameters**: the templates' network after ``examples/neural_vmc.py``'s
  default training and the corpus's after 400 minSR steps of ``sv.driver.VMC``; 16
  sampler calls of their walkers (|psi|^2's samples, 8,192 walkers), each walker's local
  energy in float32 on the platform and on the host's CPU against float64 there: the
  evaluation's mean energy off float64's (goal: within 0.1 mHa) and the per-walker errors.
- **8, kernels**: the corpus's FermiNet-style network (``tests/models``: Li, 2 layers
  of 32/8 hidden units, 4 determinants, 4,753 parameters; local energy by folx's
  forward Laplacian), per-walker output, decorated / hand-written
  ``jax.jit(shard_map(vmap))`` at 4,096, 16,384 and 65,536 walkers (and at the largest
  count also chunked by ``batch_size``, against ``folx.batched_vmap`` in ``shard_map``),
  with walkers per second and compiled temporary memory per device; the O2
  Slater-Jastrow local energy of ``run.py`` at 16,384 walkers, as ``run.py`` writes it
  (folx through ``jnp.linalg.slogdet``) and through the library (``sv.linalg.slogdet``,
  ``sv.hamiltonian``'s Laplacian for the platform, with its error against float64).
- **2, dispatch**: ``run.py``'s small-kernel call overhead (``sections.call_overhead``:
  decorated / jitted hand-written, each call waited for and calls queued, and the
  calibration rows), in 10 x ``--reps`` pairs of blocks of 40 calls.
- **9, natural gradient**: each solver of ``sv.natural_gradient`` (dense, minsr, spring,
  cg) under ``jax.jit`` / a hand-written ``jax.jit`` jnp solve of the same system, at
  the neural example's size (N = 512, P = 4,753, float64) and at N = 16,384, P = 10^5
  (float32: J is 6.5 GB; dense is left out there, its P x P matrix alone is 40 GB), or
  the P whose J fills an eighth of a smaller device's memory (some 32,000 on a 16 GiB chip).
- **10, neural step**: walkers per second (walkers x steps / s) of
  ``examples/neural_vmc.py``'s optimisation step (20 Metropolis moves, the folx local
  energy, the per-walker Jacobian, clipping, minSR, the update) and evaluation step for
  Li in the platform's dtype at 4,096 and 16,384 walkers, and their compiled memory per device.

Every row runs in a child process that writes each finished row to a journal: a row whose
process crashes (XLA aborts the whole process on some compiler failures, out-of-memory
kills it) is reported as that row, with the signal and the last lines it printed, and a
new child goes on with the next row; the table keeps every row.

Time guard: every row first times one call of each variant, then takes as many
repetitions (at most ``--reps``, at least 3) as fit ``--row-seconds``; a row still running
after ``--row-limit`` seconds (300) is stopped with its process and reported as that row's
failure, and a new process goes on with the next row; a row that would
start after ``--budget`` seconds (900) is skipped and says so, and a watchdog prints
the table so far, writes ``--out`` and exits with code 124 when the run reaches the
budget plus 45 s (a call that hangs, a row far slower than its first call). A row whose
variant fails (out of memory, say) reports the error and the run goes on.

Usage (from the repository root)::

    python benchmarks/gpu.py --out results.md        # on a GPU machine: every device of the default backend
    python benchmarks/gpu.py --only solvers,neural --reps 11
    python benchmarks/gpu.py --smoke                 # no accelerator needed: tiny sizes on 8 fake CPU devices
"""

import argparse
import dataclasses
import functools
import json
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

SECTIONS = ("errors", "kernels", "dispatch", "solvers", "neural", "trained")
ROW_LIMIT_EXIT = 125  # a child's exit status after it stopped a row at --row-limit


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on fake CPU devices: checks the script")
    parser.add_argument("--cpu-devices", type=int, default=0, help="run on this many fake CPU devices (--smoke: 8)")
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated subset of {SECTIONS}")
    parser.add_argument("--walkers", default="", help="FermiNet kernel walker counts (default 4096,16384,65536)")
    parser.add_argument("--neural-walkers", default="", help="neural step walker counts (default 4096,16384)")
    parser.add_argument(
        "--solver-sizes", default="example,large", help="section 9's sizes: example (N=512), large (N=16,384)"
    )
    parser.add_argument("--neural-optimiser", default="minsr", help="natural_gradient method of the neural step")
    parser.add_argument("--reps", type=int, default=0, help="repetitions per ratio, at most (default 21; smoke 3)")
    parser.add_argument("--row-seconds", type=float, default=0, help="timed seconds per row (default 25; smoke 5)")
    parser.add_argument(
        "--budget", type=float, default=0, help="no row starts after this many seconds (default 900; smoke 300)"
    )
    parser.add_argument(
        "--row-limit", type=float, default=0, help="a row running longer is stopped, a failed row (default 300)"
    )
    parser.add_argument("--out", default="", help="also write the table (Markdown) to this file")
    parser.add_argument("--json", default="", help="also write the rows, facts and machine to this JSON file")
    parser.add_argument("--in-process", action="store_true", help="run every row in this process (no child)")
    parser.add_argument("--journal", default="", help=argparse.SUPPRESS)  # a child's: the rows done and started
    parser.add_argument("--started-at", type=float, default=0.0, help=argparse.SUPPRESS)  # the parent's start
    # the tests': the row whose name holds this text aborts its process (as XLA does on some compiler failures)
    parser.add_argument("--abort-in", default="", help=argparse.SUPPRESS)
    # the tests': the row whose name holds this text never returns (a compile or a call that hangs)
    parser.add_argument("--hang-in", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    unknown = set(args.only.split(",")) - set(SECTIONS)
    if unknown:
        parser.error(f"--only: unknown sections {sorted(unknown)}; pick from {SECTIONS}")
    return args


@dataclasses.dataclass
class Sizes:
    """The sizes of one run: the full one on accelerators, tiny ones for ``--smoke``."""

    ferminet_walkers: list[int]
    ferminet_net: dict[str, int]
    ferminet_batch_size: int
    error_walkers: int
    o2_walkers: int
    solvers: list[tuple[str, int, int, str]]  # (label, N, P, dtype)
    neural_walkers: list[int]
    neural_quick: bool
    neural_steps: tuple[str, ...]
    trained_corpus_steps: int  # section 12: the corpus network's training steps; the template's is its default run
    trained_samples: int  # sampler calls whose walkers section 12 evaluates
    tiny_walkers: int | None
    tiny_calls: int
    reps: int
    row_seconds: float
    row_limit: float  # seconds a row may run before its process is stopped (0: no limit)
    budget: float


def device_bytes() -> int:
    """The first device's memory in bytes, as its allocator reports it (0 where it reports none: CPUs)."""
    import jax

    return int((jax.devices()[0].memory_stats() or {}).get("bytes_limit", 0))


def large_p(n: int) -> int:
    """The large solver rows' parameter count: 10^5, or fewer where J (float32) would take over an eighth of the
    device's memory (a solve holds J, its centred copy and the hand-written solve's; 10^5 fills a 16 GiB TPU)."""
    limit = device_bytes()
    fit = limit // 8 // (4 * n) // 1000 * 1000 if limit else 100_000
    return int(min(100_000, max(fit, 1000)))


def sizes_for(args: argparse.Namespace, smoke: bool) -> Sizes:
    def counts(text: str, default: list[int]) -> list[int]:
        return [int(s) for s in text.split(",") if s.strip()] or default

    if smoke:
        sizes = Sizes(
            ferminet_walkers=counts(args.walkers, [16]),
            ferminet_net={"hidden_one": 8, "hidden_two": 4, "layers": 1, "determinants": 1},
            ferminet_batch_size=0,  # no chunked row
            error_walkers=16,
            o2_walkers=0,
            solvers=[("scaled down", 32, 96, "float64")],
            neural_walkers=counts(args.neural_walkers, [16]),
            neural_quick=True,
            neural_steps=("optimisation", "evaluation"),
            trained_corpus_steps=3,
            trained_samples=1,
            tiny_walkers=16,
            tiny_calls=5,
            reps=3,
            row_seconds=5.0,
            row_limit=240.0,
            budget=300.0,
        )
    else:
        sizes = Sizes(
            ferminet_walkers=counts(args.walkers, [4096, 16384, 65536]),
            ferminet_net={"hidden_one": 32, "hidden_two": 8, "layers": 2, "determinants": 4},
            ferminet_batch_size=4096,
            error_walkers=512,
            o2_walkers=16384,
            solvers=[
                solver
                for key, solver in (
                    ("example", ("the neural example's size", 512, 4753, "auto")),
                    ("large", ("large", 16384, large_p(16384), "float32")),
                )
                if key in args.solver_sizes.split(",")
            ],
            neural_walkers=counts(args.neural_walkers, [4096, 16384]),
            neural_quick=False,
            neural_steps=("optimisation", "evaluation"),
            trained_corpus_steps=400,
            trained_samples=16,
            tiny_walkers=None,  # run.py's default (sections.Config)
            # Section 2 in short blocks (10 x --reps pairs of 40 calls): on fake CPU devices such runs agreed
            # within 0.04, against 0.12 with 21 blocks of 200 calls (benchmarks/RESULTS.md).
            tiny_calls=40,
            reps=21,
            row_seconds=25.0,
            row_limit=300.0,
            budget=900.0,
        )
    sizes.reps = args.reps or sizes.reps
    sizes.row_seconds = args.row_seconds or sizes.row_seconds
    sizes.budget = args.budget or sizes.budget
    sizes.row_limit = args.row_limit or sizes.row_limit
    return sizes


class Guard:
    """The time budget, the journal of finished rows, and a watchdog for a call that never returns.

    ``journal`` (a child's): a JSON line is appended before each row starts and when it is done;
    rows done by earlier children (or failed with their process) are taken from it, not run again.
    """

    def __init__(self, report: Any, sizes: Sizes, write: Callable[[str], None], journal: str = "",
                 started_at: float = 0.0, abort_in: str = "", hang_in: str = "") -> None:  # fmt: skip
        self.report, self.sizes, self.write, self.journal = report, sizes, write, journal
        self.abort_in, self.hang_in = abort_in, hang_in
        # the parent's start when a child runs (the budget is the whole run's), else now
        self.start = time.perf_counter() - (time.time() - started_at if started_at else 0.0)
        self.current = "start-up"
        self.finished = {entry["what"]: entry for entry in read_journal(journal) if "rows" in entry}
        self.watchdog = threading.Timer(max(sizes.budget + 45.0 - self.elapsed(), 1.0), self._expire)
        self.watchdog.daemon = True
        self.watchdog.start()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def reps(self, seconds_per_repetition: float) -> int:
        """As many repetitions as fit the row's seconds (at least 3, at most ``--reps``)."""
        fit = int(self.sizes.row_seconds / max(seconds_per_repetition, 1e-9))
        return max(3, min(self.sizes.reps, fit))

    def _log(self, entry: dict[str, Any]) -> None:
        if self.journal:
            with open(self.journal, "a") as f:
                f.write(json.dumps(entry, default=str) + "\n")
                f.flush()
                os.fsync(f.fileno())

    def row(self, section: int, what: str, run: Callable[[], None]) -> None:
        """``run()`` (which adds its rows to the report), unless the budget is spent; failures become rows."""
        if what in self.finished:  # done (or crashed) in an earlier child: its rows as recorded
            entry = self.finished[what]
            self.report.rows.extend(entry["rows"])
            for key, value in entry.get("facts", {}).items():
                self.report.facts.setdefault(key, {}).update(value)
            return
        first = len(self.report.rows)
        if self.elapsed() > self.sizes.budget:
            self.report.row(section, what, f"skipped: the {self.sizes.budget:.0f} s budget was spent")
            self._log({"what": what, "rows": self.report.rows[first:]})
            return
        self.current = what
        self._log({"what": what, "section": section, "started": True})
        if self.abort_in and self.abort_in in what:
            os.abort()
        start = time.perf_counter()
        facts: dict[str, Any] = {}
        # In a child, a row past its limit ends the process (a compile or a call cannot be interrupted otherwise):
        # the row is journalled as failed first, and the parent starts a new child for the rows after it.
        limit = self.sizes.row_limit if self.journal else 0.0
        timer = threading.Timer(limit, self._row_expired, (section, what, first)) if limit else None
        if timer is not None:
            timer.daemon = True
            timer.start()
        try:
            if self.hang_in and self.hang_in in what:
                threading.Event().wait()
            run()
        except Exception as err:  # out of memory, a refused plan: the other rows still run
            message = f"{type(err).__name__}: {str(err).splitlines()[0][:160]}" if str(err) else type(err).__name__
            self.report.row(section, what, f"failed: {message}")
            facts["errors"] = {what: traceback.format_exc()[-4000:]}
        if timer is not None:
            timer.cancel()
        facts["row seconds"] = {what: round(time.perf_counter() - start, 1)}
        for key, value in facts.items():
            self.report.facts.setdefault(key, {}).update(value)
        self._log({"what": what, "rows": self.report.rows[first:], "facts": facts})

    def _row_expired(self, section: int, what: str, first: int) -> None:
        figure = f"failed: still running after the {self.sizes.row_limit:.0f} s row limit (its process was stopped)"
        print(f"  [{section}] {what}: {figure}  (a new process goes on)", flush=True)
        self._log({"what": what, "rows": [*self.report.rows[first:], _row(section, what, figure)], "facts": {}})
        os._exit(ROW_LIMIT_EXIT)

    def _expire(self) -> None:
        print(f"\nTIMED OUT after {self.elapsed():.0f} s, in: {self.current}", flush=True)
        self.write(f"**Incomplete: timed out after {self.elapsed():.0f} s, in: {self.current}**")
        os._exit(124)


def _row(section: int, what: str, figure: str) -> dict[str, Any]:
    """A row with no goal, as ``Report.row`` writes it: a failure the parent or the row's timer records."""
    return {"section": section, "what": what, "figure": figure, "goal": "", "met": None}


def read_journal(path: str) -> list[dict[str, Any]]:
    """The journal's entries (none when there is no journal yet)."""
    if not path or not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def supervise(argv: list[str], args: argparse.Namespace, script: str = __file__) -> int:
    """Run the rows in child processes: a row whose process dies becomes a failed row, and a new child goes on.

    The last child that finishes writes the whole table (every row from the journal). ``script``: the benchmark
    the children run (another benchmark, ``scaling.py``, shares this supervisor).
    """
    import subprocess
    import tempfile

    started_at = time.time()
    with tempfile.TemporaryDirectory(prefix="shardvmc-accel-bench-") as tmp:
        journal = os.path.join(tmp, "journal.jsonl")
        for attempt in range(1, 26):
            stderr_path = os.path.join(tmp, f"stderr-{attempt}.txt")
            command = [sys.executable, os.path.abspath(script), *argv, "--journal", journal,
                       "--started-at", str(started_at)]  # fmt: skip
            with open(stderr_path, "w") as stderr:
                code = subprocess.run(command, stderr=stderr).returncode
            if code == 0:
                return 0
            if code == ROW_LIMIT_EXIT:  # the child journalled the row it stopped: the next child goes on after it
                continue
            entries = read_journal(journal)
            done = {e["what"] for e in entries if "rows" in e}
            open_rows = [e for e in entries if e.get("started") and e["what"] not in done]
            tail = open(stderr_path, errors="replace").read().strip().splitlines()[-3:]
            sys.stderr.write("\n".join(tail) + "\n")
            if code == 124 or not open_rows:  # the watchdog's end, or a failure outside any row: the child said why
                return code
            crashed = open_rows[-1]
            how = f"signal {-code}" if code < 0 else f"exit {code}"
            last = " / ".join(line.strip()[:120] for line in tail) or "no output"
            figure = f"failed: the process died ({how}): {last}"
            print(f"  [{crashed['section']}] {crashed['what']}: {figure}  (a new process goes on)", flush=True)
            with open(journal, "a") as f:
                row = _row(crashed["section"], crashed["what"], figure)
                f.write(json.dumps({"what": crashed["what"], "rows": [row], "facts": {}}) + "\n")
        print("gave up: every child died", flush=True)
        return 1


def ratio_row(
    guard: Guard, thunks: dict[str, Callable[[], Any]], a: str, b: str
) -> tuple[Any, dict[str, list[float]], float]:
    """Compile and time one call of each variant, then ``harness.interleaved`` with the reps that fit."""
    import jax
    from harness import interleaved, ratio

    start = time.perf_counter()
    for thunk in thunks.values():
        jax.block_until_ready(thunk())  # compiles
    compile_seconds = time.perf_counter() - start
    start = time.perf_counter()
    for thunk in thunks.values():
        jax.block_until_ready(thunk())
    times = interleaved(thunks, guard.reps(time.perf_counter() - start))
    return ratio(times, a, b), times, compile_seconds


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


# ----------------------------------------------------------------------------- 8. kernels


def error_figures(e: Any, reference: Any) -> dict[str, float]:
    """``median, p95, mean, rms, max`` of ``e - reference`` (hartree), and ``mean_99, rms_99`` without the 1 % of
    largest ``|E_L|``."""
    import numpy as np

    reference = np.asarray(reference, np.float64).reshape(-1)
    d = np.asarray(e, np.float64).reshape(-1) - reference
    a = np.abs(d)
    # float32's error at a walker grows with its |E_L| (like 1/distance^2 to a node or a nucleus), so the mean
    # and rms over all walkers are set by the few nearest one; the same without the 1 % of largest |E_L|
    # (chosen by the float64 values, not by the errors)
    far = np.abs(reference - np.median(reference)) <= np.percentile(np.abs(reference - np.median(reference)), 99)
    return {
        "median": float(np.median(a)),
        "p95": float(np.percentile(a, 95)),
        "mean": float(d.mean()),
        "rms": float(np.sqrt(np.mean(d * d))),
        "max": float(a.max()),
        "mean_99": float(d[far].mean()),
        "rms_99": float(np.sqrt(np.mean(d[far] ** 2))),
    }


def error_text(e: Any, reference: Any) -> str:
    """``median, 95 %, mean, rms and max`` of ``e - reference`` (hartree), the walkers' errors against float64."""
    f = error_figures(e, reference)
    return (
        f"median {f['median']:.1e}, 95 % {f['p95']:.1e}, mean {f['mean']:+.1e}, "
        f"rms {f['rms']:.1e}, max {f['max']:.1e} Ha; "
        f"without the 1 % of largest local energies (in magnitude): "
        f"mean {f['mean_99']:+.1e}, rms {f['rms_99']:.1e} Ha"
    )


def float64_on_the_cpu(fn: Any, params: Any, r: Any) -> Any:
    """``vmap(fn)(params, r)`` in float64 on the host's CPU: the oracle of every value-error figure."""
    import jax
    import numpy as np

    cpu = jax.devices("cpu")[0]
    with jax.enable_x64(True):
        as64 = jax.tree_util.tree_map(lambda a: jax.device_put(np.asarray(a, np.float64), cpu), (params, r))
        return np.asarray(jax.jit(jax.vmap(fn, (None, 0)))(*as64))


def compare_kernels(
    guard: Guard, what: str, dec: Any, hand: Any, params: Any, r: Any, memory: bool, one: Any = None
) -> None:
    """Rows: decorated / hand-written (their max rel diff; ``one``'s error against float64), speed, memory."""
    from harness import rel_diff, temp_bytes

    thunks = {"decorated": lambda: dec(params, r), "hand": lambda: hand(params, r)}
    rat, times, _ = ratio_row(guard, thunks, "decorated", "hand")
    out = dec(params, r)
    diff = rel_diff(out, hand(params, r))
    report, n = guard.report, r.shape[0]
    error = ""
    if one is not None:  # the values the speed row stands for, against float64 on the CPU (the first 512 walkers)
        m = min(n, 512)
        error = f"; against float64 on the CPU: {error_text(out[:m], float64_on_the_cpu(one, params, r[:m]))}"
    report.row(
        8, f"{what}: decorated / hand-written (max rel diff {diff:.1e}{error})", str(rat), "<= 1.02", rat.median <= 1.02
    )
    report.row(8, f"{what}: walkers per second (decorated)", f"{n / median(times['decorated']):,.0f}")
    if memory:
        report.row(
            8, f"{what}: temporary memory per device", f"{temp_bytes(dec.lower(params, r).compile()) / 2**20:,.1f} MiB"
        )


def kernel_rows(guard: Guard, mesh: Any, sizes: Sizes) -> None:
    import sections
    import system
    from harness import decorated_energy, hand_written

    import shardvmc as sv

    for n in sizes.ferminet_walkers:
        n = sv.pad_n_walkers(n, mesh.devices.size)
        cfg = sections.Config(system=system.HE, mesh=mesh, ferminet_walkers=n, ferminet_sizes=sizes.ferminet_net)
        largest = n == sv.pad_n_walkers(max(sizes.ferminet_walkers), mesh.devices.size)
        batches = [None] + ([sizes.ferminet_batch_size] if largest and sizes.ferminet_batch_size else [])
        for batch_size in batches:
            what = (f"FermiNet-style network (Li, sv.hamiltonian's Laplacian), per-walker local energy, {n} walkers, "
                    f"batch_size={batch_size}")  # fmt: skip

            def run(cfg: Any = cfg, batch_size: int | None = batch_size, what: str = what) -> None:
                _, params, r = sections.ferminet_workload(cfg)
                local_energy = library_local_energy()
                dec = sv.walker_parallel(sv.replicated_args("params")(local_energy), mesh=mesh, batch_size=batch_size)
                hand = hand_written(local_energy, mesh, "walker", batch_size)
                compare_kernels(guard, what, dec, hand, params, r, True, one=local_energy)

            guard.row(8, what, run)
    if sizes.o2_walkers:
        n = sv.pad_n_walkers(sizes.o2_walkers, mesh.devices.size)
        for output in ("walker", "mean"):
            what = f"O2 Slater-Jastrow, {'per-walker' if output == 'walker' else 'Mean'} local energy, {n} walkers"

            def run_o2(output: str = output, what: str = what) -> None:
                params = sv.replicate(system.O2.init_params(), mesh)
                r = sv.shard_walker(system.O2.init_walkers(n), mesh)
                dec, hand = (
                    decorated_energy(system.O2, mesh, output),
                    hand_written(system.O2.local_energy, mesh, output),
                )
                compare_kernels(guard, what, dec, hand, params, r, False)

            guard.row(8, what, run_o2)
        # The same O2 as docs/accelerators.md writes it: sv.linalg.slogdet and sv.hamiltonian's Laplacian for the
        # platform (a TPU's XLA has aborted compiling the rows above: folx through jnp.linalg.slogdet).
        what = f"O2 Slater-Jastrow (sv.linalg.slogdet, sv.hamiltonian), per-walker local energy, {n} walkers"

        def run_o2_library(what: str = what) -> None:
            o2, local_energy = system.O2, o2_library_local_energy()
            params = sv.replicate(o2.init_params(), mesh)
            r = sv.shard_walker(o2.init_walkers(n), mesh)
            dec = sv.walker_parallel(sv.replicated_args("params")(local_energy), mesh=mesh)
            compare_kernels(guard, what, dec, hand_written(local_energy, mesh, "walker"), params, r, False,
                            one=local_energy)  # fmt: skip

        guard.row(8, what, run_o2_library)


def o2_library_local_energy() -> Any:
    """The O2 Slater-Jastrow local energy of ONE walker as docs/accelerators.md writes it for a TPU:
    ``sv.linalg.slogdet`` for its determinants, ``sv.hamiltonian``'s Laplacian for the platform."""
    import system

    import shardvmc as sv

    o2 = system.O2
    log_psi = functools.partial(o2.log_psi, slogdet=sv.linalg.slogdet)

    def local_energy(params: Any, r: Any) -> Any:
        return sv.hamiltonian.kinetic_energy(log_psi, params, r) + o2.potential(r)

    return local_energy


def library_local_energy() -> Any:
    """The corpus's FermiNet-style Li network's local energy of ONE walker through ``sv.hamiltonian``.

    (The platform's fastest Laplacian, at float32's accuracy on a TPU: what a user of the library runs.)
    """
    from models import ferminet, hamiltonian, systems

    import shardvmc as sv

    li = systems.LI

    def local_energy(params: Any, r: Any) -> Any:
        kinetic = sv.hamiltonian.kinetic_energy(lambda p, x: ferminet.log_psi(p, x, li), params, r)
        return kinetic + hamiltonian.potential(r, li)

    return local_energy


# ----------------------------------------------------------------------------- 11. local energies against float64


def li_networks(sizes: Sizes) -> dict[str, tuple[Any, ...]]:
    """``{name: (log_psi, potential, params, walkers)}``: the templates' and the corpus's Li networks, float32."""
    import jax
    import jax.numpy as jnp
    from harness import examples_on_path

    import shardvmc as sv

    examples_on_path()
    import network
    from models import ferminet, hamiltonian, systems

    net = sizes.ferminet_net
    n = sizes.error_walkers
    keys = jax.random.split(jax.random.key(1), n)
    walkers = jax.vmap(lambda k: network.init_walker(k, network.LI, jnp.float32))(keys)
    sizes_t = (net["hidden_one"], net["hidden_two"], net["layers"], net["determinants"], jnp.float32)
    template = (
        lambda p, r: network.log_psi(p, r, network.LI),
        lambda r: sv.hamiltonian.coulomb(r, network.LI.charges, network.LI.coords),
        network.init(jax.random.key(10**6), network.LI, *sizes_t),
        walkers,
    )
    corpus = (
        lambda p, r: ferminet.log_psi(p, r, systems.LI),
        lambda r: hamiltonian.potential(r, systems.LI),
        ferminet.init(jax.random.key(0), systems.LI, **net),
        walkers,
    )
    return {"the templates' network (examples/network.py)": template, "the corpus's network (tests/models)": corpus}


def error_rows(guard: Guard, sizes: Sizes) -> None:
    """Local energies in float32 against float64 on the host's CPU: the library's, JAX's defaults, a CPU's."""
    import folx
    import jax
    import numpy as np

    import shardvmc as sv

    for name, network in li_networks(sizes).items():
        what = f"local energy of {name}, Li, initial parameters, {sizes.error_walkers} walkers, against float64"

        def run(network: tuple[Any, ...] = network, what: str = what) -> None:
            log_psi, potential, params, walkers = network

            def plain(p: Any, r: Any) -> Any:  # folx as it comes, at JAX's defaults
                shape = r.shape
                out = folx.forward_laplacian(lambda x: log_psi(p, x.reshape(shape)))(r.reshape(-1))
                return -0.5 * (out.laplacian + (out.jacobian.dense_array**2).sum()) + potential(r)

            device, cpu = jax.devices()[0], jax.devices("cpu")[0]

            def library(dev: Any, p: Any, r: Any, laplacian: str = "auto") -> Any:  # on one device
                mesh = sv.create_mesh([dev])
                on = jax.tree_util.tree_map(lambda a: jax.device_put(a, dev), (p, r))
                return sv.hamiltonian.local_energy(log_psi, potential, mesh=mesh, laplacian=laplacian)(*on)

            with jax.enable_x64(True):
                reference = library(
                    cpu, *jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), (params, walkers))
                )
            platform = device.platform
            plain_on = jax.tree_util.tree_map(lambda a: jax.device_put(a, device), (params, walkers))
            on_device = f"sv.hamiltonian.local_energy, float32 on the {platform}"
            on_cpu = "sv.hamiltonian.local_energy, float32 on the host's CPU"
            figures = {
                on_device: library(device, params, walkers),
                f"folx at JAX's defaults, float32 on the {platform}": jax.jit(jax.vmap(plain, (None, 0)))(*plain_on),
                on_cpu: library(cpu, params, walkers),
            }
            for label, e in figures.items():
                guard.report.row(11, f"{what}: {label}", error_text(e, reference))
            # the goal: no worse than float32 on a CPU by the same algorithm (mean and rms within 2x)
            mine, theirs = error_figures(figures[on_device], reference), error_figures(figures[on_cpu], reference)
            ratios = {k: abs(mine[k]) / max(abs(theirs[k]), 1e-30) for k in ("mean", "rms")}
            guard.report.row(
                11,
                f"{what}: the {platform}'s errors / float32's on the host's CPU, same Laplacian: mean (magnitude), rms",
                f"{ratios['mean']:.2f}, {ratios['rms']:.2f}",
                "<= 2",
                max(ratios.values()) <= 2,
            )

        guard.row(11, what, run)


# ----------------------------------------------------------------------------- 2. dispatch


def dispatch_rows(guard: Guard, mesh: Any, sizes: Sizes) -> None:
    import sections
    import system

    # Its blocks are short, so it takes ten times the repetitions of the other rows.
    options: dict[str, Any] = {"reps": 10 * sizes.reps, "tiny_calls": sizes.tiny_calls}
    if sizes.tiny_walkers is not None:
        options.update(tiny_walkers=sizes.tiny_walkers)
    cfg = sections.Config(system=system.HE, mesh=mesh, **options)
    guard.row(
        2, f"dispatch of a small kernel ({cfg.tiny_walkers} walkers)", lambda: sections.call_overhead(cfg, guard.report)
    )


# ----------------------------------------------------------------------------- 9. natural gradient


# XLA's Cholesky compiles in minutes on a TPU above this many rows (6.8 s at 2,048, 17.6 s at 4,096, 51.7 s at 8,192,
# over 150 s at 16,384 on a v5e): there the hand-written minSR and SPRING solve the same system by CG on its P x P form.
TPU_CHOLESKY_ROWS = 4096


def hand_written_solver(
    method: str, damping: float, momentum: float, tol: float, maxiter: int, *, by_cg: bool = False
) -> Callable[..., Any]:
    """The same system as ``sv.natural_gradient(method=...)``, solved the plain jnp way under ``jax.jit``.

    ``by_cg``: minSR and SPRING's ``Jc^T (Jc Jc^T + damping)^-1 r`` as ``(Jc^T Jc + damping)^-1 Jc^T r``, by CG
    (the same vector, without the N x N matrix).
    """
    import jax
    import jax.numpy as jnp

    def centred(j: jax.Array, e: jax.Array) -> tuple[jax.Array, jax.Array]:
        scale = jax.lax.rsqrt(jnp.asarray(j.shape[0], j.dtype))
        return (j - j.mean(0)) * scale, (e - e.mean()) * scale

    def cholesky_solve(a: jax.Array, b: jax.Array) -> jax.Array:
        return jax.scipy.linalg.cho_solve((jnp.linalg.cholesky(a), True), b)

    def solve(j: jax.Array, e: jax.Array, previous: jax.Array) -> jax.Array:
        with jax.default_matmul_precision("highest"):  # as sv.natural_gradient's (a TPU's default is one bf16 pass)
            return solve_at_highest(j, e, previous)

    def solve_at_highest(j: jax.Array, e: jax.Array, previous: jax.Array) -> jax.Array:
        jc, ec = centred(j, e)
        if method == "dense":
            return cholesky_solve(jc.T @ jc + damping * jnp.eye(j.shape[1], dtype=j.dtype), jc.T @ ec)
        matvec = lambda v: jc.T @ (jc @ v) + damping * v  # noqa: E731
        if method == "cg":
            return jax.scipy.sparse.linalg.cg(matvec, jc.T @ ec, tol=tol, maxiter=maxiter)[0]
        mu = momentum if method == "spring" else 0.0
        if by_cg:
            return (
                jax.scipy.sparse.linalg.cg(matvec, jc.T @ (ec - mu * (jc @ previous)), tol=tol, maxiter=maxiter)[0]
                + mu * previous
            )
        t = jc @ jc.T + damping * jnp.eye(j.shape[0], dtype=j.dtype)
        return jc.T @ cholesky_solve(t, ec - mu * (jc @ previous)) + mu * previous

    return jax.jit(solve)


def solver_rows(guard: Guard, mesh: Any, sizes: Sizes) -> None:
    import jax
    import jax.numpy as jnp
    from harness import rel_diff

    import shardvmc as sv

    damping, momentum, tol, maxiter = 1e-3, 0.9, 1e-6, 200
    report = guard.report
    # the dense solve holds about five P x P matrices (S, its factor, the hand-written solve's, temporaries): 19.2 GB
    # at P = 32,000 on a TPU, whose limit reads 16 GiB
    dense_limit = (device_bytes() or 2**35) / 5
    for label, n, p, dtype_name in sizes.solvers:
        if dtype_name == "auto":  # the platform's: float64 where it has it, float32 on a TPU
            dtype_name = sv.precision_policy(mesh=mesh).dtype.name
        x64 = dtype_name == "float64"
        dtype = jnp.float64 if x64 else jnp.float32
        data: dict[str, Any] = {}

        def make(n: int = n, p: int = p, dtype: Any = dtype, x64: bool = x64, data: dict = data) -> None:
            with jax.enable_x64(x64):
                keys = jax.random.split(jax.random.key(3), 3)
                j = jax.random.normal(keys[0], (n, p), dtype)
                e = jax.random.normal(keys[1], (n,), dtype)
                data["j"], data["e"] = sv.shard_walker((j, e), mesh)
                data["previous"] = sv.replicate(1e-3 * jax.random.normal(keys[2], (p,), dtype), mesh)

        first = len(report.rows)
        guard.row(9, f"natural gradient, {label}: the data (N={n}, P={p}, {dtype_name})", make)
        if len(report.rows) > first:  # making it failed (here or in an earlier process): its row says how
            continue
        for method in ("dense", "minsr", "spring", "cg"):
            what = f"natural gradient, {label} (N={n}, P={p:,}, {dtype_name}): {method}"
            gram = p * p * jnp.dtype(dtype).itemsize
            if method == "dense" and gram > dense_limit:  # S, its Cholesky factor and the hand-written solve's
                report.row(9, what, f"left out: its P x P matrix alone is {gram / 2**30:.1f} GiB, over a fifth of "
                                    f"the device's memory")  # fmt: skip
                continue

            def run(method: str = method, what: str = what, x64: bool = x64, data: dict = data, n: int = n) -> None:
                spring = method == "spring"

                def ours(j: jax.Array, e: jax.Array, previous: jax.Array) -> jax.Array:
                    return sv.natural_gradient(
                        j,
                        e,
                        damping=damping,
                        method=method,
                        momentum=momentum if spring else 0.0,
                        previous=previous if spring else None,
                        tol=tol,
                        maxiter=maxiter,
                        mesh=mesh,
                    )[0]

                if not data:  # a new process, after a row that ended the last one: the data row is in the journal
                    make()
                ours = jax.jit(ours)
                by_cg = method in ("minsr", "spring") and n > TPU_CHOLESKY_ROWS and jax.default_backend() == "tpu"
                hand = hand_written_solver(method, damping, momentum, tol, maxiter, by_cg=by_cg)
                reference = "hand-written jax.jit CG on the P x P system" if by_cg else "hand-written jax.jit solve"
                args = (data["j"], data["e"], data["previous"])
                with jax.enable_x64(x64):
                    thunks = {"shardvmc": lambda: ours(*args), "hand": lambda: hand(*args)}
                    rat, times, compile_seconds = ratio_row(guard, thunks, "shardvmc", "hand")
                    diff = rel_diff(ours(*args), hand(*args))
                report.row(
                    9,
                    f"{what}: sv.natural_gradient / {reference} (max rel diff {diff:.1e}; "
                    f"{1e3 * median(times['shardvmc']):.1f} ms per call, compiled in {compile_seconds:.0f} s)",
                    str(rat),
                )

            guard.row(9, what, run)
        data.clear()  # free J before the next size


# ----------------------------------------------------------------------------- 10. the neural step


def evaluation_step(neural: Any, config: Any, mesh: Any) -> Callable[..., Any]:
    """One step of ``sv.driver.expect``'s evaluation: moves at fixed parameters, then every walker's local energy."""
    import jax
    import jax.numpy as jnp

    import shardvmc as sv

    sampler = neural.make_sampler(config, mesh)
    energy_of_one = neural.energy_of(config.system)

    @sv.walker_parallel(mesh=mesh, batch_size=config.batch_size)
    def energy(params: sv.Replicated[Any], r: sv.PerWalker[jax.Array]) -> sv.Mean[jax.Array]:
        return energy_of_one(params, r)

    @jax.jit
    def evaluate(state: Any, key: jax.Array) -> tuple[Any, jax.Array]:
        walkers = sampler.step(state.params, state.sampler, key, refresh=False)
        return state._replace(sampler=walkers), jnp.stack([energy(state.params, walkers.positions), walkers.acceptance])

    return evaluate


def neural_rows(guard: Guard, mesh: Any, sizes: Sizes, optimiser: str) -> None:
    """The neural workload's optimisation and evaluation steps, timed, and their memory."""
    import jax
    from harness import neural_example
    from jax.flatten_util import ravel_pytree

    import shardvmc as sv

    neural = neural_example()
    base = neural.Config(**neural.QUICK) if sizes.neural_quick else neural.Config()
    report = guard.report
    for n in sizes.neural_walkers:
        config = dataclasses.replace(base, walkers=n, optimiser=optimiser)
        policy = sv.precision_policy(config.dtype, mesh=mesh)
        what = f"neural {config.system} step ({optimiser}, {policy.dtype.name}), {n} walkers"

        def run(config: Any = config, n: int = n, what: str = what, policy: Any = policy) -> None:
            with policy.context(), sv.use_mesh(mesh):
                steps = neural.make_steps(config, mesh)
                state = neural.initial_state(config, mesh, steps)  # includes the burn-in's moves
                n_params = int(ravel_pytree(state.params)[0].size)
                evaluate = evaluation_step(neural, config, mesh)
                for name, step, extra in (("optimisation", steps.train, ()), ("evaluation", evaluate, ())):
                    if name not in sizes.neural_steps:
                        continue
                    start = time.perf_counter()
                    step = step.lower(state, jax.random.key(1), *extra).compile()  # called as compiled
                    mem = step.memory_analysis()
                    per_device = (
                        mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
                    ) / 2**20
                    jax.block_until_ready(step(state, jax.random.key(1), *extra))
                    first = time.perf_counter() - start
                    start = time.perf_counter()
                    jax.block_until_ready(step(state, jax.random.key(2), *extra))
                    times = []
                    for rep in range(guard.reps(time.perf_counter() - start)):
                        start = time.perf_counter()
                        jax.block_until_ready(step(state, jax.random.key(rep + 3), *extra))
                        times.append(time.perf_counter() - start)
                    step_s = median(times)
                    label = f"{what}, {name} step ({n_params} parameters, {config.sweeps} moves per step)"
                    report.row(
                        10, f"{label}: walkers per second", f"{n / step_s:,.0f} ({1e3 * step_s:.1f} ms per step)"
                    )
                    report.row(
                        10,
                        f"{label}: memory per device (compiled); compile and first call",
                        f"{per_device:,.1f} MiB; {first:.0f} s",
                    )

        guard.row(10, what, run)


# ----------------------------------------------------------------------------- 12. trained parameters


def sampled_walkers(sampler: Any, params: Any, state: Any, calls: int) -> Any:
    """The walkers of ``calls`` sampler calls from ``state`` at ``params`` (|psi|^2's samples), on the host."""
    import jax
    import numpy as np

    positions = []
    for i in range(calls):
        state = sampler.step(params, state, jax.random.key(10**4 + i))
        positions.append(np.asarray(state.positions.valid().data))
    return np.concatenate(positions)


def trained_error_row(guard: Guard, what: str, one: Any, params: Any, walkers: Any) -> None:
    """Rows: the evaluation's mean local energy in float32 (platform, host CPU) against float64 on the same walkers."""
    import jax
    import numpy as np

    params = jax.device_get(params)
    device, cpu = jax.devices()[0], jax.devices("cpu")[0]
    f = jax.jit(jax.vmap(one, (None, 0)))
    reference = float64_on_the_cpu(one, params, walkers)
    sem = reference.std() / np.sqrt(reference.size)
    for label, dev in ((f"float32 on the {device.platform}", device), ("float32 on the host's CPU", cpu)):
        e = np.asarray(f(*jax.device_put((params, walkers), dev)), np.float64)
        gap = float(e.mean() - reference.mean())
        guard.report.row(
            12,
            f"{what}, {reference.size} walkers sampled at them: {label}",
            f"mean energy {gap:+.1e} Ha off float64's ({reference.mean():.5f} +- {sem:.5f}); per walker "
            + error_text(e, reference),
            "within 1e-4 Ha",
            abs(gap) <= 1e-4,
        )


def trained_rows(guard: Guard, mesh: Any, sizes: Sizes) -> None:
    """Local energies at trained parameters, on walkers sampled from |psi|^2, against float64 on the host's CPU."""
    import jax
    import optax
    from harness import neural_example

    import shardvmc as sv
    import shardvmc.optax as svx

    neural = neural_example()
    config = neural.Config(**neural.QUICK) if sizes.neural_quick else neural.Config()
    what = f"the templates' network trained by examples/neural_vmc.py ({config.steps} steps of {config.walkers})"

    def template() -> None:
        with sv.precision_policy(config.dtype, mesh=mesh).context(), sv.use_mesh(mesh):
            state = neural.train(config, mesh).state
            walkers = sampled_walkers(neural.make_sampler(config, mesh), state.params, state.sampler,
                                      sizes.trained_samples)  # fmt: skip
        trained_error_row(guard, what, neural.energy_of(config.system), state.params, walkers)

    guard.row(12, what, template)
    steps = sizes.trained_corpus_steps
    what = f"the corpus's network (tests/models) trained by sv.driver.VMC (minSR, {steps} steps of 512)"

    def corpus() -> None:
        from models import ferminet, hamiltonian, systems

        li = systems.LI
        log_psi = lambda p, r: ferminet.log_psi(p, r, li)  # noqa: E731
        potential = lambda r: hamiltonian.potential(r, li)  # noqa: E731
        schedule = lambda t: 0.5 / (1.0 + t / 2000.0)  # noqa: E731  # the template's recipe
        opt = optax.chain(svx.natural_gradient(damping=1e-2, method="minsr"),
                          svx.clip_by_fisher_norm(0.005, schedule), optax.scale_by_learning_rate(schedule))  # fmt: skip
        dtype = sv.precision_policy("auto", mesh=mesh).dtype
        params = jax.tree_util.tree_map(lambda a: a.astype(dtype),
                                        ferminet.init(jax.random.key(0), li, **sizes.ferminet_net))  # fmt: skip
        with sv.precision_policy("auto", mesh=mesh).context(), sv.use_mesh(mesh):
            vmc = sv.driver.VMC(log_psi, opt, potential, clipping=sv.loss.ClipMAD(5.0), mesh=mesh)
            walkers = sv.initialize_walkers_sharded(lambda k: systems.init_walkers(k, li, 1)[0].astype(dtype), 512,
                                                    mesh, key=jax.random.key(1))  # fmt: skip
            state = vmc.init(params, walkers)
            step = jax.jit(vmc.step)
            for i in range(steps):
                state, _ = step(state, jax.random.fold_in(jax.random.key(2), i))
            walkers = sampled_walkers(sv.mcmc.Metropolis(log_psi, n_steps=20, mesh=mesh), state.params,
                                      state.sampler, sizes.trained_samples)  # fmt: skip
        one = lambda p, r: sv.hamiltonian.kinetic_energy(log_psi, p, r) + potential(r)  # noqa: E731
        trained_error_row(guard, what, one, state.params, walkers)

    guard.row(12, what, corpus)


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if not (args.journal or args.in_process):  # the parent: it never opens the accelerator (one process holds it)
        return supervise(argv, args)
    here = os.path.dirname(os.path.abspath(__file__))
    # tests/: the model corpus (tests/models) of section 8; harness.neural_example puts examples/ on the path itself.
    sys.path[:0] = [here, os.path.join(os.path.dirname(here), "tests"), os.path.dirname(here)]
    cpu_devices = args.cpu_devices or (8 if args.smoke else 0)
    if cpu_devices:
        from shardvmc.testing import set_cpu_devices

        set_cpu_devices(cpu_devices)
        os.environ["JAX_PLATFORMS"] = "cpu"
    import tempfile

    import jax
    from sections import Report, machine

    import shardvmc as sv

    # A compilation cache for this run only: the memory rows lower and compile again programs the timing
    # compiled, and the cache turns those second compilations into reads.
    cache = tempfile.TemporaryDirectory(prefix="shardvmc-gpu-bench-")
    jax.config.update("jax_compilation_cache_dir", cache.name)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    accelerator = jax.default_backend() != "cpu"
    smoke = args.smoke or not accelerator
    sizes = sizes_for(args, smoke)
    mesh = sv.create_mesh()
    info: dict[str, Any] = machine()
    info["mesh"] = dict(mesh.shape)
    visible = [a for a, b in zip(argv, [""] + argv) if not (a.startswith("--journal") or a.startswith("--started-at")
               or b in ("--journal", "--started-at"))]  # fmt: skip
    command = "python benchmarks/gpu.py " + " ".join(visible)
    print("shardvmc gpu benchmark:", ", ".join(f"{k}={v}" for k, v in info.items()), flush=True)
    if smoke:
        print("NOTE: smoke run (no accelerator or --smoke): tiny sizes that only check that the script works.")
    report = Report()

    def write(note: str = "") -> None:
        text = report.table()
        if args.out:
            with open(args.out, "w") as f:
                f.write(f"`{command.strip()}`\n\n{', '.join(f'{k}={v}' for k, v in info.items())}\n\n")
                f.write("Ratios: median over repetitions [25 %, 75 % quartiles].\n\n" + text + "\n")
                if note:
                    f.write(f"\n{note}\n")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"machine": info, "rows": report.rows, "facts": report.facts, "note": note}, f, default=str)

    guard = Guard(report, sizes, lambda note: (print(report.table(), flush=True), write(note)), args.journal,
                  args.started_at, args.abort_in, args.hang_in)  # fmt: skip
    chosen = args.only.split(",")
    if "errors" in chosen:
        error_rows(guard, sizes)
    if "kernels" in chosen:
        kernel_rows(guard, mesh, sizes)
    if "dispatch" in chosen:
        dispatch_rows(guard, mesh, sizes)
    if "solvers" in chosen:
        solver_rows(guard, mesh, sizes)
    if "neural" in chosen:
        neural_rows(guard, mesh, sizes, args.neural_optimiser)
    if "trained" in chosen:
        trained_rows(guard, mesh, sizes)
    guard.watchdog.cancel()
    info["seconds"] = round(guard.elapsed(), 1)
    info["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    print()
    print(f"{command.strip()}: {info['seconds']} s. Ratios: median over repetitions [25 %, 75 % quartiles].")
    print(report.table())
    write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
