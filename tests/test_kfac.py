"""shardvmc.kfac: KFAC's step on walker-sharded batches, against kfac-jax's own step on one device.

The reference is ``kfac_jax.Optimizer`` on ONE device over the valid walkers (FermiNet's
settings, fed FermiNet's way); shardvmc's step on 1, 3 and 8 devices must equal it, for
any walker count: padding walkers enter neither the loss, its gradient nor the curvature,
and the curvature of the devices' blocks is that of all walkers (kfac-jax's own ``pmap``
squares each device's sum of tangents in its generic blocks, which depends on the device
count). The losses are FermiNet's ``make_loss`` pattern (``tests/models/kfac_loss.py``:
``custom_jvp``, ``pmean`` over ``"qmc_pmap_axis"``, clipping) and the library's
``energy_loss`` with FermiNet's and DeepQMC's clippings, checked against losses written
here with ``jnp`` alone.
"""

from __future__ import annotations

import contextlib
import functools
import re
import warnings
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from optional_imports import import_or_skip

import shardvmc as sv

kfac_jax = import_or_skip("kfac_jax")  # kfac-jax 0.0.8 cannot be imported on JAX >= 0.11: skipped, with the reason
from models import hamiltonian, kfac_loss, systems  # noqa: E402

import shardvmc.kfac as svk  # noqa: E402
from shardvmc import _kfac_compat  # noqa: E402

SYSTEM = systems.LI
N = 24  # walkers: 24, 8 and 3 per device on 1, 3 and 8 devices
STEPS = 2
DAMPING = 1e-3
KFAC = dict(  # FermiNet's train.py and base_config.py settings (norm constraint, fisher_exact, no burn-in)
    l2_reg=0.0,
    norm_constraint=1e-3,
    value_func_has_aux=True,
    value_func_has_rng=True,
    learning_rate_schedule=lambda t: 0.05 / (1.0 + t / 100.0),
    curvature_ema=0.95,
    inverse_update_period=1,
    min_damping=1e-4,
    num_burnin_steps=0,
    estimation_mode="fisher_exact",
    pmap_axis_name=kfac_loss.AXIS,
)


@functools.cache
def _data(n=N):
    """Parameters and walkers (float64), made in one compiled call (eagerly, each small operation compiles)."""

    def make():
        params = kfac_loss.init(jax.random.key(1), SYSTEM, hidden_one=8, hidden_two=4, layers=1, determinants=1,
                                dtype=jnp.float64)  # fmt: skip
        return params, systems.init_walkers(jax.random.key(2), SYSTEM, n, jnp.float64)

    with jax.enable_x64(True):
        return jax.device_get(jax.jit(make)())


def _problem(noise=0.0, n=N):
    params, walkers = jax.tree.map(jnp.asarray, _data(n))
    loss = jax.value_and_grad(kfac_loss.make_loss(SYSTEM, noise=noise), argnums=0, has_aux=True)
    return params, walkers, loss


def _keys(t):
    return jax.random.fold_in(jax.random.key(3), t)


def pmap_steps(n, params, walkers, loss, settings=KFAC, steps=STEPS):
    """FermiNet's own step: kfac-jax's pmap over the first n devices; device i's key is fold_in(key, i).

    Returns the per-step results, the last state and the last step's per-walker local energies.
    """
    opt = kfac_jax.Optimizer(loss, multi_device=True, **settings)
    rep = lambda x: jnp.broadcast_to(x, (n, *jnp.shape(x)))  # noqa: E731
    p = jax.tree.map(rep, params)
    blocks = walkers.reshape(n, walkers.shape[0] // n, *walkers.shape[1:])
    state = opt.init(p, jax.vmap(lambda _: _keys(10**6))(jnp.arange(n)), blocks)
    out = []
    for t in range(steps):
        keys = jax.vmap(lambda i, t=t: jax.random.fold_in(_keys(t), i))(jnp.arange(n))
        p, state, stats = opt.step(p, state, keys, batch=blocks, momentum=rep(0.0), damping=rep(DAMPING))
        out.append(jax.tree.map(lambda x: np.asarray(x[0]), (p, stats["loss"], stats["aux"]["variance"])))
    return out, state, np.asarray(stats["aux"]["local_energy"]).reshape(-1)  # (devices, block): walker order


@functools.cache
def _one_device_reference(period):
    """kfac-jax's FermiNet step on one device (the unsharded reference), its results and its last state."""
    with jax.enable_x64(True):
        params, walkers, loss = _problem()
        return pmap_steps(1, params, walkers, loss, dict(KFAC, inverse_update_period=period))


@pytest.fixture(scope="module", params=(1, 3, 8), ids=lambda n: f"{n}dev")
def runs(request):
    """shardvmc's steps on n devices (one compilation each), the one-device reference, the optimiser."""
    n = request.param
    period = 2 if n == 3 else 1  # on 3 devices, steps that do not invert the curvature too
    settings = dict(KFAC, inverse_update_period=period)
    with jax.enable_x64(True):
        params, walkers, loss = _problem()
        reference, reference_state, reference_local = _one_device_reference(period)
        mesh = sv.create_mesh(jax.devices()[:n])
        opt = svk.Optimizer(loss, mesh=mesh, **settings)
        state0 = opt.init(params, _keys(10**6), sv.shard_walker(walkers, mesh))
        p, state, out, first = params, state0, [], None
        for t in range(STEPS):
            p, state, stats = opt.step(p, state, _keys(t), batch=walkers, momentum=0.0, damping=DAMPING)
            first = first or (p, state, stats)
            out.append(jax.tree.map(np.asarray, (p, stats["loss"], stats["aux"]["variance"])))
    return {"n": n, "reference": reference, "ours": out, "opt": opt, "params": params, "walkers": walkers,
            "state0": state0, "first": first, "last": (p, state, stats), "reference_state": reference_state,
            "reference_local": reference_local}  # fmt: skip


def _max_diff(a, b):
    return max(
        float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
    )


def _assert_same_estimates(ours, reference, rtol=1e-9):
    """Every floating-point statistic of the curvature estimator (the factors and their weights) equal."""
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(reference)[0], jax.tree.leaves(ours)):
        x, y = np.asarray(x), np.asarray(y)
        x = x[0] if x.ndim and x.shape[0] == 1 and y.shape != x.shape else x  # pmap's leading device axis
        if np.issubdtype(x.dtype, np.inexact):
            np.testing.assert_allclose(y, x, rtol=rtol, atol=rtol * max(1.0, float(np.max(np.abs(x)))),
                                       err_msg=jax.tree_util.keystr(path))  # fmt: skip


def _assert_the_same_on_every_device(tree):
    """Every leaf holds the same bits on every device (a checkpoint checksums one copy and writes another)."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if isinstance(leaf, jax.Array) and not jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            copies = [np.asarray(shard.data) for shard in leaf.addressable_shards]
            for copy in copies[1:]:
                assert copy.tobytes() == copies[0].tobytes(), jax.tree_util.keystr(path)


def test_step_equals_kfac_jax_on_one_device(runs):
    params = runs["params"]
    for t, (ref, ours) in enumerate(zip(runs["reference"], runs["ours"])):
        update = _max_diff(ref[0], params)
        assert update > 1e-3, "the step must move the parameters"
        assert _max_diff(ref[0], ours[0]) <= 1e-9 * update, f"step {t}: parameters"
        assert abs(ref[1] - ours[1]) <= 1e-10 * abs(ref[1]), f"step {t}: loss"
        assert abs(ref[2] - ours[2]) <= 1e-9 * abs(ref[2]), f"step {t}: variance"


def test_the_curvature_estimate_is_the_one_device_estimate(runs):
    """The curvature factors (Kronecker and generic blocks) equal kfac-jax's on one device, on any device count."""
    _assert_same_estimates(runs["last"][1].estimator_state, runs["reference_state"].estimator_state)


def test_kfac_jaxs_own_pmap_estimate_depends_on_the_device_count():
    """Why shardvmc computes the curvature itself: kfac-jax's generic blocks square each device's sum of tangents."""
    with jax.enable_x64(True):
        params, walkers, loss = _problem()
        _, state, _ = pmap_steps(8, params, walkers, loss, steps=1)
        _, reference, _ = pmap_steps(1, params, walkers, loss, steps=1)
    first = lambda tree: jax.tree.map(lambda x: x[0], tree)  # noqa: E731  (device 0's; all equal after a sync)
    with pytest.raises(AssertionError, match="Mismatched"):  # the envelope exponents' generic (diagonal) blocks
        _assert_same_estimates(first(state.estimator_state), first(reference.estimator_state))


def test_per_walker_aux_values_come_back_for_every_walker(runs):
    # FermiNet's loss returns each walker's local energy in its aux; the replicated result holds all of them in
    # walker order, as they were at the last step's parameters.
    _, _, stats = runs["last"]
    local = np.asarray(stats["aux"]["local_energy"])
    assert local.shape == (N,)
    np.testing.assert_allclose(local, runs["reference_local"], rtol=1e-9)


def test_the_loss_key_reaches_device_i_as_fold_in_of_the_key_as_under_ferminets_pmap():
    """FermiNet's loss splits its key per walker of its block: device i's key is fold_in(key, i), as pmap gives."""
    n = 3
    with jax.enable_x64(True):
        params, walkers, loss = _problem(noise=0.05)
        reference, _, _ = pmap_steps(n, params, walkers, loss, steps=1)
        opt = svk.Optimizer(loss, mesh=sv.create_mesh(jax.devices()[:n]), **KFAC)
        state = opt.init(params, _keys(10**6), walkers)
        _, _, stats = opt.step(params, state, _keys(0), batch=walkers, momentum=0.0, damping=DAMPING)
    # the loss (with its noise) is evaluated before the update: the same values as pmap's
    assert abs(float(stats["loss"]) - float(reference[0][1])) <= 1e-12 * abs(float(reference[0][1]))
    assert abs(float(stats["aux"]["variance"]) - float(reference[0][2])) <= 1e-9 * abs(float(reference[0][2]))


def test_results_are_replicated_on_the_mesh_and_count_its_walkers(runs):
    params, state, stats = runs["last"]
    sv.testing.assert_replicated((params, state, stats))
    _assert_the_same_on_every_device((params, state, stats))
    assert params["layers"][0]["one"]["w"].sharding.mesh.devices.size == runs["n"]
    assert int(stats["step"]) == STEPS and int(state.step_counter) == STEPS
    assert int(stats["batch_size"]) == N and int(state.data_seen) == STEPS * N  # not N * jax.device_count()


def test_a_walker_set_without_its_padding_takes_the_same_step(runs):
    n, opt = runs["n"], runs["opt"]
    with jax.enable_x64(True):
        walkers = runs["walkers"]
        padded = sv.WalkerSet(jnp.concatenate([walkers, jnp.full((n, *walkers.shape[1:]), jnp.nan)]), N)
        p, _, stats = opt.step(runs["params"], runs["state0"], _keys(0), batch=padded, momentum=0.0, damping=DAMPING,
                               global_step_int=0)  # fmt: skip
    assert _max_diff(p, runs["first"][0]) == 0.0 and np.isfinite(float(stats["loss"]))


def test_padding_that_a_pmap_style_loss_cannot_mask_is_refused(runs):
    n, opt = runs["n"], runs["opt"]
    if n == 1:
        pytest.skip("one device divides every count")
    walkers = runs["walkers"]
    padded = sv.WalkerSet(walkers, N - 1)
    with pytest.raises(sv.CallError, match=f"do not split evenly over the {n} devices") as err:
        opt.step(runs["params"], runs["state0"], _keys(0), batch=padded, momentum=0.0, damping=DAMPING)
    assert "multiple of" in str(err.value) and "fix:" in str(err.value) and "energy_loss" in str(err.value)
    with pytest.raises(sv.CallError, match="do not split evenly"):
        opt.step(runs["params"], runs["state0"], _keys(0), batch=walkers[:-1], momentum=0.0, damping=DAMPING)


def test_another_batch_size_is_refused_and_a_traced_state_needs_the_step_only_when_programs_differ(runs):
    opt, n = runs["opt"], runs["n"]
    with pytest.raises(sv.CallError, match="one PRNG key"):
        opt.step(runs["params"], runs["state0"], jax.random.split(_keys(0), 2), batch=runs["walkers"], momentum=0.0,
                 damping=DAMPING)  # fmt: skip
    with pytest.raises(sv.CallError, match="another number than the batch init"):
        opt.step(
            runs["params"], runs["state0"], _keys(0), batch=runs["walkers"][: N - 3 * n], momentum=0.0, damping=DAMPING
        )
    if n != 3:
        return  # (one compilation is enough for what follows)
    # FermiNet's settings: every step is the same program, so a traced state needs no step number
    with jax.enable_x64(True):
        p, _, _ = jax.jit(lambda s: opt.step(runs["params"], s, _keys(0), batch=runs["walkers"], momentum=0.0,
                                             damping=DAMPING))(runs["state0"])  # fmt: skip
    assert _max_diff(p, runs["first"][0]) <= 1e-12 * max(1.0, _max_diff(p, runs["params"]) * 1e3)


def test_a_traced_state_whose_program_depends_on_the_step_needs_its_number():
    params, batch = _dense_problem(8)
    opt = svk.Optimizer(jax.value_and_grad(_dense_loss), num_burnin_steps=0, curvature_update_period=2,
                        mesh=sv.create_mesh(jax.devices()[:2]), **DENSE)  # fmt: skip
    state = opt.init(params, _keys(0), batch)
    with pytest.raises(sv.CallError, match="global_step_int"):
        jax.jit(lambda s: opt.step(params, s, _keys(0), batch=batch, momentum=0.0, damping=1e-3))(state)


# ----------------------------------------------------------------------------- the field's losses, any walker count


def _log_squeeze(x):  # DeepQMC's deepqmc.utils.log_squeeze, written out
    return jnp.sign(x) * jnp.log1p((jnp.abs(x) + x**2 / 2 + jnp.abs(x) ** 3) / (1 + x**2))


def _oracle_loss(clipping):
    """FermiNet's (clipping "mad") or DeepQMC's ("squeeze") loss on ONE device's walkers, with jnp alone."""
    psi = functools.partial(kfac_loss.log_psi, system=SYSTEM)
    batch_energy = jax.vmap(hamiltonian.make_local_energy(psi, SYSTEM, "fori"), (None, 0))
    batch_psi = jax.vmap(psi, (None, 0))

    @jax.custom_jvp
    def total(params, key, r):
        e = batch_energy(params, r)
        mean = jnp.mean(e)
        return mean, {"energy": mean, "variance": jnp.mean((e - mean) ** 2)}

    @total.defjvp
    def total_jvp(primals, tangents):
        params, key, r = primals
        (mean, aux), e = total(params, key, r), batch_energy(params, r)
        if clipping == "mad":
            mad = jnp.mean(jnp.abs(e - mean))
            clipped = jnp.clip(e, mean - 5 * mad, mean + 5 * mad)
        else:
            median = jnp.median(e)
            width = jnp.quantile(jnp.abs(e - median), 0.95)
            clipped = median + 2 * width * _log_squeeze((e - median) / (2 * width))
        value, tangent = jax.jvp(lambda p: batch_psi(p, r), (params,), (tangents[0],))
        kfac_jax.register_normal_predictive_distribution(value[:, None])
        return (mean, aux), (jnp.mean((clipped - jnp.mean(clipped)) * tangent), jax.tree.map(jnp.zeros_like, aux))

    return jax.value_and_grad(total, has_aux=True)


_CLIPPINGS = {"mad": sv.loss.ClipMAD(5.0), "squeeze": sv.loss.ClipLogSqueeze()}
LIBRARY = {k: v for k, v in KFAC.items() if k != "pmap_axis_name"}


@functools.cache
def _oracle_run(n_walkers, clipping):
    """kfac-jax on one device (multi_device=False) over the valid walkers with the jnp loss: 2 steps."""
    with jax.enable_x64(True):
        params, walkers = jax.tree.map(jnp.asarray, _data(n_walkers))
        opt = kfac_jax.Optimizer(_oracle_loss(clipping), multi_device=False, **LIBRARY)
        state = opt.init(params, _keys(10**6), walkers)
        p = params
        for t in range(STEPS):
            p, state, stats = opt.step(p, state, _keys(t), batch=walkers, momentum=0.0, damping=DAMPING)
        return jax.device_get((p, state.estimator_state, stats["loss"], stats["aux"]))


@pytest.mark.parametrize(
    "n_walkers, clipping, n_devices",
    # every device count with each walker count and clipping (each cell compiles a KFAC step: a sample, not the grid)
    [(13, "mad", 1), (13, "mad", 3), (13, "squeeze", 8), (1001, "mad", 8), (1001, "mad", 3)],
)
def test_any_walker_count_takes_the_valid_walkers_step_on_one_device(n_walkers, clipping, n_devices):
    """energy_loss with FermiNet's and DeepQMC's clippings: 13 and 1,001 walkers, which 3 and 8 do not divide."""
    p_ref, estimator_ref, loss_ref, aux_ref = _oracle_run(n_walkers, clipping)
    psi = functools.partial(kfac_loss.log_psi, system=SYSTEM)
    with jax.enable_x64(True):
        params, walkers = jax.tree.map(jnp.asarray, _data(n_walkers))
        loss = svk.energy_loss(psi, hamiltonian.make_local_energy(psi, SYSTEM, "fori"), _CLIPPINGS[clipping])
        opt = svk.Optimizer(loss, mesh=sv.create_mesh(jax.devices()[:n_devices]), **LIBRARY)
        state = opt.init(params, _keys(10**6), walkers)
        p = params
        for t in range(STEPS):
            p, state, stats = opt.step(p, state, _keys(t), batch=walkers, momentum=0.0, damping=DAMPING)
    update = _max_diff(p_ref, params)
    assert update > 1e-3 and _max_diff(p, p_ref) <= 1e-9 * update
    _assert_the_same_on_every_device((p, state))
    _assert_same_estimates(state.estimator_state, estimator_ref)
    assert abs(float(stats["loss"]) - float(loss_ref)) <= 1e-12 * abs(float(loss_ref))
    assert abs(float(stats["aux"]["variance"]) - float(aux_ref["variance"])) <= 1e-9 * float(aux_ref["variance"])
    assert int(stats["batch_size"]) == n_walkers and int(state.data_seen) == STEPS * n_walkers


def _all_reduce_operands(compiled_text):
    """The number of operands of each all-reduce of a compiled program (its text)."""
    found = re.findall(r" all-reduce(?:-start)?\(([^)]*)\)", compiled_text)
    return [len(re.findall(r"%", operands)) for operands in found]


def test_the_steps_all_reduces_each_reduce_one_buffer():
    """kfac-jax reduces the gradient, every block's inverse and every preconditioned parameter leaf by leaf, and
    XLA's CPU runtime (like gloo) exchanges an all-reduce's operands one at a time, each a rendezvous of every
    device: in shardvmc's step each all-reduce reduces one buffer, and the step is the same as kfac-jax's
    leaf-by-leaf one."""
    mesh = sv.create_mesh(jax.devices()[:8])

    def step_and_operands(packed):
        with jax.enable_x64(True):
            params, walkers, loss = _problem()
            opt = svk.Optimizer(loss, mesh=mesh, **KFAC)
            state = opt.init(params, _keys(10**6), walkers)
            step = jax.jit(lambda p, s: opt.step(p, s, _keys(0), batch=walkers, momentum=0.0, damping=DAMPING,
                                                 global_step_int=0))  # fmt: skip
            with contextlib.ExitStack() as stack:
                if not packed:  # kfac-jax's own all-reduces
                    stack.enter_context(mock.patch.object(_kfac_compat, "packed_collectives", contextlib.nullcontext))
                operands = _all_reduce_operands(step.lower(params, state).compile().as_text())
                return jax.device_get((params, step(params, state)[0])), operands

    (params, packed), operands = step_and_operands(True)
    (_, leafwise), leafwise_operands = step_and_operands(False)
    assert operands and max(operands) <= 2, operands  # (a collective may pair a float buffer with another dtype's)
    assert sum(leafwise_operands) >= 3 * sum(operands), (leafwise_operands, operands)
    update = _max_diff(packed, params)
    assert update > 1e-4 and _max_diff(packed, leafwise) <= 1e-12 * update


def test_step_before_init_says_to_call_init():
    opt = svk.Optimizer(lambda *args: None, **KFAC)
    with pytest.raises(sv.CallError, match=r"called before init\(\).*\n.*opt\.init\(params, rng, batch\)"):
        opt.step({"w": np.zeros(2)}, None, _keys(0), batch=np.zeros((8, 3)), global_step_int=0)  # was an AssertionError


def test_unsupported_kfac_arguments_are_refused():
    for bad in ({"multi_device": True}, {"debug": True}, {"use_initial_damping_calibration": True},
                {"num_burnin_steps": 2}):  # fmt: skip
        with pytest.raises(sv.CallError, match="not supported"):
            svk.Optimizer(lambda *args: None, **dict(KFAC, **bad))


# ----------------------------------------------------------------------------- kfac sees the layers


def _blocks(opt):
    kfac_opt = opt.kfac_optimizer if isinstance(opt, svk.Optimizer) else opt
    return [type(b).__name__ for b in kfac_opt._estimator.blocks]


def test_shardvmc_vmaps_inside_the_loss_keep_the_kronecker_blocks():
    """Inside the optimiser's kernel, sv.get_vmap_fn / sv.shard_vmap run as jax.vmap: kfac reads the layers."""
    mesh = sv.create_mesh(jax.devices()[:2])
    with jax.enable_x64(True):
        params, walkers, _ = _problem()
        found = {}
        for name, vmap in (("jax.vmap", jax.vmap), ("sv.get_vmap_fn", sv.get_vmap_fn(mesh=mesh))):
            loss = jax.value_and_grad(kfac_loss.make_loss(SYSTEM, vmap=vmap), argnums=0, has_aux=True)
            opt = svk.Optimizer(loss, mesh=mesh, **KFAC)
            with warnings.catch_warnings():
                warnings.simplefilter("error", svk.DiagonalBlockWarning)
                opt.init(params, _keys(0), walkers)
            found[name] = _blocks(opt)
            diagonal = svk.check_curvature_blocks(opt, params)  # the envelope exponents only: no layer hidden
            assert diagonal and all(path.endswith("['sigma']") for path in diagonal), diagonal
    assert found["jax.vmap"] == found["sv.get_vmap_fn"]
    assert "RepeatedDenseKroneckerFactored" in found["jax.vmap"]


def test_a_loss_whose_network_runs_in_shard_map_warns_naming_the_parameters():
    """FermiNet's loss with sv.shard_vmap, run by kfac-jax itself (GSPMD): every parameter falls back, now loudly."""
    mesh = sv.create_mesh(jax.devices()[:2])
    with jax.enable_x64(True):
        params, walkers, _ = _problem()
        loss = jax.value_and_grad(kfac_loss.make_loss(SYSTEM, vmap=sv.get_vmap_fn(mesh=mesh)), argnums=0, has_aux=True)
        opt = kfac_jax.Optimizer(loss, **dict(KFAC, pmap_axis_name="unused"))
        opt.init(sv.replicate(params, mesh), _keys(0), sv.shard_walker(walkers, mesh))
        with pytest.warns(
            svk.DiagonalBlockWarning,
            match=r"gave (\d+) of \1 parameters .*\['layers'\]\[0\]\['one'\]\['w'\] \[20, 8\].*inside shard_map",
        ):  # noqa: E501
            diagonal = svk.check_curvature_blocks(opt, params)
    assert len(diagonal) == len(jax.tree.leaves(params)) and set(_blocks(opt)) == {"NaiveDiagonal"}


def test_a_loss_whose_layers_kfac_cannot_match_warns_at_init():
    """Masked parameters (``x @ (w * mask)``, as autoregressive layers write them) hide every layer."""

    def masked(params, r, system):
        return kfac_loss.log_psi(jax.tree.map(lambda w: w * jnp.ones_like(w), params), r, system)

    mesh = sv.create_mesh(jax.devices()[:2])
    with jax.enable_x64(True):
        params, walkers, _ = _problem()
        loss = jax.value_and_grad(kfac_loss.make_loss(SYSTEM, network=masked), argnums=0, has_aux=True)
        opt = svk.Optimizer(loss, mesh=mesh, **KFAC)
        with pytest.warns(svk.DiagonalBlockWarning, match=r"\['layers'\]\[0\]\['one'\]\['w'\].*found no dense"):
            opt.init(params, _keys(0), walkers)
    assert "RepeatedDenseKroneckerFactored" not in _blocks(opt)


# ----------------------------------------------------------------------------- kfac-jax 0.0.8 on JAX 0.10


def test_the_eval_jaxpr_eqn_fix_is_applied_only_when_needed():
    from kfac_jax._src import tag_graph_matcher

    assert _kfac_compat._works(_kfac_compat.fixed_eval_jaxpr_eqn)
    if svk.KFAC_JAX_PATCHED:
        assert tag_graph_matcher.eval_jaxpr_eqn is _kfac_compat.fixed_eval_jaxpr_eqn
        assert not _kfac_compat._works(_kfac_compat.ORIGINAL_EVAL_JAXPR_EQN)
    else:
        assert tag_graph_matcher.eval_jaxpr_eqn is _kfac_compat.ORIGINAL_EVAL_JAXPR_EQN
    assert _kfac_compat._apply_fix() == svk.KFAC_JAX_PATCHED  # idempotent


# ----------------------------------------------------------------------------- as a user would call it


def _dense_loss(params, batch):
    """A one-layer loss in FermiNet's calling convention (a block of walkers, its own pmean), cheap to compile."""
    y = jnp.tanh(batch["r"] @ params["w"] + params["b"]) * batch["weight"][:, None]
    kfac_jax.register_squared_error_loss(y)
    return kfac_jax.utils.pmean_if_pmap(jnp.mean(y**2), kfac_loss.AXIS)


DENSE = dict(l2_reg=0.0, norm_constraint=1e-3, learning_rate_schedule=lambda t: 0.1, pmap_axis_name=kfac_loss.AXIS)


def _dense_problem(n):
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.normal(size=(3, 4)) / 3), "b": jnp.zeros(4)}
    batch = {"r": rng.normal(size=(n, 3)), "weight": np.ones(n)}  # host data, a pytree with the walker axis first
    return params, batch


def test_explicit_meshes_pytree_batches_and_steps_inside_jit():
    mesh = jax.make_mesh((2,), ("walkers",))  # JAX's default: Explicit axes
    params, batch = _dense_problem(8)
    opt = svk.Optimizer(jax.value_and_grad(_dense_loss), num_burnin_steps=0, mesh=mesh, **DENSE)
    state = opt.init(params, _keys(0), batch)
    p1, s1, stats = opt.step(params, state, _keys(1), batch=batch, momentum=0.0, damping=1e-3)
    # nested in the caller's jit: kfac-jax needs the step number as a Python int (its issue 103)
    jitted = jax.jit(lambda p, s, b: opt.step(p, s, _keys(1), batch=b, momentum=0.0, damping=1e-3, global_step_int=0))
    p2, s2, _ = jitted(params, state, sv.shard_walker(batch, sv.create_mesh(jax.devices()[:2])))
    assert _max_diff(p1, p2) <= 1e-6 and int(s2.step_counter) == int(s1.step_counter) == 1
    assert float(stats["loss"]) > 0 and int(stats["batch_size"]) == 8


def test_data_iterators_give_one_batch_per_step_and_burn_in_is_refused():
    params, batch = _dense_problem(8)
    mesh = sv.create_mesh(jax.devices()[:2])
    with pytest.raises(sv.CallError, match="num_burnin_steps=10 .*device_put_replicated"):
        svk.Optimizer(jax.value_and_grad(_dense_loss), mesh=mesh, **DENSE)  # kfac-jax's default burn-in
    opt = svk.Optimizer(jax.value_and_grad(_dense_loss), num_burnin_steps=0, mesh=mesh, **DENSE)
    state = opt.init(params, _keys(0), batch)
    drawn = []

    def batches():
        while True:
            drawn.append(len(drawn))
            yield batch

    it = batches()
    p, state, _ = opt.step(params, state, _keys(1), data_iterator=it, momentum=0.0, damping=1e-3)
    p2, _, _ = opt.step(params, opt.init(params, _keys(0), batch), _keys(1), batch=batch, momentum=0.0, damping=1e-3)
    assert len(drawn) == 1 and _max_diff(p, p2) == 0.0
    with pytest.raises(sv.CallError, match="exactly one of batch= and data_iterator="):
        opt.step(p, state, _keys(2), data_iterator=it, batch=batch, momentum=0.0, damping=1e-3)


def test_steps_under_any_mesh_context_run_on_the_optimisers_axis():
    """A mesh context (jax.set_mesh, jax.sharding.set_mesh, of any axis names) does not take the loss's axis away.

    Kernels under a mesh context compute on its axes; the optimiser's loss names its own
    axis, so eager calls enter the optimiser's mesh, and a mesh=None optimiser takes the
    context's devices whatever its axis names (it raised "no axis named 'walkers'" under
    ("S",), and a NameError for the unbound pmap axis under a walkers mesh). Inside a
    trace under such a context the axis cannot be had: a CallError saying so.
    """
    params, batch = _dense_problem(8)
    devices = jax.devices()[:2]
    settings = dict(DENSE, num_burnin_steps=0, estimation_mode="fisher_exact")

    def run(mesh=None):
        opt = svk.Optimizer(jax.value_and_grad(_dense_loss), mesh=mesh, **settings)
        state = opt.init(params, _keys(0), batch)
        return opt, state, opt.step(params, state, _keys(1), batch=batch, momentum=0.0, damping=1e-3)[0]

    expected = run(sv.create_mesh(devices))[2]
    for context in (sv.create_mesh(devices), jax.make_mesh((2,), ("S",), devices=devices)):
        with jax.set_mesh(context):
            opt, state, got = run()
            assert opt.mesh == context and _max_diff(got, expected) <= 1e-12
            with pytest.raises(sv.CallError, match=r"inside a trace .*pmap_axis_name='qmc_pmap_axis'"):
                jax.jit(lambda s: opt.step(params, s, _keys(1), batch=batch, momentum=0.0, damping=1e-3,
                                           global_step_int=0))(state)  # fmt: skip
    jax.sharding.set_mesh(context)  # as another library does at import (NetKet: ("S",))
    try:
        assert _max_diff(run(sv.create_mesh(devices))[2], expected) <= 1e-12  # mesh= of the same devices
    finally:
        jax.sharding.set_mesh(None)
    with jax.set_mesh(sv.create_mesh(devices, axis_name=kfac_loss.AXIS)):  # the fix the error names
        got = jax.jit(lambda s: opt.step(params, s, _keys(1), batch=batch, momentum=0.0, damping=1e-3,
                                         global_step_int=0)[0])(state)  # fmt: skip
    assert _max_diff(got, expected) <= 1e-12


# ----------------------------------------------------------------------------- KFAC in sv.driver


def _kfac_job(n_devices):
    """Hooke's atom on sv.driver.VMC with KFAC and FermiNet's clipping: 13 walkers, which 3 and 8 do not divide."""
    from driver_job import log_psi, potential

    mesh = sv.create_mesh(jax.devices()[:n_devices])
    sampler = sv.mcmc.Metropolis(log_psi, n_steps=5, mesh=mesh)
    vmc = sv.driver.VMC(log_psi, svk.KFAC(learning_rate=0.05), potential, sampler=sampler, mesh=mesh,
                        clipping=sv.loss.ClipMAD())  # fmt: skip
    walkers = sv.initialize_walkers_sharded(lambda k: jax.random.normal(k, (2, 3)), 13, mesh, key=jax.random.key(1))
    return vmc.step, vmc.init({"a": jnp.float64(0.3), "b": jnp.float64(1.0)}, walkers)


def test_a_kfac_run_resumed_on_another_device_count_continues_its_trajectory(tmp_path):
    steps, key = 6, jax.random.key(2)
    with jax.enable_x64(True):
        step, state = _kfac_job(8)
        reference = sv.driver.run(step, state, steps, key=key, progress=False)
        assert step._cache_size() == 1  # the step returns the state as init made it: one compilation
        first = sv.driver.run(*_kfac_job(8), steps // 2, key=key, checkpoint=tmp_path, progress=False)
        resumed = sv.driver.run(*_kfac_job(3), steps, key=key, checkpoint=tmp_path, progress=False)
    assert first.step == steps // 2 and resumed.resumed_from == steps // 2 and resumed.step == steps
    moved = abs(float(reference.state.params["a"]) - 0.3)
    assert moved > 1e-3, "KFAC must move the parameters"
    # another device count: float64 round-off of the sums over devices (docs/concepts.md), no more
    np.testing.assert_allclose(resumed.history["energy"], reference.history["energy"], rtol=0, atol=1e-10)
    assert _max_diff(resumed.state.params, reference.state.params) <= 1e-9 * moved
    _assert_same_estimates(resumed.state.opt.estimator_state, reference.state.opt.estimator_state)
