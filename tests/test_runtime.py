"""The runtime: `mopar run` serves a bundle with one real OS process per slice and hands tensors
over through a per-run folder in /dev/shm, which is gone afterwards whatever happened."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from mopar._files import OWNER_FILE
from mopar.config import RunConfig, Tolerance
from mopar.errors import BundleError, InputSpecError
from mopar.runner.bundle import read_manifest, read_reference
from mopar.runner.check import compare_outputs
from mopar.runner.local import run_bundles
from mopar.runner.worker import _name
from mopar.runtime.handler import SliceHandler
from tests.conftest import (
    SKIPNET_INPUT,
    faulty,
    new_shm_runs,
    nonblank_lines,
    pid_alive,
    run_watched,
    shm_runs,
)

SLICE_KEYS = {
    "name",
    "peak_rss_mb",
    "allocated_mb",
    "p50_ms",
    "p95_ms",
    "load_ms",
    "calls",
    "billed_ms",
    "cold_starts",
    "cold_start_ms",
    "init_ms",
    "instances",
    "instance_s",
    "oom_kills",
    "samples_ms",
}
REPORT_KEYS = {
    "slices",
    "latency_ms",
    "requests",
    "errors",
    "max_abs_err",
    "max_rel_err",
    "check",
    "transport",
    "served_by",
    "invocations_per_request",
    "mc_gb_s",
    "oom_kills",
}


def _assert_cleaned_up(watched, before: set[str]) -> None:
    """Exactly one shm folder was used, it is gone, and no slice process outlived the run."""
    assert len(watched.shm_dirs) == 1, watched.workers
    assert not any(os.path.exists(d) for d in watched.shm_dirs)
    assert new_shm_runs(before) == set()
    alive = [pid for pid in watched.workers if pid_alive(pid)]
    assert alive == [], f"slice processes outlived mopar run: {alive}"


def _replace_handler(bundle, slice_name: str, body: str) -> dict[str, str]:
    """The environment under which ``slice_name`` runs the handler ``body`` defines."""
    return faulty(bundle.parent / "faults", {slice_name: body})


# --- a healthy run --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checked_run(skipnet_bundle):
    before = shm_runs()
    watched = run_watched("run", skipnet_bundle, "--check", "--requests", "3", "--json")
    return watched, before


def test_run_check_passes_and_exits_0(checked_run):
    watched, _ = checked_run
    assert watched.returncode == 0, watched.stderr
    report = json.loads(watched.stdout)
    assert report["errors"] == 0
    assert report["max_rel_err"] <= 1e-4


def test_each_slice_runs_in_its_own_os_process(checked_run, skipnet_bundle):
    watched, _ = checked_run
    assert len(watched.workers) == 3
    functions = skipnet_bundle / "functions"
    assert watched.function_dirs == [str(functions / s) for s in ("s0", "s1", "s2")]


def test_shm_folder_is_removed_after_a_successful_run(checked_run):
    watched, before = checked_run
    _assert_cleaned_up(watched, before)


def test_json_report_has_exactly_the_documented_keys(checked_run, skipnet_bundle):
    watched, _ = checked_run
    report = json.loads(watched.stdout)
    assert set(report) == REPORT_KEYS
    assert set(report["latency_ms"]) == {"p50", "p95", "p99"}
    assert report["requests"] == 3 and report["transport"] == "shm"
    plan = json.loads((skipnet_bundle / "plan.json").read_text())["plan"]
    assert [s["name"] for s in report["slices"]] == ["s0", "s1", "s2"]
    for entry, planned in zip(report["slices"], plan["functions"]):
        assert set(entry) == SLICE_KEYS
        assert entry["allocated_mb"] == planned["memory_mb"]
        assert entry["peak_rss_mb"] > 0
        assert entry["calls"] == 3  # every slice serves every request
    assert report["invocations_per_request"] == 3.0
    assert report["mc_gb_s"] == pytest.approx(
        sum(s["allocated_mb"] / 1024 * s["p50_ms"] / 1e3 for s in report["slices"])
    )


def test_json_without_check_reports_no_error_figures(skipnet_bundle):
    watched = run_watched("run", skipnet_bundle, "--requests", "1", "--json")
    assert watched.returncode == 0, watched.stderr
    report = json.loads(watched.stdout)
    assert report["max_abs_err"] is None and report["max_rel_err"] is None


def test_concurrent_requests_are_all_served_and_match(skipnet_bundle):
    before = shm_runs()
    watched = run_watched(
        "run", skipnet_bundle, "--check", "--concurrency", "3", "--requests", "9", "--json"
    )
    assert watched.returncode == 0, watched.stderr
    report = json.loads(watched.stdout)
    assert (report["requests"], report["errors"]) == (9, 0)
    assert report["max_rel_err"] <= 1e-4
    _assert_cleaned_up(watched, before)


@pytest.fixture(scope="module")
def unsplit_bundle(tmp_path_factory):
    from mopar import api

    out = tmp_path_factory.mktemp("unsplit") / "bundle"
    api.compile("tests.models:skipnet", [SKIPNET_INPUT], out=out, slices=1)
    return out


def test_baseline_bundle_runs_alongside_and_is_reported(skipnet_bundle, unsplit_bundle):
    before = shm_runs()
    watched = run_watched(
        "run", skipnet_bundle, "--baseline", unsplit_bundle, "--check", "--requests", "2", "--json"
    )
    assert watched.returncode == 0, watched.stderr
    report = json.loads(watched.stdout)
    assert set(report) == REPORT_KEYS | {"baseline", "planned_bill"}
    assert [s["name"] for s in report["slices"]] == ["s0", "s1", "s2"]
    assert [s["name"] for s in report["baseline"]["slices"]] == ["s0"]
    for r in (report, report["baseline"]):
        assert (r["requests"], r["errors"]) == (2, 0) and r["max_rel_err"] <= 1e-4
    bills = report["planned_bill"]  # both plans' bills, priced for the same target and traffic
    assert bills["target"] == "openfaas"
    assert bills["bundle"]["traffic"] == bills["baseline"]["traffic"]
    for bill in (bills["bundle"], bills["baseline"]):
        parts = bill["includes_per_1m_usd"].values()
        assert bill["cost_per_1m_usd"] == pytest.approx(sum(parts), rel=1e-4)
    assert len(watched.workers) == 4  # three slices plus the unsplit model, each a process
    _assert_cleaned_up(watched, before)


def test_run_bundle_api_matches_the_reference(skipnet_bundle):
    manifest = read_manifest(skipnet_bundle)
    inputs, expected = read_reference(skipnet_bundle / "reference.npz")
    before = shm_runs()
    report = run_bundles(
        [manifest], inputs, config=RunConfig(requests=2, concurrency=2), expected=expected
    )[0]
    assert (report.requests, report.errors) == (2, 0)
    assert report.max_rel_err <= 1e-4
    assert [s.name for s in report.slices] == ["s0", "s1", "s2"]
    assert new_shm_runs(before) == set()


def _our_run_folders() -> set[str]:
    """The mopar-run-* folders this process holds buffers open in (not another user's runs)."""
    folders = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if "/mopar-run-" in target:
            folders.add(os.path.dirname(target))
    return folders


def test_shm_buffers_are_reused_across_requests(skipnet_bundle):
    manifest = read_manifest(skipnet_bundle)
    inputs, expected = read_reference(skipnet_bundle / "reference.npz")
    counts = []

    def count(_done: int) -> None:
        (folder,) = _our_run_folders()
        counts.append(len([n for n in os.listdir(folder) if n != OWNER_FILE]))

    report = run_bundles(
        [manifest],
        inputs,
        config=RunConfig(requests=8, concurrency=2),
        expected=expected,
        on_request=count,
    )[0]
    assert (report.requests, report.errors) == (8, 0)
    assert report.max_rel_err <= 1e-4
    values = len(manifest.inputs) + sum(len(s.outputs) for s in manifest.slices)
    assert len(counts) == 4 and len(set(counts)) == 1, counts  # no file per request
    assert counts[0] <= 2 * values  # one buffer per value and request slot
    assert _our_run_folders() == set()


def test_run_bundle_refuses_inputs_missing_a_model_input(skipnet_bundle):
    with pytest.raises(InputSpecError, match=r"lacks \['x'\]"):
        run_bundles(
            [read_manifest(skipnet_bundle)], {"y": np.zeros(1)}, config=RunConfig(requests=1)
        )[0]


# --- failures -------------------------------------------------------------------------------------


def test_check_fails_with_exit_1_when_the_reference_is_tampered_with(bundle_copy):
    ref = dict(np.load(bundle_copy / "reference.npz"))
    ref["output.output_0"] = ref["output.output_0"] + 1.0
    np.savez(bundle_copy / "reference.npz", **ref)
    before = shm_runs()
    watched = run_watched("run", bundle_copy, "--check", "--requests", "2")
    assert watched.returncode == 1
    (line,) = nonblank_lines(watched.stderr)
    assert line.startswith("error: output 'output_0' differs from the model: |a - b| reaches")
    assert "allclose with rtol 0.001, atol 0.0001" in line
    assert "Traceback" not in watched.stderr
    _assert_cleaned_up(watched, before)


RAISING = """
    class SliceHandler:
        inputs: dict = {}  # the slice's input names (the handler's contract)

        def __init__(self, function_dir, *, intra_op_threads=0):
            pass

        def handle(self, inputs):
            raise RuntimeError("slice exploded on purpose")
    """

EXITING = """
    import os

    class SliceHandler:
        inputs: dict = {}  # the slice's input names (the handler's contract)

        def __init__(self, function_dir, *, intra_op_threads=0):
            pass

        def handle(self, inputs):
            os._exit(3)
    """


def test_a_slice_that_raises_fails_the_run_and_shm_is_cleaned(bundle_copy):
    env = _replace_handler(bundle_copy, "s1", RAISING)
    before = shm_runs()
    watched = run_watched("run", bundle_copy, "--check", "--requests", "2", env=env)
    assert watched.returncode == 1
    (line,) = nonblank_lines(watched.stderr)
    assert line.startswith("error: ")
    assert "s1: RuntimeError: slice exploded on purpose" in line
    assert "Traceback" not in watched.stderr
    _assert_cleaned_up(watched, before)


def test_a_slice_process_that_dies_fails_its_requests_and_shm_is_cleaned(bundle_copy):
    """Each request kills s1's instance; each fails, and the next starts a new instance."""
    env = _replace_handler(bundle_copy, "s1", EXITING)
    before = shm_runs()
    watched = run_watched("run", bundle_copy, "--requests", "2", env=env)
    assert watched.returncode == 1
    (line,) = nonblank_lines(watched.stderr)
    assert line.startswith(
        "error: 2 of 2 requests failed; first: s1: its instance exited with code 3"
    )
    _assert_cleaned_up(watched, before)


FAILING_LOAD = """
    class SliceHandler:
        def __init__(self, function_dir, *, intra_op_threads=0):
            raise ValueError("cannot load this slice")
    """

HANGING = """
    import time

    class SliceHandler:
        inputs: dict = {}  # the slice's input names (the handler's contract)

        def __init__(self, function_dir, *, intra_op_threads=0):
            pass

        def handle(self, inputs):
            time.sleep(120)
    """


def test_a_slice_that_fails_to_load_is_named_with_its_error(bundle_copy):
    env = _replace_handler(bundle_copy, "s1", FAILING_LOAD)
    before = shm_runs()
    watched = run_watched("run", bundle_copy, "--requests", "1", env=env)
    assert watched.returncode == 1
    (line,) = nonblank_lines(watched.stderr)
    assert line == "error: slice s1 exited with code 1: ValueError: cannot load this slice"
    _assert_cleaned_up(watched, before)


def test_a_slice_that_never_answers_times_out_and_is_stopped(bundle_copy):
    env = _replace_handler(bundle_copy, "s1", HANGING)
    before = shm_runs()
    watched = run_watched(
        "run", bundle_copy, "--requests", "1", "--timeout", "2", timeout=90, env=env
    )
    assert watched.returncode == 1
    (line,) = nonblank_lines(watched.stderr)
    assert line.startswith(
        "error: 1 of 1 requests failed; first: s1: no answer within 2 s, so its instance was killed"
    )
    _assert_cleaned_up(watched, before)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_interrupting_a_run_removes_its_shm_folder_and_stops_the_slices(skipnet_bundle, sig):
    before = shm_runs()
    watched = run_watched("run", skipnet_bundle, "--requests", "100000", interrupt=sig, timeout=120)
    assert watched.returncode == 130, watched.stderr
    assert nonblank_lines(watched.stderr) == ["interrupted"]
    _assert_cleaned_up(watched, before)


def test_failed_requests_are_counted_among_the_measured_requests_only(bundle_copy):
    env = _replace_handler(bundle_copy, "s1", RAISING)
    watched = run_watched("run", bundle_copy, "--requests", "2", "--json", env=env)
    assert watched.returncode == 1
    report = json.loads(watched.stdout)
    assert (report["requests"], report["errors"]) == (2, 2)


def _strict_json(text: str):
    def refuse(name: str):
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_json_report_is_valid_json_even_when_every_request_failed(bundle_copy):
    env = _replace_handler(bundle_copy, "s1", RAISING)
    watched = run_watched("run", bundle_copy, "--requests", "2", "--json", env=env)
    assert watched.returncode == 1
    report = _strict_json(watched.stdout)
    assert report["errors"] >= 2


def test_run_accepts_big_endian_input_arrays(skipnet_bundle, tmp_path):
    ref = np.load(skipnet_bundle / "reference.npz")
    swapped = tmp_path / "big-endian.npz"
    np.savez(
        swapped,
        **{"input.x": ref["input.x"].astype(">f4"), "output.output_0": ref["output.output_0"]},
    )
    watched = run_watched("run", skipnet_bundle, "--input", swapped, "--check", "--requests", "1")
    assert watched.returncode == 0, watched.stderr


# --- bundle reading -------------------------------------------------------------------------------


def test_reading_a_missing_bundle_says_how_to_make_one(tmp_path):
    with pytest.raises(BundleError, match="mopar compile"):
        read_manifest(tmp_path / "nope")
    with pytest.raises(BundleError, match="no plan.json"):
        read_manifest(tmp_path)


def test_bundle_of_another_format_version_is_refused(bundle_copy):
    doc = json.loads((bundle_copy / "plan.json").read_text())
    doc["bundle_format_version"] = 99
    (bundle_copy / "plan.json").write_text(json.dumps(doc))
    with pytest.raises(BundleError, match="bundle format 99 is not supported"):
        read_manifest(bundle_copy)


def test_malformed_manifest_is_a_bundle_error(bundle_copy):
    (bundle_copy / "plan.json").write_text('{"bundle_format_version": 2}')
    with pytest.raises(BundleError, match="malformed"):
        read_manifest(bundle_copy)


def test_bundle_missing_a_slice_model_is_refused(bundle_copy):
    (bundle_copy / "functions" / "s2" / "model.onnx").unlink()
    with pytest.raises(BundleError, match="functions/s2/model.onnx is missing"):
        read_manifest(bundle_copy)


def test_bundle_missing_a_slice_weights_file_is_refused(bundle_copy):
    doc = json.loads((bundle_copy / "plan.json").read_text())
    name = next(f["name"] for f in doc["io"]["functions"] if "weights" in f)
    (bundle_copy / "functions" / name / "model.onnx.data").unlink()
    with pytest.raises(BundleError, match=f"functions/{name}/model.onnx.data is missing"):
        read_manifest(bundle_copy)


def test_manifest_lists_slice_inputs_and_outputs_by_value_name(skipnet_bundle):
    manifest = read_manifest(skipnet_bundle)
    assert manifest.inputs == ("x",)
    assert manifest.outputs == (("output_0", "t:conv2d_3"),)
    assert [(s.name, set(s.inputs)) for s in manifest.slices] == [
        ("s0", {"x"}),
        ("s1", {"t:relu"}),
        ("s2", {"t:tanh", "t:relu"}),
    ]


# --- the pieces that run inside a function --------------------------------------------------------


def test_handler_runs_a_slice_and_names_bad_inputs(skipnet_bundle):
    handler = SliceHandler(skipnet_bundle / "functions" / "s0")
    inputs, _ = read_reference(skipnet_bundle / "reference.npz")
    (out,) = handler.handle(inputs).values()
    assert out.shape == (1, 8, 8, 8) and out.min() >= 0  # s0 ends with the ReLU
    with pytest.raises(ValueError, match="missing input tensor 'x'"):
        handler.handle({})
    with pytest.raises(ValueError, match="input 'x' has shape \\[1, 3, 4, 4\\]"):
        handler.handle({"x": np.zeros((1, 3, 4, 4), np.float32)})


@pytest.mark.parametrize("name", ["../etc/passwd", "/tmp/x", "r1x2-v3.t/../../x", "x.t", "r1-v2.t"])
def test_worker_refuses_file_names_that_could_leave_the_shm_folder(name):
    with pytest.raises(ValueError, match="refusing"):
        _name(name)
    assert _name("r0x12-v3.t") == "r0x12-v3.t"


def test_compare_outputs_reports_absolute_and_relative_error():
    want = {"y": np.array([2.0, -4.0])}
    same = compare_outputs({"y": np.array([2.0, -4.0])}, want)
    assert (same.max_abs_err, same.max_rel_err, same.passed) == (0.0, 0.0, True)
    off = compare_outputs({"y": np.array([2.5, -4.0])}, want)
    assert (off.max_abs_err, off.max_rel_err, off.passed, off.output) == (0.5, 0.125, False, "y")
    shape = compare_outputs({"y": np.zeros(3)}, want)
    assert (shape.max_abs_err, shape.passed) == (math.inf, False)
    assert "shape (3,), expected shape (2,)" in shape.describe(Tolerance())


def test_outputs_near_zero_pass_within_atol_although_their_relative_error_is_large():
    want = {"logits": np.array([3.0, -2.0]), "mask": np.array([5.11e-41, 0.0])}
    got = {"logits": np.array([3.0001, -2.0]), "mask": np.array([1.0e-40, 0.0])}
    result = compare_outputs(got, want)
    assert result.passed and result.max_rel_err > 0.1  # the old relative-only check refused it
    assert not compare_outputs(got, want, Tolerance(rtol=1e-3, atol=0.0)).passed


def test_the_check_is_numpy_allclose_elementwise_and_names_the_failing_output():
    rng = np.random.default_rng(0)
    want = {"a": rng.standard_normal(100), "b": rng.standard_normal(100) * 100}
    for scale in (1e-6, 1e-4, 1e-3, 1e-2):
        got = {k: v + rng.standard_normal(v.shape) * scale for k, v in want.items()}
        tol = Tolerance(rtol=1e-3, atol=1e-4)
        result = compare_outputs(got, want, tol)
        expect = all(np.allclose(got[k], want[k], rtol=tol.rtol, atol=tol.atol) for k in want)
        assert result.passed == expect, scale
        if not expect:
            assert result.output in {
                k for k in want if not np.allclose(got[k], want[k], rtol=tol.rtol, atol=tol.atol)
            }


def test_nan_matches_nan_but_not_a_number():
    want = {"y": np.array([np.nan, 1.0])}
    assert compare_outputs({"y": np.array([np.nan, 1.0])}, want).passed
    assert not compare_outputs({"y": np.array([0.0, 1.0])}, want).passed
    assert not compare_outputs(
        {"y": np.array([np.nan, np.nan])}, {"y": np.array([1.0, 1.0])}
    ).passed


def test_runtime_modules_do_not_import_torch():
    code = (
        "import sys; import mopar.runner.local, mopar.runner.worker, mopar.runtime.handler, "
        "mopar.runner.bundle, mopar.runtime.wire; "
        "print(sorted(m for m in ('torch', 'mopar.frontend', 'mopar.ir') if m in sys.modules))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == "[]"


def test_the_mmap_threshold_is_left_alone_unless_a_function_asks(monkeypatch):
    import ctypes.util

    from mopar.runtime.handler import fix_mmap_threshold

    monkeypatch.delenv("MOPAR_MMAP_THRESHOLD", raising=False)
    assert fix_mmap_threshold() == 0
    monkeypatch.setenv("MOPAR_MMAP_THRESHOLD", str(256 << 10))
    expected = (256 << 10) if ctypes.util.find_library("c") else 0
    assert fix_mmap_threshold() == expected
