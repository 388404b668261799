"""Every byte of a checkpoint is checked, and a damaged step never poisons the others.

The checksums are checked against independent oracles: the bytes themselves (a checksum changes exactly
when they do), the same rows laid out on other meshes, and array data changed behind orbax's back (stored
again with orbax itself, the checksums kept), which only the checksums can see.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import shardvmc as sv
from shardvmc import _checksum

ocp = pytest.importorskip("orbax.checkpoint")

DATA = Path(__file__).parent / "data"


# ---------------------------------------------------------------- the checksum itself

DTYPES = ["float32", "float64", "float16", "bfloat16", "int8", "uint8", "int32", "int64", "bool", "complex64"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_checksum_changes_with_every_flipped_bit(dtype: str) -> None:
    """Exhaustively: each bit flipped alone changes the checksum (any change within one 32-bit word does)."""
    with jax.enable_x64(True):
        x = np.asarray(jax.random.normal(jax.random.key(1), (3, 5)) * 10).astype(jnp.dtype(dtype))
        stored = _checksum.checksum(jnp.asarray(x))
        assert not _checksum.differs(jnp.asarray(x.copy()), stored)
        raw = x.reshape(-1).view(np.uint8)
        changed = 0
        for i in range(raw.size):
            for bit in range(8):
                flipped = raw.copy()
                flipped[i] ^= 1 << bit
                y = flipped.view(x.dtype).reshape(x.shape)
                if dtype == "bool" and y.view(np.uint8).max() > 1:
                    continue  # not a bool any more: JAX would read it as True, the same value
                changed += bool(_checksum.differs(jnp.asarray(y), stored))
        expected = raw.size * 8 if dtype != "bool" else raw.size  # a bool's only other value
        assert changed == expected


def test_host_data_is_checked_in_its_own_dtype() -> None:
    """A float64 NumPy leaf is checked as stored, even with x64 off (where JAX would hold float32)."""
    x = np.linspace(0.0, 1.0, 7)
    stored = _checksum.host_checksum(x)
    assert not _checksum.differs(x.copy(), stored)
    y = x.copy()
    y.view(np.uint8)[0] ^= 1  # below float32's precision: only the float64 bits change
    assert _checksum.differs(y, stored)


@pytest.mark.parametrize("devices", [1, 3, 8])
def test_row_checksums_do_not_depend_on_the_mesh(devices: int) -> None:
    """The rows' checksums are the same sharded over any mesh as unsharded: any process can check the rows it reads."""
    with jax.enable_x64(True):
        host = np.asarray(jax.random.normal(jax.random.key(2), (24, 4, 3)))
        reference = np.asarray(_checksum.row_checksums(jnp.asarray(host)))
        sharded = sv.shard_walker(host, sv.create_mesh(jax.devices()[:devices]))
        sums = _checksum.row_checksums(sharded)
        np.testing.assert_array_equal(np.asarray(sums), reference)
        changed = host.copy()
        changed[17, 2, 1] = np.nextafter(changed[17, 2, 1], 2.0)
        assert [bool(_checksum.differs(sharded, sums, rows)) for rows in (24, 17)] == [False, False]
        assert bool(_checksum.differs(sv.shard_walker(changed, sharded.sharding.mesh), sums, 18))
        assert not bool(_checksum.differs(sv.shard_walker(changed, sharded.sharding.mesh), sums, 17))


# ---------------------------------------------------------------- states, saved and damaged


def make_state(step: int = 3) -> dict[str, Any]:
    """A training state with every kind of leaf: walkers (13 of 16 rows), parameters, Python, NumPy and a key."""
    walkers = sv.initialize_walkers_sharded(
        lambda k: jax.random.normal(k, (2, 3)), 13, sv.create_mesh(), key=jax.random.key(step)
    )
    params = sv.replicate({"w": jnp.arange(5.0) + step, "b": jnp.float32(step)})
    return {"walkers": walkers, "params": params, "step": step, "key": jax.random.key(1), "h": np.arange(3.0) * step}


def leaves(tree: Any) -> list[bytes]:
    """Every leaf's bytes (keys as their data; a walker set's valid rows), to compare states bit for bit."""
    valid = jax.tree.map(
        lambda x: x.data[: x.n_valid] if isinstance(x, sv.WalkerSet) else x,
        tree,
        is_leaf=lambda x: isinstance(x, sv.WalkerSet),
    )
    out = []
    for x in jax.tree.leaves(valid):
        if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        out.append(np.asarray(x).tobytes() + str(np.asarray(x).dtype).encode())
    return out


def three_steps(directory: Path) -> list[dict[str, Any]]:
    states = [make_state(step) for step in range(3)]
    with sv.Checkpointer(directory, keep=None) as ckpt:
        for step, state in enumerate(states):
            ckpt.save(step, state)
    return states


def rewrite_arrays(step_dir: Path, change: Any) -> None:
    """Store a step's arrays again with orbax itself, ``change(arrays)`` applied: data changed behind orbax's back."""
    arrays = step_dir / "arrays"
    checkpointer = ocp.PyTreeCheckpointer()
    tree = checkpointer.metadata(arrays).item_metadata.tree
    args = ocp.args.PyTreeRestore(restore_args={key: ocp.RestoreArgs(restore_type=np.ndarray) for key in tree})
    raw = {key: np.array(value) for key, value in checkpointer.restore(arrays, args=args).items()}
    change(raw)
    shutil.rmtree(arrays)
    checkpointer.save(arrays, raw)
    checkpointer.close()


def flip_bit(key: str, index: int) -> Any:
    def change(raw: dict[str, np.ndarray]) -> None:
        raw[key].reshape(-1).view(np.uint8)[index] ^= 1

    return change


def stored_key(step_dir: Path, path: str) -> str:
    """The key under which the header stores leaf ``path``."""
    header = json.loads((step_dir / "shardvmc" / "metadata").read_text())
    return str(next(i for i, entry in enumerate(header["leaves"]) if entry["path"] == path))


@pytest.mark.parametrize(
    ("path", "byte"),
    [
        ("['walkers'].data", 0),  # a valid walker
        ("['walkers'].data", 14 * 2 * 3 * 4 + 5),  # a padding row: stored data too
        ("['params']['w']", 9),
        ("['params']['b']", 3),
        ("['key']", 1),
        ("['h']", 23),  # host data, float64
    ],
)
def test_changed_array_data_is_refused_naming_the_checkpoint_step_and_leaf(
    tmp_path: Path, path: str, byte: int
) -> None:
    states = three_steps(tmp_path / "run")
    step_dir = tmp_path / "run" / "2"
    rewrite_arrays(step_dir, flip_bit(stored_key(step_dir, path), byte))
    with pytest.raises(sv.DamagedCheckpointError) as info:
        sv.load_state(step_dir, states[2])
    text = str(info.value)
    assert f"'{step_dir}' (step 2)" in text and f"does not match its checksums, in leaf {path}." in text, text
    with sv.Checkpointer(tmp_path / "run") as ckpt:
        with pytest.raises(sv.DamagedCheckpointError, match=r"\(step 2\)"):
            ckpt.restore(states[2], step=2)


def test_a_restore_onto_fewer_walkers_checks_the_rows_it_reads(tmp_path: Path) -> None:
    states = three_steps(tmp_path / "run")
    step_dir = tmp_path / "run" / "2"
    rewrite_arrays(step_dir, flip_bit(stored_key(step_dir, "['walkers'].data"), 12 * 2 * 3 * 4))  # row 12
    with pytest.raises(sv.DamagedCheckpointError, match=r"in leaf \['walkers'\]\.data"):
        sv.load_state(step_dir, states[2], n_walkers=13)
    restored, _ = sv.load_state(step_dir, states[2], n_walkers=8, mesh=sv.create_mesh(jax.devices()[:1]))
    np.testing.assert_array_equal(np.asarray(restored["walkers"].data), np.asarray(states[2]["walkers"].data)[:8])


def test_every_flipped_byte_of_the_stored_arrays_is_refused_or_loads_exactly(tmp_path: Path) -> None:
    """Bytes flipped across every file of a step's arrays (data, index, metadata): refused, or not read at all.

    Data chunks are zstd-compressed: a flip there either breaks the decompression (orbax cannot read
    it) or changes the data, which only the checksums see; both must be refused. The sweep is fixed, so
    it meets both kinds every time.
    """
    walkers = sv.initialize_walkers_sharded(lambda k: jax.random.normal(k, (8, 3)), 60, key=jax.random.key(0))
    state = {"walkers": walkers, "params": sv.replicate(jnp.linspace(0.0, 1.0, 5000)), "step": 2}
    sv.save_state(tmp_path / "run", state)  # large enough for data files beside the index
    sv.wait_for_saves()
    source = tmp_path / "run" / "0"
    files = sorted(f.relative_to(source) for f in (source / "arrays").rglob("*") if f.is_file())
    outcomes: dict[str, int] = {}
    for n, name in enumerate(files):
        size = (source / name).stat().st_size
        for position in sorted({int(p) for p in np.linspace(0, size - 1, min(size, 16))}):
            copy = tmp_path / f"flip{n}-{position}" / "0"  # a new path each time: tensorstore caches by path
            shutil.copytree(source, copy)
            data = bytearray((copy / name).read_bytes())
            data[position] ^= 0xFF
            (copy / name).write_bytes(bytes(data))
            try:
                restored, _ = sv.load_state(copy, state)
            except sv.DamagedCheckpointError as err:
                assert f"'{copy}' (step 0)" in str(err), err
                outcome = "checksums" if "does not match its checksums" in str(err) else "unreadable"
            else:
                assert leaves(restored) == leaves(state), f"{name} byte {position} changed the state silently"
                outcome = "exact"
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
            shutil.rmtree(copy.parent)
    assert outcomes.get("checksums", 0) > 0 and outcomes.get("unreadable", 0) > 0, outcomes


# ---------------------------------------------------------------- damaged steps beside intact ones


def _malformed_step_metadata(edit: Any) -> Any:
    def damage(step_dir: Path) -> None:
        path = step_dir / "_CHECKPOINT_METADATA"
        path.write_text(json.dumps(edit(json.loads(path.read_text()))))

    return damage


ORBAX_METADATA_DAMAGE = {
    "list": _malformed_step_metadata(lambda m: []),
    "timestamp-text": _malformed_step_metadata(lambda m: {**m, "commit_timestamp_nsecs": "soon"}),
    "metrics-list": _malformed_step_metadata(lambda m: {**m, "metrics": [1]}),
    "not-json": lambda step_dir: (step_dir / "_CHECKPOINT_METADATA").write_text("{"),
}


@pytest.mark.parametrize("damage", ORBAX_METADATA_DAMAGE.values(), ids=ORBAX_METADATA_DAMAGE.keys())
def test_a_malformed_orbax_file_of_one_step_does_not_stop_the_directory_opening(tmp_path: Path, damage: Any) -> None:
    """orbax's own bookkeeping of step 1 malformed: the directory opens, every step restores, saving goes on."""
    states = three_steps(tmp_path / "run")
    damage(tmp_path / "run" / "1")
    for step in (1, 2):
        restored, _ = sv.load_state(tmp_path / "run" / str(step), states[step])
        assert leaves(restored) == leaves(states[step])
    restored, _ = sv.load_state(tmp_path / "run", states[2])
    assert leaves(restored) == leaves(states[2])
    with sv.Checkpointer(tmp_path / "run", keep=2) as ckpt:
        assert ckpt.steps() == [0, 1, 2]
        ckpt.save(3, make_state(3))
        ckpt.wait()
        assert ckpt.steps() == [2, 3]
        assert leaves(ckpt.restore(make_state(3))[0]) == leaves(make_state(3))


def _skip_deserialize(step_dir: Path) -> None:
    path = step_dir / "arrays" / "_METADATA"
    meta = json.loads(path.read_text())
    for value in meta["tree_metadata"].values():
        value["value_metadata"]["skip_deserialize"] = True
    path.write_text(json.dumps(meta))


def _edit_header(step_dir: Path) -> None:
    path = step_dir / "shardvmc" / "metadata"
    header = json.loads(path.read_text())
    header["leaves"][[e["path"] for e in header["leaves"]].index("['step']")]["value"] = 7
    path.write_text(json.dumps(header))


def _truncate_data(step_dir: Path) -> None:
    for data in step_dir.glob("arrays/**/d/*"):
        data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])


STEP_DAMAGE = {
    "array-data": lambda d: rewrite_arrays(d, flip_bit(stored_key(d, "['params']['w']"), 0)),
    "header-edited": _edit_header,
    "header-removed": lambda d: shutil.rmtree(d / "shardvmc"),
    "skip-deserialize": _skip_deserialize,
    "data-truncated": _truncate_data,
    "arrays-removed": lambda d: shutil.rmtree(d / "arrays"),
}


@pytest.mark.parametrize("damage", STEP_DAMAGE.values(), ids=STEP_DAMAGE.keys())
def test_the_newest_intact_step_is_restored_with_a_warning_naming_the_damaged_ones(tmp_path: Path, damage: Any) -> None:
    states = three_steps(tmp_path / "run")
    damage(tmp_path / "run" / "2")
    with pytest.warns(sv.DamagedCheckpointWarning) as record:
        line = inspect.currentframe().f_lineno + 1  # pyright: ignore[reportOptionalMemberAccess]
        restored, _ = sv.load_state(tmp_path / "run", states[2])  # the warning names this line
    assert leaves(restored) == leaves(states[1])
    (warning,) = record.list
    assert (Path(warning.filename), warning.lineno) == (Path(__file__), line)
    text = str(warning.message)
    assert "skipped the damaged step(s) 2" in text and "restored step 1" in text and "step 2: load_state:" in text
    with sv.Checkpointer(tmp_path / "run") as ckpt:
        with pytest.warns(sv.DamagedCheckpointWarning, match="restored step 1"):
            restored, _ = ckpt.restore(states[2])
        assert leaves(restored) == leaves(states[1])
        with pytest.raises(sv.DamagedCheckpointError, match=r"\(step 2\)"):
            ckpt.restore(states[2], step=2)
    with pytest.raises(sv.DamagedCheckpointError, match=r"\(step 2\)"):
        sv.load_state(tmp_path / "run" / "2", states[2])


def test_a_resumed_run_writes_a_skipped_step_again_and_keeps_the_damaged_one_aside(tmp_path: Path) -> None:
    states = three_steps(tmp_path / "run")
    _edit_header(tmp_path / "run" / "2")
    with sv.Checkpointer(tmp_path / "run", keep=2) as ckpt:
        assert ckpt.save(1, states[1]) is False  # intact and saved: not written twice
        with pytest.warns(sv.DamagedCheckpointWarning, match="restored step 1"):
            ckpt.restore(states[2])
        assert ckpt.save(2, states[2]) is True  # the resumed run reaches step 2 again
        ckpt.wait()
        assert ckpt.steps() == [1, 2]
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert leaves(ckpt.restore(states[2])[0]) == leaves(states[2])
    assert (tmp_path / "run" / "2.damaged-0" / "shardvmc").is_dir()


def test_only_damaged_steps_is_an_error_listing_them(tmp_path: Path) -> None:
    states = three_steps(tmp_path / "run")
    for step in (0, 1, 2):
        _edit_header(tmp_path / "run" / str(step))
    with pytest.raises(sv.DamagedCheckpointError, match=r"every step of .* is damaged \(2, 1, 0\)") as info:
        sv.load_state(tmp_path / "run", states[2])
    assert all(f"step {step}: load_state: the checkpoint" in str(info.value) for step in (0, 1, 2))


def test_a_mistake_of_the_call_is_raised_not_taken_for_damage(tmp_path: Path) -> None:
    """A `like` of another structure fails at once: no older step is tried, no warning."""
    three_steps(tmp_path / "run")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(sv.CallError, match="another structure") as info:
            sv.load_state(tmp_path / "run", {"x": 1})
    assert not isinstance(info.value, sv.DamagedCheckpointError)


def test_a_directory_without_a_committed_step_is_no_checkpoint(tmp_path: Path) -> None:
    """The resume recipe `except FileNotFoundError: start afresh` works on a job's first run."""
    empty = tmp_path / "empty"
    empty.mkdir()
    interrupted = tmp_path / "interrupted"
    (interrupted / "4.orbax-checkpoint-tmp-1234" / "shardvmc").mkdir(parents=True)
    like = make_state()
    for directory in (empty, interrupted):
        with pytest.raises(sv.CheckpointNotFoundError, match="holds no committed checkpoint"):
            sv.load_state(directory, like)
        with pytest.raises(FileNotFoundError):
            sv.load_walkers(directory, like["walkers"])
        with sv.Checkpointer(directory) as ckpt, pytest.raises(FileNotFoundError):
            ckpt.restore(like)


_REFUSED_TWICE = """
import sys, threading
from pathlib import Path
import numpy as np
import shardvmc as sv

tmp = Path(sys.argv[1])
(tmp / "a-file").write_text("x")


def refused():
    for path, excerpt in [("a-file", "is a file"), ("a-file/sub", "cannot be created")]:
        for call in (lambda: sv.Checkpointer(tmp / path), lambda: sv.save_state(tmp / path, {"x": np.zeros(2)})):
            try:
                call()
            except sv.CallError as err:
                assert excerpt in str(err), err
            else:
                raise AssertionError(f"{path}: not refused")


refused()  # once first: orbax may start one asyncio thread per process on its first use, and keep it
before = set(threading.enumerate())
refused()
extra = set(threading.enumerate()) - before
assert not extra, extra
print("no thread left")
"""


def test_a_directory_that_cannot_hold_checkpoints_is_a_call_error_and_leaves_no_thread(tmp_path: Path) -> None:
    """Refused before orbax sees it (orbax would fail in a background thread): no thread is left by a refused call.

    In a process of its own: in the test process, the background work of other tests' checkpoints (orbax's event
    loop starting an executor thread) could start a thread during the check.
    """
    script = tmp_path / "refused.py"
    script.write_text(_REFUSED_TWICE)
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=300,
                          env=env)  # fmt: skip
    assert proc.returncode == 0 and "no thread left" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]


def test_a_checkpoint_of_shardvmc_0_3_still_loads() -> None:
    """Written before checksums (header version 1; tests/data/make_state_v1.py): loaded as it is, unchecked."""
    spec = importlib.util.spec_from_file_location("make_state_v1", DATA / "make_state_v1.py")
    assert spec is not None and spec.loader is not None
    written = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(written)
    with jax.enable_x64(True):
        like = written.state(sv.create_mesh())
        restored, metadata = sv.load_state(DATA / "state_v1", like)
    assert metadata == {"written_by": "shardvmc 0.3.0"}
    assert leaves(restored) == leaves(like)


async def _read_array_index_and_device_put() -> None:  # named as orbax's read of one array's shards
    """Stands in for the reads that a failed orbax read leaves unstarted."""


def test_reads_a_failed_read_left_unstarted_are_not_reported(tmp_path: Path) -> None:
    """Collected unawaited, they warn; where warnings are errors (as here) that is an unraisable exception, which
    pytest would report in whatever test runs then. After a failed read it is dropped."""
    from shardvmc import _orbax_compat

    with pytest.raises(ValueError), _orbax_compat.quiet_failed_reads(tmp_path):
        raise ValueError("a read of the checkpoint failed")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # pytest's filterwarnings = error, whatever filters the test started with
        unstarted = _read_array_index_and_device_put()
        del unstarted  # collected here: the warning is raised, as an unraisable exception
