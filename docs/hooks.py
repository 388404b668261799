"""mkdocs hooks of the site (mkdocs.yml ``hooks:``): the package's version in the site's name.

The version is read from ``shardvmc/__init__.py`` as text (the build needs no JAX), so the header and every page's
title show the version of the tree the site was built from; tests/test_docs.py checks the built site against
``shardvmc.__version__``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

INIT = Path(__file__).resolve().parents[1] / "shardvmc" / "__init__.py"
VERSION = re.compile(r"""^__version__\s*=\s*["']([^"']+)["']""", re.M)


def package_version(init: Path = INIT) -> str:
    """``__version__`` of ``shardvmc/__init__.py``."""
    m = VERSION.search(init.read_text())
    if m is None:
        raise ValueError(f"{init} has no __version__ = '...' line")
    return m.group(1)


def on_config(config: Any) -> Any:
    """The site name ``shardvmc`` becomes ``shardvmc X.Y.Z`` (mkdocs calls it once per build, before the pages)."""
    version = package_version()
    if not config["site_name"].endswith(f" {version}"):  # `mkdocs serve` may hand back an edited config
        config["site_name"] = f"{config['site_name']} {version}"
    return config
