"""An example over many seeds: every seed's energy, how many reached the target, the median and range.

Each seed runs as its own process (``python EXAMPLE --seed S --json ...`` with the options
given after ``--``), ``--jobs`` at a time; the table gives each seed's evaluation energy and
error bar, the step at which the training's 50-step average reached chemical accuracy (the
neural examples report it), the wall time and the load average at the seed's start and
end. The command fails (exit status 1) when fewer than ``--require`` seeds end at or below
the target: by default the example's exact energy plus chemical accuracy (1.6 mHa), else
``--target``.

    python benchmarks/seeds.py --seeds 0-9 --require 9 -- examples/neural_vmc.py --system Li
    python benchmarks/seeds.py --seeds 0-4 -- examples/neural_vmc.py --system Li --optimiser spring
    python benchmarks/seeds.py --seeds 0-4 -- examples/kfac_vmc.py --system Li
    python benchmarks/seeds.py --seeds 0-9 --jobs 2 --target -2.8885 -- examples/helium_vmc.py
    python benchmarks/seeds.py --seeds 0-2 --jobs 2 --require 3 --target 0 -- examples/neural_vmc.py --quick --devices 1
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

CHEMICAL_ACCURACY = 1.6e-3  # Hartree (1 kcal/mol)


def parse_seeds(text: str) -> list[int]:
    """``"0-9"`` -> 0..9; ``"0,3,5-6"`` -> [0, 3, 5, 6]."""
    seeds: list[int] = []
    for part in text.split(","):
        first, _, last = part.partition("-")
        seeds.extend(range(int(first), int(last or first) + 1))
    return seeds


def load() -> float:
    """The one-minute load average (what every figure here is measured beside)."""
    return os.getloadavg()[0]


class Seed:
    """One seed's process: started, polled, its summary read back."""

    def __init__(self, seed: int, command: list[str], folder: Path) -> None:
        self.seed, self.json, self.log = seed, folder / f"seed{seed}.json", folder / f"seed{seed}.log"
        self.load_start, self.start = load(), time.perf_counter()
        with open(self.log, "w") as out:  # start_new_session: the seed and its threads are killed as one group
            self.proc = subprocess.Popen([*command, "--seed", str(seed), "--json", str(self.json)], stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        self.row: dict[str, Any] | None = None

    def poll(self) -> bool:
        """Whether the process has ended (its row is then filled in)."""
        if self.proc.poll() is None:
            return False
        seconds = time.perf_counter() - self.start
        row: dict[str, Any] = {"seed": self.seed, "returncode": self.proc.returncode, "seconds": seconds,
                               "load": (self.load_start, load())}  # fmt: skip
        if self.proc.returncode == 0 and self.json.exists():
            summary = json.loads(self.json.read_text())
            row.update({k: summary.get(k) for k in ("energy", "error", "exact", "chemical_accuracy_step",
                                                    "best_average_50", "steps_done")})  # fmt: skip
        else:
            row["tail"] = self.log.read_text()[-2000:]
        self.row = row
        return True

    def kill(self) -> None:
        """End the seed's whole process group (its threads and any launcher children)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def sweep(command: list[str], seeds: list[int], jobs: int, folder: Path) -> list[dict[str, Any]]:
    """Run every seed, ``jobs`` at a time; the rows in seed order. Every process is ended whatever happens."""
    waiting, running, rows = list(seeds), [], []
    try:
        while waiting or running:
            while waiting and len(running) < jobs:
                running.append(Seed(waiting.pop(0), command, folder))
            time.sleep(0.2)
            for s in [s for s in running if s.poll()]:
                running.remove(s)
                assert s.row is not None
                rows.append(s.row)
                print(format_row(s.row, None), flush=True)
    finally:
        for s in running:
            s.kill()
    return sorted(rows, key=lambda r: r["seed"])


def target_of(rows: list[dict[str, Any]], target: float | None) -> float | None:
    """``target``, else the example's exact energy plus chemical accuracy (None when it reports none)."""
    if target is not None:
        return target
    exact = next((r["exact"] for r in rows if r.get("exact") is not None), None)
    return None if exact is None else exact + CHEMICAL_ACCURACY


def format_row(row: dict[str, Any], target: float | None) -> str:
    """One seed's line of the table."""
    if row.get("energy") is None:
        return f"| {row['seed']} | failed (exit {row['returncode']}) | | | {row['seconds']:.0f} | |"
    mark = "" if target is None else (" yes" if row["energy"] <= target else " no")
    step = row.get("chemical_accuracy_step")
    reached = "-" if "chemical_accuracy_step" not in row or row.get("best_average_50") is None else (
        f"step {step}" if step is not None else f"not reached (best {row['best_average_50']:.5f})")  # fmt: skip
    error = f" ± {row['error']:.5f}" if row.get("error") is not None else ""
    loads = f"{row['load'][0]:.1f} -> {row['load'][1]:.1f}"
    return f"| {row['seed']} | {row['energy']:.5f}{error} |{mark} | {reached} | {row['seconds']:.0f} | {loads} |"


def table(rows: list[dict[str, Any]], target: float | None) -> list[str]:
    """The markdown table and its summary lines (median, range, how many reached the target)."""
    lines = ["| seed | E (Ha) | <= target | 50-step average within chemical accuracy | seconds | load |",
             "|---|---|---|---|---|---|", *(format_row(r, target) for r in rows)]  # fmt: skip
    energies = [r["energy"] for r in rows if r.get("energy") is not None]
    if energies:
        lines.append(f"median {statistics.median(energies):.5f} Ha, range [{min(energies):.5f}, {max(energies):.5f}] "
                     f"over {len(energies)} of {len(rows)} seeds")  # fmt: skip
    if target is not None:
        lines.append(f"{converged(rows, target)} of {len(rows)} seeds at or below {target:.5f} Ha")
    return lines


def converged(rows: list[dict[str, Any]], target: float) -> int:
    """How many seeds ended at or below ``target``."""
    return sum(r.get("energy") is not None and r["energy"] <= target for r in rows)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        raise SystemExit("usage: seeds.py [options] -- EXAMPLE [example options]  (see --help)")
    split = argv.index("--")
    description = (__doc__ or "").split("\n\n")[0]
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seeds", default="0-9", help="seeds: 0-9, or 0,3,5-6 (default 0-9)")
    p.add_argument("--jobs", type=int, default=1, help="seeds run at a time (default 1)")
    p.add_argument("--require", type=int, default=0, help="fail unless this many seeds reach the target")
    p.add_argument("--target", type=float, help="the energy to reach (default: exact + 1.6 mHa, when reported)")
    p.add_argument("--json", metavar="PATH", help="write the rows here")
    p.add_argument("--out", metavar="DIR", help="keep each seed's summary and log here (default: a temporary folder)")
    args = p.parse_args(argv[:split])
    command = [sys.executable, *argv[split + 1 :]]
    seeds = parse_seeds(args.seeds)
    print(f"{len(seeds)} seeds, {args.jobs} at a time: {' '.join(argv[split + 1 :])}; load {load():.1f}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.out or tmp)
        folder.mkdir(parents=True, exist_ok=True)
        rows = sweep(command, seeds, args.jobs, folder)
    target = target_of(rows, args.target)
    print("\n".join(table(rows, target)))
    if args.json:
        Path(args.json).write_text(json.dumps({"command": argv[split + 1 :], "target": target, "rows": rows}, indent=2))
    if args.require and (target is None or converged(rows, target) < args.require):
        print(f"FAILED: fewer than {args.require} seeds reached the target", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
