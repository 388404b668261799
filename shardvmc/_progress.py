"""The progress bar of :func:`shardvmc.driver.run`: tqdm, with the energy and its error bar, and the time left."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import IO, Any

from ._errors import install
from ._loggers import format_stats

__all__ = ["PROGRESS_INSTALL", "Progress", "wants_bar"]

PROGRESS_INSTALL = install("progress")


def wants_bar(progress: Any) -> IO[str] | None:
    """Where the bar goes: ``True``: standard error; ``None``: standard error if it is a terminal; a file: there."""
    if progress is None:
        stream = sys.stderr
        if not (hasattr(stream, "isatty") and stream.isatty()):
            return None
        try:
            import tqdm  # noqa: F401
        except ImportError:  # asked for nothing: no bar without tqdm
            return None
        return stream
    if progress is True:
        return sys.stderr
    if progress is False:
        return None
    return progress


def _postfix(stats: Mapping[str, float]) -> str:
    for name, short in (("energy", "E"), ("mean", "mean")):
        if name in stats:
            shown = {name: stats[name], **({"error": stats["error"]} if "error" in stats else {})}
            return format_stats(shown).replace(f"{name} = ", f"{short} = ", 1)
    return format_stats({k: v for k, v in list(stats.items())[:1]})


class Progress:
    """A tqdm bar over the run's steps: ``E = -2.9001 ± 0.0003``, steps per second and the time left."""

    def __init__(self, file: IO[str], total: int, start: int, description: str) -> None:
        try:
            from tqdm import tqdm
        except ImportError as err:
            raise ImportError(
                f"sv.driver.run's progress bar needs tqdm, which is not installed: {PROGRESS_INSTALL} "
                "(or pass progress=False)"
            ) from err
        self.bar = tqdm(total=total, initial=start, file=file, desc=description or None, dynamic_ncols=True,
                        unit="step", smoothing=0.1)  # fmt: skip

    def update(self, step: int, stats: Mapping[str, float]) -> None:
        self.bar.set_postfix_str(_postfix(stats), refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()
