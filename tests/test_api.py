"""The public names are a contract; importing and decorating never touch devices."""

import subprocess
import sys
import textwrap

import pytest
from optional_imports import import_or_skip

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
    "walker_mean", "walker_sum", "jtj", "jtv", "all_walkers", "WalkerSet",
    # caches
    "clear_caches",
    # natural gradient
    "natural_gradient", "NaturalGradientInfo", "natural_gradient_memory", "NaturalGradientMemory",
    # Monte Carlo statistics
    "statistics", "Stats", "StatsAccumulator",
    # errors and warnings
    "ShardvmcError", "DecorationError", "CallError", "ArgumentsError", "CheckpointNotFoundError",
    "UnhashableStaticError", "PaddingWarning",
    "CommunicationWarning", "DamagedCheckpointError", "DamagedCheckpointWarning",
    # what kernel.explain returns
    "Explanation", "ExplanationEntry",
    # checkpoints and multi-process
    "save_walkers", "load_walkers", "Checkpoint", "RESIZED", "distributed",
    # training-state checkpoints (orbax-checkpoint, the `checkpoint` extra)
    "save_state", "load_state", "Checkpointer", "wait_for_saves",
    # the standard VMC pieces: the sampler, the local energy, the clippings of the gradient's energies (submodules)
    "mcmc", "hamiltonian", "loss",
    # the run loop, its loggers and callbacks, the step from its pieces, evaluation (a submodule)
    "driver",
    "dmc",  # fixed-node diffusion Monte Carlo (a submodule)
    # the run's dtype and matrix-product precision for the platform; small determinants fast everywhere
    "precision_policy", "PrecisionPolicy", "linalg",
    "compiler_options",  # the XLA options of the library's programs on a platform, for a jax.jit of your own
    "enable_compilation_cache",  # compiled programs kept on disk between runs (JAX's persistent cache)
}  # fmt: skip


# The public names of the submodules (the optional ones, optax and kfac, where their packages import).
SUBMODULES = {
    "mcmc": {"MOVES", "Metropolis", "SamplerState", "Walker", "adapt_width"},
    "hamiltonian": {"LAPLACIANS", "coulomb", "kinetic_energy", "local_energy"},
    "dmc": {"DMC", "DMCState", "DMCWalker", "energy", "extrapolate"},
    "linalg": {"MAX_UNROLLED", "slogdet"},
    "loss": {"ClipLogSqueeze", "ClipMAD", "Clipping", "log_squeeze"},
    "driver": {
        "CSVLog", "Callback", "JsonLog", "Logger", "PrintLog", "RunResult", "StopOnNonFinite", "TensorBoardLog",
        "Timeout", "VMC", "VMCState", "expect", "read_log", "run",
    },
    "distributed": {
        "ENV_COORDINATOR", "ENV_NUM_PROCESSES", "ENV_PROCESS_ID", "PREEMPTED_EXIT_CODE", "PREEMPTION_SIGNALS",
        "check_consistent", "initialize", "is_launched", "reached_preemption",
    },
    "testing": {
        "CPU_SCHEDULER_FLAG", "assert_replicated", "assert_walker_sharded", "cpu_environment", "set_cpu_devices",
    },
    "launch": {"DEFAULT_GRACE_S", "TIMEOUT_EXIT_CODE", "free_port", "launch", "main", "process_env"},
    "optax": {"FisherNormState", "NaturalGradientState", "clip_by_fisher_norm", "natural_gradient"},
    "kfac": {
        "KFAC", "KFAC_JAX_PATCHED", "DiagonalBlockWarning", "EnergyLoss", "Optimizer", "check_curvature_blocks",
        "energy_loss",
    },
}  # fmt: skip


def test_public_names_are_exported_and_listed():
    """The top level's names are exactly PUBLIC: a name added or gone fails here until this list says so."""
    missing = sorted(name for name in PUBLIC if not hasattr(sv, name))
    assert not missing, f"missing from shardvmc: {missing}"
    assert set(sv.__all__) == PUBLIC, (sorted(set(sv.__all__) - PUBLIC), sorted(PUBLIC - set(sv.__all__)))
    for name in sv.__all__:
        assert hasattr(sv, name), name
    public_attrs = {n for n in vars(sv) if not n.startswith("_")}
    # submodules become attributes once imported (by shardvmc itself, or by other tests of this process)
    assert public_attrs - PUBLIC <= {"annotations", *SUBMODULES}, sorted(public_attrs - PUBLIC)


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


@pytest.mark.parametrize("name", sorted(SUBMODULES))
def test_optional_submodules_lock_their_public_names(name):
    import importlib

    if name in ("kfac", "optax"):  # optional extras (kfac-jax 0.0.8 cannot be imported on JAX >= 0.11)
        import_or_skip({"kfac": "kfac_jax", "optax": "optax"}[name])
    module = importlib.import_module(f"shardvmc.{name}")
    names = SUBMODULES[name]
    assert set(module.__all__) == names
    assert all(getattr(module, n).__doc__ for n in names if not n.isupper() or n == "MOVES")


def test_no_cache_of_programs_grows_without_bound():
    """Every module-level cache is a bounded LRU that sv.clear_caches empties (the default mesh aside)."""
    import pathlib
    import re

    unbounded = []
    for path in sorted(pathlib.Path(sv.__file__).parent.glob("*.py")):
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if re.search(r"functools\.cache\b|lru_cache\(maxsize=None\)", line):
                unbounded.append(f"{path.name}:{lines[i + 1].split('(')[0]}")  # the function it decorates
    assert unbounded == ["_mesh.py:def _default_mesh"], unbounded  # one mesh per axis name


def test_clear_caches_empties_kernels_and_module_caches():
    @sv.walker_parallel
    def r2(r: sv.PerWalker) -> sv.Mean:
        return (r**2).sum()

    import jax.numpy as jnp

    from shardvmc import _reductions

    assert float(r2(jnp.ones((8, 3)))) == 3.0
    sv.walker_mean(jnp.ones((8, 3)))
    assert r2._jits and _reductions._kernel.cache_info().currsize
    sv.clear_caches()
    assert not r2._jits and not r2._plans and _reductions._kernel.cache_info().currsize == 0
    assert float(r2(jnp.ones((8, 3)))) == 3.0


# Raises of builtin exceptions that are not errors shardvmc raises at users, each with its reason.
PLAIN_RAISES_ALLOWED = {
    "testing.py",  # assertion helpers for users' tests raise AssertionError, as chex's do
    "_internals.py",  # re-raises of JAX's own errors
    "_placement.py:58",  # caught at once by its caller, which raises the CallError
}


def test_every_error_raised_on_purpose_is_a_shardvmc_error():
    """A new ``raise ValueError(...)`` (or another builtin) in the package fails here: raise a ShardvmcError."""
    import ast
    import builtins
    import pathlib

    found = []
    for path in sorted(pathlib.Path(sv.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Raise) or not isinstance(node.exc, ast.Call):
                continue
            name = getattr(node.exc.func, "id", None)
            # ImportError (an optional dependency missing) and AttributeError (__getattr__) are Python's protocols
            if name in ("ImportError", "AttributeError"):
                continue
            if isinstance(getattr(builtins, name or "", None), type) and issubclass(getattr(builtins, name), Exception):
                where = f"{path.name}:{node.lineno}"
                if path.name not in PLAIN_RAISES_ALLOWED and where not in PLAIN_RAISES_ALLOWED:
                    found.append(f"{where} raise {name}")
    assert not found, found
