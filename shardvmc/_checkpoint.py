"""Checkpoints on orbax-checkpoint: training states, and walkers alone as the state that is one ``WalkerSet``.

Leaves are stored by kind: "walker" (the non-scalar leaves of a ``WalkerSet``, each process writing its rows),
"array" (other ``jax.Array`` leaves, replicated, and the scalar leaves of a set; both in the dtype JAX holds),
"numpy" (host data, in its own dtype), "python" (in the header); typed keys as key data and implementation. A
checkpoint is one orbax step directory with two items: ``arrays`` (orbax's PyTree handler) and ``shardvmc`` (the
JSON header: leaf paths, kinds, dtypes, shapes, walker sets' counts, metadata). Every restore goes one way:
:func:`_check_header`, the check against ``like``, the arrays read onto the new mesh, :func:`_relayout` for the
walker sets. Walker files of shardvmc 0.2.0 (``.npz``) enter the same way through :mod:`shardvmc._npz`.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import hashlib
import json
import os
import threading
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer
from jax.sharding import Mesh, NamedSharding

from . import _checksum, _compat, _npz, _orbax_compat
from ._errors import CallError, CheckpointNotFoundError, DamagedCheckpointError, install, message, warn_at_user
from ._mesh import get_replicated_sharding, get_walker_sharding, walker_mesh
from ._placement import pad_n_walkers
from ._walkerset import WalkerSet, check_n_valid, split_walker_set, walker_count

__all__ = [
    "RESIZED",
    "Checkpoint",
    "Checkpointer",
    "DamagedCheckpointWarning",
    "load_state",
    "load_walkers",
    "save_state",
    "save_walkers",
    "wait_for_saves",
]

_ARRAYS, _HEADER = "arrays", "shardvmc"  # the orbax items: every stored array (keyed by leaf index); the header
_STEP_FILES = (_ARRAYS, _HEADER, "_CHECKPOINT_METADATA", "commit_success.txt")  # any of them: a step directory
_KINDS = ("walker", "array", "numpy", "python")
INSTALL = install("checkpoint")
"""How to install what checkpoints need (orbax-checkpoint)."""
RESIZED = "shardvmc.resized"
"""Metadata key a restore adds when it restored another number of walkers than saved."""
_VERSION = 2  # 1: shardvmc 0.3 (no checksums) and 0.2.0's files; 2: checksums of the header and of every array


class DamagedCheckpointWarning(UserWarning):
    """A restore of a directory's newest step skipped damaged steps, and restored an older, intact one.

    The message names the steps skipped and why. A run that resumes from a checkpoint
    directory recomputes the steps after the one restored, so it loses time, not data.
    """


_LIVE: weakref.WeakSet[Checkpointer] = weakref.WeakSet()  # whose writes wait_for_saves() and exit wait for
_PENDING: dict[Path, tuple[threading.Thread, list[BaseException]]] = {}  # save_state's writes, by directory


def _orbax() -> Any:
    try:
        import orbax.checkpoint as ocp
    except ImportError as err:
        raise ImportError(
            "shardvmc's checkpoints (sv.save_state, sv.load_state, sv.Checkpointer, sv.save_walkers, "
            f"sv.load_walkers) store their data with orbax-checkpoint, which is not installed: {INSTALL} "
            "(walker files written by shardvmc 0.2.0 load without it)"
        ) from err
    return ocp


def _manager(directory: Path, keep: int | None = 1, asynchronous: bool = False, write: bool = True) -> Any:
    """An orbax manager of ``directory`` (``write=False``: one that only reads, and creates nothing)."""
    ocp = _orbax()
    # lightweight_initialize: the manager lists the committed steps without reading their orbax metadata files
    # (commit times, metrics), so one step's malformed _CHECKPOINT_METADATA cannot stop the directory opening;
    # a step's own files are checked when that step is restored.
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep,
        enable_async_checkpointing=asynchronous,
        cleanup_tmp_directories=write,
        create=write,
        lightweight_initialize=True,
    )
    return _orbax_compat.manager_class()(directory, options=options, item_names=(_ARRAYS, _HEADER))


def _error(where: str, problem: str, fix: str, got: str | None = None, expected: str | None = None) -> CallError:
    return CallError(message(where, problem, got=got, expected=expected, fix=fix))


class Checkpoint(NamedTuple):
    """What :func:`load_walkers` returns; unpack it as ``walkers, n_valid, metadata``.

    Attributes:
        walkers: a :class:`~shardvmc.WalkerSet` shaped like ``like``, sharded and padded for the mesh.
        n_valid: the number of real walkers, the first ones (``walkers.n_valid``).
        metadata: the metadata given at save time (``{}`` if none); ``metadata[sv.RESIZED]`` after a resize.
    """

    walkers: WalkerSet
    n_valid: int
    metadata: dict[str, Any]


def is_key_dtype(dtype: Any) -> bool:
    """Whether ``dtype`` is a typed PRNG key dtype."""
    return dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key)


def jax_dtype(leaf: Any) -> Any:
    """The dtype ``leaf`` has (or would have) as a JAX array under the current x64 setting."""
    dtype = getattr(leaf, "dtype", None)
    return dtype if is_key_dtype(dtype) else jnp.result_type(leaf)


def resized(saved: int, restored: int) -> dict[str, Any]:
    """What ``metadata[sv.RESIZED]`` says after restoring ``restored`` walkers of ``saved``."""
    duplicated, dropped = max(0, restored - saved), max(0, saved - restored)
    return dict(saved=saved, restored=restored, duplicated=duplicated, dropped=dropped, needs_burn_in=restored > saved)


def _stored_struct(entry: dict[str, Any]) -> tuple[tuple[int, ...], Any]:
    """Shape and dtype of a leaf as stored (key data for keys)."""
    shape = tuple(entry["shape"])
    if entry["key_impl"]:
        data = jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0, impl=entry["key_impl"])))
        return (*shape, *data.shape), data.dtype
    return shape, jnp.dtype(entry["dtype"])


class _Layout(NamedTuple):
    """A state taken apart: its leaves ``(name, leaf, walker set index or None)``, its walker sets, the rest."""

    slots: list[tuple[str, Any, int | None]]
    sets: list[tuple[str, WalkerSet]]
    top: Any  # treedef with WalkerSets as leaves
    nodes: list[Any]  # the top-level leaves: WalkerSets or plain leaves


def _layout(tree: Any) -> _Layout:
    top_leaves, top = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, WalkerSet))
    slots: list[tuple[str, Any, int | None]] = []
    sets: list[tuple[str, WalkerSet]] = []
    for path, node in top_leaves:
        name = jax.tree_util.keystr(path)
        if isinstance(node, WalkerSet):  # (a set at the root, as save_walkers saves: its leaves by their own paths)
            for sub, leaf in jax.tree_util.tree_flatten_with_path(node.data)[0]:
                slots.append((f"{name}.data" * bool(name) + jax.tree_util.keystr(sub) or "<root>", leaf, len(sets)))
            sets.append((name or "<root>", node))
        else:
            slots.append((name or "<root>", node, None))
    return _Layout(slots, sets, top, [node for _, node in top_leaves])


def _rebuild(layout: _Layout, leaves: list[Any], counts: list[int]) -> Any:
    """``layout``'s state with ``leaves`` in its slots and walker set ``k`` of count ``counts[k]``."""
    it, nodes, k = iter(leaves), [], 0
    for node in layout.nodes:
        if isinstance(node, WalkerSet):
            like_leaves, data_def = jax.tree_util.tree_flatten(node.data)
            nodes.append(WalkerSet(jax.tree_util.tree_unflatten(data_def, [next(it) for _ in like_leaves]), counts[k]))
            k += 1
        else:
            nodes.append(next(it))
    return jax.tree_util.tree_unflatten(layout.top, nodes)


def _prepare(where: str, state: Any, metadata: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """The JSON header and the arrays for orbax (keyed by leaf index) of ``state``; every check on it."""
    if metadata is not None and not isinstance(metadata, Mapping):
        raise _error(where, "metadata must be a dict.", "pass metadata={...}.", type(metadata).__name__)
    try:
        meta = json.loads(json.dumps(dict(metadata or {})))
    except (TypeError, ValueError) as err:
        fix = "store numbers, strings, lists and dicts only (e.g. float(energy) instead of a jax.Array)."
        raise _error(where, "metadata cannot be stored as JSON.", fix, str(err)) from None
    layout = _layout(state)
    sets: list[dict[str, Any]] = []
    for name, node in layout.sets:
        n = walker_count(node.data, where, "tree" if name == "<root>" else f"the WalkerSet {name}")
        check_n_valid(where, node.n_valid, n)
        sets.append({"path": name, "n_valid": int(node.n_valid), "n_walkers": n})
    entries, arrays = [], {}
    for i, (name, leaf, k) in enumerate(layout.slots):
        entry: dict[str, Any] = {"path": name, "key_impl": None}
        python = isinstance(leaf, (bool, int, float, complex, str)) and not isinstance(leaf, np.generic)
        if python and k is None:
            value = [leaf.real.hex(), leaf.imag.hex()] if isinstance(leaf, complex) else leaf
            value = leaf.hex() if isinstance(leaf, float) else value
            entries.append({**entry, "kind": "python", "type": type(leaf).__name__, "value": value, "shape": []})
            continue
        dtype = getattr(leaf, "dtype", None)
        if not (python or isinstance(leaf, (jax.Array, np.ndarray, np.generic))) or dtype == np.dtype(object):
            raise _error(
                where,
                f"leaf {name} is not an array or a number, so it cannot be stored.",
                "keep arrays, NumPy values and Python numbers or strings in the state; rebuild other objects "
                "(functions, optimiser definitions) from the configuration on restore.",
                "an object array" if dtype is not None else type(leaf).__name__,
            )
        jax_held = isinstance(leaf, jax.Array) or k is not None  # restored as a jax.Array
        dtype = jax_dtype(leaf) if jax_held else np.asarray(leaf).dtype
        if is_key_dtype(dtype):
            leaf = cast(jax.Array, leaf)
            entry["key_impl"], leaf = str(jax.random.key_impl(leaf)), jax.random.key_data(leaf)
        shape = list(np.shape(leaf))[: np.ndim(leaf) - (1 if entry["key_impl"] else 0)]
        entry.update(dtype=str(dtype), shape=shape, kind="array" if jax_held else "numpy")
        if k is not None and shape:
            entry.update(kind="walker", set=k)
        elif isinstance(leaf, jax.Array) and not leaf.sharding.is_fully_replicated:
            raise _error(
                where,
                f"leaf {name} is sharded, but only the leaves of a WalkerSet are stored and restored sharded.",
                "put walker data in a sv.WalkerSet (it carries its count); replicate other arrays (sv.replicate).",
                f"{dtype}{shape} with sharding {leaf.sharding}",
            )
        elif not jax_held:
            entry["scalar"] = isinstance(leaf, np.generic)
        if isinstance(leaf, jax.Array) and (jax.process_count() == 1 or not leaf.is_fully_addressable):
            arrays[str(i)] = leaf  # orbax copies it to the host before the save returns
        else:  # a copy the caller may change at once; an array on this process's devices only travels as host data
            arrays[str(i)] = np.array(leaf, dtype=None if entry["key_impl"] else dtype, copy=True)
        entries.append(entry)
    for key in list(arrays):  # each array's checksums, computed where it lives and stored as it is
        arrays[_CHECKSUM + key] = _checksum_of(arrays[key], entries[int(key)]["kind"])
    saved_on = {"devices": jax.device_count(), "processes": jax.process_count()}
    header = dict(format=_npz.FORMAT, version=_VERSION, leaves=entries, walker_sets=sets, metadata=meta)
    header["saved_on"] = saved_on
    header["digest"] = _digest(header)
    return header, arrays


_CHECKSUM = "checksum"  # the checksums of stored array "<i>" are stored array "checksum<i>"


def _checksum_of(value: Any, kind: str) -> Any:
    """The checksums of a stored array: a row's each of a walker leaf's, else one; host data stays host data."""
    if kind == "numpy":
        return _checksum.host_checksum(value)
    device = value if isinstance(value, jax.Array) else jnp.asarray(value)  # (a JAX dtype: _prepare converted it)
    if kind != "walker":  # computed on one device holding a copy: stored as host data, written once
        return np.asarray(_checksum.checksum(device))
    sums = _checksum.row_checksums(device)  # sharded as the rows: each process writes its rows' checksums
    return sums if isinstance(value, jax.Array) else np.asarray(sums)


def _digest(header: dict[str, Any]) -> str:
    """The checksum of a header (SHA-256 of its canonical JSON, its own ``digest`` left out)."""
    text = json.dumps({k: v for k, v in header.items() if k != "digest"}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def _stored_struct_of(header: dict[str, Any], key: str) -> tuple[tuple[int, ...], Any]:
    """Shape and dtype of stored array ``key`` (a leaf's, or its checksums') as the header describes it."""
    if key.startswith(_CHECKSUM):
        entry = header["leaves"][int(key[len(_CHECKSUM) :])]
        return ((entry["shape"][0], 2) if entry["kind"] == "walker" else (2,)), np.dtype(np.uint32)
    return _stored_struct(header["leaves"][int(key)])


def _verify(header: dict[str, Any], arrays: dict[str, Any], broken: Callable[..., CallError]) -> None:
    """Every array read against its stored checksums (one transfer of one flag per leaf); damage raises."""
    checked = []
    for i, entry in enumerate(header["leaves"]):
        if str(i) in arrays:  # (Python values are the header's: its digest checks them)
            rows = entry["shape"][0] if entry["kind"] == "walker" else None
            checked.append((entry["path"], _checksum.differs(arrays[str(i)], arrays[_CHECKSUM + str(i)], rows)))
    flags = jax.device_get([flag for _, flag in checked])
    damaged = [name for (name, _), flag in zip(checked, flags) if flag]
    if damaged:
        raise broken(
            f"has array data that does not match its checksums, in leaf {', '.join(damaged)}.",
            "the data was changed after it was written (a disk or file-system fault, or a hand edit)",
        )


def _check_step(where: str, step: Any) -> int:
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
        raise _error(where, "step must be a non-negative int.", "pass the step as an int, e.g. int(t).", repr(step))
    return int(step)


def _write(manager: Any, step: int, header: dict[str, Any], arrays: dict[str, Any]) -> None:
    ocp = _orbax()
    items: dict[str, Any] = {_HEADER: ocp.args.JsonSave(header)}
    if arrays:
        items[_ARRAYS] = ocp.args.PyTreeSave(arrays)
    manager.save(step, args=ocp.args.Composite(**items), force=True)


def _settle(directory: Path | None = None) -> None:
    """Wait for this process's writes (to ``directory``, or all of them); raise the error of one that failed."""
    errors = []
    for target, (write, _) in list(_PENDING.items()):
        if directory in (None, target):
            write.join()
            errors += _PENDING.pop(target, (None, []))[1]
    for checkpointer in list(_LIVE):
        if directory in (None, checkpointer.directory):
            checkpointer.wait()
    if errors:
        raise errors[0]


def _directory_to_write(where: str, path: Path) -> Path:
    """``path`` made absolute, created if missing; a ``CallError`` for what cannot hold checkpoints.

    Checked before orbax sees it: orbax would otherwise fail in a background thread (a file
    where the directory should be) or with a bare ``OSError``.
    """
    directory = path.absolute()
    if directory.is_file():
        problem = f"{str(path)!r} is a file (a walker file of shardvmc 0.2.0?), not a checkpoint directory."
        raise _error(where, problem, "save to another path; sv.load_walkers still reads this file.")
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        problem, got = f"the checkpoint directory {str(path)!r} cannot be created.", f"{type(err).__name__}: {err}"
        raise _error(where, problem, "pass a directory this process can write.", got) from None
    return directory


def _save_once(where: str, path: str | os.PathLike[str], state: Any, metadata: Any, asynchronous: bool) -> Path:
    """Save ``state`` as the one step kept at ``path``, with a manager that ends with the write."""
    header, arrays = _prepare(where, state, metadata)
    directory = _directory_to_write(where, Path(path))
    _settle(directory)
    manager = _manager(directory, keep=1, asynchronous=asynchronous)
    try:
        latest = manager.latest_step()
        _write(manager, 0 if latest is None else latest + 1, header, arrays)
    finally:
        if asynchronous:  # a thread waits for the commit, closes the manager, and ends (a normal exit waits for it)
            error: list[BaseException] = []
            _PENDING[directory] = (threading.Thread(target=_close, args=(manager, error)), error)
            _PENDING[directory][0].start()
        else:
            manager.close()
    return Path(path)


def _close(manager: Any, error: list[BaseException]) -> None:
    try:
        manager.close()
    except BaseException as err:  # raised by the next wait_for_saves (or load_state, save_state of the path)
        error.append(err)


def wait_for_saves() -> None:
    """Wait until every pending write (of :func:`save_state` and of every :class:`Checkpointer`) is committed.

    Raises the error of a write that failed. Cheap when nothing is pending.

    Example:
        >>> import shardvmc as sv
        >>> sv.wait_for_saves()  # nothing pending
    """
    _settle()


@atexit.register
def _wait_at_exit() -> None:  # pragma: no cover - runs at interpreter exit
    for checkpointer in list(_LIVE):
        with contextlib.suppress(Exception):  # the program is ending: its own error, if any, was reported
            checkpointer.close()


def _check_header(header: Any, broken: Callable[..., CallError]) -> None:
    """Every field of a (possibly hand-edited) header, so that no later step meets a surprise."""

    def malformed(what: str) -> CallError:
        return broken(f"has a malformed header: {what}.")

    if not isinstance(header, dict) or header.get("format") != _npz.FORMAT:
        raise broken("is not a shardvmc state checkpoint (its header is another program's).")
    if header.get("version") not in (1, _VERSION) or type(header.get("version")) is not int:
        raise broken(f"is format version {header.get('version')!r}, which this shardvmc cannot read.")
    sets, entries = header.get("walker_sets"), header.get("leaves")
    if not isinstance(header.get("metadata"), dict):
        raise malformed("its metadata is not a dict")
    if not isinstance(sets, list) or not all(
        isinstance(s, dict)
        and isinstance(s.get("path"), str)
        and type(s.get("n_walkers")) is type(s.get("n_valid")) is int
        and 1 <= s["n_valid"] <= s["n_walkers"]
        for s in sets
    ):
        raise malformed("its walker sets are not a list of {path, n_valid, n_walkers} with 1 <= n_valid <= n_walkers")
    if not isinstance(entries, list) or not all(
        isinstance(e, dict) and isinstance(e.get("path"), str) and e.get("kind") in _KINDS for e in entries
    ):
        raise malformed("its leaves are not a list of {path, kind, ...} entries")
    for e in entries:
        name, shape, impl = e["path"], e.get("shape"), e.get("key_impl")
        if e["kind"] == "python":
            if _python_value(e.get("type"), e.get("value")) is _BAD:
                raise malformed(f"leaf {name} holds {e.get('value')!r} as a {e.get('type')!r}")
            continue
        if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
            raise malformed(f"leaf {name} has the shape {shape!r}, which is not a list of sizes")
        try:
            jax.eval_shape(lambda: jax.random.key(0, impl=impl)) if impl is not None else jnp.dtype(e.get("dtype"))
        except (ValueError, TypeError, KeyError):
            what = f"{impl!r} is not a PRNG key implementation" if impl else f"dtype {e.get('dtype')!r} is not a dtype"
            raise malformed(f"leaf {name}: {what} of this JAX") from None
        if e["kind"] == "walker":
            k = e.get("set")
            if type(k) is not int or not 0 <= k < len(sets) or not shape:
                raise malformed(f"leaf {name} names no walker set, or has no walker axis")
            if shape[0] != sets[k]["n_walkers"]:
                walkers = f"{sets[k]['path']} {sets[k]['n_walkers']}"
                raise broken(f"is inconsistent: leaf {name} holds {shape[0]} walkers, its walker set {walkers}.")
    if header["version"] >= 2 and header.get("digest") != _digest(header):  # last: a field's own error comes first
        raise broken("has a header that does not match its checksum: it was changed after it was written.")


_BAD = object()


def _python_value(kind: Any, value: Any) -> Any:
    """The Python value a header holds as ``value`` of type ``kind`` (``_BAD``: none)."""
    try:
        if kind == "float":
            return float.fromhex(value)
        if kind == "complex" and isinstance(value, list) and len(value) == 2:
            return complex(float.fromhex(value[0]), float.fromhex(value[1]))
        return value if kind in ("bool", "int", "str") and type(value).__name__ == kind else _BAD
    except (TypeError, ValueError, OverflowError):
        return _BAD


def _check_like(where: str, path: Path, header: dict[str, Any], layout: _Layout) -> None:
    """``like``'s structure, dtypes and shapes against the (checked) header, naming what differs."""
    # (the walker sets too: a WalkerSet where the saved state had another node is another structure)
    have = [e["path"] for e in header["leaves"]] + [f"WalkerSet {s['path']}" for s in header["walker_sets"]]
    want = [name for name, _, _ in layout.slots] + [f"WalkerSet {name}" for name, _ in layout.sets]
    if have != want:
        missing, extra = [p for p in have if p not in want], [p for p in want if p not in have]
        raise _error(
            where,
            f"the pytree saved in {str(path)!r} has another structure than `like`.",
            "pass a `like` with the saved structure (same dict keys, tuple lengths and dataclass fields, in order).",
            f"saved leaves {have}",
            f"leaves of `like` {want}"
            + (f"; only in the file: {missing}" if missing else "")
            + (f"; only in `like`: {extra}" if extra else ""),
        )
    for entry, (name, model, _) in zip(header["leaves"], layout.slots):
        kind, model_shape, saved_shape = entry["kind"], tuple(np.shape(model)), tuple(entry["shape"])
        if kind != "python":
            _check_like_dtype(where, path, entry, model)
        if kind == "walker" and (not model_shape or model_shape[1:] != saved_shape[1:]):
            rows = header["walker_sets"][entry["set"]]["n_valid"]
            saved = f"shape {(rows, *saved_shape[1:])} (walker axis first)"
            expected = f"(n_walkers, {', '.join(map(str, model_shape[1:]))}) from `like` shape {model_shape}"
        elif kind != "walker" and model_shape != saved_shape:
            saved, expected = "a Python scalar" if kind == "python" else f"shape {saved_shape}", f"shape {model_shape}"
        else:
            continue
        raise _error(
            where,
            f"leaf {name} has another shape in the checkpoint than in `like`.",
            "pass a `like` whose leaves have the saved shapes (walker leaves: any walker count).",
            f"saved: {saved} in {str(path)!r}",
            expected if model_shape else "a scalar, as in `like`",
        )


def _check_like_dtype(where: str, path: Path, entry: dict[str, Any], model: Any) -> None:
    """The dtype of ``like``'s leaf against the saved one.

    JAX-held leaves compare as JAX holds ``like`` now. A NumPy leaf keeps its dtype: a
    NumPy ``like`` compares exactly, an abstract one (``jax.eval_shape`` made it) as JAX
    would hold the saved dtype.
    """
    abstract = isinstance(model, (jax.Array, jax.ShapeDtypeStruct))
    host = entry["kind"] == "numpy" and not abstract and not is_key_dtype(getattr(model, "dtype", None))
    saved, dtype = entry["dtype"], np.asarray(model).dtype if host else jax_dtype(model)
    as_jax = saved if entry["key_impl"] else str(jax.dtypes.canonicalize_dtype(jnp.dtype(saved)))
    if str(dtype) == saved or (entry["kind"] == "numpy" and abstract and str(dtype) == as_jax):
        return
    if entry["kind"] != "numpy" and as_jax == str(dtype) != saved:  # what JAX holds differs only by the x64 setting
        fix = "it was saved with jax_enable_x64 on: turn it on before loading (jax.config.update('jax_enable_x64', 1))."
    else:
        fix = "pass a `like` with the saved dtype (built as the saved pytree was built), then convert after loading."
    problem = f"leaf {entry['path']} was saved as {saved}, but `like` has {dtype}."
    raise _error(where, problem, fix, f"saved dtype {saved} in {str(path)!r}", f"{dtype} (from `like`)")


def restored_count(where: str, path: Path, saved: int, expected: int | None, n_walkers: Any) -> int:
    """The number of walkers to restore of ``saved``: ``n_walkers``, else the saved count (that of a ``like``)."""
    if n_walkers is not None and (
        isinstance(n_walkers, bool) or not isinstance(n_walkers, (int, np.integer)) or n_walkers < 1
    ):
        fix = f"pass n_walkers=None for the saved {saved}, or a count such as {saved}."
        raise _error(where, "n_walkers must be a positive int, the number of walkers to restore.", fix, repr(n_walkers))
    if n_walkers is None and expected is not None and expected != saved:
        raise _error(
            where,
            f"{str(path)!r} holds {saved} walkers, but the WalkerSet `like` expects {expected}.",
            f"pass n_walkers={expected} to restore {expected} walkers from the {saved} saved "
            "(duplicates need burn-in), or a `like` of the saved count.",
            f"{saved} saved walkers",
            f"{expected} (like.n_valid)",
        )
    return saved if n_walkers is None else int(n_walkers)


@functools.partial(jax.jit, static_argnames=("target", "saved", "sharding"))
def _relayout(x: jax.Array, target: int, saved: int, sharding: NamedSharding) -> jax.Array:
    """The one resize rule: row ``r < target`` is saved walker ``r % saved``, the rest copies of walker 0."""
    rows = jnp.arange(x.shape[0])
    if target <= saved:  # the first rows are in place already: only the padding changes
        out = jnp.where((rows < target).reshape(-1, *([1] * (x.ndim - 1))), x, x[:1])
    else:
        out = x[jnp.where(rows < target, rows % saved, 0)]
    return jax.lax.with_sharding_constraint(out, sharding)


def _restore(
    where: str, path: Path, source: tuple[Any, Callable, Callable], like: Any, mesh: Any, axis_name: str, n_walkers: Any
) -> tuple[Any, dict[str, Any]]:
    """The state of ``source``, ``(header, read, broken)``, onto ``mesh``, in the structure of ``like``.

    ``read({leaf: (sharding, shape, dtype)})`` reads the arrays, checked against the header: walker leaves
    with the rows ``shape`` asks for (zeros past the saved rows), others as stored (``sharding`` ``None``: NumPy).
    ``broken(problem, got)`` is the error of a damaged checkpoint.
    """
    header, read, broken = source
    mesh, axes = walker_mesh(mesh, axis_name, where=where)  # the kernels' rule (_mesh.walker_mesh)
    _check_header(header, broken)
    layout = _layout(like)
    _check_like(where, path, header, layout)
    sets = header["walker_sets"]
    targets = [
        restored_count(where, path, s["n_valid"], node.n_valid or None, n_walkers)
        for s, (_, node) in zip(sets, layout.sets)
    ]
    n_shards = _compat.axis_size(mesh, axes)
    # The padding and cycling are plain array operations, which Explicit axes would make ask for output
    # shardings: they run on an Auto view of the same devices.
    auto_mesh = Mesh(mesh.devices, mesh.axis_names)
    auto, walker_sharding = get_walker_sharding(auto_mesh, axes), get_walker_sharding(mesh, axes)
    specs: dict[str, Any] = {}
    for i, entry in enumerate(header["leaves"]):
        shape, dtype = _stored_struct(entry) if entry["kind"] != "python" else ((), None)
        if entry["kind"] == "walker":
            specs[str(i)] = (auto, (pad_n_walkers(targets[entry["set"]], n_shards), *shape[1:]), dtype)
        elif entry["kind"] != "python":
            specs[str(i)] = (get_replicated_sharding(mesh) if entry["kind"] == "array" else None, shape, dtype)
    if header["version"] >= 2:  # each array's checksums, read as the array is (a walker leaf's: the same rows)
        for key, (sharding, shape, _) in list(specs.items()):
            rows = shape[:1] if header["leaves"][int(key)]["kind"] == "walker" else ()
            specs[_CHECKSUM + key] = (sharding, (*rows, 2), np.dtype(np.uint32))
    arrays = read(specs) if specs else {}
    if header["version"] >= 2:
        _verify(header, arrays, broken)
    leaves = []
    for i, entry in enumerate(header["leaves"]):
        if entry["kind"] == "python":
            leaves.append(_python_value(entry["type"], entry["value"]))
            continue
        value = arrays[str(i)]
        if entry["kind"] == "walker":
            target, saved = targets[entry["set"]], sets[entry["set"]]["n_valid"]
            if value.shape[0] > target or target > saved:  # padding rows to fill, or walkers to repeat
                with jax.set_mesh(auto_mesh):  # (also under a jax.set_mesh context of the Explicit mesh)
                    value = _relayout(value, target, saved, auto)
            if auto != walker_sharding:
                value = jax.device_put(value, walker_sharding)
        elif entry.get("scalar"):
            value = value[()]  # a NumPy scalar, as saved
        leaves.append(jax.random.wrap_key_data(value, impl=entry["key_impl"]) if entry["key_impl"] else value)
    metadata = dict(header["metadata"])
    changed = {s["path"]: resized(s["n_valid"], t) for s, t in zip(sets, targets) if t != s["n_valid"]}
    if changed:
        metadata[RESIZED] = next(iter(changed.values())) if len(sets) == 1 else changed
    return _rebuild(layout, leaves, targets), metadata


def _restore_step(
    where: str, manager: Any, step: int, like: Any, mesh: Mesh | None, axis_name: str, n_walkers: int | None
) -> tuple[Any, dict[str, Any]]:
    """Step ``step`` of ``manager``'s directory, read by orbax."""
    ocp = _orbax()
    directory = Path(manager.directory) / str(step)

    def broken(problem: str, got: str | None = None) -> CallError:
        fix = "restore another step (Checkpointer.steps() lists them); a checkpoint is only committed once complete"
        problem = f"the checkpoint {str(directory)!r} (step {step}) {problem}"
        return DamagedCheckpointError(message(where, problem, got=got, fix=fix + ", so this one was damaged."))

    try:
        header = manager.restore(step, args=ocp.args.Composite(**{_HEADER: ocp.args.JsonRestore()}))[_HEADER]
    except Exception as err:
        raise broken("has no readable header.", f"{type(err).__name__}: {err}") from None

    def read(specs: dict[str, Any]) -> dict[str, Any]:
        # What can be checked before orbax reads concurrently is checked first: the storage index, sequentially,
        # then the stored arrays' shapes and dtypes; a read that still fails is kept quiet (_orbax_compat).
        from etils import epath  # orbax-checkpoint's own path type (installed with it)

        handler = ocp.PyTreeCheckpointHandler()
        try:
            _orbax_compat.check_index(directory / _ARRAYS)
            with _orbax_compat.quiet_failed_reads(directory):
                stored = dict(handler.metadata(epath.Path(directory / _ARRAYS)).tree)
        except Exception as err:
            raise broken("has arrays that cannot be read.", f"{type(err).__name__}: {err}") from None
        finally:
            handler.close()
        for key in specs:
            (shape, dtype), meta = _stored_struct_of(header, key), stored.get(key)
            try:
                stored_as = meta and (tuple(meta.shape), np.dtype(meta.dtype))
            except (AttributeError, TypeError):  # orbax's metadata of a value it would not read (skip_deserialize)
                stored_as = None
            if stored_as != (shape, np.dtype(dtype)):
                got = stored_as and f"stored {stored_as[1]}{list(stored_as[0])}, header {np.dtype(dtype)}{list(shape)}"
                name = header["leaves"][int(key.removeprefix(_CHECKSUM))]["path"]
                what = "the checksums of leaf" if key.startswith(_CHECKSUM) else "leaf"
                raise broken(f"is inconsistent: {what} {name} is stored as another array than its header says.", got)
        restore_args = {
            key: ocp.RestoreArgs(restore_type=np.ndarray)
            if sharding is None
            else ocp.ArrayRestoreArgs(sharding=sharding, global_shape=shape, dtype=dtype, strict=False)
            for key, (sharding, shape, dtype) in specs.items()
        }
        try:
            args = ocp.args.Composite(**{_ARRAYS: ocp.args.PyTreeRestore(restore_args=restore_args)})
            with _orbax_compat.quiet_failed_reads(directory):
                return manager.restore(step, args=args)[_ARRAYS]
        except Exception as err:
            raise broken("has arrays that cannot be read.", f"{type(err).__name__}: {err}") from None

    return _restore(where, directory, (header, read, broken), like, mesh, axis_name, n_walkers)


def _load(
    where: str, path: Path, like: Any, mesh: Mesh | None, axis_name: str, n_walkers: int | None
) -> tuple[Any, dict[str, Any]]:
    """The latest step of a directory of steps, or the step directory ``path``."""
    if not path.exists():
        raise CheckpointNotFoundError(f"{where}: {str(path)!r} does not exist.")
    directory, step = path.absolute(), None
    if directory.name.isdigit() and any((directory / name).exists() for name in _STEP_FILES):
        directory, step = directory.parent, int(directory.name)
    _settle(directory)  # a write of this process to this directory finishes first
    manager = _manager(directory, keep=None, write=False)
    try:
        return _restore_kept(where, manager, step, like, mesh, axis_name, n_walkers)
    finally:
        manager.close()


def _agreed(ok: bool) -> bool:
    """Whether ``ok`` on every process: a restore counts only where every process read its part intact."""
    if jax.process_count() == 1:
        return ok
    from jax.experimental import multihost_utils

    return bool(np.all(multihost_utils.process_allgather(np.int32(ok))))


def _restore_kept(
    where: str,
    manager: Any,
    step: int | None,
    like: Any,
    mesh: Mesh | None,
    axis_name: str,
    n_walkers: int | None,
    damaged: set[int] | None = None,
) -> tuple[Any, dict[str, Any]]:
    """Step ``step`` of ``manager``'s directory, or (``None``) its newest intact step, skipping damaged ones.

    The steps skipped are added to ``damaged``.

    Only a damaged step is skipped: an error of the call (``like``, ``n_walkers``, the mesh) is raised at once.
    With several processes, a step counts as damaged when any process found its part damaged.
    """
    directory = Path(manager.directory)
    steps = sorted(manager.all_steps())
    if step is not None and step not in steps:
        written = (directory / str(step)).exists()
        if written:  # a step directory that orbax does not count: its save was never committed
            problem = f"the checkpoint {str(directory / str(step))!r} (step {step}) was never committed."
            fix = "its save was interrupted; restore another step (it holds {steps})."
            raise DamagedCheckpointError(message(where, problem, fix=fix.format(steps=steps)))
        raise CheckpointNotFoundError(f"{where}: {str(directory)!r} holds no step {step} (it holds {steps}).")
    if not steps:
        raise CheckpointNotFoundError(
            f"{where}: {str(directory)!r} holds no committed checkpoint (it is empty, or no save was completed)."
        )
    skipped: list[tuple[int, CallError]] = []
    for candidate in [step] if step is not None else steps[::-1]:
        restored: tuple[Any, dict[str, Any]] | None = None
        error: DamagedCheckpointError | None = None
        try:
            restored = _restore_step(where, manager, candidate, like, mesh, axis_name, n_walkers)
        except DamagedCheckpointError as err:
            error = err
        if _agreed(error is None) and restored is not None:
            if skipped:
                _warn_skipped(where, directory, skipped, candidate)
                if damaged is not None:
                    damaged.update(s for s, _ in skipped)
            return restored
        if error is None:
            problem = f"the checkpoint {str(directory / str(candidate))!r} is damaged in the part another process read."
            error = DamagedCheckpointError(message(where, problem))
        if step is not None or len(steps) == 1:  # the step asked for, or the only one: its own error
            raise error
        skipped.append((candidate, error))
    raise DamagedCheckpointError(
        message(
            where,
            f"every step of {str(directory)!r} is damaged ({', '.join(str(s) for s, _ in skipped)}).",
            got="\n".join(f"step {s}: {err}" for s, err in skipped),
            fix="restore from another copy of the run, or start afresh in a new directory.",
        )
    )


def _warn_skipped(where: str, directory: Path, skipped: list[tuple[int, CallError]], restored: int) -> None:
    reasons = "".join(f"\n  step {s}: {str(err).splitlines()[0]}" for s, err in skipped)
    steps = ", ".join(str(s) for s, _ in skipped)
    warn_at_user(
        f"{where}: skipped the damaged step(s) {steps} of {str(directory)!r} and restored step {restored}, "
        f"the newest intact one:{reasons}",
        DamagedCheckpointWarning,
    )


def save_walkers(
    path: str | os.PathLike[str],
    tree: Any,
    *,
    n_valid: int | None = None,
    metadata: Mapping[str, Any] | None = None,
) -> Path:
    """Save walkers at ``path`` (a directory) as :func:`save_state` saves the state that is one ``WalkerSet``.

    Non-scalar leaves are walker leaves, scalar leaves are replicated; every leaf in the
    dtype JAX holds it in (a float64 NumPy leaf: float32 unless ``jax_enable_x64`` is on).
    Returns once committed; the previous checkpoint at ``path`` is replaced only then.

    Args:
        path: the checkpoint's directory (created if missing).
        tree: a :class:`~shardvmc.WalkerSet` (its count is saved) or a pytree of walkers.
        n_valid: the number of real walkers (the first ones); ``None``: the
            ``WalkerSet``'s count, else all.
        metadata: JSON-serialisable data stored with the walkers (step, energy, ...).

    Returns:
        ``path``.

    Raises:
        CallError: for leaves of different walker counts, ``n_valid`` out of range or
            other than the ``WalkerSet``'s, or metadata JSON cannot encode.
        ImportError: when orbax-checkpoint is not installed (``pip install -e ".[checkpoint]"``).

    Example:
        >>> import os, tempfile, jax, jax.numpy as jnp, shardvmc as sv
        >>> walkers = sv.WalkerSet({"r": sv.shard_walker(jnp.arange(24.0).reshape(8, 3))}, n_valid=6)
        >>> sv.save_walkers(os.path.join(tempfile.mkdtemp(), "walkers"), walkers, metadata={"step": 100}).name
        'walkers'
    """
    where = "save_walkers"
    data, set_count = split_walker_set(tree)
    n = walker_count(data, where, "tree")
    if set_count is not None and n_valid is not None and not isinstance(n_valid, Tracer) and n_valid != set_count:
        raise _error(
            where,
            f"n_valid={int(n_valid)} disagrees with the WalkerSet's own count.",
            "omit n_valid (a WalkerSet carries its count), or save tree.replace(n_valid=...).",
            f"n_valid={int(n_valid)}, tree.n_valid={set_count}",
        )
    n_valid = set_count if n_valid is None else n_valid
    check_n_valid(where, n_valid, n)
    walkers = WalkerSet.tree_unflatten(n if n_valid is None else int(n_valid), (data,))
    return _save_once(where, path, walkers, metadata, asynchronous=False)


def load_walkers(
    path: str | os.PathLike[str],
    like: Any,
    mesh: Mesh | None = None,
    *,
    axis_name: str = "walkers",
    n_walkers: int | None = None,
) -> Checkpoint:
    """Read walkers saved by :func:`save_walkers` (or a 0.2.0 ``.npz`` walker file) onto ``mesh``.

    As :func:`load_state` restores a walker set (of a 0.2.0 file, each process reads the
    whole file). ``n_walkers`` restores another count: fewer keeps the first ones; more
    repeats the saved walkers in order (walker ``i`` is saved walker ``i % saved``;
    copies need burn-in), and ``metadata[sv.RESIZED]`` says so.

    Args:
        path: a directory written by :func:`save_walkers`, or a 0.2.0 ``.npz`` file.
        like: the structure, dtypes and per-walker shapes (arrays or
            ``jax.ShapeDtypeStruct``; any walker count); a :class:`~shardvmc.WalkerSet`
            also states the count expected (the saved one, unless ``n_walkers`` is given).
        mesh: the mesh to restore onto; defaults to the ``use_mesh`` one, else all devices.
        axis_name: the walker axis of ``mesh``.
        n_walkers: the number of walkers to restore; ``None``: the saved count.

    Returns:
        A :class:`Checkpoint` ``(walkers, n_valid, metadata)``.

    Raises:
        CheckpointNotFoundError: when ``path`` does not exist (a ``FileNotFoundError``).
        CallError: as :func:`load_state`.
        ImportError: when orbax-checkpoint is not installed (0.2.0 files need no orbax).

    Example:
        >>> import os, tempfile, jax, jax.numpy as jnp, shardvmc as sv
        >>> path = os.path.join(tempfile.mkdtemp(), "walkers")
        >>> _ = sv.save_walkers(path, {"r": jnp.ones((8, 3))}, n_valid=7, metadata={"step": 5})
        >>> mesh3 = sv.create_mesh(jax.devices()[:3])
        >>> walkers, n_valid, meta = sv.load_walkers(path, {"r": jnp.zeros((1, 3))}, mesh3)
        >>> walkers.data["r"].shape, walkers.data["r"].sharding.spec, n_valid, walkers.n_valid, meta
        ((9, 3), P('walkers',), 7, 7, {'step': 5})
        >>> more = sv.load_walkers(path, {"r": jnp.zeros((1, 3))}, n_walkers=10)
        >>> more.n_valid, more.metadata[sv.RESIZED]
        (10, {'saved': 7, 'restored': 10, 'duplicated': 3, 'dropped': 0, 'needs_burn_in': True})
    """
    where, path = "load_walkers", Path(path)
    like_data, expected = split_walker_set(like)
    root = WalkerSet.tree_unflatten(expected or 0, (like_data,))  # the walker-only state (0: any count)
    if path.is_file():
        walkers, metadata = _restore(where, path, _npz.open_file(path), root, mesh, axis_name, n_walkers)
    else:
        walkers, metadata = _load(where, path, root, mesh, axis_name, n_walkers)
    return Checkpoint(walkers, walkers.n_valid, metadata)


def save_state(path: str | os.PathLike[str], state: Any, *, metadata: dict[str, Any] | None = None) -> Path:
    """Save a whole training state at ``path``, asynchronously; returns once the state is on the host.

    ``state`` is any pytree of :class:`~shardvmc.WalkerSet`\\ s (each process writes the
    rows its devices hold, padding included), replicated ``jax.Array``\\ s (parameters,
    optax and kfac-jax states), NumPy values, Python ``bool``/``int``/``float``/
    ``complex``/``str`` and typed PRNG keys. ``path`` is a directory holding the latest
    state, replaced only once a new one is committed. The write ends with its commit:
    the next save to ``path``, :func:`wait_for_saves`, :func:`load_state` and a normal
    exit wait for it. With several processes, call it on every process, on a directory
    all of them see; :class:`Checkpointer` adds steps and retention.

    Args:
        path: the directory (created if missing).
        state: the pytree to save.
        metadata: JSON-serialisable data stored with it.

    Returns:
        ``path``.

    Raises:
        CallError: for a leaf that cannot be stored (a sharded array outside a
            ``WalkerSet``, an object that is not an array or a number), a ``WalkerSet``
            whose ``n_valid`` exceeds its walkers, or metadata JSON cannot hold.
        ImportError: when orbax-checkpoint is not installed (``pip install -e ".[checkpoint]"``).

    Example:
        >>> import tempfile, jax, jax.numpy as jnp, shardvmc as sv
        >>> walkers = sv.WalkerSet(sv.shard_walker(jnp.arange(24.0).reshape(8, 3), sv.create_mesh()), n_valid=6)
        >>> state = {"walkers": walkers, "params": {"w": jnp.ones(2)}, "step": 10, "key": jax.random.key(1)}
        >>> path = sv.save_state(tempfile.mkdtemp(), state, metadata={"energy": -2.9})
        >>> restored, meta = sv.load_state(path, state, mesh=sv.create_mesh(jax.devices()[:3]))
        >>> restored["walkers"].data.shape, restored["walkers"].n_valid, restored["step"], meta
        ((6, 3), 6, 10, {'energy': -2.9})
    """
    return _save_once("save_state", path, state, metadata, asynchronous=True)


def load_state(
    path: str | os.PathLike[str],
    like: Any,
    *,
    mesh: Mesh | None = None,
    axis_name: str = "walkers",
    n_walkers: int | None = None,
) -> tuple[Any, dict[str, Any]]:
    """Read a state saved by :func:`save_state` (or a :class:`Checkpointer`) onto ``mesh``, exactly.

    Walker-set leaves come back sharded over the walker axis of ``mesh`` (any number of
    devices and processes; each process reads its own devices' rows), padded with
    copies of walker 0; other ``jax.Array`` leaves replicated; NumPy and Python values
    and typed keys as they were. ``n_walkers`` restores every walker set onto that count
    (see :func:`load_walkers`; with several sets, ``metadata[sv.RESIZED]`` is a dict of
    them by pytree path).

    Every byte is checked: the header against its checksum, and every array read
    against the checksums written with it (one per walker row, one per other array),
    so any change after the save is refused. Of a directory of steps, the newest intact
    step is restored: damaged newer steps are skipped with a
    :class:`~shardvmc.DamagedCheckpointWarning` naming them and why.

    Args:
        path: a directory written by :func:`save_state`, a :class:`Checkpointer`'s
            directory (its newest intact step), or one of its step directories.
        like: the saved state's structure, dtypes and shapes: the freshly initialised
            state, or its ``jax.eval_shape`` (a NumPy leaf comes back in its saved dtype,
            which ``like`` may show as JAX holds it). Its ``WalkerSet``\\ s may hold any
            walker count; their ``n_valid`` is the saved count unless ``n_walkers`` is given.
        mesh: the mesh to restore onto; defaults to the ``use_mesh`` one, else all devices.
        axis_name: the walker axis of ``mesh``.
        n_walkers: the number of walkers to restore in each walker set; ``None``: the saved counts.

    Returns:
        ``(state, metadata)``, the metadata given at save time (``{}`` if none).

    Raises:
        CheckpointNotFoundError: when ``path`` does not exist or holds no committed
            checkpoint (empty, or its only save was interrupted): a ``FileNotFoundError``,
            so ``except FileNotFoundError:`` starts a run afresh.
        DamagedCheckpointError: for a damaged step asked for by its directory, or a
            directory whose every step is damaged (a ``CallError`` naming the
            checkpoint, the step and, for array data, the leaf).
        CallError: for a structure, dtype or shape other than ``like``'s (naming the
            leaf), a ``WalkerSet`` ``like`` of another count, or a bad ``n_walkers``.
    """
    path = Path(path).absolute()
    if path.is_file():
        problem = f"{str(path)!r} is a file, not a state checkpoint (a directory)."
        fix = "pass a directory sv.save_state or sv.Checkpointer wrote; read .npz walker files with sv.load_walkers."
        raise _error("load_state", problem, fix)
    return _load("load_state", path, like, mesh, axis_name, n_walkers)


class Checkpointer:
    """Training-state checkpoints in a directory: asynchronous saves, the last ``keep`` steps, elastic restores.

    ``save(step, state)`` returns once the state is on the host and writes it in the
    background (the next ``save`` or :meth:`wait` waits for it); :meth:`restore` reads
    a kept step as :func:`load_state` does. Each step is an orbax step directory
    ``<directory>/<step>``, committed once every process has written its part. With
    several processes, create it and call :meth:`save` and :meth:`restore` on every
    process. Use it as a context manager, or call :meth:`close`.

    Args:
        directory: where the steps live (created if missing).
        keep: how many of the latest steps to keep (``None``: all).
        asynchronous: write in the background (``False``: :meth:`save` returns once committed).

    Raises:
        ImportError: when orbax-checkpoint is not installed (``pip install -e ".[checkpoint]"``).

    Example:
        >>> import tempfile, jax, jax.numpy as jnp, optax, shardvmc as sv
        >>> params = sv.replicate({"w": jnp.ones(3)})
        >>> walkers = sv.initialize_walkers_sharded(lambda k: jax.random.normal(k, (2, 3)), 6, key=jax.random.key(0))
        >>> state = {"walkers": walkers, "params": params, "opt": optax.adam(1e-3).init(params), "step": 0}
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
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
            problem = "keep must be a positive int (the number of latest steps kept) or None (all)."
            raise _error("Checkpointer", problem, "pass keep=3, for example.", repr(keep))
        self.directory, self.keep = _directory_to_write("Checkpointer", Path(directory)), keep
        self._asynchronous = asynchronous
        self._damaged: set[int] = set()  # steps restore() skipped as damaged: save() replaces them
        self._manager = _manager(self.directory, keep=keep, asynchronous=asynchronous)
        _LIVE.add(self)

    def save(self, step: int, state: Any, *, metadata: dict[str, Any] | None = None) -> bool:
        """Save ``state`` with ``metadata`` as ``step`` (see :func:`save_state`); returns once it is on the host.

        The caller may change, donate or delete the state's arrays at once; a later
        :meth:`save`, :meth:`wait` or :meth:`close` waits for the write (and raises its error).

        Returns:
            ``True``; ``False`` (and nothing written) when ``step`` is already saved,
            e.g. a preemption at a step that was just saved periodically. A step that
            :meth:`restore` skipped as damaged is written again.

        Raises:
            CallError: as :func:`save_state`, or for a bad ``step``.
        """
        step = _check_step("Checkpointer.save", step)
        header, arrays = _prepare("Checkpointer.save", state, metadata)
        if step in self._manager.all_steps():
            if step not in self._damaged:
                return False
            self._set_aside(step)
        _write(self._manager, step, header, arrays)
        return True

    def _set_aside(self, step: int) -> None:
        """Rename damaged ``step`` (that :meth:`restore` skipped) to ``<step>.damaged-<k>``, so a run that resumed
        before it saves that step again; the damaged files stay for inspection."""
        self.wait()
        if jax.process_index() == 0:
            k = 0
            while (self.directory / f"{step}.damaged-{k}").exists():
                k += 1
            (self.directory / str(step)).rename(self.directory / f"{step}.damaged-{k}")
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices(f"shardvmc: step {step} set aside")
        self._manager.close()  # a manager that lists the steps again
        self._manager = _manager(self.directory, keep=self.keep, asynchronous=self._asynchronous)
        self._damaged.discard(step)

    def restore(
        self,
        like: Any,
        step: int | None = None,
        *,
        mesh: Mesh | None = None,
        axis_name: str = "walkers",
        n_walkers: int | None = None,
    ) -> tuple[Any, dict[str, Any]]:
        """Read ``step`` as :func:`load_state` does; by default the newest intact step.

        Without ``step``, damaged newer steps are skipped with a
        :class:`~shardvmc.DamagedCheckpointWarning`, and a later :meth:`save` of such a step
        writes it again (the damaged one is renamed ``<step>.damaged-0``, kept for
        inspection); ``restore(like, step=n)`` of a damaged
        step raises :class:`~shardvmc.DamagedCheckpointError`, of a step not kept
        :class:`~shardvmc.CheckpointNotFoundError` (a ``FileNotFoundError``, as when no
        step is committed yet).
        """
        where = "Checkpointer.restore"
        self.wait()
        step = None if step is None else _check_step(where, step)
        return _restore_kept(where, self._manager, step, like, mesh, axis_name, n_walkers, self._damaged)

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
