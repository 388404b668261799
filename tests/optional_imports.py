"""Optional dependencies of the tests: skipped with the reason when they cannot be imported here.

``pytest.importorskip`` catches only ``ImportError``, but a package that is installed and
does not support the installed JAX fails its import otherwise: kfac-jax 0.0.8 on JAX
>= 0.11 raises ``AttributeError`` (``jax.core.Effects``, removed in JAX 0.11). Uncaught at
a module's top, that makes the whole module uncollectable; here it is a skip whose
reason names the versions and the error. tests/test_docs.py uses :func:`unusable` for the
blocks that import such a package; the root conftest.py skips the doctests of
``shardvmc.kfac`` the same way.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import sys
from pathlib import Path
from types import ModuleType

import jax
import pytest

DISTRIBUTIONS = {"kfac_jax": "kfac-jax"}  # import name -> package name, where they differ


def unusable(name: str) -> str | None:
    """Why the module ``name`` cannot be imported here (a sentence for a skip), or ``None`` when it can."""
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as err:
        if err.name is not None and name.split(".")[0] == err.name:
            return f"{name} is not installed"
        return _why(name, err)
    except Exception as err:  # kfac-jax 0.0.8 on JAX >= 0.11: AttributeError (see the module docstring)
        return _why(name, err)
    return None


def _why(name: str, err: Exception) -> str:
    package = DISTRIBUTIONS.get(name.split(".")[0], name.split(".")[0])
    try:
        found = f"{package} {importlib.metadata.version(package)}"
    except importlib.metadata.PackageNotFoundError:
        found = package
    error = " ".join(str(err).split())  # one line: the docs' one-device run reports one skip per line
    return f"{found} cannot be imported with JAX {jax.__version__} ({type(err).__name__}: {error})"


def import_or_skip(name: str) -> ModuleType:
    """The module ``name``, or a skip of the calling test (or module, at its top) saying why it cannot be imported."""
    reason = unusable(name)
    if reason is not None:
        # pytest reports a skip at the line that raised it (here): name the module or test that asked
        caller = sys._getframe(1).f_code
        where = Path(caller.co_filename).name + ("" if caller.co_name == "<module>" else f"::{caller.co_name}")
        pytest.skip(f"{where}: {reason}", allow_module_level=True)
    return importlib.import_module(name)
