"""Scaling with the electrons: log psi, its gradient and local energies from Li (3) to bicyclobutane (30 electrons).

Each row is one piece of one network for one system (``examples/network.py``'s ``SYSTEMS``: Li, Be, Ne, N2,
bicyclobutane), timed on the default backend's first device in float32, every program traced under
``jax.default_matmul_precision("highest")`` (the library's local energy sets it inside on TPUs anyway):

- **networks**: ``template`` (``examples/network.py`` at ``examples/neural_vmc.py``'s size: 2 layers of 32/8,
  4 determinants; 4,096 walkers), ``template-large`` (the same at FermiNet's default size: 4 layers of 256/32,
  16 determinants; 512 walkers), ``ferminet`` (FermiNet's own ``networks.make_fermi_net`` with its
  ``base_config.default()`` network options; 512 walkers), the anchor. FermiNet's source is not part of this
  repository: ``benchmarks/get_ferminet.sh`` copies it into ``benchmarks/.ferminet/`` (git-ignored); without it
  the FermiNet rows are skipped and say so.
- **pieces**: ``logpsi`` (vmapped), ``grad`` (per-walker gradient of log psi with respect to the parameters, the
  natural gradient's Jacobian), the library's ``sv.hamiltonian.local_energy`` with ``laplacian=`` ``folx``
  (dense Jacobians), ``folx-sparse`` (``sparsity_threshold=0.6``, folx's recommendation), ``folx-6`` (6,
  FermiNet's) and ``jvp``, applied to
  every network (for FermiNet's, to its ``net.apply``); and FermiNet's own ``hamiltonian.local_energy`` with
  ``laplacian_method='folx'`` (``ferminet-folx``: its folx, sparsity threshold 6) and ``'default'``
  (``ferminet-default``: its JVP loop), vmapped, on FermiNet's network only. The library against FermiNet's code
  on the SAME network is the comparison that matters.
- **metrics**: walkers per second (walkers / median seconds per call, after a first call, over as many calls as fit
  ``--row-seconds``), microseconds per walker, compile seconds (``jax.jit(f).lower(...).compile()``: tracing,
  lowering and compiling), peak memory (``compiled.memory_analysis()``: arguments + outputs + temporaries, as
  ``shardvmc._memory.compiled_memory``) per walker, and XLA's FLOP count (``compiled.cost_analysis()['flops']``)
  per second as a fraction of the chip's peak at the precision used. TPU v5e: 197 TFLOP/s bf16 per chip; float32
  at "highest" runs 6 bf16 passes, so its peak is counted as 197 / 6 = 32.8 TFLOP/s. Elsewhere: n/a. XLA counts a
  loop's body once (it does on CPUs): programs with a loop (the JVP Laplacians) get a ``>=`` fraction.
- **growth exponents**: the slope of log(time per walker) against log(electrons) over the systems measured, per
  network and piece, FermiNet's own code's beside the library's.

Rows run in child processes with a journal, as ``gpu.py``'s (its ``Guard`` and ``supervise``): a crash or an
out-of-memory kill is that row's failure and a new child goes on; a row past ``--row-limit`` is stopped; no row
starts after ``--budget`` seconds, and the table so far is written at the budget plus 45 s. Each row prints one
line when it ends (set ``PYTHONUNBUFFERED=1`` so that a time-out keeps them).

Usage (from the repository root)::

    benchmarks/get_ferminet.sh PATH_TO_A_FERMINET_CLONE      # once, for the FermiNet rows
    python benchmarks/scaling.py --out scaling.md --json scaling.json
    python benchmarks/scaling.py --only ferminet --pieces jvp,ferminet-folx,ferminet-default --systems Li,N2
    python benchmarks/scaling.py --smoke                      # CPU: tiny networks, Li and N2, in seconds
"""

import argparse
import dataclasses
import functools
import importlib.util
import json
import os
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE]
import gpu  # noqa: E402  # its Guard (time limits, journal) and supervise (rows in child processes); stdlib only

NETWORKS = ("template", "template-large", "ferminet")
PIECES = ("logpsi", "grad", "folx", "folx-sparse", "folx-6", "jvp", "ferminet-folx", "ferminet-default")
SMOKE_PIECES = ("logpsi", "grad", "folx", "jvp", "ferminet-default")  # the slowest compiles left out
SYSTEMS = ("Li", "Be", "Ne", "N2", "bicyclobutane")
LAPLACIANS = {
    "folx": ("folx", 0),
    "folx-sparse": ("folx", 0.6),
    "folx-6": ("folx", 6),
    "jvp": ("jvp", 0),
}  # piece: (laplacian, sparsity)
FERMINET_DIR = os.path.join(HERE, ".ferminet")
# bf16 FLOP/s per chip by device kind; float32 at "highest" precision takes 6 bf16 passes
PEAK_BF16 = {"TPU v5 lite": 197e12, "TPU v5e": 197e12}
HIGHEST_PASSES = 6
# HBM bytes/s per chip by device kind: the roofline's other side (a program that moves more bytes per FLOP than
# peak FLOP/s / bandwidth, 40 on a v5e at "highest", is bound by memory)
PEAK_HBM = {"TPU v5 lite": 819e9, "TPU v5e": 819e9}
# FermiNet's base_config.default()['network'] (ferminet 0ce3411), for a Python without ml_collections
FERMINET_DEFAULTS = {"determinants": 16, "bias_orbitals": False, "full_det": True, "jastrow": "default",
                     "rescale_inputs": False, "ferminet": {"hidden_dims": ((256, 32),) * 4, "use_last_layer": False,
                     "separate_spin_channels": False, "schnet_electron_electron_convolutions": (),
                     "electron_nuclear_aux_dims": (), "nuclear_embedding_dim": 0,
                     "schnet_electron_nuclear_convolutions": ()}}  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny networks, Li and N2, 8 walkers: checks the script")
    parser.add_argument("--only", default=",".join(NETWORKS), help=f"comma-separated networks of {NETWORKS}")
    parser.add_argument(
        "--pieces", default="", help=f"comma-separated pieces of {PIECES} (default all; smoke {','.join(SMOKE_PIECES)})"
    )
    parser.add_argument("--systems", default="", help=f"comma-separated systems (default {SYSTEMS}; smoke Li,N2)")
    parser.add_argument("--walkers", type=int, default=0, help="walkers at the examples' size (default 4096)")
    parser.add_argument("--walkers-large", type=int, default=0, help="walkers at FermiNet's size (default 512)")
    parser.add_argument("--reps", type=int, default=0, help="timed calls per row, at most (default 11; smoke 3)")
    parser.add_argument("--row-seconds", type=float, default=0, help="timed seconds per row (default 3; smoke 0.2)")
    parser.add_argument("--budget", type=float, default=0, help="no row starts after this (default 900 s; smoke 240)")
    parser.add_argument("--row-limit", type=float, default=0, help="a row running longer is stopped (default 300 s)")
    parser.add_argument("--out", default="", help="also write the tables (Markdown) to this file")
    parser.add_argument("--json", default="", help="also write the rows, exponents and machine to this JSON file")
    parser.add_argument("--in-process", action="store_true", help="run every row in this process (no child)")
    parser.add_argument("--journal", default="", help=argparse.SUPPRESS)  # a child's (gpu.supervise)
    parser.add_argument("--started-at", type=float, default=0.0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name, allowed in (("only", NETWORKS), ("pieces", PIECES), ("systems", SYSTEMS)):
        unknown = set(filter(None, getattr(args, name).split(","))) - set(allowed)
        if unknown:
            parser.error(f"--{name}: unknown {sorted(unknown)}; pick from {allowed}")
    return args


@dataclasses.dataclass
class Sizes:
    """What gpu.Guard reads (reps, row_seconds, row_limit, budget), and the networks' sizes and walkers."""

    template: dict[str, int]
    large: dict[str, int]
    walkers: int
    walkers_large: int
    systems: tuple[str, ...]
    reps: int
    row_seconds: float
    row_limit: float
    budget: float

    def of(self, network: str) -> tuple[dict[str, int], int]:
        """The network's size (hidden_one, hidden_two, layers, determinants) and its walkers."""
        return (self.template, self.walkers) if network == "template" else (self.large, self.walkers_large)


def sizes_for(args: argparse.Namespace) -> Sizes:
    systems = tuple(filter(None, args.systems.split(",")))
    if args.smoke:
        tiny = {"hidden_one": 4, "hidden_two": 4, "layers": 1, "determinants": 1}
        sizes = Sizes(tiny, tiny, 8, 8, systems or ("Li", "N2"), 3, 0.2, 120.0, 240.0)
    else:
        sizes = Sizes({"hidden_one": 32, "hidden_two": 8, "layers": 2, "determinants": 4},
                      {"hidden_one": 256, "hidden_two": 32, "layers": 4, "determinants": 16},
                      4096, 512, systems or SYSTEMS, 11, 3.0, 300.0, 900.0)  # fmt: skip
    sizes.walkers = args.walkers or sizes.walkers
    sizes.walkers_large = args.walkers_large or sizes.walkers_large
    sizes.reps = args.reps or sizes.reps
    sizes.row_seconds = args.row_seconds or sizes.row_seconds
    sizes.row_limit = args.row_limit or sizes.row_limit
    sizes.budget = args.budget or sizes.budget
    return sizes


# ----------------------------------------------------------------------------- the networks


def ferminet_absent() -> str:
    """Why FermiNet's rows cannot run ('' when they can)."""
    if not os.path.exists(os.path.join(FERMINET_DIR, "ferminet", "networks.py")):
        return "benchmarks/.ferminet is absent (run benchmarks/get_ferminet.sh)"
    missing = [m for m in ("chex", "folx") if importlib.util.find_spec(m) is None]
    return f"FermiNet needs {', '.join(missing)} (not installed)" if missing else ""


def import_ferminet() -> tuple[Any, Any]:
    """FermiNet's ``networks`` and ``hamiltonian`` from benchmarks/.ferminet (get_ferminet.sh's stand-ins)."""
    if FERMINET_DIR not in sys.path:
        sys.path.insert(0, FERMINET_DIR)
        if importlib.util.find_spec("pyscf") is None:  # imported at module level, used for pseudopotentials only
            sys.path.insert(0, os.path.join(FERMINET_DIR, "stubs"))
        sys.path.append(os.path.join(FERMINET_DIR, "vendor"))  # attrs, typing_extensions: installed copies first
    from ferminet import hamiltonian, networks

    return networks, hamiltonian


def ferminet_options(size: dict[str, int]) -> dict[str, Any]:
    """``make_fermi_net``'s keywords as FermiNet's train.py builds them from ``base_config.default()``, at ``size``."""
    try:
        from ferminet import base_config

        network = base_config.default().network.to_dict()
    except ImportError:  # ml_collections absent: the same values, copied
        network = FERMINET_DEFAULTS
    layers = ((size["hidden_one"], size["hidden_two"]),) * size["layers"]
    options = {key: network[key] for key in ("determinants", "bias_orbitals", "full_det", "jastrow", "rescale_inputs")}
    return {**options, **network["ferminet"], "determinants": size["determinants"], "hidden_dims": layers}


@dataclasses.dataclass
class Workload:
    """One network for one system: ``log_psi(params, r)`` of ONE walker ``r`` (n, 3), its parameters and walkers."""

    log_psi: Any
    params: Any
    walkers: Any
    potential: Any
    n_params: int
    ferminet: Any = None  # FermiNet's (hamiltonian, net, FermiNetData of a walker, nspins) for its own local energy


def workload(network: str, name: str, sizes: Sizes) -> Workload:
    import jax
    import jax.numpy as jnp
    from harness import examples_on_path
    from jax.flatten_util import ravel_pytree

    import shardvmc as sv

    examples_on_path()
    import network as template

    system = template.SYSTEMS[name]
    size, n_walkers = sizes.of(network)
    keys = jax.random.split(jax.random.key(0), n_walkers)
    walkers = jax.jit(jax.vmap(lambda k: template.init_walker(k, system, jnp.float32)))(keys)
    potential = functools.partial(sv.hamiltonian.coulomb, charges=system.charges, coords=system.coords)
    if network != "ferminet":
        params = template.init(jax.random.key(1), system, *size.values(), jnp.float32)
        log_psi = functools.partial(template.log_psi, system=system)
        return Workload(log_psi, params, walkers, potential, ravel_pytree(params)[0].size)
    networks, hamiltonian = import_ferminet()
    from ferminet import envelopes

    nspins, charges = (system.n_up, system.n_down), jnp.asarray(system.charges, jnp.float32)
    atoms = jnp.asarray(system.coords, jnp.float32)
    spins = jnp.concatenate([jnp.ones(system.n_up), -jnp.ones(system.n_down)])
    features = networks.make_ferminet_features(natoms=len(system.charges), nspins=nspins, ndim=3)
    net = networks.make_fermi_net(nspins, charges, ndim=3, envelope=envelopes.make_isotropic_envelope(),
                                  feature_layer=features, complex_output=False, **ferminet_options(size))  # fmt: skip
    params = net.init(jax.random.key(1))

    def log_psi(p: Any, r: jax.Array) -> jax.Array:
        return net.apply(p, r.reshape(-1), spins, atoms, charges)[1]

    def data(r: jax.Array) -> Any:
        return networks.FermiNetData(positions=r.reshape(-1), spins=spins, atoms=atoms, charges=charges)

    fn = (hamiltonian, net, data, nspins)
    return Workload(log_psi, params, walkers, potential, ravel_pytree(params)[0].size, fn)


def program(piece: str, w: Workload) -> Any:
    """``f(params, walkers)`` of the piece (all walkers), to be jitted."""
    import jax

    import shardvmc as sv

    if piece == "logpsi":
        return jax.vmap(w.log_psi, (None, 0))
    if piece == "grad":
        return jax.vmap(jax.grad(w.log_psi), (None, 0))
    if piece in LAPLACIANS:
        laplacian, sparsity = LAPLACIANS[piece]
        mesh = sv.create_mesh(jax.devices()[:1])
        return sv.hamiltonian.local_energy(w.log_psi, w.potential, laplacian=laplacian, sparsity_threshold=sparsity,
                                           mesh=mesh)  # fmt: skip
    hamiltonian, net, data, nspins = w.ferminet
    method = {"ferminet-folx": "folx", "ferminet-default": "default"}[piece]
    e_l = hamiltonian.local_energy(
        f=net.apply,
        charges=data(w.walkers[0]).charges,
        nspins=nspins,
        use_scan=False,
        complex_output=False,
        laplacian_method=method,
    )  # as FermiNet's train.py
    key = jax.random.key(0)
    return jax.vmap(lambda p, r: e_l(p, key, data(r))[0], (None, 0))


# ----------------------------------------------------------------------------- one row


def flops_of(compiled: Any) -> tuple[float, float, bool]:
    """XLA's FLOP and memory-byte counts of a compiled program, and whether it has a loop (its body counted once)."""
    cost = compiled.cost_analysis()
    cost = (cost[0] if cost else {}) if isinstance(cost, (list, tuple)) else (cost or {})
    return float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0)), " while(" in compiled.as_text()


def peak_flops() -> float:
    """The first device's float32 FLOP/s at "highest" precision (bf16 peak / 6), 0 where unknown (CPUs)."""
    import jax

    return PEAK_BF16.get(jax.devices()[0].device_kind, 0.0) / HIGHEST_PASSES


def measure(guard: gpu.Guard, fn: Any, w: Workload) -> dict[str, Any]:
    """Compile ``fn`` once, call it, time it; the row's metrics."""
    import jax

    from shardvmc._memory import compiled_memory

    args = (w.params, w.walkers)
    with jax.default_matmul_precision("highest"):
        start = time.perf_counter()
        compiled = jax.jit(lambda p, r: fn(p, r)).lower(*args).compile()
        compile_s = time.perf_counter() - start
    jax.block_until_ready(compiled(*args))  # the first call (transfers, allocations)
    start = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(guard.reps(time.perf_counter() - start)):
        start = time.perf_counter()
        out = jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - start)
    seconds, n = gpu.median(times), w.walkers.shape[0]
    flops, moved, loop = flops_of(compiled)
    peak = peak_flops()
    bandwidth = PEAK_HBM.get(jax.devices()[0].device_kind, 0.0)
    finite = all(bool(jax.numpy.isfinite(leaf).all()) for leaf in jax.tree_util.tree_leaves(out))
    return {
        "walkers": n,
        "seconds": seconds,
        "walkers_per_s": n / seconds,
        "us_per_walker": 1e6 * seconds / n,
        "compile_s": compile_s,
        "peak_bytes_per_walker": compiled_memory(compiled).total_bytes / n,
        "flops": flops,
        "peak_fraction": flops / seconds / peak if peak and flops else None,
        "bytes": moved,
        "bandwidth_fraction": moved / seconds / bandwidth if bandwidth and moved else None,
        "loop": loop,
        "finite": finite,
        "mean_output": float(jax.numpy.mean(out)) if getattr(out, "ndim", None) == 1 else None,  # E_L, log psi
        "reps": len(times),
        "n_params": w.n_params,
    }


def rows(guard: gpu.Guard, sizes: Sizes, networks: list[str], pieces: list[str]) -> None:
    """Every network x system x piece chosen, each a row (``gpu.Guard.row``: budget, limit, journal)."""
    import network as template

    absent = ferminet_absent()
    cache: dict[tuple[str, str], Workload] = {}  # a workload made once per process, for all its pieces
    for network in networks:
        for name in sizes.systems:
            n_e = template.SYSTEMS[name].n_up + template.SYSTEMS[name].n_down
            for piece in pieces:
                if piece.startswith("ferminet-") and network != "ferminet":
                    continue  # FermiNet's own local energy takes FermiNet's network only
                what = f"{network} | {name} | {piece}"
                info = {"network": network, "system": name, "electrons": n_e, "piece": piece}
                if network == "ferminet" and absent:
                    guard.report.row(1, what, f"skipped: {absent}")
                    guard.report.rows[-1].update(info)
                    continue

                def run(network: str = network, name: str = name, piece: str = piece, what: str = what,
                        info: dict = info) -> None:  # fmt: skip
                    if (network, name) not in cache:
                        cache.clear()  # one system's walkers and parameters at a time
                        cache[(network, name)] = workload(network, name, sizes)
                    m = measure(guard, program(piece, cache[(network, name)]), cache[(network, name)])
                    fraction = "n/a" if m["peak_fraction"] is None else f"{m['peak_fraction']:.2%}"
                    guard.report.row(1, what, f"{m['walkers_per_s']:,.0f} walkers/s, {m['us_per_walker']:.2f} us "
                                              f"per walker, compiled in {m['compile_s']:.1f} s, peak "
                                              f"{m['peak_bytes_per_walker'] / 1024:.1f} KiB per walker, "
                                              f"{fraction} of peak FLOP/s, mean output "
                                              f"{m['mean_output']}")  # fmt: skip
                    guard.report.rows[-1].update(info, metrics=m)

                first = len(guard.report.rows)
                guard.row(1, what, run)
                for row in guard.report.rows[first:]:  # failures and skips: still tagged for the tables
                    row.update({k: v for k, v in info.items() if k not in row})


# ----------------------------------------------------------------------------- tables


def exponents(all_rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The least-squares slope of log(time per walker) against log(electrons), per network and piece."""
    import numpy as np

    groups: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for row in all_rows:
        if row.get("metrics"):
            groups.setdefault((row["network"], row["piece"]), []).append(
                (row["electrons"], row["metrics"]["us_per_walker"])
            )
    fits = []
    for (network, piece), points in groups.items():
        if len({n for n, _ in points}) >= 2:
            x, y = np.log([p[0] for p in points]), np.log([p[1] for p in points])
            fits.append({"network": network, "piece": piece, "exponent": float(np.polyfit(x, y, 1)[0]),
                         "electrons": sorted(p[0] for p in points)})  # fmt: skip
    return fits


def tables(all_rows: list[dict[str, Any]], fits: list[dict[str, Any]], peak: float) -> str:
    """The rows' table and the exponents' table (Markdown)."""
    peak_text = f"{peak / 1e12:.1f} TFLOP/s (float32 at 'highest': bf16 peak / 6)" if peak else "n/a (no known peak)"
    lines = ["| network | system | electrons | piece | walkers | walkers/s | us/walker | compile s | "
             "peak KiB/walker | FLOP/walker | % of peak FLOP/s | % of HBM bandwidth |", "|---" * 12 + "|"]  # fmt: skip
    for row in all_rows:
        m = row.get("metrics")
        head = f"| {row.get('network', '')} | {row.get('system', '')} | {row.get('electrons', '')} | " \
               f"{row.get('piece', row['what'])} |"  # fmt: skip
        if not m:
            lines.append(f"{head} {row['figure']} | | | | | | | |")
            continue
        bound = ">=" if m["loop"] else ""
        fraction = "n/a" if m["peak_fraction"] is None else f"{bound}{100 * m['peak_fraction']:.2f}"
        moved = "n/a" if m.get("bandwidth_fraction") is None else f"{bound}{100 * m['bandwidth_fraction']:.1f}"
        lines.append(f"{head} {m['walkers']} | {m['walkers_per_s']:,.0f} | {m['us_per_walker']:.3g} | "
                     f"{m['compile_s']:.1f} | {m['peak_bytes_per_walker'] / 1024:,.1f} | "
                     f"{m['flops'] / m['walkers']:.3g}{'*' if m['loop'] else ''} | {fraction} | {moved} |")  # fmt: skip
    lines += ["", f"Peak: {peak_text}; HBM bandwidth from XLA's bytes accessed against the chip's (819 GB/s on a "
              "v5e). * a loop: XLA counts its body once, so FLOPs, bytes and the fractions are lower bounds.",
              "", "| network | piece | time per walker grows as n^x: x | electrons | FermiNet's own code, same "
              "network: x |", "|---|---|---|---|---|"]  # fmt: skip
    own = {f["piece"]: f["exponent"] for f in fits if f["network"] == "ferminet" and f["piece"].startswith("ferminet-")}
    anchor = ", ".join(f"{piece} {x:.2f}" for piece, x in sorted(own.items())) or "n/a"
    for f in fits:
        lines.append(f"| {f['network']} | {f['piece']} | {f['exponent']:.2f} | {f['electrons']} | {anchor} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if not (args.journal or args.in_process):  # the parent never opens the accelerator: its children do
        return gpu.supervise(argv, args, script=__file__)
    sys.path.insert(1, os.path.dirname(HERE))  # shardvmc from this checkout
    import jax
    from harness import examples_on_path
    from sections import Report, machine

    examples_on_path()
    sizes = sizes_for(args)
    info: dict[str, Any] = machine()
    peak = peak_flops()
    info["peak_flops_float32_highest"] = peak or None
    info["ferminet"] = ferminet_absent() or open(os.path.join(FERMINET_DIR, "COMMIT")).read().strip()
    command = "python benchmarks/scaling.py " + " ".join(a for a, b in zip(argv, [""] + argv) if not (
        a.startswith("--journal") or a.startswith("--started-at") or b in ("--journal", "--started-at")))  # fmt: skip
    print("shardvmc scaling benchmark:", ", ".join(f"{k}={v}" for k, v in info.items()), flush=True)
    report = Report()

    def write(note: str = "") -> None:
        fits = exponents(report.rows)
        text = tables(report.rows, fits, peak)
        print(text, flush=True)
        if args.out:
            with open(args.out, "w") as f:
                f.write(f"`{command.strip()}`\n\n{', '.join(f'{k}={v}' for k, v in info.items())}\n\n{text}\n")
                f.write(f"\n{note}\n" if note else "")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"machine": info, "rows": report.rows, "exponents": fits, "note": note}, f, default=str)

    guard = gpu.Guard(report, sizes, write, args.journal, args.started_at)
    networks = list(filter(None, args.only.split(",")))
    if args.smoke and args.only == ",".join(NETWORKS):  # both template sizes are the tiny one: once
        networks.remove("template-large")
    pieces = list(filter(None, args.pieces.split(","))) or list(SMOKE_PIECES if args.smoke else PIECES)
    rows(guard, sizes, networks, pieces)
    guard.watchdog.cancel()
    info["seconds"] = round(guard.elapsed(), 1)
    print(f"\n{command.strip()}: {info['seconds']} s on {jax.devices()[0].device_kind}")
    write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
