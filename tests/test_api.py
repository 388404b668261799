"""The public names are a contract; importing and decorating never touch devices."""

import subprocess
import sys
import textwrap

import shardvmc as sv

PUBLIC = {
    # toolkit (foundation issue)
    "create_mesh", "n_devices", "is_multi_gpu", "get_walker_sharding", "get_replicated_sharding", "shard_walker",
    "replicate", "pad_n_walkers", "pad_walker", "slice_walkers", "assemble_sharded", "initialize_walkers_sharded",
    "gather_walkers", "shard_vmap", "sharded_batched_vmap", "get_vmap_fn", "shard_map_wrap", "use_mesh",
    # decorators and markers
    "walker_parallel", "replicated_args", "WalkerParallel", "PerWalker", "Replicated", "WalkerKey", "Static",
    "Mean", "Sum",
    # reductions
    "walker_mean", "walker_sum", "jtj", "jtv",
    # natural gradient
    "natural_gradient", "NaturalGradientInfo",
    # Monte Carlo statistics
    "statistics", "Stats", "StatsAccumulator",
    # errors and warnings
    "ShardvmcError", "DecorationError", "CallError", "UnhashableStaticError", "PaddingWarning",
    "CommunicationWarning",
    # checkpoints and multi-process
    "save_walkers", "load_walkers", "Checkpoint", "RESIZED", "distributed",
    # training-state checkpoints (orbax-checkpoint, the `checkpoint` extra)
    "save_state", "load_state", "Checkpointer", "wait_for_saves",
    # the standard VMC pieces: the sampler and the local energy (submodules)
    "mcmc", "hamiltonian",
}  # fmt: skip


def test_public_names_are_exported_and_listed():
    missing = sorted(name for name in PUBLIC if not hasattr(sv, name))
    assert not missing, f"missing from shardvmc: {missing}"
    assert PUBLIC <= set(sv.__all__)
    for name in sv.__all__:
        assert hasattr(sv, name), name


def test_every_public_name_is_documented():
    def documented(obj):
        if hasattr(obj, "__origin__"):  # a marker alias: its own docstring, not typing's generic one
            return bool(obj.__doc__) and obj.__doc__ != type(obj).__doc__
        return bool(obj.__doc__)

    undocumented = [n for n in sv.__all__ if n not in {"distributed"} and not documented(getattr(sv, n))]
    assert not undocumented


def test_version():
    assert isinstance(sv.__version__, str) and sv.__version__.count(".") == 2


def test_error_classes_are_the_builtin_kinds():
    assert issubclass(sv.DecorationError, TypeError)
    assert issubclass(sv.CallError, ValueError)
    assert issubclass(sv.UnhashableStaticError, TypeError) and issubclass(sv.UnhashableStaticError, sv.CallError)


def test_import_and_decoration_never_touch_devices():
    """jax.distributed.initialize must stay possible after importing shardvmc and decorating."""
    code = textwrap.dedent(
        """
        import jax
        import jax._src.xla_bridge as xb
        import shardvmc as sv
        from shardvmc import PerWalker, Replicated, WalkerKey, Static, Mean

        @sv.walker_parallel
        def f(p: Replicated, r: PerWalker, k: WalkerKey, n: Static[int]) -> tuple[PerWalker, Mean]:
            return r, r

        @sv.walker_parallel(batch_size=4)
        @sv.replicated_args("p")
        def g(p, r):
            return r

        h = sv.shard_vmap(lambda r: r)
        v = sv.sharded_batched_vmap(lambda r: r, 2)
        assert not xb.backends_are_initialized(), "a backend was initialised"
        f(1.0, jax.numpy.ones((4, 2)), jax.random.key(0), 2)
        assert xb.backends_are_initialized()
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


SUBMODULES = {  # optional extras: shardvmc.kfac (kfac-jax) and shardvmc.optax (optax); the VMC pieces
    "kfac": {"Optimizer", "DiagonalBlockWarning", "check_curvature_blocks", "KFAC_JAX_PATCHED"},
    "optax": {"natural_gradient", "clip_by_fisher_norm", "NaturalGradientState", "FisherNormState"},
    "mcmc": {"Metropolis", "SamplerState", "Walker", "adapt_width", "MOVES"},
    "hamiltonian": {"local_energy", "kinetic_energy", "coulomb", "LAPLACIANS"},
}


def test_optional_submodules_lock_their_public_names():
    import importlib

    for name, names in SUBMODULES.items():
        module = importlib.import_module(f"shardvmc.{name}")
        assert set(module.__all__) == names, name
        assert all(getattr(module, n).__doc__ for n in names if n != "KFAC_JAX_PATCHED"), name
