"""The dtype and matrix-product precision of a run, chosen for the platform: ``precision_policy``.

float64 where the platform has it (CPUs, GPUs); float32 on TPUs, which have no float64
(XLA emulates some of it, refuses FFTs and factorisations in it, and can crash compiling a
float64 network). In float32 on a TPU, matrix products run at ``"highest"`` precision
(JAX's default there is one bfloat16 pass: local energies hundreds of hartree off, see
``shardvmc._numerics``), and so they do on GPUs (TensorFloat-32 at JAX's default on recent
ones); CPUs compute float32 products in float32 anyway.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import jax
import numpy as np
from jax.sharding import Mesh

from ._errors import CallError, message

__all__ = ["PrecisionPolicy", "precision_policy"]

DTYPES = ("auto", "float32", "float64")
_NO_FLOAT64 = ("tpu",)


@dataclasses.dataclass(frozen=True)
class PrecisionPolicy:
    """The numbers a run computes in: a dtype and a matrix-product precision, for one platform.

    Enter :meth:`context` around the run (it sets ``jax.enable_x64`` and
    ``jax.default_matmul_precision``); print it in the run's header.

    Attributes:
        dtype: ``numpy.float64`` or ``numpy.float32``.
        platform: the platform it was chosen for (``"cpu"``, ``"gpu"``, ``"tpu"``...).
        matmul_precision: ``jax.default_matmul_precision``'s setting, or ``None`` for JAX's default.
        reason: why this dtype, in a few words.
    """

    dtype: np.dtype
    platform: str
    matmul_precision: str | None
    reason: str

    @property
    def x64(self) -> bool:
        """Whether the dtype is float64 (``jax.enable_x64``)."""
        return self.dtype == np.float64

    @contextlib.contextmanager
    def context(self) -> Iterator[PrecisionPolicy]:
        """``jax.enable_x64`` and ``jax.default_matmul_precision`` as the policy says, for a ``with`` block."""
        with contextlib.ExitStack() as stack:
            stack.enter_context(jax.enable_x64(self.x64))
            if self.matmul_precision is not None:
                stack.enter_context(jax.default_matmul_precision(self.matmul_precision))
            yield self

    def __str__(self) -> str:
        products = f", matrix products at {self.matmul_precision!r}" if self.matmul_precision else ""
        return f"{np.dtype(self.dtype).name} on {self.platform} ({self.reason}{products})"


def _platform(mesh: Mesh | None) -> str:
    device = mesh.devices.flat[0] if mesh is not None else jax.devices()[0]
    return str(device.platform)


def precision_policy(dtype: str = "auto", *, mesh: Mesh | None = None) -> PrecisionPolicy:
    """The dtype and matrix-product precision for the platform of ``mesh`` (default: JAX's default devices).

    ``"auto"``: float64 where the platform has it (CPUs, GPUs), float32 on a TPU (with
    matrix products at ``"highest"``). ``"float32"``: float32 anywhere (``"highest"``
    products on a TPU). ``"float64"``: float64, refused on a TPU.

    Args:
        dtype: ``"auto"``, ``"float32"`` or ``"float64"``.
        mesh: the run's mesh; its devices' platform decides.

    Returns:
        A :class:`PrecisionPolicy`; ``with policy.context(): ...`` runs under it.

    Raises:
        CallError: for another ``dtype``, or ``"float64"`` on a TPU.

    Example:
        >>> import shardvmc as sv
        >>> policy = sv.precision_policy("auto")
        >>> print(policy)  # on CPUs
        float64 on cpu (the platform has float64)
        >>> with policy.context():
        ...     import jax.numpy as jnp
        ...     jnp.zeros(2).dtype
        dtype('float64')
    """
    where = "shardvmc.precision_policy"
    if dtype not in DTYPES:
        raise CallError(message(where, f"dtype={dtype!r} is not a precision this knows.", expected=str(DTYPES)))
    platform = _platform(mesh)
    no_float64 = platform in _NO_FLOAT64
    if dtype == "float64" and no_float64:
        raise CallError(
            message(
                where,
                f"dtype='float64' asked for on a {platform.upper()}, which has no float64: XLA emulates part of it "
                "(slowly), refuses FFTs and matrix factorisations in it, and can crash compiling a float64 network.",
                fix="pass dtype='auto' (float32 there, with matrix products at 'highest' and local energies "
                "computed at float32 accuracy), or run on CPUs or GPUs for float64.",
            )
        )
    if dtype == "float64" or (dtype == "auto" and not no_float64):
        return PrecisionPolicy(np.dtype(np.float64), platform, None, "the platform has float64")
    reason = f"{platform.upper()}s have no float64" if dtype == "auto" else "asked for"
    # CPUs compute float32 products in float32; TPUs (one bfloat16 pass) and GPUs (TensorFloat-32 on recent ones)
    # do not at JAX's default.
    return PrecisionPolicy(np.dtype(np.float32), platform, None if platform == "cpu" else "highest", reason)
