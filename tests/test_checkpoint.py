"""Walker checkpoints: round trips onto other meshes, atomic writes, damaged files, several processes."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
import zipfile
from pathlib import Path
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from optional_imports import import_or_skip

import shardvmc as sv
import shardvmc._checkpoint as checkpoint_module

ROOT = Path(__file__).resolve().parents[1]

_spec = importlib.util.spec_from_file_location("mp_checkpoint_worker", ROOT / "tests" / "mp_checkpoint_worker.py")
assert _spec is not None and _spec.loader is not None
mp_worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mp_worker)

DATA = ROOT / "tests" / "data"
_legacy_spec = importlib.util.spec_from_file_location("make_legacy_checkpoints", DATA / "make_legacy_checkpoints.py")
assert _legacy_spec is not None and _legacy_spec.loader is not None
legacy = importlib.util.module_from_spec(_legacy_spec)
_legacy_spec.loader.exec_module(legacy)


@chex.dataclass
class State:
    r: Any
    spin: Any


def walkers_on(mesh: Any, n: int, seed: int = 0) -> tuple[dict, int]:
    """A walker pytree of every supported leaf kind, padded for ``mesh``; returns (tree, n)."""
    rng = np.random.default_rng(seed)
    host = {
        "state": State(r=rng.normal(size=(n, 2, 3)).astype(np.float32), spin=rng.integers(0, 2, (n,)).astype(np.int32)),
        "moved": rng.random(n) < 0.5,
        "log_psi": (rng.normal(size=n).astype(jnp.bfloat16),),
        "keys": jax.random.split(jax.random.key(seed), n),
        "run_key": jax.random.key(seed + 1),
        "step": np.int32(17),
    }
    padded, n = sv.pad_walker(host, sv.pad_n_walkers(n, mesh.size))
    return sv.shard_walker(padded, mesh), n


def assert_same_walkers(got: Any, want: Any, n: int) -> None:
    """The first ``n`` walkers (and the scalar leaves) of two walker pytrees are equal, dtypes included."""
    for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree_util.tree_leaves(want)):
        name = jax.tree_util.keystr(path)
        assert g.dtype == w.dtype, name
        walker_leaf = g.ndim > 0
        if jnp.issubdtype(g.dtype, jax.dtypes.prng_key):
            g, w = jax.random.key_data(g), jax.random.key_data(w)
        g, w = np.asarray(g), np.asarray(w)
        if walker_leaf:
            g, w = g[:n], w[:n]
        np.testing.assert_array_equal(g, w, err_msg=name)


def test_restore_from_8_devices_onto_another_mesh(tmp_path: Path, mesh: Any) -> None:
    """Saved from 8 devices (20 walkers padded to 24), restored onto 1, 3 or 8: same walkers, re-padded."""
    saved_on = sv.create_mesh(jax.devices()[:8])
    walkers, n = walkers_on(saved_on, 20)
    assert walkers["moved"].shape == (24,)
    path = sv.save_walkers(tmp_path / "walkers.npz", walkers, n_valid=n, metadata={"step": 1000, "energy": -2.9})

    restored, n_valid, meta = sv.load_walkers(path, walkers, mesh)

    assert n_valid == 20 and meta == {"step": 1000, "energy": -2.9}
    assert isinstance(restored, sv.WalkerSet) and restored.n_valid == 20
    restored = restored.data
    n_pad = sv.pad_n_walkers(20, mesh.size)
    assert_same_walkers(restored, walkers, 20)
    for path_, leaf in jax.tree_util.tree_flatten_with_path(restored)[0]:
        name = jax.tree_util.keystr(path_)
        assert leaf.sharding.mesh == mesh, name
        if name in ("['step']", "['run_key']"):
            assert leaf.shape == () and leaf.sharding.spec == P(), name
            continue
        assert leaf.shape[0] == n_pad and leaf.sharding.spec == P("walkers"), name
        data = np.asarray(jax.random.key_data(leaf) if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key) else leaf)
        np.testing.assert_array_equal(data[20:], np.repeat(data[:1], n_pad - 20, axis=0), err_msg=name)
    assert restored["log_psi"][0].dtype == jnp.bfloat16
    assert jax.random.key_impl(restored["keys"]) == jax.random.key_impl(walkers["keys"])


def test_resumed_chain_continues_the_uninterrupted_one(tmp_path: Path) -> None:
    """Ten steps on 8 devices = five on 8, save, restore on 3, five more (WalkerKey streams are mesh-free)."""

    def make_step(mesh: Any) -> sv.WalkerParallel:
        @sv.walker_parallel(mesh=mesh)
        def step(key: sv.WalkerKey, r: sv.PerWalker[jax.Array]) -> sv.PerWalker[jax.Array]:
            proposal = r + 0.5 * jax.random.normal(key, r.shape)
            return jnp.where(jnp.sum(proposal**2) < jnp.sum(r**2) + 1.0, proposal, r)

        return step

    mesh8, mesh3 = sv.create_mesh(jax.devices()[:8]), sv.create_mesh(jax.devices()[:3])
    step8, step3 = make_step(mesh8), make_step(mesh3)
    key = jax.random.key(3)
    r = sv.initialize_walkers_sharded(lambda k: jax.random.normal(k, (3,)), 13, mesh8, key=key)  # a WalkerSet
    uninterrupted = r
    for t in range(10):
        uninterrupted = step8(jax.random.fold_in(key, t), uninterrupted)
    for t in range(5):
        r = step8(jax.random.fold_in(key, t), r)
    sv.save_walkers(tmp_path / "chain.npz", r, metadata={"t": 5})  # the count comes from the WalkerSet
    r, n_valid, meta = sv.load_walkers(tmp_path / "chain.npz", r, mesh3)
    assert isinstance(r, sv.WalkerSet) and n_valid == r.n_valid == 13
    for t in range(meta["t"], 10):
        r = step3(jax.random.fold_in(key, t), r)
    assert r.n_valid == 13
    np.testing.assert_allclose(np.asarray(r.data)[:13], np.asarray(uninterrupted.data)[:13], rtol=1e-6, atol=1e-6)


def test_like_may_be_shape_dtype_structs_and_n_valid_defaults_to_all(tmp_path: Path) -> None:
    tree = (np.arange(12, dtype=np.float32).reshape(6, 2), {"w": np.arange(6, dtype=np.int32)})
    sv.save_walkers(tmp_path / "c.npz", tree)
    like = (jax.ShapeDtypeStruct((1, 2), jnp.float32), {"w": jax.ShapeDtypeStruct((1,), jnp.int32)})
    out, n_valid, meta = sv.load_walkers(tmp_path / "c.npz", like, sv.create_mesh(jax.devices()[:4]))
    assert n_valid == 6 and meta == {}
    out = out.data
    assert out[0].shape == (8, 2) and out[1]["w"].shape == (8,)
    np.testing.assert_array_equal(np.asarray(out[0])[:6], tree[0])


def test_a_walker_set_carries_its_count_through_save_and_load(tmp_path: Path) -> None:
    mesh = sv.create_mesh(jax.devices()[:4])
    r = np.arange(24, dtype=np.float32).reshape(8, 3)
    walkers = sv.WalkerSet({"r": sv.shard_walker(r, mesh)}, n_valid=6)
    sv.save_walkers(tmp_path / "c.npz", walkers)  # n_valid from the WalkerSet
    sv.save_walkers(tmp_path / "same.npz", walkers, n_valid=6)  # an explicit count that agrees is fine
    restored, n_valid, meta = sv.load_walkers(tmp_path / "c.npz", walkers, sv.create_mesh(jax.devices()[:3]))
    assert (n_valid, restored.n_valid, restored.n_walkers, meta) == (6, 6, 6, {})
    assert RESIZED_KEY not in meta
    np.testing.assert_array_equal(np.asarray(restored.data["r"]), r[:6])
    with pytest.raises(sv.CallError, match=r"(?s)holds 6 walkers, but the WalkerSet `like` expects 8.*n_walkers=8"):
        sv.load_walkers(tmp_path / "c.npz", walkers.replace(n_valid=8))


RESIZED_KEY = "shardvmc.resized"


@pytest.mark.parametrize(("n_walkers", "devices"), [(4, 3), (10, 8), (25, 8)])
def test_elastic_restore_onto_another_walker_count(tmp_path: Path, n_walkers: int, devices: int) -> None:
    """Fewer keeps the first walkers; more repeats the saved ones in order and says they need burn-in."""
    walkers, _ = walkers_on(sv.create_mesh(jax.devices()[:8]), 10)
    sv.save_walkers(tmp_path / "c.npz", walkers, n_valid=10, metadata={"step": 3})
    mesh = sv.create_mesh(jax.devices()[:devices])
    restored, n_valid, meta = sv.load_walkers(tmp_path / "c.npz", walkers, mesh, n_walkers=n_walkers)
    n_pad = sv.pad_n_walkers(n_walkers, devices)
    assert n_valid == restored.n_valid == n_walkers and restored.n_walkers == n_pad
    source = [i % 10 for i in range(n_walkers)] + [0] * (n_pad - n_walkers)  # padding: copies of walker 0
    for (path_, got), want in zip(
        jax.tree_util.tree_flatten_with_path(restored.data)[0], jax.tree_util.tree_leaves(walkers)
    ):
        walker_leaf = got.ndim > 0
        if jnp.issubdtype(got.dtype, jax.dtypes.prng_key):
            got, want = jax.random.key_data(got), jax.random.key_data(want)
        got, want = np.asarray(got), np.asarray(want)
        np.testing.assert_array_equal(got, want[source] if walker_leaf else want, err_msg=jax.tree_util.keystr(path_))
    assert sv.RESIZED == RESIZED_KEY
    if n_walkers == 10:
        assert meta == {"step": 3}
    else:
        assert meta == {
            "step": 3,
            RESIZED_KEY: {
                "saved": 10,
                "restored": n_walkers,
                "duplicated": max(0, n_walkers - 10),
                "dropped": max(0, 10 - n_walkers),
                "needs_burn_in": n_walkers > 10,
            },
        }


def test_x64_walkers_round_trip_and_need_x64_to_load(tmp_path: Path) -> None:
    with jax.enable_x64(True):
        x = jnp.arange(8, dtype=jnp.float64) / 3
        sv.save_walkers(tmp_path / "x64.npz", {"x": x})
        out = sv.load_walkers(tmp_path / "x64.npz", {"x": x}).walkers.data["x"]
        assert out.dtype == jnp.float64
        np.testing.assert_array_equal(np.asarray(out), np.asarray(x))
    with pytest.raises(sv.CallError, match=r"(?s)leaf \['x'\] was saved as float64, but `like` has float32.*x64"):
        sv.load_walkers(tmp_path / "x64.npz", {"x": jnp.zeros(1)})


def test_the_use_mesh_mesh_is_the_default(tmp_path: Path) -> None:
    sv.save_walkers(tmp_path / "c.npz", {"r": np.ones((5, 2), np.float32)})
    mesh = sv.create_mesh(jax.devices()[:2])
    with sv.use_mesh(mesh):
        r = sv.load_walkers(tmp_path / "c.npz", {"r": np.ones((1, 2), np.float32)}).walkers.data["r"]
    assert r.sharding.mesh == mesh and r.shape == (6, 2)


def test_saving_replaces_the_file_and_leaves_no_temporary_files(tmp_path: Path) -> None:
    path = tmp_path / "c.npz"
    sv.save_walkers(path, {"r": np.zeros((4, 3), np.float32)}, metadata={"v": 1})
    sv.save_walkers(path, {"r": np.ones((4, 3), np.float32)}, metadata={"v": 2})
    ck = sv.load_walkers(path, {"r": np.zeros((1, 3), np.float32)})
    assert ck.metadata == {"v": 2} and ck.n_valid == 4 and float(ck.walkers.data["r"][:4].sum()) == 12.0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.npz"]
    assert [p.name for p in path.iterdir()] == ["1"]  # the one step kept (a training state of one walker set)
    header = json.loads((path / "1" / "shardvmc" / "metadata").read_text())
    assert header["format"] == "shardvmc-state" and header["walker_sets"][0]["n_valid"] == 4


def test_a_failed_write_keeps_the_previous_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "c.npz"
    sv.save_walkers(path, {"r": np.zeros((4, 3), np.float32)}, metadata={"v": 1})

    def fail(*args: Any, **kwargs: Any) -> None:
        raise OSError("disk full")

    ocp = pytest.importorskip("orbax.checkpoint")
    monkeypatch.setattr(ocp.PyTreeCheckpointHandler, "async_save", fail)  # fails while writing the arrays
    with pytest.raises(OSError, match="disk full"):
        sv.save_walkers(path, {"r": np.ones((4, 3), np.float32)}, metadata={"v": 2})
    monkeypatch.undo()
    assert sv.load_walkers(path, {"r": np.zeros((1, 3), np.float32)}).metadata == {"v": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.npz"]
    sv.save_walkers(path, {"r": np.ones((4, 3), np.float32)}, metadata={"v": 3})  # clears what the failure left
    assert [p.name for p in path.iterdir()] == ["1"]  # step 1 again: the failed one was never committed


WRITER = textwrap.dedent(
    """
    import os, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import numpy as np
    import shardvmc as sv

    path, n = sys.argv[1], int(sys.argv[2])
    sv.save_walkers(path, {"r": np.zeros((4, 3), np.float32)}, metadata={"version": 0})
    print("ready", flush=True)
    base = np.random.default_rng(0).random((n, 3), np.float32)  # incompressible: the write takes a while
    version = 0
    while True:
        version += 1
        sv.save_walkers(path, {"r": base + np.float32(version)}, metadata={"version": version})
    """
)


def test_a_writer_killed_mid_write_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    """SIGKILL while a large checkpoint is being written: the file at `path` is still a complete checkpoint."""
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    path = tmp_path / "walkers.npz"
    n = 8_000_000  # 96 MB per checkpoint
    with subprocess.Popen(
        [sys.executable, str(script), str(path), str(n)], stdout=subprocess.PIPE, text=True, cwd=tmp_path
    ) as proc:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        partial = None
        deadline = time.monotonic() + 120
        while partial is None and time.monotonic() < deadline and proc.poll() is None:
            for tmp in path.glob("*.orbax-checkpoint-tmp*"):
                if _holds_data(tmp):
                    os.kill(proc.pid, signal.SIGKILL)
                    partial = tmp
                    break
            time.sleep(0.0005)
        proc.kill()  # in case the loop above gave up
    assert partial is not None, "never saw a checkpoint being written"
    assert proc.returncode == -signal.SIGKILL

    like = {"r": np.zeros((1, 3), np.float32)}
    walkers, n_valid, meta = sv.load_walkers(path, like, sv.create_mesh(jax.devices()[:1]))
    r = np.asarray(walkers.data["r"])
    if meta["version"] == 0:
        assert n_valid == 4 and not r.any()
    else:  # a complete earlier big checkpoint
        assert n_valid == n
        base = np.random.default_rng(0).random((n, 3), np.float32)
        np.testing.assert_array_equal(r, base + np.float32(meta["version"]))
    # What the killed writer left behind is not a checkpoint.
    if partial.exists():
        with pytest.raises(sv.CheckpointNotFoundError, match="holds no committed checkpoint"):
            sv.load_walkers(partial, like)


# ---------------------------------------------------------------- damaged and mismatched files


@pytest.fixture
def saved(tmp_path: Path) -> tuple[Path, dict]:
    tree = {"r": np.arange(24, dtype=np.float32).reshape(8, 3), "spin": np.ones(8, np.int32)}
    return sv.save_walkers(tmp_path / "c.npz", tree, n_valid=6), tree


def test_truncated_file(tmp_path: Path) -> None:
    """(A 0.2.0 file: today's checkpoints are orbax directories, truncated as in the state tests below.)"""
    path = _copy_v1(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(sv.CallError, match=r"(?s)load_walkers: '.*walkers\.npz' is truncated or corrupted.*fix:"):
        _load_v1(path)


def test_corrupted_bytes_fail_the_checksum(tmp_path: Path) -> None:
    """(A 0.2.0 file: the zip CRC; orbax keeps no checksum of the array data, see docs/reliability.md.)"""
    path = _copy_v1(tmp_path)
    data = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as z:  # flip a byte inside the walker data, not in the zip structure
        info = z.getinfo("leaf_0.npy")
    offset = info.header_offset + 30 + len(info.filename) + len(info.extra) + 100
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(sv.CallError, match="truncated or corrupted"):
        _load_v1(path)


def _write_plain_npz(f: Any) -> None:
    np.savez(f, r=np.ones(3))


def _write_npy(f: Any) -> None:
    np.save(f, np.ones(3))


def _write_garbage(f: Any) -> None:
    f.write(b"not a zip file at all")


@pytest.mark.parametrize(
    ("write", "excerpt"),
    [
        (_write_garbage, "truncated or corrupted"),
        (_write_plain_npz, "without a shardvmc header"),
        (_write_npy, "single .npy array"),
    ],
    ids=["garbage", "plain-npz", "npy"],
)
def test_files_that_are_not_checkpoints(tmp_path: Path, write: Any, excerpt: str) -> None:
    path = tmp_path / "c.npz"
    with path.open("wb") as f:
        write(f)
    with pytest.raises(sv.CallError, match=excerpt):
        sv.load_walkers(path, {"r": np.ones((1, 3))})


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        sv.load_walkers(tmp_path / "nothing.npz", {"r": np.ones((1, 3))})


@pytest.mark.parametrize(
    ("like", "excerpts"),
    [
        ({"r": np.zeros((1, 3), np.float32)}, ["another structure", "only in the file: [\"['spin']\"]"]),
        (
            {"r": np.zeros((1, 3), np.float32), "spin": np.ones(1, np.int32), "w": np.ones(1)},
            ["another structure", "only in `like`: [\"['w']\"]"],
        ),
        ({"r": np.zeros((1, 3), np.float32), "spin": np.ones(1, np.float32)}, ["leaf ['spin']", "int32", "float32"]),
        ({"r": np.zeros((1, 4), np.float32), "spin": np.ones(1, np.int32)}, ["leaf ['r']", "(6, 3)", "(n_walkers, 4)"]),
        ({"r": np.zeros((1, 3), np.float32), "spin": np.int32(1)}, ["leaf ['spin']", "a scalar, as in `like`"]),
        (({"r": np.zeros((1, 3), np.float32)}, np.ones(1)), ["another structure"]),
    ],
    ids=["missing-leaf", "extra-leaf", "dtype", "trailing-shape", "scalar-vs-walkers", "other-nesting"],
)
def test_mismatched_like_names_what_differs(saved: tuple[Path, dict], like: Any, excerpts: list[str]) -> None:
    path, _ = saved
    with pytest.raises(sv.CallError) as info:
        sv.load_walkers(path, like)
    text = str(info.value)
    assert text.startswith("load_walkers: ") and "\n  fix:" in text
    for excerpt in excerpts:
        assert excerpt in text, text


def test_save_rejects_bad_arguments(tmp_path: Path) -> None:
    tree = {"r": np.ones((8, 3), np.float32)}
    with pytest.raises(sv.CallError, match=r"save_walkers: n_valid=9 is outside 1..8"):
        sv.save_walkers(tmp_path / "c.npz", tree, n_valid=9)
    with pytest.raises(sv.CallError, match="save_walkers: metadata must be a dict"):
        sv.save_walkers(tmp_path / "c.npz", tree, metadata=[1, 2])
    with pytest.raises(sv.CallError, match=r"(?s)save_walkers: metadata cannot be stored as JSON.*float\(energy\)"):
        sv.save_walkers(tmp_path / "c.npz", tree, metadata={"e": np.float32(1)})
    with pytest.raises(sv.CallError, match="save_walkers: the leaves of tree hold different numbers of walkers"):
        sv.save_walkers(tmp_path / "c.npz", {"r": np.ones((8, 3)), "s": np.ones(7)})
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------- files written by 0.2.0


@pytest.mark.parametrize(("name", "x64"), [("walkers_v1.npz", True), ("walkers_v2.npz", False)], ids=["v1", "v2"])
def test_checkpoints_written_by_0_2_0_still_load(name: str, x64: bool, mesh: Any) -> None:
    """The committed files (one process of 8 devices; 2 processes x 2 devices) load onto 1, 3 and 8 devices."""
    with jax.enable_x64(x64):
        host = legacy.walkers(x64)
        ck = sv.load_walkers(DATA / name, host, mesh)
        assert (ck.n_valid, ck.walkers.n_valid, ck.metadata) == (
            legacy.N_VALID,
            legacy.N_VALID,
            {"written_by": "0.2.0"},
        )
        assert_same_walkers(ck.walkers.data, host, legacy.N_VALID)
        assert ck.walkers.data["r"].dtype == (jnp.float64 if x64 else jnp.float32)
        more = sv.load_walkers(DATA / name, host, mesh, n_walkers=2 * legacy.N_VALID + 1)
        source = [i % legacy.N_VALID for i in range(2 * legacy.N_VALID + 1)]
        np.testing.assert_array_equal(np.asarray(more.walkers.data["r"])[: len(source)], host["r"][source])


# ---------------------------------------------------------------- damaged and hand-edited files (issue 17, item 8)


def _copy_v1(tmp_path: Path) -> Path:
    path = tmp_path / "walkers.npz"
    shutil.copy(DATA / "walkers_v1.npz", path)
    return path


def _load_v1(path: Path) -> Any:
    with jax.enable_x64(True):
        return sv.load_walkers(path, legacy.walkers(True), sv.create_mesh(jax.devices()[:1]))


def _assert_names_the_file(info: pytest.ExceptionInfo, path: Path) -> None:
    text = str(info.value)
    assert text.startswith("load_walkers: ") and str(path) in text and "fix:" in text, text


def _central_directory(data: bytes) -> tuple[int, int]:
    """Start and end (the end of the end-of-central-directory record) of a zip's central directory."""
    eocd = data.rfind(b"PK\x05\x06")
    start = int.from_bytes(data[eocd + 16 : eocd + 20], "little")
    return start, eocd + 22


def test_every_flipped_byte_of_the_zip_directory_is_a_call_error_or_loads_exactly(tmp_path: Path) -> None:
    """Each byte of the first two central-directory records (every field once, twice) and of the end record,
    flipped: the same walkers, or a CallError naming the file."""
    path = _copy_v1(tmp_path)
    original = (DATA / "walkers_v1.npz").read_bytes()
    start, end = _central_directory(original)
    offsets = [*range(start, start + 2 * (46 + len("leaf_0.npy"))), *range(end - 22, end)]
    host = legacy.walkers(True)
    outcomes: dict[str, int] = {}
    for offset in offsets:
        damaged = bytearray(original)
        damaged[offset] ^= 0xFF
        path.write_bytes(bytes(damaged))
        try:
            ck = _load_v1(path)
        except sv.CallError as err:
            assert str(path) in str(err), (offset, str(err))
            outcomes["CallError"] = outcomes.get("CallError", 0) + 1
            continue
        except Exception as err:  # noqa: BLE001 - the point: nothing else may come out
            pytest.fail(f"byte {offset} flipped: {type(err).__name__}: {err}")
        with jax.enable_x64(True):
            assert_same_walkers(ck.walkers.data, host, legacy.N_VALID)
        outcomes["loaded"] = outcomes.get("loaded", 0) + 1
    assert outcomes.get("CallError", 0) > len(offsets) // 2, outcomes


def _set_central_field(offset_in_header: int, value: bytes) -> Any:
    """Damage: overwrite a field of the first central-directory entry (version needed, compression, ...)."""

    def damage(data: bytearray) -> None:
        start, _ = _central_directory(bytes(data))
        data[start + offset_in_header : start + offset_in_header + len(value)] = value

    return damage


def _set_local_field(offset_in_header: int, value: bytes) -> Any:
    def damage(data: bytearray) -> None:
        data[offset_in_header : offset_in_header + len(value)] = value

    return damage


@pytest.mark.parametrize(
    ("damage", "excerpt"),
    [
        (_set_central_field(6, b"\xff\x00"), "truncated or corrupted"),  # version needed to extract: 255
        (_set_central_field(10, b"\x63\x00"), "truncated or corrupted"),  # compression method 99
        (_set_central_field(8, b"\x01\x00"), "truncated or corrupted"),  # flag: encrypted
        (_set_local_field(0, b"PK\x00\x00"), "truncated or corrupted"),  # the first entry's local header
    ],
    ids=["zip-version", "compression-method", "encrypted", "local-header"],
)
def test_unsupported_zip_features_are_call_errors(tmp_path: Path, damage: Any, excerpt: str) -> None:
    path = _copy_v1(tmp_path)
    data = bytearray(path.read_bytes())
    damage(data)
    path.write_bytes(bytes(data))
    with pytest.raises(sv.CallError, match=excerpt) as info:
        _load_v1(path)
    _assert_names_the_file(info, path)


def _edit_header(path: Path, edit: Any) -> None:
    """Rewrite the JSON header of the .npz at ``path`` with ``edit(header)`` (as a person with an editor would)."""
    with np.load(path, allow_pickle=False) as data:
        arrays = {name: data[name] for name in data.files}
    header = json.loads(bytes(arrays["__shardvmc__"]).decode())
    edit(header)
    arrays["__shardvmc__"] = np.frombuffer(json.dumps(header).encode(), np.uint8)
    np.savez(path, **arrays)


def _leaf(name: str, key: str, value: Any) -> Any:
    def edit(header: dict) -> None:
        (entry,) = [e for e in header["leaves"] if e["path"] == f"['{name}']"]
        entry[key] = value

    return edit


def _top(key: str, value: Any) -> Any:
    def edit(header: dict) -> None:
        header[key] = value

    return edit


@pytest.mark.parametrize(
    ("edit", "excerpt"),
    [
        (_top("n_valid", 0), "n_valid"),
        (_top("n_valid", -3), "n_valid"),
        (_top("n_valid", True), "n_valid"),
        (_top("n_valid", 17), "n_valid is 17, but leaf"),
        (lambda h: [h.update(n_valid=0), *(e.update(shape=[0, *e["shape"][1:]]) for e in h["leaves"])], "n_valid"),
        (_top("leaves", {"r": 1}), "malformed header"),
        (_top("metadata", [1]), "malformed header"),
        (_leaf("keys", "key_impl", "no_such_rng"), "no_such_rng"),
        (_leaf("keys", "key_impl", 7), "key"),
        (_leaf("keys", "key_impl", "rbg"), "inconsistent"),
        (_leaf("r", "dtype", "float32"), "was saved as float32"),
        (_leaf("r", "dtype", "float99"), "float99"),
        (_leaf("r", "shape", [11, -2, 3]), "shape"),
        (_leaf("r", "shape", "11, 2, 3"), "shape"),
        (_leaf("r", "path", 5), "malformed header"),
        (lambda h: h["leaves"].pop(), "another structure"),
        (lambda h: h.pop("n_valid"), "malformed header"),
    ],
    ids=[
        "n_valid-0",
        "n_valid-negative",
        "n_valid-bool",
        "n_valid-above-rows",
        "n_valid-0-everywhere",
        "leaves-not-a-list",
        "metadata-not-a-dict",
        "unknown-key-impl",
        "key-impl-not-a-name",
        "other-key-impl",
        "other-dtype",
        "unknown-dtype",
        "negative-shape",
        "shape-not-a-list",
        "path-not-a-string",
        "fewer-leaves-than-entries",
        "no-n_valid",
    ],
)
def test_hand_edited_headers_are_call_errors_naming_the_file(tmp_path: Path, edit: Any, excerpt: str) -> None:
    path = _copy_v1(tmp_path)
    _edit_header(path, edit)
    with pytest.raises(sv.CallError, match=excerpt) as info:
        _load_v1(path)
    _assert_names_the_file(info, path)


def test_a_header_that_is_not_json_is_a_call_error(tmp_path: Path) -> None:
    path = _copy_v1(tmp_path)
    with np.load(path, allow_pickle=False) as data:
        arrays = {name: data[name] for name in data.files}
    arrays["__shardvmc__"] = np.frombuffer(b"\xff{not json", np.uint8)
    np.savez(path, **arrays)
    with pytest.raises(sv.CallError, match="truncated or corrupted") as info:
        _load_v1(path)
    _assert_names_the_file(info, path)


# ---------------------------------------------------------------- several processes

WORKER = ROOT / "tests" / "mp_checkpoint_worker.py"


def _launcher(
    processes: int, devices: int, mode: str, directory: Path, worker: Path = WORKER, grace: float = 1
) -> tuple[list[str], dict[str, str]]:
    """The command and environment that run ``worker MODE DIR`` as ``processes`` x ``devices`` through the launcher."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDVMC_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    command = [sys.executable, "-m", "shardvmc.launch", "-n", str(processes), "--devices-per-process", str(devices)]
    command += ["--grace", str(grace), "--timeout", "240", "--", sys.executable, str(worker), mode, str(directory)]
    return command, env


def _launch(processes: int, devices: int, mode: str, directory: Path, worker: Path = WORKER) -> tuple[int, str]:
    """Run the checkpoint worker as ``processes`` x ``devices`` through the launcher."""
    command, env = _launcher(processes, devices, mode, directory, worker)
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    return done.returncode, done.stdout + done.stderr


def _rows(local: dict[str, Any], name: str) -> dict[int, Any]:
    """Global row index -> value, from the ``[[start, stop], rows]`` shards a process reported."""
    return {start + k: row for (start, _), rows in local[name] for k, row in enumerate(rows)}


@pytest.fixture(scope="module")
def saved_by_two_processes(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict], str]:
    """2 processes x 2 devices save 10 walkers; then process 1 is killed in the middle of a second save."""
    directory = tmp_path_factory.mktemp("two_processes")
    code, output = _launch(2, 2, "save", directory)
    # Process 1 is killed mid-save; the launcher reports whichever failure it sees first: that kill, or process 0's
    # collective failing ("connection reset by peer") when its peer vanished.
    assert code in (128 + signal.SIGKILL, 1), output
    assert "the second save completed" not in output
    return directory, [json.loads((directory / f"save_{p}.json").read_text()) for p in (0, 1)], output


def test_check_consistent_across_processes(saved_by_two_processes: tuple[Path, list[dict], str]) -> None:
    _, results, _ = saved_by_two_processes
    for result in results:
        assert result["equal"] == "passed"
        text = result["different"]
        assert text is not None and text.startswith("shardvmc.distributed.check_consistent: parameters differ")
        assert "1 of 3 leaves: ['w']" in text and "['w']: processes [0] vs [1]" in text and "fix:" in text
        assert "['b']" not in text and "['key']" not in text


def test_each_process_writes_only_its_walkers_and_a_manifest_commits(
    saved_by_two_processes: tuple[Path, list[dict], str],
) -> None:
    """The walkers of a multi-process run are one walker set of a state: orbax writes each process's rows to that
    process's own files, and commits the step once every process has written its part."""
    directory, results, _ = saved_by_two_processes
    assert results[0]["steps"] == results[1]["steps"] == ["0"]
    step = directory / "walkers.npz" / "0"
    header = json.loads((step / "shardvmc" / "metadata").read_text())
    assert header["walker_sets"] == [{"path": "<root>", "n_valid": 10, "n_walkers": 12}]
    assert {e["path"]: e["kind"] for e in header["leaves"]} == {
        "['keys']": "walker", "['r']": "walker", "['spin']": "walker", "['step']": "array",
    }  # fmt: skip
    assert header["saved_on"] == {"devices": 4, "processes": 2}
    assert sorted(p.name for p in (step / "arrays").glob("ocdbt.process_*")) == ["ocdbt.process_0", "ocdbt.process_1"]


def test_a_process_killed_mid_save_leaves_the_previous_checkpoint(
    saved_by_two_processes: tuple[Path, list[dict], str],
) -> None:
    directory, _, _ = saved_by_two_processes
    assert sorted(p.name for p in (directory / "walkers.npz").iterdir() if p.name.isdigit()) == ["0"]
    assert list((directory / "walkers.npz").glob("1.orbax-checkpoint-tmp*"))  # the unfinished save, never committed
    ck = sv.load_walkers(directory / "walkers.npz", mp_worker.like(), sv.create_mesh(jax.devices()[:3]))
    assert ck.metadata == {"version": 1} and ck.n_valid == 10


def test_restore_onto_one_process_of_three_devices(saved_by_two_processes: tuple[Path, list[dict], str]) -> None:
    directory, results, _ = saved_by_two_processes
    saved = results[0]["saved"]
    assert results[1]["saved"] == saved
    walkers, n_valid, meta = sv.load_walkers(
        directory / "walkers.npz", mp_worker.like(), sv.create_mesh(jax.devices()[:3])
    )
    assert (n_valid, walkers.n_valid, walkers.n_walkers, meta) == (10, 10, 12, {"version": 1})
    data = walkers.data
    assert data["r"].sharding.spec == P("walkers") and len(data["r"].sharding.device_set) == 3
    np.testing.assert_array_equal(np.asarray(data["r"])[:10], np.asarray(saved["r"], np.float32))
    np.testing.assert_array_equal(np.asarray(jax.random.key_data(data["keys"]))[:10], saved["keys"])
    np.testing.assert_array_equal(np.asarray(data["spin"])[:10], saved["spin"])
    assert int(data["step"]) == 7


def test_restore_onto_four_processes_of_one_device(
    saved_by_two_processes: tuple[Path, list[dict], str], tmp_path: Path
) -> None:
    directory, results, _ = saved_by_two_processes
    saved = results[0]["saved"]
    code, output = _launch(4, 1, "load", directory)
    assert code == 0, output
    loads = [json.loads((directory / f"load_{p}.json").read_text()) for p in range(4)]
    source = [*range(10), 0, 0]  # 12 rows on 4 devices: the last two are copies of walker 0
    for p, result in enumerate(loads):
        assert (result["n_valid"], result["set_n_valid"], result["metadata"], result["step"]) == (
            10,
            10,
            {"version": 1},
            7,
        )
        for name in ("r", "keys", "spin"):
            rows = _rows(result["exact"], name)
            assert sorted(rows) == [3 * p, 3 * p + 1, 3 * p + 2], name  # this process's device only
            for row, value in rows.items():
                np.testing.assert_array_equal(value, saved[name][source[row]], err_msg=f"{name} row {row}")
        # Elastic restore onto fewer walkers: the first six, 2 per device.
        fewer = result["fewer"]
        assert fewer["n_valid"] == 6
        assert fewer["metadata"][sv.RESIZED] == {
            "saved": 10, "restored": 6, "duplicated": 0, "dropped": 4, "needs_burn_in": False,
        }  # fmt: skip
        rows = _rows(fewer["local"], "r")
        assert sorted(rows) == [2 * p, 2 * p + 1]
        for row, value in rows.items():
            np.testing.assert_array_equal(value, saved["r"][row if row < 6 else 0])


def _committed(directory: Path) -> Path:
    """The data directory the manifest names (the killed save left another one beside it)."""
    with np.load(directory / "walkers.npz", allow_pickle=False) as data:
        return directory / json.loads(bytes(data["__shardvmc__"]).decode())["data"]


def _without_part_1(directory: Path) -> None:
    (_committed(directory) / "part-00001.npz").unlink()


def _truncate_part_0(directory: Path) -> None:
    part = _committed(directory) / "part-00000.npz"
    part.write_bytes(part.read_bytes()[:300])


def _manifest_pointing_elsewhere(directory: Path) -> None:
    path = directory / "walkers.npz"
    with np.load(path, allow_pickle=False) as data:
        arrays = {name: data[name] for name in data.files}
    header = json.loads(bytes(arrays["__shardvmc__"]).decode())
    header["data"] = "../elsewhere.d-0123456789abcdef"
    arrays["__shardvmc__"] = np.frombuffer(json.dumps(header).encode(), np.uint8)
    np.savez(path, **arrays)


@pytest.mark.parametrize(
    ("damage", "excerpt"),
    [
        (_without_part_1, r"names the part file '.*part-00001\.npz', which is missing"),
        (_truncate_part_0, r"part-00000\.npz' is truncated or corrupted"),
        (_manifest_pointing_elsewhere, "has a malformed header"),
    ],
    ids=["missing-part", "truncated-part", "data-outside"],
)
def test_damaged_multi_process_checkpoints(tmp_path: Path, damage: Any, excerpt: str) -> None:
    """The part files of a 0.2.0 multi-process checkpoint (today's are orbax steps, damaged as in the state tests)."""
    copy = tmp_path / "copy"
    copy.mkdir()
    shutil.copy(DATA / "walkers_v2.npz", copy / "walkers.npz")
    (data,) = DATA.glob("walkers_v2.npz.d-*")
    shutil.copytree(data, copy / data.name.replace("walkers_v2", "walkers"))
    _edit_header(copy / "walkers.npz", lambda h: h.update(data=h["data"].replace("walkers_v2", "walkers")))
    damage(copy)
    with pytest.raises(sv.CallError, match=excerpt):
        sv.load_walkers(copy / "walkers.npz", legacy.walkers(False), sv.create_mesh(jax.devices()[:2]))


def test_a_save_removes_the_data_directories_it_replaced(
    saved_by_two_processes: tuple[Path, list[dict], str], tmp_path: Path
) -> None:
    """Saving over a multi-process checkpoint removes the step it replaced and what a killed save left."""
    directory, _, _ = saved_by_two_processes
    copy = tmp_path / "copy"
    shutil.copytree(directory, copy)
    (copy / "walkers.npz" / "notours").mkdir()  # not a name orbax writes: kept
    assert len(list((copy / "walkers.npz").iterdir())) == 3  # committed, uncommitted (killed), not ours
    ck = sv.load_walkers(copy / "walkers.npz", mp_worker.like(), sv.create_mesh(jax.devices()[:2]))
    sv.save_walkers(copy / "walkers.npz", ck.walkers, metadata={"version": 3})
    assert sorted(p.name for p in (copy / "walkers.npz").iterdir()) == ["1", "notours"]
    assert sv.load_walkers(copy / "walkers.npz", mp_worker.like()).metadata == {"version": 3}


# ---------------------------------------------------------------- training states: save_state, load_state, Checkpointer

STATE_WORKER = ROOT / "tests" / "mp_state_worker.py"
_state_spec = importlib.util.spec_from_file_location("mp_state_worker", STATE_WORKER)
assert _state_spec is not None and _state_spec.loader is not None
state_worker = importlib.util.module_from_spec(_state_spec)
_state_spec.loader.exec_module(state_worker)


def _host(x: Any) -> np.ndarray:
    """A leaf as NumPy (typed keys as their key data)."""
    if jnp.issubdtype(getattr(x, "dtype", np.float32), jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.asarray(x)


def assert_same_state(got: Any, want: Any, mesh: Any) -> None:
    """Same structure, leaf kinds, dtypes and values; walker sets on ``mesh`` padded with copies of walker 0."""
    got_top = jax.tree_util.tree_flatten_with_path(got, is_leaf=lambda x: isinstance(x, sv.WalkerSet))[0]
    want_top = jax.tree_util.tree_leaves(want, is_leaf=lambda x: isinstance(x, sv.WalkerSet))
    assert len(got_top) == len(want_top)
    for (path, g), w in zip(got_top, want_top):
        name = jax.tree_util.keystr(path)
        if isinstance(w, sv.WalkerSet):
            assert isinstance(g, sv.WalkerSet) and g.n_valid == w.n_valid, name
            assert g.n_walkers == sv.pad_n_walkers(w.n_valid, mesh.size), name
            for gl, wl in zip(jax.tree_util.tree_leaves(g.data), jax.tree_util.tree_leaves(w.data)):
                assert gl.dtype == wl.dtype and gl.sharding == sv.get_walker_sharding(mesh), name
                gh, wh = _host(gl), _host(wl)
                np.testing.assert_array_equal(gh[: w.n_valid], wh[: w.n_valid], err_msg=name)
                np.testing.assert_array_equal(gh[w.n_valid :], np.repeat(gh[:1], len(gh) - w.n_valid, 0), name)
            continue
        assert type(g) is type(w) or (isinstance(w, jax.Array) and isinstance(g, jax.Array)), (name, type(g))
        if isinstance(w, jax.Array):
            assert g.dtype == w.dtype and g.sharding.is_fully_replicated and g.sharding.mesh == mesh, name
            if jnp.issubdtype(w.dtype, jax.dtypes.prng_key):
                assert jax.random.key_impl(g) == jax.random.key_impl(w), name
        elif isinstance(w, np.ndarray):
            assert g.dtype == w.dtype, name
        np.testing.assert_array_equal(_host(g), _host(w), err_msg=name)


@pytest.fixture(scope="module")
def saved_state(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """A training state (13 walkers padded to 16, parameters, Adam state, step, key, NumPy leaf) saved on 8 devices."""
    with jax.enable_x64(True):
        state = {**state_worker.make_state(sv.create_mesh(jax.devices()[:8])), "step": 7}
        state["energies"][:] = [-0.5, -0.25, np.nextafter(-0.125, 0), 1 / 3]
        path = sv.save_state(tmp_path_factory.mktemp("state") / "run", state, metadata={"energy": -0.5})
        sv.wait_for_saves()
    return path, state


def test_a_training_state_saved_on_8_devices_restores_exactly_on_another_mesh(
    saved_state: tuple[Path, dict], mesh: Any
) -> None:
    """Walkers (float64, typed keys), parameters, an optax Adam state, the step, a key: exact, on 1, 3 or 8 devices."""
    path, state = saved_state
    with jax.enable_x64(True):
        restored, meta = sv.load_state(path, state, mesh=mesh)
        assert meta == {"energy": -0.5}
        assert_same_state(restored, state, mesh)
        assert restored["step"] == 7 and type(restored["step"]) is int
        assert type(restored["opt"][0]).__name__ == "ScaleByAdamState" and int(restored["opt"][0].count) == 2
        # The restored state trains on exactly as the saved one does.
        step = state_worker.ADAM.update(restored["params"], restored["opt"], restored["params"])
        want = state_worker.ADAM.update(state["params"], state["opt"], state["params"])
        for g, w in zip(jax.tree_util.tree_leaves(step), jax.tree_util.tree_leaves(want)):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_like_may_be_abstract(saved_state: tuple[Path, dict]) -> None:
    """``jax.eval_shape`` of the state (what a restart has before it builds anything) is enough."""
    path, state = saved_state
    mesh = sv.create_mesh(jax.devices()[:3])
    with jax.enable_x64(True):
        like = jax.eval_shape(lambda: state)
        assert isinstance(like["walkers"], sv.WalkerSet) and isinstance(like["step"], jax.ShapeDtypeStruct)
        restored, _ = sv.load_state(path, like, mesh=mesh)
        assert_same_state(restored, state, mesh)


@pytest.mark.parametrize("n_walkers", [5, 13, 30])
def test_a_state_restores_onto_another_walker_count(saved_state: tuple[Path, dict], n_walkers: int) -> None:
    path, state = saved_state
    mesh = sv.create_mesh(jax.devices()[:3])
    with jax.enable_x64(True):
        restored, meta = sv.load_state(path, state, mesh=mesh, n_walkers=n_walkers)
    walkers = restored["walkers"]
    assert walkers.n_valid == n_walkers and walkers.n_walkers == sv.pad_n_walkers(n_walkers, 3)
    source = [i % 13 for i in range(n_walkers)] + [0] * (walkers.n_walkers - n_walkers)
    for got, want in zip(jax.tree_util.tree_leaves(walkers.data), jax.tree_util.tree_leaves(state["walkers"].data)):
        np.testing.assert_array_equal(_host(got), _host(want)[source])
    if n_walkers == 13:
        assert meta == {"energy": -0.5}
    else:
        assert meta == {"energy": -0.5, sv.RESIZED: checkpoint_module.resized(13, n_walkers)}
        assert meta[sv.RESIZED]["needs_burn_in"] == (n_walkers > 13)


def test_the_save_returns_once_the_state_is_on_the_host(tmp_path: Path) -> None:
    """After save() returns the caller may delete its device arrays and change its host arrays: the file holds
    the state as it was at the call."""
    mesh = sv.create_mesh(jax.devices()[:4])
    with jax.enable_x64(True):
        state = state_worker.make_state(mesh)
        reference = jax.tree_util.tree_map(lambda x: np.array(_host(x)), state)  # copies
        with sv.Checkpointer(tmp_path / "run") as ckpt:
            assert ckpt.save(3, state)
            for leaf in jax.tree_util.tree_leaves(state):
                if isinstance(leaf, jax.Array) and not leaf.is_deleted():
                    leaf.delete()
            state["energies"][:] = 99.0
            ckpt.wait()
            restored, _ = ckpt.restore(state_worker.make_state(mesh), mesh=mesh)
    for (path, got), want in zip(
        jax.tree_util.tree_flatten_with_path(restored)[0], jax.tree_util.tree_leaves(reference)
    ):
        rows = state_worker.N_VALID if "walkers" in jax.tree_util.keystr(path) else None  # (padding: walker 0)
        got = _host(got)
        np.testing.assert_array_equal(got[:rows] if rows else got, want[:rows] if rows else want)


def test_a_checkpointer_keeps_the_last_steps(tmp_path: Path) -> None:
    mesh = sv.create_mesh(jax.devices()[:4])
    with jax.enable_x64(True):
        state = state_worker.make_state(mesh)
        with sv.Checkpointer(tmp_path / "run", keep=2) as ckpt:
            assert ckpt.latest_step() is None
            with pytest.raises(sv.CheckpointNotFoundError, match="holds no committed checkpoint"):
                ckpt.restore(state)
            for step in range(4):
                assert ckpt.save(step, {**state, "step": step}, metadata={"step": step})
            assert not ckpt.save(3, state)  # already saved (a preemption at a periodic save's step)
            assert ckpt.steps() == [2, 3] and ckpt.latest_step() == 3
            assert ckpt.restore(state)[1] == {"step": 3}
            assert ckpt.restore(state, step=2)[0]["step"] == 2
            with pytest.raises(FileNotFoundError, match=r"no step 1 \(it holds \[2, 3\]\)"):
                ckpt.restore(state, step=1)
        assert sorted(p.name for p in (tmp_path / "run").iterdir() if p.name.isdigit()) == ["2", "3"]
        # load_state reads a checkpointer's directory (the latest step) or one of its steps.
        assert sv.load_state(tmp_path / "run", state)[1] == {"step": 3}
        assert sv.load_state(tmp_path / "run" / "2", state)[1] == {"step": 2}


def test_save_state_replaces_the_previous_state(tmp_path: Path) -> None:
    path = tmp_path / "state"
    tree = {"x": np.arange(3.0), "n": 1}
    sv.save_state(path, tree, metadata={"v": 1})
    sv.save_state(path, {**tree, "n": 2}, metadata={"v": 2})
    restored, meta = sv.load_state(path, tree)  # waits for the write of this process
    assert meta == {"v": 2} and restored["n"] == 2
    assert [p.name for p in path.iterdir() if not p.name.startswith(".")] == ["1"]


def _every_kind(mesh: Any) -> dict[str, Any]:
    """A state of every leaf kind docs/reliability.md lists that ``jax.eval_shape`` can describe (it takes no str)."""
    r = np.arange(24.0).reshape(8, 3).astype(jnp.result_type(float))  # float32, or float64 with x64 on
    walkers = {"r": r, "key": jax.random.split(jax.random.key(0), 8)}
    return {
        "walkers": sv.WalkerSet(sv.shard_walker(walkers, mesh), n_valid=6),
        "params": sv.replicate({"w": jnp.linspace(0.0, 1.0, 3), "half": jnp.ones(2, jnp.bfloat16)}, mesh),
        "key": jax.random.key(1),
        "history": np.array([-0.5, np.nextafter(-0.25, 0.0)]),  # a NumPy float64 history, whatever the x64 setting
        "counts": np.arange(3, dtype=np.int64),
        "f32": np.float32(1.5),
        "scalar_array": np.array(4.0),
        "step": 7,
        "lr": 0.1,
        "flag": True,
        "z": 1 - 2j,
    }


@pytest.mark.parametrize("x64", [False, True], ids=["x64-off", "x64-on"])
def test_a_like_made_by_eval_shape_restores_every_leaf_kind(tmp_path: Path, x64: bool) -> None:
    """``jax.eval_shape`` shows NumPy leaves as JAX would hold them (float32 for a float64 history with x64 off):
    they come back as saved, in their own dtype and type."""
    with jax.enable_x64(x64):
        state = _every_kind(sv.create_mesh(jax.devices()[:4]))
        sv.save_state(tmp_path / "s", state)
        like = jax.eval_shape(lambda: state)
        assert x64 or like["history"].dtype == jnp.float32
        mesh = sv.create_mesh(jax.devices()[:3])
        restored, _ = sv.load_state(tmp_path / "s", like, mesh=mesh)
    got_leaves = jax.tree_util.tree_flatten_with_path(restored)[0]
    assert len(got_leaves) == len(jax.tree_util.tree_leaves(state))
    for (path, got), want in zip(got_leaves, jax.tree_util.tree_leaves(state)):
        name = jax.tree_util.keystr(path)
        assert getattr(got, "dtype", None) == getattr(want, "dtype", None), name
        if "walkers" in name:  # sharded on the new mesh, padded for it
            assert isinstance(got, jax.Array) and got.sharding.mesh == mesh, name
            got, want = _host(got)[:6], _host(want)[:6]
        else:
            assert type(got) is type(want) or isinstance(want, jax.Array) and isinstance(got, jax.Array), name
        np.testing.assert_array_equal(_host(got), _host(want), err_msg=name)


def test_a_dtype_that_differs_is_named_and_x64_only_blamed_when_it_is_the_cause(tmp_path: Path) -> None:
    state = {"history": np.zeros(3), "w": jnp.zeros(2)}  # NumPy float64 with x64 off, float32 JAX
    sv.save_state(tmp_path / "off", state)
    with pytest.raises(sv.CallError) as info:
        sv.load_state(tmp_path / "off", {**state, "history": np.zeros(3, np.float32)})
    text = str(info.value)
    assert "leaf ['history'] was saved as float64, but `like` has float32" in text and "x64" not in text, text
    with jax.enable_x64(True):
        sv.save_state(tmp_path / "on", {**state, "w": jnp.zeros(2)})  # float64 JAX
    with pytest.raises(sv.CallError) as info:
        sv.load_state(tmp_path / "on", jax.eval_shape(lambda: state))
    text = str(info.value)
    assert "leaf ['w'] was saved as float64, but `like` has float32" in text, text
    assert "saved with jax_enable_x64 on" in text, text


def test_no_manager_or_thread_outlives_its_save(tmp_path: Path) -> None:
    """save_walkers returns with its write closed; save_state's write ends with its commit, whatever the paths.

    The threads a first save starts for the whole process (asyncio's default executor, which orbax's
    writes use) are counted before: what must not grow is a manager and its thread per path.
    """

    def ended(before: set) -> bool:  # threads the saves started end (a pool thread may take a moment to exit)
        for thread in set(threading.enumerate()) - before:
            thread.join(timeout=60)
        return set(threading.enumerate()) <= before

    sv.save_walkers(tmp_path / "first", {"r": np.zeros((4, 3), np.float32)})
    before = set(threading.enumerate())
    sv.save_walkers(tmp_path / "w", {"r": np.zeros((4, 3), np.float32)})
    assert ended(before)
    for k in range(4):
        sv.save_state(tmp_path / f"s{k}", {"x": np.arange(3.0), "k": k})
    sv.wait_for_saves()
    assert ended(before)
    assert [sv.load_state(tmp_path / f"s{k}", {"x": np.zeros(3), "k": 0})[0]["k"] for k in range(4)] == [0, 1, 2, 3]


def test_python_and_numpy_leaves_keep_their_kind(tmp_path: Path) -> None:
    tree = {
        "int": 2**70,
        "float": 0.1,
        "nan": float("nan"),
        "complex": 1 - 2.5j,
        "bool": True,
        "text": "minsr",
        "f32": np.float32(1.5),
        "i64": np.arange(3, dtype=np.int64),
        "half": np.ones((2, 2), jnp.bfloat16),
        "scalar_array": np.array(4.0),
        "replicated_bf16": jnp.arange(3, dtype=jnp.bfloat16),
    }
    sv.save_state(tmp_path / "s", tree)
    restored, _ = sv.load_state(tmp_path / "s", tree)
    for name, want in tree.items():
        got = restored[name]
        assert type(got) is type(want) or isinstance(want, jax.Array), name
        if isinstance(want, float) and want != want:
            assert got != got
        elif isinstance(want, (np.ndarray, np.generic, jax.Array)):
            assert got.dtype == want.dtype and np.shape(got) == np.shape(want), name
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        else:
            assert got == want, name


def test_walkers_held_as_host_data_restore_sharded(tmp_path: Path) -> None:
    walkers = sv.WalkerSet({"r": np.arange(10.0, dtype=np.float32).reshape(5, 2)}, n_valid=4)
    sv.save_state(tmp_path / "s", {"walkers": walkers})
    mesh = sv.create_mesh(jax.devices()[:3])
    restored, _ = sv.load_state(tmp_path / "s", {"walkers": walkers}, mesh=mesh)
    r = restored["walkers"].data["r"]
    assert restored["walkers"].n_valid == 4 and r.shape == (6, 2) and r.sharding == sv.get_walker_sharding(mesh)
    np.testing.assert_array_equal(np.asarray(r), walkers.data["r"][[0, 1, 2, 3, 0, 0]])


def _inconsistent_walker_set() -> sv.WalkerSet:
    """A set claiming more valid walkers than it holds (the constructor refuses it; unflattening does not)."""
    return jax.tree_util.tree_unflatten(
        jax.tree_util.tree_structure(sv.WalkerSet(np.zeros((4, 3)), 4)), [np.zeros((2, 3))]
    )


@pytest.mark.parametrize(
    ("state", "excerpts"),
    [
        ({"w": None, "f": print}, ["leaf ['f'] is not an array or a number", "builtin_function_or_method"]),
        ({"w": _inconsistent_walker_set()}, ["n_valid=4 is outside 1..2"]),
        ({"w": "sharded"}, ["leaf ['w'] is sharded", "put walker data in a sv.WalkerSet"]),
        ({"w": np.array([object()])}, ["object array"]),
    ],
    ids=["function", "count-above-data", "sharded-outside-a-walker-set", "object-array"],
)
def test_save_state_refuses_what_it_cannot_store(tmp_path: Path, state: dict, excerpts: list[str]) -> None:
    if isinstance(state["w"], str):
        state = {"w": sv.shard_walker(np.zeros((8, 3), np.float32), sv.create_mesh())}
    with pytest.raises(sv.CallError) as info:
        sv.save_state(tmp_path / "s", state)
    text = str(info.value)
    assert text.startswith("save_state: ") and "fix:" in text
    for excerpt in excerpts:
        assert excerpt in text, text
    with pytest.raises(sv.CallError, match="metadata cannot be stored as JSON"):
        sv.save_state(tmp_path / "s", {"x": 1}, metadata={"e": jnp.ones(1)})
    with pytest.raises(sv.CallError, match="step must be a non-negative int"):
        sv.Checkpointer(tmp_path / "c").save(-1, {"x": 1})


@pytest.mark.parametrize(
    ("change", "kwargs", "excerpts"),
    [
        (lambda s: {k: v for k, v in s.items() if k != "energies"}, {}, ["another structure", "only in the file"]),
        (
            lambda s: {**s, "walkers": s["walkers"].data},
            {},
            ["another structure", "only in `like`: [\"['walkers']['key']\""],
        ),
        (lambda s: {**s, "energies": np.zeros(4, np.float32)}, {}, ["leaf ['energies'] was saved as float64"]),
        (lambda s: {**s, "params": {**s["params"], "b": jnp.zeros(4)}}, {}, ["leaf ['params']['b']", "(3,)"]),
        (lambda s: {**s, "step": np.zeros(2)}, {}, ["leaf ['step']", "Python scalar"]),
        (
            lambda s: {**s, "walkers": s["walkers"].replace(n_valid=12)},
            {},
            ["holds 13 walkers", "expects 12", "n_walkers=12"],
        ),
        (lambda s: s, {"n_walkers": 0}, ["n_walkers must be a positive int"]),
    ],
    ids=["missing-leaf", "walker-set-missing", "dtype", "shape", "kind", "walker-count", "bad-n_walkers"],
)
def test_load_state_names_what_differs(
    saved_state: tuple[Path, dict], change: Any, kwargs: dict, excerpts: list
) -> None:
    path, state = saved_state
    with jax.enable_x64(True), pytest.raises(sv.CallError) as info:
        sv.load_state(path, change(state), **kwargs)
    text = str(info.value)
    assert text.startswith("load_state: ") and "fix:" in text, text
    for excerpt in excerpts:
        assert excerpt in text, text


def test_load_state_of_nothing(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        sv.load_state(tmp_path / "nothing", {"x": 1})
    (tmp_path / "empty").mkdir()
    with pytest.raises(sv.CheckpointNotFoundError, match="holds no committed checkpoint"):
        sv.load_state(tmp_path / "empty", {"x": 1})
    with pytest.raises(sv.CallError, match=r"(?s)is a file, not a state checkpoint.*sv.load_walkers"):
        sv.load_state(DATA / "walkers_v1.npz", {"x": 1})


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # kfac-jax 0.0.8's own use of jax.core names
def test_a_kfac_jax_optimiser_state_round_trips(tmp_path: Path) -> None:
    kfac_jax = import_or_skip("kfac_jax")

    def loss(params: Any, batch: Any) -> jax.Array:
        x, y = batch
        out = jnp.tanh(x @ params["w1"] + params["b1"]) @ params["w2"]
        kfac_jax.register_squared_error_loss(out, y)
        return jnp.mean((out - y) ** 2)

    params = {"w1": jnp.full((3, 4), 0.1), "b1": jnp.zeros(4), "w2": jnp.full((4, 1), 0.1)}
    optimizer = kfac_jax.Optimizer(
        value_and_grad_func=jax.value_and_grad(loss),
        l2_reg=0.0,
        use_adaptive_learning_rate=True,
        use_adaptive_momentum=True,
        use_adaptive_damping=True,
        initial_damping=1.0,
        multi_device=False,
    )
    mesh = sv.create_mesh(jax.devices()[:4])
    state = sv.replicate(optimizer.init(params, jax.random.key(0), (jnp.ones((8, 3)), jnp.ones((8, 1)))), mesh)
    sv.save_state(tmp_path / "kfac", {"params": sv.replicate(params, mesh), "kfac": state})
    like = {"params": params, "kfac": state}
    restored, _ = sv.load_state(tmp_path / "kfac", like, mesh=sv.create_mesh(jax.devices()[:3]))
    assert type(restored["kfac"]) is type(state)
    for got, want in zip(jax.tree_util.tree_leaves(restored["kfac"]), jax.tree_util.tree_leaves(state)):
        assert got.dtype == want.dtype and got.sharding.is_fully_replicated
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def _header_file(path: Path) -> Path:
    (step,) = [p for p in path.iterdir() if p.name.isdigit()]
    return step / "shardvmc" / "metadata"


def _edit_state_header(edit: Any) -> Any:
    def damage(path: Path) -> None:
        file = _header_file(path)
        header = json.loads(file.read_text())
        edit(header)
        file.write_text(json.dumps(header))

    return damage


def _state_leaf(name: str, key: str, value: Any) -> Any:
    def edit(header: dict) -> None:
        (entry,) = [e for e in header["leaves"] if e["path"] == name]
        entry[key] = value

    return _edit_state_header(edit)


def _remove_arrays(path: Path) -> None:
    shutil.rmtree(_header_file(path).parents[1] / "arrays")


EDITED = "has a header that does not match its checksum"  # an edit that leaves a well-formed header


@pytest.mark.parametrize(
    ("damage", "excerpt"),
    [
        (_edit_state_header(lambda h: h["walker_sets"][0].update(n_valid=0)), "malformed header: its walker sets"),
        (_edit_state_header(lambda h: h["walker_sets"][0].update(n_valid=17)), "malformed header: its walker sets"),
        (_state_leaf("['key']", "key_impl", "no_such_rng"), "'no_such_rng' is not a PRNG key implementation"),
        (_state_leaf("['key']", "key_impl", "rbg"), EDITED),
        (_state_leaf("['step']", "value", 8), EDITED),
        (_edit_state_header(lambda h: h["metadata"].update(energy=0.0)), EDITED),
        (_edit_state_header(lambda h: h.pop("digest")), EDITED),
        (_state_leaf("['params']['a']", "dtype", "float99"), "dtype 'float99' is not a dtype"),
        (_state_leaf("['step']", "value", "seven"), "malformed header: leaf ['step'] holds 'seven'"),
        (_state_leaf("['walkers'].data['r']", "shape", [12, 2, 3]), "is inconsistent: leaf ['walkers'].data['r']"),
        (_edit_state_header(lambda h: h.update(version=99)), "format version 99"),
        (_edit_state_header(lambda h: h.update(format="other")), "not a shardvmc state checkpoint"),
        (lambda path: _header_file(path).write_text("{not json"), "has no readable header"),
        (_remove_arrays, "cannot be read"),
    ],
    ids=[
        "n_valid-0",
        "n_valid-above-rows",
        "unknown-key-impl",
        "other-key-impl",
        "other-python-value",
        "other-metadata",
        "no-digest",
        "unknown-dtype",
        "python-value",
        "walker-rows",
        "version",
        "format",
        "not-json",
        "arrays-removed",
    ],
)
def test_damaged_state_checkpoints_are_call_errors_naming_them(
    saved_state: tuple[Path, dict], tmp_path: Path, damage: Any, excerpt: str
) -> None:
    path, state = saved_state
    copy = tmp_path / "copy"
    shutil.copytree(path, copy)
    damage(copy)
    with jax.enable_x64(True), pytest.raises(sv.CallError) as info:
        sv.load_state(copy, state)
    text = str(info.value)
    assert excerpt in text and str(copy) in text and "fix:" in text, text


TRUNCATED_DATA = textwrap.dedent(
    """
    import os, sys
    from pathlib import Path
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import numpy as np
    import shardvmc as sv

    path = Path(sys.argv[1])
    state = {"x": np.random.default_rng(0).random((4096, 8))}
    sv.save_state(path, state)
    sv.wait_for_saves()
    (data,) = sorted(path.glob("0/arrays/**/d/*"), key=lambda f: f.stat().st_size)[-1:]
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    try:
        sv.load_state(path, state)
    except sv.CallError as err:
        print(err, flush=True)
    """
)


def test_truncated_array_data_is_a_call_error_naming_the_checkpoint(tmp_path: Path) -> None:
    """(In a process of its own: orbax leaves the reads of a failed restore behind, which pytest would report.)"""
    script = tmp_path / "truncated.py"
    script.write_text(TRUNCATED_DATA)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")]))}
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "s")], env=env, capture_output=True, text=True, timeout=120
    )
    expected = f"load_state: the checkpoint '{tmp_path / 's' / '0'}' (step 0) has arrays that cannot be read."
    assert expected in done.stdout, done.stdout + done.stderr
    # orbax's abandoned reads leave nothing behind: no asyncio log, no unraisable exception
    assert not [line for line in done.stderr.splitlines() if not line.startswith("WARNING")], done.stderr


def test_without_orbax_the_state_functions_say_how_to_install_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "orbax", None)
    monkeypatch.setitem(sys.modules, "orbax.checkpoint", None)
    for call in (lambda: sv.Checkpointer(tmp_path), lambda: sv.save_state(tmp_path / "x", {"x": 1})):
        with pytest.raises(ImportError, match=r'orbax-checkpoint, which is not installed: pip install -e "\.\['):
            call()
    with pytest.raises(ImportError, match=r'not installed: pip install -e "\.\[checkpoint\]" in the shardvmc clone'):
        sv.save_walkers(tmp_path / "w", {"r": np.zeros((2, 3), np.float32)})  # walkers alone are a state too
    with jax.enable_x64(True):  # walker files written by 0.2.0 load without orbax
        assert sv.load_walkers(DATA / "walkers_v1.npz", legacy.walkers(True)).n_valid == legacy.N_VALID


ASYNC_WRITER = textwrap.dedent(
    """
    import os, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax, jax.numpy as jnp, numpy as np
    import shardvmc as sv

    directory, n = sys.argv[1], int(sys.argv[2])
    mesh = sv.create_mesh()
    ckpt = sv.Checkpointer(directory, keep=2)
    ckpt.save(0, {"w": sv.WalkerSet(sv.shard_walker(np.zeros((4, 3), np.float32), mesh)), "v": 0})
    ckpt.wait()
    print("ready", flush=True)
    base = sv.shard_walker(np.random.default_rng(0).random((n, 3), np.float32), mesh)  # incompressible
    for version in range(1, 10**6):
        ckpt.save(version, {"w": sv.WalkerSet(base + version), "v": version})  # asynchronous; waits for the last
    """
)


def _holds_data(directory: Path) -> bool:
    """Whether a directory being written holds a file of more than 1 MiB yet (it may vanish meanwhile)."""
    try:
        return any(f.is_file() and f.stat().st_size > 2**20 for f in directory.rglob("*"))
    except FileNotFoundError:  # renamed into place (committed) while we looked
        return False


def test_a_process_killed_during_an_asynchronous_save_leaves_the_previous_state(tmp_path: Path) -> None:
    """SIGKILL while a 96 MB state is being written in the background: the latest committed state loads whole."""
    script = tmp_path / "writer.py"
    script.write_text(ASYNC_WRITER)
    directory = tmp_path / "run"
    n = 8_000_000
    with subprocess.Popen(
        [sys.executable, str(script), str(directory), str(n)], stdout=subprocess.PIPE, text=True, cwd=tmp_path
    ) as proc:
        try:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
            writing = None
            deadline = time.monotonic() + 180
            while writing is None and time.monotonic() < deadline and proc.poll() is None:
                for tmp in directory.glob("*.orbax-checkpoint-tmp*"):
                    if _holds_data(tmp):
                        os.kill(proc.pid, signal.SIGKILL)
                        writing = tmp
                        break
                time.sleep(0.001)
        finally:
            proc.kill()
    assert writing is not None, "never saw a state being written"
    assert proc.returncode == -signal.SIGKILL
    committed = sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())
    unfinished = {int(p.name.split(".")[0]) for p in directory.glob("*.orbax-checkpoint-tmp*")}
    assert committed and not unfinished & set(committed)  # a step is committed whole, or not at all
    latest = committed[-1]
    walkers = sv.WalkerSet(jax.ShapeDtypeStruct((n if latest else 4, 3), jnp.float32))
    restored, _ = sv.load_state(directory, {"w": walkers, "v": 0}, mesh=sv.create_mesh(jax.devices()[:1]))
    assert restored["v"] == latest
    if latest:
        want = np.random.default_rng(0).random((n, 3), np.float32) + np.float32(latest)
    else:
        want = np.zeros((4, 3), np.float32)
    np.testing.assert_array_equal(np.asarray(restored["w"].data), want)


PREEMPTED_SINGLE = textwrap.dedent(
    """
    import os, signal, sys
    import shardvmc as sv

    sig = getattr(signal, sys.argv[1])
    assert not sv.distributed.reached_preemption(0)  # installs the handlers
    os.kill(os.getpid(), sig)  # the process survives it: the handler records the notice
    assert sv.distributed.reached_preemption(1) and sv.distributed.reached_preemption(2)
    sys.exit(sv.distributed.PREEMPTED_EXIT_CODE)
    """
)


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGUSR1"])
def test_a_single_process_sees_a_preemption_signal(tmp_path: Path, sig: str) -> None:
    script = tmp_path / "single.py"
    script.write_text(PREEMPTED_SINGLE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")]))}
    done = subprocess.run([sys.executable, str(script), sig], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == sv.distributed.PREEMPTED_EXIT_CODE == 75, done.stderr


def test_reached_preemption_checks_its_arguments() -> None:
    with pytest.raises(sv.CallError, match="'SIGNOPE' is not a signal"):
        sv.distributed.reached_preemption(0, signals=("SIGNOPE",))
    with pytest.raises(sv.CallError, match="step must be an int"):
        sv.distributed.reached_preemption(1.5, signals=())  # type: ignore[arg-type]
    errors: list[BaseException] = []

    def call() -> None:
        try:
            sv.distributed.reached_preemption(0, signals=("SIGUSR2",))
        except BaseException as err:  # noqa: BLE001
            errors.append(err)

    thread = threading.Thread(target=call)
    thread.start()
    thread.join(60)
    assert len(errors) == 1 and "main thread" in str(errors[0])


# ---------------------------------------------------------------- training states, several processes


class _Background:
    """A launch running in the background; its output is collected, and ``stop`` ends it whatever happens."""

    def __init__(self, command: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.lines: list[str] = []
        self.reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout or []), daemon=True)
        self.reader.start()

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout=timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()  # the launcher stops its processes (SIGTERM, then SIGKILL after --grace)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.reader.join(30)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


@pytest.fixture(scope="module")
def state_launches(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Both 2 x 2 launches of the state tests, run at the same time.

    ``save``: the processes save a state as step 1; process 1 is killed during the
    asynchronous save of step 2. ``train``: a training run; SIGTERM to process 1 once
    both processes are stepping.
    """
    save_dir, train_dir = tmp_path_factory.mktemp("state_two_processes"), tmp_path_factory.mktemp("preempted")
    launches = {
        "save": _Background(*_launcher(2, 2, "save", save_dir, worker=STATE_WORKER)),
        "train": _Background(*_launcher(2, 2, "train", train_dir, worker=STATE_WORKER, grace=20)),
    }
    try:
        deadline = time.monotonic() + 240
        train = launches["train"]
        ready = [train_dir / f"ready_{p}.json" for p in (0, 1)]
        while not all(r.exists() for r in ready) and train.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(r.exists() for r in ready), train.output
        os.kill(json.loads(ready[1].read_text())["pid"], signal.SIGTERM)
        codes = {name: launch.wait(timeout=max(deadline - time.monotonic(), 60)) for name, launch in launches.items()}
    finally:
        for launch in launches.values():
            launch.stop()
    return {
        "save": (save_dir, codes["save"], launches["save"].output),
        "train": (train_dir, codes["train"], launches["train"].output),
    }


@pytest.fixture(scope="module")
def state_saved_by_two_processes(state_launches: dict[str, Any]) -> tuple[Path, dict, str]:
    """2 processes x 2 devices saved a state as step 1; process 1 was killed during the save of step 2."""
    directory, code, output = state_launches["save"]
    assert code in (128 + signal.SIGKILL, 1), output  # the kill, or process 0's broken collective, first
    assert "the second save completed" not in output
    return directory, json.loads((directory / "saved.json").read_text()), output


def test_a_state_saved_by_two_processes_restores_on_one_process_of_three_devices(
    state_saved_by_two_processes: tuple[Path, dict, str],
) -> None:
    directory, saved, _ = state_saved_by_two_processes
    mesh = sv.create_mesh(jax.devices()[:3])
    with jax.enable_x64(True):
        want = state_worker.make_state(mesh)  # the same state: walkers and parameters do not depend on the mesh
        restored, meta = sv.load_state(directory / "state" / "1", want, mesh=mesh)
    assert meta == {"version": 1} and saved["n_walkers"] == 16
    np.testing.assert_array_equal(np.asarray(restored["walkers"].data["r"])[:13], np.asarray(saved["r"])[:13])
    np.testing.assert_array_equal(_host(restored["walkers"].data["key"])[:13], np.asarray(saved["key"])[:13])
    assert_same_state(restored, want, mesh)


def test_a_process_killed_during_a_multi_process_save_leaves_the_previous_state(
    state_saved_by_two_processes: tuple[Path, dict, str], tmp_path: Path
) -> None:
    directory, _, _ = state_saved_by_two_processes
    assert sorted(p.name for p in (directory / "state").iterdir() if p.name.isdigit()) == ["1"]  # 2: uncommitted
    assert list((directory / "state").glob("2.orbax-checkpoint-tmp*"))  # what the unfinished save left
    path = tmp_path / "state"
    shutil.copytree(directory / "state", path)
    with jax.enable_x64(True):
        mesh = sv.create_mesh(jax.devices()[:3])
        state = state_worker.make_state(mesh)
        with sv.Checkpointer(path) as ckpt:
            assert ckpt.steps() == [1] and ckpt.restore(state, mesh=mesh)[1] == {"version": 1}
            ckpt.save(3, state)  # the next save (after its checkpointer cleared the leftovers)
        assert not list(path.glob("*tmp*")) and sorted(p.name for p in path.iterdir() if p.name.isdigit()) == ["1", "3"]


@pytest.fixture(scope="module")
def preempted_run(state_launches: dict[str, Any]) -> tuple[Path, int, list[dict], str]:
    """A 2 x 2 training run that got SIGTERM in process 1: its directory, exit code, the processes' records."""
    directory, code, output = state_launches["train"]
    files = [directory / f"preempted_{p}.json" for p in (0, 1)]
    assert all(f.exists() for f in files), output
    return directory, code, [json.loads(f.read_text()) for f in files], output


def test_sigterm_to_one_process_makes_every_process_save_the_same_step_and_exit(
    preempted_run: tuple[Path, int, list[dict], str],
) -> None:
    directory, code, records, output = preempted_run
    assert code == sv.distributed.PREEMPTED_EXIT_CODE, output
    assert records[0]["step"] == records[1]["step"] and records[0]["started"] == 0, records
    step = records[0]["step"]
    with sv.Checkpointer(directory / "state") as ckpt:
        assert ckpt.latest_step() == step
        with jax.enable_x64(True):
            mesh = sv.create_mesh(jax.devices()[:3])
            restored, meta = ckpt.restore(state_worker.make_state(mesh), mesh=mesh)
    assert restored["step"] == step and meta["preempted"] is True


def test_the_preempted_run_resumes_on_another_mesh_and_continues_the_uninterrupted_one(
    preempted_run: tuple[Path, int, list[dict], str], tmp_path: Path
) -> None:
    """Resumed on 3 devices of one process for 3 more steps: the run of the same steps without interruption
    (run here on the same 3 devices: the run on 2 x 2 equals it to round-off, the walkers' streams do not depend
    on the mesh)."""
    directory, _, records, _ = preempted_run
    until = records[0]["step"] + 3
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(directory / "state", resumed_dir)
    mesh = sv.create_mesh(jax.devices()[:3])
    with jax.enable_x64(True):
        resumed = state_worker.run(resumed_dir, mesh, until=until)
        straight = state_worker.run(tmp_path / "straight", mesh, until=until)
    assert resumed["step"] == straight["step"] == until
    for (path, got), want in zip(jax.tree_util.tree_flatten_with_path(resumed)[0], jax.tree_util.tree_leaves(straight)):
        got, want = _host(got), _host(want)
        if "walkers" in jax.tree_util.keystr(path):
            got, want = got[: state_worker.N_VALID], want[: state_worker.N_VALID]
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12, err_msg=jax.tree_util.keystr(path))


PREEMPTED_AFTER_A_FINISHED_SAVE = textwrap.dedent(
    """
    import os, signal, sys, time
    import jax.numpy as jnp
    import shardvmc as sv

    sv.distributed.initialize()
    state = {"x": sv.replicate(jnp.zeros(3))}
    with sv.Checkpointer(sys.argv[2]) as ckpt:
        for t in range(1, 16):
            if sv.distributed.reached_preemption(t):
                print(f"preempted at step {t}", flush=True)
                ckpt.save(t, state)
                ckpt.wait()
                sys.exit(sv.distributed.PREEMPTED_EXIT_CODE)
            if t % 3 == 0:
                ckpt.save(t, state)
            if t == 10:
                ckpt.wait()  # the save of step 9 is finished by orbax's thread
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(3)  # JAX's notifier looks for the signal once a second
    print("never preempted", flush=True)
    """
)


def test_a_notice_after_an_asynchronous_save_finished_is_acted_on(tmp_path: Path) -> None:
    """orbax's own preemption queries (with the older step of a finished save) must not move JAX's sync point back."""
    script = tmp_path / "preempted.py"
    script.write_text(PREEMPTED_AFTER_A_FINISHED_SAVE)
    code, output = _launch(1, 1, "unused", tmp_path / "run", worker=script)
    assert code == sv.distributed.PREEMPTED_EXIT_CODE and "preempted at step 11" in output, output
