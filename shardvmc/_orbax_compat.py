"""What shardvmc relies on of orbax-checkpoint's storage, and how it keeps orbax's failed reads quiet.

orbax-checkpoint (0.12.8) stores a step's arrays in an OCDBT database of tensorstore
(``<step>/arrays/manifest.ocdbt`` and data files): a B-tree whose nodes carry CRC-32C
checksums, holding small values inline and large ones (array chunks, zstd-compressed) in
data files without checksums. shardvmc checks the arrays' data with its own checksums
(``_checksum``); this module covers the rest:

- :func:`manager_class`: orbax's ``CheckpointManager`` asks JAX's preemption sync point
  (``reached_preemption_sync_point``) whether to save, also from the thread that finishes
  an asynchronous save, with that save's (older) step. JAX's sync point then lies behind
  the training loop's step, and a SIGTERM that arrives next sets the step to stop at to
  one the loop has already passed: ``sv.distributed.reached_preemption`` would never
  answer ``True``. shardvmc decides preemption saves itself (every save is forced), so its
  managers never ask: their ``reached_preemption`` (public, overridable) answers ``False``.
- :func:`check_index` reads the B-tree alone (no array data), sequentially, so a damaged
  node or manifest is reported before orbax reads anything.
- :func:`quiet_failed_reads`: when one of orbax's concurrent reads fails, orbax raises and
  closes its event loop while the other reads are still running. Their errors then surface
  later, in whatever code runs: asyncio logs ``Task exception was never retrieved`` for each,
  and tensorstore's completion callbacks raise ``RuntimeError: Event loop is closed`` as
  unraisable exceptions, as do the abandoned coroutines (pytest turns unraisable exceptions
  into warnings of unrelated tests). The read's own error is what shardvmc reports (a
  ``DamagedCheckpointError``); these echoes of it are dropped, and nothing else: the log
  filter and the unraisable hook drop only what names a directory whose read failed, and
  the hook that ``RuntimeError`` raised by asyncio's ``call_soon_threadsafe`` called
  directly from outside Python, once a read has failed. The reads orbax had not started yet
  are coroutines that are never awaited: Python warns of each when it is collected
  (``RuntimeWarning: coroutine '_read_array_index_and_device_put' was never awaited``, an
  unraisable exception where warnings are errors); that warning of that one orbax
  coroutine is ignored, and dropped by the hook once a read has failed.
  They are installed once, at the first read, and pass everything else on.
"""

from __future__ import annotations

import contextlib
import logging
import re
import sys
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["check_index", "manager_class", "quiet_failed_reads"]

_FAILED: set[str] = set()  # the directories whose read failed (their echoes are dropped)
_LOCK = threading.Lock()
_INSTALLED = False
# Python's warning for orbax's reads that a failed read left unstarted (see above)
_UNSTARTED = r"coroutine '_read_array_index_and_device_put' was never awaited"


_MANAGER: list[Any] = []  # the class, made at the first use (orbax-checkpoint is an optional dependency)


def manager_class() -> Any:
    """orbax's ``CheckpointManager``, except that it never consults JAX's preemption sync point (see above)."""
    if not _MANAGER:
        import orbax.checkpoint as ocp

        class Manager(ocp.CheckpointManager):
            def reached_preemption(self, step: int) -> bool:
                return False  # only the training loop's sv.distributed.reached_preemption moves JAX's sync point

        _MANAGER.append(Manager)
    return _MANAGER[0]


def check_index(arrays: Path) -> None:
    """Read every B-tree node of the OCDBT database at ``arrays`` (CRC-checked); raise ``ValueError`` on damage.

    A directory in another layout (no ``manifest.ocdbt``) is left to orbax.
    """
    if not (arrays / "manifest.ocdbt").is_file():
        return
    import tensorstore as ts  # orbax-checkpoint's storage library, installed with it

    store = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{arrays.absolute()}/"}).result()
    store.list().result()


class _Echoes(logging.Filter):
    """Drops asyncio's reports of the abandoned reads of a failed read (they name its directory)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (_FAILED and _names_failed(record.getMessage() + str(record.exc_info and record.exc_info[1])))


def _names_failed(text: str) -> bool:
    return any(directory in text for directory in list(_FAILED))


def _is_echo(unraisable: Any) -> bool:
    """An abandoned read's error (naming a failed directory), or the closed loop's answer to its callback."""
    exc, tb = unraisable.exc_value, unraisable.exc_traceback
    if not _FAILED or exc is None:
        return False
    if _names_failed(str(exc)) or (isinstance(exc, RuntimeWarning) and re.match(_UNSTARTED, str(exc))):
        return True
    if not (isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed" and tb is not None):
        return False
    outermost = tb.tb_frame.f_code  # the frame the callback entered Python in
    return outermost.co_name == "call_soon_threadsafe" and "asyncio" in outermost.co_filename


def _install() -> None:
    global _INSTALLED
    with _LOCK:
        if _INSTALLED:
            return
        _INSTALLED = True
        logging.getLogger("asyncio").addFilter(_Echoes())
        warnings.filterwarnings("ignore", message=_UNSTARTED, category=RuntimeWarning)
        previous = sys.unraisablehook

        def hook(unraisable: Any) -> None:
            if not _is_echo(unraisable):
                previous(unraisable)

        sys.unraisablehook = hook


@contextlib.contextmanager
def quiet_failed_reads(directory: Path) -> Iterator[None]:
    """Run an orbax read of ``directory``; if it fails, drop the echoes of its abandoned reads (see above)."""
    _install()
    try:
        yield
    except BaseException:
        _FAILED.add(str(directory.absolute()))
        raise
