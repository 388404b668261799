"""The padding contract of the engine, written out as a reference for the tests."""

import jax
import numpy as np


def as_evaluated(tree, n_valid, n_devices):
    """The walkers as a kernel evaluates them on ``n_devices`` devices.

    Walkers at index ``>= n_valid`` are padding. A padding walker that holds a NaN or an
    infinity is evaluated at a copy of the first finite walker of its device, so that no
    such value can reach a derivative; every other walker is evaluated as it is.
    """
    leaves = [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)]
    n = leaves[0].shape[0]
    n_local = -(-n // n_devices)
    finite = np.ones(n, bool)
    for x in leaves:
        if np.issubdtype(x.dtype, np.inexact):
            finite &= np.isfinite(x.reshape(n, -1)).all(axis=1)
    source = np.arange(n)
    for i in range(n_valid, n):
        if not finite[i]:
            device = slice(i // n_local * n_local, min((i // n_local + 1) * n_local, n))
            first = np.flatnonzero(finite[device])
            source[i] = device.start + (first[0] if first.size else 0)
    return jax.tree_util.tree_map(lambda x: np.asarray(x)[source], tree)
