"""``kernel.explain(...)``: the report of what a kernel does, and ``CommunicationWarning``."""

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import pytest

import shardvmc as sv
from shardvmc._explain import count_collectives


@sv.walker_parallel
def mean_square(r: sv.PerWalker[jax.Array]) -> sv.Mean[jax.Array]:
    return jnp.sum(r**2)


def test_mean_kernel_on_the_default_mesh():
    with warnings.catch_warnings():
        warnings.simplefilter("error", sv.CommunicationWarning)
        e = mean_square.explain(jnp.ones((8, 3)))
    assert isinstance(e, sv.Explanation)
    assert e.collectives == {"all-reduce": 1}
    assert e.unexpected == {} and e.cause is None and e.fix is None
    assert e.mesh_shape == {"walkers": 8} and e.device_ids == tuple(range(8))
    assert e.walker_axis == "walkers" and e.n_devices == 8
    assert (e.n_walkers, e.n_padded, e.pads_inside, e.n_valid, e.walkers_per_device) == (8, 8, False, 8, 1)
    assert (e.batched, e.batch_size) == (False, None)
    (p,) = e.parameters
    assert (p.name, p.path, p.marker, p.spec, p.shape, p.dtype) == (
        "r",
        "",
        "PerWalker",
        jax.sharding.PartitionSpec("walkers"),
        (8, 3),
        "float32",
    )
    (o,) = e.outputs
    assert (o.name, o.marker, o.spec, o.shape) == ("return", "Mean", jax.sharding.PartitionSpec(), ())
    with pytest.raises(dataclasses.FrozenInstanceError):
        e.n_walkers = 3


def test_memory_fields_are_ints():
    e = mean_square.explain(jnp.ones((8, 3)))
    for field in ("argument_bytes", "output_bytes", "temp_bytes", "generated_code_bytes"):
        value = getattr(e, field)
        assert isinstance(value, int) and value >= 0, field
    assert e.argument_bytes > 0 and e.output_bytes > 0  # one walker of 3 floats in, one float out per device


def test_str_names_parameter_paths_specs_and_statics():
    @sv.walker_parallel
    def f(
        params: sv.Replicated[dict], r: sv.PerWalker[jax.Array], power: sv.Static[int]
    ) -> tuple[sv.PerWalker[jax.Array], sv.Sum[jax.Array]]:
        return params["w"] * r**power, jnp.sum(r)

    e = f.explain({"w": jnp.ones(3), "b": jnp.float32(1)}, jnp.ones((8, 3)), power=2)
    text = str(e)
    for expected in (
        "test_str_names_parameter_paths_specs_and_statics.<locals>.f",
        "params['b']",
        "params['w']",
        "P()",
        "P('walkers',)",
        "Static",
        "compiled in",
        "int = 2",
        "float32[8, 3]",
        "return[0]",
        "return[1]",
        "Sum",
        "all-reduce x1",
        "{'walkers': 8}",
        "memory/device",
    ):
        assert expected in text, (expected, text)
    assert [(p.name, p.path) for p in e.parameters] == [
        ("params", "['b']"),
        ("params", "['w']"),
        ("r", ""),
        ("power", ""),
    ]
    assert e.parameters[-1].spec is None and e.parameters[-1].shape is None


def test_walker_set_reports_its_valid_count():
    e = mean_square.explain(sv.WalkerSet(jnp.ones((16, 3)), n_valid=11))
    assert (e.n_walkers, e.n_valid, e.pads_inside) == (16, 11, False)
    assert "valid: 11" in str(e)
    assert mean_square.explain(jnp.ones((16, 3)), n_valid=5).n_valid == 5


def test_uneven_count_reports_padding_inside():
    @sv.walker_parallel
    def square(r: sv.PerWalker[jax.Array]) -> sv.PerWalker[jax.Array]:
        return r**2

    with pytest.warns(sv.CommunicationWarning, match="padded them inside"):
        e = square.explain(jnp.ones((10, 2)))
    assert (e.n_walkers, e.n_padded, e.pads_inside, e.n_valid, e.walkers_per_device) == (10, 16, True, 10, 2)
    assert "padded to 16 inside the kernel" in str(e)
    assert e.outputs[0].spec == jax.sharding.PartitionSpec()  # an uneven count comes back replicated
    assert "pad_walker" in e.fix


def test_batch_size_reports_chunking():
    @sv.walker_parallel(batch_size=4)
    def chunked(r: sv.PerWalker[jax.Array]) -> sv.Mean[jax.Array]:
        return jnp.sum(r)

    e = chunked.explain(jnp.ones((64, 2)))
    assert (e.batch_size, e.batched, e.walkers_per_device) == (4, False, 8)
    assert "batch_size=4" in e.chunking and "2 chunks" in e.chunking
    assert "batch_size=4" in str(e)
    assert e.collectives == {"all-reduce": 1}


def test_batched_reports_blocks():
    @sv.walker_parallel(batched=True)
    def block(r: sv.PerWalker[jax.Array]) -> sv.PerWalker[jax.Array]:
        return r + 1

    e = block.explain(jnp.ones((16, 2)))
    assert e.batched and "block" in e.chunking and e.collectives == {}


def test_sharded_replicated_argument_warns_once_naming_the_gather():
    @sv.walker_parallel
    def scaled(a: sv.Replicated[jax.Array], r: sv.PerWalker[jax.Array]) -> sv.PerWalker[jax.Array]:
        return jnp.sum(a) * r

    sharded = sv.shard_walker(jnp.arange(8.0))  # e.g. the PerWalker output of another kernel
    with pytest.warns(sv.CommunicationWarning) as record:
        e = scaled.explain(sharded, jnp.ones((8, 2)))
    assert len(record) == 1
    text = str(record[0].message)
    assert "scaled" in text and "1 all-gather" in text and "Replicated argument a" in text and "sv.replicate" in text
    assert e.collectives.get("all-gather", 0) >= 1 and e.unexpected == {"all-gather": e.collectives["all-gather"]}
    assert e.parameters[0].placed == jax.sharding.PartitionSpec("walkers")
    assert "passed as P('walkers',)" in str(e) and "unexpected" in str(e)
    with warnings.catch_warnings():
        warnings.simplefilter("error", sv.CommunicationWarning)
        again = scaled.explain(sharded, jnp.ones((8, 2)))  # once per kernel
    assert again.unexpected == e.unexpected
    with warnings.catch_warnings():
        warnings.simplefilter("error", sv.CommunicationWarning)
        clean = scaled.explain(sv.replicate(jnp.arange(8.0)), jnp.ones((8, 2)))
    assert clean.collectives == {} and clean.unexpected == {}


def test_clean_kernels_do_not_warn():
    @sv.walker_parallel
    def step(
        a: sv.Replicated[jax.Array], r: sv.PerWalker[jax.Array], key: sv.WalkerKey
    ) -> tuple[sv.PerWalker[jax.Array], sv.Mean[jax.Array]]:
        r = r + a * jax.random.normal(key, r.shape)
        return r - sv.all_walkers.mean(r), jnp.sum(r)

    with warnings.catch_warnings():
        warnings.simplefilter("error", sv.CommunicationWarning)
        e = step.explain(jnp.float32(0.1), sv.shard_walker(jnp.ones((8, 2))), jax.random.key(0))
    assert set(e.collectives) == {"all-reduce"} and e.unexpected == {}
    assert [p.marker for p in e.parameters] == ["Replicated", "PerWalker", "WalkerKey"]
    assert e.parameters[2].spec == jax.sharding.PartitionSpec()


def test_mesh_of_three_devices_and_a_different_jax_mesh_context():
    mesh3 = sv.create_mesh(jax.devices()[:3])
    kernel = sv.walker_parallel(mesh=mesh3)(mean_square.__wrapped__)
    r = jnp.ones((6, 3))
    with jax.set_mesh(sv.create_mesh()):
        e = kernel.explain(r)
    assert e.mesh_shape == {"walkers": 3} and e.device_ids == (0, 1, 2) and e.n_devices == 3
    assert e.walkers_per_device == 2 and "devices [0, 1, 2]" in str(e)


def test_bad_arguments_raise_like_the_call():
    with pytest.raises(TypeError, match="mean_square"):
        mean_square.explain(jnp.ones((8, 3)), jnp.ones(3))
    with pytest.raises(sv.CallError, match="n_valid"):
        mean_square.explain(jnp.ones((8, 3)), n_valid=9)
    with pytest.raises(sv.CallError, match="scalar"):
        mean_square.explain(jnp.float32(1))


def test_explain_inside_a_kernel_body_is_an_error():
    @sv.walker_parallel
    def outer(r: sv.PerWalker[jax.Array]) -> sv.PerWalker[jax.Array]:
        mean_square.explain(r[None])
        return r

    with pytest.raises(sv.CallError, match="inside a kernel body"):
        outer(jnp.ones((8, 3)))


def test_count_collectives_counts_ops_once():
    text = "\n".join(
        [
            "ENTRY %main (p: f32[8]) -> f32[] {",
            '  %all-gather = f32[8]{0} all-gather(%p), dimensions={0}, metadata={op_name="all-gather(x)"}',
            "  %ars = f32[] all-reduce-start(%q), to_apply=%add",
            "  %ard = f32[] all-reduce-done(%ars)",
            "  %t = (f32[], f32[]) all-reduce(%a, %b), to_apply=%add",
            "  %cp = f32[2]{0} collective-permute-start(%c), source_target_pairs={{0,1}}",
            "  %cpd = f32[2]{0} collective-permute-done(%cp)",
            "  %a2a = f32[8]{0} all-to-all(%d), dimensions={0}",
            "  %rs = f32[1]{0} reduce-scatter(%e), dimensions={0}",
            "  %x = f32[] add(%all-reduce.1, %all-gather)",
            "}",
        ]
    )
    assert count_collectives(text) == {
        "all-reduce": 2,
        "all-gather": 1,
        "all-to-all": 1,
        "collective-permute": 1,
        "reduce-scatter": 1,
    }
    assert count_collectives("ENTRY %main () -> f32[] { ROOT %c = f32[] constant(1) }") == {}
