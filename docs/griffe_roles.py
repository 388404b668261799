"""Griffe extension for the API reference: Sphinx roles in docstrings become Markdown.

It also reads a docstring's ``Example:`` section as the ``Examples:`` section it is meant
to be, so that its doctest is shown as code.

shardvmc's docstrings are Google style with Sphinx cross-reference roles
(``:func:`walker_parallel```). mkdocstrings does not read roles, so this rewrites each
one to a link to the documented object (``[`walker_parallel`][shardvmc.walker_parallel]``)
when the API page documents it, and to inline code otherwise.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(?:func|class|meth|attr|mod|data|exc|obj):`~?\.?([\w.]+)(?:\(\))?`")
_API = Path(__file__).with_name("api.md")
_EXAMPLE = re.compile(r"^([ \t]*)Example:[ \t]*$", re.M)


def _documented() -> set[str]:
    return set(re.findall(r"^:::\s+([\w.]+)\s*$", _API.read_text(), re.M))


def _public(module_path: str) -> str:
    return ".".join(part for part in module_path.split(".") if not part.startswith("_"))


class SphinxRoles(griffe.Extension):
    """Rewrite ``:func:`name``` and friends in every docstring."""

    def __init__(self) -> None:
        self._documented = _documented()

    def _target(self, name: str, obj: griffe.Object) -> str | None:
        candidates = [name] if name.startswith("shardvmc") else []
        module = obj if obj.is_module else obj.module
        candidates += [f"{_public(module.path)}.{name}", f"shardvmc.{name}"]
        return next((c for c in candidates if c in self._documented), None)

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is None and obj.is_attribute and obj.path.startswith("shardvmc._markers."):
            # The markers are typing aliases that carry their docstring at runtime (``PerWalker.__doc__``),
            # which static analysis cannot see: read it from the imported module.
            import importlib

            doc = getattr(importlib.import_module("shardvmc._markers"), obj.name, None).__doc__
            obj.docstring = griffe.Docstring(doc, parent=obj) if doc else None
        if obj.docstring is None:
            return
        # Google style's section is "Examples:"; griffe reads the singular "Example:" as an admonition of
        # Markdown, in which the doctest's ">>>" lines become nested block quotes.
        obj.docstring.value = _EXAMPLE.sub(r"\1Examples:", obj.docstring.value)
        if ":`" not in obj.docstring.value:
            return

        def replace(m: re.Match[str]) -> str:
            name = m.group(1)
            short = name.rsplit(".", 1)[-1] if name.startswith("shardvmc") else name
            target = self._target(name, obj)
            return f"[`{short}`][{target}]" if target else f"`{short}`"

        obj.docstring.value = _ROLE.sub(replace, obj.docstring.value)
