"""Fixtures shared by the tests (the fake devices are set up by the root conftest.py)."""

import jax
import pytest

import shardvmc as sv

DEVICE_COUNTS = (1, 3, 8)


@pytest.fixture(params=DEVICE_COUNTS, ids=lambda n: f"{n}dev")
def mesh(request):
    """A walker mesh over the first 1, 3 or 8 devices."""
    return sv.create_mesh(jax.devices()[: request.param])
