"""natural_gradient: every method against a float64 numpy solution, on 1, 3 and 8 devices, with padding.

The system every method solves, over the n valid walkers: Jc = (J - mean J)/sqrt(n),
ec = (e - mean e)/sqrt(n), update = (Jc^H Jc + damping I)^-1 Jc^H ec. Padding walkers
hold NaN, so any leak shows. Compiled programs are shared between tests through the
solver's own cache (same shapes, same mesh).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxprs import equations

import shardvmc as sv
from shardvmc._memory import compiled_memory, device_memory_budget, format_bytes
from shardvmc._natgrad import estimate_bytes

N, N_VALID, P = 15, 13, 20  # 15 walker slots (padded to 15, 16 on 3, 8 devices), 13 real ones; N < P
DAMPING = 1e-2
METHODS = ("dense", "minsr", "spring", "cg")
EXACT = {"tol": 1e-13, "maxiter": 500}  # CG to float64 round-off


def reference(j, e, n_valid, damping, real=False, momentum=0.0, previous=None):
    """The solution in float64 numpy, from the P x P normal equations."""
    j = np.asarray(j, np.complex128)[:n_valid]
    e = np.asarray(e, np.complex128)[:n_valid]
    jc = (j - j.mean(0)) / np.sqrt(n_valid)
    ec = (e - e.mean()) / np.sqrt(n_valid)
    s, b = jc.conj().T @ jc, jc.conj().T @ ec
    if real:
        s, b = s.real, b.real
    if previous is not None:  # SPRING: argmin |ec - Jc x|^2 + damping |x - momentum prev|^2
        b = b + damping * momentum * previous
    out = np.linalg.solve(s + damping * np.eye(s.shape[0]), b)
    return out.real if real or not (np.iscomplexobj(out) and np.abs(out.imag).max() > 0) else out


def problem(seed=0, complex_=False, n=N, p=P, n_valid=N_VALID):
    """J and e with NaN in the padding rows."""
    rng = np.random.default_rng(seed)
    j = rng.normal(size=(n, p)) + 0.3 * np.arange(p)  # a non-zero mean, so centring matters
    e = rng.normal(size=n) - 2.0
    if complex_:
        j = j + 1j * rng.normal(size=(n, p))
        e = e + 0.1j * rng.normal(size=n)
    j[n_valid:] = np.nan
    e[n_valid:] = np.nan
    return j, e


_CACHE: dict = {}


def solve(k, method, **kw):
    """natural_gradient on the first k devices in float64 (memoised by arguments)."""
    key = (k, method, tuple(sorted((a, str(b)) for a, b in kw.items() if a not in ("j", "e"))))
    if key not in _CACHE:
        j, e = kw.pop("j"), kw.pop("e")
        mesh = sv.create_mesh(jax.devices()[:k])
        with jax.enable_x64(True):
            extra = EXACT if method == "cg" else {}
            update, info = sv.natural_gradient(
                j, e, n_valid=kw.pop("n_valid", N_VALID), damping=DAMPING, method=method, mesh=mesh, **extra, **kw
            )
            _CACHE[key] = (jax.device_get(update), info, update.sharding if hasattr(update, "sharding") else None, mesh)
    return _CACHE[key]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("k", [1, 3, 8], ids=lambda k: f"{k}dev")
def test_real_matches_numpy_with_padding(k, method):
    j, e = problem()
    update, info, sharding, mesh = solve(k, method, j=j, e=e)
    np.testing.assert_allclose(update, reference(j, e, N_VALID, DAMPING), rtol=1e-9, atol=1e-9)
    assert update.dtype == np.float64 and update.shape == (P,)
    assert sharding.is_fully_replicated and sharding.mesh == mesh
    assert info.method == method and info.n_params == P and info.planned_bytes > 0
    assert float(info.residual) < 1e-9
    assert (int(info.iterations) > 0) == (method == "cg")


@pytest.mark.parametrize("k", [1, 3, 8], ids=lambda k: f"{k}dev")
def test_methods_agree_with_each_other(k):
    """minSR = dense SR (push-through identity, N < P); CG converges to dense; SPRING with no momentum = minSR."""
    j, e = problem()
    dense = solve(k, "dense", j=j, e=e)[0]
    for method in ("minsr", "spring", "cg"):
        np.testing.assert_allclose(solve(k, method, j=j, e=e)[0], dense, rtol=1e-9, atol=1e-9, err_msg=method)


@pytest.mark.parametrize("method", ["dense", "minsr", "cg"])
@pytest.mark.parametrize("real_params", [False, True], ids=["complex_params", "real_params"])
def test_complex_matches_numpy(method, real_params):
    j, e = problem(seed=1, complex_=True)
    update = solve(3, method, j=j, e=e, real_params=real_params)[0]
    want = reference(j, e, N_VALID, DAMPING, real=real_params)
    assert np.iscomplexobj(update) != real_params
    np.testing.assert_allclose(update, want, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("p", [130, 301])  # the Gram product of [Jc | ec] in 2 and 4 blocks of rows
@pytest.mark.parametrize("complex_", [False, True], ids=["real", "complex"])
def test_dense_with_many_parameters_matches_numpy(p, complex_):
    j, e = problem(seed=7, complex_=complex_, n=p + 40, p=p, n_valid=p + 33)
    want = reference(j, e, p + 33, DAMPING)
    for k in (1, 3):
        mesh = sv.create_mesh(jax.devices()[:k])
        with jax.enable_x64(True):
            update, info = sv.natural_gradient(j, e, n_valid=p + 33, damping=DAMPING, method="dense", mesh=mesh)
        np.testing.assert_allclose(update, want, rtol=1e-9, atol=1e-9, err_msg=f"{k} devices")
        assert float(info.residual) < 1e-9


def test_more_walkers_than_parameters():
    """P < N: dense and minSR solve the same system from the two sides; CG (Jacobi-preconditioned here) too."""
    j, e = problem(seed=2, n=24, p=5, n_valid=21)
    want = reference(j, e, 21, DAMPING)
    for method in ("dense", "minsr", "cg"):
        np.testing.assert_allclose(solve(3, method, j=j, e=e, n_valid=21)[0], want, rtol=1e-9, atol=1e-9)


def test_spring_momentum_matches_its_least_squares_form():
    j, e = problem(seed=3)
    previous = np.random.default_rng(4).normal(size=P)
    update = solve(3, "spring", j=j, e=e, momentum=0.9, previous=previous)[0]
    np.testing.assert_allclose(update, reference(j, e, N_VALID, DAMPING, momentum=0.9, previous=previous), atol=1e-9)


def test_pytree_walker_sets_and_eigh_solver():
    """A pytree J (leaves (N, ...)) in WalkerSets: the update has J's structure without the walker axis."""
    j, e = problem(seed=5)
    tree = {"w": j[:, :12].reshape(N, 3, 4), "b": j[:, 12:]}
    mesh = sv.create_mesh(jax.devices()[:3])
    with jax.enable_x64(True):
        update, info = sv.natural_gradient(
            sv.WalkerSet(tree, N_VALID), sv.WalkerSet(e, N_VALID), damping=DAMPING, mesh=mesh, solver="eigh"
        )
    want = reference(j, e, N_VALID, DAMPING)
    assert update["w"].shape == (3, 4) and update["b"].shape == (8,)
    np.testing.assert_allclose(np.concatenate([np.ravel(update["w"]), update["b"]]), want, atol=1e-9)
    assert info.method == "minsr" and "N x N" in info.reason


def _collectives(text):
    """``[(kind, result shape)]`` of the collectives in compiled HLO text."""
    found = []
    for m in re.finditer(r"= (\S+\[[\d,]*\])\S* (all-gather|all-to-all|all-reduce)(?:-start)?\(", text):
        found.append((m.group(2), m.group(1)))
    for m in re.finditer(r"= \(([^)]*)\) (all-gather|all-to-all|all-reduce)(?:-start)?\(", text):
        found += [(m.group(2), s) for s in re.findall(r"\w+\[[\d,]*\]", m.group(1))]
    return found


def _elements(shape):
    dims = re.search(r"\[([\d,]*)\]", shape).group(1)
    return int(np.prod([int(x) for x in dims.split(",") if x]))


def test_minsr_inside_jit_never_gathers_j_and_matches_in_float32():
    """The compiled minSR program re-shards J with an all-to-all; the only all-gather is of the energies."""
    n, p = 64, 400
    mesh = sv.create_mesh()
    j, e = problem(seed=6, n=n, p=p, n_valid=n)
    j, e = sv.shard_walker((j.astype(np.float32), e.astype(np.float32)), mesh)
    step = jax.jit(lambda j, e: sv.natural_gradient(j, e, damping=1e-3, method="minsr", mesh=mesh)[0])
    found = _collectives(step.lower(j, e).compile().as_text())
    gathers = [shape for kind, shape in found if kind == "all-gather"]
    assert all(_elements(s) <= n for s in gathers), f"an all-gather of more than the energies: {gathers}"
    assert "all-to-all" in {k for k, _ in found}, found
    assert all(_elements(s) <= max(n * n, p) for k, s in found if k == "all-reduce"), found
    update = step(j, e)
    assert update.dtype == jnp.float32 and update.sharding.is_fully_replicated
    np.testing.assert_allclose(update, reference(j, e, n, 1e-3), rtol=1e-3, atol=1e-3)


def test_auto_picks_by_shape_and_chunks_to_fit_the_budget():
    mesh = sv.create_mesh()
    rng = np.random.default_rng(7)
    small_p = sv.natural_gradient(rng.normal(size=(64, 8)), rng.normal(size=64), damping=1e-3, mesh=mesh)[1]
    assert small_p.method == "dense" and "P=8 <= N=64" in small_p.reason
    j, e = rng.normal(size=(64, 1000)).astype(np.float32), rng.normal(size=64).astype(np.float32)
    one_pass, info = sv.natural_gradient(j, e, damping=1e-3, mesh=mesh, method="minsr")
    assert info.chunks == 1
    budget = info.planned_bytes - 1
    chunked, info = sv.natural_gradient(j, e, damping=1e-3, mesh=mesh, memory_budget=budget)
    assert info.planned_bytes <= budget and info.budget_bytes == budget
    assert (info.method, info.chunks) != ("minsr", 1) and "budget" in info.reason
    np.testing.assert_allclose(chunked, one_pass, rtol=1e-3, atol=1e-4)


def test_over_budget_names_what_fits():
    rng = np.random.default_rng(8)
    j, e = rng.normal(size=(64, 1000)).astype(np.float32), rng.normal(size=64).astype(np.float32)
    with pytest.raises(sv.CallError, match=r"(?s)natural_gradient: no solver fits.*method='dense'.*fix:.*method="):
        sv.natural_gradient(j, e, damping=1e-3, method="dense", memory_budget=2**20)


def test_memory_plan_of_a_step_is_j_s_rows_plus_the_solver_s_estimate_and_names_what_fits():
    params = {"w": jax.ShapeDtypeStruct((300, 100), jnp.float32), "b": np.zeros(100)}  # P = 30100, float64 wins
    p, budget = 30_100, 40 * 2**20
    plan = sv.natural_gradient_memory(1000, params, method="minsr", devices=3, memory_budget=budget)
    assert (plan.n_walkers, plan.n_params, plan.itemsize) == (1002, p, 8)  # padded to a multiple of 3
    assert plan.jacobian_bytes == 334 * p * 8  # one device's rows
    assert plan.solver_bytes == estimate_bytes("minsr", 1002, p, 3, 8, chunks=plan.chunks)
    assert plan.total_bytes == plan.jacobian_bytes + plan.solver_bytes and plan.fits == (plan.total_bytes <= budget)
    assert not plan.fits and plan.chunks == 64  # the fewest chunks that fit, else the smallest
    # The most walkers per device that fit do, one more does not; the devices named hold the 1000 walkers.
    most = plan.max_walkers_per_device
    fits = lambda n, d: sv.natural_gradient_memory(n, params, method="minsr", devices=d, memory_budget=budget).fits  # noqa: E731
    assert 0 < most < 334 and fits(3 * most, 3) and not fits(3 * (most + 1), 3)
    assert fits(1000, plan.devices_needed) and not fits(1000, plan.devices_needed - 1)
    with pytest.raises(sv.CallError) as refused:
        plan.check("here: --walkers")
    text = str(refused.value)
    assert f"minsr (chunks=64) needs about {format_bytes(plan.total_bytes)} per device" in text, text
    assert f"budget of {format_bytes(budget)}" in text and f"at most {most} walkers per device" in text, text
    assert f"{plan.devices_needed} devices hold 1002 walkers" in text and "KFAC" in text and "--walkers" in text
    # minSR's N x N matrix is on every device: more devices do not help, another solver does.
    wide = sv.natural_gradient_memory(3000, {"w": np.zeros((10, 100))}, method="minsr", devices=3, memory_budget=budget)
    assert not wide.fits and wide.devices_needed is None
    with pytest.raises(sv.CallError, match=r"(?s)no device count up to 4096 holds 3000 walkers.*method='cg'"):
        wide.check()
    small = sv.natural_gradient_memory(100, params, devices=1, memory_budget=8 * budget)
    assert small.fits and small.check() is small and small.max_walkers_per_device is None
    assert (small.method, small.chunks) == ("minsr", 1)  # auto: N < P
    with pytest.raises(sv.CallError, match="unknown method"):
        sv.natural_gradient_memory(100, params, method="kfac")


def test_info_is_a_pytree_of_two_arrays():
    update, info = sv.natural_gradient(np.ones((8, 3)) * np.arange(8)[:, None], np.arange(8.0), damping=1.0)
    assert len(jax.tree_util.tree_leaves(info)) == 2
    assert jax.tree_util.tree_map(lambda x: x, info).method == info.method


# ----------------------------------------------------------------------------- _memory


def test_compiled_memory_reads_the_program():
    compiled = jax.jit(lambda x: (x @ x.T).sum(0)).lower(jnp.ones((128, 16), jnp.float32)).compile()
    mem = compiled_memory(compiled)
    assert mem.argument_bytes == 128 * 16 * 4 and mem.output_bytes == 128 * 4
    assert mem.total_bytes == mem.argument_bytes + mem.output_bytes + mem.temp_bytes - mem.alias_bytes


def test_device_memory_budget_uses_the_reported_limit_else_a_share_of_host_ram():
    class Reporting:
        platform = "gpu"

        def memory_stats(self):
            return {"bytes_limit": 123456789}

    assert device_memory_budget(Reporting()) == 123456789
    cpu = jax.devices()[0]
    assert cpu.memory_stats() is None  # a CPU device reports nothing: the host's RAM is shared out
    import os

    ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    budget = device_memory_budget(cpu)
    assert 0 < budget * len(jax.local_devices()) < ram  # the devices' shares fit in the host together


def test_the_estimates_that_choose_candidates_match_the_compiled_solvers():
    """natural_gradient skips candidates whose estimate exceeds the budget: each estimate must be the
    compiled solver's per-device bytes within a factor of two, and rank the solvers as they compile."""
    n, p = 512, 3000
    rng = np.random.default_rng(0)
    j = sv.shard_walker(rng.normal(size=(n, p)).astype(np.float32))
    e = sv.shard_walker(rng.normal(size=(n,)).astype(np.float32))
    compiled, estimated = {}, {}
    for method, chunks in (("dense", 1), ("minsr", 1), ("minsr", 4), ("cg", 1)):
        options = {"chunks": chunks} if method == "minsr" else {}
        _, info = sv.natural_gradient(j, e, damping=1e-3, method=method, **options)
        compiled[method, chunks] = info.planned_bytes
        estimated[method, chunks] = estimate_bytes(method, n, p, 8, 4, chunks=chunks)
    for key in compiled:
        assert 0.5 <= compiled[key] / estimated[key] <= 2, (key, compiled[key], estimated[key])
    assert sorted(compiled, key=compiled.get)[-1] == sorted(estimated, key=estimated.get)[-1] == ("dense", 1)


@pytest.mark.parametrize("k", [1, 3], ids=lambda k: f"{k}dev")
def test_cg_without_damping_on_a_parameter_that_never_moves(k):
    """damping=0 and a zero column of J: S has a zero row, the Jacobi preconditioner a zero diagonal entry.

    The system is singular only in that direction, where the right-hand side is 0 too; CG must give the
    minimum-norm solution (numpy's pseudo-inverse of Jc in float64): the other entries exact, that one 0.
    """
    j, e = problem(seed=9, n=N, p=6)
    j[:N_VALID, 2] = 0.0  # a parameter log|psi| does not depend on (padding rows stay NaN)
    jc = (j[:N_VALID] - j[:N_VALID].mean(0)) / np.sqrt(N_VALID)
    ec = (e[:N_VALID] - e[:N_VALID].mean()) / np.sqrt(N_VALID)
    want = np.linalg.pinv(jc) @ ec
    mesh = sv.create_mesh(jax.devices()[:k])
    with jax.enable_x64(True):
        update, info = sv.natural_gradient(j, e, n_valid=N_VALID, damping=0.0, method="cg", mesh=mesh, **EXACT)
        dense, _ = sv.natural_gradient(j, e, n_valid=N_VALID, damping=0.0, method="dense", solver="eigh", mesh=mesh)
    update = np.asarray(update)
    assert np.isfinite(update).all(), update
    assert update[2] == 0.0
    np.testing.assert_allclose(update, want, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(update, dense, rtol=1e-9, atol=1e-9)
    assert int(info.iterations) > 0 and float(info.residual) < 1e-9


def test_traced_hyperparameters_with_concrete_walker_data():
    """A jitted step that closes over J and e and traces the damping and SPRING's state (a schedule under
    ``optax.inject_hyperparams``): the solve is traced into the step, and equals numpy's."""
    j, e = problem(seed=5)
    previous = np.random.default_rng(6).normal(size=P)
    mesh = sv.create_mesh(jax.devices()[:3])
    with jax.enable_x64(True):
        step = jax.jit(
            lambda damping, previous: sv.natural_gradient(
                j, e, n_valid=N_VALID, damping=damping, method="spring", momentum=0.5, previous=previous, mesh=mesh
            )[0]
        )
        update = step(jnp.float64(0.05), jnp.asarray(previous))
    want = reference(j, e, N_VALID, 0.05, momentum=0.5, previous=previous)
    np.testing.assert_allclose(update, want, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("method", METHODS)
def test_float32_products_at_full_precision(method):
    """The solvers' products run at HIGHEST whatever the ambient precision (a TPU's default is one bfloat16 pass).

    With one pass the Gram matrices are 1e-3 off and the update of a damped system of
    condition 1e4 1e-2 off: the TPU gave dense and minSR answers that far apart.
    """
    j, e = (np.asarray(x, np.float32) for x in problem(seed=2, n_valid=N))
    mesh = sv.create_mesh(jax.devices()[:1])
    update = lambda j, e: sv.natural_gradient(j, e, damping=DAMPING, method=method, mesh=mesh)[0]  # noqa: E731
    with jax.default_matmul_precision("bfloat16"):
        traced = jax.make_jaxpr(update)(j, e)
    dots = [q for q in equations(traced.jaxpr) if q.primitive.name == "dot_general"]
    assert dots, "no product traced"
    precisions = {str(q.params["precision"]) for q in dots}
    assert all("HIGHEST" in p for p in precisions), precisions
