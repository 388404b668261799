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


def pytest_collection_modifyitems(items):
    """Run every docstring example with only the names it imports itself, as a reader's copy runs.

    pytest gives a doctest its module's globals; without this, an example that uses ``jax``
    without importing it passes here and fails where it is copied to.
    """
    for item in items:
        dtest = getattr(item, "dtest", None)
        if dtest is not None:
            dtest.globs = {"__name__": dtest.globs.get("__name__", "__main__")}
