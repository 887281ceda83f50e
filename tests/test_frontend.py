"""Frontend: input specs, every model source, and torch.export capture (through the Python API)."""

from __future__ import annotations

import zipfile

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mopar import api
from mopar.errors import CaptureError, InputSpecError, ModelLoadError, UntrustedPickleError
from mopar.frontend import load_example_npz, load_model, make_example_arrays, parse_input_spec
from mopar.frontend.inputs import DTYPES, InputSpec
from tests import models
from tests.conftest import SKIPNET_INPUT, eager

# --- input specs ----------------------------------------------------------------------------------


def test_float_spec_parses_name_shape_and_dtype():
    spec = parse_input_spec("x=1x3x8x8:float32")
    assert (spec.name, spec.shape, spec.dtype) == ("x", (1, 3, 8, 8), "float32")


def test_int_spec_with_range_parses_bounds():
    spec = parse_input_spec("ids=1x16:int64:0..1000")
    assert (spec.name, spec.shape, spec.dtype) == ("ids", (1, 16), "int64")
    assert (spec.low, spec.high) == (0, 1000)


def test_int_values_lie_in_the_range_with_high_exclusive():
    arrays = make_example_arrays((parse_input_spec("ids=1x16:int64:0..1000"),))
    ids = arrays["ids"]
    assert ids.shape == (1, 16) and ids.dtype == np.int64
    assert ids.min() >= 0 and ids.max() < 1000
    # With HIGH exclusive, 3..5 draws only 3 and 4 -- and over 4096 draws, both of them.
    wide = make_example_arrays((parse_input_spec("v=1x4096:int64:3..5"),))["v"]
    assert set(np.unique(wide).tolist()) == {3, 4}


def test_negative_ranges_are_allowed():
    v = make_example_arrays((parse_input_spec("v=256:int32:-3..0"),))["v"]
    assert v.dtype == np.int32 and set(np.unique(v).tolist()) == {-3, -2, -1}


def test_float_inputs_are_seeded_standard_normal_and_reproducible():
    specs = (parse_input_spec("x=2x1000:float32"), parse_input_spec("m=1x8:bool"))
    a, b = make_example_arrays(specs), make_example_arrays(specs)
    np.testing.assert_array_equal(a["x"], b["x"])
    assert a["x"].dtype == np.float32 and a["m"].dtype == np.bool_
    assert abs(float(a["x"].mean())) < 0.1 and 0.9 < float(a["x"].std()) < 1.1


@pytest.mark.parametrize(
    "text, reason",
    [
        ("x=1x3x8x8:float99", "not one of"),  # unknown dtype
        ("x=1x0x8x8:float32", "at least 1"),  # zero dimension
        ("x=1x3x8x8float32", "expected NAME=DIMxDIM"),  # missing colon
        ("ids=1x16:int64:5..5", "empty"),  # empty range
        ("ids=1x16:int64:9..2", "empty"),  # reversed range
        ("x=1x16:float32:0..10", "needs an int dtype"),  # range on a float
        ("=1x3:float32", "expected NAME=DIMxDIM"),  # no name
        ("x=1x-3:float32", "expected NAME=DIMxDIM"),  # negative dimension
        ("x", "expected NAME=DIMxDIM"),
    ],
)
def test_bad_spec_raises_input_spec_error_quoting_it(text, reason):
    with pytest.raises(InputSpecError) as info:
        parse_input_spec(text)
    assert repr(text) in str(info.value)
    assert reason in str(info.value)


@pytest.mark.parametrize(
    "text", ["ids=1x64:int32:0..3000000000", "ids=2:int64:0..99999999999999999999"]
)
def test_a_range_the_dtype_cannot_hold_is_an_input_spec_error(text):
    with pytest.raises(InputSpecError):
        make_example_arrays((parse_input_spec(text),))


def test_duplicate_input_names_are_refused():
    spec = parse_input_spec("x=1x2:float32")
    with pytest.raises(InputSpecError, match="unique"):
        make_example_arrays((spec, spec))


@given(
    name=st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,8}", fullmatch=True),
    shape=st.lists(st.integers(1, 64), min_size=1, max_size=4).map(tuple),
    dtype=st.sampled_from(sorted(DTYPES)),
    low=st.integers(-50, 50),
    width=st.integers(1, 50),
)
def test_a_spec_printed_and_parsed_again_is_the_same_spec(name, shape, dtype, low, width):
    bounds = {"low": low, "high": low + width} if dtype.startswith("int") else {}
    spec = InputSpec(name=name, shape=shape, dtype=dtype, **bounds)
    assert parse_input_spec(str(spec)) == spec


def test_example_npz_strips_input_prefix_and_drops_outputs(tmp_path):
    path = tmp_path / "ref.npz"
    np.savez(
        path,
        **{
            "input.x": np.ones((1, 2), np.float32),
            "output.y": np.zeros(3),
            "mask": np.ones(2, np.int64),
        },
    )
    arrays = load_example_npz(path)
    assert sorted(arrays) == ["mask", "x"]
    np.testing.assert_array_equal(arrays["x"], np.ones((1, 2), np.float32))


def test_example_npz_errors_are_input_spec_errors(tmp_path):
    with pytest.raises(InputSpecError, match="does not exist"):
        load_example_npz(tmp_path / "missing.npz")
    objects = tmp_path / "objects.npz"
    np.savez(objects, x=np.array([{"a": 1}], dtype=object))
    with pytest.raises(InputSpecError, match="not a readable"):
        load_example_npz(objects)
    only_outputs = tmp_path / "outputs.npz"
    np.savez(only_outputs, **{"output.y": np.zeros(2)})
    with pytest.raises(InputSpecError, match="holds no arrays"):
        load_example_npz(only_outputs)


# --- model sources --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """SkipNet saved in every file format: .pt2, TorchScript, pickle and state_dict."""
    d = tmp_path_factory.mktemp("sources")
    model = models.skipnet()
    example = torch.randn(1, 3, 8, 8, generator=torch.Generator().manual_seed(7))
    torch.export.save(torch.export.export(model, (example,)), d / "skipnet.pt2")
    torch.jit.save(torch.jit.trace(model, (example,)), d / "skipnet_ts.pt")
    torch.save(model, d / "skipnet_pickle.pt")
    torch.save(model.state_dict(), d / "skipnet_weights.pt")
    return {"dir": d, "example": example, "model": model}


def test_pt2_uses_its_stored_example_inputs(saved):
    analysis = api.analyze(str(saved["dir"] / "skipnet.pt2"))
    captured = analysis.captured
    assert captured.name == "skipnet"
    assert captured.input_names == ("x",)
    np.testing.assert_array_equal(captured.inputs["x"], saved["example"].numpy())
    (ref,) = captured.reference.values()
    torch.testing.assert_close(torch.from_numpy(ref), eager(saved["model"], captured.inputs))
    assert [la.name for la in analysis.layers] == ["stem", "act", "mid1", "mid2", "head"]


class _Flagged(torch.nn.Module):
    """forward() takes a bool besides its tensor, as Hugging Face models take use_cache."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, use_cache: bool = True) -> torch.Tensor:
        return self.fc(x) * 2 if use_cache else self.fc(x) + 1


def test_a_pt2_exported_with_a_non_tensor_input_takes_only_its_tensors(tmp_path):
    model, x = _Flagged().eval(), torch.randn(1, 4)
    torch.export.save(
        torch.export.export(model, (), {"x": x, "use_cache": False}), tmp_path / "f.pt2"
    )
    captured = api.analyze(str(tmp_path / "f.pt2")).captured
    assert captured.input_names == ("x",)
    (ref,) = captured.reference.values()
    torch.testing.assert_close(torch.from_numpy(ref), model(x, use_cache=False))
    plan = api.partition(str(tmp_path / "f.pt2"), (torch.randn(1, 4),))
    assert plan.functions


def test_an_npz_batch_for_a_pt2_of_batch_1_gives_its_first_sample_under_any_key(saved, tmp_path):
    batch = np.random.default_rng(1).standard_normal((4, 3, 8, 8)).astype(np.float32)
    np.savez(tmp_path / "images.npz", images=batch)
    plan = api.partition(str(saved["dir"] / "skipnet.pt2"), tmp_path / "images.npz", slices=2)
    assert tuple(map(str, plan.notes[:2])) == (
        "example inputs: read the one array 'images' of images.npz as input 'x'",
        "example inputs: took the first of the 4 samples of x in images.npz; the model was "
        "exported for batch 1",
    )
    analysis = api.analyze(str(saved["dir"] / "skipnet.pt2"), tmp_path / "images.npz")
    np.testing.assert_array_equal(analysis.captured.inputs["x"], batch[:1])


def test_an_npz_whose_keys_fit_needs_no_note(saved, tmp_path):
    np.savez(tmp_path / "x.npz", x=saved["example"].numpy())
    analysis = api.analyze(str(saved["dir"] / "skipnet.pt2"), tmp_path / "x.npz")
    assert analysis.captured.notes == ()


def test_pt2_with_an_input_of_another_shape_says_how_to_fix_it(saved):
    with pytest.raises(InputSpecError) as info:
        api.analyze(str(saved["dir"] / "skipnet.pt2"), ["x=1x3x9x9:float32"])
    message = str(info.value)  # the API names its argument; the CLI its flag
    assert "(1, 3, 9, 9)" in message and "example_args=['x=1x3x8x8:float32']" in message
    assert "--input x=1x3x8x8:float32" in info.value.render("cli")


def test_pt2_with_an_unknown_input_name_lists_the_real_ones(saved):
    with pytest.raises(InputSpecError, match=r"\['x'\]"):
        api.analyze(str(saved["dir"] / "skipnet.pt2"), ["y=1x3x8x8:float32"])


def test_torchscript_file_is_captured_and_matches_eager(saved):
    analysis = api.analyze(str(saved["dir"] / "skipnet_ts.pt"), [SKIPNET_INPUT])
    captured = analysis.captured
    (ref,) = captured.reference.values()
    torch.testing.assert_close(torch.from_numpy(ref), eager(saved["model"], captured.inputs))
    # TorchScript carries no module hierarchy: layers start at anchor ops (the four convolutions).
    assert len(analysis.layers) == 4


def test_factory_is_resolved_from_package_module_function(skipnet_input):
    captured = api.analyze("tests.models:skipnet", skipnet_input).captured
    assert captured.name == "skipnet"
    (ref,) = captured.reference.values()
    torch.testing.assert_close(torch.from_numpy(ref), eager(models.skipnet(), skipnet_input))


def test_nn_module_instance_is_accepted_directly(skipnet, skipnet_input):
    captured = api.analyze(skipnet, skipnet_input).captured
    (ref,) = captured.reference.values()
    torch.testing.assert_close(torch.from_numpy(ref), eager(skipnet, skipnet_input))


def test_pickled_module_is_refused_without_trust_pickle(saved):
    with pytest.raises(UntrustedPickleError) as info:
        api.analyze(str(saved["dir"] / "skipnet_pickle.pt"), [SKIPNET_INPUT])
    assert "arbitrary code" in str(info.value) and "trust_pickle=True" in str(info.value)


def test_pickled_module_loads_with_trust_pickle(saved, skipnet_input):
    captured = api.analyze(
        str(saved["dir"] / "skipnet_pickle.pt"), skipnet_input, trust_pickle=True
    ).captured
    (ref,) = captured.reference.values()
    torch.testing.assert_close(torch.from_numpy(ref), eager(saved["model"], skipnet_input))


@pytest.mark.parametrize("trust", [False, True])
def test_state_dict_file_gets_a_clear_model_load_error(saved, trust):
    with pytest.raises(ModelLoadError) as info:
        load_model(str(saved["dir"] / "skipnet_weights.pt"), trust_pickle=trust)
    assert not isinstance(info.value, UntrustedPickleError)
    assert "weights only" in str(info.value) and "not a model" in str(info.value)


def test_missing_file_is_a_model_load_error(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(str(tmp_path / "nope.pt2"))


def test_directory_is_a_model_load_error(tmp_path):
    with pytest.raises(ModelLoadError, match="directory"):
        load_model(str(tmp_path))


def test_random_bytes_are_a_model_load_error(tmp_path):
    path = tmp_path / "garbage.pt2"
    path.write_bytes(np.random.default_rng(0).bytes(4096))
    with pytest.raises(ModelLoadError, match="not a zip file"):
        load_model(str(path))


def test_zip_that_torch_does_not_write_is_a_model_load_error(tmp_path):
    path = tmp_path / "other.pt"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("hello.txt", "not a model")
    with pytest.raises(ModelLoadError, match="not one torch writes"):
        load_model(str(path))


def test_corrupt_pt2_archive_is_a_model_load_error(tmp_path):
    path = tmp_path / "broken.pt2"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("broken/archive_format", "pt2")
        zf.writestr("broken/models/model.json", "{not json")
    with pytest.raises(ModelLoadError, match="torch.export archive"):
        load_model(str(path))


def test_factory_errors_are_model_load_errors():
    with pytest.raises(ModelLoadError, match="cannot import 'tests.nosuch'"):
        load_model("tests.nosuch:fn")
    with pytest.raises(ModelLoadError, match="no callable 'nosuch'"):
        load_model("tests.models:nosuch")
    with pytest.raises(ModelLoadError, match="returned dict"):
        load_model("tests.models:not_a_module")


# --- capture --------------------------------------------------------------------------------------


def test_factory_without_inputs_asks_for_them_by_argument_name():
    with pytest.raises(InputSpecError, match=r"needs example inputs: x, and example_args"):
        api.analyze("tests.models:skipnet")


def test_input_named_after_no_argument_is_refused():
    with pytest.raises(InputSpecError, match="'y' is not an argument"):
        api.analyze("tests.models:skipnet", ["y=1x3x8x8:float32"])


def test_shapes_the_model_rejects_are_an_input_spec_error():
    with pytest.raises(InputSpecError) as info:
        api.analyze("tests.models:skipnet", ["x=1x5x8x8:float32"])
    assert "x=(1, 5, 8, 8):float32" in str(info.value)
    assert "3 channels" in str(info.value)


def test_data_dependent_branch_names_the_module_that_cannot_be_captured():
    with pytest.raises(CaptureError) as info:
        api.analyze("tests.models:branchy", [SKIPNET_INPUT])
    message = str(info.value)
    assert "in module 'stage.gate' (DataDependent.forward" in message
    assert "torch.where" in message  # the next step


def test_numpy_call_names_the_module_that_cannot_be_captured():
    with pytest.raises(CaptureError, match="in module 'bridge' \\(ToNumpy.forward"):
        api.analyze("tests.models:numpy_call", [SKIPNET_INPUT])


def test_dict_outputs_are_named_after_their_keys():
    captured = api.analyze("tests.models:bert", list(models.TEXT_INPUTS)).captured
    assert captured.output_names == ("last_hidden_state", "pooler_output")
    assert captured.reference["last_hidden_state"].shape == (1, 16, 32)


class _Decoder(torch.nn.Module):
    """Token ids (1 x positions) to logits (1 x positions x 300), through a head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.mix, self.head = (
            torch.nn.Embedding(50, 16),
            torch.nn.Linear(16, 16),
            torch.nn.Linear(16, 300),
        )

    def forward(self, ids):
        h = self.embed(ids)
        return self.head(torch.relu(self.mix(h)).cumsum(1))  # each position sees those before


def test_keep_positions_last_cuts_the_answer_before_the_head():
    torch.manual_seed(0)
    model, ids = _Decoder().eval(), torch.randint(0, 50, (1, 12))
    analysis = api.analyze(model, (ids,), keep_positions="last")
    cm = analysis.captured
    (out,) = cm.gm.graph.output_node().args[0]
    assert out.args[0].target is torch.ops.aten.slice.Tensor  # the head computes one row
    expected = model(ids)[:, -1:].detach()
    torch.testing.assert_close(cm.gm(ids=ids), expected)
    torch.testing.assert_close(torch.from_numpy(next(iter(cm.reference.values()))), expected)
    plan = api.partition(model, (ids,), keep_positions="last", target="lambda")
    assert [e.bytes for e in plan.edges_in("<response>")] == [300 * 4]
    assert any("--keep-positions last" in str(n) for n in plan.notes)
    with pytest.raises(InputSpecError, match="keep_positions='last' keeps .* has none"):
        api.analyze(torch.nn.Linear(4, 4), (torch.zeros(1, 4),), keep_positions="last")
    from mopar.arguments import check_choices
    from mopar.config import CompileConfig
    from mopar.errors import MoparError

    for wrong, says in (
        ({"keep_positions": "first"}, "choose one of all, last"),
        ({"keep_positions": "last", "generate": True}, "answers with tokens"),
    ):
        with pytest.raises(MoparError, match=says):
            check_choices(CompileConfig(**wrong))


def test_a_static_pt2_given_another_shape_names_its_shape_without_any_size(saved):
    with pytest.raises(InputSpecError) as info:
        api.analyze(str(saved["dir"] / "skipnet.pt2"), ["x=1x3x4x4:float32"])
    text = str(info.value)
    assert "exported for [1, 3, 8, 8] float32; pass" in text and "any size" not in text
