"""Property-based tests: walker_parallel equals the unsharded jax.vmap reference for random inputs.

Hypothesis draws walker counts (1..70), meshes (1..8 fake devices), pytrees (nested
dict / tuple / chex.dataclass with float32, int32 and bool leaves of 0-2 trailing
dims), parameter markers, output markers, per-walker or ``batched=True`` mode,
``batch_size`` and ``n_valid``. Data are small integers (also in float leaves), so every
sum is exact in any order: per-walker outputs and ``Sum`` must equal the reference bit
for bit, and ``Mean`` to one rounding of its final division. Runs with ``jax_enable_x64`` off and on.

Every example compiles a kernel, so the example counts are small and the search is
derandomized: CI sees the same examples on every run.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any

import chex
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from jax.sharding import PartitionSpec as P
from padding import as_evaluated

import shardvmc as sv

PROPERTY_SETTINGS = settings(
    max_examples=8,  # each example compiles kernels: the suite must fit its time on 2 cores
    deadline=None,
    derandomize=True,
    database=None,
    print_blob=True,
    phases=[Phase.explicit, Phase.reuse, Phase.generate],  # no shrinking: each run compiles a kernel
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@chex.dataclass
class Pair:
    """A chex dataclass node for the random pytrees."""

    first: Any
    second: Any


# ---------------------------------------------------------------- random pytrees

LEAF = st.tuples(
    st.sampled_from(["float32", "int32", "bool"]),
    st.lists(st.integers(1, 3), max_size=2).map(tuple),
).map(lambda spec: ("leaf", spec))


def _containers(children: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(
        st.dictionaries(st.sampled_from(["a", "b", "c"]), children, min_size=1, max_size=2).map(lambda d: ("dict", d)),
        st.lists(children, min_size=1, max_size=2).map(lambda items: ("tuple", tuple(items))),
        st.tuples(children, children).map(lambda pair: ("pair", pair)),
    )


TREE = st.recursive(LEAF, _containers, max_leaves=4)


def build_tree(spec: tuple, n: int, rng: np.random.Generator) -> Any:
    """Walkers of the pytree described by ``spec``: small integers, also in float leaves."""
    kind, body = spec
    if kind == "leaf":
        dtype, trailing = body
        shape = (n, *trailing)
        if dtype == "bool":
            return rng.random(shape) < 0.5
        return rng.integers(-8, 9, shape).astype(dtype)
    if kind == "dict":
        return {k: build_tree(v, n, rng) for k, v in body.items()}
    if kind == "tuple":
        return tuple(build_tree(v, n, rng) for v in body)
    return Pair(first=build_tree(body[0], n, rng), second=build_tree(body[1], n, rng))


# ---------------------------------------------------------------- random functions


@dataclasses.dataclass(frozen=True)
class Case:
    """One random walker-parallel function, its inputs and its call options."""

    kinds: tuple[str, ...]  # marker of each parameter, in order
    output: tuple[str, ...] | str
    trees: tuple[tuple, ...]  # one pytree spec per PerWalker parameter
    n: int
    devices: int
    batched: bool
    batch_size: int | None
    n_valid: int | None
    seed: int


MARKERS = {
    "PerWalker": sv.PerWalker[Any],
    "Replicated": sv.Replicated[Any],
    "WalkerKey": sv.WalkerKey,
    "Static": sv.Static[int],
    "Mean": sv.Mean[Any],
    "Sum": sv.Sum[Any],
}


@st.composite
def cases(draw: st.DrawFn) -> Case:
    n_walker_params = draw(st.integers(1, 2))
    extras = draw(st.lists(st.sampled_from(["Replicated", "WalkerKey", "Static"]), unique=True, max_size=3))
    kinds = tuple(draw(st.permutations(["PerWalker"] * n_walker_params + extras)))
    single = st.sampled_from(["PerWalker", "Mean", "Sum"])
    output = draw(st.one_of(single, st.lists(single, min_size=2, max_size=3).map(tuple)))
    n = draw(st.integers(1, 70))
    devices = draw(st.integers(1, 8))
    batched = draw(st.booleans())
    n_local = -(-n // devices)
    batch_size = None if batched else draw(st.one_of(st.none(), st.integers(1, n_local + 2)))
    n_valid = draw(st.one_of(st.none(), st.integers(1, n)))
    trees = tuple(draw(TREE) for _ in range(n_walker_params))
    return Case(kinds, output, trees, n, devices, batched, batch_size, n_valid, draw(st.integers(0, 2**16)))


def _leaf_fn(x: jax.Array, c: Any, s: int, draw: Any) -> jax.Array:
    """What the random function does to one leaf: exact integer arithmetic in every dtype."""
    draw = jnp.reshape(draw, jnp.shape(draw) + (1,) * (x.ndim - jnp.ndim(draw)))
    if x.dtype == jnp.bool_:
        return jnp.logical_xor(x, draw % 2 == 1) if s % 2 else ~x
    return x * s + jnp.asarray(draw + c).astype(x.dtype)


def make_function(case: Case, batched: bool) -> Any:
    """A function with the case's markers: one walker, or a block of walkers when ``batched``."""
    names = [f"p{i}" for i in range(len(case.kinds))]

    def fn(*args: Any) -> Any:
        by_kind: dict[str, list[Any]] = {}
        for kind, arg in zip(case.kinds, args):
            by_kind.setdefault(kind, []).append(arg)
        c = by_kind["Replicated"][0]["c"] if "Replicated" in by_kind else 0
        s = by_kind["Static"][0] if "Static" in by_kind else 1
        draw = 0
        if "WalkerKey" in by_kind:
            key = by_kind["WalkerKey"][0]
            randint = functools.partial(jax.random.randint, shape=(), minval=0, maxval=16)
            draw = jax.vmap(randint)(key) if batched else randint(key)
        out = tuple(
            jax.tree_util.tree_map(lambda x: _leaf_fn(jnp.asarray(x), c, s, draw), tree)
            for tree in by_kind["PerWalker"]
        )
        return out if isinstance(case.output, str) else tuple(out for _ in case.output)

    annotations = {name: MARKERS[kind] for name, kind in zip(names, case.kinds)}
    output = case.output
    annotations["return"] = MARKERS[output] if isinstance(output, str) else tuple[tuple(MARKERS[k] for k in output)]
    fn.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD) for name in names]
    )
    fn.__annotations__ = annotations
    fn.__qualname__ = fn.__name__ = "random_kernel"
    return fn


def make_arguments(case: Case) -> tuple[Any, ...]:
    rng = np.random.default_rng(case.seed)
    trees = iter(case.trees)
    values = {
        "Replicated": lambda: {"c": np.float32(rng.integers(-4, 5))},
        "WalkerKey": lambda: jax.random.key(case.seed),
        "Static": lambda: int(rng.integers(1, 4)),
    }
    return tuple(build_tree(next(trees), case.n, rng) if k == "PerWalker" else values[k]() for k in case.kinds)


def reference(case: Case, args: tuple[Any, ...]) -> Any:
    """The unsharded result: jax.vmap of the one-walker function, keys fold_in(key, i)."""
    single = make_function(case, batched=False)
    static = {i: a for i, (k, a) in enumerate(zip(case.kinds, args)) if k == "Static"}
    dyn_kinds = [k for k in case.kinds if k != "Static"]

    def call(*dyn: Any) -> Any:
        it = iter(dyn)
        return single(*(static[i] if i in static else next(it) for i in range(len(case.kinds))))

    dyn = []
    for kind, arg in zip(case.kinds, args):
        if kind == "WalkerKey":
            arg = jax.vmap(jax.random.fold_in, (None, 0))(arg, jnp.arange(case.n))
        if kind != "Static":
            dyn.append(arg)
    in_axes = tuple(None if k == "Replicated" else 0 for k in dyn_kinds)
    per_walker = jax.jit(jax.vmap(call, in_axes=in_axes))(*dyn)
    n_valid = case.n if case.n_valid is None else case.n_valid

    def reduce(tree: Any, kind: str) -> Any:
        if kind == "PerWalker":
            return tree
        total = jax.tree_util.tree_map(lambda x: jnp.sum(x[:n_valid], axis=0), tree)
        if kind == "Sum":
            return total
        # a mean is float like jnp.mean: integer and boolean sums become the default float
        return jax.tree_util.tree_map(
            lambda t: t.astype(t.dtype if jnp.issubdtype(t.dtype, jnp.inexact) else jnp.result_type(float)) / n_valid,
            total,
        )

    if isinstance(case.output, str):
        return reduce(per_walker, case.output)
    return tuple(reduce(o, k) for o, k in zip(per_walker, case.output))


def assert_equal_trees(out: Any, ref: Any, case: Case, kind: str, mesh: Any) -> None:
    assert jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(ref)
    for (path, got), want in zip(jax.tree_util.tree_flatten_with_path(out)[0], jax.tree_util.tree_leaves(ref)):
        where = f"{kind} output{jax.tree_util.keystr(path)} of {case}"
        assert got.dtype == want.dtype, where
        if kind == "Mean":
            # The sums are exact; the division by a walker count known at compile time may be
            # compiled as a multiplication by its reciprocal, one rounding more.
            np.testing.assert_array_max_ulp(np.asarray(got), np.asarray(want), maxulp=1)
        else:
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=where)
        if kind != "PerWalker":
            assert got.sharding.is_fully_replicated, where
        elif case.n % case.devices == 0:
            assert got.sharding.spec == P("walkers") and got.sharding.mesh == mesh, where


def check_case(case: Case) -> None:
    mesh = sv.create_mesh(jax.devices()[: case.devices])
    kernel = sv.walker_parallel(
        make_function(case, case.batched), mesh=mesh, batched=case.batched, batch_size=case.batch_size
    )
    args = make_arguments(case)
    out = kernel(*args, n_valid=case.n_valid)
    ref = reference(case, args)
    if isinstance(case.output, str):
        assert_equal_trees(out, ref, case, case.output, mesh)
    else:
        assert isinstance(out, tuple) and len(out) == len(case.output)
        for o, r, k in zip(out, ref, case.output):
            assert_equal_trees(o, r, case, k, mesh)


NESTED = (
    "pair",
    (("dict", {"a": ("leaf", ("float32", (2, 3))), "b": ("leaf", ("bool", ()))}), ("leaf", ("int32", (3,)))),
)
EDGE_CASES = [
    # one walker on eight devices: seven padding walkers inside the kernel
    Case(("PerWalker",), "Mean", (("leaf", ("float32", (3,))),), n=1, devices=8, batched=False, batch_size=None,
         n_valid=None, seed=1),
    # every marker, chunks that do not divide the shard, the last walker invalid
    Case(("Static", "PerWalker", "WalkerKey", "Replicated"), ("PerWalker", "Mean", "Sum"), (NESTED,), n=70, devices=8,
         batched=False, batch_size=3, n_valid=69, seed=2),
    # a block function, two PerWalker trees, a single valid walker
    Case(("WalkerKey", "PerWalker", "PerWalker"), ("Sum", "Mean"), (NESTED, ("leaf", ("bool", (1, 2)))), n=9,
         devices=3, batched=True, batch_size=None, n_valid=1, seed=3),
    # divisible walkers: outputs keep P("walkers")
    Case(("PerWalker", "Replicated"), ("PerWalker", "Sum"), (("tuple", (NESTED, ("leaf", ("int32", ())))),), n=64,
         devices=8, batched=False, batch_size=8, n_valid=None, seed=4),
]  # fmt: skip


@pytest.mark.parametrize("x64", [False, True], ids=["x32", "x64"])
@PROPERTY_SETTINGS
@given(case=cases())
@example(case=EDGE_CASES[0])
@example(case=EDGE_CASES[1])
@example(case=EDGE_CASES[2])
@example(case=EDGE_CASES[3])
def test_kernel_equals_vmap_reference(x64: bool, case: Case) -> None:
    with jax.enable_x64(x64):
        check_case(case)


# ---------------------------------------------------------------- keys across meshes


def _draws(key: jax.Array, r: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    return jax.random.bits(key, (2,)), r + jax.random.uniform(key, r.shape), jax.random.normal(key, r.shape)


@st.composite
def key_cases(draw: st.DrawFn) -> tuple[int, int, int, int | None, bool, int]:
    n = draw(st.integers(1, 70))
    a, b = draw(st.lists(st.integers(1, 8), min_size=2, max_size=2, unique=True))
    batch_size = draw(st.one_of(st.none(), st.integers(1, 9)))
    return n, a, b, batch_size, draw(st.booleans()), draw(st.integers(0, 2**16))


@settings(PROPERTY_SETTINGS, max_examples=8)  # two kernels per example; the property above covers keys too
@given(params=key_cases())
def test_walker_key_streams_do_not_depend_on_the_mesh(params: tuple) -> None:
    n, a, b, batch_size, x64, seed = params
    with jax.enable_x64(x64):
        key = jax.random.key(seed)
        r = jnp.asarray(np.random.default_rng(seed).normal(size=(n, 3)), jnp.float32)
        results = []
        for devices in (a, b):
            mesh = sv.create_mesh(jax.devices()[:devices])

            @sv.walker_parallel(mesh=mesh, batch_size=batch_size)
            def noisy(k: sv.WalkerKey, r: sv.PerWalker[jax.Array]) -> tuple[sv.PerWalker, sv.PerWalker, sv.PerWalker]:
                return _draws(k, r)

            results.append(jax.tree_util.tree_map(np.asarray, noisy(key, r)))
        walker_keys = jax.vmap(jax.random.fold_in, (None, 0))(key, jnp.arange(n))
        ref = jax.tree_util.tree_map(np.asarray, jax.jit(jax.vmap(_draws))(walker_keys, r))
    # The same walker gets the same stream on any mesh: the bits and the uniforms bit for bit,
    # the normals (an erfinv polynomial, vectorised differently per shard size) to rounding.
    for got in results:
        np.testing.assert_array_equal(got[0], ref[0])
        np.testing.assert_array_equal(got[1], ref[1])
        np.testing.assert_allclose(got[2], ref[2], rtol=1e-6, atol=1e-6)
    assert len(np.unique(results[0][0], axis=0)) == n  # every walker has its own stream


# ---------------------------------------------------------------- per-walker isolation

N_ISO = 12
BAD = 5
MODES = {
    "vmap": {},
    "batch_size": {"batch_size": 2},
    "batched": {"batched": True},
}


def _local_energy(params: dict, r: jax.Array) -> jax.Array:
    """A small log-determinant and a Gaussian: NaN or inf in r makes this walker's values non-finite."""
    m = params["a"] * jnp.eye(3) + jnp.outer(r[0], r[1])
    return jnp.linalg.slogdet(m)[1] + params["b"] * jnp.sum(jnp.exp(-(r**2)))


def _observables(params: dict, r: jax.Array) -> tuple:
    e = _local_energy(params, r)
    return e, jax.grad(_local_energy, 1)(params, r), jax.grad(_local_energy)(params, r), e


def _isolation_kernel(mesh: Any, mode: str) -> sv.WalkerParallel:
    options = MODES[mode]
    fn = jax.vmap(_observables, (None, 0)) if options.get("batched") else _observables

    def observables(
        params: sv.Replicated[dict], r: sv.PerWalker[jax.Array]
    ) -> tuple[sv.PerWalker, sv.PerWalker, sv.PerWalker, sv.Mean]:
        return fn(params, r)

    return sv.walker_parallel(observables, mesh=mesh, **options)


PARAMS_ISO = {"a": jnp.float32(1.5), "b": jnp.float32(0.7)}


def _walkers() -> np.ndarray:
    return np.random.default_rng(0).normal(size=(N_ISO, 2, 3)).astype(np.float32)


@pytest.mark.parametrize(("bad", "mode"), [(np.nan, "vmap"), (np.inf, "batch_size"), (-np.inf, "batched")])
def test_a_bad_walker_leaves_the_others_unchanged(mesh: Any, bad: float, mode: str) -> None:
    kernel = _isolation_kernel(mesh, mode)
    clean = _walkers()
    dirty = clean.copy()
    dirty[BAD, 0, 1] = bad
    ref = jax.tree_util.tree_map(np.asarray, kernel(PARAMS_ISO, clean))
    out = jax.tree_util.tree_map(np.asarray, kernel(PARAMS_ISO, dirty))
    others = np.arange(N_ISO) != BAD
    for got, want in zip(jax.tree_util.tree_leaves(out[:3]), jax.tree_util.tree_leaves(ref[:3])):
        np.testing.assert_array_equal(got[others], want[others])
    assert not np.isfinite(out[0][BAD]) and not np.isfinite(out[1][BAD]).all()  # the bad walker did go bad
    assert not np.isfinite(out[3])  # and it is valid, so it enters the mean


@pytest.mark.parametrize(("bad", "mode"), [(np.nan, "batch_size"), (np.inf, "batched"), (-np.inf, "vmap")])
def test_bad_walkers_beyond_n_valid_stay_out_of_means(mesh: Any, bad: float, mode: str) -> None:
    kernel = _isolation_kernel(mesh, mode)
    n_valid = 9
    clean = _walkers()
    dirty = clean.copy()
    dirty[n_valid:] = bad
    ref = jax.tree_util.tree_map(np.asarray, kernel(PARAMS_ISO, clean, n_valid=n_valid))
    out = jax.tree_util.tree_map(np.asarray, kernel(PARAMS_ISO, dirty, n_valid=n_valid))
    assert np.isfinite(out[3]) and out[3] == ref[3]
    reference_mean = np.mean(np.asarray(jax.vmap(_local_energy, (None, 0))(PARAMS_ISO, clean[:n_valid])))
    np.testing.assert_allclose(out[3], reference_mean, rtol=1e-5)
    for got, want in zip(jax.tree_util.tree_leaves(out[:3]), jax.tree_util.tree_leaves(ref[:3])):
        np.testing.assert_array_equal(got[:n_valid], want[:n_valid])
    # The padding contract: a padding walker holding NaN/inf is evaluated at its device's first finite walker.
    evaluated = as_evaluated(dirty, n_valid, mesh.devices.size)
    expected = jax.tree_util.tree_map(np.asarray, jax.vmap(_observables, (None, 0))(PARAMS_ISO, evaluated))
    for got, want in zip(jax.tree_util.tree_leaves(out[:3]), jax.tree_util.tree_leaves(expected[:3])):
        np.testing.assert_allclose(got[n_valid:], want[n_valid:], rtol=1e-5)


@pytest.mark.parametrize("n_devices", [1, 3, 8])
@pytest.mark.parametrize("mode", ["vmap", "batch_size", "batched"])
def test_gradient_of_a_mean_ignores_bad_walkers_beyond_n_valid(n_devices: int, mode: str) -> None:
    """Padding walkers holding NaN never reach a gradient, also on devices that hold no real walker."""
    kernel = _isolation_kernel(sv.create_mesh(jax.devices()[:n_devices]), mode)
    clean = _walkers()
    dirty = clean.copy()
    dirty[9:] = np.nan
    for p in (dirty, sv.WalkerSet(dirty, 9)):  # the count as data (n_valid=) and compiled in (a WalkerSet)

        def loss(params: dict, p: Any = p) -> jax.Array:
            out = kernel(params, p, n_valid=9) if isinstance(p, np.ndarray) else kernel(params, p)
            return out[3]

        grad = jax.jit(jax.grad(loss))(PARAMS_ISO)
        want = jax.grad(lambda q: jnp.mean(jax.vmap(_local_energy, (None, 0))(q, clean[:9])))(PARAMS_ISO)
        for g, w in zip(jax.tree_util.tree_leaves(grad), jax.tree_util.tree_leaves(want)):
            np.testing.assert_allclose(g, w, rtol=1e-5)
