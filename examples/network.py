"""The wavefunction of the neural examples: a FermiNet-style network (Pfau et al. 2020), and the atoms it learns.

The atoms are data (no chemistry package). Every operation has forward-mode derivatives
in the parameters (kfac-jax takes jvps).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

import shardvmc as sv


@dataclasses.dataclass(frozen=True)
class System:
    """Nuclei (bohr), their charges, the electron spins, and reference energies (hartree); hashable (``Static``)."""

    name: str
    coords: tuple[tuple[float, float, float], ...]
    charges: tuple[float, ...]
    n_up: int
    n_down: int
    exact_energy: float
    hf_energy: float | None = None


LI = System("Li", ((0.0, 0.0, 0.0),), (3.0,), 2, 1, exact_energy=-7.47806, hf_energy=-7.43273)
LIH = System("LiH", ((0.0, 0.0, 0.0), (0.0, 0.0, 3.015)), (3.0, 1.0), 2, 2, exact_energy=-8.07050)
BE = System("Be", ((0.0, 0.0, 0.0),), (4.0,), 2, 2, exact_energy=-14.66736, hf_energy=-14.57302)
# Chakravorty et al., Phys. Rev. A 47, 3649 (1993) (exact), Clementi and Roetti (1974) (Hartree-Fock)
NE = System("Ne", ((0.0, 0.0, 0.0),), (10.0,), 5, 5, exact_energy=-128.9376, hf_energy=-128.5471)
# Pfau et al., Phys. Rev. Research 2, 033429 (2020), Table II (exact from Bytautas and Ruedenberg; Hartree-Fock)
N2 = System("N2", ((0.0, 0.0, -1.034), (0.0, 0.0, 1.034)), (7.0, 7.0), 7, 7, exact_energy=-109.5423,
            hf_energy=-108.994)  # fmt: skip
# FermiNet's geometry (ferminet/configs/organic.py 'bicbut', angstrom; its units.py's bohr); Pfau et al. (2020)
# Table II: no exact energy, its CCSD(T)/CBS -155.9575 here (FermiNet's own -155.9263(6)), Hartree-Fock -154.9372.
_BICBUT = ((1.0487346562, 0.5208579773, 0.2375867187), (0.2497284256, -0.7666691493, 0.0936474818),
           (-0.1817326465, 0.4922777820, -0.6579637266), (-1.1430708301, -0.1901383337, 0.3048494250),
           (2.0107137141, 0.5520589541, -0.2623459977), (1.0071921280, 1.0672669240, 1.1766131856),
           (0.5438033167, -1.7129829738, -0.3260782874), (-0.2580605320, 0.6268443026, -1.7229636111),
           (-1.3778676954, 0.2935640723, 1.2498189977), (-1.9664163102, -0.7380906148, -0.1402911727))  # fmt: skip
BICBUT = System("bicyclobutane", tuple(tuple(x / 0.52917721067 for x in atom) for atom in _BICBUT),
                (6.0,) * 4 + (1.0,) * 6, 15, 15, exact_energy=-155.9575, hf_energy=-154.9372)  # fmt: skip
SYSTEMS = {s.name: s for s in (LI, LIH, BE, NE, N2, BICBUT)}


def owners(system: System) -> list[int]:
    """The nucleus each electron (up electrons first) starts at: as many as its charge, of each spin about half.

    The nuclei's electrons (heaviest first) are taken by the up and down spins in turn, so that no nucleus holds
    only up electrons; an ion's electrons go round the nuclei as far as they reach.
    """
    order = sorted(range(len(system.charges)), key=lambda m: -system.charges[m])
    slots = [m for m in order for _ in range(max(round(system.charges[m]), 1))]
    n = system.n_up + system.n_down
    slots = [slots[i % len(slots)] for i in range(n)]
    ups = (list(range(0, n, 2)) + list(range(1, n, 2)))[: system.n_up]  # every other slot, then the rest
    return [slots[i] for i in ups] + [slots[i] for i in range(n) if i not in ups]


def init_walker(key: jax.Array, system: System, dtype: jnp.dtype) -> jax.Array:
    """One walker: the electrons at their nuclei (``owners``), displaced by a unit Gaussian."""
    owner = owners(system)
    noise = jax.random.normal(key, (len(owner), 3), dtype)
    return jnp.asarray(system.coords, dtype)[jnp.asarray(owner)] + noise


def _dense(key: jax.Array, n_in: int, n_out: int, dtype: jnp.dtype) -> dict:
    kw, kb = jax.random.split(key)
    scale = 1.0 / jnp.sqrt(jnp.asarray(n_in, dtype))
    return {"w": scale * jax.random.normal(kw, (n_in, n_out), dtype), "b": 0.1 * jax.random.normal(kb, (n_out,), dtype)}


def init(key: jax.Array, system: System, hidden_one: int, hidden_two: int, layers: int, determinants: int,
         dtype: jnp.dtype) -> dict:  # fmt: skip
    """The parameters: ``layers`` mixing layers of widths ``hidden_one``/``hidden_two``, K = ``determinants``."""
    keys = jax.random.split(key, 2 * layers + 2)
    n_atoms = len(system.charges)
    d_one, d_two = 4 * n_atoms, 4
    params: dict = {"layers": []}
    for i in range(layers):
        layer = {"one": _dense(keys[2 * i], 3 * d_one + 2 * d_two, hidden_one, dtype)}
        if i < layers - 1:  # the last layer's two-electron stream would be unused
            layer["two"] = _dense(keys[2 * i + 1], d_two, hidden_two, dtype)
        params["layers"].append(layer)
        d_one, d_two = hidden_one, hidden_two
    head: dict = {"det_weights": jnp.ones((determinants,), dtype)}
    for k, (spin, n_spin) in enumerate((("up", system.n_up), ("down", system.n_down))):
        if n_spin:
            k1, k2, k3 = jax.random.split(jax.random.fold_in(keys[-2], k), 3)
            width = determinants * n_spin
            envelope = lambda k: 1.0 + 0.1 * jax.random.normal(k, (n_atoms, width), dtype)  # noqa: E731
            head[spin] = {**_dense(k1, d_one, width, dtype), "sigma": envelope(k2), "pi": envelope(k3)}
    return {"layers": params["layers"], "head": head, "jastrow": {"beta": jnp.asarray(0.5, dtype)}}


def log_psi(params: dict, r: jax.Array, system: System) -> jax.Array:
    """log|psi| of ONE walker ``r`` (n_electrons, 3)."""
    return signed_log_psi(params, r, system)[1]


def sign(params: dict, r: jax.Array, system: System) -> jax.Array:
    """The sign of psi at ONE walker ``r``: fixed-node DMC's nodes (``sv.dmc.DMC(..., sign=...)``)."""
    return signed_log_psi(params, r, system)[0]


def spin_means(x: jax.Array, n_up: int, axis: int) -> tuple[jax.Array, jax.Array]:
    """Each electron's means of ``x`` over the electrons (``axis``) of its own spin and of the opposite spin.

    ``x`` is the one-electron stream ``(n, H)`` (``axis=0``) or the two-electron stream ``(n, n, H2)``
    (``axis=1``, over the second electron); returns ``(same, opposite)``, each ``(n, H)``; the mean over no
    electrons is 0. Slices and sums rather than products with ``(n, n)`` averaging matrices: on a TPU a matrix
    product over 3 or 4 electrons pads them to tiles of 8 x 128 (``benchmarks/RESULTS.md``).
    """
    means = [jnp.mean(part, axis=axis) if part.shape[axis] else jnp.zeros_like(jnp.take(x, 0, axis=axis))
             for part in jnp.split(x, [n_up], axis=axis)]  # fmt: skip
    is_up = (jnp.arange(x.shape[0]) < n_up)[:, None]
    return jnp.where(is_up, means[0], means[1]), jnp.where(is_up, means[1], means[0])


def signed_log_psi(params: dict, r: jax.Array, system: System) -> tuple[jax.Array, jax.Array]:
    """``(sign of psi, log|psi|)`` of ONE walker ``r`` (n_electrons, 3).

    The one-electron stream (electron-nucleus vectors and distances) and the two-electron
    stream (electron-electron ones) go through layers that mix each electron's features with
    their means over same-spin and opposite-spin electrons (permutation equivariant); the
    head sums K signed determinants of orbitals with exponential envelopes; a Jastrow factor
    gives the electron-electron cusp.
    """
    n, n_up = r.shape[0], system.n_up
    coords = jnp.asarray(system.coords, r.dtype)
    ae = r[:, None, :] - coords[None]
    r_ae = jnp.linalg.norm(ae, axis=-1)
    ee = r[None, :, :] - r[:, None, :]
    # The diagonal is masked with eye(n) so that the norm's derivative is finite there.
    r_ee = jnp.linalg.norm(ee + jnp.eye(n)[..., None], axis=-1) * (1.0 - jnp.eye(n))
    one = jnp.concatenate([ae.reshape(n, -1), r_ae], axis=-1)
    two = jnp.concatenate([ee, r_ee[..., None]], axis=-1)

    up = jnp.arange(n) < n_up
    for layer in params["layers"]:
        mixed = [one, *spin_means(one, n_up, axis=0), *spin_means(two, n_up, axis=1)]
        new_one = jnp.tanh(jnp.concatenate(mixed, axis=-1) @ layer["one"]["w"] + layer["one"]["b"])
        one = new_one + one if new_one.shape == one.shape else new_one  # residual where the widths agree
        if "two" in layer:
            new_two = jnp.tanh(two @ layer["two"]["w"] + layer["two"]["b"])
            two = new_two + two if new_two.shape == two.shape else new_two

    # The head: orbitals times envelopes sum_m pi_m exp(-|sigma_m| r_im), one determinant per spin and k.
    head = params["head"]
    k = head["det_weights"].shape[0]
    signs, logdets = jnp.ones((k,), r.dtype), jnp.zeros((k,), r.dtype)
    for spin, rows in (("up", slice(0, n_up)), ("down", slice(n_up, n))):
        if spin in head:
            q, h, d = head[spin], one[rows], r_ae[rows]
            env = jnp.sum(q["pi"][None] * jnp.exp(-jnp.abs(q["sigma"])[None] * d[:, :, None]), axis=1)
            orbitals = ((h @ q["w"] + q["b"]) * env).reshape(h.shape[0], k, h.shape[0]).transpose(1, 0, 2)
            s, ld = sv.linalg.slogdet(orbitals)  # fast for small matrices on every platform
            signs, logdets = signs * s, logdets + ld
    shift = jax.lax.stop_gradient(jnp.max(logdets))  # log|sum_k w_k sign_k det_k|, without overflow
    dets = jnp.sum(head["det_weights"] * signs * jnp.exp(logdets - shift))
    log_dets = jnp.log(jnp.abs(dets)) + shift

    # Jastrow: sum_{i<j} a_ij r_ij / (1 + b r_ij), the cusp a = 1/4 (same spin) or 1/2 (opposite), b = sqrt(beta^2 + 1).
    cusp = jnp.where(up[:, None] == up[None, :], 0.25, 0.5)
    b = jnp.sqrt(params["jastrow"]["beta"] ** 2 + 1.0)
    return jnp.sign(dets), log_dets + jnp.sum(jnp.triu(cusp * r_ee / (1.0 + b * r_ee), k=1))
