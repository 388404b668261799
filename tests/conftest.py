"""Fixtures shared by the tests (the fake devices are set up by the root conftest.py)."""

import warnings

import jax
import pytest
from meshes import mesh_of

import shardvmc as sv

DEVICE_COUNTS = (1, 3, 8)


@pytest.fixture(params=DEVICE_COUNTS, ids=lambda n: f"{n}dev")
def mesh(request):
    """A walker mesh over the first 1, 3 or 8 devices."""
    return mesh_of(request.param)


@pytest.fixture
def x64():
    """float64 for the whole test (``pytestmark = pytest.mark.usefixtures("x64")`` for a whole module)."""
    with jax.enable_x64(True):
        yield


@pytest.fixture
def x64_padded(x64):
    """float64, and no ``PaddingWarning``: for tests whose walker counts the devices do not divide."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sv.PaddingWarning)
        yield


# The test modules where the JAX version matters, marked jax_facing below with the package's docstring examples:
# CI's second leg (the newest JAX) runs those (pytest -m "jax_facing and not end_to_end"). What calls JAX's own APIs
# (the compatibility layer, the engine under every kernel: jit, shard_map, vmap, meshes and shardings, transforms of
# kernels; folx and dtypes; the compiler's options and cache; orbax; the distributed runtime) and the errors raised
# from JAX's. The rest (samplers' and solvers' algorithms, statistics, the driver, DMC, KFAC, the docs, the
# benchmarks, the examples) is built on those and tested on the first leg; docs/contributing.md.
JAX_FACING = frozenset(
    f"test_{name}.py"
    for name in (
        "internals", "decorator", "vmap", "engine", "meshes_and_surprises", "future_annotations", "api",
        "errors", "bad_inputs", "walker_sets", "reductions", "mcmc", "hamiltonian", "linalg", "numerics",
        "cholesky", "compiler", "compilation_cache", "testing", "model_libraries", "checkpoint", "multiprocess",
    )
)  # fmt: skip


def pytest_collection_modifyitems(items):
    """Mark ``jax_facing`` the tests of the ``JAX_FACING`` modules and the package's docstring examples."""
    for item in items:
        if item.path.name in JAX_FACING or getattr(item, "dtest", None) is not None:
            item.add_marker(pytest.mark.jax_facing)
