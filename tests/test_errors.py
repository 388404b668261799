"""Every decorator error, message by message: the function, the parameter, the sizes, the fix."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import shardvmc as sv
from shardvmc import Mean, PerWalker, Replicated, Static, Sum, WalkerKey


def raises(cls, fn, *args, **kwargs):
    with pytest.raises(cls) as err:
        fn(*args, **kwargs)
    return str(err.value)


# ------------------------------------------------------------ decoration time


def test_parameter_without_marker():
    def energy(params: Replicated, r):
        return r

    kernel = sv.walker_parallel(energy)  # reported at the first call: a replicated_args above may still name it
    text = raises(sv.CallError, kernel, 1.0, jnp.ones((8, 2)))
    assert "test_parameter_without_marker.<locals>.energy" in text
    assert "parameter 'r' has no shardvmc marker" in text
    assert "PerWalker[jax.Array]" in text and "replicated_args" in text


def test_decoration_error_is_raised_when_decorating():
    with pytest.raises(sv.DecorationError):

        @sv.walker_parallel
        def f(r: Mean):
            return r

    @sv.walker_parallel
    def g(r):
        return r

    with pytest.raises(sv.CallError, match="no shardvmc marker"):  # a missing marker: at the first call
        g.lower(jnp.ones(8))


def test_mean_on_a_parameter():
    def f(r: Mean):
        return r

    text = raises(sv.DecorationError, sv.walker_parallel, f)
    assert "parameter 'r' is marked Mean" in text and "Mean and Sum are for returns" in text and ".f" in text


def test_walker_key_on_a_return():
    def f(r: PerWalker) -> WalkerKey:
        return r

    text = raises(sv.DecorationError, sv.walker_parallel, f)
    assert "return annotation is marked WalkerKey" in text and "for parameters" in text


def test_marker_inside_tuple_return_checked():
    def f(r: PerWalker) -> tuple[PerWalker, WalkerKey]:
        return r, r

    text = raises(sv.DecorationError, sv.walker_parallel, f)
    assert "element 1 of the return annotation is marked WalkerKey" in text

    def g(r: PerWalker) -> tuple[PerWalker, Replicated]:
        return r, r

    assert "only a batched=True function" in raises(sv.DecorationError, sv.walker_parallel, g)


def test_two_markers_on_one_parameter():
    def f(r: PerWalker[Replicated[jax.Array]]):
        return r

    assert "several markers" in raises(sv.DecorationError, sv.walker_parallel, f)


def test_parameter_named_n_valid():
    def f(r: PerWalker, n_valid: Static[int]):
        return r

    text = raises(sv.DecorationError, sv.walker_parallel, f)
    assert "'n_valid'" in text and "rename" in text


def test_unresolvable_annotation_is_an_error_not_any():
    def f(r: "PerWalker[UndefinedType]"):  # noqa: F821
        return r

    text = raises(sv.DecorationError, sv.walker_parallel, f)
    assert "could not be resolved" in text and "UndefinedType" in text and ".f" in text


def test_var_args_rejected():
    def f(*rs: PerWalker):
        return rs

    assert "*args or **kwargs" in raises(sv.DecorationError, sv.walker_parallel, f)


def test_replicated_args_unknown_name():
    def f(params, r):
        return r

    text = raises(sv.DecorationError, sv.replicated_args("parms"), f)
    assert "'parms'" in text and "not parameters" in text


def test_missing_marker_error_waits_for_the_first_call_without_global_state():
    """Nothing global decides: one replicated_args object stays usable; an unmarked kernel fails when called."""
    shared = sv.replicated_args("params")

    @sv.walker_parallel
    def f(params, r):
        return r

    with pytest.raises(sv.CallError, match="no shardvmc marker"):
        f(1.0, jnp.ones((8, 2)))
    assert shared(f)(1.0, jnp.ones((8, 2))).shape == (8, 2)
    assert shared(f.__wrapped__) is not shared(f.__wrapped__)


# ------------------------------------------------------------ call time


@sv.walker_parallel
def energy(params: Replicated, r: PerWalker, spin: PerWalker) -> Mean:
    return params * jnp.sum(r) + spin


def test_walker_counts_differ():
    text = raises(sv.CallError, energy, 1.0, jnp.ones((8, 3)), jnp.ones(6))
    assert "test_errors.energy" in text
    assert "'r'" in text and "'spin'" in text and "8" in text and "6" in text
    assert "fix:" in text


def test_walker_counts_differ_inside_a_pytree():
    @sv.walker_parallel
    def f(state: PerWalker) -> PerWalker:
        return state["r"]

    text = raises(sv.CallError, f, {"r": jnp.ones((8, 3)), "logpsi": jnp.ones(4)})
    assert "'state'['logpsi']" in text and "8" in text and "4" in text


def test_zero_walkers():
    text = raises(sv.CallError, energy, 1.0, jnp.ones((0, 3)), jnp.ones(0))
    assert "zero walkers" in text and "test_errors.energy" in text


@pytest.mark.parametrize("n_valid", [0, 9, -1])
def test_n_valid_out_of_range(n_valid):
    text = raises(sv.CallError, energy, 1.0, jnp.ones((8, 3)), jnp.ones(8), n_valid=n_valid)
    assert f"n_valid={n_valid}" in text and "1..8" in text and "pad_walker" in text


def test_n_valid_not_an_integer():
    assert "integer" in raises(sv.CallError, energy, 1.0, jnp.ones((8, 3)), jnp.ones(8), n_valid=2.5)


@sv.walker_parallel
def noisy(key: WalkerKey, r: PerWalker) -> PerWalker:
    return r + jax.random.normal(key)


@pytest.mark.parametrize(
    "key",
    [np.float32([1, 2]), jax.random.split(jax.random.key(0), 8), jnp.zeros((8, 2), jnp.uint32)],
    ids=["float", "typed-keys-per-walker", "raw-keys-per-walker"],
)
def test_walker_key_not_a_key(key):
    text = raises(sv.CallError, noisy, key, jnp.ones(8))
    assert "WalkerKey parameter 'key'" in text and "ONE key" in text and "jax.random.key(seed)" in text


def test_unhashable_static():
    @sv.walker_parallel
    def f(r: PerWalker, shape: Static[tuple]) -> PerWalker:
        return r

    text = raises(TypeError, f, jnp.ones(8), [1, 2])
    assert "Static parameter 'shape'" in text and "list" in text and "tuple" in text
    with pytest.raises(sv.UnhashableStaticError):
        f(jnp.ones(8), [1, 2])


def test_scalar_per_walker_argument():
    text = raises(sv.CallError, energy, 1.0, jnp.ones((8, 3)), jnp.float32(1.0))
    assert "'spin'" in text and "scalar" in text and "Replicated" in text


def test_mesh_without_walker_axis():
    f = sv.walker_parallel(energy.__wrapped__, mesh=sv.create_mesh(axis_name="batch"))
    text = raises(sv.CallError, f, 1.0, jnp.ones((8, 3)), jnp.ones(8))
    assert "no axis named 'walkers'" in text and "'batch'" in text


def test_tuple_output_mismatch():
    @sv.walker_parallel
    def f(r: PerWalker) -> tuple[PerWalker, Sum]:
        return r

    assert "tuple of 2 outputs" in raises(sv.CallError, f, jnp.ones(8))


def test_wrong_arguments_name_the_function():
    text = raises(TypeError, energy, 1.0, jnp.ones((8, 3)))
    assert "test_errors.energy" in text and "spin" in text
