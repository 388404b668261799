"""Checksums of checkpoint data: one per walker row and one per other array, computed where the data lives.

A checkpoint is restored onto any mesh, walker count and process count, so a checksum per stored shard or
chunk could not be checked by the processes that read the data back: they read other row ranges than were
written. A checksum per walker row is independent of the layout: every process checks exactly the rows it
reads, with no data moved, and a restore onto fewer walkers checks the rows it keeps. Other arrays
(replicated parameters, optimiser states, keys, host data) are checked whole.

The checksum of a row is two independent 32-bit lanes over its 32-bit words ``w_i`` (a float64 is two words,
a float16 or a bool one, complex numbers their real and imaginary parts)::

    lane = fmix(n ^ seed ^ sum_i fmix(w_i ^ fmix(2 i + seed)))   (mod 2**32)

with murmur3's finaliser ``fmix``, a bijection of 32-bit words. A change confined to one word, any flipped
byte or bit among them, changes exactly one term of the sum and so always changes both lanes; other changes
escape with a probability of about 2**-64. It runs on the device holding the data, as a few integer
operations per word (an all-reduce-free ``jax.jit``), and dispatches asynchronously, so a save stays
asynchronous: orbax writes the checksums beside the data they describe.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

__all__ = ["checksum", "differs", "host_checksum", "row_checksums"]

_SEEDS = (0x9E3779B9, 0x7F4A7C15)
_FMIX = (np.uint32(0x85EBCA6B), np.uint32(0xC2B2AE35))


def _fmix(h: jax.Array) -> jax.Array:
    """murmur3's 32-bit finaliser: a bijection that mixes every input bit into every output bit."""
    h = h ^ (h >> 16)
    h = h * _FMIX[0]
    h = h ^ (h >> 13)
    h = h * _FMIX[1]
    return h ^ (h >> 16)


def _lanes(words: jax.Array) -> jax.Array:
    """``(rows, n)`` uint32 words -> ``(rows, 2)`` uint32 checksums."""
    n = words.shape[1]
    position = jnp.arange(n, dtype=jnp.uint32) * np.uint32(2)
    lanes = []
    for seed in _SEEDS:
        terms = _fmix(words ^ _fmix(position + np.uint32(seed)))
        total = jnp.sum(terms, axis=1, dtype=jnp.uint32)
        lanes.append(_fmix(total ^ np.uint32((n ^ seed) & 0xFFFFFFFF)))
    return jnp.stack(lanes, axis=1)


def _words(x: jax.Array) -> jax.Array:
    """The bits of ``x`` as ``(rows, n)`` uint32 words, row ``r`` holding ``x[r]`` (a scalar: one row)."""
    x = x.reshape(1, *x.shape) if x.ndim == 0 else x
    if jnp.iscomplexobj(x):
        x = jnp.stack([jnp.real(x), jnp.imag(x)], axis=-1)
    if x.dtype == jnp.bool_:
        words = x.astype(jnp.uint32)
    else:
        unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[x.dtype.itemsize]
        words = jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)  # 8 bytes: a trailing axis of 2
    return words.reshape(x.shape[0], -1)


def _own_mesh(x: Any) -> Any:
    """A mesh context of the devices holding ``x``: checkpoints are saved and restored eagerly under any context mesh
    (another library's global one, of Explicit axes), which the checksums' programs must not meet."""
    sharding = getattr(x, "sharding", None)
    if isinstance(sharding, NamedSharding) and isinstance(sharding.mesh, Mesh):
        return jax.set_mesh(sharding.mesh)
    device = next(iter(x.devices())) if isinstance(x, jax.Array) else jax.devices()[0]
    return jax.set_mesh(Mesh(np.array([device]), ("checksum",)))


def row_checksums(x: jax.Array) -> jax.Array:
    """The ``(rows, 2)`` uint32 checksums of the rows of ``x`` (along its first axis), sharded as its rows."""
    with _own_mesh(x):
        return _rows(x)


@jax.jit
def _rows(x: jax.Array) -> jax.Array:
    return _lanes(_words(x))


def checksum(x: jax.Array) -> jax.Array:
    """The ``(2,)`` uint32 checksum of the array ``x`` as a whole, computed on one device holding it.

    A replicated array is checked once, on this process's first copy, not once per device.
    """
    x = x.addressable_data(0) if isinstance(x, jax.Array) else jnp.asarray(x)
    with _own_mesh(x):
        return _whole(x)


@jax.jit
def _whole(x: jax.Array) -> jax.Array:
    return _lanes(_words(x.reshape(1, *x.shape)))[0]


def host_checksum(x: np.ndarray) -> np.ndarray:
    """The ``(2,)`` uint32 checksum of host data ``x`` as a whole, in its own dtype (whatever x64 says)."""
    data = np.ascontiguousarray(x).reshape(-1).view(np.uint8)
    data = np.concatenate([data, np.zeros(-data.size % 4, np.uint8)]).view(np.uint32)
    return np.asarray(checksum(jnp.asarray(data)))


@jax.jit
def _rows_differ(x: jax.Array, stored: jax.Array, stored_rows: jax.Array) -> jax.Array:
    wrong = jnp.any(_lanes(_words(x)) != stored, axis=1)
    return jnp.any(wrong & (jnp.arange(x.shape[0]) < stored_rows))


def differs(x: Any, stored: Any, stored_rows: int | None = None) -> Any:
    """Whether ``x`` differs from its ``stored`` checksum(s).

    With ``stored_rows``, ``x`` is checked row by row against ``(rows, 2)`` checksums, its first
    ``stored_rows`` rows only (rows past them are rows a restore onto more walkers added: zeros, not
    stored data), and the answer is a device bool, fetched with the others by the caller. A whole
    array's two words are compared on the host.
    """
    if isinstance(x, np.ndarray):
        return not np.array_equal(host_checksum(x), np.asarray(stored).reshape(2))
    if stored_rows is None:  # two words, compared on the host: not under the caller's context mesh
        return not np.array_equal(np.asarray(checksum(x)), np.asarray(stored).reshape(2))
    with _own_mesh(x):
        return _rows_differ(x, stored, stored_rows)
