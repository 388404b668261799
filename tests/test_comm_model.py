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


def test_the_dmc_step_costs_add_up():
    bandwidth, latency = IB
    n, p, n_w = 65536, 64, comm.dmc_walker_numbers(2)
    assert n_w == 16 and comm.dmc_step_comm_s(n, 1, n_w, bandwidth, latency, fallback=1.0) == 0.0
    plain = comm.dmc_step_comm_s(n, p, n_w, bandwidth, latency)
    # 64 devices' halos (64 x 2 x 32 walkers x 128 bytes) exceed the all-gather's share: one message each way; the
    # all-gather carries 13 numbers per device (weight total, two halo ends, 10 statistics); no all-reduce
    halos = 2 * latency + 2 * 32 * (8 * 16) / bandwidth
    assert plain == pytest.approx(comm.allgather_s(8 * 13, p, bandwidth, latency) + halos)
    assert set(comm.dmc_step_collectives(n, p, n_w)["every step"]) == {"all-gather", "collective-permute"}
    # on 8 devices the halos ride in the all-gather: one collective a step
    eight = comm.dmc_step_comm_s(n, 8, n_w, bandwidth, latency)
    assert eight == pytest.approx(comm.allgather_s(8 * 13 + 2 * 32 * 8 * 16, 8, bandwidth, latency))
    assert set(comm.dmc_step_collectives(n, 8, n_w)["every step"]) == {"all-gather"}
    # the fallback gathers every walker: it grows with N, the rest does not
    worst = comm.dmc_step_comm_s(n, p, n_w, bandwidth, latency, fallback=1.0)
    assert worst - plain > 8 * n * 15 / bandwidth
    assert comm.dmc_step_comm_s(4 * n, p, n_w, bandwidth, latency) == pytest.approx(plain)


def test_the_dmc_model_knows_where_the_halos_go():
    import shardvmc as sv

    assert comm.DMC_HALOS_IN_GATHER_BYTES == sv.dmc._HALOS_IN_GATHER_BYTES


@pytest.mark.parametrize(
    "walkers, devices, halo",
    [(101, 8, 32), (29, 3, 4), (2000, 8, 200)],  # the last: the halos (8 x 2 x 200 x 128 bytes) by ppermute
)
def test_the_dmc_model_is_the_compiled_step(walkers, devices, halo):
    """Messages and bytes per device of every collective of the compiled DMC step, as dmc_step_collectives says."""
    import jax
    import jax.numpy as jnp

    import shardvmc as sv

    mesh = sv.create_mesh(jax.devices()[:devices])
    with jax.enable_x64(True):
        dmc = sv.dmc.DMC(lambda a, r: -a * jnp.sum(r**2), lambda r: 0.5 * jnp.sum(r**2), time_step=0.05, halo=halo)
        init = lambda k: jax.random.normal(k, (2, 3))  # noqa: E731  (2 particles: n_w = 16)
        state = dmc.init(jnp.float64(0.4), sv.initialize_walkers_sharded(init, walkers, mesh, key=jax.random.key(0)))
        compiled = dmc._step.lower(state, jax.random.key(1), mesh=mesh).compile()
    got = comm.step_collectives(compiled.as_text())
    want = comm.dmc_step_collectives(walkers, devices, comm.dmc_walker_numbers(2), halo)
    assert got == {where: {kind: list(v) for kind, v in kinds.items()} for where, kinds in want.items()}
