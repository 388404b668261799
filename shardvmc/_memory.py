"""Per-device memory: the budget of a device, and what a compiled program needs of it.

Used to plan memory before running a program instead of discovering the limit by
running out: lower and compile for abstract inputs (``jax.ShapeDtypeStruct`` with a
sharding), read the compiled program's per-device bytes with :func:`compiled_memory`,
and compare them with :func:`device_memory_budget`. ``sv.natural_gradient`` does this
for its solvers; kernels' ``batch_size="auto"`` can do the same.

Example:
    >>> import jax, jax.numpy as jnp
    >>> from shardvmc._memory import compiled_memory, device_memory_budget
    >>> mem = compiled_memory(jax.jit(lambda x: jnp.sin(x) @ x.T).lower(jnp.ones((64, 32))).compile())
    >>> mem.argument_bytes, mem.output_bytes
    (8192, 16384)
    >>> mem.total_bytes <= device_memory_budget()
    True
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax

__all__ = ["CPU_RAM_FRACTION", "CompiledMemory", "compiled_memory", "device_memory_budget", "format_bytes"]

CPU_RAM_FRACTION = 0.5
"""Share of the host's RAM that the CPU devices of this process may use together.

CPU devices report no memory limit (``device.memory_stats()`` is ``None``); their budget
is ``CPU_RAM_FRACTION * host RAM / local device count``: fake CPU devices share the
host's memory, and the rest is left to Python, the OS and other processes.
"""


@dataclasses.dataclass(frozen=True)
class CompiledMemory:
    """Bytes per device of one compiled (SPMD) program, from XLA's ``memory_analysis``.

    Attributes:
        temp_bytes: temporary buffers (intermediates) the program allocates.
        argument_bytes: the inputs (on each device: its shards).
        output_bytes: the outputs.
        alias_bytes: outputs that reuse (donated) input buffers, counted in both.
        code_bytes: the generated code (0 where the backend does not say).
    """

    temp_bytes: int
    argument_bytes: int
    output_bytes: int
    alias_bytes: int = 0
    code_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        """Peak bytes one device needs to run the program: arguments + outputs + temporaries - aliased."""
        return self.argument_bytes + self.output_bytes + self.temp_bytes - self.alias_bytes


def compiled_memory(compiled: Any) -> CompiledMemory:
    """Per-device bytes of a compiled program (``jax.jit(f).lower(...).compile()``).

    Args:
        compiled: a ``jax.stages.Compiled``.

    Returns:
        A :class:`CompiledMemory`; zeros where the backend reports nothing.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from shardvmc._memory import compiled_memory
        >>> compiled_memory(jax.jit(lambda x: 2 * x).lower(jnp.ones(256)).compile()).output_bytes
        1024
    """
    stats = compiled.memory_analysis()
    if isinstance(stats, (list, tuple)):  # some versions return one entry per device: they are equal
        stats = stats[0] if stats else None

    def read(name: str) -> int:
        return int(getattr(stats, name, 0) or 0)

    return CompiledMemory(
        temp_bytes=read("temp_size_in_bytes"),
        argument_bytes=read("argument_size_in_bytes"),
        output_bytes=read("output_size_in_bytes"),
        alias_bytes=read("alias_size_in_bytes"),
        code_bytes=read("generated_code_size_in_bytes"),
    )


def _host_ram_bytes() -> int:
    try:
        return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not POSIX
        return 8 * 2**30


def device_memory_budget(device: Any = None) -> int:
    """Bytes one device may use: its limit where JAX reports one, else a share of host RAM.

    Accelerators report ``device.memory_stats()["bytes_limit"]`` (the allocator's pool,
    already net of XLA's reserve). CPU devices report nothing; they get
    ``CPU_RAM_FRACTION`` (one half) of the host's RAM divided by the number of local
    devices, since fake CPU devices share one host.

    Args:
        device: a ``jax.Device``; default ``jax.local_devices()[0]``.

    Example:
        >>> from shardvmc._memory import device_memory_budget
        >>> device_memory_budget() > 0
        True
    """
    device = jax.local_devices()[0] if device is None else device
    try:
        stats = device.memory_stats()
    except Exception:  # pragma: no cover - backends without memory stats may raise
        stats = None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    same_host = [d for d in jax.local_devices() if d.platform == device.platform] or [device]
    return int(CPU_RAM_FRACTION * _host_ram_bytes() / len(same_host))


def format_bytes(n: float) -> str:
    """``n`` bytes in the largest binary unit that keeps it at least 1, e.g. ``'1.50 GiB'``.

    Example:
        >>> from shardvmc._memory import format_bytes
        >>> format_bytes(3 * 2**29), format_bytes(512)
        ('1.50 GiB', '512 B')
    """
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        scale = 2 ** (10 * ("KiB", "MiB", "GiB", "TiB").index(unit) + 10)
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"
