"""The examples' command line (devices, options, the summary and its plot); progress and checkpoints are sv.driver's."""

import argparse
import contextlib
import dataclasses
import json
from collections.abc import Sequence
from typing import Any

import jax

import shardvmc as sv
import shardvmc.testing


def start(devices: int) -> Any:
    """The mesh: ``devices`` fake CPU devices without an accelerator, else every device (of every launched process)."""
    with contextlib.suppress(RuntimeError):  # JAX has started already (a notebook, a test): the devices it has
        sv.testing.set_cpu_devices(devices)  # edits XLA_FLAGS: before JAX's backend starts
    if sv.distributed.is_launched():  # under python -m shardvmc.launch: join the other processes first
        sv.distributed.initialize()
    sv.enable_compilation_cache()  # the next run of the job loads its compiled programs ($SHARDVMC_COMPILATION_CACHE)
    chosen = jax.devices()
    return sv.create_mesh(chosen[:devices] if chosen[0].platform == "cpu" and jax.process_count() == 1 else chosen)


def parse_args(argv: Sequence[str] | None, config: type, description: str, *, quick: dict | None = None,
               choices: dict | None = None, sizes: dict | None = None) -> tuple[argparse.Namespace, Any]:  # fmt: skip
    """``(args, config)``: an option per field of the dataclass ``config``, ``--quick`` (``quick``'s settings), more.

    ``--size NAME``: the settings ``sizes[NAME]`` (the network's widths), over ``--quick``'s; the options given win.
    """
    p = argparse.ArgumentParser(description=description.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    choices = {"dtype": ("auto", "float32", "float64"), **(choices or {})}
    for f in dataclasses.fields(config):
        kind = {"int": int, "float": float, "str": str, "int | None": int}[str(f.type)]
        p.add_argument(f"--{f.name.replace('_', '-')}", type=kind, choices=choices.get(f.name),
                       help=f"(default {f.default})")  # fmt: skip
    p.add_argument("--quick", action="store_true", help="a few steps of a small run (a smoke test)")
    p.add_argument("--size", choices=list(sizes or {}), help="the network's size, a preset (default: the examples')")
    p.add_argument("--float32", dest="dtype", action="store_const", const="float32", help="--dtype float32")
    p.add_argument("--devices", type=int, default=8, help="fake CPU devices (ignored on accelerators, under a launch)")
    p.add_argument("--checkpoint", metavar="DIR", help="checkpoints and the log (log.jsonl); the same command resumes")
    p.add_argument("--checkpoint-every", type=int, default=100, help="steps between checkpoints")
    p.add_argument("--print-every", type=int, default=0, help="a progress line every N steps (0: none)")
    p.add_argument("--json", metavar="PATH", help="write the summary here")
    p.add_argument("--plot", metavar="PNG", help="plot the energy per step (needs matplotlib)")
    args = p.parse_args(argv)
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(config) if getattr(args, f.name) is not None}
    return args, config(**{**((quick or {}) if args.quick else {}), **(sizes or {}).get(args.size, {}), **given})


def announce(mesh: Any, dtype: str) -> sv.PrecisionPolicy:
    """The run's precision for the mesh's platform (``sv.precision_policy``), printed in the run's header."""
    policy = sv.precision_policy(dtype, mesh=mesh)
    if jax.process_index() == 0:
        print(f"{mesh.devices.size} {mesh.devices.flat[0].platform} devices; computing in {policy}", flush=True)
    return policy


def finish(args: argparse.Namespace, summary: dict[str, Any], title: str) -> None:
    """``--json``: the summary; ``--plot``: the energy per step, the evaluation's estimate, the exact and HF lines."""
    if jax.process_index() != 0:  # only process 0 writes
        return
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    if args.plot:
        import matplotlib.pyplot as plt  # the examples extra brings it

        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot(range(1, len(summary["energies"]) + 1), summary["energies"], lw=0.6, label="E per step")
        for name, style in (("energy", "g-"), ("exact", "k--"), ("hf", "r:")):  # the evaluation, exact, Hartree-Fock
            if summary.get(name) is not None:
                ax.axhline(summary[name], color=style[0], ls=style[1:], label=f"{name} {summary[name]:.5f}")
        tail = [e for e in summary["energies"][len(summary["energies"]) // 10 :] if e == e]  # no nan
        top = max(summary.get("hf") or summary["exact"], summary["exact"]) + 0.05
        ax.set(xlabel="step", ylabel="energy (Ha)", title=title, ylim=(min([summary["exact"], *tail]) - 0.01, top))
        ax.legend()
        fig.savefig(args.plot, dpi=120, bbox_inches="tight")
