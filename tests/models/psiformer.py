"""A PsiFormer-style network (von Glehn et al. 2023), per walker, in plain JAX.

One-electron features (electron-nucleus vectors and distances, the latter by the
``custom_jvp`` :func:`~models.constructs.safe_norm`) plus a spin feature built in the body
with ``jnp.ones`` and an ``arange`` mask, projected to the model width; then layers of
multi-head self-attention over electrons and a residual MLP, each followed by layer norm;
then the orbital/envelope/determinant head of FermiNet and a Jastrow over the ``i<j`` pairs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .constructs import positive, safe_norm
from .orbitals import dense, determinant_head, init_head
from .systems import System


def init(
    key: jax.Array,
    system: System,
    *,
    hidden: int = 16,
    heads: int = 2,
    layers: int = 1,
    determinants: int = 2,
    dtype: jnp.dtype = jnp.float32,
) -> dict:
    """Parameters of a PsiFormer of width ``hidden`` with ``heads`` attention heads per layer."""
    if hidden % heads:
        raise ValueError(f"hidden={hidden} is not a multiple of heads={heads}")
    keys = jax.random.split(key, 6 * layers + 3)
    params: dict = {"embed": dense(keys[0], 4 * system.n_atoms + 1, hidden, dtype), "layers": []}
    for i in range(layers):
        k = keys[1 + 6 * i : 7 + 6 * i]
        params["layers"].append(
            {
                "q": dense(k[0], hidden, hidden, dtype)["w"],
                "k": dense(k[1], hidden, hidden, dtype)["w"],
                "v": dense(k[2], hidden, hidden, dtype)["w"],
                "out": dense(k[3], hidden, hidden, dtype),
                "mlp": dense(k[4], hidden, hidden, dtype),
                "norm1": {"scale": jnp.ones((hidden,), dtype), "offset": jnp.zeros((hidden,), dtype)},
                "norm2": {"scale": jnp.ones((hidden,), dtype), "offset": jnp.zeros((hidden,), dtype)},
            }
        )
    params["head"] = init_head(keys[-2], system, hidden, determinants, dtype)
    params["jastrow"] = {"alpha": jnp.asarray(1.0, dtype)}
    return params


def layer_norm(params: dict, h: jax.Array) -> jax.Array:
    """Layer norm over the feature axis, with a learned scale and offset."""
    mean = jnp.mean(h, axis=-1, keepdims=True)
    var = jnp.mean((h - mean) ** 2, axis=-1, keepdims=True)
    return (h - mean) / jnp.sqrt(var + 1e-5) * params["scale"] + params["offset"]


def attention(params: dict, h: jax.Array, heads: int) -> jax.Array:
    """Multi-head self-attention over electrons: ``(n, H) -> (n, H)``."""
    n, width = h.shape
    d = width // heads
    q, k, v = ((h @ params[name]).reshape(n, heads, d) for name in ("q", "k", "v"))
    weights = jax.nn.softmax(jnp.einsum("ihd,jhd->hij", q, k) / np.sqrt(d), axis=-1)
    out = jnp.einsum("hij,jhd->ihd", weights, v).reshape(n, width)
    return out @ params["out"]["w"] + params["out"]["b"]


def jastrow(params: dict, r: jax.Array, system: System) -> jax.Array:
    """``sum_{i<j} -a_ij alpha^2 / (alpha + r_ij)`` (cusp ``a_ij``), over the ``i<j`` pairs only."""
    n = system.n_electrons
    i, j = np.triu_indices(n, k=1)
    r_ij = safe_norm(r[i] - r[j])
    up = np.arange(n) < system.n_up
    cusp = np.where(up[i] == up[j], 0.25, 0.5)
    alpha = positive(params["alpha"])
    return jnp.sum(-cusp * alpha**2 / (alpha + r_ij))


def signed_log_psi(params: dict, r: jax.Array, system: System, heads: int = 2) -> tuple[jax.Array, jax.Array]:
    """``(sign psi, log|psi|)`` of one walker ``r`` of shape ``(n_electrons, 3)``."""
    n = r.shape[0]
    coords, _ = system.nuclei(r.dtype)
    ae = r[:, None, :] - coords[None, :, :]
    r_ae = safe_norm(ae)
    spin = jnp.where(jnp.arange(n)[:, None] < system.n_up, 1.0, -1.0) * jnp.ones((n, 1), r.dtype)
    x = jnp.concatenate([ae.reshape(n, -1), r_ae, spin], axis=-1)
    h = x @ params["embed"]["w"] + params["embed"]["b"]
    for layer in params["layers"]:
        h = layer_norm(layer["norm1"], h + attention(layer, h, heads))
        h = layer_norm(layer["norm2"], h + jnp.tanh(h @ layer["mlp"]["w"] + layer["mlp"]["b"]))
    sign, log_abs = determinant_head(params["head"], h, r_ae, system)
    return sign, log_abs + jastrow(params["jastrow"], r, system)


def log_psi(params: dict, r: jax.Array, system: System) -> jax.Array:
    """``log|psi|`` of one walker ``r`` of shape ``(n_electrons, 3)``."""
    return signed_log_psi(params, r, system)[1]
