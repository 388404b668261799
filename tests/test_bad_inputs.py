"""A catalogue of bad inputs: each fails with a shardvmc-level error that says where and how to fix it.

Every entry names the input, the error class expected, and the fragments its message
must hold: the function, the parameter or pytree path, and the fix. None may surface
as an error of JAX or XLA. docs/reliability.md lists the same catalogue (checked below).
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
from collections.abc import Callable
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import shardvmc as sv
from shardvmc import Mean, PerWalker, Replicated, Static, Sum, WalkerKey

DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs" / "reliability.md"


# ---------------------------------------------------------------- functions used by the catalogue


def _load_saved(like: Any, **kwargs: Any) -> Any:
    """Load a checkpoint of the 8 walkers R8 (saved in a fresh temporary directory)."""
    import tempfile

    with tempfile.TemporaryDirectory() as directory:
        path = pathlib.Path(directory) / "walkers.npz"
        sv.save_walkers(path, R8)
        return sv.load_walkers(path, like, **kwargs)


@sv.walker_parallel
def energy(alpha: Replicated[jax.Array], r: PerWalker[jax.Array]) -> Mean[jax.Array]:
    return alpha * jnp.sum(r**2)


@sv.walker_parallel
def two_sets(r: PerWalker[jax.Array], s: PerWalker[jax.Array]) -> PerWalker[jax.Array]:
    return jnp.sum(r) + jnp.sum(s)


@sv.walker_parallel
def move(key: WalkerKey, r: PerWalker[jax.Array]) -> PerWalker[jax.Array]:
    return r + jax.random.normal(key, r.shape)


class _NnxModel(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.w = nnx.Param(jnp.ones(3))


@sv.walker_parallel
def static_model(model: Static[Any], r: PerWalker[jax.Array]) -> PerWalker[jax.Array]:
    return jnp.sum(r)


@sv.walker_parallel(batched=True)
def local_sum(r: PerWalker[jax.Array]) -> Replicated[jax.Array]:
    return jnp.sum(r)  # this device's block only


@sv.walker_parallel
def scaled(r: PerWalker[jax.Array], shape: Static[tuple]) -> PerWalker[jax.Array]:
    return jnp.broadcast_to(jnp.sum(r), shape)


@sv.walker_parallel
def returns_text(r: PerWalker[jax.Array]) -> PerWalker:
    return {"e": jnp.sum(r), "label": "ground state"}


@sv.walker_parallel
def returns_one(r: PerWalker[jax.Array]) -> tuple[PerWalker, Mean]:
    return jnp.sum(r)


@sv.walker_parallel(batched=True)
def block_mean(r: PerWalker[jax.Array]) -> Mean:
    return jnp.sum(r)  # one number for the whole block: no walker axis


def no_marker(params, r: PerWalker[jax.Array]):
    return r


def mean_parameter(r: Mean[jax.Array]) -> PerWalker:
    return r


def key_return(r: PerWalker[jax.Array]) -> WalkerKey:
    return r


def two_markers(r: PerWalker[Replicated[jax.Array]]) -> PerWalker:
    return r


def static_in_tuple_output(r: PerWalker[jax.Array]) -> tuple[PerWalker, Static[int]]:
    return r, 1


def n_valid_parameter(r: PerWalker[jax.Array], n_valid: Static[int]) -> PerWalker:
    return r


def star_args(*r: PerWalker[jax.Array]) -> PerWalker:
    return r


def unresolvable(r: PerWalker[UndefinedType]) -> PerWalker:  # noqa: F821
    return r


def plain(params, r):
    return params * r


def conflicting(params: PerWalker[jax.Array], r):
    return params * r


def variadic_means(r: PerWalker[jax.Array]) -> tuple[Mean[jax.Array], ...]:
    return (r, r)


def replicated_return(r: PerWalker[jax.Array]) -> Replicated[jax.Array]:
    return r


@sv.walker_parallel(batch_size=2)
def chunked_statistic(r: PerWalker[jax.Array]) -> PerWalker[jax.Array]:
    return r - sv.all_walkers.mean(r)


@chex.dataclass
class Walkers:
    r: Any
    label: Any


R8 = np.ones((8, 2, 3), np.float32)
J8 = np.arange(8 * 5, dtype=np.float32).reshape(8, 5) % 7
E8 = np.arange(8, dtype=np.float32)
ONE = np.float32(1.0)


def _dense_1_log_psi(params: Any, r: jax.Array) -> jax.Array:
    return -jnp.sum(r**2, keepdims=True).reshape(1)  # what nn.Dense(1)(h) returns without [0]


def _oscillator_log_psi(params: Any, r: jax.Array) -> jax.Array:
    return -0.5 * jnp.sum(r**2)


def _per_electron_potential(r: jax.Array) -> jax.Array:
    return 0.5 * jnp.sum(r**2, axis=-1)  # one number per electron: the sum over them is missing


def _dmc_step_with(key: Any) -> Any:
    dmc = sv.dmc.DMC(_oscillator_log_psi, lambda r: 0.5 * jnp.sum(r**2), time_step=0.05)
    return dmc.step(dmc.init(None, R8), key)


def _vmc_init_without_params() -> Any:
    import optax

    return sv.driver.VMC(_oscillator_log_psi, optax.sgd(0.1), lambda r: 0.5 * jnp.sum(r**2)).init(None, R8)


def other_mesh_walkers(n: int = 6):
    return sv.shard_walker(np.ones((n, 3), np.float32), sv.create_mesh(jax.devices()[:3]))


@dataclasses.dataclass(frozen=True)
class Bad:
    """One catalogue entry."""

    name: str
    trigger: Callable[[], Any]
    error: type[BaseException]
    fragments: tuple[str, ...]  # the function, the parameter or path, the fix


CATALOGUE = [
    # ------------------------------------------------ decoration time
    Bad("parameter without a marker", lambda: sv.walker_parallel(no_marker)({}, jnp.ones((8, 3))), sv.CallError,
        ("no_marker", "'params'", "no shardvmc marker", "PerWalker[jax.Array]", "replicated_args")),
    Bad("Mean marker on a parameter", lambda: sv.walker_parallel(mean_parameter), sv.DecorationError,
        ("mean_parameter", "parameter 'r'", "marked Mean", "Mean and Sum are for returns")),
    Bad("WalkerKey marker on the return", lambda: sv.walker_parallel(key_return), sv.DecorationError,
        ("key_return", "return annotation", "WalkerKey", "mark returns PerWalker")),
    Bad("two markers on one parameter", lambda: sv.walker_parallel(two_markers), sv.DecorationError,
        ("two_markers", "parameter 'r'", "several markers")),
    Bad("parameter marker on a tuple output element", lambda: sv.walker_parallel(static_in_tuple_output),
        sv.DecorationError, ("static_in_tuple_output", "element 1 of the return annotation", "Static", "mark returns")),
    Bad("parameter named n_valid", lambda: sv.walker_parallel(n_valid_parameter), sv.DecorationError,
        ("n_valid_parameter", "'n_valid'", "rename the parameter")),
    Bad("*args parameter", lambda: sv.walker_parallel(star_args), sv.DecorationError,
        ("star_args", "parameter 'r'", "*args", "list the parameters explicitly")),
    Bad("annotation that cannot be resolved", lambda: sv.walker_parallel(unresolvable), sv.DecorationError,
        ("unresolvable", "UndefinedType", "could not be resolved", "define or import")),
    Bad("replicated_args naming no parameter", lambda: sv.replicated_args("parms")(plain), sv.DecorationError,
        ("plain", "replicated_args", "'parms'", "name parameters of the function exactly")),
    Bad("replicated_args on a PerWalker-annotated parameter",
        lambda: sv.walker_parallel(sv.replicated_args("params")(conflicting)), sv.DecorationError,
        ("conflicting", "parameter 'params'", "replicated_args", "drop one of the two")),
    Bad("decorating something that is not a function", lambda: sv.walker_parallel(3), sv.DecorationError,
        ("walker_parallel", "int", "decorate a function")),
    Bad("batch_size that is not a positive int", lambda: sv.walker_parallel(batch_size=0), sv.DecorationError,
        ("walker_parallel", "batch_size", "positive int")),
    Bad("batched=True with batch_size", lambda: sv.walker_parallel(batched=True, batch_size=4), sv.DecorationError,
        ("walker_parallel", "batched=True with batch_size=4", "drop batch_size")),
    Bad("variadic tuple of Mean outputs", lambda: sv.walker_parallel(variadic_means), sv.DecorationError,
        ("variadic_means", "variadic tuple", "Mean[tuple[...]]")),
    Bad("Replicated return without batched=True", lambda: sv.walker_parallel(replicated_return), sv.DecorationError,
        ("replicated_return", "marked Replicated", "batched=True")),
    Bad("memory_budget without batch_size='auto'", lambda: sv.walker_parallel(batch_size=4, memory_budget=10**9),
        sv.DecorationError, ("walker_parallel", "memory_budget=", "batch_size='auto'")),
    Bad("axis_name that is not a name", lambda: sv.walker_parallel(axis_name=["hosts", "local"]), sv.DecorationError,
        ("walker_parallel", "axis_name must be", 'axis_name=("hosts", "local")')),
    Bad("n_valid that disagrees with a WalkerSet", lambda: energy(ONE, sv.WalkerSet(R8, 6), n_valid=5),
        sv.CallError, ("energy", "disagrees with the count the WalkerSet", "drop n_valid=")),
    Bad("WalkerSet count above its walkers", lambda: sv.WalkerSet(R8, 9), sv.CallError,
        ("WalkerSet", "n_valid=9 is outside 1..8", "the real walkers come first")),
    Bad("WalkerSet whose count no longer fits its data",
        lambda: energy(ONE, jax.tree.map(lambda a: a[:4], sv.WalkerSet(R8, 6))), sv.CallError,
        ("energy", "n_valid=6 but holds 4 walkers", "walkers[a:b]")),
    Bad("a key whose draws depend on the batch (rbg)", lambda: move(jax.random.key(0, impl="rbg"), R8), sv.CallError,
        ("move", "WalkerKey parameter 'key'", "rbg", "threefry")),
    Bad("raw key of the wrong shape", lambda: move(np.zeros(3, np.uint32), R8), sv.CallError,
        ("move", "WalkerKey parameter 'key'", "not a single PRNG key", "uint32[3]", "pass ONE key")),
    Bad("a model holding arrays marked Static", lambda: static_model(_NnxModel(nnx.Rngs(0)), R8), sv.CallError,
        ("static_model", "Static parameter 'model' holds an array", "in-place", "mark the parameter Replicated")),
    Bad("a device-local value marked Replicated", lambda: local_sum(R8), sv.CallError,
        ("local_sum", "marked Replicated, but it differs between devices", "sv.all_walkers.sum")),
    Bad("all_walkers outside a kernel", lambda: sv.all_walkers.mean(R8), sv.CallError,
        ("all_walkers.mean", "outside a walker-parallel kernel", "sv.walker_mean")),
    Bad("all_walkers in a kernel with batch_size", lambda: chunked_statistic(R8), sv.CallError,
        ("all_walkers.mean", "batch_size=", "cannot see each other")),
    # ------------------------------------------------ call time: walkers
    Bad("PerWalker leaves of different walker counts", lambda: energy(ONE, {"a": R8, "b": np.ones((7, 3))}),
        sv.CallError, ("energy", "'r'['a']", "'r'['b']", "8 walkers", "has 7", "walker axis first")),
    Bad("PerWalker parameters of different walker counts", lambda: two_sets(R8, np.ones((6, 3))), sv.CallError,
        ("two_sets", "'r'", "'s'", "has 6", "pass the same walkers")),
    Bad("scalar PerWalker argument (no walker axis)", lambda: energy(ONE, np.float32(2.0)), sv.CallError,
        ("energy", "'r'", "scalar", "leading walker axis")),
    Bad("Python list instead of an array", lambda: energy(ONE, [1.0, 2.0, 3.0]), sv.CallError,
        ("energy", "'r'[0]", "scalar", "jnp.asarray")),
    Bad("unhashable non-array leaf in a PerWalker dataclass", lambda: energy(ONE, Walkers(r=R8, label={"H2"})),
        sv.CallError, ("energy", "'r'.label", "no array", "set", "unhashable", "hashable")),
    Bad("object array as a Replicated argument", lambda: energy(np.array([object()]), R8), sv.CallError,
        ("energy", "Replicated parameter 'alpha'", "not an array", "pass arrays or numbers")),
    Bad("empty walker set", lambda: energy(ONE, np.ones((0, 3), np.float32)), sv.CallError,
        ("energy", "'r'", "zero walkers", "at least one walker")),
    Bad("no PerWalker leaf at all (empty pytree)", lambda: energy(ONE, {}), sv.CallError,
        ("energy", "no PerWalker argument", "mark at least one parameter PerWalker")),
    Bad("walkers committed to other devices than the kernel's mesh",
        lambda: sv.walker_parallel(energy.__wrapped__, mesh=sv.create_mesh())(ONE, other_mesh_walkers()), sv.CallError,
        ("energy", "PerWalker parameter 'r'", "other devices", "devices [0, 1, 2]", "sv.shard_walker(x, mesh)")),
    Bad("walkers on a mesh of another size inside jax.jit",
        lambda: jax.jit(sv.walker_parallel(energy.__wrapped__, mesh=sv.create_mesh()))(ONE, other_mesh_walkers()),
        sv.CallError, ("energy", "PerWalker parameter 'r'", "a mesh of 3 devices", "traced computation",
                       "{'walkers': 3}", "jax.set_mesh(mesh)")),
    # ------------------------------------------------ call time: keys, statics, n_valid, meshes
    Bad("integer seed as WalkerKey", lambda: move(3, R8), sv.CallError,
        ("move", "WalkerKey parameter 'key'", "int32[]", "jax.random.key(seed)", "pass ONE key")),
    Bad("one key per walker as WalkerKey", lambda: move(jax.random.split(jax.random.key(0), 8), R8), sv.CallError,
        ("move", "'key'", "key<fry>[8]", "pass ONE key")),
    Bad("float array as WalkerKey", lambda: move(jnp.zeros(2), R8), sv.CallError,
        ("move", "'key'", "float32[2]", "pass ONE key")),
    Bad("unhashable Static (a list)", lambda: scaled(R8, [2, 2]), sv.UnhashableStaticError,
        ("scaled", "Static parameter 'shape'", "list", "tuple instead of a list")),
    Bad("array as a Static argument", lambda: scaled(R8, jnp.ones(2)), sv.UnhashableStaticError,
        ("scaled", "'shape'", "unhashable", "mark the parameter Replicated")),
    Bad("n_valid = 0", lambda: energy(ONE, R8, n_valid=0), sv.CallError,
        ("energy", "n_valid=0", "outside 1..8", "sv.pad_walker")),
    Bad("n_valid above the walker count", lambda: energy(ONE, R8, n_valid=9), sv.CallError,
        ("energy", "n_valid=9", "outside 1..8", "omit n_valid")),
    Bad("n_valid that is not an integer", lambda: energy(ONE, R8, n_valid=2.5), sv.CallError,
        ("energy", "n_valid", "float", "integer")),
    Bad("n_valid that is a bool", lambda: energy(ONE, R8, n_valid=True), sv.CallError,
        ("energy", "n_valid", "bool", "integer")),
    Bad("n_valid that is an array of counts", lambda: energy(ONE, R8, n_valid=jnp.array([4, 4])), sv.CallError,
        ("energy", "n_valid", "int32[2]", "integer scalar array")),
    Bad("mesh without the walker axis",
        lambda: sv.walker_parallel(energy.__wrapped__, mesh=sv.create_mesh(axis_name="x"))(ONE, R8), sv.CallError,
        ("energy", "no axis named 'walkers'", "{'x': 8}", "sv.create_mesh(axis_name='walkers')")),
    Bad("list of devices instead of a mesh",
        lambda: sv.walker_parallel(energy.__wrapped__, mesh=jax.devices())(ONE, R8), sv.CallError,
        ("energy", "mesh", "not a jax.sharding.Mesh", "list", "sv.create_mesh")),
    Bad("missing argument", lambda: energy(R8), TypeError, ("energy", "missing a required argument", "'r'")),
    # ------------------------------------------------ call time: outputs
    Bad("output leaf that is not an array", lambda: returns_text(R8), sv.CallError,
        ("returns_text", "output['label']", "not an array", "return arrays or numbers")),
    Bad("single output where the annotation marks a tuple", lambda: returns_one(R8), sv.CallError,
        ("returns_one", "tuple of 2 outputs", "no tuple", "return a tuple matching")),
    Bad("batched=True output without the walker axis", lambda: block_mean(R8), sv.CallError,
        ("block_mean", "batched=True", "Mean output", "one row per walker")),
    # ------------------------------------------------ toolkit
    Bad("shard_walker: count the mesh cannot split", lambda: sv.shard_walker(np.ones((10, 3))), sv.CallError,
        ("shard_walker", "10 walkers", "8 devices", "next: 16", "sv.pad_walker")),
    Bad("shard_walker: leaves of different walker counts",
        lambda: sv.shard_walker({"r": np.ones((8, 3)), "s": np.ones((4,))}), sv.CallError,
        ("shard_walker", "['r'] has 8", "['s'] has 4", "walker axis first")),
    Bad("shard_walker: string leaf", lambda: sv.shard_walker({"r": np.ones(8), "name": "H2"}), sv.CallError,
        ("shard_walker", "leaf ['name']", "cannot be placed", "Static argument")),
    Bad("walker_mean: n_valid out of range", lambda: sv.walker_mean(jnp.ones(8), n_valid=12), sv.CallError,
        ("walker_mean", "n_valid=12", "outside 1..8", "sv.pad_walker")),
    Bad("create_mesh: no devices", lambda: sv.create_mesh([]), sv.CallError,
        ("create_mesh", "no devices", "at least one device")),
    Bad("initialize_walkers_sharded: no key", lambda: sv.initialize_walkers_sharded(jnp.zeros, 8), sv.CallError,
        ("initialize_walkers_sharded", "no key", "key=jax.random.key(seed)")),
    Bad("save_walkers: metadata JSON cannot hold",
        lambda: sv.save_walkers("/nonexistent/x.npz", {"r": R8}, metadata={"e": jnp.float32(1.0)}), sv.CallError,
        ("save_walkers", "metadata", "JSON", "float(energy)")),
    Bad("save_walkers: n_valid other than the WalkerSet's",
        lambda: sv.save_walkers("/nonexistent/x.npz", sv.WalkerSet(R8, n_valid=6), n_valid=7), sv.CallError,
        ("save_walkers", "n_valid=7", "tree.n_valid=6", "omit n_valid")),
    Bad("load_walkers: WalkerSet like of another count", lambda: _load_saved(sv.WalkerSet(R8, n_valid=7)), sv.CallError,
        ("load_walkers", "holds 8 walkers", "expects 7", "n_walkers=7")),
    Bad("load_walkers: n_walkers that is not a positive int", lambda: _load_saved(R8, n_walkers=0), sv.CallError,
        ("load_walkers", "n_walkers must be a positive int", "got:", "0", "n_walkers=None")),
    Bad("check_consistent: a sharded leaf",
        lambda: sv.distributed.check_consistent({"r": sv.shard_walker(R8)}), sv.CallError,
        ("check_consistent", "leaf ['r'] of params is sharded", "replicated part of params")),
    Bad("natural_gradient: n_valid disagrees with the WalkerSet",
        lambda: sv.natural_gradient(sv.WalkerSet(J8, 6), sv.WalkerSet(E8, 6), n_valid=7, damping=1e-3), sv.CallError,
        ("natural_gradient", "n_valid=7", "n_valid=6", "omit n_valid=")),
    Bad("natural_gradient: energies not one per walker",
        lambda: sv.natural_gradient(J8, np.float32(-2.9), damping=1e-3), sv.CallError,
        ("natural_gradient", "one local energy per walker", "e of shape (8,)", "not their mean")),
    Bad("natural_gradient: unknown method", lambda: sv.natural_gradient(J8, E8, damping=1e-3, method="sr"),
        sv.CallError, ("natural_gradient", "unknown method 'sr'", "'minsr'", "pick one")),
    Bad("natural_gradient: zero damping with a Cholesky solve",
        lambda: sv.natural_gradient(J8, E8, damping=0.0, method="minsr"), sv.CallError,
        ("natural_gradient", "damping=0.0", "solver='eigh'", "damping=1e-3")),
    Bad("shard_walker inside jax.jit: walkers on a mesh of another size",
        lambda: jax.jit(lambda r: sv.shard_walker(r, sv.create_mesh()))(other_mesh_walkers(24)), sv.CallError,
        ("shard_walker", "leaf <root>", "a mesh of 3 devices", "traced computation", "jax.set_mesh(mesh)")),
    Bad("Metropolis: log_psi of shape (1,) (a Dense(1) output)",
        lambda: sv.mcmc.Metropolis(_dense_1_log_psi).init(None, R8), sv.CallError,
        ("shardvmc.mcmc.Metropolis", "returned shape (1,)", "not one number", "float32[1]", "nn.Dense(1)(h)[0]")),
    Bad("Metropolis: log_psi returning a (sign, log-amplitude) pair",
        lambda: sv.mcmc.Metropolis(lambda p, r: (ONE, -jnp.sum(r**2))).init(None, R8), sv.CallError,
        ("shardvmc.mcmc.Metropolis", "returned a tuple", "not one number", "f(params, r)[1]")),
    Bad("local_energy: log_psi of shape (1,)",
        lambda: sv.hamiltonian.local_energy(_dense_1_log_psi)(None, R8), sv.CallError,
        ("shardvmc.hamiltonian", "returned shape (1,)", "not one number", "jnp.squeeze")),
    Bad("natural_gradient: solver over the memory budget",
        lambda: sv.natural_gradient(J8, E8, damping=1e-3, method="dense", memory_budget=64), sv.CallError,
        ("natural_gradient", "no solver fits", "method='dense'", "tried: dense", "raise memory_budget=")),
    # ------------------------------------------------ DMC and the driver
    Bad("DMC: potential of one number per electron",
        lambda: sv.dmc.DMC(_oscillator_log_psi, _per_electron_potential, time_step=0.05).init(None, R8), sv.CallError,
        ("shardvmc.dmc.DMC", "potential(r) returned shape (2,)", "not one number", "float32[2]", "jnp.sum")),
    Bad("DMC.step: float array as key", lambda: _dmc_step_with(jnp.zeros(3)), sv.CallError,
        ("shardvmc.dmc.DMC.step", "key is not ONE PRNG key", "float32[3]", "jax.random.key(seed)")),
    Bad("dmc.extrapolate: a NaN energy",
        lambda: sv.dmc.extrapolate([0.02, 0.01], [(float("nan"), 0.001), (-2.9, 0.001)]), sv.CallError,
        ("shardvmc.dmc.extrapolate", "energies[0]", "not finite", "(nan, 0.001)", "leave that run out")),
    Bad("dmc.extrapolate: a time step that is not positive",
        lambda: sv.dmc.extrapolate([-0.02, 0.01], [(-2.9, 0.001), (-2.9, 0.001)]), sv.CallError,
        ("shardvmc.dmc.extrapolate", "time_steps[0]", "-0.02", "time_step")),
    Bad("dmc.extrapolate: an error bar that is not finite",
        lambda: sv.dmc.extrapolate([0.02, 0.01], [(-2.9, float("inf")), (-2.9, 0.001)]), sv.CallError,
        ("shardvmc.dmc.extrapolate", "error bar of energies[0]", "inf", "error_of_mean")),
    Bad("VMC: params=None (nothing to optimise)", _vmc_init_without_params, sv.CallError,
        ("shardvmc.driver.VMC.init", "params has no array leaf", "params=None", "sv.driver.expect")),
]  # fmt: skip


@pytest.mark.parametrize("bad", CATALOGUE, ids=[b.name for b in CATALOGUE])
def test_bad_input_fails_clearly(bad: Bad) -> None:
    with pytest.raises(bad.error) as info:
        bad.trigger()
    err = info.value
    text = str(err)
    missing = [f for f in bad.fragments if f not in text]
    assert not missing, f"message lacks {missing}:\n{text}"
    # Not an error of JAX or XLA, and not one that only JAX's machinery could explain.
    assert not type(err).__module__.startswith(("jax", "jaxlib")), type(err)
    tb = err.__traceback__
    while tb.tb_next is not None:
        tb = tb.tb_next
    assert "/shardvmc/" in tb.tb_frame.f_code.co_filename, f"raised by {tb.tb_frame.f_code.co_filename}"
    for internal in ("XlaRuntimeError", "jax._src", "Tracer", "abstract array", "static_argnums"):
        assert internal not in text, f"{internal!r} in:\n{text}"
    if isinstance(err, sv.ShardvmcError):
        assert "\n  fix:" in text, f"no fix section:\n{text}"


def test_catalogue_has_twenty_distinct_inputs() -> None:
    assert len({b.name for b in CATALOGUE}) == len(CATALOGUE) >= 20


def test_catalogue_is_listed_in_the_docs() -> None:
    table = DOCS.read_text()
    rows = {m.group(1).strip() for m in re.finditer(r"^\|([^|]+)\|", table, re.MULTILINE)}
    missing = [b.name for b in CATALOGUE if b.name not in rows]
    assert not missing, f"docs/reliability.md lacks rows for {missing}"
    for bad in CATALOGUE:
        assert f"`{bad.error.__name__}`" in table


def test_traced_n_valid_is_not_checked_but_masks() -> None:
    """Inside an outer jit n_valid is a tracer: it cannot be range-checked, and it still masks."""

    @jax.jit
    def run(r: jax.Array, n: jax.Array) -> jax.Array:
        return energy(ONE, r, n_valid=n)

    r = jnp.arange(8.0)
    assert float(run(r, 3)) == pytest.approx(float(jnp.mean(r[:3] ** 2)))


def test_explained_errors_keep_the_happy_path_working() -> None:
    """The error path reports the cause; the same kernel then runs on good input."""
    with pytest.raises(sv.CallError):
        energy(ONE, Walkers(r=R8, label={"H2"}))
    assert float(energy(ONE, R8)) == pytest.approx(6.0)

    @sv.walker_parallel
    def labelled(alpha: Replicated[jax.Array], w: PerWalker[Walkers]) -> Mean[jax.Array]:
        assert w.label == "H2"  # a hashable non-array leaf is compiled in, as equinox's filter_jit does
        return alpha * jnp.sum(w.r**2)

    assert float(labelled(ONE, Walkers(r=R8, label="H2"))) == pytest.approx(6.0)


def test_user_errors_inside_the_function_are_not_rewritten() -> None:
    """A TypeError raised by the user's own code passes through unchanged."""

    @sv.walker_parallel
    def broken(r: PerWalker[jax.Array]) -> Sum:
        raise TypeError("my own bug")

    with pytest.raises(TypeError, match="^my own bug"):
        broken(R8)


def test_a_vmc_state_without_parameters_is_refused_by_the_step_too() -> None:
    """A state built by hand (not by init) with params=None: the step names params, not a WalkerSet inside it."""
    import optax

    vmc = sv.driver.VMC(_oscillator_log_psi, optax.sgd(0.1), lambda r: 0.5 * jnp.sum(r**2))
    state = sv.driver.VMCState(None, optax.sgd(0.1).init(None), vmc.sampler.init(None, R8))
    with pytest.raises(sv.CallError, match=r"^shardvmc\.driver\.VMC\.step: params has no array leaf") as info:
        vmc.step(state, jax.random.key(0))
    assert "sv.driver.expect" in str(info.value)
    # and a wavefunction without parameters is still sampled at fixed (no) parameters, as the fix says
    energy = sv.driver.expect(vmc.sampler, vmc.local_energy, None, state.sampler, 3, key=jax.random.key(1))
    assert float(energy.mean) == pytest.approx(3.0)  # the ground state of two 3-D oscillators: E_L = 3 everywhere
