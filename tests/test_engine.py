"""The gradient-correctness matrix of the engine, every cell against ``jax.vmap`` on one device.

Rows: derivatives taken inside the body (grad, jacobian, hessian with respect to
``Replicated`` and ``PerWalker`` arguments) and outside it (``grad``,
``value_and_grad``, ``jvp``, ``vjp`` through ``PerWalker``, ``Mean``, ``Sum`` and tuple
outputs, under ``jax.jit``). Columns: meshes of 1, 3 and 8 devices; an uneven walker
count padded inside the kernel, and a padded ``WalkerSet`` whose padding rows hold
garbage; the body vmapped, chunked with ``batch_size`` and written as a block
(``batched=True``). Float64 throughout, so agreement is to round-off.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree
from meshes import mesh_of

import shardvmc as sv
from shardvmc import Mean, PerWalker, Replicated, Sum

pytestmark = pytest.mark.usefixtures("x64_padded")  # float64, padded walker counts without PaddingWarning

N = 13  # divisible by none of the meshes but 1
RTOL = 1e-10


def log_psi(params, r):
    """A small network of one walker (3 electrons), with the constructs of real code."""
    n = r.shape[0]
    h = jnp.tanh(r @ params["w"] + params["b"])
    ee = r[:, None, :] - r[None, :, :]
    d = jnp.linalg.norm(ee + jnp.eye(n)[..., None], axis=-1) * (1.0 - jnp.eye(n))
    return jnp.sum(h @ params["v"]) + jnp.sum(d / (1.0 + params["a"] * d)) - jnp.sum(jnp.abs(params["z"]) * r**2)


def make_params():
    k = jax.random.split(jax.random.key(0), 3)
    return {
        "w": jax.random.normal(k[0], (3, 4), jnp.float64) * 0.5,
        "b": jax.random.normal(k[1], (4,), jnp.float64) * 0.1,
        "v": jax.random.normal(k[2], (4,), jnp.float64),
        "a": jnp.float64(0.7),
        "z": jnp.float64(0.3),
    }


def walkers(n):
    return jax.random.normal(jax.random.key(1), (n, 3, 3), jnp.float64)


# ---- derivatives inside the body ---------------------------------------------------------------


def inside(params, r):
    """Every derivative a per-walker body takes, with respect to params and to the walker."""
    flat, unravel = ravel_pytree(params)
    lp = lambda p, x: log_psi(unravel(p), x)  # noqa: E731
    return {
        "grad_p": jax.grad(lp)(flat, r),
        "grad_r": jax.grad(lp, 1)(flat, r),
        "jac_p": jax.jacrev(lambda p: jnp.tanh(r @ unravel(p)["w"]))(flat),
        "jac_r": jax.jacfwd(jax.grad(lp, 1), 1)(flat, r),
        "hess_p": jax.hessian(lp)(flat, r),
        "mixed": jax.jacfwd(jax.grad(lp), 1)(flat, r),
    }


MAPPINGS = {
    "vmap": dict(),
    "batch_size": dict(batch_size=2),
}


# Every mapping on the 3-device mesh (uneven: it pads); the plain vmap on 1 and 8 devices too.
CELLS = [(3, "vmap"), (3, "batch_size"), (1, "vmap"), (8, "vmap")]


@functools.cache
def inside_reference():
    return jax.jit(jax.vmap(inside, (None, 0)))(make_params(), walkers(N))


@pytest.mark.parametrize("n_devices, mapping", CELLS, ids=[f"{d}dev-{m}" for d, m in CELLS])
def test_derivatives_inside_the_body(n_devices, mapping):
    params, r = make_params(), walkers(N)
    ref = inside_reference()
    kernel = sv.walker_parallel(sv.replicated_args("params")(inside), mesh=mesh_of(n_devices), **MAPPINGS[mapping])
    out = kernel(params, r)
    for name in ref:
        np.testing.assert_allclose(out[name], ref[name], rtol=RTOL, atol=1e-12, err_msg=name)


def test_derivatives_inside_a_block_body():
    params, r = make_params(), walkers(N)
    ref = inside_reference()
    block = sv.walker_parallel(
        sv.replicated_args("params")(lambda params, r: jax.vmap(inside, (None, 0))(params, r)),
        mesh=mesh_of(3),
        batched=True,
    )
    out = block(params, r)
    for name in ref:
        np.testing.assert_allclose(out[name], ref[name], rtol=RTOL, atol=1e-12, err_msg=name)


# ---- derivatives of the kernel's outputs, taken outside -----------------------------------------


def per_walker(params: Replicated[dict], r: PerWalker[jax.Array]) -> PerWalker[jax.Array]:
    return log_psi(params, r)


def mean(params: Replicated[dict], r: PerWalker[jax.Array]) -> Mean[jax.Array]:
    return log_psi(params, r) ** 2


def total(params: Replicated[dict], r: PerWalker[jax.Array]) -> Sum[jax.Array]:
    return jnp.sin(log_psi(params, r))


def several(params: Replicated[dict], r: PerWalker[jax.Array]) -> tuple[PerWalker[jax.Array], Mean, Sum]:
    lp = log_psi(params, r)
    return lp, {"lp2": lp**2, "r": r}, jnp.cos(lp)


def losses(kernels, params, r, n_valid):
    """Scalar functions of every output kind; ``kernels`` are sharded or the vmap reference."""
    pw, mn, sm, sev = kernels

    def loss(params, r):
        a = pw(params, r)[:n_valid]
        lp, m, s = sev(params, r)
        return (
            jnp.sum(a**3)
            + 2.0 * mn(params, r)
            - sm(params, r)
            + jnp.sum(lp[:n_valid] * 0.5)
            + m["lp2"]
            + jnp.sum(m["r"] ** 2)
            + 3.0 * s
        )

    return loss


def reference_kernels(n_valid):
    lp = jax.vmap(log_psi, (None, 0))

    def pw(params, r):
        return lp(params, r)

    def mn(params, r):
        return jnp.mean(lp(params, r)[:n_valid] ** 2)

    def sm(params, r):
        return jnp.sum(jnp.sin(lp(params, r)[:n_valid]))

    def sev(params, r):
        v = lp(params, r)
        return v, {"lp2": jnp.mean(v[:n_valid] ** 2), "r": jnp.mean(r[:n_valid], axis=0)}, jnp.sum(jnp.cos(v[:n_valid]))

    return pw, mn, sm, sev


def sharded_kernels(mesh, mapping):
    options = dict(mesh=mesh)
    if mapping == "batched":
        options["batched"] = True

        def block(fn):
            def f(params: Replicated[dict], r: PerWalker[jax.Array]):
                return jax.vmap(fn, (None, 0))(params, r)

            f.__annotations__["return"] = fn.__annotations__["return"]
            return f

        return tuple(sv.walker_parallel(block(f), **options) for f in (per_walker, mean, total, several))
    options.update(MAPPINGS[mapping])
    return tuple(sv.walker_parallel(f, **options) for f in (per_walker, mean, total, several))


def all_transforms(loss, kernels, params, r):
    """grad, value_and_grad, jvp and vjp of the loss, and the jvp/vjp of the tuple kernel itself."""
    sev = kernels[3]
    t_params = jax.tree_util.tree_map(lambda x: 0.1 * jnp.ones_like(x), params)
    t_r = 0.01 * jnp.ones_like(r)
    value, grads = jax.value_and_grad(loss, argnums=(0, 1))(params, r)
    _, tangent = jax.jvp(loss, (params, r), (t_params, t_r))
    out, pullback = jax.vjp(sev, params, r)
    cotangent = jax.tree_util.tree_map(lambda x: jnp.full_like(x, 0.3), out)
    return {
        "value": value,
        "grad": grads,
        "jvp": tangent,
        "kernel_jvp": jax.jvp(sev, (params, r), (t_params, t_r))[1],
        "kernel_vjp": pullback(cotangent),
    }


# Every mapping and both countings on 3 devices (an uneven mesh), vmap on 1 and 8 devices; each cell compiles
# every transform of four kernels, so not every product of them.
OUTPUT_CELLS = [
    (3, "vmap", "uneven"),
    (3, "vmap", "walker_set"),
    (3, "batch_size", "uneven"),
    (3, "batched", "walker_set"),
    (1, "vmap", "walker_set"),
    (8, "vmap", "uneven"),
]


@pytest.mark.parametrize(
    "n_devices, mapping, counting", OUTPUT_CELLS, ids=[f"{d}dev-{m}-{c}" for d, m, c in OUTPUT_CELLS]
)
def test_derivatives_of_outputs(n_devices, mapping, counting):
    mesh = mesh_of(n_devices)
    params = make_params()
    kernels = sharded_kernels(mesh, mapping)
    n_valid = N
    if counting == "uneven":
        r = walkers(N)
    else:  # a padded WalkerSet whose padding rows hold values that would show if they entered
        r = walkers(sv.pad_n_walkers(N, mesh.devices.size)).at[N:].set(100.0)
    refs = reference_kernels(n_valid)
    ref = jax.jit(lambda params, r: all_transforms(losses(refs, params, r, n_valid), refs, params, r))(params, r)

    def call(kernel):
        if counting == "walker_set":  # per-walker outputs come back as WalkerSets carrying the count
            return lambda p, x: _data(kernel(p, sv.WalkerSet(x, N)))
        return kernel

    def sharded(params, r):
        ks = tuple(call(k) for k in kernels)
        return all_transforms(losses(ks, params, r, n_valid), ks, params, r)

    # Under jax.jit in every cell (one compilation); eagerly, transform by transform, in one cell.
    runs = [jax.jit(sharded)(params, r)]
    if (n_devices, mapping, counting) == (3, "vmap", "walker_set"):
        runs.append(sharded(params, r))
    for got in runs:
        for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree_util.tree_leaves(ref)):
            np.testing.assert_allclose(a, b, rtol=RTOL, atol=1e-11, err_msg=jax.tree_util.keystr(path))


def _data(x):
    if isinstance(x, sv.WalkerSet):
        return x.data
    if isinstance(x, tuple):
        return tuple(_data(y) for y in x)
    return x


# ---- vmap over a kernel ------------------------------------------------------------------------


def test_vmap_over_a_kernel_maps_parameter_sets(mesh):
    params, r = make_params(), walkers(16)
    stacked = jax.tree_util.tree_map(lambda x: jnp.stack([x, 1.5 * x]), params)
    kernel = sv.walker_parallel(mean, mesh=mesh)
    out = jax.vmap(kernel, in_axes=(0, None))(stacked, r)
    ref = [
        jnp.mean(jax.vmap(log_psi, (None, 0))(jax.tree_util.tree_map(lambda x: x[i], stacked), r) ** 2) for i in (0, 1)
    ]
    np.testing.assert_allclose(out, ref, rtol=RTOL)
    per = jax.vmap(sv.walker_parallel(per_walker, mesh=mesh), in_axes=(0, None))(stacked, r)
    np.testing.assert_allclose(
        per[1], jax.vmap(log_psi, (None, 0))(jax.tree_util.tree_map(lambda x: x[1], stacked), r), rtol=RTOL
    )
