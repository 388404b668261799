"""Give the test process 8 fake CPU devices before JAX starts its backend.

This file sits at the repository root so that it runs before anything imports a JAX
backend, for the tests and for the doctests of the package alike.

XLA's CPU runtime (jaxlib 0.10.2) can deadlock on larger programs: every thread idles
on a futex and the call never returns, e.g. on the second call of a step that holds a
folx local energy, a per-walker Jacobian and a linear solve. ``set_cpu_devices`` also
turns off the concurrency-optimised scheduler, which removes it (measured): the suite
must never hang.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from shardvmc.testing import set_cpu_devices  # noqa: E402  (imports jax, starts no backend)

set_cpu_devices(8)

import jax  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _doctest_namespace(doctest_namespace):
    doctest_namespace["jax"] = jax
