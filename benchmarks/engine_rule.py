"""The engine rule, measured: why shardvmc runs every kernel body with ``check_vma=False``.

    python benchmarks/engine_rule.py    # about 90 s of CPU time: 1.5-3 min on 2 cores, 8 fake devices

Hand-written ``jax.jit(jax.shard_map(jax.vmap(f), mesh, in_specs=(P(), P('w')),
out_specs=P('w'), check_vma=...))`` kernels, no shardvmc code, in float64:

(a) a small FermiNet-like log-psi (3 electrons; pair distances regularised with
    ``jnp.eye(n)``; a tanh layer; ``slogdet`` of a 3x3 orbital matrix) and its local
    energy, with the Laplacian from ``folx.forward_laplacian`` (sparsity propagation on)
    and from FermiNet's jvp-of-grad loop (``jax.linearize`` of the gradient, applied to
    the rows of ``jnp.eye(3n)``), under ``check_vma=True`` (replicated parameters cast
    with ``jax.lax.pcast(..., to="varying")``, the old workaround) and ``False``. Each case
    runs in a subprocess, because folx calls ``exit()`` when it fails. Compared with
    ``jax.vmap`` on one device.
(b) with ``check_vma=False``: per-walker gradients with respect to a ``P()`` input
    taken inside the body, and the gradient of a ``psum``'d mean taken outside, against
    ``jax.vmap`` (and, for contrast, the inside gradient under ``check_vma=True`` without
    the cast).
(c) the time of one per-walker kernel (the same local energy with folx's dense default,
    which ``check_vma=True`` accepts) under both settings, as the median of interleaved
    runs, and whether the optimized HLO differs.
"""

from shardvmc.testing import set_cpu_devices

# Before JAX starts: 8 fake CPU devices, and the workaround of an XLA CPU deadlock of the
# concurrency-optimized scheduler on larger programs.
set_cpu_devices(8)

import collections  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402

import folx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.flatten_util import ravel_pytree  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

jax.config.update("jax_enable_x64", True)

N_EL = 3  # electrons
N_WALKERS = 64  # 8 per device
AXIS = "w"


# ----------------------------------------------------------------------------- the wavefunction


def make_params():
    k = jax.random.split(jax.random.key(0), 3)
    n_feat = 3 + 1 + N_EL  # position, |r|, distances to the other electrons
    return {
        "w1": jax.random.normal(k[0], (n_feat, 8)) * 0.4,
        "b1": jax.random.normal(k[1], (8,)) * 0.1,
        "w2": jax.random.normal(k[2], (8, N_EL)) * 0.5,
    }


def walkers(n=N_WALKERS):
    return jax.random.normal(jax.random.key(1), (n, N_EL * 3))


def LOG_PSI(params, x):
    """log|psi| of one walker, x of shape (3n,)."""
    r = x.reshape(N_EL, 3)
    ee = r[:, None, :] - r[None, :, :]
    # FermiNet's trick: |r_i - r_j| with the diagonal regularised by an identity (a constant).
    pairs = jnp.linalg.norm(ee + jnp.eye(N_EL)[..., None], axis=-1) * (1 - jnp.eye(N_EL))
    feats = jnp.concatenate([r, jnp.linalg.norm(r, axis=-1, keepdims=True), pairs], axis=-1)
    h = jnp.tanh(feats @ params["w1"] + params["b1"])
    orbitals = (h @ params["w2"]) * jnp.exp(-jnp.linalg.norm(r, axis=-1, keepdims=True))
    return jnp.linalg.slogdet(orbitals)[1]


def potential(x):
    r = x.reshape(N_EL, 3)
    ee = r[:, None, :] - r[None, :, :]
    iu = np.triu_indices(N_EL, 1)
    return -N_EL * jnp.sum(1 / jnp.linalg.norm(r, axis=-1)) + jnp.sum(1 / jnp.linalg.norm(ee[iu], axis=-1))


def local_energy_folx(log_psi, sparsity_threshold=0):
    """E_loc with the Laplacian of log|psi| from folx (sparsity propagation when the threshold is > 0)."""

    def e_loc(params, x):
        out = folx.forward_laplacian(lambda y: log_psi(params, y), sparsity_threshold=sparsity_threshold)(x)
        grad = out.jacobian.dense_array.reshape(-1)
        return -0.5 * (out.laplacian + jnp.sum(grad**2)) + potential(x)

    return e_loc


def local_energy_jvp(log_psi):
    """E_loc with the Laplacian as FermiNet's loop: jvps of the gradient along the rows of eye(3n)."""

    def e_loc(params, x):
        grad, dgrad = jax.linearize(jax.grad(lambda y: log_psi(params, y)), x)
        eye = jnp.eye(x.size)
        lap = jax.lax.fori_loop(0, x.size, lambda i, acc: acc + dgrad(eye[i])[i], 0.0)
        return -0.5 * (lap + jnp.sum(grad**2)) + potential(x)

    return e_loc


# ----------------------------------------------------------------------------- kernels


def mesh():
    return Mesh(np.array(jax.devices()), (AXIS,), axis_types=(jax.sharding.AxisType.Auto,))


def hand_written(f, check_vma, out_specs=P(AXIS), cast=None):
    """``jit(shard_map(vmap(f)))``; ``cast=True`` casts the replicated params to varying first."""
    cast = check_vma if cast is None else cast

    def body(params, x):
        if cast:
            params = jax.tree_util.tree_map(lambda p: jax.lax.pcast(p, AXIS, to="varying"), params)
        return jax.vmap(f, in_axes=(None, 0))(params, x)

    return jax.jit(jax.shard_map(body, mesh=mesh(), in_specs=(P(), P(AXIS)), out_specs=out_specs, check_vma=check_vma))


def max_rel_err(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


# ----------------------------------------------------------------------------- (a) one case per process

LAPLACIANS = {
    "folx.forward_laplacian, sparsity_threshold=6": lambda f: local_energy_folx(f, sparsity_threshold=6),
    "jvp-of-grad over eye(3n) (jax.linearize + fori_loop)": local_energy_jvp,
}


def run_case(lap: str, check_vma: bool) -> dict:
    """The sharded local energies (a list), or the error, as JSON for the parent process."""
    params, x = make_params(), walkers()
    e_loc = LAPLACIANS[lap](LOG_PSI)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            out = hand_written(e_loc, check_vma)(params, x)
            return {"ok": True, "out": np.asarray(out).tolist()}
        except BaseException as e:  # folx raises SystemExit (it calls exit()) after a warning
            text = str(e) if not isinstance(e, SystemExit) else "\n".join(str(w.message) for w in caught)
            return {"ok": False, "error": f"{type(e).__name__}: {_key_line(text)}"}


def _key_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for key in ("should be called under", "inconsistent with"):
        for ln in lines:
            if key in ln:
                return ln.rstrip(":")
    return lines[-1] if lines else "(no message)"


def start_case(lap: str, check_vma: bool) -> subprocess.Popen:
    """Run one case in its own Python process (folx may exit() it), in the background."""
    args = [sys.executable, __file__, "case", str(list(LAPLACIANS).index(lap)), str(check_vma)]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def case_result(proc: subprocess.Popen) -> dict:
    stdout, stderr = proc.communicate(timeout=600)
    for line in stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    return {"ok": False, "error": f"exit code {proc.returncode}: {_key_line(stderr + stdout)}"}


# ----------------------------------------------------------------------------- (b) gradients


def gradients() -> dict:
    params, x = make_params(), walkers()
    flat, unravel = ravel_pytree(params)

    def grad_p(p, y):  # this walker's gradient of log psi w.r.t. the replicated parameters
        return jax.grad(lambda q: LOG_PSI(unravel(q), y))(p)

    ref = jax.jit(jax.vmap(grad_p, in_axes=(None, 0)))(flat, x)
    inside_off = hand_written(grad_p, False)(flat, x)
    inside_on = hand_written(grad_p, True, cast=False)(flat, x)  # no pcast: JAX psums the gradient

    def mean_sum(p, y):
        return jax.lax.psum(jnp.sum(jax.vmap(LOG_PSI, in_axes=(None, 0))(unravel(p), y)), AXIS) / N_WALKERS

    kernel = jax.shard_map(mean_sum, mesh=mesh(), in_specs=(P(), P(AXIS)), out_specs=P(), check_vma=False)
    outer = jax.jit(jax.grad(kernel))(flat, x)
    outer_ref = jax.grad(lambda p: jnp.mean(jax.vmap(LOG_PSI, in_axes=(None, 0))(unravel(p), x)))(flat)
    return {
        "inside_off": max_rel_err(inside_off, ref),
        "inside_on_nocast": max_rel_err(inside_on, ref),
        "outer_off": max_rel_err(outer, outer_ref),
    }


# ----------------------------------------------------------------------------- (c) cost

_OP = re.compile(r"^\s*(?:ROOT\s+)?\S+\s*=\s*\S+\s+([\w-]+)\(", re.M)


def op_counts(compiled) -> collections.Counter:
    return collections.Counter(_OP.findall(compiled.as_text()))


def cost(reps: int = 41, number: int = 3) -> dict:
    params, x = make_params(), walkers(512)
    e_loc = local_energy_folx(LOG_PSI)  # folx without sparsity: runs under check_vma=True
    compiled = {flag: hand_written(e_loc, flag).lower(params, x).compile() for flag in (True, False)}
    outs = {flag: k(params, x) for flag, k in compiled.items()}
    ref = jax.jit(jax.vmap(e_loc, in_axes=(None, 0)))(params, x)
    ops = {flag: op_counts(k) for flag, k in compiled.items()}
    times = {True: [], False: []}
    for rep in range(-2, reps):  # two warm-up rounds, then the order alternates
        for flag in (True, False) if rep % 2 == 0 else (False, True):
            start = time.perf_counter()
            for _ in range(number):
                out = compiled[flag](params, x)
            jax.block_until_ready(out)
            if rep >= 0:
                times[flag].append((time.perf_counter() - start) / number)
    ratios = sorted(a / b for a, b in zip(times[False], times[True]))
    q = statistics.quantiles(ratios, n=4)
    diff = {op: (ops[True][op], ops[False][op]) for op in ops[True] | ops[False] if ops[True][op] != ops[False][op]}
    return {
        "err_true": max_rel_err(outs[True], ref),
        "err_false": max_rel_err(outs[False], ref),
        "ms_true": 1e3 * statistics.median(times[True]),
        "ms_false": 1e3 * statistics.median(times[False]),
        "ratio": (statistics.median(ratios), q[0], q[2]),
        "n_ops": (sum(ops[True].values()), sum(ops[False].values())),
        "same_hlo": _strip_names(compiled[True].as_text()) == _strip_names(compiled[False].as_text()),
        "op_diff": diff,
        "reps": reps,
        "number": number,
    }


def _strip_names(hlo: str) -> str:
    """The HLO text without module/instruction names and metadata, to compare programs."""
    hlo = re.sub(r", metadata=\{[^}]*\}", "", hlo)
    hlo = re.sub(r"%[\w.\-]+", "%", hlo)
    return re.sub(r"^HloModule \S+", "HloModule", hlo, flags=re.M)


# ----------------------------------------------------------------------------- report


def main() -> None:
    start = time.perf_counter()
    print(
        f"JAX {jax.__version__}, folx {getattr(folx, '__version__', '?')}, {len(jax.devices())} fake CPU devices, "
        f"{N_WALKERS} walkers of {N_EL} electrons, float64\n"
    )
    # (a) runs in subprocesses while this process computes the references and (b); (c) times alone.
    cases = {(lap, flag): start_case(lap, flag) for lap in LAPLACIANS for flag in (True, False)}
    params, x = make_params(), walkers()
    refs = {lap: jax.jit(jax.vmap(make(LOG_PSI), in_axes=(None, 0)))(params, x) for lap, make in LAPLACIANS.items()}
    g = gradients()
    print("| (a) local energy, Laplacian by | check_vma=True (+ pcast) | check_vma=False |")
    print("|---|---|---|")
    for lap in LAPLACIANS:
        cells = []
        for flag in (True, False):
            r = case_result(cases[lap, flag])
            cells.append(f"rel. error {max_rel_err(r['out'], refs[lap]):.0e}" if r["ok"] else f"fails: `{r['error']}`")
        print(f"| {lap} | {cells[0]} | {cells[1]} |")

    print("\n| (b) gradients, check_vma=False | max rel. error vs vmap |")
    print("|---|---|")
    print(f"| per-walker grad w.r.t. a P() input, inside the body | {g['inside_off']:.0e} |")
    print(f"| grad of a psum'd mean, taken outside | {g['outer_off']:.0e} |")
    print(f"| (contrast) inside grad, check_vma=True without pcast | {g['inside_on_nocast']:.0e} |")

    c = cost()
    print("\n| (c) local energy, folx without sparsity, 512 walkers | check_vma=True (+ pcast) | check_vma=False |")
    print("|---|---|---|")
    print(f"| rel. error vs vmap | {c['err_true']:.0e} | {c['err_false']:.0e} |")
    runs = f"{c['reps']} interleaved runs of {c['number']} calls"
    print(f"| median time per call ({runs}) | {c['ms_true']:.2f} ms | {c['ms_false']:.2f} ms |")
    m, lo, hi = c["ratio"]
    print(f"| time False / True, median [quartiles] | | {m:.3f} [{lo:.3f}, {hi:.3f}] |")
    print(f"| optimized HLO ops | {c['n_ops'][0]} | {c['n_ops'][1]} |")
    print(f"| optimized HLO, names aside | | {'identical' if c['same_hlo'] else 'differs'} |")
    diff = ", ".join(f"{op} {a}/{b}" for op, (a, b) in sorted(c["op_diff"].items())) or "none"
    print(f"\nop kinds that differ (True/False): {diff}")
    print(f"total {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "case":
        result = run_case(list(LAPLACIANS)[int(sys.argv[2])], sys.argv[3] == "True")
        print("RESULT " + json.dumps(result), flush=True)
    else:
        main()
