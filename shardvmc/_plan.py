"""The plan of a kernel for one call signature, which calls, ``lower``, ``explain`` and ``batch_size="auto"`` read.

A :class:`WalkerParallel` kernel resolves its layout once (a :class:`KernelSpec`) and,
per call signature (the mesh, the static values, the compiled-in parts of model
containers, the walker count and the valid count), one :class:`Plan`: the jitted
program, the chunk it runs with, the padding decision and how its ``Replicated``
outputs are verified. The call path builds the key, looks the plan up and runs it;
nothing else is recomputed per call.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from . import _compat, _internals
from ._errors import CallError, message
from ._kernel import TRACED, Options, build, output_shardings, signature_of
from ._markers import Kind, Layout, Param
from ._placement import pad_n_walkers

__all__ = ["KernelSpec", "Plan", "PlanKey", "make_plan", "options_of", "pinned_out_shardings", "raise_if_disagree"]


def _picker(indices: tuple[int, ...]) -> Callable[[tuple[Any, ...]], tuple[Any, ...]]:
    """A fast ``lambda args: tuple(args[i] for i in indices)``."""
    if not indices:
        return lambda args: ()
    if len(indices) == 1:
        i = indices[0]
        return lambda args: (args[i],)
    return operator.itemgetter(*indices)


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    """What decoration fixed: the function, its complete layout, the options and the name.

    Attributes:
        fn: the per-walker (or block) function.
        layout: its markers.
        options: the options of ``walker_parallel``.
        qualname: the name used in messages.
        static_idx: positions of the ``Static`` parameters.
        dyn_idx: positions of the other parameters (traced).
        walker_idx: positions, among the traced ones, of the ``PerWalker`` parameters.
        container_idx: positions, among the traced ones, of the parameters that may hold
            model containers (``Replicated`` and ``PerWalker``).
    """

    fn: Callable[..., Any]
    layout: Layout
    options: Options
    qualname: str
    static_idx: tuple[int, ...]
    dyn_idx: tuple[int, ...]
    walker_idx: tuple[int, ...]
    container_idx: tuple[int, ...]
    statics_of: Callable[[tuple[Any, ...]], tuple[Any, ...]]
    dyn_of: Callable[[tuple[Any, ...]], tuple[Any, ...]]

    @classmethod
    def of(cls, fn: Callable[..., Any], layout: Layout, options: Options, qualname: str) -> KernelSpec:
        params = layout.params
        static_idx = tuple(i for i, p in enumerate(params) if p.kind is Kind.STATIC)
        dyn_idx = tuple(i for i, p in enumerate(params) if p.kind is not Kind.STATIC)
        dyn_kinds = [params[i].kind for i in dyn_idx]
        return cls(
            fn=fn,
            layout=layout,
            options=options,
            qualname=qualname,
            static_idx=static_idx,
            dyn_idx=dyn_idx,
            walker_idx=tuple(j for j, k in enumerate(dyn_kinds) if k is Kind.PER_WALKER),
            container_idx=tuple(j for j, k in enumerate(dyn_kinds) if k in (Kind.PER_WALKER, Kind.REPLICATED)),
            statics_of=_picker(static_idx),
            dyn_of=_picker(dyn_idx),
        )

    @property
    def dyn_params(self) -> tuple[Param, ...]:
        """The traced parameters, in order."""
        return tuple(self.layout.params[i] for i in self.dyn_idx)

    @property
    def static_params(self) -> tuple[Param, ...]:
        """The ``Static`` parameters, in order."""
        return tuple(self.layout.params[i] for i in self.static_idx)


class PlanKey(NamedTuple):
    """What makes two calls of one kernel need different programs."""

    mesh: Mesh
    axis: str | tuple[str, ...]  # the walker axes of the call on ``mesh`` (see ``_mesh.call_mesh``)
    statics: tuple[Any, ...]
    parts: tuple[Any, ...]  # per traced parameter: the compiled-in part of a model container, or None
    n_walkers: int
    valid_count: int | str | None  # None: all valid; an int (compiled in); TRACED
    signature: tuple[Any, ...] | None  # the abstract arguments, with batch_size="auto" only


class Plan:
    """The program of a kernel for one call signature, and what it was decided with.

    Attributes:
        spec: the kernel.
        key: the call signature.
        batch_size: the chunk each device runs with (``None``: all walkers at once).
        run: the jitted program ``run(dynamic_args, n_valid)``.
        replicated_check: how ``Replicated`` outputs are verified: ``"none"`` (there
            are none, or ``checks=False``), ``"types"`` (JAX proved them replicated at
            trace time) or ``"values"`` (the program also compares their bits across
            devices, read at the first concrete call).
    """

    __slots__ = ("batch_size", "key", "mesh", "out_shardings", "replicated_check", "run", "spec")

    def __init__(
        self,
        spec: KernelSpec,
        key: PlanKey,
        run: jax.stages.Wrapped,
        batch_size: int | None,
        replicated_check: str,
        out_shardings: Any = None,
    ) -> None:
        self.spec = spec
        self.out_shardings = out_shardings
        """The ``out_shardings`` ``run`` is jitted with (``None``: XLA's own)."""
        self.key = key
        self.mesh: Mesh = key.mesh
        """The mesh the program runs on."""
        self.run = run
        self.batch_size = batch_size
        self.replicated_check = replicated_check

    @property
    def n_shards(self) -> int:
        """The number of devices along the walker axis: the shards the walkers are split into."""
        return _compat.axis_size(self.key.mesh, self.key.axis)

    @property
    def n_walkers(self) -> int:
        """The walkers passed, padding included."""
        return self.key.n_walkers

    @property
    def n_padded(self) -> int:
        """``n_walkers`` rounded up to a multiple of ``n_shards``."""
        return pad_n_walkers(self.key.n_walkers, self.n_shards)

    @property
    def n_valid(self) -> int | None:
        """The number of real walkers (``None``: traced, known when the program runs)."""
        count = self.key.valid_count
        return self.key.n_walkers if count is None else None if count == TRACED else int(count)

    def traced_call(self, dyn: tuple[Any, ...], n_valid: Any) -> tuple[Any, Any]:
        """Run the program inside the call's trace: ``(outputs, agree)``.

        ``agree`` is ``None`` unless the ``Replicated`` outputs' values are compared
        (``replicated_check == "values"``): then it says, per such output, whether every
        device holds the same bits, and the outputs of a disagreeing call are poisoned, NaN
        (the lowest integer for integers). No error can be raised from inside a program (a
        host callback that raises leaves the other devices waiting in their all-reduce): the
        kernel raises from ``agree`` at a concrete call.
        """
        if self.replicated_check != "values":
            return self.run(dyn, n_valid), None
        out, agree = self.run(dyn, n_valid)
        ok = jnp.all(agree)
        return jax.tree_util.tree_map(lambda o: jnp.where(ok, o, _poison(o)) if _numeric(o) else o, out), agree

    def lower(self, dyn: tuple[Any, ...], n_valid: Any) -> jax.stages.Lowered:
        """``jax.jit(...).lower`` of the program."""
        return self.run.lower(dyn, n_valid)


def raise_if_disagree(spec: KernelSpec, agree: Any) -> None:
    """Raise the ``CallError`` of a call whose ``Replicated`` outputs differ between devices (``agree`` concrete)."""
    bad = [i for i, ok in enumerate(np.asarray(agree)) if not ok]
    if bad:
        raise _device_local_error(spec, _replicated_positions(spec.layout, bad))


def _numeric(x: Any) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.number)


def _poison(x: jax.Array) -> jax.Array:
    dtype = jnp.result_type(x)
    return jnp.full((), jnp.nan if jnp.issubdtype(dtype, jnp.inexact) else jnp.iinfo(dtype).min, dtype)


def _replicated_positions(layout: Layout, among: list[int]) -> list[int | None]:
    """Output positions (``None`` for a single output) of the ``among``-th Replicated outputs."""
    if isinstance(layout.output, Kind):
        return [None]
    positions = [i for i, k in enumerate(layout.output) if k is Kind.REPLICATED]
    return [positions[j] for j in among]


def _device_local_error(spec: KernelSpec, positions: Sequence[int | None]) -> CallError:
    names = ", ".join("the return" if p is None else f"return[{p}]" for p in positions)
    return CallError(
        message(
            spec.qualname,
            f"{names} is marked Replicated, but it differs between devices: the block function returned a value "
            "computed from its own device's walkers only.",
            expected="a value equal on every device, such as a result of sv.all_walkers.mean/.sum",
            fix="reduce it over all walkers inside the body (sv.all_walkers.sum(x) instead of x.sum()), or mark it "
            "Mean[...]/Sum[...] and return one row per walker of the block.",
        )
    )


def _abstract(tree: Any) -> Any:
    return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(np.shape(x), jax.typeof(x).dtype), tree)


def _prove_replicated(spec: KernelSpec, key: PlanKey, dyn: tuple[Any, ...], n_valid: Any) -> str:
    """Ask JAX, by tracing once with its varying-axes check, whether the Replicated outputs are replicated.

    Returns ``"types"`` when JAX proves them, ``"values"`` when it cannot tell (the body
    does not trace under the check, as folx's Laplacian does not); raises the
    ``CallError`` naming the output when JAX finds one that varies over the devices.
    """
    checked = build(
        spec.fn, spec.layout, key.statics, key.mesh, options_of(spec, key), spec.qualname,
        n=key.n_walkers, count=key.valid_count, parts=key.parts, check_vma=True,
    )  # fmt: skip
    verdict = _internals.vma_check_verdict(
        lambda: jax.eval_shape(checked, _abstract(dyn), None if n_valid is None else _abstract(n_valid))
    )
    if verdict is None:  # the body does not trace under the check; the values are compared instead
        return "values"
    if not verdict:
        return "types"
    kinds = spec.layout.output if isinstance(spec.layout.output, tuple) else (spec.layout.output,)
    positions = [i for i in verdict if kinds[i] is Kind.REPLICATED]
    if not positions:
        return "values"
    raise _device_local_error(spec, [None] if isinstance(spec.layout.output, Kind) else positions)


def _check_statics(spec: KernelSpec, statics: tuple[Any, ...]) -> None:
    """A ``Static`` value holding arrays would compile stale copies of them in: refused."""
    for p, value in zip(spec.static_params, statics):
        for path, leaf in jax.tree_util.tree_flatten_with_path(value)[0]:
            if isinstance(leaf, (jax.Array, np.ndarray)):
                raise CallError(
                    message(
                        spec.qualname,
                        f"Static parameter {p.name!r} holds an array at {jax.tree_util.keystr(path) or '<root>'}: a "
                        "Static value is compiled in and keyed by equality (a model object by its identity), so "
                        "changes to its arrays, such as an optimiser's in-place update, would never reach the kernel.",
                        got=f"{type(value).__name__} with {type(leaf).__name__} {list(np.shape(leaf))}",
                        fix="mark the parameter Replicated: its arrays are then traced, and its other leaves "
                        "(functions, settings) are compiled in.",
                    )
                )


def pinned_out_shardings(layout: Layout, mesh: Mesh, axis_name: str | tuple[str, ...]) -> Any:
    """The ``out_shardings`` a kernel's program is jitted with on ``mesh`` (``None``: XLA's own).

    shard_map's out_specs give per-walker outputs P(axis) on a mesh of several devices. On one device XLA
    reports P() instead, so the spec is pinned with out_shardings there only: on more devices, pinned
    shardings become the required shardings of the cotangents when a caller differentiates eagerly.
    """
    return output_shardings(layout, mesh, axis_name) if mesh.size == 1 else None


def options_of(spec: KernelSpec, key: PlanKey) -> Options:
    """The kernel's options with the walker axes of the call."""
    return spec.options if key.axis == spec.options.axis_name else dataclasses.replace(spec.options, axis_name=key.axis)


def make_plan(spec: KernelSpec, key: PlanKey, dyn: tuple[Any, ...], n_valid: Any) -> Plan:
    """Build the plan of ``spec`` for the call signature ``key`` (the arguments of that call: ``dyn``)."""
    _check_statics(spec, key.statics)
    options = options_of(spec, key)
    mesh = key.mesh
    shardings = pinned_out_shardings(spec.layout, mesh, options.axis_name)
    outputs = spec.layout.output if isinstance(spec.layout.output, tuple) else (spec.layout.output,)
    check = "none"
    if options.batched and options.checks and Kind.REPLICATED in outputs:
        check = _prove_replicated(spec, key, dyn, n_valid)
    if check == "values" and shardings is not None:
        shardings = (shardings, None)

    def jitted(opts: Options) -> jax.stages.Wrapped:
        program = build(
            spec.fn, spec.layout, key.statics, mesh, opts, spec.qualname,
            n=key.n_walkers, count=key.valid_count, parts=key.parts, verify_replicated=check == "values",
        )  # fmt: skip
        return jax.jit(program, out_shardings=shardings)

    if options.batch_size == "auto":
        run, chunk = _largest_fitting_chunk(options, jitted, key, dyn, n_valid, spec.qualname)
    else:
        run, chunk = jitted(options), options.batch_size
    return Plan(spec, key, run, chunk if isinstance(chunk, int) else None, check, shardings)


def _largest_fitting_chunk(
    options: Options,
    jitted: Callable[[Options], jax.stages.Wrapped],
    key: PlanKey,
    dyn: tuple[Any, ...],
    n_valid: Any,
    qualname: str,
) -> tuple[jax.stages.Wrapped, int | None]:
    """``batch_size="auto"``: the largest chunk whose compiled per-device bytes fit the budget.

    Candidates are all walkers of a device at once, then powers of two below that; the
    compiled memory grows with the chunk, so a bisection needs a few compilations at most
    (one when everything fits at once).
    """
    from ._memory import compiled_memory, device_memory_budget, format_bytes

    mesh = key.mesh
    abstract = (_abstract(dyn), None if n_valid is None else _abstract(n_valid))
    per_device = -(-key.n_walkers // _compat.axis_size(mesh, options.axis_name))
    budget = options.memory_budget or device_memory_budget(mesh.devices.flat[0])
    candidates: list[int | None] = [1 << k for k in range(max(per_device - 1, 1).bit_length()) if 1 << k < per_device]
    candidates.append(None)  # ascending: 1, 2, 4, ..., then every walker at once
    tried: dict[int | None, tuple[Any, int]] = {}

    def needs(bs: int | None) -> int:
        if bs not in tried:
            run = jitted(dataclasses.replace(options, batch_size=bs))
            # Compiled here, while the call traces: abstract arguments (a tracer cannot be lowered with).
            compiled = run.lower(*abstract).compile()
            tried[bs] = (run, compiled_memory(compiled).total_bytes)
        return tried[bs][1]

    if needs(None) <= budget:
        return tried[None][0], None
    lo, hi = -1, len(candidates) - 1  # candidates[lo] fits (-1: none known yet); candidates[hi] does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if needs(candidates[mid]) <= budget else (lo, mid)
    if lo < 0:
        raise CallError(
            message(
                qualname,
                "batch_size='auto' found no chunk that fits the per-device memory budget: even one walker at a time "
                "needs more.",
                got=f"{format_bytes(needs(candidates[0]))} per device for batch_size={candidates[0]}, "
                f"{format_bytes(needs(None))} for all {per_device} walkers of a device at once",
                expected=f"at most {format_bytes(budget)} per device (memory_budget)",
                fix="spread the walkers over more devices, shrink the per-walker work, or raise memory_budget=.",
            )
        )
    return tried[candidates[lo]][0], candidates[lo]


def auto_signature(spec: KernelSpec, dyn: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """The part of the key that only ``batch_size="auto"`` needs: the abstract arguments."""
    return signature_of(dyn) if spec.options.batch_size == "auto" else None
