"""Things a new user hits first: a data-dependent size (``torch.nonzero``, a boolean mask)
counted rather than crashing, ``-v``/``--debug`` after any command, a plan table that fits 80
columns with its costs whole, and bench charts that one outlier does not flatten."""

from __future__ import annotations

import logging

import click
import pytest
import torch
from click.testing import CliRunner
from rich.console import Console
from torch import nn

from mopar.cli import cli


class Masked(nn.Module):
    """A linear layer, then only its positive outputs (a data-dependent count, at most 4 x 6),
    scaled, and their sum beside a second head."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.fc(x)
        kept = h[h > 0] * 2.0  # nonzero inside: [u0], u0 <= 24
        return self.head(h), kept.sum().reshape(1)


def masked() -> nn.Module:
    torch.manual_seed(0)
    return Masked().eval()


MASKED_INPUT = "x=4x6:float32"


class Counted(nn.Module):
    """The count of positive outputs, read three modules later."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.a, self.b, self.c = (nn.Linear(6, 6) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        n = h[h > 0].shape[0]
        return self.c(torch.relu(self.b(torch.relu(self.a(h))))) / n


# --- a data-dependent size is counted, not a crash ------------------------------------------------


def test_data_dependent_sizes_count_at_their_upper_bound_with_a_warning(caplog):
    from mopar.ir import build_layer_graph
    from mopar.ir.flops import data_dependent, node_flops, op_name

    ep = torch.export.export(masked(), (torch.randn(4, 6),), strict=False)
    gm = ep.module()
    with caplog.at_level(logging.WARNING, logger="mopar"):
        lg = build_layer_graph(gm, input_names=("x",), output_names=("y", "s"))
    found = data_dependent(gm.graph.nodes)
    assert [d.op for d in found] == ["index"] and found[0].bounded  # x[mask]: aten.index
    assert found[0].shape == (24,)  # at most every one of the 4 x 6 elements
    assert found[0].source.endswith("kept = h[h > 0] * 2.0")
    scaled = next(n for n in gm.graph.nodes if op_name(n) == "mul")
    assert node_flops(scaled) == 24  # one per element of the bounded [u0]
    assert sum(layer.flops for layer in lg.layers) > 2 * 4 * 6 * 6
    [warning] = [r.getMessage() for r in caplog.records if "data-dependent" in r.getMessage()]
    assert "index (test_small_things.py:" in warning and "kept = h[h > 0]" in warning
    assert "upper bound, shape (24,)" in warning and "docs/exportable.md" in warning


def test_a_data_dependent_count_is_computed_per_request_and_never_cut_across():
    from mopar.frontend import capture, load_model
    from mopar.ir import build_layer_graph

    torch.manual_seed(0)
    model = Counted().eval()
    example, other = (torch.randn(4, 6, generator=torch.Generator().manual_seed(s)) for s in (1, 7))
    with torch.no_grad():
        assert (model.fc(example) > 0).sum() != (model.fc(other) > 0).sum()
        want = model(other)
    captured = capture(load_model(model), {"x": example.numpy()})
    with torch.no_grad():
        got = captured.gm(x=other)
    torch.testing.assert_close(got, want)  # not frozen at the example's count
    lg = build_layer_graph(captured.gm, input_names=("x",), output_names=("y",))
    held = next(la for la in lg.layers if "index" in la.nodes)
    assert "div" in held.nodes  # the count's reader, three modules on, shares its layer


def test_inspect_counts_a_masked_model_and_verbose_works_after_the_command():
    args = ["inspect", "tests.test_small_things:masked", "--input", MASKED_INPUT]
    quiet = CliRunner().invoke(cli, args)
    loud = CliRunner().invoke(cli, [*args, "-v"])
    assert quiet.exit_code == 0, quiet.output
    assert "internal error" not in quiet.output and "FLOPs" in quiet.stdout
    assert "warning: index (" in quiet.stderr and "info:" not in quiet.stderr
    assert loud.exit_code == 0, loud.output
    assert "info: stage capture" in loud.stderr


# --- the global options after every command -------------------------------------------------------


def _commands(group: click.Group, path: tuple[str, ...] = ()):
    for name, command in group.commands.items():
        yield (*path, name)
        if isinstance(command, click.Group):
            yield from _commands(command, (*path, name))


@pytest.mark.parametrize("where", ["before", "after"])
def test_verbose_and_debug_go_before_or_after_every_command(where):
    paths = list(_commands(cli))
    assert ("compile",) in paths and ("profile", "train") in paths
    for path in paths:
        flags = ["-v", "--debug", "--verbose"]
        args = [*flags, *path, "--help"] if where == "before" else [*path, *flags, "--help"]
        if where == "before" and len(path) > 1:  # the group's own, then the subcommand's
            args = [path[0], *flags, *path[1:], "--help"]
        result = CliRunner().invoke(cli, args)
        assert result.exit_code == 0, (args, result.output)
        assert "-v, --verbose" in result.stdout


# --- the plan table at 80 columns -----------------------------------------------------------------


def _plan():
    from mopar.plan import REQUEST, RESPONSE, Edge, Function, Plan

    big = Function(
        name="s0",
        layers=tuple(f"features.denseblock{i}.denselayer16.conv2" for i in range(12)),
        memory_mb=10240,
        need_mb=9876.4,
        vcpus=5.79,
        time_ms=1234.56,
        param_bytes=1023 * 2**20,
        cost_per_1m_usd=123.4567,
    )
    small = Function(
        name="s1",
        layers=("classifier",),
        memory_mb=128,
        need_mb=118.0,
        vcpus=0.07,
        time_ms=3.2,
        param_bytes=44 * 2**20,
        cost_per_1m_usd=0.01234,
    )
    edges = (
        Edge(src=REQUEST, dst="s0", tensors=("x",), bytes=4, transport="request"),
        Edge(src="s0", dst="s1", tensors=("t",), bytes=4, transport="redis"),
        Edge(src="s1", dst=RESPONSE, tensors=("y",), bytes=4, transport="response"),
    )
    return Plan(
        model="densenet121",
        strategy="mopar",
        functions=(big, small),
        edges=edges,
        cost_per_1m_usd=1234.5678,
        latency_ms=1240.1,
        bound_ms=1300.0,
    )


def test_the_plan_table_fits_80_columns_with_every_cost_whole():
    from mopar.cli.render import plan_table

    console = Console(width=80, record=True)
    console.print(plan_table(_plan()))
    text = console.export_text()
    assert max(len(line) for line in text.splitlines()) <= 80
    for cost in ("$123.46", "$0.0123", "$1,234.57"):
        assert cost in text, text
    for number in ("9876", "10240", "5.79", "1234.56", "1023.0 MB"):
        assert number in text, text
    cut = [w for w in text.split() if "…" in w]  # a name longer than its column: cut, not
    assert cut and all(w.startswith("features.") for w in cut)  # folded mid-word onto a line


# --- bench charts with an outlier -----------------------------------------------------------------


def _rows(outlier: float) -> list[dict]:
    rows = []
    for model in ("resnet50", "bert"):
        for strategy, ratio in (("unsplit", 1.0), ("mopar", 0.8), ("torch-unsplit", outlier)):
            value = 10.0 * ratio
            rows.append(
                {
                    "model": model,
                    "strategy": strategy,
                    "oom": False,
                    "mc_gb_s": value,
                    "cost_per_1m_openfaas_usd": value,
                    "cost_per_1m_lambda_usd": value,
                    "p95_ms": value,
                }
            )
    return rows


def test_an_outlier_puts_the_chart_on_a_log_axis_with_its_ratio_written():
    from benchmarks.charts import chart_figure

    ax = chart_figure(_rows(5156.0), "mc.png").axes[0]
    assert ax.get_yscale() == "log"
    assert "5,156x" in [t.get_text() for t in ax.texts]
    low, high = ax.get_ylim()
    assert low < 0.8 and high > 5156  # mopar's 0.8x and the outlier are both on the axis
    calm = chart_figure(_rows(1.3), "mc.png").axes[0]
    assert calm.get_yscale() == "linear" and not calm.texts
