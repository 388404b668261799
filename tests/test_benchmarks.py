"""The benchmark commands keep working, and the facts behind their tables hold.

``benchmarks/run.py --quick`` runs every section at tiny sizes in a subprocess (with
the 8 fake devices of the root conftest); the tests check what must hold whatever the
machine: outputs agree with the hand-written kernels, per-walker outputs move no data,
reductions are one all-reduce, ``batch_size`` bounds memory, a Metropolis loop
compiles each kernel once. Timings are printed by the command, never asserted.
"""

import json
import pathlib
import re
import statistics
import subprocess
import sys

import pytest
from optional_imports import unusable

ROOT = pathlib.Path(__file__).resolve().parents[1]
NONE = {"all-gather": 0, "all-reduce": 0, "all-to-all": 0, "collective-permute": 0, "reduce-scatter": 0}


def _run(script: str, *args: str, tmp_path: pathlib.Path, timeout: float = 240) -> tuple[str, dict]:
    out = tmp_path / "out.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args, "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout, json.loads(out.read_text())


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """stdout and JSON of ``benchmarks/run.py --quick``."""
    return _run("run.py", "--quick", tmp_path=tmp_path_factory.mktemp("bench"))


@pytest.mark.end_to_end  # benchmarks/run.py's smoke table: once, on CI's first leg
def test_prints_one_table_with_every_section(quick):
    stdout, data = quick
    assert "| # | measurement | figure | goal | met |" in stdout
    assert {row["section"] for row in data["rows"]} == set(range(1, 8))
    assert data["machine"]["devices"].startswith("8 x ")
    ratios = [row["figure"] for row in data["rows"] if row["section"] in (1, 2, 3, 6) and "/" in row["what"]]
    assert ratios and all(float(fig.split()[0]) > 0 for fig in ratios)


@pytest.mark.end_to_end  # benchmarks/run.py's smoke table: once, on CI's first leg
def test_decorated_kernels_compute_what_the_hand_written_ones_do(quick):
    facts = quick[1]["facts"]
    for output in ("walker", "mean", "ferminet"):
        assert facts[f"kernel_{output}"]["rel_diff"] < 1e-6
        assert facts[f"kernel_{output}"]["same_hlo_ops"], f"{output}: the decorated program differs from hand-written"
    assert facts["tiny_rel_diff"] < 1e-6
    assert max(facts["pytc_rel_diff"].values()) < 1e-4
    assert facts["jacobian_rel_diff"] < 1e-5
    assert facts["grad_sum_rel_diff"] < 1e-5
    assert facts["jtj_rel_diff"] < 1e-5


@pytest.mark.end_to_end  # benchmarks/run.py's smoke table: once, on CI's first leg
def test_per_walker_outputs_move_nothing_and_reductions_are_one_all_reduce(quick):
    comm = quick[1]["facts"]["collectives"]
    per_walker = [k for k in comm if k.startswith("per-walker")]
    reductions = [k for k in comm if not k.startswith(("per-walker", "pytc"))]
    assert len(per_walker) == 2 and len(reductions) == 4
    for name in per_walker:
        assert comm[name] == NONE, name
    for name in reductions:
        assert comm[name] == dict(NONE, **{"all-reduce": 1}), name
    pytc = quick[1]["facts"]["collectives_pytc"]
    for name in ("decorated", "decorated_b", "sharded_batched_vmap"):
        assert pytc[name] == NONE, name
        assert quick[1]["facts"]["output_spec_pytc"][name] == "P('walkers',)"


@pytest.mark.end_to_end  # benchmarks/run.py's smoke table: once, on CI's first leg
def test_batch_size_bounds_compiled_memory(quick):
    memory = quick[1]["facts"]["memory"]
    assert memory["None"] > memory["64"] > memory["16"] > 0
    assert memory["16"] <= memory["None"] / 8


@pytest.mark.end_to_end  # benchmarks/run.py's smoke table: once, on CI's first leg
def test_padding_is_masked_and_a_padded_set_communicates_like_a_full_one(quick):
    padding = quick[1]["facts"]["padding"]
    assert padding["internal_vs_reference"] < 1e-4
    assert padding["persistent_vs_reference"] < 1e-4
    assert padding["padding_warnings"] >= 1
    comm = padding["collectives"]
    full, internal, persistent = (comm[k] for k in comm if k.startswith("Mean"))
    assert full == persistent == dict(NONE, **{"all-reduce": 1})
    assert internal == full, "internal padding of a replicated input must not gather or broadcast walkers"
    walker_full, walker_internal, walker_persistent = (comm[k] for k in comm if k.startswith("per-walker"))
    assert walker_full == walker_persistent == NONE
    assert walker_internal == dict(NONE, **{"all-gather": 1}), "only the un-padded output may be gathered"


@pytest.mark.end_to_end  # benchmarks/run.py's smoke table: once, on CI's first leg
def test_metropolis_loop_traces_and_compiles_each_kernel_once(quick):
    loop = quick[1]["facts"]["loop"]
    assert loop["traces"] == {"log_prob": 1, "mcmc_step": 1, "energy": 1}
    assert loop["compiles_later_steps"] == 0
    assert loop["finite"] and 0 < loop["acceptance"] < 1


@pytest.fixture(scope="module")
def gpu_smoke(tmp_path_factory):
    """stdout, JSON and ``--out`` table of ``benchmarks/gpu.py --smoke`` (tiny sizes, 8 fake CPU devices)."""
    tmp = tmp_path_factory.mktemp("gpu")
    stdout, data = _run("gpu.py", "--smoke", "--out", str(tmp / "table.md"), tmp_path=tmp)
    return stdout, data, (tmp / "table.md").read_text()


@pytest.mark.end_to_end  # benchmarks/gpu.py's runs: once, on CI's first leg (pyproject.toml's markers)
def test_gpu_script_prints_one_table_with_every_ratio(gpu_smoke):
    stdout, data, table = gpu_smoke
    header = "| # | measurement | figure | goal | met |"
    assert "smoke run" in stdout and stdout.count(header) == 1 and table.count(header) == 1
    # dispatch, kernels, solvers, neural step, local energies against float64 (initial and trained parameters)
    assert {row["section"] for row in data["rows"]} == {2, 8, 9, 10, 11, 12}
    broken = [row for row in data["rows"] if row["figure"].startswith(("failed", "skipped"))]
    assert not broken, (broken, data["facts"].get("errors"))
    ratios = [row for row in data["rows"] if " / " in row["what"]]
    assert ratios and all(float(row["figure"].split()[0].rstrip(",")) > 0 for row in ratios)
    for row in data["rows"]:
        assert row["what"] in table
    assert any("FermiNet" in row["what"] and "walkers per second" in row["what"] for row in data["rows"])
    assert any(row["section"] == 10 and "walkers per second" in row["what"] for row in data["rows"])


@pytest.mark.end_to_end  # benchmarks/gpu.py's runs: once, on CI's first leg (pyproject.toml's markers)
def test_gpu_script_solvers_and_kernels_agree_with_the_hand_written_ones(gpu_smoke):
    rows = gpu_smoke[1]["rows"]
    solvers = {row["what"].split(": ")[1] for row in rows if row["section"] == 9 and "max rel diff" in row["what"]}
    assert solvers == {"dense", "minsr", "spring", "cg"}
    for row in rows:
        if "max rel diff" in row["what"]:
            assert float(row["what"].split("max rel diff ")[1].split(";")[0].rstrip(")")) < 1e-5, row["what"]


@pytest.mark.end_to_end  # benchmarks/gpu.py's runs: once, on CI's first leg (pyproject.toml's markers)
def test_gpu_script_reports_the_local_energies_errors_against_float64(gpu_smoke):
    """Section 11 and the kernel rows give each value's error against float64 on the CPU, in hartree."""
    rows = gpu_smoke[1]["rows"]
    errors = [row for row in rows if row["section"] == 11 and "median" in row["figure"]]
    assert len(errors) == 6  # two networks: the library on the platform, folx at JAX's defaults, a CPU in float32
    for row in errors:
        median = float(row["figure"].split("median ")[1].split(",")[0])
        assert 0 <= median < 1e-3, row  # float32 against float64: round-off, not hartrees
    # each network's goal: the platform's errors against float32's on a CPU by the same Laplacian (here: the same)
    goals = [row for row in rows if row["section"] == 11 and row not in errors]
    assert len(goals) == 2 and all(row["figure"] == "1.00, 1.00" and row["met"] is True for row in goals), goals
    kernels = [row for row in rows if row["section"] == 8 and "against float64 on the CPU" in row["what"]]
    assert kernels and all("median" in row["what"] for row in kernels)


@pytest.mark.end_to_end  # benchmarks/gpu.py's runs: once, on CI's first leg (pyproject.toml's markers)
def test_gpu_script_reports_the_evaluations_error_at_trained_parameters(gpu_smoke):
    """Section 12: both networks after training, float32 (the platform's, the host CPU's) against float64."""
    rows = [row for row in gpu_smoke[1]["rows"] if row["section"] == 12]
    assert len(rows) == 4 and {"templates'" in row["what"] for row in rows} == {True, False}
    for row in rows:
        gap = float(row["figure"].split("mean energy ")[1].split(" Ha")[0])
        mean = float(row["figure"].split("float64's (")[1].split(" ")[0])
        assert abs(gap) < 1e-4 and row["met"] is True, row
        assert -8.0 < mean < -2.0, row  # trained Li: between the initial guess and the exact -7.478


@pytest.fixture(scope="module")
def gpu_faults(tmp_path_factory):
    """stdout, JSON and rows (what: figure) of one ``gpu.py --smoke`` run of its cheapest rows (dispatch, then the
    solvers' data, dense, minsr, spring, cg: a few seconds each) in which minsr's process aborts (as XLA's compiler
    can) and spring's row never returns (a compile that hangs) past a 30 s ``--row-limit`` (over ten times what
    these rows take on a busy CPU): both faults' tests read this one run."""
    args = ("--smoke", "--only", "solvers,dispatch", "--abort-in", "minsr", "--hang-in", "spring", "--row-limit", "30")
    stdout, data = _run("gpu.py", *args, tmp_path=tmp_path_factory.mktemp("gpu_faults"), timeout=480)
    return stdout, data, {row["what"]: row["figure"] for row in data["rows"]}


def _solved(rows: dict[str, str]) -> set[str]:
    """The solver rows that computed their figures (``max rel diff`` in their name), by method."""
    return {what.split(": ")[1] for what in rows if "max rel diff" in what}


@pytest.mark.end_to_end  # benchmarks/gpu.py's runs: once, on CI's first leg (pyproject.toml's markers)
def test_gpu_script_keeps_the_table_when_a_row_kills_its_process(gpu_faults):
    """A row whose process aborts is that row's failure; the other rows are all there, those after it in a new
    process (which makes again the data an earlier process made)."""
    stdout, data, rows = gpu_faults
    crashed = [what for what in rows if what.endswith("minsr")]
    assert len(crashed) == 1 and rows[crashed[0]].startswith("failed: the process died (signal 6)"), rows
    assert _solved(rows) == {"dense", "cg"}, rows  # dense before the crash, cg after it (spring: the hang, below)
    assert any(row["section"] == 2 and "[" in row["figure"] for row in data["rows"])  # dispatch, before it
    assert stdout.count("| # | measurement | figure | goal | met |") == 1


@pytest.mark.end_to_end  # benchmarks/gpu.py's runs: once, on CI's first leg (pyproject.toml's markers)
def test_gpu_script_stops_a_row_past_its_limit_and_goes_on(gpu_faults):
    """A row that never returns (a compile that hangs) is stopped at --row-limit as that row's failure; the rows
    after it run in a new process and the table keeps every row."""
    stdout, _, rows = gpu_faults
    hung = [what for what in rows if what.endswith("spring")]
    assert len(hung) == 1 and rows[hung[0]].startswith("failed: still running after the 30 s row limit"), rows
    assert "dense" in _solved(rows) and "cg" in _solved(rows), rows  # before it; after it, in a new process
    assert stdout.count("| # | measurement | figure | goal | met |") == 1


@pytest.mark.end_to_end  # benchmarks/gpu.py's runs: once, on CI's first leg (pyproject.toml's markers)
def test_gpu_script_skips_rows_past_its_budget(tmp_path):
    stdout, data = _run("gpu.py", "--smoke", "--only", "solvers", "--budget", "0.001", tmp_path=tmp_path)
    assert data["rows"] and all(row["figure"].startswith("skipped") for row in data["rows"])
    assert stdout.count("| # | measurement | figure | goal | met |") == 1


@pytest.mark.end_to_end  # benchmarks/netket.py's smoke run: once, on CI's first leg
def test_netket_comparison_runs_its_shardvmc_side_without_netket(tmp_path):
    # NetKet is an optional benchmark dependency (pip install -e ".[bench]"), not in the test environment:
    # --smoke runs shardvmc's side of benchmarks/netket.py alone, with 13 walkers on the 8 fake devices.
    stdout, data = _run("netket.py", "--smoke", tmp_path=tmp_path)
    (row,) = data["rows"]
    side = row["shardvmc"]
    assert row["walkers"] == side["chains"] == 13 and "netket" not in row
    # the first step, two warm-up blocks, two timed rounds of 2; the same again against the bare step
    assert side["steps"] == 1 + 2 * 2 + 2 * 2 + 2 * 2 + 2 * 2
    assert row["loop_over_bare_step"] and 1.0 < side["expect"] < 4.0  # the evaluation at fixed parameters
    assert 1.0 < side["energy"] < 4.0  # a few steps of 13 walkers: near the exact 2 Ha, loosely
    assert data["lines"]["netket"] > 0 and data["lines"]["shardvmc"] > 0
    assert "| 13 |" in stdout


def test_checkpoint_io_reports_what_the_checksums_cost(tmp_path):
    _, data = _run(
        "checkpoint.py", "io", "--walkers", "64", "--electrons", "2", "--params", "4000", "--reps", "1",
        tmp_path=tmp_path,
    )  # fmt: skip
    for name in ("state save s", "state commit s", "state restore s", "checksums on save s", "checksums on restore s"):
        assert data[name] > 0, name
    assert data["checksums share of the state's commit"] > 0 and data["checksums share of the state's restore"] > 0


def test_checkpoint_history_reports_saves_at_two_run_lengths(tmp_path):
    _, data = _run("checkpoint.py", "history", "--at", "40", "400", "--saves", "2", "--reps", "1", tmp_path=tmp_path)
    for length in ("40", "400"):
        assert data[length]["save s"] > 0 and data[length]["bytes"] > 0, length
    # sizes, not times: a checkpoint does not grow with the run, one with the history in its metadata does
    assert data["bytes ratio"] < 1.2 and data["history in the metadata: bytes ratio"] > 2


def test_deepqmc_comparison_runs_its_shardvmc_side_without_deepqmc(tmp_path):
    # DeepQMC is an optional benchmark dependency (pip install -e ".[bench]"), not in the test environment:
    # --smoke runs shardvmc's side of benchmarks/deepqmc.py alone (the examples' network of LiH standing in for
    # DeepQMC's ansatz), KFAC on 16 walkers over the 8 fake devices, then its trajectory with KFAC and DeepQMC's
    # clipping on 1 and 3 devices for 13 walkers (padded on 3 devices and, in a real run, on 8).
    if (reason := unusable("kfac_jax")) is not None:  # its shardvmc side trains with shardvmc.kfac
        pytest.skip(f"benchmarks/deepqmc.py --smoke: {reason}")
    stdout, data = _run("deepqmc.py", "--smoke", tmp_path=tmp_path, timeout=1200)
    (row,) = data["rows"]
    side = row["shardvmc"]
    assert row["devices"] == 8 and "deepqmc" not in row and "ratio" not in row
    assert side["energy"]["steps"] == 1 + 2 * 1 + 2 * 1  # the first step, two warm-up blocks, two rounds of 1
    assert -12.0 < side["energy"]["mean"] < -2.0  # LiH (-8.07 Ha) from an untrained network: loosely
    assert set(row["pieces"]) >= {"sampler step", "local energy", "gradient of log|psi|", "optimiser step (KFAC)"}
    assert all(piece["shardvmc_ms"] > 0 for piece in row["pieces"].values())
    runs = data["trajectory"]["runs"]["kfac"]
    assert set(runs) == {"1", "3"} and data["trajectory"]["walkers"] == 13
    assert runs["3"]["energy_max_diff"] < 1e-3 and runs["3"]["params_max_diff"] < 1e-3  # float32 round-off
    assert data["lines"]["deepqmc"] > 0 and data["lines"]["shardvmc"] > 0
    assert "| 8 |" in stdout


@pytest.mark.end_to_end  # a smoke run of benchmarks/dmc.py: once, on CI's first leg
def test_dmc_script_prints_the_energies_the_step_ratios_and_the_traffic(tmp_path):
    stdout, data = _run("dmc.py", "--quick", tmp_path=tmp_path)
    assert "smoke run" in stdout and "| helium |" in stdout and "extrapolated to tau = 0" in stdout
    (name,) = data["energies"]
    e0, err0 = data["energies"][name]["extrapolated"]
    assert name == "helium" and err0 > 0 and -3.5 < e0 < -2.3  # 16 walkers x 12 steps: loosely
    ratios = data["timing"]["ratios"]
    assert set(ratios) == {"VMC, 1 move", "VMC, 10 moves (default)"} and all(r[0] > 0 for r in ratios.values())
    traffic = data["traffic"]
    assert traffic["devices"] == 8 and traffic["steps"] == 3
    every, fallback = traffic["collectives"]["every step"], traffic["collectives"]["fallback only"]
    # one all-gather a step: each device's statistics, weight total, prefix sums and halo walkers
    assert set(every) == {"all-gather"} and every["all-gather"][0] == 1
    assert set(fallback) == {"all-gather"}  # every walker, only when a copy reaches past the halos


FAKE_EXAMPLE = """
import argparse, json, sys
p = argparse.ArgumentParser()
p.add_argument("--seed", type=int)
p.add_argument("--json")
args = p.parse_args()
if args.seed == 1:
    sys.exit("seed 1 fails")
summary = {"energy": -1.0 - 0.1 * args.seed, "error": 0.01, "exact": -1.2, "chemical_accuracy_step": None,
           "best_average_50": -1.0}
open(args.json, "w").write(json.dumps(summary))
"""


def _sweep(*args: str, cwd: pathlib.Path = ROOT, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "seeds.py"), *args], capture_output=True,
                          text=True, timeout=timeout, cwd=cwd)  # fmt: skip


@pytest.mark.parametrize("require", [2, 3])
def test_seed_sweep_counts_the_seeds_at_the_target_and_fails_below_the_required_count(tmp_path, require):
    # an example whose seed s ends at -1 - 0.1 s (seed 1 crashes): exact -1.2, so the default target -1.1984 is
    # reached by seeds 2 and 3 only
    (tmp_path / "example.py").write_text(FAKE_EXAMPLE)
    out = tmp_path / "rows.json"
    proc = _sweep("--seeds", "0-3", "--jobs", "2", "--require", str(require), "--json", str(out), "--",
                  str(tmp_path / "example.py"))  # fmt: skip
    assert proc.returncode == (0 if require <= 2 else 1), proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    assert abs(data["target"] - (-1.2 + 1.6e-3)) < 1e-12
    assert [r["seed"] for r in data["rows"]] == [0, 1, 2, 3]
    assert data["rows"][1]["returncode"] != 0 and "energy" not in data["rows"][1]
    assert [r.get("energy") for r in data["rows"]] == pytest.approx([-1.0, None, -1.2, -1.3])
    assert "2 of 4 seeds at or below -1.19840 Ha" in proc.stdout
    assert "median -1.20000 Ha, range [-1.30000, -1.00000] over 3 of 4 seeds" in proc.stdout
    assert ("FAILED" in proc.stderr) == (require > 2)


@pytest.mark.end_to_end  # three short helium optimisations: once, on CI's first leg
def test_seed_sweep_of_the_helium_example_converges_on_every_seed(tmp_path):
    # docs/getting-started.md: 1000 walkers and 20 steps end near -2.890 Ha (the trial function's optimum; exact
    # -2.9037); 40 steps from alpha = 1.7 reach -2.885 on every seed (benchmarks/RESULTS.md, seed sweeps)
    out = tmp_path / "rows.json"
    example = ["examples/helium_vmc.py", "--walkers", "1000", "--steps", "40", "--devices", "2"]
    proc = _sweep("--seeds", "0-2", "--jobs", "2", "--require", "3", "--target", "-2.885", "--json", str(out), "--",
                  *example, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert all(-2.9037 - 0.01 < r["energy"] <= -2.885 for r in rows)
    assert len({r["energy"] for r in rows}) == 3  # three seeds, three different runs


# The protocol of the peer ratios (benchmarks/harness.py): its rules on made-up times and loads, no timing.


@pytest.fixture(scope="module")
def harness():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import harness  # pyright: ignore[reportMissingImports]  # benchmarks/ on the path; starts no backend

        yield harness
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def test_harness_imports_without_shardvmc_or_folx():
    """``deepqmc_pieces.py`` times with ``harness`` in DeepQMC's own interpreter, which has neither."""
    code = "import sys; sys.modules['shardvmc'] = sys.modules['folx'] = None; import harness; harness.interleaved"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT / "benchmarks")
    assert proc.returncode == 0, proc.stderr[-2000:]


_LOOPS_HLO = """HloModule jit_step

%fused_computation (param_0: f32[8]) -> f32[8] {
  %param_0 = f32[8]{0} parameter(0)
  ROOT %tanh.1 = f32[8]{0} tanh(%param_0)
}

%hash_body (p: (s32[], u32[8])) -> (s32[], u32[8]) {
  %p = (s32[], u32[8]{0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = u32[8]{0} get-tuple-element(%p), index=1
  %copy.1 = s32[] copy(%i)
  %add_fusion = u32[8]{0} fusion(%x), kind=kLoop, calls=%fused_computation
  ROOT %t = (s32[], u32[8]{0}) tuple(%copy.1, %add_fusion)
}

%move_body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]{0}) parameter(0)
  %x = f32[8]{0} get-tuple-element(%p), index=1
  %w.1 = (s32[], u32[8]{0}) while(%p), condition=%cond, body=%hash_body
  %w.2 = (s32[], u32[8]{0}) while(%p), condition=%cond, body=%hash_body
  %dot.3 = f32[8,8]{1,0} dot(%x, %x), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %tanh_fusion = f32[8]{0} fusion(%x), kind=kLoop, calls=%fused_computation
  %tanh_fusion.2 = f32[8]{0} fusion(%x), kind=kLoop, calls=%fused_computation
  %bitcast.4 = f32[8]{0} bitcast(%x)
  ROOT %t = (s32[], f32[8]{0}) tuple(%x, %x)
}

ENTRY %main.9 (Arg_0.1: f32[8]) -> f32[8] {
  %Arg_0.1 = f32[8]{0} parameter(0)
  %constant.2 = s32[] constant(0)
  %while.7 = (s32[], f32[8]{0}) while(%Arg_0.1), condition=%cond, body=%move_body
  ROOT %gte = f32[8]{0} get-tuple-element(%while.7), index=1
}
"""


def test_move_loop_counts_the_work_of_the_largest_loop_body_and_its_inner_loops(monkeypatch):
    """``deepqmc_pieces.move_loop``: the sampler's move loop by instruction kind (no work for tuples, parameters,
    constants, bitcasts), and the loops it runs (the threefry hashes of ``jax.random`` on CPUs)."""
    import importlib.util

    import jax
    import jax.numpy as jnp

    monkeypatch.setattr(sys, "path", list(sys.path))  # the module puts benchmarks/ on it
    spec = importlib.util.spec_from_file_location("deepqmc_pieces", ROOT / "benchmarks" / "deepqmc_pieces.py")
    assert spec is not None and spec.loader is not None
    pieces = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pieces)
    census = pieces.move_loop(_LOOPS_HLO)
    assert census == {"instructions": {"while": 2, "fusion": 2, "dot": 1}, "inner loops": [2, 2]}
    assert pieces.move_loop(jax.jit(jnp.tanh).lower(jnp.ones(3)).compile().as_text()) == {}
    looped = jax.jit(lambda x: jax.lax.fori_loop(0, 3, lambda i, y: jnp.tanh(y @ y), x)).lower(jnp.ones((4, 4)))
    assert pieces.move_loop(looped.compile().as_text())["instructions"]


def _idle_meter(harness, others=0.0, load=0.3):
    """A LoadMeter whose clock advances 1 s a reading, while other processes take ``others`` cores."""
    state = {"t": 0.0, "busy": 0, "own": 0}

    def clock():
        state["t"] += 1.0
        return state["t"]

    def read():
        state["own"] += 100
        state["busy"] += 100 + round(100 * others)
        return state["busy"], state["own"]

    return harness.LoadMeter(read=read, clock=clock, loadavg=lambda: (load, 0.0, 0.0), ticks_per_second=100)


def _sides(noise):
    """Two sides whose per-round ratio is 0.5 + noise[k] / calls (k counting rounds): longer rounds, less noise."""
    k = {"a": 0}

    def a(calls):
        k["a"] += 1
        return calls * (0.5 + noise[k["a"] % len(noise)] / calls)

    return {"a": a, "b": lambda calls: float(calls)}


def test_peer_protocol_lengthens_the_rounds_until_the_quartiles_settle(harness):
    p = harness.Protocol(batch=10, max_rounds=60, spread=0.1, max_calls=16)
    m = harness.measure(_sides([-0.3, 0.3, -0.25, 0.25, 0.0]), p, _idle_meter(harness), warm_up=0)
    assert m["calls"] == 4 and m["ratio"]["settled"]  # 1 call: +-0.25, 2: +-0.125, 4: +-0.06
    assert [r["calls"] for r in m["rounds"]] == [1] * 10 + [2] * 10 + [4] * 10
    assert m["ratio"]["reps"] == m["rounds_at_length"] == 10 and abs(m["ratio"]["median"] - 0.5) < 0.02
    assert m["ratio"]["q75"] - m["ratio"]["median"] <= 0.1 and m["ratio"]["median"] - m["ratio"]["q25"] <= 0.1
    assert all(r["load"] == 0.3 and r["others"] == 0.0 for r in m["rounds"]) and m["above"] is False


def test_peer_protocol_stops_unsettled_at_its_round_cap(harness):
    p = harness.Protocol(batch=10, max_rounds=40, spread=0.1, max_calls=2)
    m = harness.measure(_sides([-0.9, 0.9, -0.8, 0.8]), p, _idle_meter(harness), warm_up=0)
    assert len(m["rounds"]) == 40 and m["calls"] == 2 and m["rounds_at_length"] == 30  # 10 at 1 call, 30 at 2
    assert not m["ratio"]["settled"]


@pytest.mark.parametrize(
    ("ratio", "at_length", "total", "calls", "expected"),
    [
        ((0.50, 0.45, 0.58), 10, 10, 1, "done"),
        ((0.50, 0.35, 0.58), 10, 10, 1, "longer"),
        ((0.50, 0.35, 0.58), 10, 30, 16, "more"),  # at max_calls: more rounds of that length
        ((0.50, 0.45, 0.65), 10, 60, 4, "cap"),  # the next batch would pass max_rounds
    ],
)
def test_peer_protocol_next_step(harness, ratio, at_length, total, calls, expected):
    r = harness.Ratio(ratio[0], ratio[1], ratio[2], at_length)
    assert harness.next_step(r, at_length, total, calls, harness.Protocol(batch=10, max_rounds=60)) == expected


def test_load_meter_counts_the_cpu_of_other_processes_only(harness):
    # /proc/<pid>/stat of this process (10), its worker (11, whose name holds ") (" and spaces) and a stranger (12):
    # fields after the name: state, ppid, ..., utime (14th field), stime, cutime, cstime
    def stat(pid, name, ppid, ticks):
        return f"{pid} ({name}) S {ppid} 0 0 0 0 0 0 0 0 0 {ticks} 0 0 0 20 0 1 0"

    stats = {10: stat(10, "python", 1, 50), 11: stat(11, "py ) (worker", 10, 70), 12: stat(12, "other", 1, 900)}
    assert harness.tree_ticks(stats, 10) == 120 and harness.tree_ticks(stats, 12) == 900
    assert harness.busy_ticks("cpu  10 1 5 1000 7 2 3 4 0 0\ncpu0 ...") == 10 + 1 + 5 + 2 + 3 + 4  # idle, iowait out
    readings = iter([(0, 0), (250, 150), (450, 350)])  # 1 s apart: others took 1 core, then none
    times = iter([0.0, 1.0, 2.0])
    meter = harness.LoadMeter(read=lambda: next(readings), clock=lambda: next(times), loadavg=lambda: (1.7, 0, 0),
                              ticks_per_second=100)  # fmt: skip
    first, second = meter.reading(), meter.reading()
    assert first == {"load": 1.7, "others": 1.0, "span": 1.0} and second["others"] == 0.0
    # the run's figure weighs each round by its span; above max_load (0.5 cores) it is marked
    summary = harness.load_summary([{**first, "span": 3.0}, second], max_load=0.5)
    assert summary["others"] == 0.75 and summary["others_max"] == 1.0 and summary["above"] is True
    assert summary["load"] == [1.7, 1.7]
    unknown = harness.LoadMeter(read=lambda: None, loadavg=lambda: (0.2, 0, 0)).reading()
    assert unknown["others"] is None and harness.load_summary([unknown], 0.5)["above"] is None


def _run_record(median, above):
    ratio = {"median": median, "q25": median - 0.05, "q75": median + 0.05, "settled": True}
    return {"ratio": ratio, "load": {"above": above, "load": [0.5, 1.2], "others": 0.9 if above else 0.1}}


def test_independent_runs_repeat_a_run_taken_above_the_load_and_report_the_median_of_medians(harness):
    p = harness.Protocol(runs=3, extra_runs=3)
    records = iter([_run_record(0.9, True), _run_record(0.52, False), _run_record(0.8, True),
                    _run_record(0.55, False), _run_record(0.50, False)])  # fmt: skip
    logged = []
    result = harness.independent_runs(lambda i: next(records), p, logged.append)
    assert result["counted"] == [1, 3, 4] and len(result["runs"]) == 5 and result["above_load"] == 0
    assert sum("repeated" in line for line in logged) == 2
    combined = harness.median_of_runs([result["runs"][i]["ratio"] for i in result["counted"]])
    assert combined["median"] == 0.52 and combined["runs"] == [0.52, 0.55, 0.5] and combined["settled"] == 3
    assert combined["q25"] == pytest.approx(0.47) and combined["q75"] == pytest.approx(0.57)
    assert harness.fmt_runs(combined).startswith("0.520 [0.470, 0.570] (runs 0.520, 0.550, 0.500")


def test_independent_runs_say_when_every_run_was_above_the_load(harness):
    p = harness.Protocol(runs=3, extra_runs=2)
    result = harness.independent_runs(lambda i: _run_record(0.6 + i / 100, True), p, lambda line: None)
    assert len(result["runs"]) == 5 and result["counted"] == [0, 1, 2] and result["above_load"] == 3


def test_time_to_accuracy_is_measured_by_the_protocol(harness, monkeypatch, capsys):
    """``deepqmc.py --train``: run i from seed i, the load of every run kept, a run taken above the load repeated
    (with the next seed), and the figure the median over the counted runs of the time at which shardvmc reaches
    DeepQMC's final energy over DeepQMC's (a side that never reaches it: the slowest)."""
    import importlib.util

    # by its path, under another name: `deepqmc` is DeepQMC's package; the script takes its folder off sys.path
    monkeypatch.setattr(sys, "path", list(sys.path))
    spec = importlib.util.spec_from_file_location("deepqmc_benchmark", ROOT / "benchmarks" / "deepqmc.py")
    assert spec is not None and spec.loader is not None
    deepqmc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(deepqmc)

    # seconds per shardvmc step by seed (DeepQMC's: 1 s), and whether its run was taken above the load;
    # seed 3's shardvmc stays above DeepQMC's final energy
    runs = {0: (0.5, False), 1: (0.9, True), 2: (0.4, False), 3: (0.3, False)}

    def child(flag, devices, args):
        per_step, above = runs[args.seed]
        sv_energies = [-7.0] * 60 if args.seed == 3 else [-8.0] * 60
        return {
            "devices": devices, "ratio": {"median": per_step, "q25": 0, "q75": 1, "n": 60},
            "train": {"shardvmc": [per_step] * 60, "deepqmc": [1.0] * 60},
            "shardvmc": {"energies": sv_energies}, "deepqmc": {"energies": [-7.5] * 10 + [-8.0] * 50},
            "load": {"above": above, "load": [0.1, 0.4], "others": 0.9 if above else 0.05, "others_max": 1.0},
            "train_rounds": [{"utc": "12:00:00"}, {"utc": "12:01:00"}],
        }  # fmt: skip

    monkeypatch.setattr(deepqmc, "run_child", child)
    args = deepqmc.parse_args(["--train", "60", "--runs", "3", "--extra-runs", "2", "--seed", "0"])
    row = deepqmc.train_runs(8, args)
    assert [r["seed"] for r in row["train_runs"]] == [0, 1, 2, 3]
    assert [r["counted"] for r in row["train_runs"]] == [True, False, True, True]
    # DeepQMC reaches -8.0 (its last fifth's mean) when its 20-step mean does: after step 30, at 30 s
    reached = [r["reached"] for r in row["train_runs"]]
    assert [r["deepqmc"] for r in reached] == [30.0] * 4 and reached[0]["shardvmc"] == pytest.approx(10.0)
    assert reached[3]["shardvmc"] is None and reached[3]["ratio"] == float("inf")
    assert row["time_ratio"] == pytest.approx(1 / 3)  # the median of 1/3, 4/15 (seed 2) and inf (seed 3)
    assert row["seed"] == 0 and row["ratio"]["median"] == 0.5  # the first counted run's step quartiles
    deepqmc.time_to_accuracy([row], plot="")
    table = capsys.readouterr().out
    assert "| 8 | 1 (not counted: above the load limit) |" in table and "not reached" in table
    assert "**median of the counted runs** | | | | **0.333** |" in table


def test_cholesky_script_puts_xlas_and_the_blocked_solve_side_by_side():
    """One process a cell: both solves' residuals at float32's level; a row past its limit is a cell, not a crash."""
    command = [sys.executable, str(ROOT / "benchmarks" / "cholesky.py"), "--variants", "xla,128x2"]
    proc = subprocess.run([*command, "--rows", "300"], capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = [line for line in proc.stdout.splitlines() if line.startswith("| 300 |")]
    residuals = [float(r) for r in re.findall(r"residual ([0-9.e+-]+),", row)]
    assert len(residuals) == 2 and max(residuals) < 1e-5, row
    stopped = subprocess.run([*command, "--rows", "300", "--limit", "0.5"], capture_output=True, text=True,
                             timeout=240, cwd=ROOT)  # fmt: skip
    assert stopped.returncode == 0 and stopped.stdout.count("at the 0.5 s limit") == 2, stopped.stdout


def test_jqmc_side_by_side_is_measured_by_the_protocol(harness, monkeypatch):
    """``jqmc.py``: run i a child process from seed ``--seed`` + i with the sides in turn first, a run taken above
    the load repeated, and per system the median over the counted runs of shardvmc's cost over jQMC's (per
    walker-step, and for a 1 mHa error bar on the extrapolated energy)."""
    import importlib.util

    monkeypatch.setattr(sys, "path", list(sys.path))
    spec = importlib.util.spec_from_file_location("jqmc_benchmark", ROOT / "benchmarks" / "jqmc.py")
    assert spec is not None and spec.loader is not None
    jqmc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(jqmc)

    args = jqmc.parse_args(["--systems", "helium", "--seed", "5", "--runs", "3"])
    child = jqmc.parse_args(jqmc.child_argv(args, 1, "out.json"))  # what run 2's process reads
    assert (child.seed, child.child, child.json, child.walkers, child.alats) == (6, "shardvmc", "out.json", 512,
                                                                               [0.4, 0.3, 0.2])  # fmt: skip
    assert jqmc.parse_args(jqmc.child_argv(args, 2, "x")).child == "jqmc"

    def system(sv_seconds: float) -> dict:
        def side(seconds: float, error: float) -> dict:
            return {"runs": [{"seconds": seconds, "steps": 100}, {"seconds": seconds, "steps": 300}],
                    "extrapolated": (-2.9, error)}  # fmt: skip

        return {"helium": {"shardvmc": side(sv_seconds, 2e-3), "jqmc": side(2.0, 1e-3)}}

    # shardvmc's seconds per run by seed; run 2 (seed 6) taken above the load
    seconds = {5: 0.5, 6: 0.1, 7: 0.8, 8: 0.6}

    def one_run(args, run):  # what jqmc.one_run returns, without the child process
        seed = args.seed + run
        return {"seed": seed, "first": ("jqmc", "shardvmc")[run % 2], "utc": ["10:00:00", "10:08:00"],
                "load": {"above": seed == 6, "load": [0.2, 1.9], "others": 0.9 if seed == 6 else 0.02,
                         "others_max": 1.0},
                "figures": jqmc.figures(system(seconds[seed]))}  # fmt: skip

    taken = harness.independent_runs(lambda i: one_run(args, i), harness.Protocol(runs=3), log=lambda _: None)
    assert [r["seed"] for r in taken["runs"]] == [5, 6, 7, 8] and taken["counted"] == [0, 2, 3]
    text, medians = jqmc.protocol_table(taken, ["helium"])
    # walker-step: (2 s / 400 steps) each side -> the seconds' ratio; 1 mHa: seconds x (error / 1 mHa)^2 -> x4
    assert medians["helium"]["walker_step"] == pytest.approx(0.6 / 2.0)
    assert medians["helium"]["one_mha"] == pytest.approx(4 * 0.6 / 2.0)
    rows = [line for line in text.splitlines() if line.startswith("| ")][1:]
    assert len(rows) == 5 and "| no |" in rows[1] and "**0.300**" in rows[-1] and "**1.200**" in rows[-1], text


def test_gpu_o2_row_through_the_library_computes_o2s_local_energy(harness):  # harness: benchmarks/ on the path
    """Section 8's O2 row through the library (``sv.linalg.slogdet``, ``sv.hamiltonian``'s Laplacian) computes the
    local energy of the folx rows (folx through ``jnp.linalg.slogdet``), both in float64 by the script's oracle,
    called after the float32 program as the row does (an int64 NumPy index once failed there); float32 close."""
    import gpu  # pyright: ignore[reportMissingImports]
    import jax
    import numpy as np
    import system  # pyright: ignore[reportMissingImports]

    import shardvmc as sv

    local_energy = gpu.o2_library_local_energy()
    params, r = system.O2.init_params(), system.O2.init_walkers(8)
    kernel = sv.walker_parallel(sv.replicated_args("params")(local_energy), mesh=jax.make_mesh((1,), ("walkers",)))
    with jax.enable_x64(False):  # the row's order: the kernel in float32 (a TPU's dtype), then the oracle
        f32 = np.asarray(kernel(params, r))
    f64 = gpu.float64_on_the_cpu(local_energy, params, r)
    np.testing.assert_allclose(f64, gpu.float64_on_the_cpu(system.O2.local_energy, params, r), rtol=1e-10)
    assert f32.dtype == np.float32 and f64.dtype == np.float64
    assert np.median(np.abs(f32 - f64) / np.abs(f64)) < 1e-4


def test_fusions_script_puts_each_program_with_and_without_ynnpack_fusions_side_by_side(tmp_path):
    """``benchmarks/fusions.py``: per network and walker count, three programs timed with XLA's YNNPACK fusions and
    without (``sv.compiler_options("cpu")``'s option for them), in turn; a network that does not import (DeepQMC)
    is left out."""
    stdout, data = _run("fusions.py", "--networks", "helium,deepqmc", "--walkers", "8,16", tmp_path=tmp_path)
    assert data["dtype"] == "float64" and [(r["network"], r["walkers"]) for r in data["rows"]] == [
        ("helium", 8), ("helium", 16)
    ]  # fmt: skip
    for row in data["rows"]:
        for what in ("log_psi", "local energy", "sampler step"):
            cell = row[what]
            readings = cell["readings (with ms, without ms, without / with)"]
            assert len(readings) == 5 and all(a > 0 and b > 0 and r == b / a for a, b, r in readings)
            # each figure the median of its 5 readings (taken in pairs, so the ratio is not the medians' ratio)
            for i, key in enumerate(("with ms", "without ms", "without / with")):
                assert cell[key] == round(statistics.median(reading[i] for reading in readings), 3)
    assert "| helium | 16 |" in stdout and ("deepqmc: not run" in stdout or "| deepqmc |" in stdout)


@pytest.mark.end_to_end  # benchmarks/scaling.py's smoke table: once, on CI's first leg
def test_scaling_script_measures_every_piece_and_fits_the_growth_exponents(tmp_path):
    """The template's rows (FermiNet's need benchmarks/.ferminet): every piece for Li and N2, finite figures, a table
    row each, and an exponent per piece."""
    table = tmp_path / "table.md"
    stdout, data = _run("scaling.py", "--smoke", "--only", "template", "--out", str(table), tmp_path=tmp_path)
    pieces = ("logpsi", "grad", "folx", "jvp")
    measured = [row for row in data["rows"] if row.get("metrics")]
    assert sorted((row["system"], row["piece"]) for row in measured) == sorted(
        (system, piece) for system in ("Li", "N2") for piece in pieces
    ), data["rows"]
    text = table.read_text()
    for row in measured:
        m = row["metrics"]
        figures = ("walkers_per_s", "us_per_walker", "compile_s", "peak_bytes_per_walker", "flops")
        assert m["finite"] and all(0 < m[k] < float("inf") for k in figures), row
        assert m["peak_fraction"] is None  # no known peak FLOP/s on a CPU
        assert f"| template | {row['system']} | {row['electrons']} | {row['piece']} | 8 |" in text
    exponents = {f["piece"]: f["exponent"] for f in data["exponents"] if f["network"] == "template"}
    assert set(exponents) == set(pieces) and all(-10 < x < 10 for x in exponents.values()), exponents
    assert "time per walker grows as n^x" in stdout and "time per walker grows as n^x" in text
