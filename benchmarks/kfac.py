"""KFAC: shardvmc.kfac's step against kfac-jax's own pmap step (FermiNet's), side by side.

FermiNet's loss pattern (``tests/models/kfac_loss.py``: ``custom_jvp``, ``pmean`` over
``"qmc_pmap_axis"``, clipping, a folx-free Laplacian) on a small FermiNet-style network
for Li, FermiNet's KFAC settings (``fisher_exact``, the norm constraint), on 8 fake CPU
devices. The steppers run in turn in every repetition (``harness.interleaved``), each
feeding its own results back:

- ``pmap``: ``kfac_jax.Optimizer(multi_device=True)`` under its own ``jax.pmap``, fed
  per-device blocks (FermiNet's ``train.py``);
- ``shardvmc``: ``shardvmc.kfac.Optimizer`` on the walker-sharded batch;

each with FermiNet's ``inverse_update_period=1`` (kfac-jax then averages the curvature
estimate over the devices every step, as shardvmc.kfac always does) and with 10
(kfac-jax averages only when it inverts; shardvmc.kfac still every step).

Prints the per-step time ratios (median [quartiles] over repetitions), the first call
of each (compile included), the collectives of shardvmc's compiled step, and how far
the shardvmc parameters are from the pmap ones after the timed steps, relative to how
far those moved.

Usage (from the repository root)::

    python benchmarks/kfac.py                 # several minutes on 2 cores (eight compilations)
    python benchmarks/kfac.py --quick         # tiny sizes (still two minutes: eight compilations)
"""

import argparse
import os
import sys
import time

from harness import count_collectives, fill_defaults, fmt_collectives, interleaved, ratio

QUICK = {"walkers": 32, "hidden": 8, "layers": 1, "determinants": 1, "reps": 3}
DEFAULTS = {"walkers": 256, "hidden": 16, "layers": 2, "determinants": 2, "reps": 15}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, few repetitions")
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--float64", action="store_true", help="compute in float64 (default float32, FermiNet's)")
    for name in DEFAULTS:
        parser.add_argument(f"--{name}", type=int, default=None)
    return fill_defaults(parser.parse_args(argv), DEFAULTS, QUICK)


def main(argv=None):
    args = parse_args(argv)
    from shardvmc.testing import set_cpu_devices

    set_cpu_devices(args.devices)
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))  # the model corpus, tests/models
    import jax

    jax.config.update("jax_enable_x64", args.float64)
    import jax.numpy as jnp
    import kfac_jax
    import numpy as np
    from models import kfac_loss, systems

    import shardvmc as sv
    import shardvmc.kfac as svk
    from shardvmc import _kfac_compat

    n, d = args.walkers, args.devices
    system = systems.LI
    dtype = jnp.float64 if args.float64 else jnp.float32
    params = kfac_loss.init(jax.random.key(1), system, hidden_one=args.hidden, hidden_two=8, layers=args.layers,
                            determinants=args.determinants, dtype=dtype)  # fmt: skip
    walkers = systems.init_walkers(jax.random.key(2), system, n, dtype)
    loss = jax.value_and_grad(kfac_loss.make_loss(system), argnums=0, has_aux=True)
    base = dict(l2_reg=0.0, norm_constraint=1e-3, value_func_has_aux=True, value_func_has_rng=True,
                learning_rate_schedule=lambda t: 0.05 / (1.0 + t / 1e4), curvature_ema=0.95, min_damping=1e-4,
                num_burnin_steps=0, estimation_mode="fisher_exact", pmap_axis_name=kfac_loss.AXIS)  # fmt: skip
    key = jax.random.key(3)
    mesh = sv.create_mesh(jax.devices()[:d])
    batch = sv.shard_walker(walkers, mesh)
    rep = lambda x: jnp.broadcast_to(x, (d, *jnp.shape(x)))  # noqa: E731
    blocks = walkers.reshape(d, n // d, *walkers.shape[1:])
    mom, damp = rep(jnp.zeros(())), rep(jnp.asarray(1e-3))

    def pmap_stepper(settings):
        """kfac-jax's own pmap step, fed as FermiNet's train.py feeds it (device i's key: fold_in(key_t, i))."""
        opt = kfac_jax.Optimizer(loss, multi_device=True, **settings)
        run = {"p": jax.tree.map(rep, params), "t": 0}
        run["s"] = opt.init(run["p"], jax.vmap(lambda _: key)(jnp.arange(d)), blocks)

        def step():
            k = jax.vmap(lambda i: jax.random.fold_in(jax.random.fold_in(key, run["t"]), i))(jnp.arange(d))
            run["p"], run["s"], stats = opt.step(run["p"], run["s"], k, batch=blocks, momentum=mom, damping=damp)
            run["t"] += 1
            return stats["loss"]

        return run, step

    def shardvmc_stepper(settings):
        opt = svk.Optimizer(loss, mesh=mesh, **settings)
        run = {"p": params, "t": 0, "s": opt.init(params, key, batch), "opt": opt}

        def step():
            k = jax.random.fold_in(key, run["t"])
            run["p"], run["s"], stats = opt.step(run["p"], run["s"], k, batch=batch, momentum=0.0, damping=1e-3)
            run["t"] += 1
            return stats["loss"]

        return run, step

    runs, steppers, first = {}, {}, {}
    for period in (1, 10):
        settings = dict(base, inverse_update_period=period)
        for name, make in (("pmap", pmap_stepper), ("shardvmc", shardvmc_stepper)):
            label = f"{name}/{period}"
            runs[label], steppers[label] = make(settings)
            start = time.perf_counter()
            jax.block_until_ready(steppers[label]())
            first[label] = time.perf_counter() - start
    times = interleaved(steppers, args.reps)
    n_params = sum(x.size for x in jax.tree.leaves(params))

    def largest(a, b):
        return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in zip(a, b))

    opt = runs["shardvmc/1"]["opt"]
    _, kernel = opt._kernels()
    plan = _kfac_compat.curvature_flags(opt.kfac_optimizer, runs["shardvmc/1"]["t"])
    opt._trace_step = runs["shardvmc/1"]["t"]
    lowered = kernel.lower(opt._replicated(runs["shardvmc/1"]["p"]), opt._replicated(runs["shardvmc/1"]["s"]), key,
                           opt._batch(batch, "batch"), None, None,
                           *opt._replicated([jnp.asarray(0.0), jnp.asarray(1e-3)]), plan)  # fmt: skip
    collectives = fmt_collectives(count_collectives(lowered.compile()))

    print(f"KFAC step, Li, FermiNet-style network ({n_params} parameters), {n} walkers on {d} fake CPU devices, "
          f"{np.dtype(dtype).name}, {args.reps} repetitions")  # fmt: skip
    print(f"{'inverse_update_period':<22} {'shardvmc.kfac / pmap':<22} {'first call pmap, shardvmc':<27} "
          f"{'|params_pmap - params_shardvmc| / |params_pmap - params_0|'}")  # fmt: skip
    for period in (1, 10):
        a, b = runs[f"pmap/{period}"], runs[f"shardvmc/{period}"]
        p_pmap = jax.tree.leaves(jax.tree.map(lambda x: x[0], a["p"]))
        drift = largest(p_pmap, jax.tree.leaves(b["p"])) / largest(p_pmap, jax.tree.leaves(params))
        steps = f"after {a['t']} steps" if a["t"] == b["t"] else "(step counts differ)"
        compile_s = f"{first[f'pmap/{period}']:.1f} s, {first[f'shardvmc/{period}']:.1f} s"
        print(f"{period:<22} {ratio(times, f'shardvmc/{period}', f'pmap/{period}')!s:<22} {compile_s:<27} "
              f"{drift:.1e} {steps}")  # fmt: skip
    medians = {k: np.median(v) * 1e3 for k, v in times.items()}
    print("median step (ms): " + ", ".join(f"{k} {v:.1f}" for k, v in medians.items()))
    print(f"collectives in shardvmc.kfac's compiled step (inverse_update_period=1): {collectives}")


if __name__ == "__main__":
    main()
