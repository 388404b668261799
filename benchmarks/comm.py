"""What does one VMC step communicate, and when does it start to cost? Measured on CPU, modelled at scale.

Measured: the time of one ``psum`` all-reduce (``shard_map`` over a mesh of every
device) of float32 vectors of a few sizes, on 1, 2, 4, 8 fake CPU devices of one
process and on 1, 2, 4 processes of one fake device each (gloo over loopback, through
``python -m shardvmc.launch``). Median of ``--reps`` calls after two warm-up calls.

Modelled: the ring all-reduce cost ``2 (p-1)/p * bytes / B + 2 (p-1) * latency`` and an
all-to-all ``(p-1)/p * bytes_per_device / B + (p-1) * latency``, at 8, 64, 256, 1024
GPUs over NVLink and InfiniBand, for the collectives of one VMC step of a network with
P parameters and N walkers (see ``docs/cluster.md``, "Communication at scale"), and of one
DMC step (``sv.dmc.DMC``: its statistics, the comb's offsets and halos, and the all-gather
fallback; the messages and bytes are those of the compiled step, tests/test_comm_model.py).

Usage (from the repository root)::

    python benchmarks/comm.py                 # measure (about a minute on 2 cores) and model; prints tables
    python benchmarks/comm.py --model-only    # the model alone, instantly
    python benchmarks/comm.py --json out.json --reps 30
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from shardvmc.testing import cpu_environment

ROOT = Path(__file__).resolve().parents[1]
SIZES = (1_000, 100_000, 1_000_000)  # float32 elements: 4 kB, 400 kB, 4 MB
DEVICE_COUNTS = (1, 2, 4, 8)
PROCESS_COUNTS = (1, 2, 4)

# ---------------------------------------------------------------- the model (assumptions, stated)

LINKS = {
    # name: (bandwidth in bytes/s per GPU, latency per message in s)
    "NVLink (one node)": (450e9, 3e-6),
    "InfiniBand (across nodes)": (50e9, 5e-6),
}
GPUS = (8, 64, 256, 1024)
PARAMS = (10_000, 100_000, 1_000_000)
WALKER_TOTALS = (4096, 65536)
CG_ITERATIONS = 100
SCALARS = 1  # the Mean/Sum scalars of a step's energy kernel: one small all-reduce (latency only)
DMC_CASES = ((2, 65536), (30, 65536))  # (electrons, walkers in all) of the DMC rows
WALKER_COST_S = 1e-3  # assumed: one walker's local energy + gradient on one GPU (see docs/cluster.md)


def ring_allreduce_s(nbytes: float, p: int, bandwidth: float, latency: float) -> float:
    """The standard ring all-reduce model: 2 (p-1)/p * bytes / B + 2 (p-1) * latency."""
    if p == 1:
        return 0.0
    return 2 * (p - 1) / p * nbytes / bandwidth + 2 * (p - 1) * latency


def alltoall_s(total_bytes: float, p: int, bandwidth: float, latency: float) -> float:
    """An all-to-all of ``total_bytes`` spread over p devices: each sends (p-1)/p of its share."""
    if p == 1:
        return 0.0
    return (p - 1) / p * (total_bytes / p) / bandwidth + (p - 1) * latency


def allgather_s(bytes_per_device: float, p: int, bandwidth: float, latency: float) -> float:
    """A ring all-gather of ``bytes_per_device`` from each of p devices: (p-1) * bytes / B + (p-1) * latency."""
    if p == 1:
        return 0.0
    return (p - 1) * bytes_per_device / bandwidth + (p - 1) * latency


# One DMC step (float64), as compiled: ONE all-gather carrying, per device, 13 numbers (its sums of the step's 10
# statistics, its weight total and the two prefix sums that tell every device how far its neighbours' halos reach)
# and its two halos (its first and last h walkers: every field but the weight, and their prefix sums); no
# all-reduce. When every device's halos together exceed DMC_HALOS_IN_GATHER_BYTES (as sv.dmc's
# _HALOS_IN_GATHER_BYTES) the halos go by one ppermute each way instead, and the all-gather carries the 13 numbers.
# In the fallback: one all-gather of every walker (its fields and prefix sum).
DMC_STATISTICS = 10
DMC_GATHERED = 3 + DMC_STATISTICS  # numbers per device in the all-gather
DMC_HALO = 32  # sv.dmc.DMC's default halo
DMC_HALOS_IN_GATHER_BYTES = 2**18


def dmc_walker_numbers(n_electrons: int, ndim: int = 3) -> int:
    """``n_w``: the float64 numbers of one DMC walker (positions, drift, log|psi|, sign, local energy, weight)."""
    return 2 * n_electrons * ndim + 4


def dmc_step_collectives(
    n: int, p: int, n_w: int, halo: int = DMC_HALO, halos_in_gather_bytes: int = DMC_HALOS_IN_GATHER_BYTES
) -> dict[str, dict[str, tuple[int, int]]]:
    """The collectives of one DMC step on p devices, N = ``n`` walkers of ``n_w`` float64 numbers each.

    Returns:
        ``{"every step": {kind: (messages, bytes)}, "fallback only": {...}}``, ``bytes`` the size of each
        collective's result on one device, summed over its messages; empty on one device.
    """
    if p == 1:
        return {"every step": {}, "fallback only": {}}
    per_device = -(-n // p)  # the walkers of one device (the last ones padding)
    h = min(halo, per_device)
    sent = 8 * n_w  # a walker's numbers but its weight, and its prefix sum
    halos = 2 * h * sent  # the first and the last h walkers of a device
    if p * halos <= halos_in_gather_bytes:
        every = {"all-gather": (1, p * (8 * DMC_GATHERED + halos))}
    else:
        every = {"all-gather": (1, 8 * DMC_GATHERED * p), "collective-permute": (2, halos)}
    return {"every step": every, "fallback only": {"all-gather": (1, p * per_device * sent)}}


def dmc_step_comm_s(
    n: int, p: int, n_w: int, bandwidth: float, latency: float, halo: int = DMC_HALO, fallback: float = 0.0
) -> float:
    """Seconds of communication in one DMC step: every message a latency; ``fallback`` the share of its steps."""
    if p == 1:
        return 0.0
    parts = dmc_step_collectives(n, p, n_w, halo)
    every = parts["every step"]
    _, gathered = every["all-gather"]
    seconds = allgather_s(gathered / p, p, bandwidth, latency)  # the statistics, the offsets (and the halos)
    if "collective-permute" in every:
        messages, nbytes = every["collective-permute"]
        seconds += messages * latency + nbytes / bandwidth  # (both ways at once on a full-duplex link: an upper bound)
    gathers, everyone = parts["fallback only"]["all-gather"]
    fallback_s = (gathers - 1) * (p - 1) * latency + allgather_s(everyone / p, p, bandwidth, latency)
    return seconds + fallback * fallback_s


_SHAPE = re.compile(r"=\s*\(?((?:[a-z]+\d*\[[\d,]*\](?:\{[^}]*\})?(?:,\s*)?)+)\)?\s+(?:all-gather|all-reduce|"
                    r"collective-permute)(?:-start)?\(")  # fmt: skip
_ARRAY = re.compile(r"([a-z]+)(\d*)\[([\d,]*)\]")
_BITS = {"pred": 8}
_ANY = re.compile(r"\s(?:all-gather|all-reduce|collective-permute)(?:-start)?\(")


def _bytes(shapes: str) -> int:
    total = 0
    for kind, bits, dims in _ARRAY.findall(shapes):
        size = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
        total += size * (int(bits) if bits else _BITS.get(kind, 8)) // 8
    return total


def step_collectives(hlo: str) -> dict[str, dict[str, list[int]]]:
    """``{"every step" | "fallback only": {kind: [messages, bytes per device]}}`` of a compiled step's HLO text.

    The bytes are each collective's result on one device (an all-gather's gathered result; a ``ppermute``'s
    message); a collective inside a ``cond``'s branch (the comb's fallback) counts as fallback-only.
    """
    rows: dict[str, dict[str, list[int]]] = {"every step": {}, "fallback only": {}}
    for line in hlo.splitlines():
        match = _SHAPE.search(line)
        if not match or "-done" in line:
            continue
        kind = next(k for k in ("all-gather", "all-reduce", "collective-permute") if f" {k}" in line)
        where = "fallback only" if "/cond/branch" in line else "every step"
        entry = rows[where].setdefault(kind, [0, 0])
        entry[0] += 1
        entry[1] += _bytes(match.group(1))
    found = sum(n for part in rows.values() for n, _ in part.values())
    starts = len(_ANY.findall(hlo))
    if found != starts:
        raise RuntimeError(f"parsed {found} collectives, the program has {starts}")
    return rows


def step_comm_s(method: str, n: int, params: int, p: int, bandwidth: float, latency: float) -> float:
    """Seconds of communication in one VMC step (float32) by the method of the parameter update."""
    scalars = SCALARS * ring_allreduce_s(4, p, bandwidth, latency)
    gradient = ring_allreduce_s(4 * params, p, bandwidth, latency)
    if method == "gradient":  # SGD/Adam/KFAC-free: the Mean gradient only
        return scalars + gradient
    if method == "minSR":  # J re-sharded (N x P all-to-all), T = J J^T all-reduced (N x N), one size-P vector
        return (
            scalars
            + gradient
            + alltoall_s(4 * n * params, p, bandwidth, latency)
            + ring_allreduce_s(4 * n * n, p, bandwidth, latency)
        )
    if method == "CG":  # one size-P all-reduce per conjugate-gradient iteration
        return scalars + gradient + CG_ITERATIONS * ring_allreduce_s(4 * params, p, bandwidth, latency)
    raise ValueError(method)


def min_walkers_per_gpu(method: str, params: int, p: int, bandwidth: float, latency: float) -> int | None:
    """Fewest walkers per GPU for which communication is at most 10% of the step (None: none up to 10^6)."""

    def fits(per_gpu: int) -> bool:
        comm = step_comm_s(method, per_gpu * p, params, p, bandwidth, latency)
        return comm <= 0.1 * (comm + per_gpu * WALKER_COST_S)

    grid = sorted({int(round(1.05**k)) for k in range(284)})  # 1 .. 10^6, 5% apart
    previous = 0
    for per_gpu in grid:
        if fits(per_gpu):
            return next(n for n in range(previous + 1, per_gpu + 1) if fits(n))
        previous = per_gpu
    return None


def model_tables() -> tuple[str, dict[str, Any]]:
    """Markdown tables of the model, and the same numbers as data."""
    lines, data = [], {}
    lines.append("Modelled all-reduce of 4P bytes (one Mean gradient), milliseconds:\n")
    lines.append("| link | P | " + " | ".join(f"{g} GPUs" for g in GPUS) + " |")
    lines.append("|---|---|" + "---|" * len(GPUS))
    for link, (bw, lat) in LINKS.items():
        for params in PARAMS:
            row = [ring_allreduce_s(4 * params, g, bw, lat) * 1e3 for g in GPUS]
            data[f"allreduce {link} P={params}"] = row
            lines.append(f"| {link} | {params:.0e} | " + " | ".join(f"{t:.3g}" for t in row) + " |")
    lines.append(
        f"\nFewest walkers per GPU for which communication is at most 10% of a step "
        f"(InfiniBand, {WALKER_COST_S * 1e3:g} ms per walker-step; '-' = over 10% at any count up to 10^6):\n"
    )
    lines.append("| method | P | " + " | ".join(f"{g} GPUs" for g in GPUS) + " |")
    lines.append("|---|---|" + "---|" * len(GPUS))
    bw, lat = LINKS["InfiniBand (across nodes)"]
    for method in ("gradient", "CG", "minSR"):
        for params in PARAMS:
            row = [min_walkers_per_gpu(method, params, g, bw, lat) for g in GPUS]
            data[f"min walkers/GPU {method} P={params}"] = row
            lines.append(f"| {method} | {params:.0e} | " + " | ".join("-" if n is None else str(n) for n in row) + " |")
    lines.append(
        "\nStrong scaling: the most GPUs (a power of 2, up to 1024) at which communication is still at most "
        "10% of a step, for N walkers in all (InfiniBand):\n"
    )
    lines.append("| method | P | " + " | ".join(f"N = {n}" for n in WALKER_TOTALS) + " |")
    lines.append("|---|---|" + "---|" * len(WALKER_TOTALS))
    for method in ("gradient", "CG", "minSR"):
        for params in PARAMS:
            row = [max_gpus(method, params, n, bw, lat) for n in WALKER_TOTALS]
            data[f"max GPUs {method} P={params}"] = row
            lines.append(f"| {method} | {params:.0e} | " + " | ".join(str(g) for g in row) + " |")
    lines.append(
        "\nModelled DMC step (float64, a halo of 32 walkers), microseconds of communication; 'fallback' rows: the "
        "all-gather of every walker in every step (its worst case), against the VMC step's gradient all-reduce:\n"
    )
    lines.append("| link | electrons | N | step | " + " | ".join(f"{g} GPUs" for g in GPUS) + " |")
    lines.append("|---|---|---|---|" + "---|" * len(GPUS))
    for link, (bw, lat) in LINKS.items():
        for electrons, n in DMC_CASES:
            n_w = dmc_walker_numbers(electrons)
            for label, share in (("DMC", 0.0), ("DMC, fallback", 1.0)):
                row = [dmc_step_comm_s(n, g, n_w, bw, lat, fallback=share) * 1e6 for g in GPUS]
                data[f"dmc {link} electrons={electrons} N={n} {label}"] = row
                lines.append(f"| {link} | {electrons} | {n} | {label} | " + " | ".join(f"{t:.3g}" for t in row) + " |")
        row = [step_comm_s("gradient", 0, 100_000, g, bw, lat) * 1e6 for g in GPUS]
        lines.append(f"| {link} | - | - | VMC gradient, P = 1e+05 | " + " | ".join(f"{t:.3g}" for t in row) + " |")
    return "\n".join(lines), data


def max_gpus(method: str, params: int, n: int, bandwidth: float, latency: float) -> int:
    """The most GPUs (power of 2, <= 1024, <= n) for which n walkers keep communication at most 10% of a step."""
    best = 1
    for p in (2**k for k in range(1, 11)):
        if p > n:
            break
        comm = step_comm_s(method, n, params, p, bandwidth, latency)
        if comm <= 0.1 * (comm + n / p * WALKER_COST_S):
            best = p
    return best


# ---------------------------------------------------------------- the measurement


def measure(reps: int) -> dict[str, float]:
    """Median seconds of one psum of each size over a mesh of every device (every process)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    import shardvmc as sv

    if sv.distributed.is_launched():
        sv.distributed.initialize()
    mesh = sv.create_mesh()
    allreduce = jax.jit(
        jax.shard_map(
            lambda x: jax.lax.psum(x, "walkers"),
            mesh=mesh,
            in_specs=PartitionSpec(),
            out_specs=PartitionSpec(),
            check_vma=False,
        )
    )
    out = {}
    for size in SIZES:
        x = jax.device_put(jnp.ones(size, jnp.float32), NamedSharding(mesh, PartitionSpec()))
        for _ in range(2):
            allreduce(x).block_until_ready()
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            allreduce(x).block_until_ready()
            times.append(time.perf_counter() - start)
        out[str(size)] = float(np.median(times))
    return out


def _env(devices: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDVMC_")}
    cpu_environment(env, devices, replace=True)
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    return env


def run_all(reps: int) -> dict[str, dict[str, float]]:
    """Every measurement, each in a fresh process (group) of its own."""
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for d in DEVICE_COUNTS:
            out = Path(tmp) / f"d{d}.json"
            cmd = [sys.executable, __file__, "--worker", str(out), "--reps", str(reps)]
            subprocess.run(cmd, env=_env(d), check=True, timeout=600)
            results[f"1 process x {d} device{'s' if d > 1 else ''}"] = json.loads(out.read_text())
        for p in PROCESS_COUNTS:
            out = Path(tmp) / f"p{p}.json"
            cmd = [sys.executable, "-m", "shardvmc.launch", "-n", str(p), "--devices-per-process", "1", "--"]
            cmd += [sys.executable, __file__, "--worker", str(out), "--reps", str(reps)]
            subprocess.run(cmd, env=_env(1), check=True, timeout=600, cwd=ROOT, stdout=subprocess.DEVNULL)
            results[f"{p} process{'es' if p > 1 else ''} x 1 device (gloo)"] = json.loads(out.read_text())
    return results


def measured_table(results: dict[str, dict[str, float]]) -> str:
    lines = ["Measured psum all-reduce of float32 vectors, milliseconds (median):\n"]
    lines.append("| layout | " + " | ".join(f"{s * 4 / 1e3:g} kB" for s in SIZES) + " |")
    lines.append("|---|" + "---|" * len(SIZES))
    for layout, times in results.items():
        lines.append(f"| {layout} | " + " | ".join(f"{times[str(s)] * 1e3:.3g}" for s in SIZES) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=20, help="timed calls per size (median reported)")
    parser.add_argument("--model-only", action="store_true", help="print the model only, measure nothing")
    parser.add_argument("--json", default="", help="also write the numbers to this JSON file")
    parser.add_argument("--worker", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:  # one measurement, in a process started by run_all
        times = measure(args.reps)
        import jax

        if jax.process_index() == 0:
            Path(args.worker).write_text(json.dumps(times))
        return
    report: dict[str, Any] = {}
    if not args.model_only:
        report["measured"] = run_all(args.reps)
        print(measured_table(report["measured"]), end="\n\n")
    text, report["model"] = model_tables()
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
