"""How small and how fast each codec is on a bundle's real activations. A benchmark, not a test.

``python -m benchmarks.codec_activations BUNDLE [--input F.npz ...] [--codec NAME ...] [--repeat N]
[--per-tensor] [--json]`` runs the bundle's slices in this process with onnxruntime (the reference
input, or each ``--input``), keeps every tensor handed over at a cut, and passes them through
each codec on one thread; speeds are of the fastest of ``--repeat`` runs (the machine's other
load only ever slows a run down). docs/codecs.md quotes it.

Read `measure` (pure: arrays in, `CodecFigure`s out), then `cut_activations` and `main`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from mopar.codec import CODEC_NAMES, get_codec

__all__ = ["CodecFigure", "measure", "cut_activations", "main"]


@dataclass(frozen=True, kw_only=True)
class CodecFigure:
    """One codec over a set of tensors.

    Attributes:
        codec: the codec's name.
        tensors: how many tensors it encoded.
        raw_bytes: their total size uncompressed, bytes.
        encoded_bytes: the total size of the codec's sections, bytes.
        ratio: raw_bytes / encoded_bytes.
        encode_mb_s: raw MB (10**6 bytes) encoded per second, on the fastest repeat.
        decode_mb_s: raw MB decoded per second, on the fastest repeat.
        max_rel_err: max over tensors of max |x - decoded| / max |x| (0 for lossless codecs).
    """

    codec: str
    tensors: int
    raw_bytes: int
    encoded_bytes: int
    ratio: float
    encode_mb_s: float
    decode_mb_s: float
    max_rel_err: float


def measure(
    arrays: Sequence[np.ndarray], codecs: Sequence[str], *, repeat: int = 5
) -> tuple[CodecFigure, ...]:
    """Encode and decode ``arrays`` with each codec ``repeat`` times; sizes, speeds and errors.

    A codec skips the tensors whose dtype it cannot carry (the lossy ones skip integer tensors);
    its figure counts only those it encoded.
    """
    figures = []
    for name in codecs:
        codec = get_codec(name)
        usable = [a for a in arrays if codec.supports(a.dtype)]
        enc_s, dec_s = [], []
        for _ in range(repeat):
            start = time.perf_counter()
            sections = [codec.encode(a) for a in usable]
            enc_s.append(time.perf_counter() - start)
            start = time.perf_counter()
            decoded = [
                codec.decode(s, dtype=a.dtype, shape=a.shape) for s, a in zip(sections, usable)
            ]
            dec_s.append(time.perf_counter() - start)
        used = sum(a.nbytes for a in usable)
        figures.append(
            CodecFigure(
                codec=codec.name,
                tensors=len(usable),
                raw_bytes=used,
                encoded_bytes=sum(len(s) for s in sections),
                ratio=round(used / max(1, sum(len(s) for s in sections)), 3),
                encode_mb_s=round(used / 1e6 / min(enc_s), 1),
                decode_mb_s=round(used / 1e6 / min(dec_s), 1),
                max_rel_err=max((_rel_err(a, d) for a, d in zip(usable, decoded)), default=0.0),
            )
        )
    return tuple(figures)


def _rel_err(want: np.ndarray, got: np.ndarray) -> float:
    if want.size == 0:
        return 0.0
    want64, got64 = want.astype(np.float64), got.astype(np.float64)
    scale = float(np.max(np.abs(want64)))
    diff = float(np.max(np.abs(want64 - got64)))
    return diff / scale if scale > 0 else diff


def cut_activations(
    bundle: Path, inputs: Sequence[dict[str, np.ndarray]] | None = None
) -> dict[str, list[np.ndarray]]:
    """Every tensor handed over at a cut, by name, one array per input sample.

    Args:
        bundle: a compiled bundle.
        inputs: model inputs by name, one dict per sample; None: the bundle's reference input.
    """
    from mopar.runner.bundle import read_manifest, read_reference
    from mopar.runtime.handler import SliceHandler

    manifest = read_manifest(bundle)
    if inputs is None:
        inputs = [read_reference(manifest.root / "reference.npz")[0]]
    handlers = [SliceHandler(manifest.function_dir(s), intra_op_threads=1) for s in manifest.slices]
    cuts = list(
        dict.fromkeys(v for s in manifest.slices for v in s.inputs if v not in manifest.inputs)
    )
    found: dict[str, list[np.ndarray]] = {name: [] for name in cuts}
    for sample in inputs:
        values = dict(sample)
        for s, handler in zip(manifest.slices, handlers):
            values.update(handler.handle({k: values[k] for k in s.inputs}))
        for name in cuts:
            found[name].append(values[name])
    return found


def _table(rows: Sequence[CodecFigure], label: str) -> list[str]:
    lines = [
        f"| {label} | codec | ratio | encode MB/s | decode MB/s | max rel. error |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    lines += [
        f"| {r.tensors} tensors, {r.raw_bytes / 1e6:.2f} MB | {r.codec} | {r.ratio:.2f}x | "
        f"{r.encode_mb_s:,.0f} | {r.decode_mb_s:,.0f} | {r.max_rel_err:.1e} |"
        for r in rows
    ]
    return lines


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.codec_activations", description=__doc__
    )
    parser.add_argument("bundle", type=Path)
    parser.add_argument(
        "--input",
        type=Path,
        action="append",
        default=[],
        help="an .npz of model inputs (repeatable); default: reference.npz",
    )
    parser.add_argument("--codec", action="append", default=[], help="default: every codec")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--per-tensor", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    samples = None
    if args.input:
        samples = []
        for path in args.input:
            with np.load(path, allow_pickle=False) as data:
                samples.append(
                    {
                        k.removeprefix("input."): data[k]
                        for k in data.files
                        if not k.startswith("output.")
                    }
                )
    found = cut_activations(args.bundle, samples)
    codecs = args.codec or list(CODEC_NAMES)
    groups = {"all cuts": [a for arrays in found.values() for a in arrays]}
    if args.per_tensor:
        groups.update(found)
    results = {
        label: measure(arrays, codecs, repeat=args.repeat) for label, arrays in groups.items()
    }
    if args.json:
        print(json.dumps({k: [asdict(f) for f in v] for k, v in results.items()}, indent=2))
        return
    for label, rows in results.items():
        shapes = sorted({str(list(a.shape)) for a in groups[label]})
        print(f"\n{label} ({', '.join(shapes)})\n")
        print("\n".join(_table(rows, "tensors")))


if __name__ == "__main__":
    main(sys.argv[1:])
