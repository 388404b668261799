"""Cholesky solves of minSR-sized matrices: XLA's against shardvmc's blocked one, compile and run, side by side.

On a TPU XLA's Cholesky compiles into a program that grows with the matrix (minutes at 16,384
rows); ``sv.natural_gradient`` factors matrices above 4,096 rows there by blocks
(``shardvmc/_cholesky.py``). Each row is one process (a compile may be stopped at
``--limit`` seconds and the table goes on): float32, ``"highest"`` products, a damped
``J J^T`` of ``rows`` rows, the factor and a solve of one right-hand side; compile time,
the mean of three runs, and the relative residual.

Usage (from the repository root)::

    python benchmarks/cholesky.py                                # 2,048 to 16,384 rows
    python benchmarks/cholesky.py --rows 4096,16384 --variants xla,512x4,512x1
    python benchmarks/cholesky.py --rows 600 --limit 60          # seconds, on a CPU
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time


def measure(variant: str, rows: int) -> str:
    """One row in this process: ``variant`` is ``xla`` or ``BLOCKxPHASES``."""
    import jax
    import jax.numpy as jnp

    from shardvmc import _cholesky

    if variant == "xla":
        solve = _cholesky._xla_solve
    else:
        block, phases = map(int, variant.split("x"))

        def solve(a: jax.Array, b: jax.Array) -> jax.Array:
            return _cholesky.blocked_cho_solve(_cholesky.blocked_cholesky(a, block, phases), b, block)

    with jax.default_matmul_precision("highest"):
        j = jax.random.normal(jax.random.key(0), (rows, 2 * rows), jnp.float32) / jnp.sqrt(2.0 * rows)
        a = j @ j.T + 1e-3 * jnp.eye(rows, dtype=jnp.float32)
        b = jax.random.normal(jax.random.key(1), (rows,), jnp.float32)
        start = time.perf_counter()
        compiled = jax.jit(solve).lower(a, b).compile()
        compile_seconds = time.perf_counter() - start
        compiled(a, b).block_until_ready()
        start = time.perf_counter()
        for _ in range(3):
            x = compiled(a, b)
        x.block_until_ready()
        run_ms = (time.perf_counter() - start) / 3 * 1e3
        residual = float(jnp.linalg.norm(a @ x - b) / jnp.linalg.norm(b))
    return f"{compile_seconds:.1f} s, {run_ms:.1f} ms (residual {residual:.0e}, {jax.default_backend()})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="2048,4096,8192,16384", help="comma-separated matrix sizes")
    parser.add_argument("--variants", default="xla,512x4", help="xla and BLOCKxPHASES of the blocked one")
    parser.add_argument("--limit", type=float, default=150, help="seconds per row (its process is stopped)")
    parser.add_argument("--one", nargs=2, help=argparse.SUPPRESS)  # a row's process: VARIANT ROWS
    args = parser.parse_args()
    if args.one:
        print(measure(args.one[0], int(args.one[1])), flush=True)
        return
    variants = args.variants.split(",")
    print("| rows | " + " | ".join(variants) + " |")
    print("|---" * (len(variants) + 1) + "|")
    for rows in map(int, args.rows.split(",")):
        cells = []
        for variant in variants:
            command = [sys.executable, __file__, "--one", variant, str(rows)]
            try:
                done = subprocess.run(command, capture_output=True, text=True, timeout=args.limit, check=False)
                lines = done.stdout.strip().splitlines()
                cells.append(lines[-1] if done.returncode == 0 and lines else f"failed (exit {done.returncode})")
            except subprocess.TimeoutExpired:  # subprocess.run kills the child before raising
                cells.append(f"still compiling or running at the {args.limit:g} s limit")
        print(f"| {rows:,} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
