"""The tests' meshes: a walker mesh over the first devices (the fake devices are set up by the root conftest.py)."""

import jax

import shardvmc as sv


def mesh_of(n: int):
    """A walker mesh over the first ``n`` devices."""
    return sv.create_mesh(jax.devices()[:n])
