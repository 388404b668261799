"""The XLA options of the library's steps (``shardvmc._compiler``): no YNNPACK fusions in their CPU programs,
and single-threaded matrix products where the CPU devices fill the cores.

Read from the compiled programs: a plain ``jax.jit`` of the same function has such fusions on
this JAX; ``platform_jit``'s (``sv.driver.VMC.step``, ``sv.dmc.DMC``'s step) called at the top
level has none, inside a user's ``jax.jit`` the user's options decide, and the values are the
plain program's.
"""

import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import shardvmc as sv
from shardvmc import _compiler
from shardvmc._compiler import platform_jit

W1 = jnp.linspace(-1.0, 1.0, 16 * 32).reshape(16, 32)
W2 = jnp.linspace(0.1, 0.5, 32 * 8).reshape(32, 8)
YNN = "__ynn"  # how XLA's CPU backend names a YNNPACK fusion in the compiled program's text


def mlp(params: sv.Replicated[dict], r: sv.PerWalker[jax.Array]) -> sv.PerWalker[jax.Array]:
    """Small products of a few walkers: what XLA hands to YNNPACK on CPUs."""
    return jnp.sum(jnp.tanh(jnp.tanh(r @ params["w1"]) @ params["w2"]))


PARAMS = {"w1": W1, "w2": W2}


def walkers(n: int = 64) -> jax.Array:
    return jnp.linspace(-1.0, 1.0, n * 4 * 16, dtype=jnp.float32).reshape(n, 4, 16)


def ynn_fusions(compiled) -> int:
    return compiled.as_text().count(YNN)


@pytest.fixture(scope="module")
def plain_has_fusions():
    """The plain jit of ``mlp`` has YNNPACK fusions here, or the tests below would prove nothing."""
    plain = jax.jit(jax.vmap(mlp, (None, 0))).lower(PARAMS, walkers()).compile()
    if not ynn_fusions(plain):
        pytest.skip("this JAX's CPU compiler makes no YNNPACK fusions of the test's program")
    return True


NO_YNN = {"xla_cpu_experimental_ynn_fusion_type": "", "xla_cpu_enable_concurrency_optimized_scheduler": False}
ONE_THREAD = {"xla_cpu_multi_thread_eigen": False}


def test_the_options_by_platform_and_by_cores(monkeypatch):
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    devices = jax.local_device_count("cpu")
    monkeypatch.setattr(_compiler, "_cores", lambda: devices + 1)  # a core to spare: Eigen's pool may use it
    assert sv.compiler_options("cpu") == NO_YNN
    monkeypatch.setattr(_compiler, "_cores", lambda: devices)  # a device on every core
    assert sv.compiler_options("cpu") == NO_YNN | ONE_THREAD
    assert sv.compiler_options("tpu") == {} and sv.compiler_options("gpu") == {}
    assert sv.compiler_options() == sv.compiler_options(jax.default_backend())
    # flags that name an option decide it: the library does not pass that one
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_cpu_experimental_ynn_fusion_type=")
    assert sv.compiler_options("cpu") == ONE_THREAD | {"xla_cpu_enable_concurrency_optimized_scheduler": False}
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_experimental_ynn_fusion_type= --xla_cpu_multi_thread_eigen=true "
                       "--xla_cpu_enable_concurrency_optimized_scheduler=true")  # fmt: skip
    assert sv.compiler_options("cpu") == {}


def test_single_threaded_products_compute_what_the_plain_program_does(monkeypatch):
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    monkeypatch.setattr(_compiler, "_cores", lambda: 1)
    options = sv.compiler_options("cpu")
    assert options == NO_YNN | ONE_THREAD  # this JAX knows both (else the library would leave them out)
    big = jnp.linspace(-1.0, 1.0, 256 * 256).reshape(256, 256)  # large enough for Eigen to split
    np.testing.assert_allclose(
        jax.jit(lambda a: jnp.tanh(a @ a.T) @ a, compiler_options=options)(big), jnp.tanh(big @ big.T) @ big, rtol=2e-5
    )


def test_platform_jit_builds_its_jit_at_first_use_with_the_options(plain_has_fusions):
    step = platform_jit(jax.vmap(mlp, (None, 0)))
    assert step._top is None  # the top-level jit waits for a first use (it reads the default backend)
    assert ynn_fusions(step.lower(PARAMS, walkers()).compile()) == 0  # lower, trace, ...: the jit's
    np.testing.assert_allclose(step(PARAMS, walkers()), jax.vmap(mlp, (None, 0))(PARAMS, walkers()), rtol=1e-6)
    assert step.__wrapped__ is not None and weakref.ref(step)() is step  # caches hold steps weakly


def test_inside_a_users_jit_the_users_options_decide(plain_has_fusions):
    step = platform_jit(jax.vmap(mlp, (None, 0)))

    def outer(params, r):  # JAX refuses options on a nested jit: the step is the plain jit there
        return 2 * step(params, r)

    r = walkers()
    assert ynn_fusions(jax.jit(outer).lower(PARAMS, r).compile()) > 0
    mine = jax.jit(outer, compiler_options=sv.compiler_options("cpu"))
    assert ynn_fusions(mine.lower(PARAMS, r).compile()) == 0
    np.testing.assert_allclose(mine(PARAMS, r), 2 * jax.vmap(mlp, (None, 0))(PARAMS, r), rtol=1e-6)
    total, _ = jax.lax.scan(lambda c, _: (c + step(PARAMS, r), None), jnp.zeros(len(r)), None, length=2)
    np.testing.assert_allclose(total, 2 * jax.vmap(mlp, (None, 0))(PARAMS, r), rtol=1e-6)
    np.testing.assert_allclose(jax.jit(step)(PARAMS, r), jax.vmap(mlp, (None, 0))(PARAMS, r), rtol=1e-6)  # jit of it


def test_importing_turns_the_cpu_scheduler_off_before_the_backend_starts():
    """XLA reads its flags once: importing shardvmc adds the flag while no backend has started, and only then."""
    import os
    import subprocess
    import sys

    def flags_after_import(before: str = "", xla_flags: str | None = None) -> list[str]:
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
        if xla_flags is not None:
            env["XLA_FLAGS"] = xla_flags
        code = f"import os, jax{before}; import shardvmc; print(os.environ.get('XLA_FLAGS', ''))"
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        return out.stdout.split()

    assert flags_after_import() == [_compiler.SCHEDULER_FLAG]
    assert flags_after_import(before="; jax.numpy.ones(1)") == []  # the backend has started: too late, left alone
    mine = "--xla_cpu_enable_concurrency_optimized_scheduler=true"
    assert flags_after_import(xla_flags=mine) == [mine]  # the user's choice wins
