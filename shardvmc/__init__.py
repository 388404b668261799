"""shardvmc: write variational Monte Carlo code for one walker, run it on every device.

Example:
    >>> import jax, jax.numpy as jnp, shardvmc as sv
    >>> @sv.walker_parallel
    ... def local_energy(alpha: sv.Replicated[jax.Array], r: sv.PerWalker[jax.Array]) -> sv.Mean[jax.Array]:
    ...     return alpha * jnp.sum(r**2)
    >>> float(local_energy(jnp.float32(1.0), jnp.ones((16, 2, 3))))
    6.0
"""

from . import distributed as distributed
from . import dmc as dmc
from . import driver as driver
from . import hamiltonian as hamiltonian
from . import linalg as linalg
from . import loss as loss
from . import mcmc as mcmc
from ._caches import clear_caches as clear_caches
from ._checkpoint import RESIZED as RESIZED
from ._checkpoint import Checkpoint as Checkpoint
from ._checkpoint import Checkpointer as Checkpointer
from ._checkpoint import DamagedCheckpointWarning as DamagedCheckpointWarning
from ._checkpoint import load_state as load_state
from ._checkpoint import load_walkers as load_walkers
from ._checkpoint import save_state as save_state
from ._checkpoint import save_walkers as save_walkers
from ._checkpoint import wait_for_saves as wait_for_saves
from ._compiler import compiler_options as compiler_options
from ._compiler import guard_cpu_runtime as _guard_cpu_runtime
from ._decorator import WalkerParallel as WalkerParallel
from ._decorator import replicated_args as replicated_args
from ._decorator import walker_parallel as walker_parallel
from ._errors import ArgumentsError as ArgumentsError
from ._errors import CallError as CallError
from ._errors import CheckpointNotFoundError as CheckpointNotFoundError
from ._errors import DamagedCheckpointError as DamagedCheckpointError
from ._errors import DecorationError as DecorationError
from ._errors import ShardvmcError as ShardvmcError
from ._errors import UnhashableStaticError as UnhashableStaticError
from ._explain import CommunicationWarning as CommunicationWarning
from ._explain import Explanation as Explanation
from ._explain import ExplanationEntry as ExplanationEntry
from ._kernel import PaddingWarning as PaddingWarning
from ._markers import Mean as Mean
from ._markers import PerWalker as PerWalker
from ._markers import Replicated as Replicated
from ._markers import Static as Static
from ._markers import Sum as Sum
from ._markers import WalkerKey as WalkerKey
from ._mcstats import Stats as Stats
from ._mcstats import StatsAccumulator as StatsAccumulator
from ._mcstats import statistics as statistics
from ._mesh import create_mesh as create_mesh
from ._mesh import get_replicated_sharding as get_replicated_sharding
from ._mesh import get_walker_sharding as get_walker_sharding
from ._mesh import is_multi_gpu as is_multi_gpu
from ._mesh import n_devices as n_devices
from ._mesh import use_mesh as use_mesh
from ._natgrad import NaturalGradientInfo as NaturalGradientInfo
from ._natgrad import NaturalGradientMemory as NaturalGradientMemory
from ._natgrad import natural_gradient as natural_gradient
from ._natgrad import natural_gradient_memory as natural_gradient_memory
from ._persistent_cache import enable_compilation_cache as enable_compilation_cache
from ._placement import assemble_sharded as assemble_sharded
from ._placement import gather_walkers as gather_walkers
from ._placement import pad_n_walkers as pad_n_walkers
from ._placement import pad_walker as pad_walker
from ._placement import replicate as replicate
from ._placement import shard_walker as shard_walker
from ._placement import slice_walkers as slice_walkers
from ._precision import PrecisionPolicy as PrecisionPolicy
from ._precision import precision_policy as precision_policy
from ._reductions import jtj as jtj
from ._reductions import jtv as jtv
from ._reductions import walker_mean as walker_mean
from ._reductions import walker_sum as walker_sum
from ._stats import all_walkers as all_walkers
from ._vmap import get_vmap_fn as get_vmap_fn
from ._vmap import initialize_walkers_sharded as initialize_walkers_sharded
from ._vmap import shard_map_wrap as shard_map_wrap
from ._vmap import shard_vmap as shard_vmap
from ._vmap import sharded_batched_vmap as sharded_batched_vmap
from ._walkerset import WalkerSet as WalkerSet

_guard_cpu_runtime()  # importing starts no backend: XLA reads its flags once, when one starts

__version__ = "0.4.0"

__all__ = [
    "ArgumentsError",
    "CallError",
    "Checkpoint",
    "CheckpointNotFoundError",
    "Checkpointer",
    "CommunicationWarning",
    "DamagedCheckpointError",
    "DamagedCheckpointWarning",
    "DecorationError",
    "Explanation",
    "ExplanationEntry",
    "Mean",
    "NaturalGradientInfo",
    "NaturalGradientMemory",
    "PaddingWarning",
    "PerWalker",
    "PrecisionPolicy",
    "RESIZED",
    "Replicated",
    "ShardvmcError",
    "Static",
    "Stats",
    "StatsAccumulator",
    "Sum",
    "UnhashableStaticError",
    "WalkerKey",
    "WalkerParallel",
    "WalkerSet",
    "all_walkers",
    "assemble_sharded",
    "clear_caches",
    "compiler_options",
    "create_mesh",
    "distributed",
    "dmc",
    "driver",
    "enable_compilation_cache",
    "gather_walkers",
    "get_replicated_sharding",
    "get_vmap_fn",
    "get_walker_sharding",
    "hamiltonian",
    "initialize_walkers_sharded",
    "is_multi_gpu",
    "jtj",
    "jtv",
    "linalg",
    "load_state",
    "load_walkers",
    "loss",
    "mcmc",
    "n_devices",
    "natural_gradient",
    "natural_gradient_memory",
    "pad_n_walkers",
    "pad_walker",
    "precision_policy",
    "replicate",
    "replicated_args",
    "save_state",
    "save_walkers",
    "shard_map_wrap",
    "shard_vmap",
    "shard_walker",
    "sharded_batched_vmap",
    "slice_walkers",
    "statistics",
    "use_mesh",
    "wait_for_saves",
    "walker_mean",
    "walker_parallel",
    "walker_sum",
]
