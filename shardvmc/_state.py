"""Training-state checkpoints on orbax-checkpoint: walker sets, parameters, optimiser states, keys and counters.

A state is any pytree. Its leaves are stored by kind:

* leaves of a :class:`~shardvmc.WalkerSet` ("walker"): sharded arrays that orbax writes
  shard by shard, each process its own rows (padding included: the rows beyond
  ``n_valid``, at most one fewer than the device count); the set's count is in the header;
* other ``jax.Array`` leaves ("array"): replicated, written once;
* NumPy arrays and scalars ("numpy"): host data, written once;
* Python ``bool``/``int``/``float``/``complex``/``str`` ("python"): in the JSON header.

Typed PRNG keys are stored as their key data with the implementation's name. A
checkpoint is one orbax step directory ``<directory>/<step>/`` holding two items,
``arrays`` (orbax's PyTree handler: tensorstore, OCDBT) and ``shardvmc`` (the JSON
header: leaf paths, kinds, dtypes, shapes, the walker sets' counts, the metadata).
orbax writes it under a temporary name and renames it once every process has written
its part, so a save killed at any moment leaves the previous checkpoint as it was;
it keeps the last ``keep`` steps.

A restore reads the header, checks it against ``like``, and has orbax read each leaf
onto the new mesh: walker leaves sharded over the walker axis, each process reading
only its own devices' rows (then padded with copies of walker 0, or cycled onto
another walker count as :func:`~shardvmc.load_walkers` does), every other array
replicated.
"""

from __future__ import annotations

import atexit
import functools
import os
import weakref
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from . import _compat
from ._checkpoint import (
    RESIZED,
    check_dtype,
    check_key_impl,
    check_shape,
    checked_metadata,
    dtype_error,
    is_key_dtype,
    jax_dtype,
    path_name,
    resized,
    restored_count,
    structure_error,
)
from ._errors import CallError, message
from ._mesh import get_replicated_sharding, get_walker_sharding, resolve_mesh
from ._placement import pad_n_walkers
from ._walkerset import WalkerSet, check_n_valid, walker_count

__all__ = ["Checkpointer", "load_state", "save_state", "wait_for_saves"]

_FORMAT = "shardvmc-state"
_VERSION = 1
_ARRAYS = "arrays"  # orbax item: every stored array, keyed by leaf index
_HEADER = "shardvmc"  # orbax item: the JSON header
_KINDS = ("walker", "array", "numpy", "python")
_PYTHON = {"bool": bool, "int": int, "float": float, "complex": complex, "str": str}
INSTALL = "pip install 'shardvmc[checkpoint]'"
"""How to install what the state checkpoints need (orbax-checkpoint)."""

_LIVE: weakref.WeakSet[Checkpointer] = weakref.WeakSet()  # whose writes wait_for_saves() and exit wait for
_ONE_SHOT: dict[Path, Checkpointer] = {}  # the checkpointers behind save_state, one per path


def _orbax() -> Any:
    try:
        import orbax.checkpoint as ocp
    except ImportError as err:
        raise ImportError(
            "shardvmc's state checkpoints (sv.save_state, sv.load_state, sv.Checkpointer) store their data with "
            f"orbax-checkpoint, which is not installed: {INSTALL}"
        ) from err
    return ocp


# ---------------------------------------------------------------- the layout of a state


class _Slot(NamedTuple):
    """One leaf of a state: its name, the leaf, and the index of its walker set (``None``: not in one)."""

    name: str
    leaf: Any
    walker_set: int | None


class _Layout(NamedTuple):
    """A state taken apart: the leaves, the walker sets (name, node), and how to put it back together."""

    slots: list[_Slot]
    sets: list[tuple[str, WalkerSet]]
    top: Any  # treedef with WalkerSets as leaves
    nodes: list[Any]  # the top-level leaves: WalkerSets or plain leaves


def _layout(tree: Any) -> _Layout:
    top_leaves, top = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, WalkerSet))
    slots: list[_Slot] = []
    sets: list[tuple[str, WalkerSet]] = []
    nodes: list[Any] = []
    for path, node in top_leaves:
        nodes.append(node)
        if isinstance(node, WalkerSet):
            name = jax.tree_util.keystr(path)
            for sub, leaf in jax.tree_util.tree_flatten_with_path(node.data)[0]:
                slots.append(_Slot(f"{name}.data{jax.tree_util.keystr(sub)}", leaf, len(sets)))
            sets.append((name or "<root>", node))
        else:
            slots.append(_Slot(path_name(path), node, None))
    return _Layout(slots, sets, top, nodes)


def _rebuild(layout: _Layout, leaves: list[Any], counts: list[int]) -> Any:
    """``layout``'s state with ``leaves`` in its slots and walker set ``k`` of count ``counts[k]``."""
    it = iter(leaves)
    nodes, k = [], 0
    for node in layout.nodes:
        if isinstance(node, WalkerSet):
            like_leaves, data_def = jax.tree_util.tree_flatten(node.data)
            data = jax.tree_util.tree_unflatten(data_def, [next(it) for _ in like_leaves])
            nodes.append(WalkerSet(data, counts[k]))
            k += 1
        else:
            nodes.append(next(it))
    return jax.tree_util.tree_unflatten(layout.top, nodes)


# ---------------------------------------------------------------- save


def _unsupported(where: str, name: str, problem: str, got: str, fix: str) -> CallError:
    return CallError(message(where, f"leaf {name} {problem}", got=got, fix=fix))


def _host_copy(leaf: Any) -> np.ndarray:
    """A copy the caller may change or donate right after the save returns."""
    return np.array(leaf, copy=True)


def _prepare(where: str, state: Any, metadata: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """The JSON header and the arrays for orbax (keyed by leaf index) of ``state``; every check on it."""
    meta = checked_metadata(where, metadata)
    layout = _layout(state)
    multi = jax.process_count() > 1
    sets: list[dict[str, Any]] = []
    for name, node in layout.sets:
        n = walker_count(node.data, where, f"the WalkerSet {name}")
        check_n_valid(where, node.n_valid, n)
        sets.append({"path": name, "n_valid": int(node.n_valid), "n_walkers": n})
    entries, arrays = [], {}
    for i, slot in enumerate(layout.slots):
        name, leaf = slot.name, slot.leaf
        entry: dict[str, Any] = {"path": name, "key_impl": None}
        if isinstance(leaf, (bool, int, float, complex, str)) and not isinstance(leaf, np.generic):
            if slot.walker_set is not None:
                raise _unsupported(
                    where,
                    name,
                    "of a WalkerSet is a Python scalar, which has no walker axis.",
                    got=type(leaf).__name__,
                    fix="keep counters and settings out of the walker data (beside the WalkerSet in the state).",
                )
            kind = type(leaf).__name__
            value: Any = leaf.hex() if isinstance(leaf, float) else leaf
            if isinstance(leaf, complex):
                value = [leaf.real.hex(), leaf.imag.hex()]
            entries.append({**entry, "kind": "python", "type": kind, "value": value, "dtype": None, "shape": []})
            continue
        if not isinstance(leaf, (jax.Array, np.ndarray, np.generic)):
            raise _unsupported(
                where,
                name,
                "is not an array or a number, so it cannot be stored.",
                got=type(leaf).__name__,
                fix="keep arrays, NumPy values and Python numbers or strings in the state; rebuild other objects "
                "(functions, optimiser definitions) from the configuration on restore.",
            )
        dtype = leaf.dtype
        if dtype == np.dtype(object):
            raise _unsupported(where, name, "is an object array.", got="dtype object", fix="store numeric arrays.")
        if isinstance(leaf, jax.Array) and is_key_dtype(dtype):
            entry["key_impl"] = str(jax.random.key_impl(leaf))
            leaf = jax.random.key_data(leaf)
        shape = list(np.shape(leaf))[: np.ndim(leaf) - (1 if entry["key_impl"] else 0)]
        entry.update(dtype=str(dtype), shape=shape)
        if slot.walker_set is not None:
            if not shape:
                raise _unsupported(
                    where,
                    name,
                    "of a WalkerSet is a scalar, which has no walker axis.",
                    got=f"{dtype}[]",
                    fix="keep counters and settings out of the walker data (beside the WalkerSet in the state).",
                )
            entry.update(kind="walker", set=slot.walker_set)
        elif isinstance(leaf, jax.Array):
            if not leaf.sharding.is_fully_replicated:
                raise _unsupported(
                    where,
                    name,
                    "is sharded, but only the leaves of a WalkerSet are stored and restored sharded.",
                    got=f"{dtype}{shape} with sharding {leaf.sharding}",
                    fix="put walker data in a sv.WalkerSet (it carries its count); replicate other arrays "
                    "(sv.replicate).",
                )
            entry["kind"] = "array"
        else:
            entry["kind"] = "numpy"
        if isinstance(leaf, jax.Array):
            # An array on this process's devices only (the same on every process, like host data): orbax stores
            # global arrays, so it travels as host data, written by one process.
            arrays[str(i)] = _host_copy(leaf) if multi and leaf.is_fully_addressable else leaf
        else:
            arrays[str(i)] = _host_copy(leaf)
        entries.append(entry)
    header = {
        "format": _FORMAT,
        "version": _VERSION,
        "leaves": entries,
        "walker_sets": sets,
        "metadata": meta,
        "saved_on": {"devices": jax.device_count(), "processes": jax.process_count()},
    }
    return header, arrays


# ---------------------------------------------------------------- restore


def _broken(where: str, directory: Path, problem: str, got: str | None = None) -> CallError:
    return CallError(
        message(
            where,
            f"the checkpoint {str(directory)!r} {problem}",
            got=got,
            fix="restore another step (Checkpointer.steps() lists them); a checkpoint is only committed once "
            "complete, so this one was damaged or edited afterwards.",
        )
    )


def _check_header(where: str, directory: Path, header: Any) -> None:
    """Every field of a (possibly hand-edited) header, so that no later step meets a surprise."""

    def malformed(what: str) -> CallError:
        return _broken(where, directory, f"has a malformed header: {what}.")

    if not isinstance(header, dict) or header.get("format") != _FORMAT:
        raise _broken(where, directory, "is not a shardvmc state checkpoint (its header is another program's).")
    if header.get("version") != _VERSION or type(header.get("version")) is not int:
        raise _broken(
            where,
            directory,
            f"is format version {header.get('version')!r}, which this shardvmc cannot read.",
            got=f"version {header.get('version')!r}, expected {_VERSION}",
        )
    sets, entries = header.get("walker_sets"), header.get("leaves")
    if not isinstance(header.get("metadata"), dict):
        raise malformed("its metadata is not a dict")
    if not isinstance(sets, list) or not all(
        isinstance(s, dict)
        and isinstance(s.get("path"), str)
        and type(s.get("n_walkers")) is int
        and type(s.get("n_valid")) is int
        and 1 <= s["n_valid"] <= s["n_walkers"]
        for s in sets
    ):
        raise malformed("its walker sets are not a list of {path, n_valid, n_walkers} with 1 <= n_valid <= n_walkers")
    if not isinstance(entries, list) or not all(
        isinstance(e, dict) and isinstance(e.get("path"), str) and e.get("kind") in _KINDS for e in entries
    ):
        raise malformed("its leaves are not a list of {path, kind, ...} entries")
    for e in entries:
        name = e["path"]
        if e["kind"] == "python":
            if e.get("type") not in _PYTHON or not _python_value_ok(e["type"], e.get("value")):
                raise malformed(f"leaf {name} holds {e.get('value')!r} as a {e.get('type')!r}")
            continue
        if not check_shape(e.get("shape")):
            raise malformed(f"leaf {name} has the shape {e.get('shape')!r}, which is not a list of sizes")
        key_impl = e.get("key_impl")
        why = check_key_impl(key_impl) if key_impl is not None else check_dtype(e.get("dtype"))
        if why:
            raise malformed(f"leaf {name}: {why}")
        if e["kind"] == "walker":
            k = e.get("set")
            if type(k) is not int or not 0 <= k < len(sets) or not e["shape"]:
                raise malformed(f"leaf {name} names no walker set, or has no walker axis")
            if e["shape"][0] != sets[k]["n_walkers"]:
                raise _broken(
                    where,
                    directory,
                    f"is inconsistent: leaf {name} holds {e['shape'][0]} walkers, its walker set "
                    f"{sets[k]['path']} {sets[k]['n_walkers']}.",
                )


def _python_value_ok(kind: str, value: Any) -> bool:
    try:
        _python_value(kind, value)
    except (TypeError, ValueError, OverflowError):
        return False
    return True


def _python_value(kind: str, value: Any) -> Any:
    if kind == "float":
        if not isinstance(value, str):
            raise TypeError(value)
        return float.fromhex(value)
    if kind == "complex":
        if not (isinstance(value, list) and len(value) == 2 and all(isinstance(v, str) for v in value)):
            raise TypeError(value)
        return complex(float.fromhex(value[0]), float.fromhex(value[1]))
    if type(value) is not _PYTHON[kind]:
        raise TypeError(value)
    return value


def _stored_struct(entry: dict[str, Any]) -> tuple[tuple[int, ...], Any]:
    """Shape and dtype of a leaf as orbax holds it (key data for keys)."""
    shape = tuple(entry["shape"])
    if entry["key_impl"]:
        data = jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0, impl=entry["key_impl"])))
        return (*shape, *data.shape), data.dtype
    return shape, jnp.dtype(entry["dtype"])


def _like_dtype(leaf: Any, kind: str) -> Any:
    """The dtype ``like``'s leaf asks for: as JAX would hold it, or as NumPy does for host leaves."""
    if kind == "numpy" and not isinstance(leaf, jax.Array) and not is_key_dtype(getattr(leaf, "dtype", None)):
        return getattr(leaf, "dtype", None) or np.asarray(leaf).dtype
    return jax_dtype(leaf)


def _check_like(where: str, directory: Path, header: dict[str, Any], layout: _Layout) -> None:
    """``like``'s structure, kinds, dtypes and shapes against the header."""
    entries = header["leaves"]
    have = [e["path"] for e in entries]
    want = [s.name for s in layout.slots]
    if have != want:
        raise structure_error(where, directory, have, want, "state")
    saved_sets = [s["path"] for s in header["walker_sets"]]
    like_sets = [name for name, _ in layout.sets]
    if saved_sets != like_sets:
        raise CallError(
            message(
                where,
                f"the walker sets saved in {str(directory)!r} are not where `like` has its WalkerSets.",
                got=f"saved WalkerSets at {saved_sets}",
                expected=f"WalkerSets of `like` at {like_sets}",
                fix="pass a `like` that holds a sv.WalkerSet wherever the saved state held one.",
            )
        )
    for entry, slot in zip(entries, layout.slots):
        name, kind, model = entry["path"], entry["kind"], slot.leaf
        model_shape = tuple(np.shape(model))
        if kind == "python":
            if model_shape != ():
                raise _shape_error(where, directory, name, "a Python scalar", model_shape)
            continue
        dtype = _like_dtype(model, kind)
        if str(dtype) != entry["dtype"]:
            raise dtype_error(where, directory, name, entry["dtype"], dtype)
        saved_shape = tuple(entry["shape"])
        if kind == "walker":
            if not model_shape or model_shape[1:] != saved_shape[1:]:
                raise _shape_error(where, directory, name, f"shape {saved_shape} (walker axis first)", model_shape)
        elif model_shape != saved_shape:
            raise _shape_error(where, directory, name, f"shape {saved_shape}", model_shape)


def _shape_error(where: str, directory: Path, name: str, saved: str, model_shape: tuple[int, ...]) -> CallError:
    return CallError(
        message(
            where,
            f"leaf {name} has another shape in the checkpoint than in `like`.",
            got=f"saved: {saved} in {str(directory)!r}",
            expected=f"`like`'s shape {model_shape}" + (" (walker leaves: any walker count)" if model_shape else ""),
            fix="pass a `like` built like the saved state (the same model sizes and walker shapes).",
        )
    )


@functools.partial(jax.jit, static_argnames=("target", "saved", "sharding"))
def _relayout(x: jax.Array, target: int, saved: int, sharding: NamedSharding) -> jax.Array:
    """Rows ``< target`` become saved walker ``row % saved``, the rest copies of walker 0 (exact: no arithmetic)."""
    rows = jnp.arange(x.shape[0])
    if target <= saved:  # the first rows are in place already: only the padding changes
        keep = (rows < target).reshape(-1, *([1] * (x.ndim - 1)))
        out = jnp.where(keep, x, x[:1])
    else:
        out = x[jnp.where(rows < target, rows % saved, 0)]
    return jax.lax.with_sharding_constraint(out, sharding)


def _check_stored(where: str, directory: Path, header: dict[str, Any]) -> None:
    """The arrays orbax holds against the header, from orbax's metadata alone.

    orbax-checkpoint 0.12.8 raises on the first array read that fails and leaves the others running on an event
    loop it has closed: they report unraisable errors later, in whatever code runs then. A damaged or edited
    checkpoint is caught here, before any read starts.
    """
    ocp = _orbax()
    from etils import epath  # orbax-checkpoint's own path type (installed with it)

    handler = ocp.PyTreeCheckpointHandler()
    try:
        stored = handler.metadata(epath.Path(directory / _ARRAYS)).tree
    except Exception as err:
        raise _broken(where, directory, "has arrays that cannot be read.", got=f"{type(err).__name__}: {err}") from None
    finally:
        handler.close()
    for i, entry in enumerate(header["leaves"]):
        if entry["kind"] == "python":
            continue
        shape, dtype = _stored_struct(entry)
        meta = stored.get(str(i)) if isinstance(stored, dict) else None
        if meta is None:
            raise _broken(where, directory, f"is inconsistent: leaf {entry['path']} has no stored array.")
        if tuple(meta.shape) != shape or np.dtype(meta.dtype) != np.dtype(dtype):
            raise _broken(
                where,
                directory,
                f"is inconsistent: leaf {entry['path']} is stored as another array than its header says.",
                got=f"stored {np.dtype(meta.dtype)}{list(meta.shape)}, header {np.dtype(dtype)}{list(shape)}",
            )


def _restore(
    where: str,
    manager: Any,
    step: int,
    directory: Path,
    like: Any,
    mesh: Mesh | None,
    axis_name: str,
    n_walkers: int | None,
) -> tuple[Any, dict[str, Any]]:
    ocp = _orbax()
    mesh = resolve_mesh(mesh, axis_name, where=where)
    try:
        header = manager.restore(step, args=ocp.args.Composite(**{_HEADER: ocp.args.JsonRestore()}))[_HEADER]
    except Exception as err:
        raise _broken(where, directory, "has no readable header.", got=f"{type(err).__name__}: {err}") from None
    _check_header(where, directory, header)
    layout = _layout(like)
    _check_like(where, directory, header, layout)
    sets = header["walker_sets"]
    targets = [
        restored_count(where, directory, s["n_valid"], node.n_valid, n_walkers)
        for s, (_, node) in zip(sets, layout.sets)
    ]
    n_shards = _compat.axis_size(mesh, axis_name)
    walker_sharding = get_walker_sharding(mesh, axis_name)
    # The padding and cycling below are plain array operations, which Explicit axes would make
    # ask for output shardings: they run on an Auto view of the same devices.
    auto_mesh = Mesh(mesh.devices, mesh.axis_names)
    auto_sharding = get_walker_sharding(auto_mesh, axis_name)
    replicated = get_replicated_sharding(mesh)
    restore_args: dict[str, Any] = {}
    for i, entry in enumerate(header["leaves"]):
        if entry["kind"] == "python":
            continue
        shape, dtype = _stored_struct(entry)
        if entry["kind"] == "walker":
            # orbax reads the rows each device gets (zeros past the saved ones); _relayout then pads or cycles.
            rows = pad_n_walkers(targets[entry["set"]], n_shards)
            restore_args[str(i)] = ocp.ArrayRestoreArgs(
                sharding=auto_sharding, global_shape=(rows, *shape[1:]), dtype=dtype, strict=False
            )
        elif entry["kind"] == "array":
            restore_args[str(i)] = ocp.ArrayRestoreArgs(sharding=replicated, global_shape=shape, dtype=dtype)
        else:
            restore_args[str(i)] = ocp.RestoreArgs(restore_type=np.ndarray)
    arrays: dict[str, Any] = {}
    if restore_args:
        _check_stored(where, directory, header)
        try:
            arrays = manager.restore(
                step, args=ocp.args.Composite(**{_ARRAYS: ocp.args.PyTreeRestore(restore_args=restore_args)})
            )[_ARRAYS]
        except Exception as err:
            got = f"{type(err).__name__}: {err}"
            raise _broken(where, directory, "has arrays that cannot be read.", got=got) from None
    leaves = []
    for i, (entry, slot) in enumerate(zip(header["leaves"], layout.slots)):
        if entry["kind"] == "python":
            leaves.append(_python_value(entry["type"], entry["value"]))
            continue
        value = arrays.get(str(i)) if isinstance(arrays, dict) else None
        shape, dtype = _stored_struct(entry)
        if value is None or np.dtype(value.dtype) != np.dtype(dtype):
            raise _broken(where, directory, f"is inconsistent: leaf {entry['path']} is missing or of another dtype.")
        if entry["kind"] == "walker":
            s = sets[entry["set"]]
            target, saved = targets[entry["set"]], s["n_valid"]
            if value.shape[0] > target or target > saved:  # padding rows to fill, or walkers to repeat
                with jax.set_mesh(auto_mesh):  # (also under a jax.set_mesh context of the Explicit mesh)
                    value = _relayout(value, target, saved, auto_sharding)
            if auto_sharding != walker_sharding:
                value = jax.device_put(value, walker_sharding)
        elif entry["kind"] == "numpy":
            if value.shape != shape:
                raise _broken(where, directory, f"is inconsistent: leaf {entry['path']} has another shape.")
            if isinstance(slot.leaf, np.generic) or (not shape and not isinstance(slot.leaf, np.ndarray)):
                value = value[()]  # a NumPy scalar, as saved
        if entry["key_impl"]:
            value = jax.random.wrap_key_data(value, impl=entry["key_impl"])
        leaves.append(value)
    metadata = dict(header["metadata"])
    changed = {s["path"]: resized(s["n_valid"], t) for s, t in zip(sets, targets) if t != s["n_valid"]}
    if changed:
        metadata[RESIZED] = next(iter(changed.values())) if len(sets) == 1 else changed
    return _rebuild(layout, leaves, targets), metadata


# ---------------------------------------------------------------- the manager


def _check_step(where: str, step: Any) -> int:
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
        raise CallError(
            message(
                where,
                "step must be a non-negative int.",
                got=repr(step),
                fix="pass the training step as a Python int, e.g. int(t).",
            )
        )
    return int(step)


class Checkpointer:
    """Training-state checkpoints in a directory: asynchronous saves, the last ``keep`` steps, elastic restores.

    The manager a training loop wants: ``save(step, state)`` returns once the state
    is on the host and writes it while the run goes on; the next ``save`` (or
    :meth:`wait`) waits for it, so writes never overlap; :meth:`restore` reads the
    latest (or any kept) step onto any mesh. ``state`` is any pytree of
    :class:`~shardvmc.WalkerSet`\\ s, replicated ``jax.Array``\\ s (parameters, optax and
    kfac-jax states), NumPy arrays, Python numbers and typed PRNG keys; see
    :func:`save_state` for what is written where. Each step is one orbax-checkpoint
    step directory ``<directory>/<step>``, committed atomically once every process has
    written its part (a process killed mid-write leaves the previous steps as they
    were).

    In a multi-process run, create it and call :meth:`save` and :meth:`restore` on
    every process (they are collectives), on a directory all processes see. Use it as
    a context manager, or call :meth:`close`, so that the last write finishes before
    the program ends (pending writes are also waited for at a normal interpreter exit).

    Args:
        directory: where the steps live (created if missing).
        keep: how many of the latest steps to keep (``None``: all).
        asynchronous: write in the background (``False``: :meth:`save` returns once
            the step is committed).

    Raises:
        ImportError: when orbax-checkpoint is not installed (``pip install
            'shardvmc[checkpoint]'``).

    Example:
        >>> import tempfile, jax, jax.numpy as jnp, optax, shardvmc as sv
        >>> mesh = sv.create_mesh(jax.devices()[:4])
        >>> params = sv.replicate({"w": jnp.ones(3)}, mesh)
        >>> state = {"walkers": sv.initialize_walkers_sharded(lambda k: jax.random.normal(k, (2, 3)), 6, mesh,
        ...                                                   key=jax.random.key(0)),
        ...          "params": params, "opt": optax.adam(1e-3).init(params), "step": 0}
        >>> with sv.Checkpointer(tempfile.mkdtemp(), keep=2) as ckpt:
        ...     for step in range(3):
        ...         _ = ckpt.save(step, {**state, "step": step}, metadata={"energy": -1.0})
        ...     restored, meta = ckpt.restore(state, mesh=sv.create_mesh(jax.devices()[:3]))
        ...     ckpt.steps()
        [1, 2]
        >>> restored["step"], restored["walkers"].n_valid, restored["walkers"].n_walkers, meta
        (2, 6, 6, {'energy': -1.0})
    """

    def __init__(self, directory: str | os.PathLike[str], *, keep: int | None = 3, asynchronous: bool = True) -> None:
        ocp = _orbax()
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
            raise CallError(
                message(
                    "Checkpointer",
                    "keep must be a positive int (the number of latest steps kept) or None (all).",
                    got=repr(keep),
                    fix="pass keep=3, for example.",
                )
            )
        self.directory = Path(directory).absolute()
        self.keep = keep
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, enable_async_checkpointing=asynchronous, cleanup_tmp_directories=True, create=True
        )
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_names=(_ARRAYS, _HEADER))
        _LIVE.add(self)

    def save(self, step: int, state: Any, *, metadata: dict[str, Any] | None = None) -> bool:
        """Save ``state`` (with JSON ``metadata``) as ``step``; returns once the state is on the host.

        The write goes on in the background; a later :meth:`save`, :meth:`wait` or
        :meth:`close` waits for it (and raises its error, if it failed). The caller may
        change, donate or delete the state's arrays as soon as this returns.

        Args:
            step: the training step, a non-negative int.
            state: the pytree to save (see :class:`Checkpointer`).
            metadata: JSON-serialisable data stored with it (energies, settings).

        Returns:
            ``True``; ``False`` (and nothing written) when ``step`` is already saved,
            e.g. a preemption at a step that was just saved periodically.

        Raises:
            CallError: for a leaf that cannot be stored (a sharded array outside a
                ``WalkerSet``, an object that is not an array or number), a
                ``WalkerSet`` whose count does not fit its data, metadata JSON cannot
                hold, or a bad ``step``.
        """
        return _save(self, "Checkpointer.save", step, state, metadata)

    def restore(
        self,
        like: Any,
        step: int | None = None,
        *,
        mesh: Mesh | None = None,
        axis_name: str = "walkers",
        n_walkers: int | None = None,
    ) -> tuple[Any, dict[str, Any]]:
        """Read ``step`` (default: the latest) onto ``mesh``, in the structure of ``like``.

        See :func:`load_state` for ``like``, ``mesh``, ``axis_name`` and ``n_walkers``.

        Returns:
            ``(state, metadata)``.

        Raises:
            FileNotFoundError: when the directory holds no step (or not ``step``).
            CallError: as :func:`load_state`.
        """
        where = "Checkpointer.restore"
        self.wait()
        steps = self._manager.all_steps()
        if step is None:
            if not steps:
                raise FileNotFoundError(f"{where}: {str(self.directory)!r} holds no checkpoint yet.")
            step = max(steps)
        step = _check_step(where, step)
        if step not in steps:
            held = sorted(steps)
            raise FileNotFoundError(f"{where}: {str(self.directory)!r} holds no step {step} (it holds {held}).")
        return _restore(where, self._manager, step, self.directory / str(step), like, mesh, axis_name, n_walkers)

    def latest_step(self) -> int | None:
        """The latest step saved (or being saved), ``None`` when there is none."""
        return self._manager.latest_step()

    def steps(self) -> list[int]:
        """The steps kept, in increasing order (a step being written included)."""
        return sorted(self._manager.all_steps())

    def wait(self) -> None:
        """Wait until every write of this checkpointer is committed; raise the error of one that failed."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Wait for the writes (as :meth:`wait`) and release the checkpointer."""
        self._manager.close()
        _LIVE.discard(self)

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Checkpointer({str(self.directory)!r}, keep={self.keep})"


def _save(checkpointer: Checkpointer, where: str, step: Any, state: Any, metadata: Any) -> bool:
    ocp = _orbax()
    step = _check_step(where, step)
    header, arrays = _prepare(where, state, metadata)
    manager = checkpointer._manager
    if step in manager.all_steps():
        return False
    items: dict[str, Any] = {_HEADER: ocp.args.JsonSave(header)}
    if arrays:
        items[_ARRAYS] = ocp.args.PyTreeSave(arrays)
    manager.save(step, args=ocp.args.Composite(**items), force=True)
    return True


def wait_for_saves() -> None:
    """Wait until every pending write (of :func:`save_state` and of every :class:`Checkpointer`) is committed.

    Raises the error of a write that failed. Cheap when nothing is pending.

    Example:
        >>> import shardvmc as sv
        >>> sv.wait_for_saves()  # nothing pending
    """
    for checkpointer in list(_LIVE):
        checkpointer.wait()


@atexit.register
def _wait_at_exit() -> None:  # pragma: no cover - runs at interpreter exit
    for checkpointer in list(_LIVE):
        try:
            checkpointer.close()
        except Exception:  # the program is ending: its own error, if any, was reported
            pass


def save_state(path: str | os.PathLike[str], state: Any, *, metadata: dict[str, Any] | None = None) -> Path:
    """Save a whole training state at ``path``, asynchronously; returns once the state is on the host.

    ``state`` is any pytree of:

    * :class:`~shardvmc.WalkerSet`\\ s: every process writes only the rows its devices
      hold (padding rows included; the count is saved), nothing is gathered;
    * replicated ``jax.Array``\\ s (parameters, ``optax`` and ``kfac-jax`` states),
      written once;
    * NumPy arrays and scalars, Python ``bool``/``int``/``float``/``complex``/``str``
      (steps, counters, histories), and typed PRNG keys.

    ``path`` is a directory holding the latest state (an orbax-checkpoint step
    directory inside it); a new save replaces the previous one only once it is
    committed, so a process killed at any moment leaves the previous state loadable.
    The write goes on in the background: the next save to ``path``,
    :func:`wait_for_saves` or :func:`load_state` waits for it, and a normal interpreter
    exit too. For a training loop, :class:`Checkpointer` adds steps and retention.

    In a multi-process run, call it on every process (a collective), on a directory
    all of them see.

    Args:
        path: the directory (created if missing).
        state: the pytree to save.
        metadata: JSON-serialisable data stored with it.

    Returns:
        ``path``.

    Raises:
        CallError: for a leaf that cannot be stored (a sharded array outside a
            ``WalkerSet``, an object that is not an array or a number), a
            ``WalkerSet`` whose ``n_valid`` exceeds its walkers, or metadata JSON
            cannot hold.
        ImportError: when orbax-checkpoint is not installed (``pip install
            'shardvmc[checkpoint]'``).

    Example:
        >>> import tempfile, jax, jax.numpy as jnp, shardvmc as sv
        >>> walkers = sv.WalkerSet(sv.shard_walker(jnp.arange(24.0).reshape(8, 3), sv.create_mesh()), n_valid=6)
        >>> state = {"walkers": walkers, "params": {"w": jnp.ones(2)}, "step": 10, "key": jax.random.key(1)}
        >>> path = sv.save_state(tempfile.mkdtemp(), state, metadata={"energy": -2.9})
        >>> restored, meta = sv.load_state(path, state, mesh=sv.create_mesh(jax.devices()[:3]))
        >>> restored["walkers"].data.shape, restored["walkers"].n_valid, restored["step"], meta
        ((6, 3), 6, 10, {'energy': -2.9})
    """
    where = "save_state"
    directory = Path(path).absolute()
    checkpointer = _ONE_SHOT.get(directory)
    if checkpointer is None or checkpointer not in _LIVE:
        checkpointer = _ONE_SHOT[directory] = Checkpointer(directory, keep=1)
    latest = checkpointer.latest_step()
    _save(checkpointer, where, 0 if latest is None else latest + 1, state, metadata)
    return Path(path)


def _step_directory(path: Path) -> tuple[Path, int | None]:
    """``(directory, step)`` of ``path``: a step directory of a checkpointer, or a directory of steps (latest)."""
    if (path / _HEADER).is_dir() and path.name.isdigit():
        return path.parent, int(path.name)
    return path, None


def load_state(
    path: str | os.PathLike[str],
    like: Any,
    *,
    mesh: Mesh | None = None,
    axis_name: str = "walkers",
    n_walkers: int | None = None,
) -> tuple[Any, dict[str, Any]]:
    """Read a state saved by :func:`save_state` (or a :class:`Checkpointer`) onto ``mesh``.

    The mesh may have any number of devices and processes. Leaves come back by the kind
    they were saved as: walker-set leaves sharded over the walker axis of ``mesh`` and
    padded for it with copies of walker 0 (each process reads only its own devices'
    rows); other ``jax.Array`` leaves replicated on ``mesh``; NumPy and Python values as
    they were; typed keys as keys. Values are exact (float64 included).

    By default every walker set comes back with its saved count. ``n_walkers`` restores
    every walker set of the state onto that count, as :func:`~shardvmc.load_walkers`
    does: fewer keeps the first ones, more repeats the saved walkers in order, and
    ``metadata[sv.RESIZED]`` says so (with several walker sets, a dict of them by
    pytree path).

    Args:
        path: a directory written by :func:`save_state` (or a :class:`Checkpointer`'s
            directory: its latest step; or one of its step directories).
        like: a pytree of the saved state's structure whose leaves give the dtypes and
            shapes: typically the freshly initialised state of the same configuration,
            or its ``jax.eval_shape``. Its ``WalkerSet``\\ s may hold any walker count;
            their ``n_valid`` must be the saved count unless ``n_walkers`` is given.
        mesh: the mesh to restore onto; defaults to the ``use_mesh`` one, else all
            devices.
        axis_name: the walker axis of ``mesh``.
        n_walkers: the number of walkers to restore in each walker set; ``None``: the
            saved counts.

    Returns:
        ``(state, metadata)``: the state in the structure of ``like``, and the metadata
        given at save time (``{}`` if none).

    Raises:
        FileNotFoundError: when ``path`` does not exist.
        CallError: for a checkpoint that is damaged or not a state checkpoint, whose
            structure, kinds, dtypes or shapes differ from ``like`` (naming the leaf),
            a ``WalkerSet`` ``like`` of another count, or a bad ``n_walkers``.
    """
    where = "load_state"
    ocp = _orbax()
    path = Path(path).absolute()
    if not path.exists():
        raise FileNotFoundError(f"{where}: {str(path)!r} does not exist.")
    if not path.is_dir():
        raise CallError(
            message(
                where,
                f"{str(path)!r} is a file, not a state checkpoint (a directory).",
                fix="pass the directory given to sv.save_state or sv.Checkpointer; read walker files (.npz) with "
                "sv.load_walkers.",
            )
        )
    directory, step = _step_directory(path)
    for checkpointer in list(_LIVE):  # a write of this process to this directory finishes first
        if checkpointer.directory == directory:
            checkpointer.wait()
    # (not read_only=True, which logs a warning on every restore; this manager never saves)
    options = ocp.CheckpointManagerOptions(create=False, enable_async_checkpointing=False)
    manager = ocp.CheckpointManager(directory, options=options, item_names=(_ARRAYS, _HEADER))
    try:
        steps = manager.all_steps()
        if step is None:
            if not steps:
                raise CallError(
                    message(
                        where,
                        f"{str(path)!r} holds no shardvmc state checkpoint.",
                        fix="pass a directory written by sv.save_state or sv.Checkpointer (or one of its steps).",
                    )
                )
            step = max(steps)
        return _restore(where, manager, step, directory / str(step), like, mesh, axis_name, n_walkers)
    finally:
        manager.close()
