"""Walker checkpoints: atomic ``.npz`` files that restore onto any number of devices.

A checkpoint holds the valid walkers only (padding is dropped), so it can be restored
onto a mesh of another size, where it is padded again for that mesh. The file is a
plain NumPy ``.npz`` archive read with ``allow_pickle=False``: one entry per leaf and a
JSON header (format version, pytree paths, dtypes, shapes, ``n_valid``, metadata).
"""

from __future__ import annotations

import json
import os
import secrets
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from . import _compat
from ._errors import CallError, message
from ._mesh import resolve_mesh
from ._placement import gather_walkers, leading_size, pad_n_walkers, pad_walker, replicate, shard_walker
from ._walkerset import check_n_valid

__all__ = ["Checkpoint", "load_walkers", "save_walkers"]

_FORMAT = "shardvmc-walkers"
_VERSION = 1
_HEADER = "__shardvmc__"


class Checkpoint(NamedTuple):
    """What :func:`load_walkers` returns; unpack it as ``walkers, n_valid, metadata``.

    Attributes:
        walkers: the pytree of ``like``, every non-scalar leaf sharded ``P(axis_name)``
            on the mesh and padded to a multiple of its size (copies of walker 0);
            scalar leaves replicated.
        n_valid: the number of real walkers, the first ones; pass it as ``n_valid=``.
        metadata: the JSON metadata given to :func:`save_walkers` (``{}`` if none).
    """

    walkers: Any
    n_valid: int
    metadata: dict[str, Any]


def _is_key(dtype: Any) -> bool:
    return dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key)


def _dtype(leaf: Any) -> Any:
    """The dtype ``leaf`` has (or would have) as a JAX array under the current x64 setting."""
    dtype = getattr(leaf, "dtype", None)
    return dtype if _is_key(dtype) else jnp.result_type(leaf)


def _path(path: Any) -> str:
    return jax.tree_util.keystr(path) or "<root>"


def save_walkers(
    path: str | os.PathLike[str],
    tree: Any,
    *,
    n_valid: int | None = None,
    metadata: Mapping[str, Any] | None = None,
) -> Path:
    """Write the valid walkers of ``tree`` to ``path``, atomically.

    The first ``n_valid`` walkers of every non-scalar leaf are saved (padding is
    dropped); scalar leaves are saved as they are. Leaves are stored in the dtype JAX
    gives them (a float64 NumPy leaf is stored as float32 unless ``jax_enable_x64`` is
    on), which is what :func:`load_walkers` compares ``like`` with.

    The file is written under a temporary name in the same directory, flushed to disk,
    and renamed over ``path``, so a writer killed at any moment leaves the previous
    checkpoint intact (at worst a stray ``.<name>.*.tmp`` file stays behind).

    In a multi-process run, call it on every process: the walkers are gathered from
    all processes, process 0 alone writes, and every process returns once the file is
    in place (an error of the writer is raised on every process).

    Args:
        path: the file to write, used as given (no suffix is added); its directory
            must exist.
        tree: a pytree of walkers (sharded ``jax.Array`` or host arrays); typed PRNG
            key leaves are supported.
        n_valid: the number of real walkers (the first ones); ``None``: all.
        metadata: JSON-serialisable data stored with the walkers (step, energy, ...).

    Returns:
        The path written.

    Raises:
        CallError: for leaves of different walker counts, ``n_valid`` out of range, or
            metadata JSON cannot encode.

    Example:
        >>> import os, tempfile, jax, jax.numpy as jnp, shardvmc as sv
        >>> mesh = sv.create_mesh(jax.devices()[:4])
        >>> walkers = {"r": sv.shard_walker(jnp.arange(24.0).reshape(8, 3), mesh)}
        >>> path = os.path.join(tempfile.mkdtemp(), "walkers.npz")
        >>> sv.save_walkers(path, walkers, n_valid=6, metadata={"step": 100}).name
        'walkers.npz'
    """
    where = "save_walkers"
    n = leading_size(tree, where, "tree")
    check_n_valid(where, n_valid, n)
    count = n if n_valid is None else int(n_valid)
    if metadata is not None and not isinstance(metadata, Mapping):
        raise CallError(
            message(where, "metadata must be a dict.", got=type(metadata).__name__, fix="pass metadata={...}.")
        )
    meta = dict(metadata or {})
    try:
        json.dumps(meta)
    except (TypeError, ValueError) as err:
        raise CallError(
            message(
                where,
                "metadata cannot be stored as JSON.",
                got=str(err),
                fix="store numbers, strings, lists and dicts only (e.g. float(energy) instead of a jax.Array).",
            )
        ) from None

    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    entries, dtypes, leaves = [], [], []
    for path_, leaf in flat:
        dtype = _dtype(leaf)
        key_impl = str(jax.random.key_impl(leaf)) if _is_key(dtype) else None
        shape = list(np.shape(leaf))
        if shape:
            shape[0] = count
        entries.append({"path": _path(path_), "dtype": str(dtype), "shape": shape, "key_impl": key_impl})
        dtypes.append(dtype)
        leaves.append(jax.random.key_data(leaf) if key_impl else leaf)
    host = gather_walkers(leaves)  # a collective: every process takes part
    arrays: dict[str, np.ndarray] = {}
    for i, (entry, dtype, leaf) in enumerate(zip(entries, dtypes, host)):
        if entry["shape"]:
            leaf = leaf[:count]
        if not entry["key_impl"]:
            leaf = leaf.astype(dtype, copy=False)
        leaf = np.asarray(leaf, order="C")  # (not ascontiguousarray: it makes scalars 1-d)
        # Dtypes NumPy cannot describe in a .npy header (bfloat16, ...) travel as unsigned ints.
        arrays[f"leaf_{i}"] = leaf if leaf.dtype.isbuiltin == 1 else leaf.view(f"u{leaf.dtype.itemsize}")
    header = {
        "format": _FORMAT,
        "version": _VERSION,
        "n_valid": count,
        "leaves": entries,
        "metadata": meta,
        "saved_on": {"devices": jax.device_count(), "processes": jax.process_count()},
    }
    arrays[_HEADER] = np.frombuffer(json.dumps(header).encode(), dtype=np.uint8)

    target = Path(path)
    error: BaseException | None = None
    if jax.process_index() == 0:
        try:
            _write_atomic(target, arrays)
        except Exception as err:  # reported on every process below
            error = err
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        failed = int(multihost_utils.broadcast_one_to_all(np.int32(error is not None)))
        if failed and error is None:
            raise CallError(
                message(where, f"process 0 failed to write {str(target)!r}.", fix="see the error of process 0.")
            )
    if error is not None:
        raise error
    return target


def _write_atomic(target: Path, arrays: dict[str, np.ndarray]) -> None:
    """Write ``arrays`` as an ``.npz`` at ``target``: temporary file, fsync, rename, fsync dir."""
    directory = target.absolute().parent
    tmp = directory / f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # 0o666: the umask applies
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    try:
        dir_fd = os.open(directory, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory handles
        return
    try:
        os.fsync(dir_fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(dir_fd)


def _corrupt(path: Path, problem: str, got: str | None = None) -> CallError:
    return CallError(
        message(
            "load_walkers",
            f"{str(path)!r} {problem}",
            got=got,
            fix="restore an earlier checkpoint; a file written by sv.save_walkers is only replaced once complete.",
        )
    )


def _read(path: Path) -> tuple[dict[str, Any], list[np.ndarray]]:
    """The header and the leaves of a checkpoint file, every read checked (CRC included)."""
    try:
        with open(path, "rb") as f:
            data = np.load(f, allow_pickle=False)
            if not isinstance(data, np.lib.npyio.NpzFile):
                raise _corrupt(path, "is a single .npy array, not a shardvmc checkpoint.")
            with data:
                if _HEADER not in data.files:
                    raise _corrupt(path, "is an .npz file without a shardvmc header, not a shardvmc checkpoint.")
                header = json.loads(bytes(data[_HEADER]).decode())
                if not isinstance(header, dict) or header.get("format") != _FORMAT:
                    raise _corrupt(path, "has a header that is not a shardvmc walker checkpoint's.")
                if header.get("version") != _VERSION:
                    raise _corrupt(
                        path,
                        f"is format version {header.get('version')!r}, which this shardvmc cannot read.",
                        got=f"version {header.get('version')!r}, expected {_VERSION}",
                    )
                entries = header["leaves"]
                if not (
                    isinstance(header["n_valid"], int)
                    and isinstance(header["metadata"], dict)
                    and all({"path", "dtype", "shape", "key_impl"} <= set(e) for e in entries)
                ):
                    raise _corrupt(path, "has a malformed header.")
                leaves = [data[f"leaf_{i}"] for i in range(len(entries))]
    except (FileNotFoundError, CallError):
        raise
    except (OSError, ValueError, EOFError, KeyError, TypeError, zipfile.BadZipFile, UnicodeDecodeError) as err:
        raise _corrupt(path, "is truncated or corrupted.", got=f"{type(err).__name__}: {err}") from None
    return header, leaves


def load_walkers(
    path: str | os.PathLike[str],
    like: Any,
    mesh: Mesh | None = None,
    *,
    axis_name: str = "walkers",
) -> Checkpoint:
    """Read walkers saved by :func:`save_walkers` and shard them over ``mesh``.

    The walkers are padded for ``mesh`` (which may have any number of devices, not
    only the one they were saved from) with copies of walker 0, and placed from host
    data: in a multi-process run every process reads the file (it must be visible to
    all of them) and transfers only the walkers of its own devices.

    Args:
        path: a file written by :func:`save_walkers`.
        like: a pytree of the expected structure, whose leaves give the dtypes and the
            trailing (non-walker) shapes: arrays or ``jax.ShapeDtypeStruct``; their
            walker counts do not matter.
        mesh: the mesh to restore onto; defaults to the ``use_mesh`` one, else all
            devices.
        axis_name: the walker axis of ``mesh``.

    Returns:
        A :class:`Checkpoint` ``(walkers, n_valid, metadata)``.

    Raises:
        FileNotFoundError: when ``path`` does not exist.
        CallError: for a file that is truncated, corrupted or not a checkpoint, or
            whose pytree paths, dtypes or trailing shapes differ from ``like``; the
            message names the leaf and both values.

    Example:
        >>> import os, tempfile, jax, jax.numpy as jnp, shardvmc as sv
        >>> path = os.path.join(tempfile.mkdtemp(), "walkers.npz")
        >>> _ = sv.save_walkers(path, {"r": jnp.ones((8, 3))}, n_valid=7, metadata={"step": 5})
        >>> walkers, n_valid, meta = sv.load_walkers(path, {"r": jnp.zeros((1, 3))}, sv.create_mesh(jax.devices()[:3]))
        >>> walkers["r"].shape, walkers["r"].sharding.spec, n_valid, meta
        ((9, 3), P('walkers',), 7, {'step': 5})
    """
    where = "load_walkers"
    mesh = resolve_mesh(mesh, axis_name, where=where)
    path = Path(path)
    header, stored = _read(path)
    entries = header["leaves"]
    flat, treedef = jax.tree_util.tree_flatten_with_path(like)
    want = [_path(p) for p, _ in flat]
    have = [e["path"] for e in entries]
    if want != have:
        missing = [p for p in have if p not in want]
        extra = [p for p in want if p not in have]
        raise CallError(
            message(
                where,
                f"the pytree saved in {str(path)!r} has another structure than `like`.",
                got=f"saved leaves {have}",
                expected=f"leaves of `like` {want}"
                + (f"; only in the file: {missing}" if missing else "")
                + (f"; only in `like`: {extra}" if extra else ""),
                fix="pass a `like` with the structure of the saved walkers (same dict keys, tuple lengths and "
                "dataclass fields, in the same order).",
            )
        )
    n_valid = header["n_valid"]
    size = _compat.axis_size(mesh, axis_name)
    n_pad = pad_n_walkers(n_valid, size)
    leaves = []
    for (_, model), entry, data in zip(flat, entries, stored):
        name = entry["path"]
        dtype = _dtype(model)
        if str(dtype) != entry["dtype"]:
            raise CallError(
                message(
                    where,
                    f"leaf {name} was saved as {entry['dtype']}, but `like` has {dtype}.",
                    got=f"saved dtype {entry['dtype']}",
                    expected=f"{dtype} (from `like`)",
                    fix="give `like` the saved dtype (and the jax_enable_x64 setting it was saved with), "
                    "then convert after loading.",
                )
            )
        model_shape, saved_shape = tuple(np.shape(model)), tuple(entry["shape"])
        if (len(model_shape) == 0) != (len(saved_shape) == 0) or model_shape[1:] != saved_shape[1:]:
            raise CallError(
                message(
                    where,
                    f"leaf {name} has other per-walker (trailing) dimensions in the file than in `like`.",
                    got=f"saved shape {saved_shape} (walker axis first)",
                    expected=f"(n_walkers, {', '.join(map(str, model_shape[1:]))}) from `like` shape {model_shape}"
                    if model_shape
                    else "a scalar, as in `like`",
                    fix="pass a `like` whose leaves have the saved per-walker shapes.",
                )
            )
        stored_shape = data.shape[: data.ndim - 1] if entry["key_impl"] else data.shape  # key data: one more axis
        if stored_shape != saved_shape or (saved_shape and saved_shape[0] != n_valid):
            raise _corrupt(path, f"is inconsistent: leaf {name} does not have the shape its header gives.")
        if not entry["key_impl"] and data.dtype != dtype:
            if np.dtype(dtype).isbuiltin == 1 or data.dtype != np.dtype(f"u{np.dtype(dtype).itemsize}"):
                raise _corrupt(path, f"is inconsistent: leaf {name} holds {data.dtype} data, not {dtype}.")
            data = data.view(dtype)
        if saved_shape:
            placed = shard_walker(pad_walker(data, n_pad)[0], mesh, axis_name)
        else:
            placed = replicate(data, mesh)
        leaves.append(jax.random.wrap_key_data(placed, impl=entry["key_impl"]) if entry["key_impl"] else placed)
    return Checkpoint(jax.tree_util.tree_unflatten(treedef, leaves), int(n_valid), header["metadata"])
