"""The split-point autoencoder and the per-cut codec choice, on small real models."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mopar import api
from mopar.compress.ae import make_autoencoder, output_loss, supports, train_autoencoder
from mopar.compress.budget import Budget
from mopar.compress.calibration import load_calibration
from mopar.compress.choose import MIN_CODEC_BYTES, choose_codecs
from mopar.config import CompileConfig
from mopar.emit.onnx_export import run_slices_torch
from mopar.errors import InputSpecError
from mopar.rewrite import split_by_plan


@pytest.mark.parametrize("shape", [(8, 16, 6, 6), (8, 12, 32), (8, 64)])
def test_autoencoder_keeps_the_shape_and_shrinks_by_its_ratio(shape):
    ae = make_autoencoder(shape, 4, seed=0)
    x = torch.randn(shape)
    code = ae.encoder(x)
    assert ae(x).shape == x.shape
    assert x.numel() / code.numel() == pytest.approx(ae.ratio) == pytest.approx(4.0)


def test_autoencoder_training_improves_over_its_initialisation_and_is_deterministic():
    torch.manual_seed(1)
    # low-rank activations: 16 channels that are mixtures of 4 patterns, as real features are
    basis = torch.randn(4, 16)
    x = torch.einsum("nkhw,kc->nchw", torch.randn(24, 4, 5, 5), basis)
    reports, weights = [], []
    for _ in range(2):
        ae = make_autoencoder(tuple(x.shape), 4, seed=0)
        reports.append(
            train_autoencoder(ae, x, samples=24, budget_s=900.0, seed=0, max_steps=60, lr=2e-2)
        )
        weights.append([p.detach().clone() for p in ae.parameters()])
    assert not any(r.budget_hit for r in reports)  # else the step counts, and weights, could differ
    assert reports[0].error_after < 0.5 * reports[0].error_before
    assert all(torch.equal(a, b) for a, b in zip(*weights))  # same seed, same steps: same weights


def _hidden_signal(seed: int = 0):
    """Activations whose loud channels carry nothing the output reads, and a classifier that
    reads two quiet directions: what a reconstruction objective drops first."""
    g = torch.Generator().manual_seed(seed)
    n = 16
    loud = 3.0 * torch.randn(n, 6, 4, 4, generator=g)
    quiet = torch.randn(n, 2, 4, 4, generator=g)
    mix = torch.linalg.qr(torch.randn(8, 8, generator=g))[0]  # spread both over all 8 channels
    x = torch.einsum("nchw,dc->ndhw", torch.cat([loud, quiet], 1), mix)
    head = torch.nn.Linear(2, 5).requires_grad_(False)
    torch.nn.init.normal_(head.weight, std=3.0, generator=g)

    def model(act: torch.Tensor) -> list[torch.Tensor]:  # the layers after the cut
        z = torch.einsum("ndhw,dc->nchw", act, mix)[:, 6:]
        return [head(z.mean((2, 3)))]

    return x, model


def test_distillation_keeps_the_outputs_that_reconstruction_loses():
    x, model = _hidden_signal()
    rows = [x[k : k + 1] for k in range(len(x))]
    targets = [model(r) for r in rows]

    def output_error(ae) -> float:
        with torch.no_grad():
            return float(sum(output_loss(model(ae(r)), t) for r, t in zip(rows, targets)))

    errors, reports = [], []
    for downstream in (None, lambda decoded, _k: model(decoded)):
        ae = make_autoencoder(tuple(x.shape), 4, seed=0, activations=x)  # starts as PCA
        reports.append(
            train_autoencoder(
                ae,
                x,
                samples=len(x),
                downstream=downstream,
                targets=targets,
                budget_s=900.0,
                seed=0,
                max_steps=100,
                lr=3e-2,
            )
        )
        errors.append(output_error(ae))
    assert not any(r.budget_hit or r.restored for r in reports)
    recon_only, distilled = errors
    assert distilled < 0.4 * recon_only
    assert reports[1].output_loss_after < 0.4 * reports[1].output_loss_before


def test_support_rules():
    assert supports((1, 8, 4, 4), torch.float32, 4)
    assert not supports((1, 2, 4, 4), torch.float32, 4)  # fewer channels than the ratio
    assert not supports((1, 128), torch.int64, 4)
    assert not supports((128,), torch.float32, 4)


@pytest.fixture(scope="module")
def cnn():
    analysis = api.analyze("examples.cnn:resnet50_tiny", ["x=1x3x64x64:float32"])
    config = CompileConfig(slices=3, strategy="uniform")
    plan = api.plan_from(analysis, config, api.predict(analysis.layers, config))
    return analysis, split_by_plan(analysis.layers, plan)


def _transfer(_slice, nbytes):  # a slow link (HTTP-like): compression pays
    return 0.5 + nbytes / 50e3


def test_without_a_budget_only_lossless_codecs_are_chosen(cnn):
    analysis, slices = cnn
    calib = load_calibration(None, analysis.captured.inputs, count=6)
    _coded, choices, runtime = choose_codecs(
        slices, calib, codec="auto", budget=Budget(), transfer_ms=_transfer
    )
    assert choices and all(c.codec in ("none", "zstd") and c.error == 0.0 for c in choices)
    assert set(runtime) == {c.tensor for c in choices}


def test_a_budget_admits_lossy_codecs_and_the_chain_stays_within_it(cnn):
    analysis, slices = cnn
    calib = load_calibration(None, analysis.captured.inputs, count=8)
    budget = Budget(max_output_error=0.02)
    coded, choices, runtime = choose_codecs(
        slices, calib, codec="auto", budget=budget, transfer_ms=_transfer, budget_s=10.0
    )
    assert any(c.codec not in ("none", "zstd") for c in choices)
    assert all(c.ratio >= 1.0 for c in choices)
    # the coded chain (autoencoders inside the slices, runtime codecs applied) on the example input
    from mopar.codec import get_codec

    values = {k: torch.from_numpy(v) for k, v in analysis.captured.inputs.items()}
    with torch.no_grad():
        for s in coded:
            out = s.gm(*[values[t.name] for t in s.inputs])
            for t, o in zip(s.outputs, out):
                codec = get_codec(runtime.get(t.name, "none"))
                a = o.numpy()
                values[t.name] = torch.from_numpy(
                    np.array(codec.decode(codec.encode(a), dtype=a.dtype, shape=a.shape))
                )
    ref = analysis.captured.reference[analysis.captured.output_names[0]]
    got = values[[t.name for t in coded[-1].outputs][0]].numpy()
    assert np.abs(got - ref).max() / np.abs(ref).max() <= 0.05  # the example input is not held out


def test_a_forced_autoencoder_lands_inside_the_slices(cnn):
    analysis, slices = cnn
    calib = load_calibration(None, analysis.captured.inputs, count=6)
    coded, choices, runtime = choose_codecs(
        slices,
        calib,
        codec="ae",
        budget=Budget(max_output_error=1.0),
        transfer_ms=_transfer,
        budget_s=4.0,
    )
    ae_tensors = {c.tensor for c in choices if c.codec == "ae4"}
    assert ae_tensors and all(runtime[t] == "none" for t in ae_tensors)
    values = run_slices_torch(coded, analysis.captured.inputs)
    plain = run_slices_torch(slices, analysis.captured.inputs)
    for t in ae_tensors:  # what crosses the cut is the code, 4x smaller
        assert values[t].numel() * 4 == plain[t].numel()


@pytest.fixture(scope="module")
def int8_coded(cnn):
    """The cnn's slices with an autoencoder whose code travels as int8+zstd at every cut."""
    analysis, slices = cnn
    calib = load_calibration(None, analysis.captured.inputs, count=8)
    coded, choices, runtime = choose_codecs(
        slices,
        calib,
        codec="ae4+int8+zstd",
        budget=Budget(max_output_error=10.0),
        transfer_ms=_transfer,
        budget_s=1.0,
    )
    return calib, coded, choices, runtime


def test_an_int8_autoencoder_code_crosses_the_cut_at_the_bytes_the_plan_states(int8_coded):
    from mopar.codec import get_codec

    calib, coded, choices, runtime = int8_coded
    # measured cut by cut on the held-out samples: the first slice's cuts see the exact input
    first = [c for c in choices if c.slice == coded[0].name and c.codec == "ae4+int8+zstd"]
    assert first and all(runtime[c.tensor] == "int8+zstd" for c in first)
    sizes = {c.tensor: [] for c in first}
    for sample in calib.split()[1]:
        values = run_slices_torch(coded, sample)
        for c in first:  # what the worker writes: the slice's output, by the runtime codec
            sizes[c.tensor].append(len(get_codec("int8+zstd").encode(values[c.tensor].numpy())))
    for c in first:
        assert c.bytes == int(np.mean(sizes[c.tensor]))
        assert c.ratio > 12  # 4x fewer elements, 1 byte each for 4; a few bytes per channel


@pytest.mark.slow  # one ONNX export (5-14 s on the shared machine); the default suite checks the
# code's shape and bytes in torch (test_an_int8_autoencoder_code_crosses_the_cut_at_the_bytes...)
def test_the_onnx_slice_holds_the_decoder_of_its_input_and_the_encoder_of_its_output(
    cnn, int8_coded, tmp_path
):
    import onnx
    import onnxruntime as ort

    from mopar.emit.onnx_export import try_export_slice

    analysis, slices = cnn
    _calib, coded, choices, _runtime = int8_coded
    middle, plain_middle = coded[1], slices[1]
    aes = {c.tensor for c in choices if c.codec == "ae4+int8+zstd"}
    read = [t.name for t in middle.inputs if t.name in aes]
    sent = [t.name for t in middle.outputs if t.name in aes]
    assert read and sent
    values = run_slices_torch(coded, analysis.captured.inputs)
    plain = run_slices_torch(slices, analysis.captured.inputs)
    assert try_export_slice(middle, values, tmp_path / "model.onnx", opset=None) is None
    graph = onnx.load(str(tmp_path / "model.onnx")).graph
    dims = {
        v.name: [d.dim_value for d in v.type.tensor_type.shape.dim]
        for v in (*graph.input, *graph.output)
    }
    for name in read + sent:  # the code crosses: 4x fewer channels than the model's tensor
        assert dims[name][1] * 4 == plain[name].shape[1], name
    session = ort.InferenceSession(str(tmp_path / "model.onnx"))
    feed = {t.name: values[t.name].numpy() for t in plain_middle.inputs}
    got = dict(zip([o.name for o in session.get_outputs()], session.run(None, feed)))
    for name in sent:
        torch.testing.assert_close(torch.from_numpy(got[name]), values[name], rtol=1e-3, atol=1e-4)


@pytest.mark.slow  # test_a_forced_autoencoder_lands_inside_the_slices covers their place in the
# slices, tests/test_codec the codecs the runtime serves
def test_compile_with_autoencoders_puts_them_in_the_onnx_slices_and_the_bundle_runs(tmp_path):
    import json

    import onnx

    from tests.conftest import mopar

    out = tmp_path / "b"
    proc = mopar(
        "compile",
        "examples.cnn:resnet50_tiny",
        "--input",
        "x=1x3x64x64:float32",
        "--slices",
        "3",
        "--strategy",
        "uniform",
        "--codec",
        "ae",
        "--max-output-error",
        "0.5",
        "--codec-budget-s",
        "4",
        "--out",
        out,
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads((out / "plan.json").read_text())
    chosen = [c for s in doc["plan"]["functions"] for c in s["codecs"] if c["codec"] == "ae4"]
    assert chosen and all(c["ratio"] == pytest.approx(4.0) for c in chosen)
    first = onnx.load(str(out / "functions" / "s0" / "model.onnx"))
    shapes = {
        o.name: [d.dim_value for d in o.type.tensor_type.shape.dim] for o in first.graph.output
    }
    for c in chosen:
        if c["slice"] == "s0":  # the encoder's code, 4x fewer channels, is what s0 emits
            raw = dict(
                zip(
                    ("n", "c", "h", "w"),
                    next(
                        t["shape"]
                        for t in doc["io"]["functions"][0]["outputs"]
                        if t["name"] == c["tensor"]
                    ),
                )
            )
            assert shapes[c["tensor"]][1] * 4 == c["raw_bytes"] // 4 // (raw["h"] * raw["w"])
    proc = mopar("run", out, "--check", "--requests", "2")
    assert proc.returncode == 0, proc.stderr


@pytest.mark.slow  # test_codec covers zstd; the autoencoder compile covers codecs in bundles
def test_compile_with_zstd_records_lossless_codecs_and_checks_exactly(tmp_path):
    import json

    from tests.conftest import mopar

    out = tmp_path / "z"
    proc = mopar(
        "compile",
        "examples.cnn:resnet50_tiny",
        "--input",
        "x=1x3x64x64:float32",
        "--slices",
        "3",
        "--strategy",
        "uniform",
        "--codec",
        "zstd",
        "--out",
        out,
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads((out / "plan.json").read_text())
    assert (doc["verification"]["rtol"], doc["verification"]["atol"]) == (1e-3, 1e-4)
    codecs = [c for s in doc["plan"]["functions"] for c in s["codecs"]]
    assert all(c["error"] == 0.0 for c in codecs)
    # tensors below MIN_CODEC_BYTES travel raw: no codec pays for itself on them
    assert all(
        c["codec"] == ("zstd" if c["raw_bytes"] >= MIN_CODEC_BYTES else "none") for c in codecs
    )
    assert any(c["codec"] == "zstd" for c in codecs)
    runtime = {k: v for s in doc["io"]["functions"] for k, v in s["codecs"].items()}
    assert runtime == {c["tensor"]: c["codec"] for c in codecs}
    proc = mopar("run", out, "--check", "--requests", "2")
    assert proc.returncode == 0, proc.stderr


# --- calibration files as users write them --------------------------------------------------------


def test_a_batch_along_the_models_batch_axis_is_split_into_samples_with_a_note(tmp_path):
    example = {"x": np.zeros((1, 3, 4, 4), np.float32)}
    batch = np.random.default_rng(0).standard_normal((5, 3, 4, 4)).astype(np.float32)
    np.savez(tmp_path / "cal.npz", x=batch)
    calib = load_calibration(tmp_path / "cal.npz", example)
    assert len(calib.samples) == 5 and not calib.synthetic
    assert all(s["x"].shape == (1, 3, 4, 4) for s in calib.samples)
    np.testing.assert_array_equal(calib.samples[3]["x"][0], batch[3])
    assert calib.notes == (
        "calibration: split x (5, 3, 4, 4) of cal.npz into 5 samples of the example's (1, 3, 4, 4)",
    )


def test_samples_stacked_on_a_new_axis_need_no_note(tmp_path):
    example = {"x": np.zeros((1, 3, 4, 4), np.float32)}
    np.savez(tmp_path / "cal.npz", x=np.ones((4, 1, 3, 4, 4), np.float32))
    calib = load_calibration(tmp_path / "cal.npz", example)
    assert len(calib.samples) == 4 and calib.notes == ()


def test_one_array_is_read_as_the_one_input_whatever_its_key(tmp_path):
    example = {"pixel_values": np.zeros((1, 3, 4, 4), np.float32)}
    np.savez(tmp_path / "cal.npz", np.ones((2, 3, 4, 4), np.float32))  # numpy names it arr_0
    calib = load_calibration(tmp_path / "cal.npz", example)
    assert [set(s) for s in calib.samples] == [{"pixel_values"}] * 2
    assert (
        calib.notes[0]
        == "calibration: read the one array 'arr_0' of cal.npz as input 'pixel_values'"
    )


def test_a_shape_that_fits_no_reading_names_the_ones_that_would(tmp_path):
    example = {"x": np.zeros((2, 3, 4, 4), np.float32)}
    np.savez(tmp_path / "cal.npz", x=np.ones((3, 3, 4, 4), np.float32))  # 3 is no multiple of 2
    with pytest.raises(
        InputSpecError,
        match=r"expected the example's \(2, 3, 4, 4\), N of them "
        r"as \(N, 2, 3, 4, 4\), or a batch \(N, 3, 4, 4\)",
    ):
        load_calibration(tmp_path / "cal.npz", example)
