"""Walker files of shardvmc 0.2.0 (``.npz``), read as the header and arrays of today's checkpoints.

0.2.0 wrote one ``.npz`` at ``path`` (format version 1: a JSON header ``__shardvmc__``
and an entry ``leaf_<i>`` per leaf, the valid walkers only), or, with several
processes, a manifest at ``path`` (version 2: the header, the scalar leaves, and each
leaf's ``[start, stop, process]`` blocks) beside ``<path>.d-<token>/part-<process>.npz``.
:func:`open_file` checks what is particular to those files and turns the header into
the one of :mod:`shardvmc._checkpoint` (one walker set at the root); that module's
validator, ``like`` check and resize rule do the rest. NumPy only: no orbax needed.
Every process reads the whole file (these are old files; today's format reads per device).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

from ._errors import CallError, message

FORMAT = "shardvmc-state"  # the format of today's checkpoint headers
_HEADER = "__shardvmc__"
_DATA = re.compile(r"[^/\\]+\.d-[0-9a-f]{16}")  # <manifest name>.d-<token>: a sibling data directory


def _corrupt(path: Path, problem: str, got: str | None = None) -> CallError:
    fix = "restore an earlier checkpoint; a file written by sv.save_walkers is only replaced once complete."
    return CallError(message("load_walkers", f"{str(path)!r} {problem}", got=got, fix=fix))


def _entries(path: Path) -> dict[str, np.ndarray]:
    """Every entry of the ``.npz`` at ``path``, read (so the zip CRC is checked), damage as ``CallError``."""
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

    def malformed(what: str) -> CallError:
        return _corrupt(path, f"has a malformed header: {what}.")

    if not isinstance(old, dict) or old.get("format") != "shardvmc-walkers":
        raise _corrupt(path, "has a header that is not a shardvmc walker checkpoint's.")
    version, n, leaves = old.get("version"), old.get("n_valid"), old.get("leaves")
    if version not in (1, 2) or type(version) is not int:
        raise _corrupt(path, f"is format version {version!r}, which this shardvmc cannot read.")
    if type(n) is not int or n < 1:
        raise malformed(f"n_valid must be a positive int, the number of saved walkers, not {n!r}")
    if not isinstance(leaves, list) or not all(
        isinstance(e, dict) and {"dtype", "shape", "key_impl"} <= set(e) for e in leaves
    ):
        raise malformed("its leaves are not a list of {path, dtype, shape, key_impl} entries")
    for e in leaves:
        if isinstance(e["shape"], list) and e["shape"] and e["shape"][0] != n:
            raise _corrupt(
                path, f"is inconsistent: n_valid is {n}, but leaf {e.get('path')} holds {e['shape'][0]} walkers."
            )
    data_dir = old.get("data")
    if version == 2 and (not isinstance(data_dir, str) or _DATA.fullmatch(data_dir) is None):
        raise malformed(f"its data directory {data_dir!r} is not a sibling data directory of the manifest")
    parts: dict[int, dict[str, np.ndarray]] = {}

    def part(process: int) -> dict[str, np.ndarray]:
        file = path.with_name(str(data_dir)) / f"part-{process:05d}.npz"
        if process not in parts:
            try:
                parts[process] = _entries(file)
            except FileNotFoundError:
                raise _corrupt(path, f"names the part file {str(file)!r}, which is missing.") from None
        return parts[process]

    def stored(i: int) -> np.ndarray:
        """Leaf ``i`` as saved (the valid walkers), from the file or its parts."""
        e = leaves[i]
        if version == 1 or not e["shape"]:
            return entries.get(f"leaf_{i}", np.zeros(0))
        blocks, offsets, pieces = e.get("blocks"), {}, []
        if not isinstance(blocks, list) or not all(
            isinstance(b, list) and len(b) == 3 and all(type(v) is int and v >= 0 for v in b) for b in blocks
        ):
            raise malformed(f"leaf {e['path']} has no valid list of [start, stop, process] blocks")
        if [a for a, _, _ in blocks] != [0] + [b for _, b, _ in blocks[:-1]] or blocks[-1][1] != n:
            raise _corrupt(path, f"is inconsistent: the parts of leaf {e['path']} do not cover its walkers.")
        for a, b, p in blocks:  # a part holds its blocks' rows one after the other
            start = offsets.get(p, 0)
            pieces.append(part(p).get(f"leaf_{i}", np.zeros(0))[start : start + b - a])
            offsets[p] = start + b - a
        return np.concatenate(pieces) if len({x.dtype for x in pieces}) == 1 else np.zeros(0)

    def read(specs: dict[str, Any]) -> dict[str, Any]:
        out = {}
        for key, (sharding, shape, dtype) in specs.items():
            (data, dtype), walker = (stored(int(key)), np.dtype(dtype)), bool(leaves[int(key)]["shape"])
            if data.dtype != dtype and dtype.isbuiltin != 1 and data.dtype == np.dtype(f"u{dtype.itemsize}"):
                data = data.view(dtype)  # dtypes a .npy header cannot describe (bfloat16) were stored as uints
            if data.dtype != dtype or data.shape != ((n, *shape[1:]) if walker else shape):
                problem = (
                    f"is inconsistent: leaf {leaves[int(key)]['path']} is stored as another array than its header says."
                )
                raise _corrupt(path, problem, f"stored {data.dtype}{list(data.shape)}, header {dtype}")
            if walker:  # the rows asked for: the saved ones, then zeros (as orbax reads a longer array)
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
