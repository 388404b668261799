# --8<-- [start:devices]
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


# --8<-- [end:devices]

# The suite compiles far more than it computes: many small programs, most run a few times. Without LLVM's expensive
# optimisations XLA's CPU backend compiles them faster: measured on 2 cores, tests/test_hamiltonian.py with
# tests/test_mcmc.py took 86 s instead of 101 s, the driver's tests with the docs pages of the driver 97 s instead of
# 122 s. Every program of a test, and of the processes it starts (they inherit XLA_FLAGS), is built with the same
# flags, so comparisons between them are unchanged; what a test compares with an oracle holds at any optimisation.
_FAST_COMPILE_FLAGS = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true")
_flags = os.environ.get("XLA_FLAGS", "").split()
_flags += [f for f in _FAST_COMPILE_FLAGS if not any(g.startswith(f.split("=")[0] + "=") for g in _flags)]
os.environ["XLA_FLAGS"] = " ".join(_flags)

from pathlib import Path  # noqa: E402

import jax  # noqa: E402  (imported already by shardvmc.testing; no backend started)
import pytest  # noqa: E402

# JAX's persistent compilation cache, shared by the test processes (the xdist workers; set in this process's JAX
# config, not in the environment, so the processes a test starts do not inherit it). The suite compiles the same
# program again and again: a fresh jax.jit (a lambda, a functools.partial) compiles again in the same process, as
# the examples' initial_state does each run (tests/test_neural_example.py: 92 s, 59 s with the cache from empty,
# measured). Not for the processes the tests start: a process that reuses nothing pays for writing each entry (the
# KFAC example: 28 s, 33 s from an empty cache), and under shardvmc.launch process 0 alone would read the entries,
# reaching its first collective early, past gloo's 30 s wait under load (tests/test_chaos.py's _cached).
# SHARDVMC_TEST_COMPILATION_CACHE names another directory; empty: none.
_CACHE = os.environ.get("SHARDVMC_TEST_COMPILATION_CACHE", str(Path(__file__).resolve().parent / ".jax-cache"))
# The processes tests start (the examples, sv.driver.run's jobs) keep none either, unless a test sets its own
# (sv.driver.run and the examples turn sv.enable_compilation_cache on by default).
os.environ.setdefault("SHARDVMC_COMPILATION_CACHE", "off")
if _CACHE:
    jax.config.update("jax_compilation_cache_dir", _CACHE)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)  # most programs compile in under 1 s
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)  # every size

# orbax-checkpoint 0.12.8 reads jax.sharding.SingleDeviceSharding at import, which JAX 0.12 deprecates: imported once
# here, quietly, so that whichever test (or docs example) imports it first does not turn its warning into an error.
import warnings  # noqa: E402

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    try:
        import orbax.checkpoint  # noqa: F401
    except ImportError:  # the checkpoint extra is not installed: its tests skip
        pass

# The doctests of the modules that need kfac-jax, which may be installed without supporting the
# installed JAX (kfac-jax 0.0.8 cannot be imported on JAX >= 0.11): there each module is collected
# as one skip with the reason (shardvmc.kfac's ImportError: the versions and the fix), not as an error.
PACKAGE = Path(__file__).resolve().parent / "shardvmc"
NEEDS_KFAC_JAX = {"kfac.py", "_kfac_compat.py"}


class _Skipped(pytest.File):
    """A module whose doctests cannot run here, collected as one skip."""

    reason = ""

    def collect(self):
        pytest.skip(self.reason)


def _kfac_jax_unusable() -> str | None:
    """Why kfac-jax cannot be imported here (shardvmc.kfac's message: the versions and the fix), or None."""
    try:
        import kfac_jax  # noqa: F401
    except Exception:  # not only ImportError: kfac-jax 0.0.8 on JAX >= 0.11 raises AttributeError
        try:
            import shardvmc.kfac  # noqa: F401
        except ImportError as err:
            return str(err)
        return "kfac-jax cannot be imported here"
    return None


@pytest.hookimpl(wrapper=True)
def pytest_collect_file(file_path, parent):
    collected = yield
    if file_path.parent == PACKAGE and file_path.name in NEEDS_KFAC_JAX and (reason := _kfac_jax_unusable()):
        skipped = _Skipped.from_parent(parent, path=file_path)
        skipped.reason = reason
        return [skipped]
    return collected
