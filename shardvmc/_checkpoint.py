"""Walker checkpoints: atomic ``.npz`` files that restore onto any number of devices and processes.

A checkpoint holds the valid walkers only (padding is dropped), so it can be restored
onto a mesh of another size, where it is padded again for that mesh. Files are plain
NumPy ``.npz`` archives read with ``allow_pickle=False``, each with a JSON header
(format version, pytree paths, dtypes, shapes, ``n_valid``, metadata).

Two layouts, one reader:

* one process: one file at ``path`` (format version 1) with one entry per leaf;
* several processes: no process ever holds the whole walker set. Every process writes
  the walker rows it holds to its own part file ``<path>.d-<token>/part-<process>.npz``,
  then process 0 writes a small manifest at ``path`` (format version 2: the header,
  the scalar leaves, and which rows of which leaf each part holds). The manifest is the
  commit marker: it replaces the previous one atomically, only once every part is on
  disk; then the other data directories of ``path`` (the replaced one, and any left by
  a save killed before its commit) are removed.

A restore reads the header, and each process reads only the part files that hold the
rows its own devices get (``jax.make_array_from_callback``).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer
from jax.sharding import Mesh

from . import _compat
from ._errors import CallError, message
from ._mesh import get_walker_sharding, resolve_mesh
from ._placement import pad_n_walkers, replicate
from ._walkerset import WalkerSet, check_n_valid, split_walker_set, walker_count

__all__ = ["Checkpoint", "RESIZED", "load_walkers", "save_walkers"]

_FORMAT = "shardvmc-walkers"
_VERSION = 1  # one file holding every leaf
_MANIFEST_VERSION = 2  # a manifest naming one part file per saving process
_HEADER = "__shardvmc__"
_DATA_SUFFIX = r"\.d-[0-9a-f]{16}"  # <manifest name>.d-<token>: the data directory of a manifest
RESIZED = "shardvmc.resized"
"""Metadata key :func:`load_walkers` adds when it restored another number of walkers than saved."""


class Checkpoint(NamedTuple):
    """What :func:`load_walkers` returns; unpack it as ``walkers, n_valid, metadata``.

    Attributes:
        walkers: a :class:`~shardvmc.WalkerSet` of the pytree of ``like``, every
            non-scalar leaf sharded ``P(axis_name)`` on the mesh and padded to a
            multiple of its size (copies of walker 0); scalar leaves replicated. Its
            ``n_valid`` is the restored count.
        n_valid: the number of real walkers, the first ones (``walkers.n_valid``).
        metadata: the JSON metadata given to :func:`save_walkers` (``{}`` if none);
            after a restore onto another walker count, also ``metadata[sv.RESIZED]``
            (see :func:`load_walkers`).
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


def path_name(path: Any) -> str:
    """A pytree path as messages and headers show it (``['r']``; ``<root>`` for the root)."""
    return jax.tree_util.keystr(path) or "<root>"


def checked_metadata(where: str, metadata: Any) -> dict[str, Any]:
    """``metadata`` as a dict that JSON can store, else a ``CallError``."""
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
    return meta


def restored_count(where: str, path: Path, saved: int, expected: int | None, n_walkers: Any) -> int:
    """The number of walkers to restore of ``saved``: ``n_walkers``, checked, else the saved count.

    ``expected`` is the count of a ``WalkerSet`` given as ``like`` (``None``: any).
    """
    if n_walkers is not None:
        if isinstance(n_walkers, bool) or not isinstance(n_walkers, (int, np.integer)) or n_walkers < 1:
            raise CallError(
                message(
                    where,
                    "n_walkers must be a positive int, the number of walkers to restore.",
                    got=repr(n_walkers),
                    fix=f"pass n_walkers=None for the saved {saved}, or a count such as {saved}.",
                )
            )
        return int(n_walkers)
    if expected is not None and expected != saved:
        raise CallError(
            message(
                where,
                f"{str(path)!r} holds {saved} walkers, but the WalkerSet `like` expects {expected}.",
                got=f"{saved} saved walkers",
                expected=f"{expected} (like.n_valid)",
                fix=f"pass n_walkers={expected} to restore {expected} walkers from the {saved} saved "
                "(duplicates need burn-in), or a `like` of the saved count.",
            )
        )
    return saved


def resized(saved: int, restored: int) -> dict[str, Any]:
    """What ``metadata[sv.RESIZED]`` says after restoring ``restored`` walkers of ``saved``."""
    return {
        "saved": saved,
        "restored": restored,
        "duplicated": max(0, restored - saved),
        "dropped": max(0, saved - restored),
        "needs_burn_in": restored > saved,
    }


def dtype_error(where: str, path: Path, name: str, saved: str, dtype: Any) -> CallError:
    """Leaf ``name`` of the checkpoint at ``path`` was saved as ``saved``, ``like`` has ``dtype``."""
    return CallError(
        message(
            where,
            f"leaf {name} was saved as {saved}, but `like` has {dtype}.",
            got=f"saved dtype {saved} in {str(path)!r}",
            expected=f"{dtype} (from `like`)",
            fix="give `like` the saved dtype (and the jax_enable_x64 setting it was saved with), "
            "then convert after loading.",
        )
    )


def structure_error(where: str, path: Path, have: list[str], want: list[str], what: str) -> CallError:
    """The pytree saved in ``path`` (leaf paths ``have``) is not the one of ``like`` (``want``)."""
    missing = [p for p in have if p not in want]
    extra = [p for p in want if p not in have]
    return CallError(
        message(
            where,
            f"the pytree saved in {str(path)!r} has another structure than `like`.",
            got=f"saved leaves {have}",
            expected=f"leaves of `like` {want}"
            + (f"; only in the file: {missing}" if missing else "")
            + (f"; only in `like`: {extra}" if extra else ""),
            fix=f"pass a `like` with the structure of the saved {what} (same dict keys, tuple lengths and "
            "dataclass fields, in the same order).",
        )
    )


def _stored(leaf: np.ndarray, dtype: Any, key: bool) -> np.ndarray:
    """Host data as stored: the leaf's JAX dtype, C order, exotic dtypes as unsigned ints."""
    if not key:
        leaf = leaf.astype(dtype, copy=False)
    leaf = np.asarray(leaf, order="C")  # (not ascontiguousarray: it makes scalars 1-d)
    # Dtypes NumPy cannot describe in a .npy header (bfloat16, ...) travel as unsigned ints.
    return leaf if leaf.dtype.isbuiltin == 1 else leaf.view(f"u{leaf.dtype.itemsize}")


def _blocks(leaf: Any, count: int, n_processes: int) -> list[tuple[int, int, int]]:
    """Which process writes which rows: ``(start, stop, process)`` over rows ``< count``.

    The same on every process (it reads only the sharding, not the data). Rows held by
    several processes (replicas, or host data every process has) are split evenly
    among their holders, so every process writes about ``count / n_processes`` rows.
    """
    n = int(np.shape(leaf)[0])
    holders: dict[tuple[int, int], set[int]] = {}
    if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
        for device, index in leaf.sharding.devices_indices_map(leaf.shape).items():
            start, stop, _ = (index[0] if index else slice(None)).indices(n)
            holders.setdefault((start, stop), set()).add(device.process_index)
    else:  # host data, or an array on this process's devices: every process holds all of it
        holders[(0, n)] = set(range(n_processes))
    blocks = []
    for (start, stop), processes in sorted(holders.items()):
        stop = min(stop, count)
        who = sorted(processes)
        for k, process in enumerate(who):
            a = start + (stop - start) * k // len(who)
            b = start + (stop - start) * (k + 1) // len(who)
            if b > a:
                blocks.append((a, b, process))
    return blocks


def _rows(leaf: Any, start: int, stop: int) -> np.ndarray:
    """Rows ``start:stop`` of ``leaf`` from this process's own copy (no transfer between processes)."""
    if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
        for shard in leaf.addressable_shards:
            a, b, _ = (shard.index[0] if shard.index else slice(None)).indices(leaf.shape[0])
            if a <= start and stop <= b:
                return np.asarray(shard.data[start - a : stop - a])
        raise AssertionError(f"rows {start}:{stop} are not on this process")  # pragma: no cover
    return np.asarray(leaf[start:stop])


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

    Files are written under a temporary name, flushed to disk, and renamed into place,
    so a writer killed at any moment leaves the previous checkpoint intact (at worst a
    stray ``.<name>.*.tmp`` file or ``<name>.d-*`` directory stays behind, until the
    next successful save removes every data directory of ``path`` but its own).

    In a multi-process run, call it on every process (a collective): each process
    writes the walkers it holds to its own file in a new directory
    ``<path>.d-<token>/``, and once all are on disk process 0 replaces the manifest at
    ``path``, which names that directory; nothing is gathered. Every process returns
    once the checkpoint is committed, and an error of any process is raised on all.

    Args:
        path: the file to write, used as given (no suffix is added); its directory
            must exist (and, with several processes, be shared by all of them).
        tree: a :class:`~shardvmc.WalkerSet` (its count is saved) or a pytree of
            walkers (sharded ``jax.Array`` or host arrays); typed PRNG key leaves are
            supported.
        n_valid: the number of real walkers (the first ones); ``None``: the
            ``WalkerSet``'s count, else all.
        metadata: JSON-serialisable data stored with the walkers (step, energy, ...).

    Returns:
        The path written.

    Raises:
        CallError: for leaves of different walker counts, ``n_valid`` out of range or
            other than the ``WalkerSet``'s, or metadata JSON cannot encode.

    Example:
        >>> import os, tempfile, jax, jax.numpy as jnp, shardvmc as sv
        >>> mesh = sv.create_mesh(jax.devices()[:4])
        >>> walkers = sv.WalkerSet({"r": sv.shard_walker(jnp.arange(24.0).reshape(8, 3), mesh)}, n_valid=6)
        >>> path = os.path.join(tempfile.mkdtemp(), "walkers.npz")
        >>> sv.save_walkers(path, walkers, metadata={"step": 100}).name
        'walkers.npz'
    """
    where = "save_walkers"
    data, set_count = split_walker_set(tree)
    n = walker_count(data, where, "tree")
    if set_count is not None and n_valid is not None and not isinstance(n_valid, Tracer):
        if int(n_valid) != set_count:
            raise CallError(
                message(
                    where,
                    f"n_valid={int(n_valid)} disagrees with the WalkerSet's own count.",
                    got=f"n_valid={int(n_valid)}, tree.n_valid={set_count}",
                    fix="omit n_valid (a WalkerSet carries its count), or save tree.replace(n_valid=...).",
                )
            )
    n_valid = set_count if n_valid is None else n_valid
    check_n_valid(where, n_valid, n)
    count = n if n_valid is None else int(n_valid)
    meta = checked_metadata(where, metadata)

    entries, leaves = [], []
    for path_, leaf in jax.tree_util.tree_flatten_with_path(data)[0]:
        dtype = jax_dtype(leaf)
        key_impl = str(jax.random.key_impl(leaf)) if is_key_dtype(dtype) else None
        shape = list(np.shape(leaf))
        if shape:
            shape[0] = count
        entries.append({"path": path_name(path_), "dtype": str(dtype), "shape": shape, "key_impl": key_impl})
        leaves.append((jax.random.key_data(leaf) if key_impl else leaf, dtype, bool(key_impl)))
    header = {
        "format": _FORMAT,
        "version": _VERSION,
        "n_valid": count,
        "leaves": entries,
        "metadata": meta,
        "saved_on": {"devices": jax.device_count(), "processes": jax.process_count()},
    }
    target = Path(path)
    if jax.process_count() == 1:
        arrays = {}
        for i, (entry, (leaf, dtype, key)) in enumerate(zip(entries, leaves)):
            host = np.asarray(jax.device_get(leaf))
            arrays[f"leaf_{i}"] = _stored(host[:count] if entry["shape"] else host, dtype, key)
        arrays[_HEADER] = _encode(header)
        _write_atomic(target, arrays)
        _remove_stale(target)
    else:
        _save_parts(target, header, leaves, count)
    return target


def _encode(header: dict[str, Any]) -> np.ndarray:
    return np.frombuffer(json.dumps(header).encode(), dtype=np.uint8)


def _save_parts(target: Path, header: dict[str, Any], leaves: list[tuple[Any, Any, bool]], count: int) -> None:
    """The multi-process save: a part file per process, then the manifest (see the module doc)."""
    from jax.experimental import multihost_utils

    me, n_processes = jax.process_index(), jax.process_count()
    token = np.asarray(multihost_utils.broadcast_one_to_all(np.frombuffer(secrets.token_bytes(8), np.int32)))
    directory = target.with_name(f"{target.name}.d-{token.astype('<i4').tobytes().hex()}")  # matches _DATA_SUFFIX
    part, scalars = {}, {}
    for i, (entry, (leaf, dtype, key)) in enumerate(zip(header["leaves"], leaves)):
        if not entry["shape"]:
            if me == 0:
                scalars[f"leaf_{i}"] = _stored(_local_scalar(leaf), dtype, key)
            continue
        blocks = _blocks(leaf, count, n_processes)
        entry["blocks"] = [list(b) for b in blocks]
        mine = [_stored(_rows(leaf, a, b), dtype, key) for a, b, p in blocks if p == me]
        empty = np.zeros((0, *np.shape(leaf)[1:]), leaf.dtype if key else dtype)
        part[f"leaf_{i}"] = np.concatenate(mine) if mine else _stored(empty, dtype, key)
    error: BaseException | None = None
    try:
        directory.mkdir(exist_ok=True)
        _write_atomic(directory / _part_name(me), part)
    except Exception as err:  # reported on every process below
        error = err
    failed = np.asarray(multihost_utils.process_allgather(np.int32(error is not None)))  # also the barrier
    if failed.any():
        if me == 0:
            _remove(directory)
        if error is not None:
            raise error
        raise CallError(
            message(
                "save_walkers",
                f"processes {np.flatnonzero(failed).tolist()} failed to write their part of {str(target)!r}.",
                fix="see the error of those processes; the previous checkpoint is unchanged.",
            )
        )
    if me == 0:
        try:
            manifest = {**header, "version": _MANIFEST_VERSION, "data": directory.name, "processes": n_processes}
            _write_atomic(target, {**scalars, _HEADER: _encode(manifest)})
        except Exception as err:
            error = err
    if int(multihost_utils.broadcast_one_to_all(np.int32(error is not None))):
        if me == 0:
            _remove(directory)
        if error is not None:
            raise error
        raise CallError(
            message("save_walkers", f"process 0 failed to write {str(target)!r}.", fix="see the error of process 0.")
        )
    if me == 0:
        _remove_stale(target, keep=directory)


def _local_scalar(leaf: Any) -> np.ndarray:
    if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
        leaf = leaf.addressable_data(0)
    return np.asarray(leaf)


def _part_name(process: int) -> str:
    return f"part-{process:05d}.npz"


def _remove_stale(target: Path, keep: Path | None = None) -> None:
    """Remove the data directories of ``target`` other than ``keep``: the one a new commit
    replaced, and any left by a save that was killed before its commit."""
    pattern = re.compile(re.escape(target.name) + _DATA_SUFFIX)
    for entry in target.absolute().parent.iterdir():
        if pattern.fullmatch(entry.name) and entry.name != getattr(keep, "name", None) and entry.is_dir():
            _remove(entry)


def _remove(directory: Path | None) -> None:
    if directory is not None:
        shutil.rmtree(directory, ignore_errors=True)


def _write_atomic(target: Path, arrays: dict[str, np.ndarray]) -> None:
    """Write ``arrays`` as an ``.npz`` at ``target``: temporary file, fsync, rename, fsync dir."""
    directory = target.absolute().parent
    tmp = directory / f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # 0o666: the umask applies
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, allow_pickle=False, **arrays)
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


def _unreadable(path: Path, err: BaseException) -> CallError:
    # zipfile and np.load report damage in many ways (BadZipFile, NotImplementedError for a
    # flipped version or compression field, RuntimeError for an "encrypted" flag, ValueError,
    # EOFError, struct.error, ...): for a file that parsed as far as this, every one means damage.
    return _corrupt(path, "is truncated or corrupted.", got=f"{type(err).__name__}: {err}")


def _open_npz(path: Path) -> Any:
    """``np.load`` of an ``.npz`` (entries are read when asked for), errors as ``CallError``."""
    file = open(path, "rb")  # noqa: SIM115 - handed to the archive, which closes it
    try:
        data = np.load(file, allow_pickle=False)
    except Exception as err:
        file.close()
        raise _unreadable(path, err) from None
    if not isinstance(data, np.lib.npyio.NpzFile):
        file.close()
        raise _corrupt(path, "is a single .npy array, not a shardvmc checkpoint.")
    # data.close() closes the file too. numpy's stub types fid as IO[str] (it is the binary file np.load read).
    data.fid = file  # pyright: ignore[reportAttributeAccessIssue]
    return data


def _read_header(path: Path) -> tuple[dict[str, Any], Any]:
    """The checked header of the checkpoint (or manifest) at ``path``, and the open archive."""
    data = _open_npz(path)
    try:
        if _HEADER not in data.files:
            raise _corrupt(path, "is an .npz file without a shardvmc header, not a shardvmc checkpoint.")
        header = json.loads(bytes(data[_HEADER]).decode())
        _check_header(path, header)
    except CallError:
        data.close()
        raise
    except Exception as err:
        data.close()
        raise _unreadable(path, err) from None
    return header, data


def check_key_impl(name: Any) -> str | None:
    """Why ``name`` is not the name of a JAX PRNG implementation (``None`` when it is one)."""
    if not isinstance(name, str):
        return f"a key implementation must be a name, not {name!r}"
    try:
        jax.eval_shape(lambda: jax.random.key(0, impl=name))
    except (ValueError, TypeError, KeyError):
        return f"{name!r} is not a PRNG key implementation of this JAX"
    return None


def check_dtype(name: Any) -> str | None:
    """Why ``name`` is not a dtype name JAX knows (``None`` when it is one)."""
    try:
        if isinstance(name, str) and name.startswith("key<"):
            return None  # typed keys: their dtype name follows the implementation, checked on its own
        jnp.dtype(name)
    except (TypeError, ValueError):
        return f"dtype {name!r} is not a dtype"
    return None


def check_shape(shape: Any) -> bool:
    """Whether ``shape`` is a list of non-negative ints (a shape as JSON holds it)."""
    return isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)


def _check_header(path: Path, header: Any) -> None:
    """Every field of a (possibly hand-edited) header, so that no later step meets a surprise."""

    def malformed(what: str) -> CallError:
        return _corrupt(path, f"has a malformed header: {what}.")

    if not isinstance(header, dict) or header.get("format") != _FORMAT:
        raise _corrupt(path, "has a header that is not a shardvmc walker checkpoint's.")
    version = header.get("version")
    if version not in (_VERSION, _MANIFEST_VERSION) or type(version) is not int:
        raise _corrupt(
            path,
            f"is format version {version!r}, which this shardvmc cannot read.",
            got=f"version {version!r}, expected {_VERSION} or {_MANIFEST_VERSION}",
        )
    if "n_valid" not in header or not isinstance(header.get("metadata"), dict):
        raise malformed("it lacks n_valid or its metadata is not a dict")
    n_valid = header["n_valid"]
    if type(n_valid) is not int or n_valid < 1:
        raise malformed(f"n_valid must be a positive int, the number of saved walkers, not {n_valid!r}")
    entries = header.get("leaves")
    if not isinstance(entries, list) or not all(
        isinstance(e, dict) and {"path", "dtype", "shape", "key_impl"} <= set(e) and isinstance(e["path"], str)
        for e in entries
    ):
        raise malformed("its leaves are not a list of {path, dtype, shape, key_impl} entries")
    for e in entries:
        name = e["path"]
        if not check_shape(e["shape"]):
            raise malformed(f"leaf {name} has the shape {e['shape']!r}, which is not a list of sizes")
        if e["key_impl"] is not None and (why := check_key_impl(e["key_impl"])):
            raise malformed(f"leaf {name}: {why}")
        if e["key_impl"] is None and (why := check_dtype(e["dtype"])):
            raise malformed(f"leaf {name}: {why}")
        if e["shape"] and e["shape"][0] != n_valid:
            raise _corrupt(
                path, f"is inconsistent: n_valid is {n_valid}, but leaf {name} holds {e['shape'][0]} walkers."
            )
    if version == _MANIFEST_VERSION:
        data_dir = header.get("data")
        # a sibling of the manifest, nothing else
        if not isinstance(data_dir, str) or re.fullmatch(r"[^/\\]+" + _DATA_SUFFIX, data_dir) is None:
            raise malformed(f"its data directory {data_dir!r} is not a sibling data directory of the manifest")
        for e in entries:
            blocks = e.get("blocks") if e["shape"] else []
            if not isinstance(blocks, list) or not all(
                isinstance(b, list) and len(b) == 3 and all(type(v) is int and v >= 0 for v in b) for b in blocks
            ):
                raise malformed(f"leaf {e['path']} has no valid list of [start, stop, process] blocks")


def _key_data_struct(impl: str) -> jax.ShapeDtypeStruct:
    """Shape and dtype of one key's data for the implementation ``impl``."""
    return jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0, impl=impl)))


class _Reader:
    """The leaves of one checkpoint, read part by part as the devices of this process need them."""

    def __init__(self, path: Path, header: dict[str, Any], archive: Any) -> None:
        self.path, self.header = path, header
        self.archives: dict[str | None, Any] = {None: archive}  # None: the file at `path`
        self.cache: dict[tuple[str | None, int], np.ndarray] = {}
        self.directory = path.with_name(header["data"]) if header["version"] == _MANIFEST_VERSION else None

    def close(self) -> None:
        for archive in self.archives.values():
            archive.close()

    def _entry(self, part: str | None, i: int) -> np.ndarray:
        if part is None:
            file = self.path
        else:
            assert self.directory is not None  # only a manifest names part files, and it has their directory
            file = self.directory / part
        try:
            if part not in self.archives:
                self.archives[part] = _open_npz(file)
            return self.archives[part][f"leaf_{i}"]
        except FileNotFoundError:
            raise _corrupt(self.path, f"names the part file {str(file)!r}, which is missing.") from None
        except CallError:
            raise
        except Exception as err:
            raise _unreadable(file, err) from None

    def _checked(self, part: str | None, i: int, rows: int | None, dtype: Any) -> np.ndarray:
        """Entry ``leaf_<i>`` of ``part``, its shape (``rows`` walkers) and dtype checked."""
        if (part, i) in self.cache:
            return self.cache[part, i]
        entry = self.header["leaves"][i]
        data = self._entry(part, i)
        saved = tuple(entry["shape"])
        expected = saved if rows is None else (rows, *saved[1:])
        if entry["key_impl"]:  # key data: the implementation's shape and dtype follow the key's
            key_data = _key_data_struct(entry["key_impl"])
            expected, dtype = (*expected, *key_data.shape), key_data.dtype
        if data.shape != expected:
            raise _corrupt(
                self.path, f"is inconsistent: leaf {entry['path']} does not have the shape its header gives."
            )
        if data.dtype != dtype:
            if np.dtype(dtype).isbuiltin == 1 or data.dtype != np.dtype(f"u{np.dtype(dtype).itemsize}"):
                raise _corrupt(
                    self.path, f"is inconsistent: leaf {entry['path']} holds {data.dtype} data, not {dtype}."
                )
            data = data.view(dtype)
        self.cache[part, i] = data
        return data

    def scalar(self, i: int, dtype: Any) -> np.ndarray:
        return self._checked(None, i, None, dtype)

    def place(self, i: int, dtype: Any, source: np.ndarray, sharding: Any) -> jax.Array:
        """Leaf ``i`` with row ``r`` taken from saved walker ``source[r]``, placed on ``sharding``."""
        entry = self.header["leaves"][i]
        count = self.header["n_valid"]
        if self.directory is None:
            blocks = [(0, count, None)]
        else:
            blocks = [(int(a), int(b), _part_name(int(p))) for a, b, p in entry["blocks"]]
        if [a for a, _, _ in blocks] != [0] + [b for _, b, _ in blocks[:-1]] or blocks[-1][1] != count:
            raise _corrupt(self.path, f"is inconsistent: the parts of leaf {entry['path']} do not cover its walkers.")
        starts = np.array([a for a, _, _ in blocks])
        offsets, totals = [], {}  # where each block starts in its part file; rows per part file
        for a, b, part in blocks:
            offsets.append(totals.get(part, 0))
            totals[part] = totals.get(part, 0) + b - a
        if entry["key_impl"]:  # stored as key data: the key's own shape and dtype follow the walker's
            data = _key_data_struct(entry["key_impl"])
            trailing, stored = (*entry["shape"][1:], *data.shape), data.dtype
        else:
            trailing, stored = tuple(entry["shape"][1:]), dtype
        shape = (len(source), *trailing)

        def rows(index: tuple[slice, ...] | None) -> np.ndarray:
            if index is None:  # JAX's type allows no index: the whole array
                index = (slice(None),)
            wanted = source[index[0]]
            which = np.searchsorted(starts, wanted, side="right") - 1
            out = np.empty((len(wanted), *trailing), stored)
            for k in np.unique(which):
                a, _, part = blocks[k]
                data = self._checked(part, i, totals[part], dtype)
                at = which == k
                out[at] = data[offsets[k] + wanted[at] - a]
            return out[(slice(None), *index[1:])]

        try:
            return jax.make_array_from_callback(shape, sharding, rows)
        finally:
            self.cache.clear()


def load_walkers(
    path: str | os.PathLike[str],
    like: Any,
    mesh: Mesh | None = None,
    *,
    axis_name: str = "walkers",
    n_walkers: int | None = None,
) -> Checkpoint:
    """Read walkers saved by :func:`save_walkers` and shard them over ``mesh``.

    The walkers are padded for ``mesh`` (which may have any number of devices and
    processes, not only the ones they were saved from) with copies of walker 0, and
    placed from host data: each process reads only the files holding the walkers of
    its own devices (all files must be visible to every process).

    By default exactly the saved walkers come back. ``n_walkers`` restores another
    count (an elastic restart on more or fewer GPUs): fewer keeps the first
    ``n_walkers``; more repeats the saved walkers in order (walker ``i`` is saved
    walker ``i % saved``), and the copies start correlated with their originals, so run
    burn-in steps before taking statistics. Then ``metadata[sv.RESIZED]`` says so:
    ``{"saved": ..., "restored": ..., "duplicated": ..., "dropped": ..., "needs_burn_in": ...}``.

    Args:
        path: a file written by :func:`save_walkers`.
        like: a pytree of the expected structure, whose leaves give the dtypes and the
            trailing (non-walker) shapes: arrays or ``jax.ShapeDtypeStruct``; their
            walker counts do not matter. A :class:`~shardvmc.WalkerSet` also states
            the count expected: its ``n_valid`` must then be the saved count (or pass
            ``n_walkers``).
        mesh: the mesh to restore onto; defaults to the ``use_mesh`` one, else all
            devices.
        axis_name: the walker axis of ``mesh``.
        n_walkers: the number of walkers to restore; ``None``: the saved count.

    Returns:
        A :class:`Checkpoint` ``(walkers, n_valid, metadata)``; ``walkers`` is a
        :class:`~shardvmc.WalkerSet`.

    Raises:
        FileNotFoundError: when ``path`` does not exist.
        CallError: for a file that is truncated, corrupted or not a checkpoint (or a
            part file that is missing or damaged), whose pytree paths, dtypes or
            trailing shapes differ from ``like`` (the message names the leaf and both
            values), a ``WalkerSet`` ``like`` of another count, or a bad ``n_walkers``.

    Example:
        >>> import os, tempfile, jax, jax.numpy as jnp, shardvmc as sv
        >>> path = os.path.join(tempfile.mkdtemp(), "walkers.npz")
        >>> _ = sv.save_walkers(path, {"r": jnp.ones((8, 3))}, n_valid=7, metadata={"step": 5})
        >>> mesh3 = sv.create_mesh(jax.devices()[:3])
        >>> walkers, n_valid, meta = sv.load_walkers(path, {"r": jnp.zeros((1, 3))}, mesh3)
        >>> walkers.data["r"].shape, walkers.data["r"].sharding.spec, n_valid, walkers.n_valid, meta
        ((9, 3), P('walkers',), 7, 7, {'step': 5})
        >>> more = sv.load_walkers(path, {"r": jnp.zeros((1, 3))}, n_walkers=10)
        >>> resized = more.metadata[sv.RESIZED]
        >>> more.n_valid, resized["duplicated"], resized["needs_burn_in"]
        (10, 3, True)
    """
    where = "load_walkers"
    mesh = resolve_mesh(mesh, axis_name, where=where)
    like_data, expected_count = split_walker_set(like)
    path = Path(path)
    header, archive = _read_header(path)
    reader = _Reader(path, header, archive)
    try:
        tree = _load(reader, like_data, expected_count, mesh, axis_name, n_walkers)
    finally:
        reader.close()
    saved = header["n_valid"]
    target = saved if n_walkers is None else int(n_walkers)
    metadata = dict(header["metadata"])
    if target != saved:
        metadata[RESIZED] = resized(saved, target)
    return Checkpoint(WalkerSet(tree, target), target, metadata)


def _load(
    reader: _Reader, like: Any, expected_count: int | None, mesh: Mesh, axis_name: str, n_walkers: int | None
) -> Any:
    where = "load_walkers"
    path, header = reader.path, reader.header
    entries = header["leaves"]
    flat, treedef = jax.tree_util.tree_flatten_with_path(like)
    want = [path_name(p) for p, _ in flat]
    have = [e["path"] for e in entries]
    if want != have:
        raise structure_error(where, path, have, want, "walkers")
    saved = header["n_valid"]
    target = restored_count(where, path, saved, expected_count, n_walkers)
    n_pad = pad_n_walkers(target, _compat.axis_size(mesh, axis_name))
    rows = np.arange(n_pad)
    source = np.where(rows < target, rows % saved, 0)  # padding: copies of walker 0
    sharding = get_walker_sharding(mesh, axis_name)
    leaves = []
    for i, ((_, model), entry) in enumerate(zip(flat, entries)):
        name = entry["path"]
        dtype = jax_dtype(model)
        if str(dtype) != entry["dtype"]:
            raise dtype_error(where, path, name, entry["dtype"], dtype)
        model_shape, saved_shape = tuple(np.shape(model)), tuple(entry["shape"])
        if (len(model_shape) == 0) != (len(saved_shape) == 0) or model_shape[1:] != saved_shape[1:]:
            raise CallError(
                message(
                    where,
                    f"leaf {name} has other per-walker (trailing) dimensions in the file than in `like`.",
                    got=f"saved shape {saved_shape} (walker axis first) in {str(path)!r}",
                    expected=f"(n_walkers, {', '.join(map(str, model_shape[1:]))}) from `like` shape {model_shape}"
                    if model_shape
                    else "a scalar, as in `like`",
                    fix="pass a `like` whose leaves have the saved per-walker shapes.",
                )
            )
        if saved_shape:
            placed = reader.place(i, dtype, source, sharding)
        else:
            placed = replicate(reader.scalar(i, dtype), mesh)
        leaves.append(jax.random.wrap_key_data(placed, impl=entry["key_impl"]) if entry["key_impl"] else placed)
    return jax.tree_util.tree_unflatten(treedef, leaves)
