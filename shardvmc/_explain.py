"""``kernel.explain(...)``: what a walker-parallel kernel will do with given arguments.

Reads everything from the same places the call uses (the resolved mesh, the layout,
the engine's padding rule, the options) and from the compiled program itself (the
collectives in its HLO text, its memory analysis), so the report cannot drift from
what runs. A program that moves walker data with an all-gather or an all-to-all,
which no marker asks for, warns :class:`CommunicationWarning` once per kernel.
"""

from __future__ import annotations

import dataclasses
import math
import re
import weakref
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from jax.core import Tracer
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ._errors import CallError, message, warn_at_user
from ._kernel import spec as spec_of
from ._markers import Kind
from ._memory import compiled_memory, format_bytes
from ._placement import pad_n_walkers

if TYPE_CHECKING:
    from ._plan import Plan

__all__ = ["COLLECTIVES", "CommunicationWarning", "ExplanationEntry", "Explanation", "count_collectives", "explain"]

COLLECTIVES = ("all-reduce", "all-gather", "all-to-all", "collective-permute", "reduce-scatter")
"""The HLO collectives counted, in report order."""

_UNASKED = ("all-gather", "all-to-all")
"""The collectives that move walker data, which no marker asks for: they warn."""

# One HLO instruction: the op name right before its operand list, as in `%x = f32[8]{0} all-gather(%p), ...`.
# An async pair (`all-reduce-start(` ... `all-reduce-done(`) counts once, at its start; the instruction's own
# name (`%all-gather = ...`), `-done` ops and metadata mentions do not match.
_OP = re.compile(r"(?<![\w%.\-])(" + "|".join(re.escape(c) for c in COLLECTIVES) + r")(?:-start)?\(")

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
"""A quoted string of HLO text (metadata op names, source files): never an op."""

_warned: weakref.WeakSet[Any] = weakref.WeakSet()
"""The kernels that already warned ``CommunicationWarning``."""


class CommunicationWarning(UserWarning):
    """A kernel's compiled program moves data that its markers did not ask to move.

    Raised by ``kernel.explain(...)`` (once per kernel) when the program holds an
    all-gather or an all-to-all. shardvmc itself places only all-reduces (``Mean``/
    ``Sum`` outputs, ``sv.all_walkers``); a gather usually means a ``Replicated``
    argument arrived sharded over the walkers, or a walker count the mesh does not
    divide was padded inside the kernel. The message names the likely cause and the fix.
    """


@dataclasses.dataclass(frozen=True)
class ExplanationEntry:
    """One leaf of a parameter or of the output, as the kernel sees it.

    Attributes:
        name: the parameter name (``"return"`` for the output, ``"return[i]"`` for
            element ``i`` of a tuple output).
        path: the pytree path inside it (``jax.tree_util.keystr``; ``""`` for the whole).
        marker: the marker, e.g. ``"PerWalker"``.
        spec: the PartitionSpec the kernel gives it; ``None`` for a ``Static`` parameter
            (compiled in).
        shape: the global shape (``None`` for a ``Static`` parameter).
        dtype: the dtype name (for a ``Static`` parameter: the type of its value).
        placed: the PartitionSpec of the argument as passed, when it is an array placed
            with a ``NamedSharding``; ``None`` otherwise.
    """

    name: str
    path: str
    marker: str
    spec: PartitionSpec | None
    shape: tuple[int, ...] | None
    dtype: str
    placed: PartitionSpec | None = None


@dataclasses.dataclass(frozen=True)
class Explanation:
    """What a walker-parallel kernel does with one set of arguments (``kernel.explain``).

    ``str(explanation)`` is a readable report; the attributes hold the same as data.

    Attributes:
        kernel: the qualified name of the function.
        mesh_shape: the resolved mesh, axis name to size.
        device_ids: the ids of the mesh's devices, in mesh order.
        walker_axis: the mesh axis (or axes) the walkers are split over.
        n_devices: the number of devices along ``walker_axis``.
        parameters: every parameter leaf (one entry per ``Static`` parameter).
        outputs: every output leaf.
        n_walkers: the number of walkers passed (padding included).
        n_padded: ``n_walkers`` rounded up to a multiple of ``n_devices``.
        pads_inside: whether the kernel pads inside (``n_walkers`` not divisible).
        n_valid: the number of valid walkers (``None`` when traced).
        walkers_per_device: walkers on each device (of the padded count).
        batched: whether the function takes each device's block of walkers.
        batch_size: the chunk size of ``folx.batched_vmap``, or ``None``.
        collectives: the collectives of the compiled program, HLO op name to count
            (nonzero kinds only).
        unexpected: the collectives no marker asked for (all-gathers, all-to-alls).
        cause: the likely cause of ``unexpected`` (``None`` when there are none).
        fix: how to remove them (``None`` when there are none).
        argument_bytes: per-device bytes of the arguments (0 where the backend does not say).
        output_bytes: per-device bytes of the outputs.
        temp_bytes: per-device bytes of temporaries.
        generated_code_bytes: bytes of generated code.
    """

    kernel: str
    mesh_shape: dict[str, int]
    device_ids: tuple[int, ...]
    walker_axis: str | tuple[str, ...]
    n_devices: int
    parameters: tuple[ExplanationEntry, ...]
    outputs: tuple[ExplanationEntry, ...]
    n_walkers: int
    n_padded: int
    pads_inside: bool
    n_valid: int | None
    walkers_per_device: int
    batched: bool
    batch_size: int | None
    collectives: dict[str, int]
    unexpected: dict[str, int]
    cause: str | None
    fix: str | None
    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    generated_code_bytes: int

    @property
    def chunking(self) -> str:
        """How each device runs the function over its walkers, in words."""
        per_device = self.walkers_per_device
        n = f"{per_device} walker{'s' if per_device != 1 else ''}"
        if self.batched:
            return f"block function: each device passes its {n} as one block"
        if self.batch_size:
            chunks = math.ceil(per_device / self.batch_size)
            return (
                f"folx.batched_vmap, batch_size={self.batch_size}: each device's {n} in {chunks} "
                f"chunk{'s' if chunks != 1 else ''}"
            )
        return f"jax.vmap (no batch_size): each device's {n} at once"

    def __str__(self) -> str:
        axis = self.walker_axis if isinstance(self.walker_axis, str) else " x ".join(self.walker_axis)
        lines = [
            f"walker_parallel kernel {self.kernel}",
            f"  mesh:          {self.mesh_shape}, devices {list(self.device_ids)}",
            f"  walker axis:   {axis!r} ({self.n_devices} device{'s' if self.n_devices != 1 else ''})",
            "  parameters:",
            *_table(self.parameters),
            "  outputs:",
            *_table(self.outputs),
        ]
        if self.pads_inside:
            padding = f"padded to {self.n_padded} inside the kernel ({self.n_devices} devices do not divide it)"
        else:
            padding = f"no padding inside (divisible by {self.n_devices})"
        valid = "traced" if self.n_valid is None else str(self.n_valid)
        lines.append(f"  walkers:       {self.n_walkers}, {padding}; valid: {valid}")
        lines.append(f"  chunking:      {self.chunking}")
        found = ", ".join(f"{k} x{v}" for k, v in self.collectives.items()) or "none"
        lines.append(f"  collectives:   {found}")
        if self.unexpected:
            found = ", ".join(f"{k} x{v}" for k, v in self.unexpected.items())
            lines.append(f"    unexpected:  {found}, not asked for by any marker")
            lines.append(f"    cause:       {self.cause}")
            lines.append(f"    fix:         {self.fix}")
        memory = (
            ("arguments", self.argument_bytes),
            ("outputs", self.output_bytes),
            ("temporaries", self.temp_bytes),
            ("generated code", self.generated_code_bytes),
        )
        lines.append("  memory/device: " + ", ".join(f"{label} {format_bytes(b)}" for label, b in memory))
        return "\n".join(lines)


def _table(entries: tuple[ExplanationEntry, ...]) -> list[str]:
    rows = []
    for e in entries:
        where = f"{e.name}{e.path}"
        layout = "compiled in" if e.spec is None else str(e.spec)
        what = e.dtype if e.shape is None else f"{e.dtype}{list(e.shape)}"
        placed = "" if e.placed is None or e.placed == e.spec else f"(passed as {e.placed})"
        rows.append((where, e.marker, layout, what, placed))
    if not rows:
        return ["    (none)"]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    return [
        ("    " + "  ".join(c.ljust(w) for c, w in zip(r[:4], widths)) + ("  " + r[4] if r[4] else "")).rstrip()
        for r in rows
    ]


def count_collectives(hlo_text: str) -> dict[str, int]:
    """Count the collective ops of an HLO module's text, by kind (nonzero kinds only).

    An async pair (``all-reduce-start``/``all-reduce-done``) counts once.

    Example:
        >>> from shardvmc._explain import count_collectives
        >>> count_collectives(
        ...     "%all-gather = f32[8]{0} all-gather(%p), dimensions={0}\\n"
        ...     "%s = f32[] all-reduce-start(%q)\\n%d = f32[] all-reduce-done(%s)"
        ... )
        {'all-reduce': 1, 'all-gather': 1}
    """
    found: dict[str, int] = {}
    for op in _OP.findall(_STRING.sub('""', hlo_text)):
        found[op] = found.get(op, 0) + 1
    return {op: found[op] for op in COLLECTIVES if op in found}


def _dtype(leaf: Any) -> tuple[tuple[int, ...], str]:
    dtype = getattr(leaf, "dtype", None)
    if dtype is None:
        aval = jax.typeof(leaf)
        return tuple(aval.shape), str(aval.dtype)
    return tuple(np.shape(leaf)), str(dtype)


def _placed(leaf: Any) -> PartitionSpec | None:
    sharding = getattr(leaf, "sharding", None) if isinstance(leaf, jax.Array) else None
    return sharding.spec if isinstance(sharding, NamedSharding) else None


def _parameters(plan: Plan, args: tuple[Any, ...], dyn: tuple[Any, ...]) -> tuple[ExplanationEntry, ...]:
    spec = plan.spec
    axis = plan.key.axis
    values = dict(zip(spec.dyn_idx, dyn))
    values.update(zip(spec.static_idx, spec.statics_of(args)))
    entries = []
    for i, p in enumerate(spec.layout.params):
        value = values[i]
        if p.kind is Kind.STATIC:
            entries.append(
                ExplanationEntry(p.name, "", p.kind.value, None, None, f"{type(value).__name__} = {value!r}"[:60])
            )
            continue
        for path, leaf in jax.tree_util.tree_flatten_with_path(value)[0]:
            shape, dtype = _dtype(leaf)
            keystr = jax.tree_util.keystr(path)
            entries.append(
                ExplanationEntry(p.name, keystr, p.kind.value, spec_of(p.kind, axis), shape, dtype, _placed(leaf))
            )
    return tuple(entries)


def _outputs(plan: Plan, out_info: Any, pads_inside: bool) -> tuple[ExplanationEntry, ...]:
    axis = plan.key.axis
    output = plan.spec.layout.output
    if plan.replicated_check == "values":
        out_info = out_info[0]  # the program's last output is the check of its Replicated outputs
    parts = [("return", output, out_info)] if isinstance(output, Kind) else []
    if not isinstance(output, Kind):
        parts = [(f"return[{i}]", k, o) for i, (k, o) in enumerate(zip(output, out_info))]
    entries = []
    for name, kind, info in parts:
        # An uneven count cannot keep its walker sharding on the way out: the outputs come back replicated.
        layout = PartitionSpec() if pads_inside else spec_of(kind, axis)
        for path, leaf in jax.tree_util.tree_flatten_with_path(info)[0]:
            shape, dtype = _dtype(leaf)
            entries.append(ExplanationEntry(name, jax.tree_util.keystr(path), kind.value, layout, shape, dtype))
    return tuple(entries)


def _cause(plan: Plan, mesh: Mesh, dyn: tuple[Any, ...], n: int, size: int) -> tuple[str, str]:
    """The likely reason for an all-gather or all-to-all, and its fix."""
    n_pad = pad_n_walkers(n, size)
    if n != n_pad:
        return (
            f"the {n} walkers do not split evenly over the {size} devices, so the kernel padded them inside, "
            "replicating the walkers and gathering the per-walker outputs",
            f"keep a padded walker set: `walkers = sv.WalkerSet(*sv.pad_walker(walkers, sv.pad_n_walkers({n}, "
            f"{size})))`, or initialise with sv.initialize_walkers_sharded.",
        )
    axis = plan.key.axis
    params = plan.spec.dyn_params
    sharded, misplaced = [], []
    for p, arg in zip(params, dyn):
        for path, leaf in jax.tree_util.tree_flatten_with_path(arg)[0]:
            sharding = getattr(leaf, "sharding", None) if isinstance(leaf, jax.Array) else None
            if sharding is None or sharding.is_fully_replicated:
                continue
            placed = _placed(leaf) or sharding
            where = f"{p.kind.value} argument {p.name}{jax.tree_util.keystr(path)} (passed as {placed})"
            if p.kind is not Kind.PER_WALKER:
                sharded.append(where)
            elif not sharding.is_equivalent_to(NamedSharding(mesh, spec_of(p.kind, axis)), leaf.ndim):
                misplaced.append(where)
    if sharded:
        return (
            f"the {', '.join(sharded)} arrives sharded over the devices (e.g. the PerWalker output of another "
            "kernel), so the kernel all-gathers it on every call",
            "pass it replicated: `x = sv.replicate(x)` once, outside the loop (or make the kernel that produces it "
            "return a Mean/Sum); mark the parameter PerWalker if it holds one row per walker.",
        )
    if misplaced:
        return (
            f"the {', '.join(misplaced)} is sharded otherwise than over the walker axis {axis!r}, so the kernel "
            "moves it into place",
            "place it with `sv.shard_walker(x)` (walker axis first, split over the walker mesh axis).",
        )
    return (
        "no argument placement explains it: the function body itself (a sharding constraint, or an op that XLA "
        "partitions across devices) moves data",
        "read `kernel.lower(...).compile().as_text()` for the ops and their metadata op_name, and keep walker data "
        "inside the per-walker body.",
    )


def explain(
    plan: Plan, lowered: jax.stages.Lowered, args: tuple[Any, ...], dyn: tuple[Any, ...], n_valid: Any, *, warn_key: Any
) -> Explanation:
    """The :class:`Explanation` of a call with plan ``plan`` (``kernel.explain``).

    Compiles ``lowered`` (as ``kernel.lower(...).compile()`` does; the compilation is
    not cached for the calls) and warns :class:`CommunicationWarning` once per kernel
    (``warn_key``) when the program holds an all-gather or an all-to-all.

    Example:
        >>> import jax, jax.numpy as jnp, shardvmc as sv
        >>> @sv.walker_parallel(batch_size=2)
        ... def energy(alpha: sv.Replicated[jax.Array], r: sv.PerWalker[jax.Array]) -> sv.Mean[jax.Array]:
        ...     return alpha * jnp.sum(r**2)
        >>> e = energy.explain(jnp.float32(0.5), sv.WalkerSet(jnp.ones((16, 3)), n_valid=12))
        >>> e.n_walkers, e.pads_inside, e.n_valid, e.walkers_per_device, e.collectives
        (16, False, 12, 2, {'all-reduce': 1})
        >>> [(p.name, str(p.spec), p.shape) for p in e.parameters]
        [('alpha', 'P()', ()), ('r', "P('walkers',)", (16, 3))]
    """
    mesh = plan.mesh
    compiled = lowered.compile()
    spec = plan.spec
    size, n, n_pad = plan.n_shards, plan.n_walkers, plan.n_padded
    text = compiled.as_text()
    if text is None:  # JAX allows a backend to keep the compiled program's text to itself
        raise CallError(
            message(
                f"{spec.qualname}.explain",
                "the backend gives no text of the compiled program, so its collectives cannot be counted.",
                fix="explain the kernel on a CPU or GPU mesh of the same shape.",
            )
        )
    collectives = count_collectives(text)
    unexpected = {k: v for k, v in collectives.items() if k in _UNASKED}
    cause, fix = _cause(plan, mesh, dyn, n, size) if unexpected else (None, None)
    memory = compiled_memory(compiled)
    explanation = Explanation(
        kernel=spec.qualname,
        mesh_shape={str(k): int(v) for k, v in mesh.shape.items()},
        device_ids=tuple(int(d.id) for d in mesh.devices.flat),
        walker_axis=plan.key.axis,
        n_devices=size,
        parameters=_parameters(plan, args, dyn),
        outputs=_outputs(plan, lowered.out_info, n != n_pad),
        n_walkers=n,
        n_padded=n_pad,
        pads_inside=n != n_pad,
        n_valid=plan.n_valid if n_valid is None or isinstance(n_valid, Tracer) else int(n_valid),
        walkers_per_device=n_pad // size,
        batched=spec.options.batched,
        batch_size=plan.batch_size,
        collectives=collectives,
        unexpected=unexpected,
        cause=cause,
        fix=fix,
        argument_bytes=memory.argument_bytes,
        output_bytes=memory.output_bytes,
        temp_bytes=memory.temp_bytes,
        generated_code_bytes=memory.code_bytes,
    )
    if unexpected and warn_key not in _warned:
        _warned.add(warn_key)
        found = ", ".join(f"{v} {k}{'s' if v != 1 else ''}" for k, v in unexpected.items())
        warn_at_user(
            message(
                spec.qualname,
                f"the compiled kernel holds {found}, which no marker asks for (shardvmc places only all-reduces), "
                "so it moves data between devices on every call.",
                got=f"collectives {collectives}; likely cause: {cause}",
                fix=fix,
            ),
            CommunicationWarning,
        )
    return explanation
