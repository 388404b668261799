"""Walker files of shardvmc 0.2.0 (``.npz``), read as the header and arrays of today's checkpoints.

0.2.0 wrote one ``.npz`` at ``path`` (version 1: a JSON header ``__shardvmc__`` and an entry ``leaf_<i>`` per
leaf, the valid walkers only), or with several processes a manifest (version 2: the header, the scalar leaves,
each leaf's ``[start, stop, process]`` blocks) beside ``<path>.d-<token>/part-<process>.npz``. :func:`open_file`
checks what is particular to those files and gives the header of :mod:`shardvmc._checkpoint` (one walker set at
the root), whose validator, ``like`` check and resize rule do the rest. NumPy only; each process reads the whole file.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

from ._errors import DamagedCheckpointError, message

__all__ = ["FORMAT", "open_file"]

FORMAT = "shardvmc-state"  # the format of today's checkpoint headers
_HEADER = "__shardvmc__"
_DATA = re.compile(r"[^/\\]+\.d-[0-9a-f]{16}")  # <manifest name>.d-<token>: a sibling data directory


def _corrupt(path: Path, problem: str, got: str | None = None) -> DamagedCheckpointError:
    fix = "restore an earlier checkpoint; a file written by sv.save_walkers is only replaced once complete."
    return DamagedCheckpointError(message("load_walkers", f"{str(path)!r} {problem}", got=got, fix=fix))


def _entries(path: Path) -> dict[str, np.ndarray]:
    """Every entry of the ``.npz`` at ``path``, read (the zip CRC checked), damage as ``DamagedCheckpointError``."""
    error: Exception | None = None
    with open(path, "rb") as file:  # our own handle: closed whatever np.load and zipfile do on damage
        try:
            data = np.load(file, allow_pickle=False)
            if isinstance(data, np.lib.npyio.NpzFile):
                return {name: data[name] for name in data.files}
        except Exception as err:  # zipfile and np.load report damage in many ways (BadZipFile, ValueError, ...)
            error = err
    if error is None:
        raise _corrupt(path, "is a single .npy array, not a shardvmc checkpoint.")
    raise _corrupt(path, "is truncated or corrupted.", f"{type(error).__name__}: {error}")


def open_file(path: Path) -> tuple[dict[str, Any], Callable[[dict[str, Any]], dict[str, Any]], Callable[..., Any]]:
    """``(header, read, broken)`` of the 0.2.0 file at ``path``, as :func:`shardvmc._checkpoint._restore` takes them."""
    entries = _entries(path)
    if _HEADER not in entries:
        raise _corrupt(path, "is an .npz file without a shardvmc header, not a shardvmc checkpoint.")
    try:
        old = json.loads(bytes(entries[_HEADER]).decode())
    except Exception as err:
        raise _corrupt(path, "is truncated or corrupted.", f"{type(err).__name__}: {err}") from None

    if not isinstance(old, dict) or old.get("format") != "shardvmc-walkers":
        raise _corrupt(path, "has a header that is not a shardvmc walker checkpoint's.")
    version, n, leaves = old.get("version"), old.get("n_valid"), old.get("leaves")
    if version not in (1, 2) or type(version) is not int:
        raise _corrupt(path, f"is format version {version!r}, which this shardvmc cannot read.")
    if type(n) is not int or n < 1:
        raise _corrupt(path, f"has a malformed header: n_valid must be a positive int, not {n!r}.")
    if not isinstance(leaves, list) or not all(
        isinstance(e, dict) and {"dtype", "shape", "key_impl"} <= set(e) for e in leaves
    ):
        raise _corrupt(path, "has a malformed header: its leaves are not a list of {path, dtype, shape, ...}.")
    for e in leaves:
        if isinstance(e["shape"], list) and e["shape"] and e["shape"][0] != n:
            holds = f"leaf {e.get('path')} holds {e['shape'][0]} walkers"
            raise _corrupt(path, f"is inconsistent: n_valid is {n}, but {holds}.")
    data_dir = old.get("data")
    if version == 2 and (not isinstance(data_dir, str) or _DATA.fullmatch(data_dir) is None):
        raise _corrupt(path, f"has a malformed header: its data directory {data_dir!r} is not a sibling of it.")
    parts: dict[int, dict[str, np.ndarray]] = {}

    def part(process: int) -> dict[str, np.ndarray]:
        file = path.with_name(str(data_dir)) / f"part-{process:05d}.npz"
        try:
            return parts[process] if process in parts else parts.setdefault(process, _entries(file))
        except FileNotFoundError:
            raise _corrupt(path, f"names the part file {str(file)!r}, which is missing.") from None

    def stored(i: int) -> np.ndarray:
        """Leaf ``i`` as saved (the valid walkers), from the file or its parts."""
        e, offsets, pieces = leaves[i], {}, []
        if version == 1 or not e["shape"]:
            return entries.get(f"leaf_{i}", np.zeros(0))
        blocks = e.get("blocks")  # [start, stop, process] in row order; a part holds its blocks' rows in turn
        ok = isinstance(blocks, list) and all(isinstance(b, list) and [type(v) for v in b] == [int] * 3 for b in blocks)
        if (
            not (ok and blocks)
            or [a for a, _, _ in blocks] != [0, *(b for _, b, _ in blocks[:-1])]
            or blocks[-1][1] != n
        ):
            raise _corrupt(path, f"is inconsistent: the blocks of leaf {e['path']} do not cover its walkers.")
        for a, b, p in blocks:
            pieces.append(part(p).get(f"leaf_{i}", np.zeros(0))[offsets.get(p, 0) : offsets.get(p, 0) + b - a])
            offsets[p] = offsets.get(p, 0) + b - a
        return np.concatenate(pieces) if len({x.dtype for x in pieces}) == 1 else np.zeros(0)

    def read(specs: dict[str, Any]) -> dict[str, Any]:
        out = {}
        for key, (sharding, shape, dtype) in specs.items():
            data, dtype, e = stored(int(key)), np.dtype(dtype), leaves[int(key)]
            if data.dtype != dtype and dtype.isbuiltin != 1 and data.dtype == np.dtype(f"u{dtype.itemsize}"):
                data = data.view(dtype)  # dtypes a .npy header cannot describe (bfloat16) were stored as uints
            if data.dtype != dtype or data.shape != ((n, *shape[1:]) if e["shape"] else shape):
                got = f"stored {data.dtype}{list(data.shape)}, header {dtype}"
                raise _corrupt(
                    path, f"is inconsistent: leaf {e['path']} is stored as another array than its header says.", got
                )
            if e["shape"]:  # the rows asked for: the saved ones, then zeros (as orbax reads a longer array)
                data = np.concatenate([data[: shape[0]], np.zeros((max(0, shape[0] - n), *shape[1:]), dtype)])
            out[key] = jax.make_array_from_callback(shape, sharding, lambda index, data=data: data[index])
        return out

    sets = [{"path": "<root>", "n_valid": n, "n_walkers": n}]
    new = [
        {"path": e.get("path"), "kind": "walker" if e["shape"] else "array", "set": 0}
        | {k: e[k] for k in ("dtype", "shape", "key_impl")}
        for e in leaves
    ]
    header = {"format": FORMAT, "version": 1, "leaves": new, "walker_sets": sets, "metadata": old.get("metadata")}
    return header, read, lambda problem, got=None: _corrupt(path, problem, got)
