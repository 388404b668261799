"""``sv.enable_compilation_cache`` and ``sv.driver.run``'s ``compilation_cache``: a second run loads its programs.

In fresh processes (JAX's cache is set up once per process, and each test's directory is its own):
the first run writes the programs it compiled, the second run of the same job reads every one of
them back and compiles none.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

JOB = textwrap.dedent(
    """
    import json, sys
    import jax, jax.numpy as jnp
    import shardvmc as sv

    events = []
    jax.monitoring.register_event_listener(lambda name, **kw: events.append(name))

    @sv.walker_parallel
    def energy(alpha: sv.Replicated, r: sv.PerWalker) -> sv.Mean:
        return jnp.sum(alpha * r**2)

    @jax.jit
    def step(state, key):
        alpha, r = state
        r = r + 0.1 * jax.random.normal(key, r.shape)
        return (alpha, r), {"energy": energy(alpha, r)}

    state = (jnp.float32(0.5), jnp.ones((16, 3)))
    del events[:]  # what compiled before run (the state above) was compiled before the cache was set
    result = sv.driver.run(step, state, 3, key=jax.random.key(0), progress=False, **json.loads(sys.argv[1]))
    print(json.dumps({"hits": events.count("/jax/compilation_cache/cache_hits"),
                      "requests": events.count("/jax/compilation_cache/compile_requests_use_cache"),
                      "energy": float(result.history["energy"][-1]),
                      "dir": jax.config.jax_compilation_cache_dir}))
    """
)


def _job(tmp_path, env: dict[str, str], **run_kwargs) -> dict:
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_COMPILATION_CACHE", "SHARDVMC_COMP"))}
    out = subprocess.run(
        [sys.executable, "-c", JOB, json.dumps(run_kwargs)],
        env={**environ, **env},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_second_run_loads_every_program_the_first_compiled(tmp_path):
    cache = tmp_path / "cache"
    first = _job(tmp_path, {"SHARDVMC_COMPILATION_CACHE": str(cache)})
    assert first["hits"] == 0 and first["requests"] > 0 and first["dir"] == str(cache)
    written = sorted(cache.iterdir())
    assert written
    second = _job(tmp_path, {"SHARDVMC_COMPILATION_CACHE": str(cache)})
    # every program of the run loaded, none compiled again (nothing new written): also those that compile in well
    # under JAX's default of a second
    assert second["hits"] == len(written) and sorted(cache.iterdir()) == written, (first, second)
    assert second["energy"] == first["energy"]  # the same programs, the same numbers


def test_a_directory_given_to_run_and_one_jax_has_and_off(tmp_path):
    given = tmp_path / "given"
    assert _job(tmp_path, {}, compilation_cache=str(given))["dir"] == str(given) and any(given.iterdir())
    mine = tmp_path / "mine"  # JAX's own setting is kept
    assert _job(tmp_path, {"JAX_COMPILATION_CACHE_DIR": str(mine), "SHARDVMC_COMPILATION_CACHE": "off"})["dir"] == str(
        mine
    )
    off = _job(tmp_path, {"SHARDVMC_COMPILATION_CACHE": "off"})
    assert off["dir"] is None and off["hits"] == 0
    unset = _job(tmp_path, {"SHARDVMC_COMPILATION_CACHE": str(tmp_path / "unused")}, compilation_cache=False)
    assert unset["dir"] is None and not (tmp_path / "unused").exists()
