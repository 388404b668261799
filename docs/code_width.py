"""The widest code line the site shows without cutting it off, and a check of the built site.

At a 1280 px browser window (mkdocs-material, ``toc.integrate``: the page's table of
contents sits in the left sidebar) a code block shows 110 characters of its monospace
font before it scrolls sideways; measured in headless Chromium (see docs/contributing.md,
"Looking at the site"). Code in an admonition is set smaller and shows more, so one width
holds everywhere.

    python docs/code_width.py SITE_DIR    # after mkdocs build --site-dir SITE_DIR

lists every code line of the built site wider than that and exits 1 if there is one. The
same rule applied to the Markdown sources (and the files they include) runs in
tests/test_docs.py, so a long line fails the tests before the site is built.
"""

from __future__ import annotations

import html
import re
import sys
from pathlib import Path

WIDTH = 110  # characters of a code line visible at a 1280 px window

_PRE = re.compile(r"<pre\b[^>]*>(.*?)</pre>", re.S)
_TAG = re.compile(r"<[^>]+>")


def long_lines_in_html(text: str, width: int = WIDTH) -> list[str]:
    """The lines of every ``<pre>`` block of an HTML page wider than ``width`` characters."""
    out = []
    for block in _PRE.findall(text):
        for line in html.unescape(_TAG.sub("", block)).splitlines():
            if len(line.rstrip()) > width:
                out.append(line.rstrip())
    return out


def check_site(site: Path, width: int = WIDTH) -> list[str]:
    """``page: N characters: line`` for every code line of the built site wider than ``width``."""
    found = []
    for page in sorted(site.rglob("*.html")):
        for line in long_lines_in_html(page.read_text(encoding="utf-8"), width):
            found.append(f"{page.relative_to(site)}: {len(line)} characters: {line}")
    return found


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python docs/code_width.py SITE_DIR")
    problems = check_site(Path(sys.argv[1]))
    print("\n".join(problems) if problems else f"no code line wider than {WIDTH} characters")
    sys.exit(1 if problems else 0)
