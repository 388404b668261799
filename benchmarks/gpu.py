"""The kernel comparison of ``run.py`` on an accelerator, plus walkers per second.

For each walker count: the decorated local energy vs the hand-written
``jax.jit(shard_map(vmap(f)))`` (per-walker and ``Mean`` outputs, unchunked and with
``batch_size``), as interleaved ratios; walkers per second of the decorated kernel; and
its compiled temporary memory per device. Uses every device of JAX's default backend.

Usage (from the repository root)::

    python benchmarks/gpu.py                         # on a GPU machine: O2, 4096,16384,65536 walkers
    python benchmarks/gpu.py --walkers 8192 --batch-size 1024 --reps 41
    python benchmarks/gpu.py --cpu-devices 8         # no accelerator: a tiny CPU run (He, 64 walkers)
"""

import argparse
import json
import os
import sys
import time
from typing import Any


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--system", choices=("o2", "he"), help="trial function (default: o2 on accelerators, he on CPU)"
    )
    parser.add_argument("--walkers", default="", help="comma-separated walker counts (default: by platform)")
    parser.add_argument("--batch-size", type=int, help="batch_size of the chunked rows (default: by platform)")
    parser.add_argument("--reps", type=int, help="timed repetitions per figure (default 21 on accelerators, 5 on CPU)")
    parser.add_argument("--cpu-devices", type=int, default=0, help="no accelerator: run on this many fake CPU devices")
    parser.add_argument("--json", default="", help="also write the rows and machine to this JSON file")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.cpu_devices:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from run import set_cpu_devices

        set_cpu_devices(args.cpu_devices)
        os.environ["JAX_PLATFORMS"] = "cpu"
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import jax
    import system
    from harness import decorated_energy, hand_written, interleaved, ratio, rel_diff, temp_bytes
    from sections import Report, machine

    import shardvmc as sv

    accelerator = jax.default_backend() != "cpu"
    chosen = {"o2": system.O2, "he": system.HE}[args.system or ("o2" if accelerator else "he")]
    sizes = [int(s) for s in args.walkers.split(",") if s.strip()] or ([4096, 16384, 65536] if accelerator else [64])
    batch_size = args.batch_size or (1024 if accelerator else 4)
    reps = args.reps or (21 if accelerator else 5)
    mesh = sv.create_mesh()
    n_dev = mesh.shape["walkers"]
    info: dict[str, Any] = machine()
    info["system"] = chosen.name
    info["accelerator"] = accelerator
    print("shardvmc gpu benchmark:", ", ".join(f"{k}={v}" for k, v in info.items()))
    if not accelerator:
        print("NOTE: no accelerator present; this CPU run only checks that the script works.")
    report = Report()
    params = sv.replicate(chosen.init_params(), mesh)
    for n in sizes:
        n = sv.pad_n_walkers(n, n_dev)
        r = sv.shard_walker(chosen.init_walkers(n), mesh)
        for output in ("walker", "mean"):
            for bs in (None, batch_size):
                if bs is not None and bs >= n // n_dev:
                    continue
                dec = decorated_energy(chosen, mesh, output, bs)
                hand = hand_written(chosen.local_energy, mesh, output, bs)
                diff = rel_diff(dec(params, r), hand(params, r))
                times = interleaved({"decorated": lambda: dec(params, r), "hand": lambda: hand(params, r)}, reps)
                rat = ratio(times, "decorated", "hand")
                rate = n / sorted(times["decorated"])[len(times["decorated"]) // 2]
                what = f"{'per-walker' if output == 'walker' else 'Mean'} local energy, {n} walkers, batch_size={bs}"
                report.row(
                    8,
                    f"{what}: decorated / hand-written (max abs diff {diff:.1e})",
                    str(rat),
                    "<= 1.02",
                    rat.median <= 1.02,
                )
                if output == "walker":
                    memory = temp_bytes(dec.lower(params, r).compile()) / 2**20
                    report.row(8, f"{what}: walkers per second (decorated)", f"{rate:,.0f}")
                    report.row(8, f"{what}: temporary memory per device", f"{memory:,.2f} MiB")
    info["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    print()
    print(report.table())
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": info, "rows": report.rows, "when": time.time()}, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
