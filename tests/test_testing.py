"""shardvmc.testing assertions pass on good shardings and list every bad leaf."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import shardvmc as sv
from shardvmc.testing import assert_replicated, assert_walker_sharded


@pytest.mark.parametrize("n_devices", [3, 8])
def test_assert_walker_sharded(n_devices):
    mesh = sv.create_mesh(jax.devices()[:n_devices])
    tree = sv.shard_walker({"r": np.zeros((24, 3)), "t": 1.0}, mesh)
    assert_walker_sharded(tree, mesh)
    bad = {"r": tree["r"], "p": sv.replicate(np.zeros((24, 3)), mesh), "q": jnp.zeros((24, 3))}
    with pytest.raises(AssertionError) as err:
        assert_walker_sharded(bad, mesh)
    assert "['p']" in str(err.value) and "['r']" not in str(err.value) and "2 leaves" in str(err.value)


def test_on_one_device_replicated_and_walker_sharded_are_one_layout():
    mesh = sv.create_mesh(jax.devices()[:1])
    assert_walker_sharded({"p": sv.replicate(np.zeros((24, 3)), mesh)}, mesh)
    with pytest.raises(AssertionError, match=r"\['p'\]"):  # but not on another mesh
        assert_walker_sharded({"p": sv.replicate(np.zeros((24, 3)), mesh)}, sv.create_mesh(jax.devices()[:2]))


def test_assert_replicated():
    mesh = sv.create_mesh()
    assert_replicated(sv.replicate({"w": np.ones(3)}, mesh))
    with pytest.raises(AssertionError, match=r"\['w'\]"):
        assert_replicated({"w": sv.shard_walker(np.ones(8), mesh)})


def test_tracers_are_reported_clearly():
    with pytest.raises(AssertionError, match="tracer"):
        jax.jit(lambda x: assert_replicated(x))(jnp.ones(2))


def test_set_cpu_devices_keeps_an_existing_count_and_adds_the_scheduler_flag(monkeypatch):
    from jax._src import xla_bridge

    from shardvmc.testing import CPU_SCHEDULER_FLAG, set_cpu_devices

    monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: False)  # this process's backend runs
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
    set_cpu_devices(8)
    assert os.environ["XLA_FLAGS"].split() == ["--xla_force_host_platform_device_count=2", CPU_SCHEDULER_FLAG]
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_use_thunk_runtime=false")
    set_cpu_devices(3)
    set_cpu_devices(3)  # idempotent
    assert os.environ["XLA_FLAGS"].split() == [
        "--xla_cpu_use_thunk_runtime=false",
        "--xla_force_host_platform_device_count=3",
        CPU_SCHEDULER_FLAG,
    ]


def test_set_cpu_devices_keeps_openblas_to_one_thread_per_fake_device(monkeypatch):
    from jax._src import xla_bridge

    from shardvmc.testing import set_cpu_devices

    monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: False)
    monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
    set_cpu_devices(8)  # the existing count, one device, wins: OpenBLAS keeps its threads
    assert "OPENBLAS_NUM_THREADS" not in os.environ
    monkeypatch.setenv("XLA_FLAGS", "")
    set_cpu_devices(8)
    assert os.environ["OPENBLAS_NUM_THREADS"] == "1"
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "4")  # the user's choice wins
    set_cpu_devices(8)
    assert os.environ["OPENBLAS_NUM_THREADS"] == "4"


def test_set_cpu_devices_refuses_a_started_backend():
    from shardvmc.testing import set_cpu_devices

    with pytest.raises(RuntimeError, match="already started"):
        set_cpu_devices(8)
