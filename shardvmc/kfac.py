"""KFAC from kfac-jax on walker-sharded batches: FermiNet's and DeepQMC's optimiser, without ``pmap``.

The whole job: ``sv.driver.VMC(log_psi, sv.kfac.KFAC(), potential, clipping=sv.loss.ClipMAD())``
(:class:`KFAC`): the library's energy loss (:func:`energy_loss`, FermiNet's and DeepQMC's
written once), any walker count, the same step on any device count.

``shardvmc.kfac.Optimizer`` is ``kfac_jax.Optimizer`` whose ``init`` and ``step`` take
a walker-sharded batch (a ``sv.WalkerSet`` or a pytree with the walker axis first,
placed or not) and return kfac-jax's results replicated. Its loss sees one device's
block of walkers, as under FermiNet's ``pmap``: :func:`energy_loss`, or one written as
FermiNet writes it, reducing with its own collectives over ``pmap_axis_name``
(``kfac_jax.utils.pmean_if_pmap(x, "qmc_pmap_axis")``).

How it runs: the whole kfac-jax step runs inside one ``batched=True`` walker-parallel
kernel whose mesh axis is named ``pmap_axis_name``, with kfac-jax's staging switched off
(``staging_context()``). Inside it ``sv.all_walkers`` gives statistics over every valid
walker, and ``sv.shard_vmap``, ``sv.get_vmap_fn`` and other shardvmc kernels called by
the loss run as plain vmaps on the block, where kfac-jax's graph matcher sees the layers.

Differences from kfac-jax's own ``pmap`` step, each deliberate:

- **the curvature estimate is kfac-jax's estimate on one device over every valid
  walker** (``shardvmc/_kfac_compat.py``): padding walkers enter no statistic, and the
  blocks of parameters outside any recognised layer, which kfac-jax's ``pmap`` estimates
  from each device's own sum of tangents (an estimate that shrinks with the device
  count), get the sum over every device. The state is the same on every device and
  carries over to another device count; the step equals kfac-jax's on one device (tested
  on 1, 3 and 8 devices and 2 processes, 13 and 1,001 walkers, in float64), for the
  estimation modes built from the loss's Fisher or GGN (``"fisher_exact"``,
  ``"fisher_gradients"``, ...; the empirical modes normalise by each device's block);
- ``data_seen`` and ``stats["batch_size"]`` count the valid walkers of the mesh;
- per-walker aux values (FermiNet's local energies) are gathered over the devices
  inside the loss, in walker order (kfac-jax averages the aux over the devices);
- with FermiNet's settings every step is one program, so ``step`` reads no step number
  from the host and runs inside ``jax.jit`` as it is; nothing is donated;
- the loss's ``rng`` on device ``i`` is ``jax.random.fold_in(rng, i)``: one key per
  device, as FermiNet's ``make_different_rng_key_on_all_devices`` gives (a loss that
  splits its key by its block size draws streams that depend on the device count).

kfac-jax's burn-in (``num_burnin_steps > 0``, its default 10) calls
``jax.device_put_replicated``, which JAX 0.10 removed, and is refused: pass
``num_burnin_steps=0``, FermiNet's setting. See ``docs/optimisers.md``.

Padding walkers cannot be masked out of a loss written for ``pmap`` (its means and its
gradient average the block): with such a loss a batch whose walkers do not split evenly
over the mesh is refused (``CallError``); :func:`energy_loss`, or a loss that reduces with
``sv.all_walkers`` and is passed with ``masks_padding=True``, takes any count.

Importing this module applies, when the installed kfac-jax needs it, the fix of kfac-jax
0.0.8 for JAX >= 0.9.2 (:data:`KFAC_JAX_PATCHED`; see ``shardvmc/_kfac_compat.py``). On a
JAX that kfac-jax cannot be imported on (0.0.8 on JAX >= 0.11), importing it raises an
``ImportError`` naming both versions and the fix (``pip install -e ".[kfac]"`` in the clone, whose
extra pins JAX below 0.11).

Example:
    >>> import jax, jax.numpy as jnp, kfac_jax, shardvmc as sv, shardvmc.kfac
    >>> def loss(params, batch):  # FermiNet's pattern: one device's block, its own pmean
    ...     y = jnp.tanh(batch @ params["w"])
    ...     kfac_jax.register_squared_error_loss(y)
    ...     return kfac_jax.utils.pmean_if_pmap(jnp.mean(y**2), "qmc_pmap_axis")
    >>> opt = sv.kfac.Optimizer(jax.value_and_grad(loss), l2_reg=0.0, num_burnin_steps=0,
    ...                         learning_rate_schedule=lambda t: 0.1, pmap_axis_name="qmc_pmap_axis")
    >>> params = {"w": jnp.ones((3, 2)) / 3}
    >>> batch = jax.random.normal(jax.random.key(0), (16, 3))
    >>> state = opt.init(params, jax.random.key(1), batch)
    >>> params, state, stats = opt.step(params, state, jax.random.key(2), batch=batch, momentum=0.0, damping=1e-3)
    >>> params["w"].sharding.is_fully_replicated, int(stats["step"])
    (True, 1)
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

try:
    import kfac_jax
except Exception as err:  # tested with a stand-in kfac_jax (tests/test_extras.py)
    # Any failure, not only ImportError: kfac-jax 0.0.8 (the newest release) uses jax.core names that JAX 0.11
    # removed, so on a newer JAX its import raises AttributeError. The `kfac` and `examples` extras pin JAX below
    # 0.11 until a kfac-jax release supports it (pyproject.toml says where that is tracked).
    import importlib.metadata

    import jax

    from ._errors import install, message

    if isinstance(err, ModuleNotFoundError) and err.name == "kfac_jax":
        raise ImportError(
            message(
                "shardvmc.kfac",
                "needs kfac-jax, which is not installed.",
                fix=f"{install('kfac')} (kfac-jax with a JAX it supports), or pip install kfac-jax.",
            )
        ) from err
    try:
        _found = f"kfac-jax {importlib.metadata.version('kfac-jax')}"
    except importlib.metadata.PackageNotFoundError:
        _found = "kfac-jax (version unknown)"
    raise ImportError(
        message(
            "shardvmc.kfac",
            f"{_found} cannot be imported with JAX {jax.__version__}.",
            got=f"{type(err).__name__}: {err}",
            expected="JAX < 0.11 for kfac-jax <= 0.0.8 (JAX 0.11 removed jax.core names it uses), or a kfac-jax "
            "release that supports this JAX",
            fix=f"{install('kfac')}, which installs a JAX that kfac-jax supports (or pip install "
            '"jax<0.11" "jaxlib<0.11"; jax 0.10.2 has wheels for Python 3.11 to 3.13).',
        )
    ) from err

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from . import _kfac_compat
from ._compat import context_mesh
from ._decorator import WalkerParallel, kernel_of
from ._errors import CallError, describe, message
from ._internals import tracing
from ._kernel import Options
from ._markers import Kind, Layout, Param
from ._mesh import call_mesh, mesh_of_arrays
from ._placement import pad_n_walkers, pad_walker, place_on, slice_walkers
from ._stats import all_walkers, current_body
from ._walkerset import WalkerSet, walker_count

__all__ = [
    "KFAC",
    "KFAC_JAX_PATCHED",
    "DiagonalBlockWarning",
    "EnergyLoss",
    "Optimizer",
    "check_curvature_blocks",
    "energy_loss",
]

KFAC_JAX_PATCHED: bool = _kfac_compat.PATCHED
"""Whether importing ``shardvmc.kfac`` fixed kfac-jax's ``eval_jaxpr_eqn`` (kfac-jax 0.0.8 on JAX >= 0.9.2)."""

_WHERE = "shardvmc.kfac.Optimizer"


class DiagonalBlockWarning(UserWarning):
    """kfac-jax could not see the network's layers and gave their parameters diagonal curvature blocks.

    Warned by :meth:`Optimizer.init` and :func:`check_curvature_blocks` when the loss
    runs part of its computation inside ``shard_map`` (a shardvmc kernel called outside
    this optimiser, or ``jax.shard_map``), whose inside kfac-jax's graph matcher does
    not read, or when it found no dense or convolution layer at all. The step then
    preconditions those parameters with a diagonal estimate from each device's batch
    gradient, far from the Kronecker-factored one.
    """


def _gathering_aux(
    value_and_grad_func: Callable[..., Any], has_state: bool, block_size: Callable[[], int]
) -> Callable[..., Any]:
    """``value_and_grad_func`` whose per-walker aux values are gathered over every device, in walker order.

    kfac-jax averages the loss's aux over the devices (``pmean``): a per-walker value
    (FermiNet's local energies) would come back as the mean of the devices' blocks.
    Gathered inside the loss (an aux leaf whose leading axis is the block's walkers),
    every device holds the same values and the average keeps them: the valid walkers'
    values, as on one device.
    """

    def gather(x: Any) -> Any:
        body = current_body()
        if body is None or not isinstance(x, jax.Array) or x.ndim == 0 or x.shape[0] != block_size():
            return x
        every = jax.lax.all_gather(x, body.axes, tiled=True)
        return every[: body.count] if isinstance(body.count, int) else every

    @functools.wraps(value_and_grad_func)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        (value, rest), grads = value_and_grad_func(*args, **kwargs)
        if has_state:
            state, aux = rest
            return (value, (state, jax.tree_util.tree_map(gather, aux))), grads
        return (value, jax.tree_util.tree_map(gather, rest)), grads

    return wrapped


def _signature(names: tuple[str, ...]) -> inspect.Signature:
    return inspect.Signature([inspect.Parameter(n, inspect.Parameter.POSITIONAL_ONLY) for n in names])


def _kernel(
    body: Callable[..., Any],
    kinds: tuple[tuple[str, Kind], ...],
    output: Kind | tuple[Kind, ...],
    mesh: Mesh,
    axis: str,
) -> WalkerParallel:
    names = tuple(name for name, _ in kinds)
    layout = Layout(tuple(Param(n, k) for n, k in kinds), output, _signature(names))
    # checks=False: no second trace under JAX's varying-axes check to prove the Replicated outputs
    # replicated. kfac-jax keeps the layers its graph matcher finds at the first trace, and under that check
    # the program holds pvary casts between parameters and matmuls, where it would match no dense layer.
    # kfac-jax's own pmeans make the step's outputs replicated.
    options = Options(axis_name=axis, batched=True, checks=False)
    return kernel_of(body, layout, mesh=mesh, options=options, qualname=f"{_WHERE}.{body.__name__}")


def _walker_mesh(mesh: Mesh, axis: str) -> Mesh:
    """The devices of ``mesh`` in walker order, on one axis named ``axis`` (the loss's collective axis).

    Walkers are split over every axis of ``mesh`` (in order, as ``P(mesh.axis_names)``
    splits them), so the flat device list is the walker order, and arrays placed on
    ``mesh`` need no data movement to run here.
    """
    if mesh.axis_names == (axis,):
        return mesh
    return Mesh(np.asarray(mesh.devices).reshape(-1), (axis,), axis_types=(jax.sharding.AxisType.Auto,))


class Optimizer:
    """``kfac_jax.Optimizer`` on walker-sharded batches: FermiNet's KFAC step on any mesh, without ``pmap``.

    Takes every argument of ``kfac_jax.Optimizer`` except ``multi_device`` (and
    ``debug``, which turns its collectives off). ``value_and_grad_func`` sees one
    device's block of walkers: :func:`energy_loss`, or a loss written as for FermiNet's
    ``pmap``, reducing with its own collectives over ``pmap_axis_name``.

    Args:
        value_and_grad_func: as for ``kfac_jax.Optimizer``: :func:`energy_loss`, or e.g.
            ``jax.value_and_grad(loss, has_aux=True)`` of FermiNet's ``make_loss``.
        l2_reg: as for ``kfac_jax.Optimizer``.
        mesh: the devices; the walkers are split over all its axes. Default: resolved at
            the first ``init`` as a kernel's mesh is (the mesh another kernel left the
            batch on, ``sv.use_mesh``, JAX's current mesh whatever its axis names, else
            all devices) and kept: kfac-jax reads the network's layers from one block shape.
        pmap_axis_name: the axis name the loss's collectives use (FermiNet:
            ``"qmc_pmap_axis"``); the kernels run on a mesh axis of this name, the
            optimiser's devices on one axis. Eager calls run there under any mesh context.
        masks_padding: whether the loss leaves padding walkers out of its value and
            gradient (it reduces with ``sv.all_walkers``), so that any walker count is
            taken; default: the loss's own ``masks_padding`` attribute (``True`` for
            :func:`energy_loss`), else ``False`` (a count the devices do not divide is refused).
        **kwargs: the other arguments of ``kfac_jax.Optimizer``.

    Raises:
        CallError: for ``multi_device=``, ``debug=True``, or
            ``use_initial_damping_calibration=True`` (which reads values on the host in
            the middle of the step); from ``init`` and ``step`` inside a trace
            (``jax.jit``, ``lax.scan``...) under a mesh context (``jax.set_mesh``) other
            than a mesh whose one axis is ``pmap_axis_name``: a traced program runs on
            its context mesh's axes, where the loss's collectives find no such axis.
    """

    def __init__(
        self,
        value_and_grad_func: Callable[..., Any],
        l2_reg: Any,
        *,
        mesh: Mesh | None = None,
        pmap_axis_name: str = "kfac_axis",
        masks_padding: bool | None = None,
        **kwargs: Any,
    ) -> None:
        for name, bad, why in (
            ("multi_device", None, "shardvmc places the walkers itself (one kernel over the mesh)"),
            ("debug", True, "kfac-jax's debug mode drops the collectives over pmap_axis_name"),
            ("use_initial_damping_calibration", True, "the calibration reads the damping on the host mid-step"),
        ):
            if name in kwargs and (bad is None or kwargs[name] == bad):
                raise CallError(
                    message(
                        _WHERE,
                        f"{name}={kwargs[name]!r} is not supported: {why}.",
                        fix=f"drop {name}=.",
                    )
                )
        burnin = kwargs.get("num_burnin_steps", 10)  # kfac-jax's default
        if burnin:
            raise CallError(
                message(
                    _WHERE,
                    f"num_burnin_steps={burnin} (kfac-jax's default is 10) is not supported: kfac-jax's burn-in "
                    "makes its accumulator with jax.device_put_replicated, which JAX 0.10 removed (it fails under "
                    "kfac-jax's own pmap too, in 0.0.8 and at its source head).",
                    fix="pass num_burnin_steps=0, FermiNet's setting (the curvature estimate then starts from the "
                    "first step's statistics).",
                )
            )
        if not isinstance(pmap_axis_name, str):
            raise CallError(
                message(
                    _WHERE,
                    "pmap_axis_name must be the axis name (a str) that the loss's collectives use.",
                    got=repr(pmap_axis_name),
                    fix='pass e.g. pmap_axis_name="qmc_pmap_axis" (FermiNet).',
                )
            )
        # multi_device=True keeps pmap_axis_name for kfac-jax's collectives; staging_context() (entered in the
        # kernels) stops it from wrapping its methods in its own pmap.
        # A loss that reduces with sv.all_walkers (energy_loss does) leaves padding out; a pmap-style loss cannot.
        if masks_padding is None:
            masks_padding = bool(getattr(value_and_grad_func, "masks_padding", False))
        self._masks_padding = masks_padding
        if kwargs.get("value_func_has_aux", False):
            has_state = bool(kwargs.get("value_func_has_state", False))
            value_and_grad_func = _gathering_aux(value_and_grad_func, has_state, lambda: self._block_size)
        self._kfac = kfac_jax.Optimizer(
            value_and_grad_func, l2_reg, multi_device=True, pmap_axis_name=pmap_axis_name, **kwargs
        )
        self._axis = pmap_axis_name
        self._mesh = mesh
        self._has_state = bool(kwargs.get("value_func_has_state", False))
        self._warn = bool(kwargs.get("use_automatic_registration", True)) and not kwargs.get(
            "register_only_generic", False
        )
        self._block_size = 0  # walkers per device, set by init (kfac-jax reads the network from that shape)
        self._one_program = _kfac_compat.steps_share_one_program(self._kfac)  # the step number need not be read
        self._size = 0  # devices of the mesh
        self._kmesh: Mesh | None = None  # the mesh's devices on one axis named pmap_axis_name
        self._trace_step = 0  # the step number the step kernel is being traced for (see _step_body)
        self._init_kernel: WalkerParallel | None = None
        self._step_kernel: WalkerParallel | None = None

    @property
    def kfac_optimizer(self) -> kfac_jax.Optimizer:
        """The underlying ``kfac_jax.Optimizer`` (``multi_device=True``; run only through this object)."""
        return self._kfac

    @property
    def replicated_sharding(self) -> NamedSharding | None:
        """Where ``step`` returns the parameters and the state (``None`` until the first ``init``).

        Parameters given in this sharding come back in it, so a jitted step that feeds its
        results back compiles once.
        """
        return None if self._kmesh is None else NamedSharding(self._kmesh, PartitionSpec())

    @property
    def mesh(self) -> Mesh | None:
        """The mesh the walkers are split over (``None`` until the first ``init`` when not given)."""
        return self._mesh

    # ------------------------------------------------------------------ the kernels

    def _kernels(self, batch: Any = None) -> tuple[WalkerParallel, WalkerParallel]:
        if self._init_kernel is None or self._step_kernel is None:
            if self._mesh is None:  # where a kernel without mesh= computes (see _mesh.call_mesh), at init
                data = batch.data if isinstance(batch, WalkerSet) else batch
                self._mesh = mesh_of_arrays(data, "walkers") or call_mesh(None, "walkers", _WHERE)[0]
            mesh = self._kmesh = _walker_mesh(self._mesh, self._axis)
            self._size = int(mesh.devices.size)
            r, w, s = Kind.REPLICATED, Kind.PER_WALKER, Kind.STATIC
            self._init_kernel = _kernel(
                self._init_body, (("params", r), ("rng", r), ("batch", w), ("func_state", r)), r, mesh, self._axis
            )
            n_out = 4 if self._has_state else 3
            self._step_kernel = _kernel(
                self._step_body,
                (("params", r), ("state", r), ("rng", r), ("batch", w), ("func_state", r), ("learning_rate", r))
                + (("momentum", r), ("damping", r), ("plan", s)),
                (r,) * n_out,
                mesh,
                self._axis,
            )
        return self._init_kernel, self._step_kernel

    def _call(self, kernel: WalkerParallel, *args: Any) -> Any:
        """``kernel(*args)`` on the optimiser's mesh, whose one axis is the loss's ``pmap_axis_name``.

        A kernel under a mesh context computes on that mesh's axes (``_mesh.call_mesh``),
        where the loss's collectives over ``pmap_axis_name`` would name no axis (an error
        at best; kfac-jax's ``pmean_if_pmap`` silently skips an axis it does not find).
        Eagerly, the optimiser's mesh is entered around the call; inside a trace it
        cannot be (one traced program runs on its context mesh), which is refused.
        """
        assert self._kmesh is not None and self._mesh is not None
        context = context_mesh()
        if context is None or context == self._kmesh:
            return kernel(*args)
        if tracing():
            raise CallError(
                message(
                    _WHERE,
                    f"called inside a trace (jax.jit, lax.scan, jax.eval_shape...) under the mesh context "
                    f"{dict(context.shape)}: a traced program runs on its context mesh's axes, and the loss's "
                    f"collectives over pmap_axis_name={self._axis!r} would find no such axis there.",
                    got=f"mesh context {dict(context.shape)}, the optimiser's mesh {dict(self._mesh.shape)}",
                    expected=f"no mesh context, or one whose only axis is {self._axis!r}",
                    fix="call init and step outside jax.jit (eagerly they run on the optimiser's mesh under any "
                    f"context), or trace them under jax.set_mesh(sv.create_mesh(devices, axis_name={self._axis!r})) "
                    "on the optimiser's devices, or with no mesh context.",
                )
            )
        with jax.set_mesh(self._kmesh):
            return kernel(*args)

    def _init_body(self, params: Any, rng: Any, batch: Any, func_state: Any) -> Any:
        with self._kfac.staging_context():
            return self._kfac.init(params, rng, batch, func_state)

    def _step_body(
        self,
        params: Any,
        state: Any,
        rng: Any,
        batch: Any,
        func_state: Any,
        learning_rate: Any,
        momentum: Any,
        damping: Any,
        plan: tuple[Any, ...],
    ) -> Any:
        data_seen = state.data_seen
        rng = jax.random.fold_in(rng, jax.lax.axis_index(self._axis))
        body = current_body()
        assert body is not None
        # kfac-jax's curvature of the valid walkers of every device, as on one device, and its all-reduces of one
        # buffer each (see _kfac_compat).
        with (
            _kfac_compat.valid_walker_curvature(body.valid, body.count, body.axes),
            _kfac_compat.packed_collectives(),
            self._kfac.staging_context(),
        ):
            # The program depends on the step number only through `plan` (the compilation key; burn-in at step 0
            # is refused in __init__); the number itself is the one being traced for, so kfac-jax takes the same
            # branches.
            out = self._kfac.step(
                params,
                state,
                rng,
                batch=batch,
                func_state=func_state,
                learning_rate=learning_rate,
                momentum=momentum,
                damping=damping,
                global_step_int=self._trace_step,
            )
        new_state, stats = out[1], out[-1]
        new_state.estimator_state = _kfac_compat.sync_estimator(self._kfac, new_state.estimator_state, self._axis)
        n_walkers = all_walkers.count()  # the valid walkers (kfac-jax counts its block times jax.device_count())
        new_state.data_seen = data_seen + n_walkers.astype(jnp.asarray(data_seen).dtype)
        stats["data_seen"] = new_state.data_seen
        stats["batch_size"] = n_walkers
        return out

    # ------------------------------------------------------------------ the public steps

    def _batch(self, batch: Any, what: str) -> Any:
        """The walker data of ``batch`` on the mesh, its padding dropped; ``CallError`` when it cannot split evenly."""
        assert self._mesh is not None and self._kmesh is not None
        size = self._size
        data, n_valid = (batch.data, batch.n_valid) if isinstance(batch, WalkerSet) else (batch, None)
        n = walker_count(data, _WHERE, what)
        if self._masks_padding:  # any count: padded to the mesh, the padding masked by the loss and the curvature
            padded, _ = pad_walker(data, pad_n_walkers(n, size))
            self._check_block(pad_n_walkers(n, size) // size, what)
            sharding = NamedSharding(self._kmesh, PartitionSpec(self._axis))
            placed = jax.tree_util.tree_map(lambda x: _on(x, sharding, lambda y: place_on(y, sharding, _WHERE)), padded)
            return WalkerSet(placed, n if n_valid is None else n_valid)
        if n_valid is not None and n_valid < n:
            if n_valid % size == 0:  # drop the padding: the valid walkers still split evenly
                data, n = slice_walkers(data, 0, n_valid), n_valid
            else:
                raise CallError(
                    message(
                        _WHERE,
                        f"{what} is a WalkerSet of {n_valid} valid walkers padded to {n}; its {n_valid} walkers do not "
                        f"split evenly over the {size} devices, and padding cannot be masked out of a loss written "
                        "for pmap (it averages each device's block).",
                        got=f"n_valid={n_valid}, {n} walkers, mesh {dict(self._mesh.shape)}",
                        expected=f"a walker count that is a multiple of {size}, or a loss that masks padding",
                        fix=f"use sv.kfac.energy_loss (any walker count), or a loss that reduces with sv.all_walkers "
                        f"and masks_padding=True; or use {n_valid - n_valid % size or size} or "
                        f"{pad_n_walkers(n_valid, size)} walkers.",
                    )
                )
        if n % size:
            raise CallError(
                message(
                    _WHERE,
                    f"{what} holds {n} walkers, which do not split evenly over the {size} devices of the mesh "
                    "(padding cannot be masked out of a loss written for pmap).",
                    got=f"{n} walkers, mesh {dict(self._mesh.shape)}",
                    expected=f"a multiple of {size}, or a loss that masks padding",
                    fix=f"use sv.kfac.energy_loss (any walker count), or a loss that reduces with sv.all_walkers and "
                    f"masks_padding=True; or use {n - n % size or size} or {pad_n_walkers(n, size)} walkers.",
                )
            )
        self._check_block(n // size, what)
        # Host data is sliced per device (each process sends only its own walkers); jax.Arrays are moved (or,
        # already split this way, relabelled).
        sharding = NamedSharding(self._kmesh, PartitionSpec(self._axis))
        return jax.tree_util.tree_map(lambda x: _on(x, sharding, lambda y: place_on(y, sharding, _WHERE)), data)

    def _check_block(self, block: int, what: str) -> None:
        if self._block_size and block != self._block_size:
            raise CallError(
                message(
                    _WHERE,
                    f"{what} holds {block} walkers per device, another number than the batch init() was given.",
                    got=f"{block} walkers per device",
                    expected=f"{self._block_size} per device (kfac-jax reads the network from init's batch shape)",
                    fix="pass batches of init's size, or build a new Optimizer (the state carries over).",
                )
            )

    def _replicated(self, tree: Any) -> Any:
        """``tree`` replicated on the mesh: host data is copied there; arrays already there are relabelled.

        ``jax.device_put`` onto an equivalent sharding aliases the buffers (no copy); it
        gives every step's inputs the same sharding, hence one compilation for all steps.
        """
        assert self._kmesh is not None
        sharding = NamedSharding(self._kmesh, PartitionSpec())
        return jax.tree_util.tree_map(lambda x: _on(x, sharding, lambda y: place_on(y, sharding, _WHERE)), tree)

    def init(self, params: Any, rng: jax.Array, batch: Any, func_state: Any = None) -> Any:
        """kfac-jax's ``init`` on a walker-sharded ``batch``; returns its state, replicated.

        ``rng`` is one key (the same on every device, as kfac-jax asks for ``init``).
        Warns :class:`DiagonalBlockWarning` when kfac-jax could not see the network's
        layers.

        Args:
            params: the parameters (replicated, or host arrays).
            rng: a PRNG key.
            batch: a ``sv.WalkerSet`` or a pytree with the walker axis first (any
                walker count the mesh divides, the same as every later ``step``).
            func_state: the loss's state, when ``value_func_has_state=True``.
        """
        init_kernel, _ = self._kernels(batch)
        data = self._batch(batch, "batch")
        rows = data.data if isinstance(data, WalkerSet) else data
        self._block_size = walker_count(rows, _WHERE, "batch") // self._size
        state = self._call(
            init_kernel, self._replicated(params), self._replicated(_key(rng)), data, self._replicated(func_state)
        )
        if self._warn:
            check_curvature_blocks(self._kfac, params, stacklevel=3)
        return state

    def step(
        self,
        params: Any,
        state: Any,
        rng: jax.Array,
        data_iterator: Iterator[Any] | None = None,
        batch: Any = None,
        func_state: Any = None,
        learning_rate: Any = None,
        momentum: Any = None,
        damping: Any = None,
        global_step_int: int | None = None,
    ) -> Any:
        """kfac-jax's ``step`` on a walker-sharded batch; returns kfac-jax's tuple, replicated.

        The arguments are kfac-jax's (``batch`` or ``data_iterator``, one of them);
        ``rng`` is one key, and device ``i``'s loss sees ``fold_in(rng, i)``.

        Args:
            params: the parameters, replicated.
            state: the optimiser state (from :meth:`init` or the previous step).
            rng: a PRNG key, a new one every step.
            data_iterator: yields batches; one is drawn per step.
            batch: a ``sv.WalkerSet`` or a pytree with the walker axis first.
            func_state: the loss's state, when ``value_func_has_state=True``.
            learning_rate: as for kfac-jax (when there is no schedule).
            momentum: as for kfac-jax.
            damping: as for kfac-jax.
            global_step_int: the step number as a Python int; default read from
                ``state`` (one transfer to the host), required when ``state`` is traced.

        Returns:
            ``(params, state, stats)``, or ``(params, state, func_state, stats)`` with
            ``value_func_has_state=True``: kfac-jax's results, replicated.
        """
        if (data_iterator is None) == (batch is None):
            raise CallError(
                message(f"{_WHERE}.step", "pass exactly one of batch= and data_iterator= (as kfac-jax asks).")
            )
        if not self._block_size:  # 0 until init() has read the batch
            raise CallError(
                message(
                    f"{_WHERE}.step",
                    "called before init(): the optimiser has no state and no batch size yet.",
                    fix="call state = opt.init(params, rng, batch) first and pass that state to step.",
                )
            )
        if global_step_int is None and self._one_program:
            global_step_int = 1  # every step is the same program (kfac-jax's flags do not depend on it): no read
        if global_step_int is None:
            counter = state.step_counter
            if isinstance(counter, Tracer):
                raise CallError(
                    message(
                        f"{_WHERE}.step",
                        "state is traced (step called inside jax.jit), so its step counter cannot be read.",
                        fix="pass global_step_int= (the step number as a Python int), as kfac-jax asks when nested.",
                    )
                )
            global_step_int = int(np.asarray(jax.device_get(counter)))
        step = int(global_step_int)
        data = self._batch(next(data_iterator) if data_iterator is not None else batch, "batch")
        _, step_kernel = self._kernels()
        plan = _kfac_compat.curvature_flags(self._kfac, step)
        scalars = self._replicated([None if x is None else jnp.asarray(x) for x in (learning_rate, momentum, damping)])
        params, state, func_state = self._replicated((params, state, func_state))
        self._trace_step = step
        return self._call(step_kernel, params, state, self._replicated(_key(rng)), data, func_state, *scalars, plan)


class EnergyLoss:
    """The VMC energy loss for kfac-jax, as FermiNet's and DeepQMC's write it, over the valid walkers only.

    Made by :func:`energy_loss`; call it as kfac-jax calls its ``value_and_grad_func``:
    ``loss(params, key, walkers) -> ((energy, aux), gradient)`` on one device's block,
    inside :class:`Optimizer`'s step. ``masks_padding`` tells the optimiser that padding
    walkers never enter it, so it takes any walker count.
    """

    masks_padding = True

    def __init__(self, log_psi: Callable[..., Any], local_energy: Callable[..., Any], clipping: Any = None) -> None:
        self.log_psi, self.local_energy, self.clipping = log_psi, local_energy, clipping
        self._value_and_grad = jax.value_and_grad(_total_energy(log_psi, local_energy, clipping), has_aux=True)

    def __call__(self, params: Any, key: Any, walkers: Any) -> Any:
        return self._value_and_grad(params, key, walkers)

    def __repr__(self) -> str:
        return f"EnergyLoss(clipping={self.clipping!r})"


def _total_energy(log_psi: Callable[..., Any], local_energy: Callable[..., Any], clipping: Any) -> Callable[..., Any]:
    # a walker-parallel kernel called from the step's body maps itself over the block (sv.hamiltonian's is one)
    batch_energy = local_energy if isinstance(local_energy, WalkerParallel) else jax.vmap(local_energy, (None, 0))
    batch_log_psi = jax.vmap(log_psi, in_axes=(None, 0))

    def statistics(params: Any, r: jax.Array) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
        e = batch_energy(params, r)
        energy = all_walkers.mean(e)
        variance = all_walkers.mean(jnp.abs(e - energy) ** 2)
        return e, energy, {"energy": energy, "variance": variance}

    @jax.custom_jvp
    def total_energy(params: Any, key: Any, r: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        _, energy, aux = statistics(params, r)
        return energy, aux

    @total_energy.defjvp
    def total_energy_jvp(primals: tuple[Any, ...], tangents: tuple[Any, ...]) -> tuple[Any, Any]:
        params, _, r = primals
        e, energy, aux = statistics(params, r)
        clipped, keep = (e, jnp.ones(e.shape, bool)) if clipping is None else clipping(e)
        body = current_body()
        assert body is not None  # inside Optimizer's step kernel
        if body.valid is not None:
            keep = keep & body.valid
        centred = jnp.where(keep, clipped - all_walkers.mean(clipped), 0.0)
        log_psi_value, log_psi_tangent = jax.jvp(lambda p: batch_log_psi(p, r), (params,), (tangents[0],))
        kfac_jax.register_normal_predictive_distribution(log_psi_value[:, None])
        # This device's share: kfac-jax averages the devices' gradients, which then is the mean over the kept
        # walkers of every device (no collective on the tangent: its transpose would sum the devices again).
        share = jax.lax.axis_size(body.axes) / all_walkers.sum(keep.astype(e.dtype))
        tangent = share * jnp.dot(log_psi_tangent, centred)
        return (energy, aux), (tangent, jax.tree_util.tree_map(jnp.zeros_like, aux))

    return total_energy


def energy_loss(log_psi: Callable[..., Any], local_energy: Callable[..., Any], clipping: Any = None) -> EnergyLoss:
    """The VMC energy loss for :class:`Optimizer`: its value, its gradient and kfac-jax's curvature registration.

    FermiNet's ``make_loss`` and DeepQMC's energy loss, written once: the value is the
    mean local energy over every valid walker, the gradient ``E[(c - E[c]) d log|psi|]``
    with ``c`` the clipped local energies (``clipping``: ``sv.loss.ClipMAD()`` is
    FermiNet's, ``sv.loss.ClipLogSqueeze()`` DeepQMC's; ``None`` keeps them), averaged
    over the walkers the clipping keeps, and ``log|psi|`` registered as a normal
    predictive distribution for kfac-jax's Fisher (as FermiNet does; like both codes,
    the gradient is half the energy's). Padding walkers enter nothing, so the optimiser
    takes any walker count, and the step is the same on any device count.

    Pass it to :class:`Optimizer` with ``value_func_has_aux=True`` and
    ``value_func_has_rng=True``; ``stats["aux"]`` then holds ``energy`` and
    ``variance``. :class:`KFAC` does all this for ``sv.driver.VMC``.

    Args:
        log_psi: ``log_psi(params, r)`` of ONE walker (real ``log|psi|``).
        local_energy: ``local_energy(params, r)`` of ONE walker (e.g.
            ``sv.hamiltonian.local_energy(log_psi, potential)``).
        clipping: a clipping of the gradient's local energies (``sv.loss``), or ``None``.

    Example:
        >>> import jax, jax.numpy as jnp, shardvmc as sv, shardvmc.kfac
        >>> log_psi = lambda a, r: -a * jnp.sum(r**2)
        >>> energy = sv.hamiltonian.local_energy(log_psi, lambda r: 0.5 * jnp.sum(r**2))
        >>> loss = sv.kfac.energy_loss(log_psi, energy, sv.loss.ClipMAD(5.0))
        >>> opt = sv.kfac.Optimizer(loss, l2_reg=0.0, num_burnin_steps=0, learning_rate_schedule=lambda t: 0.1,
        ...                         value_func_has_aux=True, value_func_has_rng=True)
        >>> r = jax.random.normal(jax.random.key(0), (13, 1, 3))  # any walker count
        >>> state = opt.init(jnp.float32(0.4), jax.random.key(1), r)
        >>> a, state, stats = opt.step(jnp.float32(0.4), state, jax.random.key(2), batch=r, momentum=0.0,
        ...                            damping=1e-3)
        >>> int(stats["batch_size"]), bool(a > 0.4)  # 13 walkers; a moves toward the ground state's 0.5
        (13, True)
    """
    return EnergyLoss(log_psi, local_energy, clipping)


def _constant(value: float) -> Callable[[Any], Any]:
    return lambda step: jnp.asarray(value)


@dataclasses.dataclass(frozen=True, eq=False)
class KFAC:
    """KFAC as ``sv.driver.VMC``'s optimiser: kfac-jax on the library's energy loss, FermiNet's settings by default.

    ``sv.driver.VMC(log_psi, sv.kfac.KFAC(), potential, clipping=sv.loss.ClipMAD())``
    trains with KFAC as it does with the natural gradient: VMC builds
    :func:`energy_loss` (its clipping, any walker count) and an :class:`Optimizer` of
    these settings, and its step samples, then takes kfac-jax's step, in one jitted
    program.

    Args:
        learning_rate: a number, or a schedule ``step -> rate`` (an optax schedule);
            FermiNet's is ``0.05 / (1 + t / 10^4)``.
        damping: the Tikhonov damping (FermiNet: 1e-3).
        norm_constraint: the bound on the update's Fisher norm (FermiNet: 1e-3), or ``None``.
        momentum: kfac-jax's momentum (FermiNet: 0).
        curvature_ema: the curvature estimate's moving-average decay (FermiNet: 0.95).
        inverse_update_period: steps between inversions of the curvature (FermiNet: 1).
        min_damping: kfac-jax's ``min_damping``.
        estimation_mode: kfac-jax's ``estimation_mode`` (FermiNet: ``"fisher_exact"``).
        l2_reg: kfac-jax's ``l2_reg``.
        options: any other argument of ``kfac_jax.Optimizer`` (every step must be the same
            program: no adaptive damping, ``curvature_update_period=1``).

    Example:
        >>> import jax, jax.numpy as jnp, shardvmc as sv, shardvmc.kfac
        >>> log_psi = lambda a, r: -a * jnp.sum(r**2)  # a 3-D harmonic oscillator: E = 1.5 at a = 0.5
        >>> vmc = sv.driver.VMC(log_psi, sv.kfac.KFAC(learning_rate=0.1, norm_constraint=None),
        ...                     lambda r: 0.5 * jnp.sum(r**2), clipping=sv.loss.ClipMAD())
        >>> walkers = sv.initialize_walkers_sharded(lambda k: jax.random.normal(k, (1, 3)), 13, key=jax.random.key(0))
        >>> state, stats = vmc.step(vmc.init(jnp.float32(0.4), walkers), jax.random.key(1))
        >>> bool(state.params > 0.4), sorted(stats)
        (True, ['acceptance', 'energy', 'error', 'variance'])
    """

    learning_rate: float | Callable[[Any], Any] = 0.05
    damping: float = 1e-3
    norm_constraint: float | None = 1e-3
    momentum: float = 0.0
    curvature_ema: float = 0.95
    inverse_update_period: int = 1
    min_damping: float = 1e-4
    estimation_mode: str = "fisher_exact"
    l2_reg: float = 0.0
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    _built: dict[Any, Optimizer] = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)

    def vmc_optimizer(
        self, log_psi: Callable[..., Any], local_energy: Callable[..., Any], clipping: Any, mesh: Mesh | None
    ) -> Optimizer:
        """The :class:`Optimizer` of these settings on :func:`energy_loss` (what ``sv.driver.VMC`` steps).

        The same arguments give the same optimiser (its compiled step and its mesh), so a
        script can time or call the step ``sv.driver.VMC`` runs.
        """
        key = (log_psi, local_energy, clipping, mesh)
        if key not in self._built:
            self._built[key] = self._optimizer(log_psi, local_energy, clipping, mesh)
        return self._built[key]

    def _optimizer(
        self, log_psi: Callable[..., Any], local_energy: Callable[..., Any], clipping: Any, mesh: Mesh | None
    ) -> Optimizer:
        schedule = self.learning_rate if callable(self.learning_rate) else _constant(self.learning_rate)
        # The loss reduces with sv.all_walkers; kfac-jax's own collectives name the mesh's axis, so that on a
        # one-axis mesh (sv.create_mesh's "walkers") its kernels run on the walkers' own mesh.
        axis = mesh.axis_names[0] if mesh is not None and len(mesh.axis_names) == 1 else "walkers"
        optimizer = Optimizer(
            energy_loss(log_psi, local_energy, clipping), self.l2_reg, mesh=mesh, pmap_axis_name=axis,
            value_func_has_aux=True,
            value_func_has_rng=True, learning_rate_schedule=schedule, damping_schedule=_constant(self.damping),
            momentum_schedule=_constant(self.momentum), norm_constraint=self.norm_constraint,
            curvature_ema=self.curvature_ema, inverse_update_period=self.inverse_update_period,
            min_damping=self.min_damping, estimation_mode=self.estimation_mode, num_burnin_steps=0,
            **dict(self.options),
        )  # fmt: skip
        if not optimizer._one_program:
            raise CallError(
                message(
                    f"{_WHERE} (KFAC)",
                    "sv.driver.VMC runs every step as one jitted program, but these options make kfac-jax's program "
                    "depend on the step number (adaptive damping, or a curvature_update_period above 1).",
                    got=repr(dict(self.options)),
                    fix="drop use_adaptive_damping= and curvature_update_period=, or write the step yourself with "
                    "shardvmc.kfac.Optimizer (its step takes global_step_int=).",
                )
            )
        return optimizer


_DIAGONAL = frozenset({"generic", "scale_and_shift"})  # kfac-jax's layer tags whose blocks are diagonal


def check_curvature_blocks(optimizer: Any, params: Any, *, stacklevel: int = 2) -> list[str]:
    """The parameters kfac-jax gave generic (diagonal) curvature blocks; warns when layers look hidden.

    Call it after ``init`` on a ``kfac_jax.Optimizer`` you run yourself
    (:meth:`Optimizer.init` calls it for you). It warns :class:`DiagonalBlockWarning`,
    naming the parameters, when the loss kfac-jax traced runs a ``shard_map`` and some
    parameters fell back to generic blocks (e.g. a network run through
    ``sv.shard_vmap`` outside a kernel: kfac-jax's graph matcher does not read inside
    it), or when kfac-jax found no dense or convolution layer although the parameters
    hold matrices. A few generic blocks in a network whose layers were found
    (determinant weights, envelope exponents) are normal and pass silently.

    Args:
        optimizer: a ``shardvmc.kfac.Optimizer`` or an initialised ``kfac_jax.Optimizer``.
        params: the parameters (for their paths and shapes).
        stacklevel: as for ``warnings.warn``.

    Returns:
        The pytree paths of the parameters in generic blocks (empty when kfac-jax's
        internals are not where this version expects them).
    """
    kfac_opt = optimizer.kfac_optimizer if isinstance(optimizer, Optimizer) else optimizer
    blocks = _kfac_compat.parameter_blocks(kfac_opt, params)
    generic = [(path, shape) for path, shape, variant in blocks if variant == "generic"]
    if generic and _kfac_compat.runs_shard_map(kfac_opt):
        named, cause = (
            generic,
            (
                "The loss runs part of its computation inside shard_map (e.g. sv.shard_vmap or sv.get_vmap_fn called "
                "outside a kernel, or jax.shard_map), whose inside kfac-jax's graph matcher does not read."
            ),
        )
    elif blocks and all(variant in _DIAGONAL for *_, variant in blocks) and any(len(s) >= 2 for _, s, _ in blocks):
        named = [(path, shape) for path, shape, _ in blocks if len(shape) >= 2]
        cause = (
            "kfac-jax's graph matcher found no dense or convolution layer in the loss (a weight that is masked, "
            "normalised or otherwise transformed before its matmul is not matched)."
        )
    else:
        return [path for path, _ in generic]
    names = ", ".join(f"{path} {list(shape)}" for path, shape in named[:12])
    more = f" and {len(named) - 12} more" if len(named) > 12 else ""
    warnings.warn(
        f"kfac-jax gave {len(named)} of {len(blocks)} parameters diagonal curvature blocks instead of "
        f"Kronecker-factored ones: {names}{more}. {cause} Write the loss with jax.vmap over the network and run it "
        "through shardvmc.kfac.Optimizer (inside it, sv.shard_vmap and sv.get_vmap_fn run as jax.vmap on each "
        "device's block), or register the layers with kfac_jax.register_dense; see docs/optimisers.md.",
        DiagonalBlockWarning,
        stacklevel=stacklevel + 1,
    )
    return [path for path, _ in generic]


def _on(x: Any, sharding: NamedSharding, place_host: Callable[[Any], Any]) -> Any:
    """``x`` with exactly ``sharding``: traced and matching arrays as they are, other arrays moved, host data placed."""
    if isinstance(x, Tracer) or (isinstance(x, jax.Array) and x.sharding == sharding):
        return x
    if isinstance(x, jax.Array) and x.is_fully_addressable == sharding.is_fully_addressable:
        return jax.device_put(x, sharding)
    if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        # a key of this process bound for a mesh across processes: its bits go the way of host data
        impl = jax.random.key_impl(x)
        return jax.random.wrap_key_data(place_host(np.asarray(jax.random.key_data(x))), impl=impl)
    return place_host(x)


def _key(rng: Any) -> jax.Array:
    """``rng`` as a JAX array (a typed key or a raw ``uint32[2]`` key), checked to be ONE key."""
    rng = jnp.asarray(rng) if not isinstance(rng, jax.Array) else rng
    typed = jnp.issubdtype(rng.dtype, jax.dtypes.prng_key)
    if (typed and rng.ndim == 0) or (not typed and rng.dtype == jnp.uint32 and rng.shape == (2,)):
        return rng
    raise CallError(
        message(
            _WHERE,
            "rng must be one PRNG key (shardvmc gives device i the key fold_in(rng, i)).",
            got=describe(rng),
            expected="jax.random.key(seed) or jax.random.PRNGKey(seed)",
            fix="pass one key, not FermiNet's per-device keys (make_different_rng_key_on_all_devices).",
        )
    )
