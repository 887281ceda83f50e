"""Plot: plan comparison PNGs are written, readable, and refuse bad paths and data clearly."""

from __future__ import annotations

import matplotlib.image
import pytest

from mopar.errors import MoparError
from tools.plot import PlotError, plot_plans

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _layers(n: int) -> tuple[list[str], list[float]]:
    return [f"block{i // 4}.op{i % 4}" for i in range(n)], [10.0 + (i * 37) % 90 for i in range(n)]


def _even_slices(n: int, k: int, memory_mb: float = 256.0) -> list[tuple[int, int, float]]:
    bounds = [round(i * n / k) for i in range(k + 1)]
    return [(lo, hi, memory_mb) for lo, hi in zip(bounds, bounds[1:])]


def _read_png(path):
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    return matplotlib.image.imread(path)


def test_one_panel_writes_a_readable_png(tmp_path):
    names, memory = _layers(12)
    out = plot_plans(
        tmp_path / "plan.png", names, memory, {"balanced": _even_slices(12, 3)}, title="tiny"
    )
    assert out == tmp_path / "plan.png"
    image = _read_png(out)
    height, width = image.shape[:2]
    assert 600 <= width <= 3000 and 200 <= height <= 3000
    assert image.std() > 0.01  # not a blank canvas
    assert [p.name for p in tmp_path.iterdir()] == ["plan.png"]  # no temporary file left behind


def test_six_panels_stack_vertically(tmp_path):
    names, memory = _layers(50)
    panels = {f"strategy{k}": _even_slices(50, k + 1, 128.0 * (k + 1)) for k in range(6)}
    one = _read_png(plot_plans(tmp_path / "one.png", names, memory, {"a": _even_slices(50, 2)}))
    six = _read_png(plot_plans(tmp_path / "six.png", names, memory, panels))
    assert six.shape[0] > 3 * one.shape[0]


def test_three_hundred_layers_and_a_log_axis(tmp_path):
    names, memory = _layers(300)
    panels = {"dp": _even_slices(300, 40, 128.0), "whole": [(0, 300, 10240.0)]}
    image = _read_png(plot_plans(tmp_path / "big.png", names, memory, panels))
    assert image.shape[1] <= 3000  # the width is capped however many layers there are


def test_an_existing_file_is_replaced(tmp_path):
    names, memory = _layers(5)
    target = tmp_path / "plan.png"
    target.write_bytes(b"old")
    plot_plans(target, names, memory, {"a": [(0, 5, 64.0)]})
    assert target.read_bytes()[:8] == PNG_MAGIC


@pytest.mark.parametrize(
    ("name", "match"),
    [
        ("plan.jpg", r"must end in \.png, got .*plan\.jpg"),
        ("missing/plan.png", r"folder .*missing.* does not exist; create it"),
    ],
)
def test_bad_paths_are_refused_with_a_clear_error(tmp_path, name, match):
    names, memory = _layers(4)
    with pytest.raises(PlotError, match=match) as info:
        plot_plans(tmp_path / name, names, memory, {"a": [(0, 4, 64.0)]})
    assert isinstance(info.value, MoparError)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("memory", "panels", "match"),
    [
        ([1.0, 2.0], {"a": [(0, 3, 64.0)]}, r"got 3 layer names and 2 memories"),
        ([1.0, 2.0, 3.0], {"a": [(0, 4, 64.0)]}, r"slice \(0, 4, 64.0\) of 'a' must span"),
        ([1.0, 2.0, 3.0], {"a": [(2, 2, 64.0)]}, r"0 <= lo < hi <= 3"),
        ([1.0, 2.0, 3.0], {"a": [(0, 3, 0.0)]}, r"memory > 0 MB"),
        ([1.0, 2.0, 3.0], {}, r"no panels"),
        ([1.0, float("nan"), 3.0], {"a": [(0, 3, 64.0)]}, r"finite and >= 0"),
    ],
)
def test_inconsistent_data_is_refused(tmp_path, memory, panels, match):
    with pytest.raises(PlotError, match=match):
        plot_plans(tmp_path / "p.png", ["x", "y", "z"], memory, panels)
    assert not list(tmp_path.iterdir())
