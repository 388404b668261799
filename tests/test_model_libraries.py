"""Wavefunctions written with flax (linen and nnx), equinox and haiku, through kernels as their users pass them.

Each library's model is an electron-pair network for two electrons, log|psi| = MLP(r)
- |r|. Passed as the ``Replicated`` argument the way its users hold it (linen and haiku:
a parameter dict; equinox: the module, whose activation functions are leaves; nnx: the
module object), every kernel is checked against ``jax.vmap`` of the same code: log|psi|
per walker, a folx local energy, per-walker parameter gradients, ``jax.grad`` of a
``Mean``, and a Metropolis step, under the library's own jit, on 13 walkers over 8
devices (padded inside) and on ``jax.make_mesh``'s Explicit mesh.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import equinox as eqx
import flax.linen as nn
import folx
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import shardvmc as sv
from shardvmc import Mean, PerWalker, Replicated, WalkerKey

N = 13
RTOL = 2e-5
R = jax.random.normal(jax.random.key(0), (N, 2, 3))


class LinenNet(nn.Module):
    @nn.compact
    def __call__(self, r: jax.Array) -> jax.Array:
        h = jnp.tanh(nn.Dense(8)(r.reshape(-1)))
        return nn.Dense(1)(h)[0] - jnp.sum(jnp.linalg.norm(r, axis=-1))


class NnxNet(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.hidden = nnx.Linear(6, 8, rngs=rngs)
        self.out = nnx.Linear(8, 1, rngs=rngs)
        self.activation = jnp.tanh  # a non-array attribute, as real modules hold

    def __call__(self, r: jax.Array) -> jax.Array:
        h = self.activation(self.hidden(r.reshape(-1)))
        return self.out(h)[0] - jnp.sum(jnp.linalg.norm(r, axis=-1))


class EqxNet(eqx.Module):
    mlp: eqx.nn.MLP
    decay: float = eqx.field(static=True, default=1.0)

    def __call__(self, r: jax.Array) -> jax.Array:
        return self.mlp(r.reshape(-1))[0] - self.decay * jnp.sum(jnp.linalg.norm(r, axis=-1))


def _haiku_net(r: jax.Array) -> jax.Array:
    h = jnp.tanh(hk.Linear(8)(r.reshape(-1)))
    return hk.Linear(1)(h)[0] - jnp.sum(jnp.linalg.norm(r, axis=-1))


HAIKU = hk.without_apply_rng(hk.transform(_haiku_net))


def model(library: str) -> tuple[Any, Callable[[Any, jax.Array], jax.Array]]:
    """``(the model as its users pass it, log_psi(model, r) for one walker)``."""
    r0 = R[0]
    if library == "linen":
        net = LinenNet()
        return net.init(jax.random.key(1), r0), net.apply
    if library == "nnx":
        return NnxNet(nnx.Rngs(1)), lambda m, r: m(r)
    if library == "equinox":
        return EqxNet(eqx.nn.MLP(6, 1, 8, 1, key=jax.random.key(1))), lambda m, r: m(r)
    return HAIKU.init(jax.random.key(1), r0), HAIKU.apply


def kernels(log_psi: Callable[[Any, jax.Array], jax.Array], **options: Any) -> dict[str, sv.WalkerParallel]:
    def local_energy(m: Any, r: jax.Array) -> jax.Array:
        lap = folx.forward_laplacian(lambda x: log_psi(m, x))(r)
        kinetic = -0.5 * (lap.laplacian + jnp.sum(lap.jacobian.dense_array**2))
        return kinetic - jnp.sum(2.0 / jnp.linalg.norm(r, axis=-1)) + 1.0 / jnp.linalg.norm(r[0] - r[1])

    @sv.walker_parallel(**options)
    def value(m: Replicated[Any], r: PerWalker[jax.Array]) -> PerWalker[jax.Array]:
        return log_psi(m, r)

    @sv.walker_parallel(**options)
    def energy(m: Replicated[Any], r: PerWalker[jax.Array]) -> tuple[PerWalker[jax.Array], Mean[jax.Array]]:
        e = local_energy(m, r)
        return e, e

    @sv.walker_parallel(**options)
    def gradient(m: Replicated[Any], r: PerWalker[jax.Array]) -> PerWalker[Any]:
        return _grads(log_psi, m, r)

    @sv.walker_parallel(**options)
    def mean_log_psi(m: Replicated[Any], r: PerWalker[jax.Array]) -> Mean[jax.Array]:
        return log_psi(m, r)

    @sv.walker_parallel(**options)
    def metropolis(m: Replicated[Any], r: PerWalker[jax.Array], key: WalkerKey) -> PerWalker[jax.Array]:
        new = r + 0.3 * jax.random.normal(key, r.shape)
        ratio = 2 * (log_psi(m, new) - log_psi(m, r))
        accept = jnp.log(jax.random.uniform(jax.random.fold_in(key, 1))) < ratio
        return jnp.where(accept, new, r)

    return {"value": value, "energy": energy, "gradient": gradient, "mean": mean_log_psi, "move": metropolis}, (
        local_energy
    )


def _grads(log_psi: Callable[[Any, jax.Array], jax.Array], m: Any, r: jax.Array) -> Any:
    """d log|psi| / d(the model's arrays) for one walker, in the library's own terms."""
    if isinstance(m, nnx.Module):  # nnx's functional form, the one jax.vmap and kernels can map over
        graphdef, state = nnx.split(m)
        return jax.grad(lambda s: log_psi(nnx.merge(graphdef, s), r))(state)
    if isinstance(m, eqx.Module):
        return eqx.filter_grad(lambda mm: log_psi(mm, r))(m)
    return jax.grad(log_psi)(m, r)


def reference(log_psi: Callable[..., jax.Array], local_energy: Callable[..., jax.Array], m: Any, key: jax.Array):
    """The same computations with jax.vmap over all walkers, on one device."""
    per = jax.vmap(lambda r: log_psi(m, r))(R)
    e = jax.vmap(lambda r: local_energy(m, r))(R)
    g = jax.vmap(lambda r: _grads(log_psi, m, r))(R)
    keys = jax.vmap(jax.random.fold_in, (None, 0))(key, jnp.arange(N))

    def move(r: jax.Array, k: jax.Array) -> jax.Array:
        new = r + 0.3 * jax.random.normal(k, r.shape)
        accept = jnp.log(jax.random.uniform(jax.random.fold_in(k, 1))) < 2 * (log_psi(m, new) - log_psi(m, r))
        return jnp.where(accept, new, r)

    return per, e, g, jax.vmap(move)(R, keys)


def _arrays(tree: Any) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(eqx.filter(tree, eqx.is_array))]


def _close(got: Any, want: Any) -> None:
    for a, b in zip(_arrays(got), _arrays(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=1e-5)


def _jit(library: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """The library's own jit: the way its users compile a step that holds the model."""
    return {"nnx": nnx.jit, "equinox": eqx.filter_jit}.get(library, jax.jit)(fn)


LIBRARIES = ["linen", "nnx", "equinox", "haiku"]


@pytest.mark.filterwarnings("ignore::shardvmc.PaddingWarning")
@pytest.mark.parametrize("mesh_kind", ["auto", "explicit"])
@pytest.mark.parametrize("library", LIBRARIES)
def test_every_kernel_equals_vmap(library: str, mesh_kind: str) -> None:
    m, log_psi = model(library)
    mesh = sv.create_mesh() if mesh_kind == "auto" else jax.make_mesh((8,), ("walkers",))
    ks, local_energy = kernels(log_psi, mesh=mesh)
    key = jax.random.key(3)
    per, e, g, moved = reference(log_psi, local_energy, m, key)

    @jax.named_call
    def step(m: Any, r: jax.Array, key: jax.Array) -> Any:
        return (
            ks["value"](m, r),
            ks["energy"](m, r),
            ks["gradient"](m, r),
            ks["mean"](m, r),
            ks["move"](m, r, key),
        )

    for run in (step, _jit(library, step)):
        got_per, (got_e, got_mean_e), got_g, got_mean, got_moved = run(m, R, key)
        _close(got_per, per)
        _close(got_e, e)
        np.testing.assert_allclose(got_mean_e, jnp.mean(e), rtol=RTOL)
        _close(got_g, g)
        np.testing.assert_allclose(got_mean, jnp.mean(per), rtol=RTOL)
        _close(got_moved, moved)


@pytest.mark.parametrize("library", LIBRARIES)
def test_gradient_of_a_mean_equals_vmap(library: str) -> None:
    m, log_psi = model(library)
    ks, _ = kernels(log_psi)
    r = R[:8]

    def loss(m: Any) -> jax.Array:
        return ks["mean"](m, r)

    def want(m: Any) -> jax.Array:
        return jnp.mean(jax.vmap(lambda x: log_psi(m, x))(r))

    grad = {"nnx": nnx.grad, "equinox": eqx.filter_grad}.get(library, jax.grad)
    _close(_jit(library, grad(loss))(m), grad(want)(m))


def test_an_nnx_model_updated_in_place_reaches_the_kernel() -> None:
    """The arrays of a Replicated nnx module are traced: an optimiser's in-place update is seen."""
    net, log_psi = model("nnx")
    ks, _ = kernels(log_psi)
    before = np.asarray(ks["value"](net, R))
    optimizer = nnx.Optimizer(net, optax.sgd(0.5), wrt=nnx.Param)
    grads = nnx.grad(lambda mm: jnp.mean(jax.vmap(lambda r: log_psi(mm, r))(R)))(net)
    optimizer.update(net, grads)
    after = np.asarray(ks["value"](net, R))
    assert not np.allclose(before, after)
    np.testing.assert_allclose(after, jax.vmap(lambda r: log_psi(net, r))(R), rtol=RTOL)


def test_a_model_holding_arrays_is_refused_as_static() -> None:
    """Compiled in, its arrays would go stale after an in-place update (a silently wrong log|psi|)."""
    net, log_psi = model("nnx")

    @sv.walker_parallel
    def value(m: sv.Static[Any], r: PerWalker[jax.Array]) -> PerWalker[jax.Array]:
        return log_psi(m, r)

    with pytest.raises(sv.CallError, match=r"(?s)Static parameter 'm' holds an array.*mark the parameter Replicated"):
        value(net, R)


def test_non_array_leaves_key_the_compilation_by_equality() -> None:
    """An equinox module's functions and static fields are compiled in: equal ones reuse the program."""
    traces = []

    @sv.walker_parallel
    def value(m: Replicated[EqxNet], r: PerWalker[jax.Array]) -> PerWalker[jax.Array]:
        traces.append(1)
        return m(r)

    a = EqxNet(eqx.nn.MLP(6, 1, 8, 1, key=jax.random.key(1)))
    b = EqxNet(eqx.nn.MLP(6, 1, 8, 1, key=jax.random.key(2)))  # other arrays, same functions
    value(a, R[:8])
    np.testing.assert_allclose(value(b, R[:8]), jax.vmap(b)(R[:8]), rtol=RTOL)
    assert len(traces) == 1
    c = eqx.tree_at(lambda m: m.mlp.activation, b, jax.nn.gelu)  # another function: another program
    np.testing.assert_allclose(value(c, R[:8]), jax.vmap(c)(R[:8]), rtol=RTOL)
    assert len(traces) == 2
