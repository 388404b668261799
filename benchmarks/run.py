"""Benchmarks of shardvmc: do the decorators cost nothing, and communicate only what they must?

Prints one table. Every speed figure is a RATIO of two variants timed side by side in
this process (interleaved repetitions, median of the per-repetition ratios, quartiles
in brackets), never a bare time; the other figures are collective counts read from the
compiled HLO, compiled memory, and trace/compile counts.

Usage (from the repository root)::

    python benchmarks/run.py                  # the full run: O2, 2048 walkers, 8 fake CPU devices
    python benchmarks/run.py --quick          # tiny sizes, seconds (what the test runs)
    python benchmarks/run.py --only 1,2 --reps 41 --json results.json

Sections: 1 kernel cost, 2 call overhead, 3 the pytc pattern, 4 communication,
5 memory, 6 padding, 7 retracing. ``benchmarks/gpu.py`` measures on an accelerator.
"""

import argparse
import json
import os
import sys
import time
from typing import Any

from harness import fill_defaults  # this folder is on sys.path when run as a script; starts no backend

from shardvmc.testing import set_cpu_devices  # imports jax; starts no backend

QUICK = {
    "system": "he",
    "walkers": 64,
    "reps": 3,
    "tiny_walkers": 64,
    "tiny_calls": 20,
    "batch_size": 4,
    "memory_walkers": 4096,
    "pad_walkers": 64,
    "loop_walkers": 64,
    "loop_steps": 20,
    "energy_every": 5,
    "ferminet_walkers": 16,
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes and few repetitions (a smoke run)")
    parser.add_argument("--devices", type=int, default=8, help="fake CPU devices (default 8)")
    parser.add_argument("--only", default="", help="comma-separated sections to run, e.g. 1,4 (default: all)")
    parser.add_argument("--json", default="", help="also write the rows, facts and machine to this JSON file")
    parser.add_argument("--system", choices=("o2", "he"), help="trial function: o2 (16 electrons) or he (2)")
    sizes = (
        ("walkers", 2048, "walkers of sections 1-4"),
        ("reps", 31, "timed repetitions per figure (>= 20 for a real run)"),
        ("tiny-walkers", 2048, "walkers of section 2's small kernel"),
        ("tiny-calls", 200, "calls per repetition in section 2"),
        ("batch-size", 64, "batch_size of the chunked kernels in sections 3, 6, 7"),
        ("memory-walkers", 4096, "walkers of section 5"),
        ("pad-walkers", 4096, "walkers of section 6 (the short set has one fewer)"),
        ("loop-walkers", 2048, "walker slots of section 7 (one of them padding)"),
        ("loop-steps", 200, "Metropolis steps of section 7"),
        ("energy-every", 10, "steps between energy evaluations in section 7"),
        ("ferminet-walkers", 512, "walkers of the FermiNet-style row of section 1"),
    )
    for name, default, what in sizes:
        quick = QUICK[name.replace("-", "_")]
        parser.add_argument(f"--{name}", type=int, help=f"{what} (default {default}; --quick: {quick})")
    args = parser.parse_args(argv)
    defaults = {"system": "o2"} | {name.replace("-", "_"): default for name, default, _ in sizes}
    return fill_defaults(args, defaults, QUICK)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    set_cpu_devices(args.devices)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, here)
    sys.path.insert(1, os.path.join(os.path.dirname(here), "tests"))  # the model corpus, tests/models
    import sections  # imported here: JAX may start only after the device count is set
    import system

    import shardvmc as sv

    chosen = system.O2 if args.system == "o2" else system.HE
    mesh = sv.create_mesh()
    cfg = sections.Config(
        system=chosen,
        mesh=mesh,
        walkers=args.walkers,
        reps=args.reps,
        tiny_walkers=args.tiny_walkers,
        tiny_calls=args.tiny_calls,
        batch_size=args.batch_size,
        memory_walkers=args.memory_walkers,
        pad_walkers=args.pad_walkers,
        loop_walkers=args.loop_walkers,
        loop_steps=args.loop_steps,
        energy_every=args.energy_every,
        ferminet_walkers=args.ferminet_walkers,
    )
    if args.quick:
        cfg.ferminet_sizes = {"hidden_one": 8, "hidden_two": 4, "layers": 1, "determinants": 2}
    only = {int(s) for s in args.only.split(",") if s.strip()} or set(sections.SECTIONS)
    info: dict[str, Any] = sections.machine()
    info["system"] = chosen.name
    info["mesh"] = dict(mesh.shape)
    print("shardvmc benchmarks:", ", ".join(f"{k}={v}" for k, v in info.items()))
    if args.reps < 20:
        print(f"NOTE: {args.reps} repetitions (< 20): the ratios are a smoke test, not measurements.")
    report = sections.Report()
    start = time.perf_counter()
    for number, section in sections.SECTIONS.items():
        if number in only:
            t0 = time.perf_counter()
            print(f"section {number}: {section.__doc__.splitlines()[0]}", flush=True)
            section(cfg, report)
            report.facts.setdefault("section_seconds", {})[number] = round(time.perf_counter() - t0, 1)
    info["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    info["seconds"] = round(time.perf_counter() - start, 1)
    print()
    print("Ratios: median over repetitions of time(first) / time(second), [25%, 75%] quartiles.")
    print(report.table())
    if args.json:
        payload = {"machine": info, "config": {k: v for k, v in vars(args).items()}, "rows": report.rows}
        payload["facts"] = report.facts
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
