"""The communication model of ``benchmarks/comm.py`` (docs/cluster.md, "Communication at scale")."""

import importlib.util
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("comm", ROOT / "benchmarks" / "comm.py")
assert _spec is not None and _spec.loader is not None
comm = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(comm)

IB = comm.LINKS["InfiniBand (across nodes)"]


def test_ring_all_reduce_is_the_standard_formula():
    bandwidth, latency = IB
    assert comm.ring_allreduce_s(4e6, 1, bandwidth, latency) == 0.0
    assert comm.ring_allreduce_s(4e6, 8, bandwidth, latency) == pytest.approx(
        2 * 7 / 8 * 4e6 / bandwidth + 2 * 7 * latency
    )
    assert comm.alltoall_s(8e6, 4, bandwidth, latency) == pytest.approx(3 / 4 * 2e6 / bandwidth + 3 * latency)


def test_step_costs_add_up_by_method():
    bandwidth, latency = IB
    n, params, p = 4096, 100_000, 64
    scalar = comm.ring_allreduce_s(4, p, bandwidth, latency)
    gradient = comm.ring_allreduce_s(4 * params, p, bandwidth, latency)
    assert comm.step_comm_s("gradient", n, params, p, bandwidth, latency) == pytest.approx(scalar + gradient)
    assert comm.step_comm_s("CG", n, params, p, bandwidth, latency) == pytest.approx(
        scalar + (1 + comm.CG_ITERATIONS) * gradient
    )
    minsr = comm.step_comm_s("minSR", n, params, p, bandwidth, latency)
    assert minsr == pytest.approx(
        scalar
        + gradient
        + comm.alltoall_s(4 * n * params, p, bandwidth, latency)
        + comm.ring_allreduce_s(4 * n * n, p, bandwidth, latency)
    )


def test_the_ten_percent_point_is_the_smallest_walker_count_that_fits():
    bandwidth, latency = IB
    for method in ("gradient", "CG"):
        n = comm.min_walkers_per_gpu(method, 100_000, 64, bandwidth, latency)
        assert n is not None

        def share(per_gpu: int) -> float:
            c = comm.step_comm_s(method, per_gpu * 64, 100_000, 64, bandwidth, latency)
            return c / (c + per_gpu * comm.WALKER_COST_S)

        assert share(n) <= 0.1 < share(n - 1)
    assert comm.min_walkers_per_gpu("minSR", 1_000_000, 1024, bandwidth, latency) is None  # N^2 outgrows N/p


def test_model_only_prints_the_tables(capsys):
    comm.main(["--model-only"])
    out = capsys.readouterr().out
    assert "Modelled all-reduce" in out and "| minSR | 1e+06 |" in out and "Strong scaling" in out
