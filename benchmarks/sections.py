"""The measurements of ``run.py``, one function per section of the table.

Each section appends rows to a :class:`Report` and records the facts the test checks
(collective counts, memory, compile counts, agreement with the hand-written kernels)
in ``report.facts``. Import this module only after the device count is set.
"""

import collections
import contextvars
import dataclasses
import datetime
import os
import platform
import re
import time
import warnings
from typing import Any

import folx
import jax
import jax.numpy as jnp
import numpy as np
from harness import (
    AXIS,
    count_collectives,
    decorated_energy,
    fmt_collectives,
    hand_written,
    interleaved,
    ratio,
    rel_diff,
    temp_bytes,
)
from jax.flatten_util import ravel_pytree
from jax.sharding import PartitionSpec as P
from system import System

import shardvmc as sv

_OPCODE = re.compile(r"\b([a-z][a-z0-9\-]*)\(")


@dataclasses.dataclass
class Config:
    """Sizes of one run (defaults: the full run the issue asks for)."""

    system: System
    mesh: Any
    walkers: int = 2048
    reps: int = 31
    tiny_walkers: int = 2048
    tiny_calls: int = 200
    batch_size: int = 64
    memory_walkers: int = 4096
    memory_batches: tuple[int | None, ...] = (None, 64, 16)
    pad_walkers: int = 4096
    loop_walkers: int = 2048
    loop_steps: int = 200
    energy_every: int = 10
    ferminet_walkers: int = 512
    ferminet_sizes: dict[str, int] = dataclasses.field(
        default_factory=lambda: {"hidden_one": 32, "hidden_two": 8, "layers": 2, "determinants": 4}
    )
    _memo: dict[Any, Any] = dataclasses.field(default_factory=dict, repr=False)

    def energy(self, output: str = "walker", batch_size: int | None = None) -> Any:
        """The decorated local energy, one object per (output, batch_size) so it compiles once per shape."""
        key = ("energy", output, batch_size)
        if key not in self._memo:
            self._memo[key] = decorated_energy(self.system, self.mesh, output, batch_size)
        return self._memo[key]

    def params(self) -> Any:
        """The trial-function parameters, replicated over the mesh."""
        if "params" not in self._memo:
            self._memo["params"] = sv.replicate(self.system.init_params(), self.mesh)
        return self._memo["params"]

    def walker_set(self, n: int) -> jax.Array:
        """``n`` walkers sharded over the mesh."""
        if ("walkers", n) not in self._memo:
            self._memo[("walkers", n)] = sv.shard_walker(self.system.init_walkers(n), self.mesh)
        return self._memo[("walkers", n)]


@dataclasses.dataclass
class Report:
    """The rows of the table and the facts behind them."""

    rows: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    facts: dict[str, Any] = dataclasses.field(default_factory=dict)

    def row(self, section: int, what: str, figure: str, goal: str = "", met: bool | None = None) -> None:
        self.rows.append({"section": section, "what": what, "figure": figure, "goal": goal, "met": met})
        print(f"  [{section}] {what}: {figure}" + (f"  (goal {goal}: {'met' if met else 'MISSED'})" if goal else ""))

    def table(self) -> str:
        lines = ["| # | measurement | figure | goal | met |", "|---|---|---|---|---|"]
        for r in self.rows:
            met = "" if r["met"] is None else ("yes" if r["met"] else "**no**")
            lines.append(f"| {r['section']} | {r['what']} | {r['figure']} | {r['goal']} | {met} |")
        return "\n".join(lines)


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    devices = jax.devices()
    return {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "python": platform.python_version(),
        "jax": jax.__version__,
        "folx": getattr(folx, "__version__", "?"),
        "shardvmc": sv.__version__,
        "devices": f"{len(devices)} x {devices[0].device_kind} ({devices[0].platform})",
    }


def compiled(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """The compiled program of ``fn(*args)``: its own ``lower`` when it has one (then a call before is reused)."""
    lower = getattr(fn, "lower", None) or jax.jit(fn).lower
    return lower(*args, **kwargs).compile()


def _ops(compiled: Any) -> collections.Counter[str]:
    """The multiset of HLO opcodes of a compiled program (names and metadata ignored)."""
    ops: collections.Counter[str] = collections.Counter()
    for line in compiled.as_text().splitlines():
        if " = " in line:
            match = _OPCODE.search(line.split(" = ", 1)[1])
            if match:
                ops[match.group(1)] += 1
    return ops


# ------------------------------------------------------------------------------------------------
# 1. kernel cost


def kernel_cost(cfg: Config, report: Report) -> None:
    """Decorated local energy vs the hand-written jit(shard_map(vmap)), per-walker and Mean outputs.

    Two workloads: the Slater-Jastrow system of the run, and a FermiNet-style network of the
    model corpus (``tests/models``; Li, folx forward Laplacian), the code researchers write.
    """
    params, r = cfg.params(), cfg.walker_set(cfg.walkers)
    for output in ("walker", "mean"):
        _compare_kernels(
            cfg,
            report,
            f"local energy, {'per-walker' if output == 'walker' else 'Mean'} output, {cfg.walkers} walkers",
            f"kernel_{output}",
            cfg.energy(output),
            hand_written(cfg.system.local_energy, cfg.mesh, output),
            params,
            r,
        )
    local_energy, ferminet_params, ferminet_walkers = ferminet_workload(cfg)
    _compare_kernels(
        cfg,
        report,
        f"FermiNet-style network (Li, {ravel_pytree(ferminet_params)[0].size} parameters, folx), per-walker "
        f"output, {cfg.ferminet_walkers} walkers",
        "kernel_ferminet",
        sv.walker_parallel(sv.replicated_args("params")(local_energy), mesh=cfg.mesh),
        hand_written(local_energy, cfg.mesh, "walker"),
        ferminet_params,
        ferminet_walkers,
    )


def ferminet_workload(cfg: Config) -> tuple[Any, Any, Any]:
    """The corpus's FermiNet-style network for Li: ``(local_energy(params, r), params, walkers)``."""
    from models import ferminet, hamiltonian, systems

    li = systems.LI
    params = ferminet.init(jax.random.key(0), li, **cfg.ferminet_sizes)
    local_energy = hamiltonian.make_local_energy(lambda p, x: ferminet.log_psi(p, x, li), li, "folx")
    walkers = sv.shard_walker(systems.init_walkers(jax.random.key(1), li, cfg.ferminet_walkers), cfg.mesh)
    return local_energy, sv.replicate(params, cfg.mesh), walkers


def _compare_kernels(
    cfg: Config, report: Report, what: str, fact: str, dec: Any, hand: Any, params: Any, r: Any
) -> None:
    diff = rel_diff(dec(params, r), hand(params, r))
    same = _ops(compiled(dec, params, r)) == _ops(compiled(hand, params, r))
    times = interleaved({"decorated": lambda: dec(params, r), "hand": lambda: hand(params, r)}, cfg.reps)
    rat = ratio(times, "decorated", "hand")
    report.facts[fact] = {"rel_diff": diff, "same_hlo_ops": same, "ratio": rat.median}
    report.row(
        1,
        f"{what}: decorated / hand-written jit(shard_map(vmap)) (same HLO ops: {'yes' if same else 'no'})",
        str(rat),
        "<= 1.02",
        rat.median <= 1.02,
    )


# ------------------------------------------------------------------------------------------------
# 2. call overhead


def call_overhead(cfg: Config, report: Report) -> None:
    """A tiny kernel, where the time of a call is dispatch: decorated vs the jitted hand-written one."""
    mesh, n = cfg.mesh, cfg.tiny_walkers

    def one(alpha: jax.Array, r: jax.Array) -> jax.Array:
        return alpha * jnp.sum(r**2)

    @sv.walker_parallel(mesh=mesh)
    def tiny(alpha: sv.Replicated[jax.Array], r: sv.PerWalker[jax.Array]) -> sv.PerWalker[jax.Array]:
        return one(alpha, r)

    @sv.walker_parallel(mesh=mesh)
    def tiny_mean(alpha: sv.Replicated[jax.Array], r: sv.PerWalker[jax.Array]) -> sv.Mean[jax.Array]:
        return one(alpha, r)

    def masked_mean(alpha: jax.Array, r: jax.Array, n_valid: jax.Array) -> jax.Array:
        index = jax.lax.axis_index(AXIS) * r.shape[0] + jnp.arange(r.shape[0])
        e = jax.vmap(one, (None, 0))(alpha, r)
        return jax.lax.psum(jnp.sum(jnp.where(index < n_valid, e, 0.0)), AXIS) / n_valid

    hand = hand_written(one, mesh)
    hand_mean = jax.jit(
        jax.shard_map(masked_mean, mesh=mesh, in_specs=(P(), P(AXIS), P()), out_specs=P(), check_vma=False)
    )
    pc = time.perf_counter_ns

    def hand_after_python(microseconds: float) -> jax.Array:
        end = pc() + int(microseconds * 1000)  # stands in for a wrapper's Python work
        while pc() < end:
            pass
        return hand(alpha, r)

    class Forward:
        """The least a Python wrapper can do: a class whose __call__ forwards to the jitted function."""

        def __call__(self, *args: Any) -> Any:
            return hand(*args)

    read = contextvars.ContextVar("read", default=None)

    class ForwardAfterRead:
        """A forwarding class that first reads one context variable (about 0.03 us), as a kernel reads its context."""

        def __call__(self, *args: Any) -> Any:
            if read.get() is not None:
                raise AssertionError
            return hand(*args)

    forward, forward_read = Forward(), ForwardAfterRead()
    alpha = sv.replicate(jnp.float32(0.5), mesh)
    r = sv.shard_walker(np.ones((n, 3), np.float32), mesh)
    report.facts["tiny_rel_diff"] = max(
        rel_diff(tiny(alpha, r), hand(alpha, r)),
        rel_diff(tiny_mean(alpha, r, n_valid=n - 1), hand_mean(alpha, r, n - 1)),
    )
    thunks = {
        "decorated": lambda: tiny(alpha, r),
        "hand": lambda: hand(alpha, r),
        "decorated_n_valid": lambda: tiny_mean(alpha, r, n_valid=n - 1),
        "hand_n_valid": lambda: hand_mean(alpha, r, n - 1),
        "hand_2us": lambda: hand_after_python(2.0),
        "hand_forwarded": lambda: forward(alpha, r),
        "hand_forwarded_read": lambda: forward_read(alpha, r),
    }
    waited = interleaved(
        {k: (lambda f=f: f().block_until_ready()) for k, f in thunks.items()}, cfg.reps, cfg.tiny_calls
    )
    # Only kernels without collectives are queued: on fake CPU devices a deep queue of programs with an
    # all-reduce can deadlock XLA's rendezvous (seen here: 7 of 8 device threads arrived, abort after 40 s).
    no_collectives = ("decorated", "hand", "hand_2us", "hand_forwarded", "hand_forwarded_read")
    queued = interleaved({k: thunks[k] for k in no_collectives}, cfg.reps, cfg.tiny_calls)
    for a, b, what, goal in (
        ("decorated", "hand", "decorated / jitted hand-written", "<= 1.05"),
        ("decorated_n_valid", "hand_n_valid", "Mean, n_valid=: decorated / jitted hand-written masked mean", "<= 1.05"),
        ("hand_2us", "hand", "calibration: hand-written after 2 us of Python busy-wait / hand-written", ""),
        ("hand_forwarded", "hand", "calibration: hand-written behind a forwarding Python class / hand-written", ""),
        ("hand_forwarded_read", "hand_forwarded", "calibration: it, after reading a context variable / without", ""),
    ):
        for mode, times in (("each call waited for", waited), ("calls queued, wait for the last", queued)):
            if a not in times:
                continue
            rat = ratio(times, a, b)
            report.facts[f"overhead {a}/{b}, {mode}"] = rat.median
            report.row(
                2,
                f"tiny kernel, {n} walkers, {mode} ({cfg.tiny_calls} calls per repetition): {what}",
                str(rat),
                goal,
                rat.median <= 1.05 if goal else None,
            )


# ------------------------------------------------------------------------------------------------
# 3. against the pytc pattern


def pytc_pattern(cfg: Config, report: Report) -> None:
    """jax.jit(jax.vmap(f)) and jax.jit(folx.batched_vmap(f)) on sharded inputs; sv.sharded_batched_vmap."""
    S, mesh, bs = cfg.system, cfg.mesh, cfg.batch_size
    params, r = cfg.params(), cfg.walker_set(cfg.walkers)
    dec = cfg.energy()
    dec_b = cfg.energy(batch_size=bs)
    pytc = jax.jit(jax.vmap(S.local_energy, (None, 0)))
    pytc_b = jax.jit(folx.batched_vmap(S.local_energy, bs, (None, 0)))
    sbv = sv.sharded_batched_vmap(S.local_energy, bs, mesh=mesh, in_axes=(None, 0))
    kernels = {"decorated": dec, "pytc_vmap": pytc, "decorated_b": dec_b, "sharded_batched_vmap": sbv, "pytc_b": pytc_b}
    ref = np.asarray(dec(params, r))
    comm, specs = {}, {}
    for name, f in kernels.items():
        out = f(params, r)
        report.facts.setdefault("pytc_rel_diff", {})[name] = rel_diff(out, ref)
        specs[name] = str(out.sharding.spec) if hasattr(out.sharding, "spec") else str(out.sharding)
        comm[name] = count_collectives(compiled(f, params, r))
    report.facts["collectives_pytc"] = comm
    report.facts["output_spec_pytc"] = specs
    times = interleaved({name: (lambda f=f: f(params, r)) for name, f in kernels.items()}, cfg.reps)
    for a, b, label in (
        ("decorated", "pytc_vmap", "decorated / pytc jax.jit(jax.vmap(f)) on sharded inputs"),
        ("decorated_b", "sharded_batched_vmap", f"decorated(batch_size={bs}) / sv.sharded_batched_vmap(f, {bs})"),
        ("decorated_b", "pytc_b", f"decorated(batch_size={bs}) / pytc jax.jit(folx.batched_vmap(f, {bs}))"),
    ):
        report.row(3, f"local energy, {cfg.walkers} walkers: {label}", str(ratio(times, a, b)))
    for name, label in (
        ("decorated", "decorated"),
        ("pytc_vmap", "jax.jit(jax.vmap(f))"),
        ("decorated_b", f"decorated(batch_size={bs})"),
        ("sharded_batched_vmap", "sv.sharded_batched_vmap"),
        ("pytc_b", "jax.jit(folx.batched_vmap(f))"),
    ):
        report.row(3, f"collectives of {label}; output sharding {specs[name]}", fmt_collectives(comm[name]))


# ------------------------------------------------------------------------------------------------
# 4. communication


def communication(cfg: Config, report: Report) -> None:
    """Collectives in the compiled HLO for per-walker, Mean, Sum and jtj outputs (and pytc equivalents)."""
    S, mesh = cfg.system, cfg.mesh
    params, r = cfg.params(), cfg.walker_set(cfg.walkers)

    @sv.walker_parallel(mesh=mesh)
    def grad_sum(params: sv.Replicated[dict], r: sv.PerWalker[jax.Array]) -> sv.Sum[dict]:
        return jax.grad(S.log_psi)(params, r)

    @sv.walker_parallel(mesh=mesh)
    def jacobian(params: sv.Replicated[dict], r: sv.PerWalker[jax.Array]) -> sv.PerWalker[jax.Array]:
        return ravel_pytree(jax.grad(S.log_psi)(params, r))[0]

    @sv.walker_parallel(mesh=mesh)
    def energy_and_mean(
        params: sv.Replicated[dict], r: sv.PerWalker[jax.Array]
    ) -> tuple[sv.PerWalker[jax.Array], sv.Mean[jax.Array]]:
        e = S.local_energy(params, r)
        return e, e

    jac = jacobian(params, r)
    host_jac = np.asarray(jac, np.float64)
    unsharded_grads = jax.jit(jax.vmap(jax.grad(S.log_psi), (None, 0)))(S.init_params(), jnp.asarray(np.asarray(r)))
    # Per-walker gradients with respect to replicated parameters: wrong by the device count without the cast.
    report.facts["jacobian_rel_diff"] = rel_diff(jac, jax.vmap(lambda g: ravel_pytree(g)[0])(unsharded_grads))
    report.facts["grad_sum_rel_diff"] = rel_diff(
        grad_sum(params, r),
        jax.tree_util.tree_map(lambda g: np.sum(np.asarray(g, np.float64), axis=0), unsharded_grads),
    )
    report.facts["jtj_rel_diff"] = rel_diff(sv.jtj(jac), host_jac.T @ host_jac)
    cases = {
        "per-walker local energy (decorated)": cfg.energy().lower(params, r),
        "Mean local energy (decorated)": cfg.energy("mean").lower(params, r),
        "(PerWalker, Mean) local energy (decorated)": energy_and_mean.lower(params, r),
        f"Sum of d log psi / d params, {len(jax.tree_util.tree_leaves(params))} leaves (decorated)": grad_sum.lower(
            params, r
        ),
        f"per-walker Jacobian J, {jac.shape[1]} params (decorated)": jacobian.lower(params, r),
        "sv.jtj(J)": jax.jit(sv.jtj).lower(jac),
        "pytc: jax.jit(mean(jax.vmap(f)))": jax.jit(
            lambda p, x: jnp.mean(jax.vmap(S.local_energy, (None, 0))(p, x))
        ).lower(params, r),
        "pytc: jax.jit(J.T @ J) on sharded J": jax.jit(lambda j: j.T @ j).lower(jac),
    }
    comm = {name: count_collectives(lowered.compile()) for name, lowered in cases.items()}
    report.facts["collectives"] = comm
    for name, counts in comm.items():
        if name.startswith("pytc"):
            goal, met = "", None
        elif name.startswith("per-walker"):
            goal, met = "none", sum(counts.values()) == 0
        else:
            goal = "all-reduce only"
            met = counts["all-reduce"] >= 1 and sum(counts.values()) == counts["all-reduce"]
        report.row(4, f"collectives: {name}", fmt_collectives(counts), goal, met)


# ------------------------------------------------------------------------------------------------
# 5. memory


def memory(cfg: Config, report: Report) -> None:
    """Compiled temporary bytes per device of the local energy for several batch sizes (compiled, never run)."""
    params, r = cfg.params(), cfg.walker_set(cfg.memory_walkers)
    size = cfg.mesh.shape[AXIS]
    sizes = {}
    for bs in cfg.memory_batches:
        sizes[bs] = temp_bytes(cfg.energy(batch_size=bs).lower(params, r).compile())
    report.facts["memory"] = {str(k): v for k, v in sizes.items()}
    base = sizes[cfg.memory_batches[0]]
    for bs, b in sizes.items():
        rel = b / base
        goal, met = ("<= 1/8 of unbatched", rel <= 1 / 8) if bs == min(k for k in sizes if k) else ("", None)
        report.row(
            5,
            f"temporary bytes per device, {cfg.memory_walkers} walkers ({cfg.memory_walkers // size} per device), "
            f"batch_size={bs}",
            f"{b / 2**20:.2f} MiB = {rel:.3f} of unbatched",
            goal,
            met,
        )


# ------------------------------------------------------------------------------------------------
# 6. padding


def padding(cfg: Config, report: Report) -> None:
    """A walker count the mesh does not divide: internal padding vs a persistent padded set with n_valid."""
    S, mesh, bs, n = cfg.system, cfg.mesh, cfg.batch_size, cfg.pad_walkers
    params = cfg.params()
    host = S.init_walkers(n)
    full = sv.shard_walker(host, mesh)
    short = jax.device_put(host[: n - 1], sv.get_replicated_sharding(mesh))  # cannot be sharded evenly
    padded, n_valid = sv.pad_walker(host[: n - 1], n)
    padded = sv.shard_walker(padded, mesh)
    mean = cfg.energy("mean", batch_size=bs)
    per_walker = cfg.energy(batch_size=bs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", sv.PaddingWarning)
        thunks = {
            "full": lambda: mean(params, full),
            "internal": lambda: mean(params, short),
            "persistent": lambda: mean(params, padded, n_valid=n_valid),
        }
        values = {k: float(f()) for k, f in thunks.items()}
        reference = float(np.mean(np.asarray(per_walker(params, full), np.float64)[: n - 1]))
        comm = {
            f"Mean, {n} walkers": mean.lower(params, full),
            f"Mean, {n - 1} walkers (internal padding)": mean.lower(params, short),
            f"Mean, {n} walkers with n_valid={n_valid} (persistent padded set)": mean.lower(
                params, padded, n_valid=n_valid
            ),
            f"per-walker, {n} walkers": per_walker.lower(params, full),
            f"per-walker, {n - 1} walkers (internal padding)": per_walker.lower(params, short),
            f"per-walker, {n} walkers with n_valid={n_valid} (persistent padded set)": per_walker.lower(
                params, padded, n_valid=n_valid
            ),
        }
        comm = {k: count_collectives(v.compile()) for k, v in comm.items()}
        times = interleaved(thunks, cfg.reps)
    report.facts["padding"] = {
        "internal_vs_reference": abs(values["internal"] - reference),
        "persistent_vs_reference": abs(values["persistent"] - reference),
        "padding_warnings": sum(issubclass(w.category, sv.PaddingWarning) for w in caught),
        "collectives": comm,
    }
    for a, b, label in (
        ("internal", "full", f"Mean local energy (batch_size={bs}): {n - 1} walkers (internal padding) / {n} walkers"),
        ("persistent", "full", f"Mean: {n}-walker padded set with n_valid={n_valid} / {n} walkers"),
        ("persistent", "internal", f"Mean: padded set with n_valid={n_valid} / {n - 1} walkers (internal padding)"),
    ):
        report.row(6, label, str(ratio(times, a, b)))
    for name, counts in comm.items():
        report.row(6, f"collectives: {name}", fmt_collectives(counts))


# ------------------------------------------------------------------------------------------------
# 7. retracing


def retracing(cfg: Config, report: Report) -> None:
    """A Metropolis loop over a persistent padded walker set: each kernel must be traced and compiled once."""
    S, mesh = cfg.system, cfg.mesh
    traces: collections.Counter[str] = collections.Counter()

    @sv.walker_parallel(mesh=mesh)
    def log_prob(params: sv.Replicated[dict], r: sv.PerWalker[jax.Array]) -> sv.PerWalker[jax.Array]:
        traces["log_prob"] += 1
        return 2 * S.log_psi(params, r)

    @sv.walker_parallel(mesh=mesh)
    def mcmc_step(
        params: sv.Replicated[dict],
        r: sv.PerWalker[jax.Array],
        logp: sv.PerWalker[jax.Array],
        key: sv.WalkerKey,
        width: sv.Static[float],
    ) -> tuple[sv.PerWalker[jax.Array], sv.PerWalker[jax.Array], sv.Mean[jax.Array]]:
        traces["mcmc_step"] += 1
        k_move, k_accept = jax.random.split(key)
        proposal = r + width * jax.random.normal(k_move, r.shape)
        logp_new = 2 * S.log_psi(params, proposal)
        accept = jnp.log(jax.random.uniform(k_accept)) < logp_new - logp
        return jnp.where(accept, proposal, r), jnp.where(accept, logp_new, logp), accept.astype(jnp.float32)

    @sv.walker_parallel(mesh=mesh, batch_size=cfg.batch_size)
    def energy(params: sv.Replicated[dict], r: sv.PerWalker[jax.Array]) -> sv.Mean[jax.Array]:
        traces["energy"] += 1
        return S.local_energy(params, r)

    compiles = [0]

    def on_event(event: str, _seconds: float, **_: Any) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            compiles[0] += 1

    n_real = cfg.loop_walkers - 1
    params = cfg.params()
    r, n_valid = sv.pad_walker(S.init_walkers(n_real, seed=2), sv.pad_n_walkers(n_real, mesh.shape[AXIS]))
    r = sv.shard_walker(r, mesh)
    key = jax.random.key(0)
    jax.monitoring.register_event_duration_secs_listener(on_event)
    try:
        logp = log_prob(params, r, n_valid=n_valid)
        energies, acceptance = [], []
        for step in range(cfg.loop_steps):
            key, sub = jax.random.split(key)
            r, logp, acc = mcmc_step(params, r, logp, sub, 0.1, n_valid=n_valid)
            # Wait for every step: a deep queue of programs with collectives can deadlock fake CPU devices.
            acceptance.append(float(acc))
            if step % cfg.energy_every == 0:
                energies.append(float(energy(params, r, n_valid=n_valid)))
            if step == 0:
                first = compiles[0]
        jax.block_until_ready(r)
    finally:
        jax.monitoring.unregister_event_duration_listener(on_event)
    later = compiles[0] - first
    acc_rate = float(np.mean(acceptance))
    report.facts["loop"] = {
        "steps": cfg.loop_steps,
        "traces": dict(traces),
        "compiles_first_step": first,
        "compiles_later_steps": later,
        "acceptance": acc_rate,
        "final_energy": float(energies[-1]),
        "finite": bool(np.isfinite(float(energies[-1]))),
    }
    report.row(
        7,
        f"{cfg.loop_steps}-step Metropolis loop ({n_real} walkers padded to {cfg.loop_walkers}, n_valid each call, "
        f"energy every {cfg.energy_every} steps): traces of each kernel body",
        ", ".join(f"{k} {v}" for k, v in sorted(traces.items())),
        "1 each",
        all(v == 1 for v in traces.values()) and len(traces) == 3,
    )
    report.row(
        7,
        f"backend compiles in steps 2..{cfg.loop_steps} (step 1 compiled {first}: the kernels and small eager ops); "
        f"acceptance {acc_rate:.2f}",
        str(later),
        "0",
        later == 0,
    )


SECTIONS = {
    1: kernel_cost,
    2: call_overhead,
    3: pytc_pattern,
    4: communication,
    5: memory,
    6: padding,
    7: retracing,
}
