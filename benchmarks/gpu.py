"""The kernel comparison of ``run.py`` on an accelerator, plus walkers per second.

For each walker count: the decorated local energy vs the hand-written
``jax.jit(shard_map(vmap(f)))`` (per-walker and ``Mean`` outputs, unchunked and with
``batch_size``), as interleaved ratios; walkers per second of the decorated kernel; and
its compiled temporary memory per device. Uses every device of JAX's default backend.

Usage (from the repository root)::

    python benchmarks/gpu.py                         # on a GPU machine: O2, 4096,16384,65536 walkers
    python benchmarks/gpu.py --walkers 8192 --batch-size 1024 --reps 41
    python benchmarks/gpu.py --cpu-devices 8         # no accelerator: a tiny CPU run (He, 64 walkers)
    python benchmarks/gpu.py --neural                # also the real workload (examples/neural_vmc.py)
    python benchmarks/gpu.py --neural-only --walkers 4096,16384,65536 --json neural.json

``--neural`` (the default on accelerators) adds the real workload, section 10: one
optimisation step of ``examples/neural_vmc.py`` (10 Metropolis moves of every walker,
the folx local energy, the per-walker Jacobian, energy clipping, ``sv.natural_gradient``
with ``--neural-optimiser``, the parameter update) for Li with the example's default
network (2 layers, 32 hidden units, 4 determinants, 4753 parameters), in float64 unless
``--neural-float32``: walkers per second (walkers x steps / s, after compilation), the
evaluation step's rate (moves and energies only), and the compiled step's memory per
device (arguments + outputs + temporaries, XLA's ``memory_analysis``).
"""

import argparse
import json
import os
import sys
import time
from typing import Any


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--system", choices=("o2", "he"), help="trial function (default: o2 on accelerators, he on CPU)"
    )
    parser.add_argument("--walkers", default="", help="comma-separated walker counts (default: by platform)")
    parser.add_argument("--batch-size", type=int, help="batch_size of the chunked rows (default: by platform)")
    parser.add_argument("--reps", type=int, help="timed repetitions per figure (default 21 on accelerators, 5 on CPU)")
    parser.add_argument("--cpu-devices", type=int, default=0, help="no accelerator: run on this many fake CPU devices")
    parser.add_argument("--json", default="", help="also write the rows and machine to this JSON file")
    parser.add_argument("--neural", action="store_true", default=None, help="add the neural workload (section 10)")
    parser.add_argument("--no-neural", dest="neural", action="store_false", help="leave the neural workload out")
    parser.add_argument("--neural-only", action="store_true", help="only the neural workload")
    parser.add_argument(
        "--neural-optimiser", default="auto", help="natural_gradient method of the neural step (default auto)"
    )
    parser.add_argument("--neural-float32", action="store_true", help="the neural workload in float32")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.cpu_devices:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from run import set_cpu_devices

        set_cpu_devices(args.cpu_devices)
        os.environ["JAX_PLATFORMS"] = "cpu"
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import jax
    import system
    from harness import decorated_energy, hand_written, interleaved, ratio, rel_diff, temp_bytes
    from sections import Report, machine

    import shardvmc as sv

    accelerator = jax.default_backend() != "cpu"
    chosen = {"o2": system.O2, "he": system.HE}[args.system or ("o2" if accelerator else "he")]
    sizes = [int(s) for s in args.walkers.split(",") if s.strip()] or ([4096, 16384, 65536] if accelerator else [64])
    batch_size = args.batch_size or (1024 if accelerator else 4)
    reps = args.reps or (21 if accelerator else 5)
    mesh = sv.create_mesh()
    n_dev = mesh.shape["walkers"]
    info: dict[str, Any] = machine()
    info["system"] = chosen.name
    info["accelerator"] = accelerator
    print("shardvmc gpu benchmark:", ", ".join(f"{k}={v}" for k, v in info.items()))
    if not accelerator:
        print("NOTE: no accelerator present; this CPU run only checks that the script works.")
    report = Report()
    params = sv.replicate(chosen.init_params(), mesh)
    for n in [] if args.neural_only else sizes:
        n = sv.pad_n_walkers(n, n_dev)
        r = sv.shard_walker(chosen.init_walkers(n), mesh)
        for output in ("walker", "mean"):
            for bs in (None, batch_size):
                if bs is not None and bs >= n // n_dev:
                    continue
                dec = decorated_energy(chosen, mesh, output, bs)
                hand = hand_written(chosen.local_energy, mesh, output, bs)
                diff = rel_diff(dec(params, r), hand(params, r))
                times = interleaved({"decorated": lambda: dec(params, r), "hand": lambda: hand(params, r)}, reps)
                rat = ratio(times, "decorated", "hand")
                rate = n / sorted(times["decorated"])[len(times["decorated"]) // 2]
                what = f"{'per-walker' if output == 'walker' else 'Mean'} local energy, {n} walkers, batch_size={bs}"
                report.row(
                    8,
                    f"{what}: decorated / hand-written (max abs diff {diff:.1e})",
                    str(rat),
                    "<= 1.02",
                    rat.median <= 1.02,
                )
                if output == "walker":
                    memory = temp_bytes(dec.lower(params, r).compile()) / 2**20
                    report.row(8, f"{what}: walkers per second (decorated)", f"{rate:,.0f}")
                    report.row(8, f"{what}: temporary memory per device", f"{memory:,.2f} MiB")
    if args.neural_only or (accelerator if args.neural is None else args.neural):
        neural_rows(report, mesh, sizes if accelerator or args.walkers else [64], reps, args)
    info["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    print()
    print(report.table())
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": info, "rows": report.rows, "when": time.time()}, f, indent=2, default=str)
    return 0


def neural_rows(report: Any, mesh: Any, sizes: list[int], reps: int, args: argparse.Namespace) -> None:
    """Section 10: the neural workload's optimisation and evaluation steps, timed, and their memory."""
    import dataclasses
    import importlib.util

    import jax
    import jax.numpy as jnp
    from jax.flatten_util import ravel_pytree

    import shardvmc as sv

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", "neural_vmc.py")
    spec = importlib.util.spec_from_file_location("neural_vmc", path)
    neural = importlib.util.module_from_spec(spec)
    sys.modules["neural_vmc"] = neural
    spec.loader.exec_module(neural)
    x64 = not args.neural_float32
    dtype = jnp.float64 if x64 else jnp.float32
    for n in sizes:
        config = dataclasses.replace(neural.Config(), walkers=n, optimiser=args.neural_optimiser, x64=x64)
        system = neural.SYSTEMS[config.system]
        with jax.enable_x64(x64), sv.use_mesh(mesh):
            params = sv.replicate(neural.init_params(config, dtype), mesh)
            n_params = int(ravel_pytree(params)[0].size)
            state = neural.State(
                params, sv.replicate(jnp.zeros((n_params,), dtype), mesh), sv.replicate(jnp.asarray(0.3, dtype), mesh)
            )

            def init_walker(key: Any, system: Any = system) -> dict:
                return {"r": neural.systems.init_walkers(key, system, 1, dtype)[0], "log_psi": jnp.zeros((), dtype)}

            walkers = sv.initialize_walkers_sharded(init_walker, n, key=jax.random.key(0))
            walkers = neural.make_kernels(mesh, None).refresh(params, walkers, system)
            train, evaluate = neural.make_steps(config, mesh)
            t = jnp.asarray(0, dtype)
            for name, step, extra in (("optimisation", train, (t,)), ("evaluation", evaluate, ())):
                compiled = step.lower(state, walkers, jax.random.key(1), *extra).compile()
                mem = compiled.memory_analysis()
                per_device = (mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes) / 2**20
                out = step(state, walkers, jax.random.key(1), *extra)  # warm-up (and the step's first call)
                jax.block_until_ready(out)
                times = []
                for rep in range(reps):
                    start = time.perf_counter()
                    out = step(state, walkers, jax.random.key(rep + 2), *extra)
                    jax.block_until_ready(out)
                    times.append(time.perf_counter() - start)
                median = sorted(times)[len(times) // 2]
                what = f"neural {config.system} ({n_params} params, {dtype.__name__}), {n} walkers, {name} step"
                report.row(10, f"{what}: walkers per second", f"{n / median:,.0f} ({median * 1e3:.1f} ms/step)")
                report.row(10, f"{what}: memory per device (compiled)", f"{per_device:,.1f} MiB")
            stats = jax.device_get(out[2])
            report.facts.setdefault("neural", []).append({"walkers": n, "energy": float(stats[0])})


if __name__ == "__main__":
    sys.exit(main())
