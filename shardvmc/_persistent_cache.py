"""Compiled programs kept between runs: ``enable_compilation_cache``, JAX's persistent compilation cache.

Compiling dominates a short accelerator job: a FermiNet-style local energy takes tens of
seconds to compile on a TPU and a training step more, and every restart of a preempted job
(every piece of a long run on a cluster) pays it again. JAX can keep compiled programs on
disk and load them in a later process with the same program, JAX version, devices and flags
(``jax_compilation_cache_dir``); it is off unless a directory is set. This turns it on, with
every program kept (JAX's default keeps only those that compiled for more than a second: a
VMC step compiles a dozen smaller ones, which add up).
"""

from __future__ import annotations

import os
from pathlib import Path

import jax

from . import _internals

__all__ = ["ENV_VAR", "enable_compilation_cache"]

ENV_VAR = "SHARDVMC_COMPILATION_CACHE"
"""The environment variable naming the cache's directory (``"off"``: no cache)."""


def _default_directory() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "shardvmc" / "jax"


def _several_processes() -> bool:
    """Whether this process is one of a job of several (JAX's distributed runtime, or shardvmc.launch's variables)."""
    from . import distributed  # (distributed imports the package's kernels; here only when called)

    return (_internals.distributed_settings()["num_processes"] or 1) > 1 or distributed.is_launched()


def enable_compilation_cache(
    directory: str | os.PathLike[str] | None = None,
    *,
    min_compile_seconds: float = 0.0,
    several_processes: bool = False,
) -> Path | None:
    """Keep compiled programs on disk, so that the next run of the same job loads them instead of compiling.

    JAX's persistent compilation cache (``jax_compilation_cache_dir``), with programs that
    compiled in at least ``min_compile_seconds`` kept. A directory already configured for JAX
    (``JAX_COMPILATION_CACHE_DIR``, ``jax.config``) is kept as it is unless ``directory`` is
    given. The directory is, in order: ``directory``; JAX's; ``$SHARDVMC_COMPILATION_CACHE``;
    ``$XDG_CACHE_HOME/shardvmc/jax`` (``~/.cache/shardvmc/jax``). ``SHARDVMC_COMPILATION_CACHE=off``
    turns it off (nothing is set; returns ``None``).

    In a job of several processes (``jax.distributed`` initialised, or started by
    ``python -m shardvmc.launch``) it sets nothing and returns ``None`` unless
    ``several_processes=True``: on JAX 0.12.1 a job of two CPU processes hung at its start with
    the cache on (it ran on JAX 0.10.2). Try it on your cluster before you rely on it there.

    Processes on one machine, and the processes of a multi-host job on a shared file system,
    may use one directory at once: JAX writes from process 0 only, each program under a hash
    of the program, its compiler options, its devices and JAX's version, so a program
    compiled for other devices or another JAX is compiled again, never loaded (a process
    that reads an entry another is still writing warns and compiles). Programs with host
    callbacks (``jax.debug.print``) are not kept. Anyone who can write to the directory can
    make your processes run their code: keep it private to you.

    ``sv.driver.run`` calls it (``compilation_cache=True``, its default), and the examples
    do at their start; call it at the start of a job of your own. A call after programs were
    compiled takes effect for the programs compiled after it.

    Args:
        directory: where the compiled programs live; ``None``: see above.
        min_compile_seconds: keep only programs that took at least this long to compile.
        several_processes: turn it on in a job of several processes too (see above).

    Returns:
        The cache's directory, or ``None`` where ``SHARDVMC_COMPILATION_CACHE=off`` or in a job of
        several processes without ``several_processes=True``.

    Example:
        >>> import jax, tempfile, shardvmc as sv
        >>> before = jax.config.jax_compilation_cache_dir
        >>> path = sv.enable_compilation_cache(tempfile.mkdtemp())   # at the start of a job
        >>> path.is_dir()
        True
        >>> jax.config.update("jax_compilation_cache_dir", before)   # (this example's clean-up)
    """
    if not several_processes and _several_processes():
        return None
    configured = getattr(jax.config, "jax_compilation_cache_dir")  # (a dynamic attribute of JAX's config)
    if directory is None and configured:
        path = Path(configured)
    else:
        env = os.environ.get(ENV_VAR, "")
        if directory is None and env.lower() == "off":
            return None
        path = Path(directory if directory is not None else env or _default_directory()).expanduser()
        path.mkdir(parents=True, exist_ok=True)
        if str(path) != configured:
            jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", min_compile_seconds)
    return path
