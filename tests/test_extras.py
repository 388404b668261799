"""The optional extras: shardvmc.kfac's import errors, the JAX pin of the kfac extras, a suite that survives both.

kfac-jax 0.0.8, the newest release, cannot be imported on JAX >= 0.11 (it raises
``AttributeError``). These tests need no working kfac-jax: a stand-in package on the path
plays one that cannot be imported, so they run on both CI legs (Python 3.11 with JAX
0.10.2, Python 3.13 with the newest JAX).
"""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import jax
import pytest
from optional_imports import unusable
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
BROKEN = "module 'jax.core' has no attribute 'Effects'"  # what kfac-jax 0.0.8 raises on JAX >= 0.11


@pytest.fixture
def broken_kfac_jax(tmp_path):
    """A directory holding a kfac-jax 9.9.9 whose import raises AttributeError, as 0.0.8's does on JAX >= 0.11."""
    package = tmp_path / "kfac_jax"
    package.mkdir()
    (package / "__init__.py").write_text(f"raise AttributeError({BROKEN!r})\n")
    info = tmp_path / "kfac_jax-9.9.9.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kfac-jax\nVersion: 9.9.9\n")
    return tmp_path


def _env(*first: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*map(str, first), str(ROOT), env.get("PYTHONPATH", "")])
    return env


@pytest.fixture
def unimported(monkeypatch):
    """kfac-jax and shardvmc.kfac out of ``sys.modules`` for the test (put back after it), so imports run again."""
    for name in list(sys.modules):
        if name.split(".")[0] == "kfac_jax" or name in ("shardvmc.kfac", "shardvmc._kfac_compat"):
            monkeypatch.delitem(sys.modules, name)
    return monkeypatch


def _import_error() -> ImportError:
    with pytest.raises(ImportError) as info:
        importlib.import_module("shardvmc.kfac")
    return info.value


def test_importing_without_kfac_jax_says_how_to_install_it(unimported):
    unimported.setitem(sys.modules, "kfac_jax", None)  # as if not installed
    message = str(_import_error())
    assert "needs kfac-jax, which is not installed" in message
    assert 'pip install -e ".[kfac]" in the shardvmc clone' in message


def test_a_kfac_jax_that_cannot_run_on_this_jax_is_an_import_error_naming_versions_and_fix(unimported, broken_kfac_jax):
    unimported.syspath_prepend(str(broken_kfac_jax))
    err = _import_error()
    assert f"kfac-jax 9.9.9 cannot be imported with JAX {jax.__version__}" in str(err)
    assert f"AttributeError: {BROKEN}" in str(err) and isinstance(err.__cause__, AttributeError)
    assert 'pip install -e ".[kfac]" in the shardvmc clone' in str(err)
    assert 'pip install "jax<0.11" "jaxlib<0.11"' in str(err)


def test_shardvmc_kfac_imports_exactly_when_kfac_jax_does():
    """In this environment as installed: on the Python 3.13 leg kfac-jax 0.0.8 cannot be imported, on 3.11 it can."""
    why = unusable("kfac_jax")
    if why is None:
        assert importlib.import_module("shardvmc.kfac").Optimizer
    else:
        with pytest.raises(ImportError, match=f"with JAX {jax.__version__}|not installed"):
            importlib.import_module("shardvmc.kfac")


def test_the_kfac_extras_pin_a_jax_that_kfac_jax_supports():
    """While they allow kfac-jax 0.0.8, the kfac, examples and bench extras keep JAX below 0.11 (0.10.2 allowed).

    The test extra stays unpinned: CI's Python 3.13 leg runs the newest JAX with it.
    """
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for extra in ("kfac", "examples", "bench"):
        pins = {r.name: r.specifier for r in map(Requirement, extras[extra])}
        assert "0.0.8" in pins["kfac-jax"], extra  # the constraint below is for this release
        for package in ("jax", "jaxlib"):
            assert package in pins, (extra, package)
            assert "0.10.2" in pins[package] and "0.11.0" not in pins[package], (extra, pins[package])
    assert not {r.name for r in map(Requirement, extras["test"])} & {"jax", "jaxlib"}


def test_every_module_that_imports_kfac_jax_is_collected_when_it_cannot_be(broken_kfac_jax):
    """Collection with the broken kfac-jax, doctests included: skips with the reason, no errors.

    The modules are those that mention kfac-jax or shardvmc.kfac (tests/test_docs.py imports
    shardvmc.kfac while it collects); CI's Python 3.13 leg collects the whole suite with the
    real kfac-jax 0.0.8, which cannot be imported there.
    """
    mentions = re.compile(r"kfac_jax|shardvmc\.kfac|_kfac_compat")
    files = [p for p in (*ROOT.glob("tests/*.py"), *ROOT.glob("shardvmc/*.py")) if mentions.search(p.read_text())]
    assert {"test_kfac.py", "test_docs.py", "kfac.py", "_kfac_compat.py"} <= {p.name for p in files}
    command = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-n", "0", "-p", "no:cacheprovider", "-rs"]
    command += [str(p.relative_to(ROOT)) for p in files]
    out = subprocess.run(command, cwd=ROOT, env=_env(broken_kfac_jax), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-3000:]  # a collection error exits with 2
    assert not [line for line in out.stdout.splitlines() if line.startswith("ERROR")], out.stdout[-6000:]
    skipped = [line for line in out.stdout.splitlines() if line.startswith("SKIPPED")]
    assert any("test_kfac.py: kfac-jax 9.9.9 cannot be imported" in line for line in skipped), out.stdout[-6000:]
    assert any("conftest.py" in line and "shardvmc.kfac" in line for line in skipped), out.stdout[-6000:]  # doctests
    assert "tests/test_docs.py::test_code_examples_run[optimisers.md]" in out.stdout  # collected
