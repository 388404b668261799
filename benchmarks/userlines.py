"""Lines of user code of a side-by-side benchmark: the regions between ``# user code: NAME`` markers.

Imports nothing beyond the standard library, so that a peer's worker process (another
interpreter, without shardvmc) can import the benchmark that uses it.
"""

import re
from pathlib import Path


def user_lines(path: str | Path) -> dict[str, int]:
    """Non-blank, non-comment lines of each ``# user code: NAME`` region of ``path``; ``both`` counts for each side.

    A region ends at ``# end of user code``.
    """
    counts: dict[str, int] = {}
    name = None
    for line in Path(path).read_text().splitlines():
        marker = re.match(r"\s*# user code: (\w+)", line)
        if marker:
            name = marker.group(1)
            continue
        if re.match(r"\s*# end of user code", line):
            name = None
            continue
        if name and line.strip() and not line.strip().startswith("#"):
            counts[name] = counts.get(name, 0) + 1
    shared = counts.pop("both", 0)
    return {side: n + shared for side, n in counts.items()}
