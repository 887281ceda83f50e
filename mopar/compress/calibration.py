"""Calibration samples: the model inputs codecs are trained and judged on.

A user's data (``--calibration PATH``) is an ``.npz`` of arrays keyed by input name whose first
axis lists samples (or a batch along the model's own batch axis: (N, C, H, W) for an example of
(1, C, H, W); one array for a one-input model, whatever its key), or a folder of ``.npz``
files (one sample each) or of images (for a model with one image input). Without it, samples
are the example input, augmented: shifted crops, flips and noise for floating-point inputs, 10%
of tokens replaced for integer ones. Plans say plainly when quality was estimated on such synthetic data.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mopar.errors import InputSpecError, Option

__all__ = ["Calibration", "load_calibration", "IMAGE_SUFFIXES"]

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".tif", ".tiff")
IMAGENET_MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
IMAGENET_STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)


@dataclass(frozen=True, kw_only=True)
class Calibration:
    """Samples of model inputs (each a dict shaped like the example input), their source, and
    notes on what was assumed to read them."""

    samples: tuple[dict[str, np.ndarray], ...]
    synthetic: bool
    source: str
    notes: tuple[str, ...] = ()

    def split(self, count: int | None = None) -> tuple[tuple[dict, ...], tuple[dict, ...]]:
        """(training samples, held-out samples): the last ``count`` held out (default: a
        quarter); at least one of each when there are two."""
        n = len(self.samples)
        k = min(max(1, round(n / 4) if count is None else count), n - 1) if n > 1 else 0
        return self.samples[: n - k] or self.samples, self.samples[n - k :] or self.samples


def load_calibration(
    path: Path | None, example: dict[str, np.ndarray], *, count: int = 24, seed: int = 0
) -> Calibration:
    """The calibration samples for a model whose example input is ``example``."""
    if path is None:
        rng = np.random.default_rng(seed)
        samples = tuple({k: _augment(v, rng) for k, v in example.items()} for _ in range(count))
        return Calibration(
            samples=samples,
            synthetic=True,
            source=f"{count} augmentations of the example input (synthetic)",
        )
    path = Path(path)
    if path.is_file() and path.suffix == ".npz":
        samples, notes = _from_npz(path, example)
        return Calibration(
            samples=tuple(samples), synthetic=False, source=str(path), notes=tuple(notes)
        )
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix.lower() in (".npz", *IMAGE_SUFFIXES))
        if not files:
            raise InputSpecError(
                Option("calibration"),
                f" folder {str(path)!r} holds no .npz or image files; "
                f"add some ({', '.join(IMAGE_SUFFIXES)}) or pass an .npz",
            )
        samples, notes = [], []
        for f in files[: count * 4]:
            got, said = (
                _from_npz(f, example) if f.suffix == ".npz" else ([_from_image(f, example)], [])
            )
            samples.extend(got)
            notes.extend(n for n in said if n not in notes)
        return Calibration(
            samples=tuple(samples), synthetic=False, source=str(path), notes=tuple(notes)
        )
    raise InputSpecError(
        Option("calibration", value=str(path), quoted=True),
        " is neither an .npz file nor a folder; pass one",
    )


def _augment(x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    if np.issubdtype(x.dtype, np.integer):
        out = x.copy()
        mask = rng.random(x.shape) < 0.10
        lo, hi = int(x.min()), int(x.max())
        out[mask] = rng.integers(lo, hi + 1, size=int(mask.sum()))
        return out
    if x.dtype == np.bool_:
        return x.copy()
    out = x.astype(np.float32, copy=True)
    if out.ndim == 4:  # images: a shifted crop (wrapped) and a horizontal flip
        dy, dx = (int(rng.integers(-s // 8, s // 8 + 1)) for s in out.shape[2:])
        out = np.roll(out, (dy, dx), axis=(2, 3))
        if rng.random() < 0.5:
            out = out[..., ::-1]
    noise = rng.normal(0.0, 0.05 * (float(out.std()) or 1.0), out.shape)
    return np.ascontiguousarray(out + noise).astype(x.dtype)


def _from_npz(
    path: Path, example: dict[str, np.ndarray]
) -> tuple[list[dict[str, np.ndarray]], list[str]]:
    """The samples in ``path``, and notes on what was assumed to read them."""
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {k: data[k] for k in data.files}
    except (OSError, ValueError) as exc:
        raise InputSpecError(
            Option("calibration", value=str(path), quoted=True), f" cannot be read as .npz ({exc})"
        ) from None
    notes = []
    missing = sorted(set(example) - set(arrays))
    if missing and len(example) == 1 and len(arrays) == 1:
        (key, array), (name,) = arrays.popitem(), example
        arrays[name] = array
        notes.append(f"calibration: read the one array {key!r} of {path.name} as input {name!r}")
    elif missing:
        raise InputSpecError(
            Option("calibration", value=str(path), quoted=True),
            f" lacks inputs {missing}; it has {sorted(arrays)}",
        )
    counts = set()
    for name, ref in example.items():
        a, batch = arrays[name], (ref.shape[0] if ref.ndim else 1)
        if a.shape == ref.shape:
            arrays[name] = a[None]
        elif a.shape[1:] == ref.shape:
            pass  # (samples, *example shape)
        elif (
            ref.ndim
            and a.ndim == ref.ndim
            and a.shape[1:] == ref.shape[1:]
            and a.shape[0] % batch == 0
        ):
            # a batch of samples along the model's own batch axis, e.g. (N, C, H, W) for (1, C, H, W)
            arrays[name] = a.reshape(a.shape[0] // batch, *ref.shape)
            notes.append(
                f"calibration: split {name} {_dims(a.shape)} of {path.name} into "
                f"{a.shape[0] // batch} samples of the example's {_dims(ref.shape)}"
            )
        else:
            raise InputSpecError(
                Option("calibration"),
                f" {name} has shape {_dims(a.shape)}; expected the example's "
                f"{_dims(ref.shape)}, N of them as (N, {', '.join(map(str, ref.shape))}), or a "
                f"batch (N, {', '.join(map(str, ref.shape[1:]))})",
            )
        counts.add(len(arrays[name]))
    if len(counts) != 1:
        raise InputSpecError(
            Option("calibration", value=str(path), quoted=True),
            f" has different sample counts per input: {counts}",
        )
    n = counts.pop()
    return [{k: arrays[k][i].astype(example[k].dtype) for k in example} for i in range(n)], notes


def _dims(shape: tuple[int, ...]) -> str:
    return "(" + ", ".join(map(str, shape)) + ")"


def _from_image(path: Path, example: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """An RGB image, centre-cropped and resized to the model's input, ImageNet-normalised."""
    from PIL import Image

    name, ref = next(iter(example.items()))
    if len(example) != 1 or ref.ndim != 4 or ref.shape[1] != 3:
        raise InputSpecError(
            Option("calibration"),
            " images need a model with one (N, 3, H, W) input; this "
            f"one takes {[(k, v.shape) for k, v in example.items()]}; pass an .npz",
        )
    h, w = ref.shape[2:]
    with Image.open(path) as img:
        img = img.convert("RGB")
        side = min(img.size)
        left, top = (img.size[0] - side) // 2, (img.size[1] - side) // 2
        img = img.crop((left, top, left + side, top + side)).resize((w, h), Image.BILINEAR)
        pixels = np.asarray(img, dtype=np.float32) / 255.0
    chw = ((pixels - IMAGENET_MEAN) / IMAGENET_STD).transpose(2, 0, 1)
    return {name: np.broadcast_to(chw, ref.shape).astype(ref.dtype)}
