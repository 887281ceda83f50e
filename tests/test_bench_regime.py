"""The regime table's arithmetic (`benchmarks.regime`): the models it sizes, the CPU floor it bills
against, and the goals it checks. Nothing is planned here; its figures are docs/regime.md's."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from benchmarks import regime
from mopar.config import PROFILES_DIR
from mopar.facts import load_platform


@pytest.mark.parametrize("family", regime.FAMILIES)
@pytest.mark.parametrize("dtype", sorted(regime.DTYPE_BYTES))
def test_every_size_of_the_grid_is_a_sensible_model_of_about_that_many_gb(family, dtype):
    shapes = [regime.shape_for(family, gb, dtype) for gb in regime.SIZES_GB]
    for gb, s in zip(regime.SIZES_GB, shapes):
        assert s.weights_gb(dtype) == pytest.approx(gb, rel=0.1), (gb, s)
        assert s.layers >= 2 and s.hidden % s.heads == 0
        assert s.vocab == regime.VOCAB[family]  # fixed across the family
    # bigger models are wider and at least as deep, as a family grows
    assert [s.hidden for s in shapes] == sorted(s.hidden for s in shapes)
    assert [s.layers for s in shapes[1:]] == sorted(s.layers for s in shapes[1:])
    # a bfloat16 model of a size has twice the parameters of a float32 one
    assert shapes[-1].params * regime.DTYPE_BYTES[dtype] == pytest.approx(20e9, rel=0.1)


@pytest.mark.parametrize("family", regime.FAMILIES)
def test_the_parameter_count_is_what_transformers_builds_from_the_config(family):
    import torch
    import transformers

    shape = regime._family_shape(family, 128, 3)
    config = transformers.AutoConfig.for_model(**shape.config("float32"))
    auto = transformers.AutoModelForCausalLM if family == "decoder" else transformers.AutoModel
    with torch.device("meta"):
        model = auto.from_config(config)
    assert shape.params == sum(p.numel() for p in model.parameters())


def test_a_family_it_does_not_know_or_a_size_below_its_vocabulary_is_refused():
    with pytest.raises(ValueError, match="no family"):
        regime.shape_for("vision", 1.0, "float32")
    with pytest.raises(ValueError, match="vocabulary"):
        regime.shape_for("decoder", 0.001, "float32")


def test_the_floor_is_one_vcpu_of_memory_for_the_time_at_one_vcpu_plus_one_request_fee():
    lam = load_platform(PROFILES_DIR, "lambda")
    assert lam.mb_per_vcpu == 1769  # Lambda: 1,769 MB buy one vCPU
    per_s = 1769 / 1024 * lam.usd_per_gb_s
    assert regime.floor_usd(1000.0, lam) == pytest.approx(per_s + lam.usd_per_request)
    assert regime.floor_usd(250.0, lam) == pytest.approx(per_s / 4 + lam.usd_per_request)
    # Lambda's published x86 price: $0.0000166667 per GB-s and $0.20 per 1M requests
    assert regime.floor_usd(1000.0, lam) * 1e6 == pytest.approx(28.79 + 0.20, abs=0.01)


def test_the_time_at_one_vcpu_undoes_the_threads_by_each_layers_parallel_share():
    prediction = SimpleNamespace(time_ms=(100.0, 30.0), parallel=(0.5, 0.0), threads=2.0)
    # Amdahl at 2 threads: 100 ms is 0.5 + 0.25 of its one-thread time; a serial layer is as is
    assert regime.model_t1_ms(prediction) == pytest.approx(100.0 / 0.75 + 30.0)


def _fig(usd: float, *, slices: int = 1, vs_whole: float | None = 1.0, vcpu: float = 1.0, **parts):
    base = dict.fromkeys(("compute", "waits", "init", "fees", "orchestration", "idle"), 0.0)
    base.update(parts)
    return {
        "functions": slices,
        "slices": slices,
        "usd_per_1m": usd,
        "parts_per_1m": base,
        "vs_floor": usd / 10.0,
        "vs_whole": vs_whole,
        "vcpu_s_over_t1": vcpu,
        "memory_mb": [3538],
    }


def _cell(anyp: dict, whole: dict | None) -> dict:
    return {"floor_usd_per_1m": 10.0, "fee_usd_per_1m": 0.2, "any": anyp, "whole": whole}


def test_a_plan_within_the_goal_that_uses_its_vcpus_misses_nothing():
    whole = _fig(10.5, compute=10.3, fees=0.2)
    assert regime.goal_checks(_cell(whole, whole)) == []


def test_a_plan_over_the_floor_is_a_miss_that_names_the_largest_part_beyond_it():
    anyp = _fig(14.0, compute=9.8, init=4.0, fees=0.2)
    (miss,) = regime.goal_checks(_cell(anyp, anyp))
    assert "1.40x the floor" in miss and "INIT of cold starts 0.40x the floor" in miss


def test_whole_buying_vcpus_it_cannot_use_is_a_miss_unless_a_split_is_cheaper():
    whole = _fig(11.0, compute=10.8, fees=0.2, vcpu=1.9)
    misses = regime.goal_checks(_cell(whole, whole))
    assert len(misses) == 1 and "1.90x the vCPU-seconds" in misses[0] and "is whole" in misses[0]
    split = _fig(10.4, slices=2, vs_whole=0.95, compute=10.0, fees=0.4)
    assert regime.goal_checks(_cell(split, whole)) == []
    dearer = _fig(11.2, slices=2, vs_whole=1.02, compute=10.8, fees=0.4)
    assert "is 2 slices" in regime.goal_checks(_cell(dearer, whole))[0]


def test_the_generated_part_of_the_page_is_replaced_and_the_rest_kept(tmp_path, monkeypatch):
    page = tmp_path / "regime.md"
    page.write_text(f"# title\n\nprose\n\n{regime.BEGIN}\nold\n{regime.END}\n\nafter\n")
    monkeypatch.setattr(regime, "markdown", lambda results: "new\n")
    regime.write_doc(page, {})
    assert page.read_text() == f"# title\n\nprose\n\n{regime.BEGIN}\nnew\n{regime.END}\n\nafter\n"
