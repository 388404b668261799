"""Give the test process 8 fake CPU devices before JAX starts its backend.

This file sits at the repository root so that it runs before anything imports a JAX
backend, for the tests and for the doctests of the package alike.
"""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _doctest_namespace(doctest_namespace):
    doctest_namespace["jax"] = jax
