"""The documentation site: every public name in the API reference, every code example runs.

Conventions of the Markdown pages under docs/:

- ```` ```python ```` blocks are run, in page order, in one namespace per page (on the 8
  fake CPU devices of the test process). A block made only of snippet lines
  (``--8<-- "path:section"``) includes a file that has its own tests (the helium example,
  conftest.py); the test checks that the file and section exist.
- ```` ```pycon ```` blocks are doctests, run in the same namespace, output checked.
- ```` ```py ```` blocks show code that is not shardvmc's (pmap, NetKet) for comparison;
  they are only compiled.
- Other languages (bash, text) are not run.

The site itself is built by CI (``mkdocs build --strict``), not here.
"""

import doctest
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

import shardvmc

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
API_PAGE = DOCS / "api.md"
FENCE = re.compile(r"^```(?P<lang>[\w-]*)[^\n]*\n(?P<body>.*?)^```[ \t]*$", re.M | re.S)
SNIPPET = re.compile(r'^\s*--8<--\s+"(?P<path>[^":]+)(?::(?P<section>[\w-]+))?"\s*$')
DIRECTIVE = re.compile(r"^:::\s+(?P<name>[\w.]+)\s*$", re.M)


def _public_modules():
    """(module path, __all__) of every public module whose names the reference must list."""
    out = [("shardvmc", list(shardvmc.__all__))]
    for sub in ("testing", "distributed", "launch", "kfac", "optax"):
        try:
            module = importlib.import_module(f"shardvmc.{sub}")
        except ImportError:  # a submodule not written yet
            continue
        out.append((f"shardvmc.{sub}", list(module.__all__)))
    return out


def _blocks(page: Path):
    text = page.read_text()
    for m in FENCE.finditer(text):
        yield m.group("lang"), m.group("body"), text.count("\n", 0, m.start("body")) + 1


def _pages_with(lang: str):
    return sorted(p.name for p in DOCS.glob("*.md") if any(b[0] == lang for b in _blocks(p)))


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


def _run_python(body: str, namespace: dict, name: str, line: int) -> None:
    lines = body.splitlines()
    if lines and all(SNIPPET.match(x) or not x.strip() for x in lines):
        return  # an included, separately tested file
    code = compile("\n" * (line - 1) + body, name, "exec")
    exec(code, namespace)


def _run_pycon(body: str, namespace: dict, name: str, line: int) -> None:
    test = doctest.DocTestParser().get_doctest(body, namespace, name, name, line - 1)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    result = runner.run(test, clear_globs=False)
    assert result.failed == 0, f"{name}: {result.failed} of {result.attempted} doctest examples failed (see stdout)"


@pytest.mark.parametrize("page", sorted(set(_pages_with("python")) | set(_pages_with("pycon"))))
def test_code_examples_run(page):
    path = DOCS / page
    namespace: dict = {"__name__": f"docs_{path.stem}"}
    ran = 0
    for lang, body, line in _blocks(path):
        name = f"docs/{page}"
        if lang == "python":
            _run_python(body, namespace, name, line)
            ran += 1
        elif lang == "pycon":
            _run_pycon(body, namespace, name, line)
            ran += 1
    assert ran


@pytest.mark.parametrize("page", _pages_with("py"))
def test_comparison_code_compiles(page):
    for lang, body, line in _blocks(DOCS / page):
        if lang == "py":
            compile("\n" * (line - 1) + body, f"docs/{page}", "exec")


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
    assert "metropolis_step" in page and "make_step" in page  # the example's snippets were included
