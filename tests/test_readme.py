"""The README's two set-up commands: exactly two, and CI runs the test command verbatim."""

import pathlib
import re

from jax.sharding import PartitionSpec as P

import shardvmc as sv

ROOT = pathlib.Path(__file__).resolve().parents[1]


def commands():
    readme = (ROOT / "README.md").read_text()
    quickstart = readme.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.*?)\n```", quickstart, re.S)


def test_exactly_two_commands():
    run, test = commands()
    # the main job needs optax (its optimiser is an optax chain of shardvmc.optax)
    assert "examples/helium_vmc.py" in run and 'pip install -e ".[optax]"' in run
    assert '".[test]"' in test and "pytest" in test


def test_ci_runs_the_test_command_verbatim():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert commands()[1] in ci


def test_readme_example_runs_and_stays_sharded():
    readme = (ROOT / "README.md").read_text()
    (code,) = re.findall(r"```python\n(.*?)\n```", readme, re.S)
    namespace = {}
    exec(compile(code, "README.md", "exec"), namespace)
    walkers = namespace["walkers"]
    assert isinstance(walkers, sv.WalkerSet) and walkers.n_valid == 4096
    walkers = walkers.data
    assert walkers.shape == (4096, 2, 3)
    assert walkers.sharding.spec == P("walkers") and walkers.sharding.mesh.devices.size == 8
