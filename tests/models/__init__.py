"""A corpus of realistic per-walker VMC programs, written in plain JAX, for tests and benchmarks.

A walker is one electron configuration ``r`` of shape ``(n_electrons, 3)``; parameters are
dicts of arrays. Each network module has ``init(key, system, **sizes)`` and
``log_psi(params, r, system)``; :mod:`models.hamiltonian` turns any ``log_psi(params, r)``
into a local energy (folx forward Laplacian, or jvp-of-grad loops over basis tangents).

- :mod:`models.systems`: atoms and molecules as data, with reference energies.
- :mod:`models.ferminet`: one- and two-electron streams, equivariant mixing, determinants.
- :mod:`models.psiformer`: self-attention over electrons, same determinant head.
- :mod:`models.complex_wf`: a plane-wave phase times a real FermiNet amplitude (complex log psi).
- :mod:`models.orbitals`: the shared head: envelopes, orbitals, log-sum of signed determinants.
- :mod:`models.constructs`: ``custom_jvp``, ``custom_vjp`` and ``while_loop`` pieces real code uses.
- :mod:`models.hamiltonian`: Coulomb potential and kinetic energy, several Laplacian methods.
"""
