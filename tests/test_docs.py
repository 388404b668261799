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

import ast
import contextlib
import dataclasses
import doctest
import importlib
import importlib.util
import io
import json
import os
import re
import subprocess
import sys
import tomllib
import traceback
from pathlib import Path

import jax
import pytest
from optional_imports import unusable
from packaging.requirements import Requirement

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
# Modules a block may import whose package can be installed without supporting the installed JAX (kfac-jax 0.0.8
# cannot be imported on JAX >= 0.11): such a block is skipped there, with the reason, and the page's others run.
NEEDS = {"kfac_jax": "kfac_jax", "shardvmc.kfac": "kfac_jax"}


def _public_modules():
    """(module path, __all__) of every public module whose names the reference must list."""
    out = [("shardvmc", list(shardvmc.__all__))]
    for sub in ("testing", "distributed", "launch", "kfac", "optax", "mcmc", "hamiltonian", "linalg", "driver", "dmc",
                "loss"):  # fmt: skip
        try:
            module = importlib.import_module(f"shardvmc.{sub}")
        except ImportError:  # its optional dependency is missing, or cannot run on this JAX (shardvmc.kfac says which)
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
    stale, unchecked = [], {}
    for name in sorted(_documented()):
        module_name, _, attr = name.rpartition(".")
        if why := _cannot_import(name):
            unchecked.setdefault(why, []).append(name)
            continue
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
    _skip_if_any([f"{', '.join(names)} ({why})" for why, names in unchecked.items()], "the others exist; not checked")


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


def test_the_module_table_of_contributing_lists_every_module():
    """docs/contributing.md's table says what each module of the package owns: none may be missing or stale."""
    text = (DOCS / "contributing.md").read_text()
    listed = {name for row in re.findall(r"^\| (`[^|]+`) \|", text, re.M) for name in re.findall(r"`(\w+)`", row)}
    modules = {p.stem for p in (ROOT / "shardvmc").glob("*.py") if p.stem != "__init__"}
    assert listed == modules, f"missing from the table: {sorted(modules - listed)}; stale: {sorted(listed - modules)}"


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


# ----------------------------------------------------------------------------- what the site states

MKDOCS = ROOT / "mkdocs.yml"
EXTRAS_PAGE = DOCS / "getting-started.md"
EXTRAS_ROW = re.compile(r"^\| `(?P<extra>[\w-]+)`:[^|\n]*\| (?P<adds>[^|\n]*) \|$", re.M)
CLONE = re.compile(r"git clone (\S+?)(?:\.git)?(?=\s|$)", re.M)
RELEASE = re.compile(r"^## (\d+\.\d+\.\d+)(.*)$", re.M)

_hooks_spec = importlib.util.spec_from_file_location("docs_hooks", DOCS / "hooks.py")
assert _hooks_spec is not None and _hooks_spec.loader is not None
docs_hooks = importlib.util.module_from_spec(_hooks_spec)
_hooks_spec.loader.exec_module(docs_hooks)


def _mkdocs_setting(key: str) -> str:
    m = re.search(rf"^{key}:\s*(\S+)\s*$", MKDOCS.read_text(), re.M)
    assert m, f"mkdocs.yml has no top-level {key}"
    return m.group(1)


def extras_table_mismatches(page_text: str, extras: dict[str, list[str]]) -> list[str]:
    """How the extras table of ``page_text`` differs from pyproject's ``[project.optional-dependencies]``.

    A row is ``| `extra`: what for | adds |``; ``adds`` names each requirement's package in backquotes, and
    says "below X" for a requirement capped at ``<X`` (the JAX pin of the kfac-jax extras).
    """
    section = page_text[page_text.index("## Extras and GPUs") :]
    rows = {m["extra"]: m["adds"] for m in EXTRAS_ROW.finditer(section)}
    out = []
    if set(rows) != set(extras):
        out.append(f"extras in the table {sorted(rows)}, in pyproject {sorted(extras)}")
    for extra in sorted(set(rows) & set(extras)):
        requirements = [Requirement(r) for r in extras[extra]]
        listed = set(re.findall(r"`([^`]+)`", rows[extra]))
        wanted = {r.name for r in requirements}
        if listed != wanted:
            out.append(f"{extra}: the table adds {sorted(listed)}, pyproject {sorted(wanted)}")
        for r in requirements:
            for cap in (s.version for s in r.specifier if s.operator == "<"):
                if f"below {cap}" not in rows[extra]:
                    out.append(f"{extra}: pyproject caps {r.name} below {cap}; the table does not say so")
    return out


def _pyproject_extras() -> dict[str, list[str]]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def test_the_extras_table_is_pyprojects():
    mismatches = extras_table_mismatches(EXTRAS_PAGE.read_text(), _pyproject_extras())
    assert not mismatches, "docs/getting-started.md's extras table is not pyproject.toml's:\n" + "\n".join(mismatches)


def test_the_extras_check_sees_a_difference():
    text, extras = EXTRAS_PAGE.read_text(), _pyproject_extras()
    assert extras_table_mismatches(text, extras) == []
    assert extras_table_mismatches(text, {**extras, "new": ["tqdm>=4"]}) == [
        f"extras in the table {sorted(extras)}, in pyproject {sorted([*extras, 'new'])}"
    ]
    grown = {**extras, "optax": ["optax>=0.2.8", "tqdm"]}
    assert extras_table_mismatches(text, grown) == ["optax: the table adds ['optax'], pyproject ['optax', 'tqdm']"]
    uncapped = {**extras, "kfac": [r.replace(",<0.11", "") for r in extras["kfac"]] + ["optax<9"]}
    assert extras_table_mismatches(text, uncapped) == ["kfac: pyproject caps optax below 9; the table does not say so"]


def _install_pages() -> list[Path]:
    return [*sorted(DOCS.glob("*.md")), ROOT / "README.md", ROOT / "CHANGELOG.md"]


def test_every_page_installs_in_a_clone():
    # The package is installed from a clone (pip install -e ".[extra]"), not by name from an index.
    by_name = re.compile(r"pip install\s+[\"']?shardvmc\b")
    found = [f"{p.name}: {m.group(0)}" for p in _install_pages() for m in by_name.finditer(p.read_text())]
    assert not found, f"install by name where the pages install in a clone: {found}"


def test_the_repository_is_named_where_the_install_is():
    repo = _mkdocs_setting("repo_url")
    for page in (DOCS / "index.md", DOCS / "getting-started.md", ROOT / "README.md"):
        text = page.read_text()
        assert f"git clone {repo}.git" in text and f"<{repo}>" in text, f"{page.name}: no link to {repo} or clone of it"
    for page in _install_pages():
        for url in CLONE.findall(page.read_text()):
            assert url == repo, f"{page.name} clones {url}, mkdocs.yml's repo_url is {repo}"


def test_the_site_has_an_address():
    # mkdocs writes an empty sitemap.xml without site_url.
    assert re.fullmatch(r"https://\S+/", _mkdocs_setting("site_url"))


def test_the_package_links_the_repository_the_site_and_the_changelog():
    urls = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["urls"]
    repo, site = _mkdocs_setting("repo_url"), _mkdocs_setting("site_url")
    expected = {"Repository": repo, "Documentation": site, "Changelog": f"{site}changelog/", "Issues": f"{repo}/issues"}
    assert urls == expected
    assert (DOCS / "changelog.md").exists()  # the site's page of CHANGELOG.md


def test_the_site_shows_the_packages_version():
    assert docs_hooks.package_version() == shardvmc.__version__
    config = docs_hooks.on_config({"site_name": "shardvmc"})
    assert config["site_name"] == f"shardvmc {shardvmc.__version__}"
    assert docs_hooks.on_config(config)["site_name"] == f"shardvmc {shardvmc.__version__}"  # once only


def test_the_citation_names_the_packages_version():
    # docs/licence.md's BibTeX entry: the version a reader cites is the version of the tree the site was built from
    assert re.findall(r"^\s*version\s*=\s*\{([^}]*)\},", (DOCS / "licence.md").read_text(), re.M) == [
        shardvmc.__version__
    ]


def test_every_release_in_the_changelog_has_its_date():
    releases = RELEASE.findall((ROOT / "CHANGELOG.md").read_text())
    assert shardvmc.__version__ in [version for version, _ in releases]
    dated = re.compile(r" \((\d{4}-\d\d-\d\d|unreleased)\)")
    undated = [version + rest for version, rest in releases if not dated.fullmatch(rest)]
    assert not undated, f"CHANGELOG.md: releases without a date (## X.Y.Z (YYYY-MM-DD)): {undated}"


# ----------------------------------------------------------------------------- code width

# docs/code_width.py is a script of the docs (CI runs it on the built site), not a package module.
_spec = importlib.util.spec_from_file_location("code_width", DOCS / "code_width.py")
assert _spec is not None and _spec.loader is not None
code_width = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(code_width)
ANY_FENCE = re.compile(r"^(?P<indent>[ \t]*)```[^\n]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$", re.M | re.S)


def _snippet_lines(path: str, section: str | None) -> list[str]:
    lines = (ROOT / path).read_text().splitlines()
    if section:
        start = next(i for i, x in enumerate(lines) if f"--8<-- [start:{section}]" in x)
        end = next(i for i, x in enumerate(lines) if f"--8<-- [end:{section}]" in x)
        lines = [x for x in lines[start + 1 : end] if "--8<-- [" not in x]
    indent = min((len(x) - len(x.lstrip()) for x in lines if x.strip()), default=0)  # dedent_subsections
    return [x[indent:] for x in lines]


def long_code_lines(page: Path, width: int = code_width.WIDTH) -> list[str]:
    """``docs/PAGE:LINE: N characters`` for every code line of ``page`` (included files too) wider than ``width``."""
    text = page.read_text()
    out = []
    for m in ANY_FENCE.finditer(text):
        first = text.count("\n", 0, m.start("body")) + 1
        indent = len(m.group("indent"))
        for k, line in enumerate(m.group("body").splitlines()):
            where = f"docs/{page.name}:{first + k}"
            snippet = SNIPPET.match(line)
            shown = _snippet_lines(snippet["path"], snippet["section"]) if snippet else [line[indent:]]
            out += [f"{where}: {len(x)} characters: {x.strip()[:60]}" for x in shown if len(x.rstrip()) > width]
    return out


@pytest.mark.parametrize("page", sorted(p.name for p in DOCS.glob("*.md")))
def test_code_lines_fit_the_page(page):
    # A wider line is cut off at a 1280 px window (docs/code_width.py says how the width was measured).
    long = long_code_lines(DOCS / page)
    assert not long, f"code lines wider than {code_width.WIDTH} characters (wrap them):\n" + "\n".join(long)


def test_the_width_checks_see_a_long_line(tmp_path):
    page = tmp_path / "p.md"
    long = "y = 0" + " " * 120 + "+ 1"
    page.write_text(f"text\n\n```python\nx = 1\n{long}\n```\n\n!!! note\n    ```\n    ok\n    ```\n")
    assert [x.split(":")[1] for x in long_code_lines(page)] == ["5"]
    wide = "<pre><code>" + "a" * (code_width.WIDTH + 1) + "</code></pre><pre><span>b</span>&lt;</pre>"
    assert code_width.long_lines_in_html(wide) == ["a" * (code_width.WIDTH + 1)]
    assert code_width.long_lines_in_html("<pre>" + "&lt;" * code_width.WIDTH + "</pre>") == []


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


def _imports(block: Block) -> set[str]:
    """The modules a python or pycon block imports (``from a import b`` gives ``a`` and ``a.b``)."""
    if block.lang == "python":
        sources = [block.body]
    else:
        sources = [example.source for example in doctest.DocTestParser().get_examples(block.body)]
    names = set()
    for source in sources:
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module)
                names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _cannot_import(name: str) -> str | None:
    """Why the module or attribute ``name`` cannot be imported here (it needs an unusable package), or None."""
    for prefix, package in NEEDS.items():
        if (name == prefix or name.startswith(prefix + ".")) and (reason := unusable(package)):
            return reason
    return None


def _cannot_run(block: Block) -> str | None:
    """Why the block cannot run here (a package it imports cannot be imported), or None."""
    return next(filter(None, map(_cannot_import, sorted(_imports(block)))), None)


def run_page(page: Path, n_devices: int, skipped: list[str] | None = None) -> list[str]:
    """Run the page's blocks in order in one namespace; the failures, ``docs/PAGE:LINE: what``.

    A page stops at its first failure (the blocks after it would fail for want of its names). A
    block that imports a package that cannot be imported here (``NEEDS``) is not run; it is
    appended to ``skipped`` as ``docs/PAGE:LINE (why)``.
    """
    namespace: dict = {"__name__": "__main__"}  # names in outputs read as in a user's script
    name = f"docs/{page.name}"
    printed: str | None = None  # what the last python block printed
    not_run = False  # whether the last block was one not run here (its Output block is not checked either)
    for block in _page_blocks(page):
        where = f"{name}:{block.line}"
        is_output, for_devices = _expected_output(block)
        follows_not_run, not_run = not_run, False
        if is_output:
            if follows_not_run:
                continue
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
        if (why := _cannot_run(block)) is not None:
            if skipped is not None:
                skipped.append(f"{where} ({why})")
            printed, not_run = None, True
            continue
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


def _skip_if_any(skipped: list[str], what: str = "the other blocks ran; not run") -> None:
    """Skip the test (after its checks passed) when it left something out, saying what and why."""
    if skipped:
        pytest.skip(f"{what}: " + "; ".join(skipped))


@pytest.mark.parametrize("page", RUNNABLE)
def test_code_examples_run(page):
    skipped: list[str] = []
    failures = run_page(DOCS / page, jax.device_count(), skipped)
    assert not failures, "\n".join(failures)
    _skip_if_any(skipped)


@pytest.mark.end_to_end
def test_code_examples_run_on_one_device():
    """Every page again, in one child process with ONE device: the counts must follow the mesh."""
    env = dict(os.environ)
    cpu_environment(env, 1, replace=True)
    # XLA_FLAGS keeps the suite's fast-compile flags (the root conftest.py)
    env["JAX_PLATFORMS"] = "cpu"
    # the suite's import path (pyproject.toml's pythonpath: examples/, tests/), as the pages run in this process
    paths = [str(ROOT), str(ROOT / "examples"), str(ROOT / "tests"), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, paths))
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
    ran, *not_run = proc.stdout.splitlines()
    assert ran.split() == ["ran", "on", "1", "devices:", *RUNNABLE], proc.stdout + proc.stderr[-4000:]
    _skip_if_any([line.removeprefix("skipped ") for line in not_run])


def test_blocks_that_need_an_unusable_package_are_not_run_nor_their_output(tmp_path, monkeypatch):
    monkeypatch.setitem(NEEDS, "not_a_module_anywhere", "not_a_module_anywhere")
    page = tmp_path / "p.md"
    page.write_text(
        '```python\nimport not_a_module_anywhere\nprint(1)\n```\n\n```text title="Output"\n2\n```\n\n'
        '```python\nprint(3)\n```\n\n```text title="Output"\n3\n```\n'
    )
    skipped = []
    assert run_page(page, 1, skipped) == []
    assert skipped == ["docs/p.md:2 (not_a_module_anywhere is not installed)"]


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
    assert "make_step" in page and "sv.driver.run" in page  # the example's snippets were included
    assert not code_width.check_site(tmp_path / "site"), "code lines wider than the page: see docs/code_width.py"
    home = (tmp_path / "site" / "index.html").read_text()
    assert f"<title>shardvmc {shardvmc.__version__}</title>" in home  # the version, from docs/hooks.py
    sitemap = (tmp_path / "site" / "sitemap.xml").read_text()  # empty without site_url
    assert f"<loc>{_mkdocs_setting('site_url')}getting-started/</loc>" in sitemap
    index = json.loads((tmp_path / "site" / "search" / "search_index.json").read_text())
    for name, pages in SEARCHED.items():
        assert pages <= search_hits(index, name), f"searching {name} misses some of {sorted(pages)}"


# Names that pages use only qualified (sv.PaddingWarning), and pages where they are so used.
SEARCHED = {"PaddingWarning": {"concepts/", "faq/"}, "StatsAccumulator": {"getting-started/", "statistics/"}}


def search_hits(index: dict, word: str) -> set[str]:
    """The pages whose search entries hold ``word`` as a term, split as the site's search splits text.

    mkdocs-material's search splits the text between the HTML tags of the index at the configured separator
    (a regular expression) and lower-cases the terms.
    """
    separator = re.compile(index["config"]["separator"])
    pages = set()
    for doc in index["docs"]:
        text = re.sub(r"<[^>]*>", " ", f"{doc['title']} {doc['text']}")
        if word.lower() in {t.lower() for t in separator.split(text)}:
            pages.add(doc["location"].split("#")[0])
    return pages


def test_search_splits_qualified_names():
    text = "<p>a <code>sv.PaddingWarning</code> and n_valid</p>"
    doc = {"location": "concepts/#padding", "title": "Padding", "text": text}
    index = {"config": {"separator": r"[\s\-]+"}, "docs": [doc]}  # mkdocs' default: the name is not found
    assert search_hits(index, "PaddingWarning") == set()
    index["config"]["separator"] = re.search(r"separator: '(.*)'", MKDOCS.read_text()).group(1)  # the site's
    assert search_hits(index, "PaddingWarning") == search_hits(index, "valid") == {"concepts/"}


if __name__ == "__main__":  # the one-device run of test_code_examples_run_on_one_device: python test_docs.py PAGE...
    not_run: list[str] = []
    failed = [f for page in sys.argv[1:] for f in run_page(DOCS / page, jax.device_count(), not_run)]
    print("\n\n".join(failed) if failed else f"ran on {jax.device_count()} devices: {' '.join(sys.argv[1:])}")
    for block in not_run if not failed else []:
        print(f"skipped {block}")  # one line each (optional_imports gives one-line reasons)
    sys.exit(1 if failed else 0)
