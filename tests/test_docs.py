"""The documentation site: every public name in the API reference, every code example runs.

Conventions of the Markdown pages under docs/:

- ```` ```python ```` blocks are run, in page order, in one namespace per page: on the 8
  fake CPU devices of the test process, and again on 1 device in one child process for
  every page (``python tests/test_docs.py PAGE...``), so counts must follow the mesh. A
  block made only of snippet lines (``--8<-- "path:section"``) includes a file that has
  its own tests (the helium example, conftest.py); the test checks that the file and
  section exist.
- ```` ```text title="Output" ```` right after a ``python`` block quotes what that block
  prints, checked on 1 and on 8 devices; ```` ```text title="Output on 8 devices" ````
  is checked on 8 only. Both compare as doctests do (``...`` matches anything, e.g. a
  timing; runs of whitespace are equal).
- ```` ```pycon ```` blocks are doctests, run in the same namespace, output checked.
- ```` ```py title="..." ```` blocks are not run, only compiled; the title says what they
  are: code of another library for comparison, or part of a program that needs a
  cluster (the names it leaves to that program are named in the title or a comment).
- Other languages (bash, plain text) are not run.

The site itself is built by CI (``mkdocs build --strict``), and here when mkdocs is installed.
"""

import contextlib
import dataclasses
import doctest
import importlib
import io
import os
import re
import subprocess
import sys
import traceback
from pathlib import Path

import jax
import pytest

import shardvmc
from shardvmc.testing import cpu_environment

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
API_PAGE = DOCS / "api.md"
FENCE = re.compile(r"^```(?P<lang>[\w-]*)[^\n]*\n(?P<body>.*?)^```[ \t]*$", re.M | re.S)
SNIPPET = re.compile(r'^\s*--8<--\s+"(?P<path>[^":]+)(?::(?P<section>[\w-]+))?"\s*$')
TITLE = re.compile(r'title="([^"]*)"')
OUTPUT_TITLE = re.compile(r"Output(?: on (\d+) devices?)?")
DIRECTIVE = re.compile(r"^:::\s+(?P<name>[\w.]+)\s*$", re.M)


def _public_modules():
    """(module path, __all__) of every public module whose names the reference must list."""
    out = [("shardvmc", list(shardvmc.__all__))]
    for sub in ("testing", "distributed", "launch", "kfac", "optax", "mcmc", "hamiltonian"):
        try:
            module = importlib.import_module(f"shardvmc.{sub}")
        except ImportError:  # a submodule not written yet
            continue
        out.append((f"shardvmc.{sub}", list(module.__all__)))
    return out


def _pages_with(lang: str):
    return sorted(p.name for p in DOCS.glob("*.md") if any(b.lang == lang for b in _page_blocks(p)))


# ----------------------------------------------------------------------------- API reference


def _documented(page: Path = API_PAGE) -> set[str]:
    return set(DIRECTIVE.findall(page.read_text()))


def _missing(module: str, names: list[str], page: Path = API_PAGE) -> list[str]:
    documented = _documented(page)
    return [f"{module}.{name}" for name in names if f"{module}.{name}" not in documented]


@pytest.mark.parametrize("module, names", _public_modules(), ids=lambda v: v if isinstance(v, str) else "")
def test_every_public_name_is_in_the_api_reference(module, names):
    missing = _missing(module, names)
    assert not missing, f"docs/api.md has no `::: name` entry for {missing}; add one per public name."


def test_api_reference_entries_exist():
    stale = []
    for name in sorted(_documented()):
        module_name, _, attr = name.rpartition(".")
        try:
            importlib.import_module(name)
            continue
        except ImportError:
            pass
        try:
            getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError):
            stale.append(name)
    assert not stale, f"docs/api.md documents names that do not exist: {stale}"


def test_the_check_sees_a_missing_name(tmp_path):
    page = tmp_path / "api.md"
    text = API_PAGE.read_text()
    assert "::: shardvmc.jtj\n" in text
    page.write_text(text.replace("::: shardvmc.jtj\n", ""))
    assert _missing("shardvmc", list(shardvmc.__all__), page) == ["shardvmc.jtj"]


# ----------------------------------------------------------------------------- site structure


def test_nav_lists_every_page_and_every_page_exists():
    config = (ROOT / "mkdocs.yml").read_text()
    nav = config[config.index("\nnav:") : config.index("\nmarkdown_extensions:")]
    listed = set(re.findall(r":\s*([\w-]+\.md)\s*$", nav, re.M))
    pages = {p.name for p in DOCS.glob("*.md")}
    assert listed == pages, f"in the nav but missing: {listed - pages}; not in the nav: {pages - listed}"


def test_snippets_point_at_existing_sections():
    for page in sorted(DOCS.glob("*.md")):
        for line in page.read_text().splitlines():
            m = SNIPPET.match(line)
            if not m:
                continue
            target = ROOT / m.group("path")
            assert target.is_file(), f"{page.name}: snippet file {m.group('path')} does not exist"
            if m.group("section"):
                text = target.read_text()
                for mark in ("start", "end"):
                    assert f"--8<-- [{mark}:{m.group('section')}]" in text, (
                        f"{page.name}: {m.group('path')} has no [{mark}:{m.group('section')}] marker"
                    )


# ----------------------------------------------------------------------------- code examples


@dataclasses.dataclass
class Block:
    lang: str
    body: str
    line: int
    title: str | None  # the fence's title="...", if any


def _page_blocks(page: Path) -> list[Block]:
    text = page.read_text()
    out = []
    for m in FENCE.finditer(text):
        title = TITLE.search(m.group(0).split("\n", 1)[0])
        line = text.count("\n", 0, m.start("body")) + 1
        out.append(Block(m.group("lang"), m.group("body"), line, title.group(1) if title else None))
    return out


def _expected_output(block: Block) -> tuple[bool, int | None]:
    """Whether ``block`` quotes the output of the block before it, and the device count it is for."""
    if block.lang != "text" or block.title is None:
        return False, None
    m = OUTPUT_TITLE.fullmatch(block.title)
    return (m is not None), (int(m.group(1)) if m and m.group(1) else None)


def _check_output(got: str, want: str) -> bool:
    return doctest.OutputChecker().check_output(want, got, doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)


def run_page(page: Path, n_devices: int) -> list[str]:
    """Run the page's blocks in order in one namespace; the failures, ``docs/PAGE:LINE: what``.

    A page stops at its first failure (the blocks after it would fail for want of its names).
    """
    namespace: dict = {"__name__": f"docs_{page.stem}"}
    name = f"docs/{page.name}"
    printed: str | None = None  # what the last python block printed
    for block in _page_blocks(page):
        where = f"{name}:{block.line}"
        is_output, for_devices = _expected_output(block)
        if is_output:
            if printed is None:
                return [f"{where}: an Output block must follow a python block"]
            if for_devices in (None, n_devices) and not _check_output(printed, block.body):
                return [f"{where}: the block above printed\n{printed}\ninstead of\n{block.body}"]
            printed = None
            continue
        if block.lang not in ("python", "pycon"):
            printed = None
            continue
        lines = block.body.splitlines()
        if block.lang == "python" and lines and all(SNIPPET.match(x) or not x.strip() for x in lines):
            printed = None
            continue  # an included, separately tested file
        stdout = io.StringIO()
        try:
            with contextlib.redirect_stdout(stdout):
                if block.lang == "python":
                    exec(compile("\n" * (block.line - 1) + block.body, name, "exec"), namespace)
                else:
                    test = doctest.DocTestParser().get_doctest(block.body, namespace, name, name, block.line - 1)
                    flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
                    result = doctest.DocTestRunner(optionflags=flags).run(test, clear_globs=False)
        except Exception as err:
            frames = traceback.extract_tb(err.__traceback__)
            on_page = [f"  {name}:{f.lineno}: {f.line}" for f in frames if f.filename == name]
            return [f"{where}: {type(err).__name__}: {err}\n" + "\n".join(on_page)]
        if block.lang == "pycon" and result.failed:
            return [f"{where}: {result.failed} of {result.attempted} doctest examples failed:\n{stdout.getvalue()}"]
        printed = stdout.getvalue() if block.lang == "python" else None
    return []


RUNNABLE = sorted(set(_pages_with("python")) | set(_pages_with("pycon")))


ONE_DEVICE_WAIT_S = 900  # a bound against hangs only
# The one-device run checks counts and outputs, not XLA's code: compiled with LLVM's optimisations
# off it costs a third less CPU time (71 s -> 49 s measured), and nothing it checks changes.
FAST_COMPILE_FLAGS = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true")


@pytest.mark.parametrize("page", RUNNABLE)
def test_code_examples_run(page):
    failures = run_page(DOCS / page, jax.device_count())
    assert not failures, "\n".join(failures)


def test_code_examples_run_on_one_device():
    """Every page again, in one child process with ONE device: the counts must follow the mesh."""
    env = dict(os.environ)
    cpu_environment(env, 1, replace=True)
    env["XLA_FLAGS"] = " ".join([env["XLA_FLAGS"], *FAST_COMPILE_FLAGS])
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    # run() kills the child when the time is up or anything else goes wrong.
    proc = subprocess.run(
        [sys.executable, __file__, *RUNNABLE],
        cwd=ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=ONE_DEVICE_WAIT_S,
    )
    assert proc.returncode == 0, proc.stdout[-12000:] + proc.stderr[-4000:]
    assert proc.stdout.split() == ["ran", "on", "1", "devices:", *RUNNABLE], proc.stdout + proc.stderr[-4000:]


def test_output_blocks_follow_the_code_they_quote(tmp_path):
    page = tmp_path / "p.md"
    page.write_text('```python\nprint(1 + 1)\n```\n\n```text title="Output"\n2\n```\n')
    assert run_page(page, 1) == []
    page.write_text('```python\nprint(1 + 2)\n```\n\n```text title="Output"\n2\n```\n')
    assert "instead of" in run_page(page, 1)[0]
    page.write_text('```python\nprint(1 + 2)\n```\n\n```text title="Output on 8 devices"\n2\n```\n')
    assert run_page(page, 1) == [] and "instead of" in run_page(page, 8)[0]
    page.write_text('```python\nprint("took 3.2 s")\n```\n\n```text title="Output"\ntook ... s\n```\n')
    assert run_page(page, 1) == []


@pytest.mark.parametrize("page", _pages_with("py"))
def test_comparison_code_compiles(page):
    for block in _page_blocks(DOCS / page):
        if block.lang == "py":
            assert block.title, f"docs/{page}:{block.line}: a py block (not run) needs a title saying what it is"
            compile("\n" * (block.line - 1) + block.body, f"docs/{page}", "exec")


def test_pages_have_runnable_examples():
    # The pages that teach the API must keep executable examples.
    runnable = set(_pages_with("python")) | set(_pages_with("pycon"))
    assert {"index.md", "getting-started.md", "concepts.md", "migrating.md"} <= runnable


def test_site_builds_strict(tmp_path):
    # CI builds the site after the tests (the docs extra is installed then); this runs it
    # here too when mkdocs is installed (about 2 s).
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings_handlers.python")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    page = (tmp_path / "site" / "getting-started" / "index.html").read_text()
    assert "make_kernels" in page and "make_step" in page  # the example's snippets were included


if __name__ == "__main__":  # the one-device run of test_code_examples_run_on_one_device: python test_docs.py PAGE...
    failed = [f for page in sys.argv[1:] for f in run_page(DOCS / page, jax.device_count())]
    print("\n\n".join(failed) if failed else f"ran on {jax.device_count()} devices: {' '.join(sys.argv[1:])}")
    sys.exit(1 if failed else 0)
