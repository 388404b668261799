"""The conformance matrix: public entry points x transforms x mesh contexts x devices x walker counts.

Every cell runs one entry point under one transform in one mesh context, on a mesh of 1, 3
or 8 devices with a walker count the mesh divides or not, and compares with the unsharded
reference (each entry's ``reference``): the same computation written with ``jax.vmap`` on one
device, or an independent oracle, float64 throughout, so agreement is to round-off (``RTOL``).

The entry points (``ENTRIES``): ``walker_parallel`` (with a ``WalkerKey``, ``PerWalker`` and
``Mean`` outputs), ``replicated_args``, ``shard_vmap``, ``sharded_batched_vmap``,
``walker_mean``/``walker_sum``, ``jtj``/``jtv``, ``natural_gradient``,
``shardvmc.optax.natural_gradient``, ``statistics``, ``StatsAccumulator`` (12 steps
accumulated in a ``lax.scan`` with ``max_blocks=12``: the buffer fills and is never merged,
so its statistics are those of the stored series, against ``statistics`` on one device) and
``shardvmc.kfac.Optimizer`` (init and one step of a one-layer loss in FermiNet's calling
convention, against ``kfac_jax.Optimizer(multi_device=False)`` on the whole batch on one
device, where the loss's ``pmean_if_pmap`` is a no-op; skipped, with the reason, where
kfac-jax cannot be imported: JAX >= 0.11).

The full product (``sum over entries of len(transforms) x len(CONTEXTS) x 3 x 2`` cells,
over two thousand) compiles a program per cell, too slow for CI. It is sampled with a fixed
seed (``SEED``) as a pairwise covering: every (entry point, transform) pair and every
(transform, context) pair and every (entry point, context) pair appears at least once,
each cell with a device count and walker count from the seeded generator. Change
``SEED`` to draw other cells; ``SHARDVMC_CONFORMANCE=full`` runs the whole product.

Cells whose result is a documented error rather than a value (``_expected_error``):

- arrays committed to a sub-mesh passed to a kernel of all devices inside a trace raise
  the ``CallError`` that names the argument and both meshes (one traced program runs on
  one set of devices; an eager call runs on the arrays' mesh instead). A kernel whose own
  mesh spans other devices than the context mesh computes on the context mesh inside a
  trace: a value, compared.
- ``shardvmc.kfac.Optimizer`` refuses a walker count its mesh does not divide (padding
  cannot be masked out of a loss shardvmc does not write), and a call inside a trace under
  a mesh context (``jax.set_mesh``, ``jax.sharding.set_mesh``): the traced program runs on
  the context mesh's axes, where the loss's collectives over its ``pmap_axis_name`` find
  no axis. Eagerly, under any context, it runs on its own mesh: a value, compared.

Entry points that are not differentiable by design (the solver's update, the Monte Carlo
statistics, the optimiser's step) are run under the transforms that do not differentiate;
the optimiser's step under those that make sense for it (``Entry.transforms``: not
``vmap``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from optional_imports import import_or_skip

import shardvmc as sv
import shardvmc.optax as svx
from shardvmc import Mean, PerWalker, Replicated, WalkerKey

pytestmark = pytest.mark.usefixtures("x64_padded")  # float64, padded walker counts without PaddingWarning

SEED = 20261202
RTOL = 1e-9
DEVICES = (1, 3, 8)
COUNTS = ("divisible", "uneven")


# ---- the per-walker program: a small network with the constructs of real code ------------------------


def log_psi(params: dict[str, jax.Array], r: jax.Array) -> jax.Array:
    n = r.shape[0]
    h = jnp.tanh(r @ params["w"] + params["b"])
    d = jnp.linalg.norm(r[:, None, :] - r[None, :, :] + jnp.eye(n)[..., None], axis=-1) * (1.0 - jnp.eye(n))
    return jnp.sum(h @ params["v"]) + jnp.sum(d / (1.0 + params["a"] * d)) - jnp.sum(params["z"] ** 2 * r**2)


def local_energy(params: dict[str, jax.Array], r: jax.Array) -> jax.Array:
    grad = jax.grad(log_psi, argnums=1)(params, r)
    hess = jax.hessian(log_psi, argnums=1)(params, r).reshape(r.size, r.size)
    return -0.5 * (jnp.trace(hess) + jnp.sum(grad**2)) + jnp.sum(r**2)


def make_params() -> dict[str, jax.Array]:
    k = jax.random.split(jax.random.key(0), 3)
    return {
        "w": jax.random.normal(k[0], (3, 4), jnp.float64) * 0.5,
        "b": jax.random.normal(k[1], (4,), jnp.float64) * 0.1,
        "v": jax.random.normal(k[2], (4,), jnp.float64),
        "a": jnp.float64(0.7),
        "z": jnp.float64(0.6),
    }


def walkers(n: int) -> jax.Array:
    return jax.random.normal(jax.random.key(1), (n, 3, 3), jnp.float64)


KEY_SEED = 7


def noise(key: jax.Array) -> jax.Array:
    return 1e-2 * jax.random.normal(key, (), jnp.float64)


# ---- entry points: (the function under test on a mesh, its reference) ---------------------------------
# Each takes the mesh it is given (None: the call's own resolution) and returns f(x, rest) where x is the
# differentiated input (the parameters, or J) and rest the others; outputs are pytrees of arrays.


@dataclasses.dataclass(frozen=True)
class Entry:
    name: str
    make: Callable[[Any], Callable[..., Any]]  # mesh -> f(x, *rest)
    reference: Callable[..., Any]  # f(x, *rest) on one device, jax.vmap
    inputs: Callable[[int], tuple[Any, ...]]  # n walkers -> (x, *rest)
    differentiable: bool = True
    walker_outputs: bool = True  # whether outputs have a walker axis (vmap/scan stack around it)
    transforms: tuple[str, ...] | None = None  # the transforms that make sense for it (None: all of them)
    placement: bool = False  # outputs (walker data, replicated data), padded to the mesh, placed by the rule


def _usable(e: Entry) -> list[str]:
    """The transforms an entry point runs under: its own list, without those that differentiate if it is not."""
    allowed = TRANSFORMS if e.transforms is None else e.transforms
    return [t for t, (_, diff) in TRANSFORMS.items() if t in allowed and (e.differentiable or not diff)]


def _energy_kernel(mesh: Any) -> Callable[..., Any]:
    @sv.walker_parallel(mesh=mesh)
    def energy(
        params: Replicated[dict], r: PerWalker[jax.Array], key: WalkerKey
    ) -> tuple[PerWalker[jax.Array], Mean[jax.Array]]:
        e = local_energy(params, r) + noise(key)
        return e, e

    return lambda p, r: energy(p, r, jax.random.key(KEY_SEED))


def _energy_reference(p: Any, r: jax.Array) -> Any:
    keys = jax.vmap(jax.random.fold_in, (None, 0))(jax.random.key(KEY_SEED), jnp.arange(r.shape[0]))
    e = jax.vmap(lambda r, k: local_energy(p, r) + noise(k))(r, keys)
    return e, jnp.mean(e)


def _replicated_args_kernel(mesh: Any) -> Callable[..., Any]:
    @sv.walker_parallel(mesh=mesh)
    @sv.replicated_args("params")
    def psi(params, r, *, scale: sv.Replicated[jax.Array]):  # keyword-only, too
        return scale * log_psi(params, r)

    return lambda p, r: psi(p, r, scale=jnp.float64(0.5))


def drift(params: dict[str, jax.Array], r: jax.Array) -> tuple[jax.Array, jax.Array]:
    """log|psi| and the squared norm of its gradient with respect to the walker (cheaper than the Laplacian)."""
    return log_psi(params, r), jnp.sum(jax.grad(log_psi, argnums=1)(params, r) ** 2)


def _shard_vmap(mesh: Any) -> Callable[..., Any]:
    return sv.shard_vmap(drift, mesh=mesh, in_axes=(None, 0))


def _batched_vmap(mesh: Any) -> Callable[..., Any]:
    return sv.sharded_batched_vmap(log_psi, 2, mesh=mesh, in_axes=(None, 0))


def _reductions(mesh: Any) -> Callable[..., Any]:
    def f(p: Any, r: jax.Array) -> Any:
        x = r.reshape(r.shape[0], -1) * p["z"]
        return sv.walker_mean(x, mesh=mesh), sv.walker_sum(x**2, mesh=mesh)

    return f


def _gram(mesh: Any) -> Callable[..., Any]:
    return lambda j, e: (sv.jtj(j, mesh=mesh), sv.jtv(j, e, mesh=mesh))


def _solver(mesh: Any) -> Callable[..., Any]:
    return lambda j, e: sv.natural_gradient(j, e, damping=1e-3, method="dense", mesh=mesh)[0]


def _chain(mesh: Any) -> Callable[..., Any]:
    ng = svx.natural_gradient(damping=1e-3, method="minsr", mesh=mesh)

    def f(j: jax.Array, e: jax.Array) -> Any:
        zeros = jnp.zeros(j.shape[1], j.dtype)
        return ng.update(zeros, ng.init(zeros), jacobian=j, local_energies=e)[0]

    return f


def _stats(mesh: Any) -> Callable[..., Any]:
    def f(x: jax.Array) -> Any:
        s = sv.statistics(x, mesh=mesh)
        return s.mean, s.error_of_mean, s.variance

    return f


def _accumulator(mesh: Any) -> Callable[..., Any]:
    def f(x: jax.Array) -> Any:
        # max_blocks = the 12 steps: the buffer fills and is never merged, so the blocks are the series itself and
        # every statistic equals sv.statistics of the stored series to round-off (the class docstring).
        acc = sv.StatsAccumulator.create(x[:, 0], max_blocks=12)
        acc, _ = jax.lax.scan(lambda acc, xt: (acc.update(xt), None), acc, x.T)  # the steps of a sampling loop
        s = acc.statistics(mesh=mesh)
        return s.mean, s.error_of_mean, s.variance

    return f


KFAC_AXIS = "qmc_pmap_axis"
KFAC_SETTINGS: dict[str, Any] = dict(  # no sampling in the curvature (fisher_exact): the same on any device count
    l2_reg=0.0,
    norm_constraint=1e-3,
    learning_rate_schedule=lambda t: 0.1,
    num_burnin_steps=0,
    estimation_mode="fisher_exact",
    pmap_axis_name=KFAC_AXIS,
)


def _kfac_jax() -> Any:
    kfac_jax = import_or_skip("kfac_jax")  # kfac-jax 0.0.8 cannot be imported on JAX >= 0.11: skipped, with the reason
    import shardvmc.kfac  # noqa: F401  (its import fixes kfac-jax 0.0.8 for JAX >= 0.9.2, the reference's too)

    return kfac_jax


def _dense_loss(params: dict[str, jax.Array], r: jax.Array) -> jax.Array:
    """One dense layer in FermiNet's calling convention: a block of walkers, its own pmean over the pmap axis."""
    kfac_jax = _kfac_jax()
    y = jnp.tanh(r @ params["w"] + params["b"])
    kfac_jax.register_squared_error_loss(y)
    return kfac_jax.utils.pmean_if_pmap(jnp.mean(y**2), KFAC_AXIS)


def _kfac_step(opt: Any, params: Any, r: jax.Array) -> Any:
    """init and one step (the step number given: kfac-jax needs it inside jit); the new parameters and the loss."""
    state = opt.init(params, jax.random.key(KEY_SEED), r)
    step = opt.step(params, state, jax.random.key(KEY_SEED + 1), batch=r, momentum=0.0, damping=1e-3, global_step_int=0)
    return step[0], step[-1]["loss"]


def _kfac(mesh: Any) -> Callable[..., Any]:
    _kfac_jax()
    import shardvmc.kfac

    return lambda p, r: _kfac_step(
        shardvmc.kfac.Optimizer(jax.value_and_grad(_dense_loss), mesh=mesh, **KFAC_SETTINGS), p, r
    )


def _kfac_reference(p: Any, r: jax.Array) -> Any:
    """kfac-jax itself on one device, the whole batch at once: an independent oracle."""
    kfac_jax = _kfac_jax()

    def loss(p: Any, r: jax.Array) -> jax.Array:
        assert not kfac_jax.utils.in_pmap(KFAC_AXIS)  # so the loss's pmean_if_pmap is a no-op here
        return _dense_loss(p, r)

    opt = kfac_jax.Optimizer(jax.value_and_grad(loss), multi_device=False, **KFAC_SETTINGS)
    return _kfac_step(opt, jax.tree_util.tree_map(jnp.copy, p), r)  # a copy: kfac-jax's step donates the parameters


def _kfac_inputs(n: int) -> tuple[dict[str, jax.Array], jax.Array]:
    k1, k2 = jax.random.split(jax.random.key(5))
    params = {"w": jax.random.normal(k1, (3, 4), jnp.float64) / 3, "b": jnp.zeros(4, jnp.float64)}
    return params, jax.random.normal(k2, (n, 3), jnp.float64)


def _jacobian_inputs(n: int) -> tuple[jax.Array, jax.Array]:
    k1, k2 = jax.random.split(jax.random.key(3))
    return jax.random.normal(k1, (n, 6), jnp.float64), jax.random.normal(k2, (n,), jnp.float64)


def _centred(j: jax.Array, e: jax.Array) -> tuple[jax.Array, jax.Array]:
    n = j.shape[0]
    return (j - j.mean(0)) / jnp.sqrt(n), (e - e.mean()) / jnp.sqrt(n)


def _solver_reference(j: jax.Array, e: jax.Array) -> jax.Array:
    jc, ec = _centred(j, e)
    return jnp.linalg.solve(jc.T @ jc + 1e-3 * jnp.eye(j.shape[1]), jc.T @ ec)


def _stats_reference(x: jax.Array) -> Any:
    s = sv.statistics(x, mesh=sv.create_mesh(jax.devices()[:1]))
    return s.mean, s.error_of_mean, s.variance


def _series(n: int) -> tuple[jax.Array]:
    return (jnp.float64(-2.5) + 0.1 * jax.random.normal(jax.random.key(4), (n, 12), jnp.float64),)


# ---- the placement functions: outputs (walker data, replicated data), checked for where they are too -----
# Each pads its walkers to the mesh it resolves (``Entry.padded``): the rows past the reference's are padding.

PAD_TO = 24  # a multiple of every device count of DEVICES: walkers padded to it split over any of these meshes


def _placed(mesh: Any) -> Callable[..., Any]:
    def f(p: Any, r: jax.Array) -> Any:
        padded, _ = sv.pad_walker({"r": r * p["z"], "a": p["a"]}, sv.pad_n_walkers(r.shape[0], PAD_TO))
        placed = sv.shard_walker(padded, mesh)  # the scalar leaf "a" is replicated
        return placed["r"], (placed["a"], sv.replicate(p, mesh))

    return f


def _placed_reference(p: Any, r: jax.Array) -> Any:
    x = r * p["z"]
    extra = sv.pad_n_walkers(r.shape[0], PAD_TO) - r.shape[0]
    return jnp.concatenate([x, jnp.repeat(x[:1], extra, axis=0)]), (p["a"], p)


def _one_walker(key: jax.Array) -> jax.Array:
    return jax.random.normal(key, (3, 3), jnp.float64)


def _initialised(mesh: Any) -> Callable[..., Any]:
    def f(p: Any, r: jax.Array) -> Any:  # (p unused: walkers from a key, and from walkers given)
        n, key = r.shape[0], jax.random.key(KEY_SEED)
        drawn = sv.initialize_walkers_sharded(_one_walker, n, mesh, key=key)
        given = sv.initialize_walkers_sharded(_one_walker, n, mesh, initial_walkers={"r": r})
        return (drawn.data, given.data["r"]), ()

    return f


def _initialised_reference(p: Any, r: jax.Array) -> Any:
    keys = jax.vmap(jax.random.fold_in, (None, 0))(jax.random.key(KEY_SEED), jnp.arange(r.shape[0]))
    return (jax.vmap(_one_walker)(keys), r), ()


def _loaded(mesh: Any) -> Callable[..., Any]:
    def f(p: Any, r: jax.Array) -> Any:
        n = r.shape[0]
        with tempfile.TemporaryDirectory() as directory:
            sv.save_walkers(os.path.join(directory, "walkers"), sv.WalkerSet({"r": np.asarray(r)}, n))
            walkers, _, _ = sv.load_walkers(os.path.join(directory, "walkers"), {"r": r[:1]}, mesh)
            sv.save_state(os.path.join(directory, "state"), {"w": sv.WalkerSet(np.asarray(r), n), "p": p})
            state, _ = sv.load_state(os.path.join(directory, "state"), {"w": sv.WalkerSet(r, n), "p": p}, mesh=mesh)
        return (walkers.data["r"], state["w"].data), state["p"]

    return f


ENTRIES = (
    Entry("walker_parallel", _energy_kernel, _energy_reference, lambda n: (make_params(), walkers(n))),
    Entry(
        "replicated_args",
        _replicated_args_kernel,
        lambda p, r: 0.5 * jax.vmap(log_psi, (None, 0))(p, r),
        lambda n: (make_params(), walkers(n)),
    ),
    Entry(
        "shard_vmap",
        _shard_vmap,
        lambda p, r: jax.vmap(drift, (None, 0))(p, r),
        lambda n: (make_params(), walkers(n)),
    ),
    Entry(
        "sharded_batched_vmap",
        _batched_vmap,
        lambda p, r: jax.vmap(log_psi, (None, 0))(p, r),
        lambda n: (make_params(), walkers(n)),
    ),
    Entry(
        "walker_mean/walker_sum",
        _reductions,
        lambda p, r: (
            jnp.mean(r.reshape(r.shape[0], -1) * p["z"], 0),
            jnp.sum((r.reshape(r.shape[0], -1) * p["z"]) ** 2, 0),
        ),
        lambda n: (make_params(), walkers(n)),
        walker_outputs=False,
    ),
    Entry(
        "jtj/jtv",
        _gram,
        lambda j, e: (j.T @ j, j.T @ e),
        _jacobian_inputs,
        walker_outputs=False,
    ),
    Entry("natural_gradient", _solver, _solver_reference, _jacobian_inputs, differentiable=False, walker_outputs=False),
    Entry("optax.natural_gradient", _chain, _solver_reference, _jacobian_inputs, False, walker_outputs=False),
    Entry("statistics", _stats, _stats_reference, _series, differentiable=False, walker_outputs=False),
    Entry("StatsAccumulator", _accumulator, _stats_reference, _series, differentiable=False, walker_outputs=False),
    Entry(
        "kfac.Optimizer",
        _kfac,
        _kfac_reference,
        _kfac_inputs,
        differentiable=False,
        walker_outputs=False,
        transforms=("eager", "jit", "scan", "cond", "eval_shape", "lower_compile"),  # an optimiser's step
    ),
    Entry("shard_walker/pad_walker/replicate", _placed, _placed_reference, lambda n: (make_params(), walkers(n)),
          differentiable=False, placement=True),
    Entry("initialize_walkers_sharded", _initialised, _initialised_reference, lambda n: (make_params(), walkers(n)),
          differentiable=False, placement=True),
    Entry("load_walkers/load_state", _loaded, lambda p, r: ((r, r), p), lambda n: (make_params(), walkers(n)),
          differentiable=False, placement=True, transforms=("eager",)),  # files: read and written eagerly
)  # fmt: skip


# ---- transforms: (run f, run the reference) -> outputs to compare -------------------------------------


def _loss(out: Any) -> jax.Array:
    return sum(jnp.sum(jnp.sin(leaf)) for leaf in jax.tree_util.tree_leaves(out))


def _eager(f, x, *rest):
    return f(x, *rest)


def _jit(f, x, *rest):
    return jax.jit(f)(x, *rest)


def _grad(f, x, *rest):
    return jax.grad(lambda x: _loss(f(x, *rest)))(x)


def _value_and_grad(f, x, *rest):
    return jax.jit(jax.value_and_grad(lambda x: _loss(f(x, *rest))))(x)


def _vjp(f, x, *rest):
    out, pull = jax.vjp(lambda x: f(x, *rest), x)
    return out, pull(jax.tree_util.tree_map(jnp.cos, out))


def _jvp(f, x, *rest):
    tangent = jax.tree_util.tree_map(lambda a: jnp.full_like(a, 0.3), x)
    return jax.jvp(lambda x: f(x, *rest), (x,), (tangent,))


def _vmap(f, x, *rest):
    xs = jax.tree_util.tree_map(lambda a: jnp.stack([a, 1.1 * a]), x)
    return jax.vmap(lambda x: f(x, *rest))(xs)


def _scan(f, x, *rest):
    def step(carry, scale):
        return carry, f(jax.tree_util.tree_map(lambda a: scale * a, x), *rest)

    return jax.lax.scan(step, 0.0, jnp.array([1.0, 0.9]))[1]


def _cond(f, x, *rest):
    other = lambda x: jax.tree_util.tree_map(jnp.zeros_like, f(x, *rest))  # noqa: E731
    return jax.jit(lambda x, flag: jax.lax.cond(flag, lambda x: f(x, *rest), other, x))(x, True)


def _checkpoint(f, x, *rest):
    return jax.grad(jax.checkpoint(lambda x: _loss(f(x, *rest))))(x)


def _eval_shape(f, x, *rest):
    shapes = jax.eval_shape(f, *[_abstract(a) for a in (x, *rest)])
    return jax.tree_util.tree_map(lambda s: np.zeros(s.shape, s.dtype), shapes)


def _aot(f, x, *rest):
    compiled = jax.jit(f).lower(*[_abstract(a) for a in (x, *rest)]).compile()
    return compiled(x, *rest)


def _abstract(tree: Any) -> Any:
    """The arguments' types, with the placement of committed arrays (the program is compiled for where they live)."""

    def struct(a: Any) -> jax.ShapeDtypeStruct:
        sharding = a.sharding if isinstance(a, jax.Array) and a.committed else None
        return jax.ShapeDtypeStruct(np.shape(a), jnp.result_type(a), sharding=sharding)

    return jax.tree_util.tree_map(struct, tree)


TRANSFORMS: dict[str, tuple[Callable[..., Any], bool]] = {  # name: (transform, differentiates)
    "eager": (_eager, False),
    "jit": (_jit, False),
    "grad": (_grad, True),
    "value_and_grad": (_value_and_grad, True),
    "vjp": (_vjp, True),
    "jvp": (_jvp, True),
    "vmap": (_vmap, False),
    "scan": (_scan, False),
    "cond": (_cond, False),
    "checkpoint": (_checkpoint, True),
    "eval_shape": (_eval_shape, False),
    "lower_compile": (_aot, False),
}
TRACED = set(TRANSFORMS) - {"eager"}


# ---- mesh contexts ------------------------------------------------------------------------------------


def _devices(d: int) -> list[Any]:
    return jax.devices()[:d]


@contextlib.contextmanager
def _global_mesh(mesh: Any) -> Iterator[None]:
    jax.sharding.set_mesh(mesh)  # as another library does at import (NetKet: ("S",))
    try:
        yield
    finally:
        jax.sharding.set_mesh(None)


def _explicit(d: int, name: str) -> Any:
    return jax.make_mesh((d,), (name,), devices=_devices(d))


# name: (mesh given to the entry point, context manager, inputs committed to a mesh)
CONTEXTS: dict[str, Callable[[int], tuple[Any, Any, Any]]] = {
    "mesh=": lambda d: (sv.create_mesh(_devices(d)), contextlib.nullcontext(), None),
    "mesh= explicit": lambda d: (_explicit(d, "walkers"), contextlib.nullcontext(), None),
    "use_mesh": lambda d: (None, sv.use_mesh(sv.create_mesh(_devices(d))), None),
    "set_mesh auto": lambda d: (None, jax.set_mesh(sv.create_mesh(_devices(d))), None),
    "set_mesh explicit": lambda d: (None, jax.set_mesh(_explicit(d, "walkers")), None),
    "set_mesh other axis": lambda d: (None, jax.set_mesh(_explicit(d, "S")), None),
    "global set_mesh other axis": lambda d: (None, _global_mesh(_explicit(d, "S")), None),
    "mesh= inside another mesh": lambda d: (
        sv.create_mesh(_devices(d)),
        jax.set_mesh(jax.make_mesh((len(jax.devices()),), ("S",))),
        None,
    ),
    "inputs on a sub-mesh": lambda d: (None, contextlib.nullcontext(), sv.create_mesh(_devices(d))),
}


MESH_CONTEXTS = {  # the contexts that set a mesh context (jax.set_mesh, jax.sharding.set_mesh)
    "set_mesh auto",
    "set_mesh explicit",
    "set_mesh other axis",
    "global set_mesh other axis",
    "mesh= inside another mesh",
}


def _expected_error(entry: str, context: str, transform: str, d: int, n: int) -> tuple[type[Exception] | None, bool]:
    """The documented error of a cell, and whether it must be raised (else the cell may give the right value).

    Any other error fails the cell. Arrays on a sub-mesh in a traced step: the ``CallError``
    naming them, or the right value where JAX runs the step eagerly (``grad``, ``vmap``...
    outside ``jit`` run on the arrays' mesh).
    """
    if entry == "kfac.Optimizer":
        if n % d:  # padding cannot be masked out of a loss shardvmc does not write
            return sv.CallError, True
        if transform in TRACED and context in MESH_CONTEXTS:  # the loss's collectives name the optimiser's axis
            return sv.CallError, True
    if context == "inputs on a sub-mesh" and transform in TRACED and d != len(jax.devices()):
        return sv.CallError, False
    return None, False


# ---- the sample ---------------------------------------------------------------------------------------


def _cells() -> list[tuple[str, str, str, int, str]]:
    rng = random.Random(SEED)
    entries = [e.name for e in ENTRIES]
    usable = {e.name: _usable(e) for e in ENTRIES}
    if os.environ.get("SHARDVMC_CONFORMANCE") == "full":
        return [(e, t, c, d, n) for e in entries for t in usable[e] for c in CONTEXTS for d in DEVICES for n in COUNTS]
    cells: set[tuple[str, str, str]] = set()
    contexts = list(CONTEXTS)
    for e in entries:  # every (entry point, transform) pair
        for t in usable[e]:
            cells.add((e, t, rng.choice(contexts)))
    for t in TRANSFORMS:  # every (transform, context) pair
        for c in contexts:
            if not any(cell[1] == t and cell[2] == c for cell in cells):
                cells.add((rng.choice([e for e in entries if t in usable[e]]), t, c))
    for e in entries:  # every (entry point, context) pair
        for c in contexts:
            if not any(cell[0] == e and cell[2] == c for cell in cells):
                cells.add((e, rng.choice(usable[e]), c))
    ordered = sorted(cells)
    return [(e, t, c, rng.choice(DEVICES), rng.choice(COUNTS)) for e, t, c in ordered]


CELLS = _cells()
ENTRY = {e.name: e for e in ENTRIES}


def test_the_sample_covers_every_pair():
    seen_et = {(e, t) for e, t, *_ in CELLS}
    seen_tc = {(t, c) for _, t, c, *_ in CELLS}
    seen_ec = {(e, c) for e, _, c, *_ in CELLS}
    for e in ENTRIES:
        assert all((e.name, t) in seen_et for t in _usable(e))
        assert not any(t not in _usable(e) for name, t in seen_et if name == e.name)
        assert all((e.name, c) in seen_ec for c in CONTEXTS)
    assert all((t, c) in seen_tc for t in TRANSFORMS for c in CONTEXTS)
    assert {d for *_, d, _ in CELLS} == set(DEVICES) and {n for *_, n in CELLS} == set(COUNTS)


def _walker_count(d: int, count: str) -> int:
    return 4 * d if count == "divisible" else 4 * d + 1 if d > 1 else 5


@pytest.mark.parametrize(
    ("entry", "transform", "context", "d", "count"), CELLS, ids=["|".join(map(str, c)) for c in CELLS]
)
def test_cell(entry: str, transform: str, context: str, d: int, count: str) -> None:
    e = ENTRY[entry]
    run, _ = TRANSFORMS[transform]
    n = _walker_count(d, count)
    inputs = e.inputs(n)
    expected = run(e.reference, *inputs)
    mesh, ctx, committed = CONTEXTS[context](d)
    if committed is not None:  # left there by kernels on that mesh: walker data sharded, the rest replicated
        inputs = tuple(
            sv.shard_walker(a, committed)
            if np.ndim(a) and np.shape(a)[0] == n and n % d == 0
            else sv.replicate(a, committed)
            for a in inputs
        )
    error, required = _expected_error(entry, context, transform, d, n)
    with ctx:
        f = e.make(mesh)
        if required:
            with pytest.raises(error):
                jax.block_until_ready(run(f, *inputs))
            return
        try:
            got = jax.block_until_ready(run(f, *inputs))
        except Exception as err:
            if error is None or not isinstance(err, error):
                raise
            return  # the documented error; where JAX can place the arrays, the result is compared below
    if e.placement:
        got = _placement_checked(got, expected, context, transform, d)
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(expected)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(expected)):
        assert np.shape(a) == np.shape(b)
        if transform != "eval_shape":
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=RTOL, atol=1e-12)


def _rule(context: str, d: int, transform: str) -> tuple[Any, str]:
    """Where walkers go in a context: (mesh, walker axis), the table of docs/concepts.md written out (an oracle).

    Meshes of the same devices in the same order and the same split are the same placement, whatever their axis
    names and types (``is_equivalent_to``).
    """
    everything, traced = jax.make_mesh((len(jax.devices()),), ("S",)), transform in TRACED
    return {
        "mesh=": (sv.create_mesh(_devices(d)), "walkers"),
        "mesh= explicit": (_explicit(d, "walkers"), "walkers"),
        "use_mesh": (sv.create_mesh(_devices(d)), "walkers"),
        "set_mesh auto": (sv.create_mesh(_devices(d)), "walkers"),
        "set_mesh explicit": (_explicit(d, "walkers"), "walkers"),
        "set_mesh other axis": (_explicit(d, "S"), "S"),  # no walkers axis: over all of its axes
        "global set_mesh other axis": (_explicit(d, "S"), "S"),
        # another mesh context: eagerly the mesh= one, inside a trace the context's (the same when d is all devices)
        "mesh= inside another mesh": (everything, "S") if traced else (sv.create_mesh(_devices(d)), "walkers"),
        "inputs on a sub-mesh": (sv.create_mesh(), "walkers"),  # placing chooses: no mesh chosen, all devices
    }[context]


def _placement_checked(got: Any, expected: Any, context: str, transform: str, d: int) -> Any:
    """The outputs of a placement entry with the padding rows left out, once checked: as many rows as the mesh of
    the rule pads the walkers to and, eagerly, every walker leaf split over the rule's mesh and every other leaf
    replicated on it."""
    mesh, axis = _rule(context, d, transform)
    walker_axis = 1 if transform in ("vmap", "scan") else 0  # (the transform stacks its two calls in front)

    def trimmed(a: Any, b: Any) -> Any:
        rows = np.shape(b)[walker_axis]
        assert np.shape(a)[walker_axis] == sv.pad_n_walkers(rows, mesh.shape[axis]), (np.shape(a), mesh.shape)
        if transform == "eager":
            where = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(axis))
            assert a.sharding.is_equivalent_to(where, a.ndim), (a.sharding, where)
        return np.asarray(a).take(np.arange(rows), axis=walker_axis)

    if transform == "eager":
        everywhere = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        for a in jax.tree_util.tree_leaves(got[1]):
            assert a.sharding.is_equivalent_to(everywhere, a.ndim), (a.sharding, everywhere)
    return jax.tree_util.tree_map(trimmed, got[0], expected[0]), got[1]


def test_a_repeated_call_in_every_context_reuses_its_program():
    """Calls in one context after calls in another give the same results: nothing depends on call history."""
    e = ENTRY["walker_parallel"]
    p, r = e.inputs(13)
    expected = e.reference(p, r)
    kernel = e.make(sv.create_mesh(_devices(3)))
    order = ["mesh=", "mesh= inside another mesh", "mesh=", "set_mesh other axis", "mesh="]
    for context in order + order[::-1]:
        _, ctx, _ = CONTEXTS[context](3)
        with ctx:
            got = kernel(p, r)
        for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(expected)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=RTOL)


def test_a_kernel_of_other_devices_runs_inside_a_trace_under_another_mesh():
    """A 3-device kernel under an 8-device jax.set_mesh: eagerly on its devices, traced on the context's."""
    n = len(jax.devices())
    x = jnp.ones((6, 3))

    @sv.walker_parallel(mesh=sv.create_mesh(_devices(3)))
    def e(r: PerWalker[jax.Array]) -> Mean[jax.Array]:
        return jnp.sum(r**2)

    with jax.set_mesh(sv.create_mesh()):
        eager = e(x)
        jitted = jax.jit(e)(x)
        grad = jax.grad(e)(x)
        scanned = jax.lax.scan(lambda c, s: (c + e(s * x), None), 0.0, jnp.array([1.0, 2.0]))[0]
        again = e(x)  # eager after traced calls in the same context: on its own devices again
    assert float(eager) == float(jitted) == float(again) == 3.0 and float(scanned) == 15.0
    assert len(again.sharding.device_set) == 3
    np.testing.assert_allclose(np.asarray(grad), np.full((6, 3), 2.0 / 6))
    assert len(eager.sharding.device_set) == 3 and len(jitted.sharding.device_set) == n


def test_arrays_on_a_sub_mesh_inside_jit_raise_a_call_error_naming_them():
    """Inside jax.jit each entry point names the argument and both meshes; eagerly the same calls run there."""
    if len(jax.devices()) < 4:
        pytest.skip("needs a mesh smaller than all devices")
    sub = sv.create_mesh(_devices(3))
    j, e = (sv.shard_walker(a, sub) for a in _jacobian_inputs(12))
    p, r = make_params(), sv.shard_walker(walkers(12), sub)
    calls = {
        "Replicated parameter 'params'": (
            lambda p, r: ENTRY["walker_parallel"].make(None)(p, r),
            (sv.replicate(p, sub), r),
        ),
        "J": (lambda j, e: sv.natural_gradient(j, e, damping=1e-3, method="dense")[0], (j, e)),
        "parameter 'J'": (lambda j, e: sv.jtj(j), (j, e)),
    }
    for name, (f, args) in calls.items():
        expected = f(*args)  # eagerly: on the arrays' mesh
        assert len(jax.tree_util.tree_leaves(expected)[0].sharding.device_set) == 3
        with pytest.raises(sv.CallError) as info:
            jax.jit(f)(*args)
        text = str(info.value)
        assert name in text and "{'walkers': 3}" in text and str(list(range(len(jax.devices())))) in text


def test_a_kernel_without_a_mesh_follows_use_mesh_call_by_call():
    """The jit kept per chosen mesh (no mesh context) follows sv.use_mesh in and out, in any order."""
    e = ENTRY["walker_parallel"]
    p, r = e.inputs(12)
    expected = e.reference(p, r)
    kernel = e.make(None)
    n = len(jax.devices())
    for d in (3, n, 1, 3, n):
        ctx = sv.use_mesh(sv.create_mesh(_devices(d))) if d != n else contextlib.nullcontext()
        with ctx:
            got = kernel(p, r)
        assert len(got[0].sharding.device_set) == d
        np.testing.assert_allclose(np.asarray(got[1]), np.asarray(expected[1]), rtol=RTOL)


def test_kfac_places_host_data_on_its_own_mesh_under_a_mesh_context_of_the_same_devices():
    """The optimiser owns its mesh (its loss names the mesh's axis): host batches and parameters go there, not to the
    context mesh that placement picks for everything else (a global ("S",) mesh of the same devices)."""
    p, r = (jax.tree_util.tree_map(np.asarray, a) for a in _kfac_inputs(16))  # host data
    expected = _kfac_reference(p, r)
    with _global_mesh(_explicit(len(jax.devices()), "S")):
        got = _kfac(None)(p, r)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(expected)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=RTOL, atol=1e-12)
