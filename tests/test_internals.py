"""Each of other libraries' internals that shardvmc uses (``shardvmc/_internals.py``), pinned by a test.

Every test here fails when the internal it checks changes in a new JAX (or folx): it is
the signal to revisit the function in ``_internals`` (and, where the comment there says
so, to delete it).
"""

from __future__ import annotations

import inspect
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import shardvmc as sv
from shardvmc import _internals

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- the current mesh


def test_context_mesh_is_jax_private_state_and_reads_set_mesh():
    import jax._src.mesh as jax_mesh

    private = getattr(jax_mesh, "device_context", None) or jax._src.config.device_context
    assert _internals.CONTEXT_MESH is private  # not the public fallback
    assert _internals.NO_CONTEXT_MESH is jax_mesh.empty_concrete_mesh
    mesh = sv.create_mesh(jax.devices()[:2])
    outside = _internals.CONTEXT_MESH.value
    assert any(outside is none for none in (None, _internals.NO_CONTEXT_MESH))  # the engine tests by identity
    with jax.set_mesh(mesh):
        assert _internals.CONTEXT_MESH.value == mesh
        # and while tracing, where the public jax.sharding.get_mesh refuses
        seen = []
        jax.jit(lambda x: seen.append(_internals.CONTEXT_MESH.value) or x)(jnp.ones(2))
        assert seen == [mesh]
    jax.sharding.set_mesh(mesh)  # the global spelling (NetKet's, at import) sets the same state
    try:
        assert _internals.CONTEXT_MESH.value == mesh
    finally:
        jax.sharding.set_mesh(None)
    after = _internals.CONTEXT_MESH.value
    assert any(after is none for none in (None, _internals.NO_CONTEXT_MESH))


def test_tracing_is_jax_trace_state_and_sees_every_transform():
    from jax._src.core import trace_state_clean

    assert _internals._trace_state_clean is trace_state_clean  # not the fallback
    assert not _internals.tracing()
    seen = []

    def probe(x):
        seen.append(_internals.tracing())
        return x

    jax.jit(probe)(1.0)
    jax.grad(probe)(1.0)
    jax.vmap(probe)(jnp.ones(2))
    jax.lax.scan(lambda c, x: (probe(c), None), 0.0, jnp.ones(2))
    assert seen == [True] * 4


# ---------------------------------------------------------------- the backend, before and after it starts


def test_backends_initialized_and_distributed_settings_in_a_fresh_process():
    code = textwrap.dedent(
        """
        import jax
        from shardvmc import _internals
        print(_internals.backends_initialized(), _internals.distributed_settings()["coordinator_address"])
        jax.devices()
        print(_internals.backends_initialized())
        """
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "None", "True"]


def test_backends_initialized_in_this_process():
    jax.devices()
    assert _internals.backends_initialized()


# ---------------------------------------------------------------- gloo's host


def test_jax_builds_gloo_through_the_factory_that_pin_gloo_host_wraps(monkeypatch):
    from jax._src import xla_bridge

    module = xla_bridge._jax  # pyright: ignore[reportPrivateImportUsage]
    # the factory takes the host and interface, and JAX's CPU client calls it through this module attribute
    assert "hostname" in (module.make_gloo_tcp_collectives.__doc__ or "")
    assert "interface" in (module.make_gloo_tcp_collectives.__doc__ or "")
    assert "_jax.make_gloo_tcp_collectives(" in inspect.getsource(xla_bridge.make_cpu_client)

    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(module, "make_gloo_tcp_collectives", lambda **kw: calls.append(kw) or "collectives")
    assert _internals.gloo_host() is None
    assert _internals.pin_gloo_host("127.0.0.1")
    assert _internals.pin_gloo_host("::1")  # again: the factory is wrapped once, with the new host
    assert _internals.gloo_host() == "::1"
    assert module.make_gloo_tcp_collectives(distributed_client="client") == "collectives"
    module.make_gloo_tcp_collectives(distributed_client="client", interface="eth0")
    assert calls == [
        {"distributed_client": "client", "hostname": "::1"},
        {"distributed_client": "client", "interface": "eth0"},  # someone else's choice is kept
    ]


# ---------------------------------------------------------------- the distributed runtime


def test_distributed_settings_reads_what_jax_settled_on(monkeypatch):
    from jax._src.distributed import global_state

    monkeypatch.setattr(global_state, "coordinator_address", "10.0.0.1:1234")
    monkeypatch.setattr(global_state, "num_processes", 4)
    monkeypatch.setattr(global_state, "process_id", 3)
    assert _internals.distributed_settings() == {
        "coordinator_address": "10.0.0.1:1234",
        "num_processes": 4,
        "process_id": 3,
    }


# ---------------------------------------------------------------- JAX's SIGTERM notifier


def test_jax_distributed_initialize_takes_sigterm_and_its_disposition_can_be_put_back():
    """JAX's preemption notifier replaces SIGTERM's C-level handler (SIGTERM then no longer ends the process);
    the disposition from before, and JAX's, can be read and set back."""
    code = textwrap.dedent(
        """
        import os, signal, time
        import jax
        from shardvmc import _internals
        from shardvmc.launch import free_port
        before = _internals.signal_disposition(signal.SIGTERM)
        jax.distributed.initialize(f"127.0.0.1:{free_port()}", 1, 0)
        notifier = _internals.signal_disposition(signal.SIGTERM)
        print(before.handler == 0, notifier.handler not in (0, before.handler))  # SIG_DFL, then JAX's handler
        assert _internals.set_signal_disposition(signal.SIGTERM, before)
        print(_internals.signal_disposition(signal.SIGTERM).handler == 0)
        assert _internals.set_signal_disposition(signal.SIGTERM, notifier)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(2)
        print("JAX's notifier took it")
        assert _internals.set_signal_disposition(signal.SIGTERM, before)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(10)
        print("not reached: SIGTERM ends the process")
        """
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert out.returncode == -signal.SIGTERM, out.stdout + out.stderr
    assert out.stdout.splitlines() == ["True True", "True", "JAX's notifier took it"], out.stderr


# ---------------------------------------------------------------- the varying-axes verdict


def _checked(mesh: Any, out_specs: Any, fn: Any) -> Any:
    return jax.shard_map(fn, mesh=mesh, in_specs=P("walkers"), out_specs=out_specs, check_vma=True)


def test_vma_check_verdict_reads_the_outputs_jax_finds_varying():
    mesh = sv.create_mesh(jax.devices()[:2])
    x = jax.ShapeDtypeStruct((4,), jnp.float32)

    def body(r: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        return jax.lax.psum(r.sum(), "walkers"), r.sum(), r * 2  # replicated, device-local, per walker

    varying = _checked(mesh, (P(), P(), P("walkers")), body)
    assert _internals.vma_check_verdict(lambda: jax.eval_shape(varying, x)) == [1]
    both = _checked(mesh, (P(), P()), lambda r: (r.sum(), r.max()))
    assert _internals.vma_check_verdict(lambda: jax.eval_shape(both, x)) == [0, 1]
    proven = _checked(mesh, P(), lambda r: jax.lax.psum(r.sum(), "walkers"))
    assert _internals.vma_check_verdict(lambda: jax.eval_shape(proven, x)) == []


def test_vma_check_verdict_cannot_tell_other_failures():
    def fails(error: BaseException) -> Any:
        def trace() -> None:
            raise error

        return trace

    assert _internals.vma_check_verdict(fails(ValueError("out_specs[0] is P() but something else"))) is None
    assert _internals.vma_check_verdict(fails(TypeError("no"))) is None
    assert _internals.vma_check_verdict(fails(SystemExit(None))) is None  # folx's exit() while tracing


def test_folx_still_calls_exit_while_tracing():
    """The reason vma_check_verdict catches SystemExit; when this fails, folx dropped it and the catch can go."""
    interpreter = pytest.importorskip("folx.interpreter")
    assert "exit()" in inspect.getsource(interpreter)


# ---------------------------------------------------------------- the quarantine itself

# The modules allowed to name another library's private modules: _internals (JAX), _kfac_compat (kfac-jax), and
# _compat until its current-mesh getter comes from _internals.
QUARANTINE = {"_internals", "_kfac_compat"}


def test_only_the_compatibility_modules_reach_into_private_modules():
    found = {}
    for path in sorted((ROOT / "shardvmc").glob("*.py")):
        text = path.read_text()
        uses = [word for word in ("jax._src", "kfac_jax._src", "ctypes") if word in text]
        if uses and path.stem not in QUARANTINE:
            found[path.name] = uses
    assert not found, f"private APIs outside shardvmc/_internals.py: {found}; add a function there instead."


# ---------------------------------------------------------------- jaxprs


def test_jaxpr_parts_of_a_traced_program_and_its_literals():
    """``make_jaxpr``'s program splits into a jaxpr and its constants; a literal input is recognised as one."""
    closed = jax.make_jaxpr(lambda x: jnp.sin(x) * 2.0 + jnp.ones(3))(jnp.ones(3))
    jaxpr, consts = _internals.closed_jaxpr_parts(closed)
    assert isinstance(jaxpr, _internals.Jaxpr) and _internals.is_jaxpr(closed) and _internals.is_jaxpr(jaxpr)
    assert len(consts) == len(jaxpr.constvars)
    mul = next(e for e in jaxpr.eqns if e.primitive.name == "mul")
    assert [_internals.literal_value(v) for v in mul.invars][1] == (2.0,)
    assert _internals.literal_value(mul.invars[0]) is None
    pjit = jax.make_jaxpr(lambda x: jax.jit(jnp.cos)(x))(1.0)
    sub = next(
        v for e in _internals.closed_jaxpr_parts(pjit)[0].eqns for v in e.params.values() if _internals.is_jaxpr(v)
    )
    assert _internals.closed_jaxpr_parts(sub)[0].eqns[0].primitive.name == "cos"
