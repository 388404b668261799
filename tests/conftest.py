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
