"""XLA's YNNPACK fusions on a CPU: each program with them / without, side by side in one process.

For each network and walker count, three programs of one CPU device: ``log|psi|`` of every
walker (``jax.jit(jax.vmap(log_psi))``), the local energy (the ``sv.hamiltonian.local_energy``
kernel inside a ``jax.jit``) and a 20-move ``sv.mcmc.Metropolis`` step (``jax.jit(sampler.step)``),
each compiled twice: at JAX's defaults and with ``sv.compiler_options("cpu")``'s option that
turns the YNNPACK fusions off (that one alone). A figure is without / with: the median of 5
interleaved readings, each the median of 7 calls. Networks: helium's Slater-Jastrow
(examples/helium_vmc.py), the templates' Li network (examples/network.py), the tests'
FermiNet-style Li network (tests/models) and, where DeepQMC imports, DeepQMC's LiH ansatz of
``deepqmc.py``.

    python benchmarks/fusions.py                       # float64, every network that imports
    python benchmarks/fusions.py --float32 --networks deepqmc,ferminet --walkers 64,512
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")
HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "examples"), str(HERE.parent / "tests")]
NETWORKS = ("helium", "template", "ferminet", "deepqmc")
YNN = "xla_cpu_experimental_ynn_fusion_type"  # the option of sv.compiler_options("cpu") that turns them off


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--networks", default=",".join(NETWORKS), help="comma-separated subset of " + str(NETWORKS))
    p.add_argument("--walkers", default="64,512,2048", help="walker counts")
    p.add_argument("--float32", action="store_true", help="float32 (default float64)")
    p.add_argument("--json", help="also write the rows to this JSON file")
    return p.parse_args(argv)


def network(name: str, dtype: Any) -> tuple[Any, Any, Any, Any]:
    """``(params, log_psi(params, r), one_walker(key), potential(r))`` of one walker."""
    import jax
    import jax.numpy as jnp

    import shardvmc as sv

    if name == "helium":
        import helium_vmc as helium

        params = helium.Params(alpha=jnp.asarray(1.8, dtype), beta=jnp.asarray(0.3, dtype))
        return params, helium.log_psi, lambda k: helium.init_walker(k).astype(dtype), helium.potential
    if name == "deepqmc":
        import importlib.util

        saved = sys.path[:]  # DeepQMC itself, not this folder's deepqmc.py (the script's folder is on the path)
        sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
        try:
            from deepqmc.types import PhysicalConfiguration  # an ImportError where DeepQMC is missing
        finally:
            sys.path[:] = saved

        spec = importlib.util.spec_from_file_location("deepqmc_bench", HERE / "deepqmc.py")  # its ansatz
        assert spec is not None and spec.loader is not None
        deepqmc_bench = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(deepqmc_bench)

        hamil, ansatz = deepqmc_bench.deepqmc_model(deepqmc_bench.deepqmc_task(64))
        params = jax.tree.map(lambda a: a.astype(dtype), deepqmc_bench.initial_params(hamil, ansatz))
        coords, charges = hamil.mol.coords, hamil.mol.charges

        def log_psi(p: Any, r: Any) -> Any:
            return ansatz.apply(p, PhysicalConfiguration(coords, r, jnp.array(0))).log

        walker = lambda k: hamil.init_sample(k, coords, 1).r[0].astype(dtype)  # noqa: E731
        return params, log_psi, walker, lambda r: sv.hamiltonian.coulomb(r, charges, coords)
    if name == "template":
        import network as template

        system = template.LI
        params = template.init(jax.random.key(0), system, 32, 16, 2, 8, dtype)
        log_psi = lambda p, r: template.log_psi(p, r, system)  # noqa: E731
        walker = lambda k: template.init_walker(k, system, dtype)  # noqa: E731
    else:
        from models import ferminet, systems

        system = systems.LI
        params = ferminet.init(jax.random.key(0), system, dtype=dtype)
        log_psi = lambda p, r: ferminet.log_psi(p, r, system)  # noqa: E731
        walker = lambda k: systems.init_walkers(k, system, 1, dtype)[0]  # noqa: E731
    charges, coords = jnp.asarray(system.charges, dtype), jnp.asarray(system.coords, dtype)
    return params, log_psi, walker, lambda r: sv.hamiltonian.coulomb(r, charges, coords)


def median_ms(fn: Any, calls: int = 7) -> float:
    import jax

    jax.block_until_ready(fn())
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return 1e3 * sorted(times)[len(times) // 2]


def rows_of(name: str, walker_counts: list[int], dtype: Any) -> list[dict[str, Any]]:
    import jax

    import shardvmc as sv

    params, log_psi, walker, potential = network(name, dtype)
    energy = sv.hamiltonian.local_energy(log_psi, potential, mesh=sv.create_mesh(jax.devices()[:1]))
    sampler = sv.mcmc.Metropolis(log_psi, n_steps=20, mesh=sv.create_mesh(jax.devices()[:1]))
    replicated = sv.replicate(params, sv.create_mesh(jax.devices()[:1]))
    off = {YNN: sv.compiler_options("cpu")[YNN]}
    rows = []
    for n in walker_counts:
        walkers = sv.initialize_walkers_sharded(
            walker, n, key=jax.random.key(1), mesh=sv.create_mesh(jax.devices()[:1])
        )
        positions = jax.numpy.stack([walker(k) for k in jax.random.split(jax.random.key(1), n)])
        state = sampler.init(replicated, walkers, width=0.2)
        programs = {
            "log_psi": (jax.vmap(log_psi, (None, 0)), (params, positions)),
            "local energy": (lambda p, w: energy(p, w), (replicated, walkers)),
            "sampler step": (sampler.step, (replicated, state, jax.random.key(3))),
        }
        row: dict[str, Any] = {"network": name, "walkers": n}
        for what, (fn, args) in programs.items():
            with_, without = jax.jit(fn), jax.jit(fn, compiler_options=off)
            readings = []
            for _ in range(5):  # interleaved: the machine's drift slows both alike
                a = median_ms(lambda: with_(*args))
                b = median_ms(lambda: without(*args))
                readings.append((a, b, b / a))
            a, b, ratio = (sorted(x)[2] for x in zip(*readings))
            row[what] = {"with ms": round(a, 3), "without ms": round(b, 3), "without / with": round(ratio, 3),
                         "readings (with ms, without ms, without / with)": readings}  # fmt: skip
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import jax

    jax.config.update("jax_enable_x64", not args.float32)
    import jax.numpy as jnp

    import shardvmc as sv

    if YNN not in sv.compiler_options("cpu"):
        print("no option to compare: XLA_FLAGS names the fusions, or this JAX does not know the option")
        return 1
    dtype = jnp.float32 if args.float32 else jnp.float64
    counts = [int(s) for s in args.walkers.split(",") if s.strip()]
    rows = []
    for name in args.networks.split(","):
        try:
            rows += rows_of(name, counts, dtype)
        except ImportError as err:
            print(f"# {name}: not run ({err})")
    print(f"\n{jnp.dtype(dtype).name}, one CPU device, JAX {jax.__version__}: without YNNPACK fusions / with "
          "(median of 5 interleaved readings; ms with, without)")  # fmt: skip
    print("| network | walkers | log psi | local energy | sampler step (20 moves) |\n|---|---|---|---|---|")
    for row in rows:
        cells = [f"{row[k]['without / with']} ({row[k]['with ms']}, {row[k]['without ms']})"
                 for k in ("log_psi", "local energy", "sampler step")]  # fmt: skip
        print(f"| {row['network']} | {row['walkers']} | " + " | ".join(cells) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps({"dtype": jnp.dtype(dtype).name, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
