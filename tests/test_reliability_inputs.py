"""Reliability: bad inputs, each refused with a clear error, without a crash, and without writing
anything outside its own folder.

- The command line (in this process through click's CliRunner; through the real ``mopar``
  executable with -m slow): model files that are empty, cut short, damaged or folders;
  ``--input`` specs; ``--example-inputs`` and ``mopar run --input`` files that are corrupt, not
  .npz, of strings or of the wrong names, dtypes or shapes; ``--out`` paths that cannot become a
  bundle. Exit 1, one ``error:`` line naming the problem and the fix, no traceback, and the
  case's folder (and the folder of input files) holds what it held before.
- Bundle files tampered with (copies of `skipnet_bundle`): ``plan.json``, ``model.onnx`` and its
  weights, ``function.json``. ``mopar run`` exits 1 with one line, and leaves neither a
  ``/dev/shm/mopar-run-*`` folder nor a slice process behind.
- Requests to a real function server on 127.0.0.1: hostile frames (zstd bombs, huge claims),
  path-like references, malformed HTTP, a body cut short, slow clients. A 4xx with one line of
  JSON naming the problem, no memory blow-up, and the server answers a good request right after.
- Lambda events that are not what a function expects.

Inputs that tests/test_cli.py, test_runtime.py, test_transports.py and test_lambda.py already
try are not repeated here.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import struct
import sys
import threading
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np
import pytest
import zstandard

from mopar.bundle.function import FunctionSpec
from mopar.codec import get_codec
from mopar.runner.processes import ServerProcess
from mopar.runtime import wire
from mopar.runtime.aws import LambdaFunction
from mopar.runtime.frame import MAGIC as FRAME_MAGIC
from mopar.runtime.frame import encode_frame, join_frame, split_frame
from mopar.runtime.transports import HttpClient
from tests.conftest import (
    ROOT,
    mopar,
    new_shm_runs,
    nonblank_lines,
    pid_alive,
    run_watched,
    shm_runs,
)

pytestmark = pytest.mark.timeout(300)  # generous: the first test also waits for skipnet_bundle


def _listing(folder: Path) -> list[str]:
    """Every path under ``folder`` (hidden ones too), with each file's size."""
    return sorted(
        f"{p.relative_to(folder)}:{p.stat().st_size if p.is_file() else 'dir'}"
        for p in folder.rglob("*")
    )


def _assert_one_error_line(code: int, stderr: str, words: list[str]) -> None:
    assert code == 1, stderr
    assert "Traceback" not in stderr
    lines = nonblank_lines(stderr)
    assert len(lines) == 1, stderr
    assert lines[0].startswith("error: "), lines[0]
    for text in words:
        assert text in lines[0], f"{text!r} not in {lines[0]!r}"


# --- the command line -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def input_files(tmp_path_factory) -> Path:
    """The bad files the command-line cases read (never written to by them)."""
    d = tmp_path_factory.mktemp("bad-inputs")
    (d / "empty.pt2").write_bytes(b"")
    (d / "a-folder.pt2").mkdir()
    import torch

    from tests import models

    ep = torch.export.export(models.skipnet(), (torch.randn(1, 3, 8, 8),))
    torch.export.save(ep, d / "whole.pt2")
    whole = (d / "whole.pt2").read_bytes()
    (d / "half.pt2").write_bytes(whole[: len(whole) // 2])
    with zipfile.ZipFile(d / "whole.pt2") as src, zipfile.ZipFile(d / "damaged.pt2", "w") as dst:
        for info in src.infolist():  # the program's JSON damaged, the archive itself intact
            dst.writestr(
                info,
                b"{not json" if info.filename.endswith("models/model.json") else src.read(info),
            )
    (d / "whole.pt2").unlink()
    x = np.zeros((1, 3, 8, 8), np.float32)
    (d / "corrupt.npz").write_bytes(b"PK\x03\x04" + np.random.default_rng(0).bytes(512))
    np.save(d / "one-array.npy", x)
    np.savez(d / "strings.npz", x=np.array(["a", "b"]))
    np.savez(d / "other-names.npz", y=x, z=x)
    np.savez(d / "int64.npz", x=x.astype(np.int64))
    np.savez(d / "five-channels.npz", x=np.zeros((1, 5, 8, 8), np.float32))
    return d


@dataclass(frozen=True)
class CliCase:
    """``args`` ("{in}": the input files, "{d}": the case's own folder and working directory,
    "{bundle}": the compiled SkipNet); ``words`` the error line holds; ``files`` made in the
    case's folder first (bytes: a file, None: a folder)."""

    args: tuple[str, ...]
    words: tuple[str, ...]
    files: tuple[tuple[str, bytes | None], ...] = ()


SPEC = ("inspect", "tests.models:skipnet", "--input")
EXAMPLE = ("inspect", "tests.models:skipnet", "--example-inputs")
RUN = ("run", "{bundle}", "--requests", "1", "--input")
SAVEZ = "numpy.savez(path, name=array, ...)"
CLI_CASES = {
    # model files
    "empty model file": CliCase(
        ("compile", "{in}/empty.pt2", "--out", "{d}/out"),
        ("empty.pt2", "not a PyTorch model archive", "Re-save it"),
    ),
    "model path is a folder": CliCase(
        ("compile", "{in}/a-folder.pt2", "--out", "{d}/out"),
        ("a-folder.pt2", "is a directory", "give a model file"),
    ),
    "pt2 cut in half": CliCase(
        ("compile", "{in}/half.pt2", "--out", "{d}/out"),
        ("half.pt2", "not a zip file", "Re-save it"),
    ),
    "pt2 with a damaged member": CliCase(
        ("compile", "{in}/damaged.pt2", "--out", "{d}/out"),
        (
            "cannot read",
            "damaged.pt2",
            "as a torch.export archive",
            "JSONDecodeError",
            "re-save it with torch.export.save",
        ),
    ),
    # --input specs
    "unsupported dtype": CliCase(
        (*SPEC, "x=1x3x8x8:int8"), ("bad --input spec", "'int8'", "is not one of float32")
    ),
    "zero dimension": CliCase(
        (*SPEC, "x=1x3x0x8:float32"), ("bad --input spec", "every dimension must be at least 1")
    ),
    "input named twice": CliCase(
        (*SPEC, "x=1x3x8x8:float32", "--input", "x=1x3x8x8:float32"),
        ("--input names must be unique", "['x', 'x']"),
    ),
    "dtype the model rejects": CliCase(
        (*SPEC, "x=1x3x8x8:int64"),
        ("the model rejects inputs x=(1, 3, 8, 8):int64", "fix the --input shapes or dtypes"),
    ),
    # --example-inputs files
    "corrupt npz": CliCase(
        (*EXAMPLE, "{in}/corrupt.npz"), ("corrupt.npz", "is not an .npz", SAVEZ)
    ),
    "npy, not npz": CliCase(
        (*EXAMPLE, "{in}/one-array.npy"), ("one-array.npy", "is not an .npz", SAVEZ)
    ),
    "npz of strings": CliCase(
        (*EXAMPLE, "{in}/strings.npz"), ("'x' holds <U1 values, not numbers", "float, int or bool")
    ),
    "npz lacking the input": CliCase(
        (*EXAMPLE, "{in}/other-names.npz"), ("is not an argument of skipnet.forward(x)",)
    ),
    # --out
    "out is a file": CliCase(
        ("compile", "tests.models:skipnet", "--input", "x=1x3x8x8:float32", "--out", "{d}/taken"),
        ("taken' is a file, not a folder", "give a folder path"),
        (("taken", b"mine"),),
    ),
    "out under a file": CliCase(
        (
            "compile",
            "tests.models:skipnet",
            "--input",
            "x=1x3x8x8:float32",
            "--out",
            "{d}/taken/bundle",
        ),
        ("taken' is a file, not a folder",),
        (("taken", b"mine"),),
    ),
    "--force over a folder that is not a bundle": CliCase(
        (
            "compile",
            "tests.models:skipnet",
            "--input",
            "x=1x3x8x8:float32",
            "--out",
            "{d}/work",
            "--force",
        ),
        ("is a folder that is not a mopar bundle", "--force would delete it"),
        (("work", None), ("work/notes.txt", b"keep me")),
    ),
    # mopar run --input
    "run: corrupt npz": CliCase((*RUN, "{in}/corrupt.npz"), ("is not an .npz", SAVEZ)),
    "run: npy, not npz": CliCase((*RUN, "{in}/one-array.npy"), ("is not an .npz", SAVEZ)),
    "run: npz of strings": CliCase(
        (*RUN, "{in}/strings.npz"), ("'x' holds <U1 values, not numbers",)
    ),
    "run: npz lacking the input": CliCase(
        (*RUN, "{in}/other-names.npz"), ("input file lacks ['x']", "inputs are ['x']")
    ),
    "run: npz of the wrong dtype": CliCase(
        (*RUN, "{in}/int64.npz"),
        ("input 'x' is int64 [1, 3, 8, 8]", "compiled for float32 [1, 3, 8, 8]"),
    ),
    "run: npz of the wrong shape": CliCase(
        (*RUN, "{in}/five-channels.npz"),
        ("input 'x' is float32 [1, 5, 8, 8]", "compiled for float32 [1, 3, 8, 8]"),
    ),
}


def _case_folder(root: Path, name: str, case: CliCase) -> Path:
    """The case's own folder (and working directory), holding ``case.files``."""
    d = root / name.replace(" ", "-").replace(",", "").replace(":", "")
    d.mkdir()
    for rel, content in case.files:
        if content is None:
            (d / rel).mkdir()
        else:
            (d / rel).write_bytes(content)
    return d


def _case_args(case: CliCase, d: Path, bundle: Path, input_files: Path) -> list[str]:
    return [a.format(d=d, bundle=bundle, **{"in": input_files}) for a in case.args]


@pytest.fixture(scope="module")
def cli_runs(input_files, skipnet_bundle, tmp_path_factory):
    """Every command-line case through the real executable, run at once (each ``mopar`` imports
    torch: seconds apiece); per case: the finished process and its folder's listing before and
    after."""
    root = tmp_path_factory.mktemp("cli-cases")
    env = {"PYTHONPATH": str(ROOT)}  # tests.models, from each case's own working directory
    shm_before = shm_runs()

    def run(name: str, case: CliCase):
        d = _case_folder(root, name, case)
        before = _listing(d)
        proc = mopar(*_case_args(case, d, skipnet_bundle, input_files), cwd=d, env=env, timeout=240)
        return proc, before, _listing(d)

    inputs_before = _listing(input_files)
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 2)) as pool:
        futures = {name: pool.submit(run, name, case) for name, case in CLI_CASES.items()}
        results = {name: f.result() for name, f in futures.items()}
    assert _listing(input_files) == inputs_before, "a case wrote into the input files' folder"
    return results, new_shm_runs(shm_before)


@pytest.fixture(scope="module")
def cli_runs_in_process(input_files, skipnet_bundle, tmp_path_factory):
    """Every command-line case through click's CliRunner in this process, one after the other,
    each from its own folder; per case: the result and its folder's listing before and after."""
    from click.testing import CliRunner

    from mopar.cli import cli

    root = tmp_path_factory.mktemp("cli-cases-in-process")
    shm_before, inputs_before = shm_runs(), _listing(input_files)
    results = {}
    for name, case in CLI_CASES.items():
        d = _case_folder(root, name, case)
        before = _listing(d)
        with contextlib.chdir(d):
            result = CliRunner().invoke(cli, _case_args(case, d, skipnet_bundle, input_files))
        results[name] = result, before, _listing(d)
    assert _listing(input_files) == inputs_before, "a case wrote into the input files' folder"
    return results, new_shm_runs(shm_before)


# Through the real executable (slow: 21 processes that import torch, minutes on a busy machine),
# every case's one line is its own stderr; test_cli.py runs the executable's error wrapping by
# default.
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", list(CLI_CASES))
def test_bad_cli_input_is_one_error_line_exit_1_and_writes_nothing(cli_runs, name):
    results, leftover_shm = cli_runs
    proc, before, after = results[name]
    _assert_one_error_line(proc.returncode, proc.stderr, list(CLI_CASES[name].words))
    assert after == before, "a half-written output was left behind"
    assert leftover_shm == set()


@pytest.mark.parametrize("name", list(CLI_CASES))
def test_bad_cli_input_in_process_is_one_error_line_exit_1_and_writes_nothing(
    cli_runs_in_process, name
):
    results, leftover_shm = cli_runs_in_process
    result, before, after = results[name]
    _assert_one_error_line(result.exit_code, result.stderr, list(CLI_CASES[name].words))
    assert after == before, "a half-written output was left behind"
    assert leftover_shm == set()


# --- bundle files tampered with -------------------------------------------------------------------


def _edit_json(path: Path, edit) -> None:
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc))


def _set(*keys_value):
    """An edit that sets doc[k1][k2]... = value (a key may be an index)."""
    *keys, value = keys_value

    def edit(doc):
        for k in keys[:-1]:
            doc = doc[k]
        doc[keys[-1]] = value

    return edit


def _rename_s1(name: str):
    def edit(doc):
        doc["io"]["functions"][1]["name"] = name
        doc["plan"]["functions"][1]["name"] = name

    return edit


def _damage(rel: str, how: str):
    def tamper(bundle: Path) -> None:
        path = bundle / rel
        if how == "random":
            path.write_bytes(np.random.default_rng(0).bytes(4096))
        elif how == "truncated":
            path.write_bytes(path.read_bytes()[: max(1, path.stat().st_size // 3)])
        elif how == "missing":
            path.unlink()
        else:  # a link out of the bundle
            path.unlink()
            path.symlink_to(how)

    return tamper


def _linked_out(rel: str):
    """Move ``rel`` out of the bundle, and leave a link to it in its place."""

    def tamper(bundle: Path) -> None:
        outside = bundle.parent / f"outside-{Path(rel).name}"
        (bundle / rel).rename(outside)
        (bundle / rel).symlink_to(outside)

    return tamper


LINK_OUT = ("outside the bundle", "a bundle must hold its own files")


def _plan(edit):
    return lambda bundle: _edit_json(bundle / "plan.json", edit)


def _function_json(edit):
    return lambda bundle: _edit_json(bundle / "functions" / "s1" / "function.json", edit)


ONNX_FIX = ("onnxruntime cannot load", "functions/s1/model.onnx", "recompile the bundle")
# id -> (tamper, words in the error line, mopar run's extra options)
BUNDLE_CASES = {
    "plan.json: not JSON": (
        lambda b: (b / "plan.json").write_text("{not json"),
        ("plan.json' is malformed (JSONDecodeError", "recompile"),
        (),
    ),
    "plan.json: a JSON array": (
        lambda b: (b / "plan.json").write_text("[1, 2]"),
        ("plan.json' is malformed (TypeError", "recompile"),
        (),
    ),
    "plan.json: no io": (
        _plan(lambda d: d.pop("io")),
        ("plan.json' is malformed (KeyError: 'io')", "recompile"),
        (),
    ),
    "plan.json: io.functions a number": (
        _plan(_set("io", "functions", 5)),
        ("is malformed (TypeError", "recompile"),
        (),
    ),
    "plan.json: memory_mb a string": (
        _plan(_set("plan", "functions", 0, "memory_mb", "lots")),
        ("gives function s0 memory_mb 'lots', expected a positive number of MB", "recompile"),
        (),
    ),
    "plan.json: verification a list": (
        _plan(_set("verification", [1])),
        ("has verification [1], expected an object", "recompile"),
        (),
    ),
    "plan.json: a function the plan lacks": (
        _plan(_set("io", "functions", 1, "name", "s9")),
        (
            "lists function 's9' in io.functions, but the plan has only ['s0', 's1', 's2']",
            "recompile",
        ),
        (),
    ),
    "plan.json: a function named ../../etc": (
        _plan(_rename_s1("../../etc")),
        ("names function '../../etc', which is not a folder name", "recompile"),
        (),
    ),
    "plan.json: a function named /etc": (
        _plan(_rename_s1("/etc")),
        ("names function '/etc', which is not a folder name",),
        (),
    ),
    "model.onnx missing": (
        _damage("functions/s1/model.onnx", "missing"),
        ("bundle is incomplete: functions/s1/model.onnx is missing", "recompile"),
        (),
    ),
    "model.onnx random bytes": (_damage("functions/s1/model.onnx", "random"), ONNX_FIX, ()),
    "model.onnx truncated": (_damage("functions/s1/model.onnx", "truncated"), ONNX_FIX, ()),
    "weights truncated": (_damage("functions/s1/model.onnx.data", "truncated"), ONNX_FIX, ()),
    "weights a link to /etc/passwd": (
        _damage("functions/s1/model.onnx.data", "/etc/passwd"),
        LINK_OUT,
        (),
    ),
    "model.onnx a link to /etc/passwd": (
        _damage("functions/s1/model.onnx", "/etc/passwd"),
        LINK_OUT,
        (),
    ),
    "a function folder a link to a folder outside": (_linked_out("functions/s2"), LINK_OUT, ()),
    "reference.npz a link outside": (_linked_out("reference.npz"), LINK_OUT, ()),
    "reference.npz corrupt": (
        _damage("reference.npz", "random"),
        ("reference.npz' is not an .npz", SAVEZ),
        (),
    ),
    # function.json is read by the function servers: --transport http
    "function.json: not JSON": (
        lambda b: (b / "functions/s1/function.json").write_text("{"),
        ("function.json' is malformed", "recompile the bundle"),
        ("--transport", "http"),
    ),
    "function.json: slice ../../etc/passwd": (
        _function_json(_set("slice", "../../etc/passwd")),
        ("slice '../../etc/passwd' is not a function name", "recompile the bundle"),
        ("--transport", "http"),
    ),
    "function.json: slice /etc/passwd": (
        _function_json(_set("slice", "/etc/passwd")),
        ("slice '/etc/passwd' is not a function name",),
        ("--transport", "http"),
    ),
    "function.json: shape a string": (
        _function_json(_set("receives", 0, "shape", "big")),
        ("tensor 't:relu' has shape 'big', expected a list of sizes", "recompile the bundle"),
        ("--transport", "http"),
    ),
    "function.json: unknown dtype": (
        _function_json(_set("receives", 0, "dtype", "float99")),
        ("tensor 't:relu' has dtype 'float99'",),
        ("--transport", "http"),
    ),
    "function.json: unknown codec": (
        _function_json(_set("receives", 0, "codec", "gzip")),
        ("unknown codec 'gzip'", "recompile the bundle"),
        ("--transport", "http"),
    ),
}


@pytest.mark.parametrize("name", list(BUNDLE_CASES))
def test_run_of_a_tampered_bundle_is_one_error_line_and_leaves_nothing(bundle_copy, name):
    tamper, words, options = BUNDLE_CASES[name]
    tamper(bundle_copy)
    before, listing = shm_runs(), _listing(bundle_copy)
    watched = run_watched(
        "run", bundle_copy, "--requests", "1", "--timeout", "30", *options, timeout=60
    )
    _assert_one_error_line(watched.returncode, watched.stderr, list(words))
    assert not any(os.path.exists(d) for d in watched.shm_dirs)
    assert new_shm_runs(before) == set()
    assert [pid for pid in watched.workers if pid_alive(pid)] == []
    assert _listing(bundle_copy) == listing


# --- requests to a real function server -----------------------------------------------------------


@dataclass(frozen=True)
class Served:
    server: ServerProcess
    shm: Path  # the server's MOPAR_SHM_DIR
    outside: Path  # a folder beside it
    good: bytes  # a frame the server answers 200

    @property
    def url(self) -> str:
        return self.server.url


@pytest.fixture(scope="module")
def served(skipnet_bundle, tmp_path_factory):
    """The last slice's function server, with an shm folder and a Redis nothing listens at."""
    yield from _serve(skipnet_bundle / "functions" / "s2", tmp_path_factory.mktemp("served"))


@pytest.fixture(scope="module")
def served_zstd(skipnet_bundle, tmp_path_factory):
    """The same server, its first tensor declared zstd (as a zstd cut declares it): a server
    decodes zstd only there, and refuses a payload of any codec but the declared one."""
    work = tmp_path_factory.mktemp("served-zstd")
    function_dir = work / "s2"
    shutil.copytree(skipnet_bundle / "functions" / "s2", function_dir)
    spec = FunctionSpec.load(function_dir)
    first = replace(spec.receives[0], codec="zstd")
    replace(spec, receives=(first, *spec.receives[1:])).write(function_dir)
    yield from _serve(function_dir, work)


def _serve(function_dir: Path, work: Path):
    shm, outside = work / "shm", work / "outside"
    shm.mkdir()
    outside.mkdir()
    env = dict(
        os.environ,
        PORT="0",
        MOPAR_HOST="127.0.0.1",
        MOPAR_THREADS="4",
        MOPAR_FUNCTION_DIR=str(function_dir),
        MOPAR_SHM_DIR=str(shm),
        REDIS_URL="redis://127.0.0.1:9/0",
    )
    server = ServerProcess([sys.executable, "-m", "mopar.runtime.server"], env, "s2", timeout_s=60)
    spec = FunctionSpec.load(function_dir)
    rng = np.random.default_rng(0)
    good = encode_frame(
        {t.name: rng.standard_normal(t.shape).astype(t.dtype) for t in spec.receives},
        {t.name: t.codec for t in spec.receives},
    )
    yield Served(server, shm, outside, good)
    server.stop()


def _post(served: Served, body: bytes, headers: dict | None = None):
    return HttpClient(served.url, timeout_s=10, retries=0).post(body, headers or {})


def _assert_json_error(status: int, headers: dict, body: bytes, want: int, words: str) -> None:
    assert status == want, body
    assert headers.get("content-type") == "application/json", headers
    assert b"\n" not in body, body
    assert words in json.loads(body)["error"], body


def _assert_still_serves(served: Served) -> None:
    answer = _post(served, served.good)
    assert answer.status == 200, answer.body
    assert list(split_frame(answer.body)) == ["output_0"]


def _payload(dtype_code: int, codec_code: int, shape: tuple[int, ...], section: bytes) -> bytes:
    """A tensor payload with the header written by hand (see `mopar.runtime.wire`'s layout)."""
    head = struct.pack(
        "<4sBBBBQ", b"MOPT", wire.VERSION, dtype_code, codec_code, len(shape), len(section)
    )
    return head + struct.pack(f"<{len(shape)}Q", *shape) + section


def _with_first(served: Served, payload: bytes) -> bytes:
    """The good frame with its first tensor's payload replaced."""
    payloads = dict(split_frame(served.good))
    return join_frame({**payloads, next(iter(payloads)): payload})


def _zstd_bomb(served: Served, frame: bytes) -> bytes:
    """The good frame whose first tensor (float32, 1x8x8x8: 2048 bytes) is the zstd ``frame``."""
    shape = wire.decode(next(iter(split_frame(served.good).values()))).shape
    section = b"\x00" + frame  # filter byte: plain
    return _with_first(
        served, _payload(wire.DTYPE_CODES["float32"], get_codec("zstd").code, shape, section)
    )


def _declared_bomb() -> bytes:
    """A zstd frame header claiming 1 TiB of content, then one block: 17 bytes."""
    descriptor = 0b1110_0000  # an 8-byte content size, single segment, no checksum
    rle_block = (1 | 1 << 1 | 8 << 3).to_bytes(3, "little") + b"\x00"  # last, RLE, 8 bytes
    return b"\x28\xb5\x2f\xfd" + bytes([descriptor]) + struct.pack("<Q", 1 << 40) + rle_block


def _streamed_bomb() -> bytes:
    """64 MB of zeros in one zstd frame that does not declare its size: 2 KB."""
    cctx = zstandard.ZstdCompressor(level=19, write_content_size=False)
    return cctx.compress(bytes(64 << 20))


def _peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM in /proc")


@pytest.mark.parametrize(
    "bomb, words",
    [
        (_declared_bomb, "declares 1099511627776 content bytes, but the tensor takes exactly 2048"),
        (_streamed_bomb, "does not decompress to exactly 2048 bytes"),
    ],
    ids=["declares 1 TiB", "inflates to 64 MB undeclared"],
)
def test_a_zstd_bomb_is_refused_without_allocating(served_zstd, bomb, words):
    served = served_zstd
    body = _zstd_bomb(served, bomb())
    assert len(body) < len(served.good) + 4096  # small on the wire
    peak = _peak_rss_mb(served.server.proc.pid)
    answer = _post(served, body)
    _assert_json_error(answer.status, answer.headers, answer.body, 400, words)
    assert _peak_rss_mb(served.server.proc.pid) - peak < 32, "the bomb was inflated"
    _assert_still_serves(served)


def _frame_head(count: int) -> bytes:
    return FRAME_MAGIC + struct.pack("<BH", 1, count)


def _request(method: str, body: bytes = b"", **headers: str) -> bytes:
    """An HTTP/1.1 request as bytes; ``headers`` by name, ``_`` for ``-``."""
    lines = [
        f"{method} / HTTP/1.1",
        "Host: 127.0.0.1",
        *(f"{k.replace('_', '-')}: {v}" for k, v in headers.items()),
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def _frame_post(body: bytes, **headers: str) -> bytes:
    return _request(
        "POST",
        body,
        Content_Type="application/octet-stream",
        Content_Length=str(len(body)),
        **headers,
    )


def _chunked(body: bytes) -> bytes:
    return _request(
        "POST",
        f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n",
        Content_Type="application/octet-stream",
        Transfer_Encoding="chunked",
    )


F32 = wire.DTYPE_CODES["float32"]
# id -> (the request's bytes, given the server; status; words in the JSON error)
HOSTILE = {
    "a header claiming 2**40 x 2**40 floats": (
        lambda s: _frame_post(_with_first(s, _payload(F32, 0, (1 << 40, 1 << 40), b""))),
        400,
        "is larger than the 17179869184 byte limit",
    ),
    "an unknown dtype code": (
        lambda s: _frame_post(_with_first(s, _payload(99, 0, (2,), b"\0" * 8))),
        400,
        "unknown dtype code 99",
    ),
    "a tensor claiming 2**63 bytes": (
        lambda s: _frame_post(
            _frame_head(1) + struct.pack("<H", 1) + b"x" + struct.pack("<Q", 1 << 63) + b"!"
        ),
        400,
        "claims 9223372036854775808 bytes, the frame has 1 left",
    ),
    "a frame claiming 65535 tensors": (
        lambda s: _frame_post(_frame_head(65535)),
        400,
        "frame claims 65535 tensors, more than 4096",
    ),
    "an shm reference by absolute path": (
        lambda s: _frame_post(b"", X_Mopar_Ref=f"shm:{s.outside}/planted"),
        400,
        "is not a mopar frame name",
    ),
    "an shm reference out of the folder": (
        lambda s: _frame_post(b"", X_Mopar_Ref="shm:../outside/planted"),
        400,
        "is not a mopar frame name",
    ),
    "a redis reference ../../etc/passwd": (
        lambda s: _frame_post(b"", X_Mopar_Ref="redis:../../etc/passwd"),
        400,
        "is not a mopar key",
    ),
    "a reference to an unknown store": (
        lambda s: _frame_post(b"", X_Mopar_Ref="file:///etc/passwd"),
        400,
        "names the unknown store 'file'",
    ),
    "a PUT": (
        lambda s: _request("PUT", s.good, Content_Length=str(len(s.good))),
        405,
        "PUT is not served; POST a frame",
    ),
    "a chunked body over the limit": (
        lambda s: _chunked(s.good * 3),
        413,
        "this slice can receive",
    ),
    "no Content-Length": (
        lambda s: _request("POST", Content_Type="application/octet-stream"),
        411,
        "a Content-Length header is required",
    ),
    "Content-Length not a number": (
        lambda s: _request("POST", Content_Length="abc"),
        400,
        "Content-Length is invalid",
    ),
    "Content-Length negative": (
        lambda s: _request("POST", Content_Length="-5"),
        400,
        "Content-Length is invalid",
    ),
    "Content-Length claiming 10 GB": (
        lambda s: _request("POST", Content_Length=str(10**10)),
        413,
        "body of 10000000000 bytes exceeds the",
    ),
    "a request line of garbage": (
        lambda s: b"\x00\x01 garbage\r\n\r\n",
        400,
        "Start line is invalid",
    ),
}


def _raw(served: Served, data: bytes, *, half_close: bool = False, timeout_s: float = 5.0):
    """Send ``data`` on a fresh connection; (status, headers, body) of the answer, or
    (None, {}, b"") when the server closed the connection without one."""
    u = urlsplit(served.url)
    with socket.create_connection((u.hostname, u.port), timeout=timeout_s) as sock:
        sock.sendall(data)
        if half_close:
            sock.shutdown(socket.SHUT_WR)
        return _read_answer(sock)


def _read_answer(sock: socket.socket):
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        if not chunk:
            return None, {}, b""
        buf += chunk
    head, _, body = buf.partition(b"\r\n\r\n")
    first, *lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines)}
    length = int(headers.get("content-length", 0))
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return int(first.split()[1]), headers, body[:length]


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_hostile_request_gets_a_json_4xx_at_once_and_the_server_stays_up(served, name):
    make, status, words = HOSTILE[name]
    planted = served.outside / "planted"
    planted.write_bytes(served.good)  # what an escaping reference would serve, and delete
    t0 = time.monotonic()
    _assert_json_error(*_raw(served, make(served)), status, words)
    assert time.monotonic() - t0 < 5  # no body awaited that will never come
    assert planted.read_bytes() == served.good, "a reference reached outside the shm folder"
    assert list(served.shm.iterdir()) == []
    _assert_still_serves(served)


def test_a_body_cut_short_is_dropped_at_once_and_the_server_stays_up(served):
    data = _request(
        "POST",
        served.good[:100],
        Content_Type="application/octet-stream",
        Content_Length=str(len(served.good)),
    )
    t0 = time.monotonic()
    status, _, _ = _raw(served, data, half_close=True)  # the client sends no more
    assert status is None, "no answer to a request that never arrived whole"
    assert time.monotonic() - t0 < 5
    _assert_still_serves(served)


def test_a_handshake_naming_a_file_outside_the_shm_folder_is_never_read(served):
    (served.outside / "planted").write_text("token")
    answer = _post(served, b"", {"X-Mopar-Handshake": "../outside/planted:token"})
    assert answer.status == 200 and answer.json() == {"shm": False}
    assert (served.outside / "planted").read_text() == "token"


def test_slow_and_stalled_clients_do_not_stop_the_others(served):
    """Twelve connections (three times the server's threads): six send a good request a few
    bytes at a time over two seconds, six stop halfway. Others are served all along, and the
    slow ones get their answers."""
    u = urlsplit(served.url)
    request = _frame_post(served.good)
    step = len(request) // 20 + 1
    slow = [socket.create_connection((u.hostname, u.port), timeout=10) for _ in range(6)]
    stalled = [socket.create_connection((u.hostname, u.port), timeout=10) for _ in range(6)]
    try:
        for sock in stalled:
            sock.sendall(request[: len(request) // 2])

        def trickle(sock: socket.socket) -> None:
            for i in range(0, len(request), step):
                sock.sendall(request[i : i + step])
                time.sleep(0.1)

        threads = [threading.Thread(target=trickle, args=(s,), daemon=True) for s in slow]
        for t in threads:
            t.start()
        client, times = HttpClient(served.url, timeout_s=5, retries=0), []
        while any(t.is_alive() for t in threads):
            t0 = time.monotonic()
            assert client.post(served.good, {}).status == 200
            times.append(time.monotonic() - t0)
        assert len(times) >= 10 and max(times) < 2.0, times
        for sock in slow:
            assert _read_answer(sock)[0] == 200
    finally:
        for sock in slow + stalled:
            sock.close()
    _assert_still_serves(served)


# --- Lambda events --------------------------------------------------------------------------------


@dataclass
class Context:
    function_name: str = "fn-s2"
    aws_request_id: str = "00000000-0000-0000-0000-000000000000"
    memory_limit_in_mb: int = 128

    def get_remaining_time_in_millis(self) -> int:
        return 30_000


@pytest.fixture(scope="module")
def lambda_s2(skipnet_bundle) -> LambdaFunction:
    return LambdaFunction(skipnet_bundle / "functions" / "s2", {})


@pytest.mark.parametrize(
    "event, words",
    [
        ([1, 2], "the event [1, 2] is not a JSON object"),
        ("hello", 'the event "hello" is not a JSON object'),
        (None, "the event null is not a JSON object"),
        ({}, "the event has no frame"),
        ({"version": "2.0", "isBase64Encoded": True}, "the event has no frame"),
        ({"mopar": 1, "ref": "file:/etc/passwd"}, "names the unknown store 'file'"),
    ],
    ids=["a list", "a string", "null", "empty", "an HTTP event without a body", "a file ref"],
)
def test_a_malformed_lambda_event_gets_a_400_answer_not_a_crash(lambda_s2, event, words):
    answer = lambda_s2(event, Context())
    assert answer["status"] == 400 and words in answer["error"], answer


def test_an_http_lambda_event_whose_body_is_not_base64_is_a_json_400(lambda_s2):
    answer = lambda_s2(
        {"version": "2.0", "body": "%%% not base64 %%%", "isBase64Encoded": True}, Context()
    )
    assert answer["statusCode"] == 400
    assert "not valid base64" in json.loads(answer["body"])["error"]


@pytest.mark.parametrize(
    ("rel", "options"),
    [("functions/s0/handler.py", ()), ("template/mopar-onnx/index.py", ("--transport", "http"))],
)
def test_run_never_executes_code_from_the_bundle(bundle_copy, tmp_path, rel, options):
    """A bundle is data to `mopar run`: the code it ships for its images never runs here."""
    marker, path = tmp_path / "ran", bundle_copy / rel
    path.write_text(f"open({str(marker)!r}, 'w').close()\n" + path.read_text())
    proc = mopar("run", bundle_copy, "--requests", "1", *options, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert not marker.exists()
