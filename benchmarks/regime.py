"""The regime table (issue 50, point 4): big models on Lambda, split or whole, against the CPU floor.

    python -m benchmarks.regime [--sizes 0.1,0.5,1,2,4,8,20] [--rates 0.001,0.01,0.1,1,10]
        [--families decoder,encoder] [--dtypes float32,bfloat16] [--work DIR]
        [--json OUT.json] [--doc docs/regime.md]
    python -m benchmarks.regime --table OUT.json [--doc docs/regime.md]   # a saved run, again

Nothing is compiled or run: every model is planned from a transformers config with no weights
(built on the meta device, as ``mopar plan CONFIG.json`` builds it: `mopar.frontend.weightless`),
and every figure is the planner's prediction.

- **Models.** Two families, each sized to about ``--sizes`` GB of weights (10^9 bytes) in each
  of ``--dtypes`` (a bfloat16 model of 2 GB has twice the parameters of a float32 one):
  a Llama-shaped decoder (``LlamaForCausalLM``, vocabulary 32,000, untied output head, MLP
  8/3 x hidden rounded up to 256, heads of 64, or of 128 from hidden 2,048) at ``input_ids``
  1x128 int64, its logits for every position; and a BERT-shaped encoder (``BertModel``,
  vocabulary 30,522, MLP 4 x hidden, heads of 64) at ``input_ids`` 1x128 int64. The hidden
  size and depth grow together (`shape_for`: the hidden size whose depth for the size is
  nearest the family's aspect, ``DEPTH_PER_HIDDEN``); the vocabulary stays fixed, as it does
  across a real family. The decoder's config goes through ``mopar plan``'s own loader
  (`mopar.frontend.load_model` of the config file); the encoder's is built with
  ``AutoModel`` (that loader tries ``AutoModelForCausalLM`` first, which makes a BERT config
  a ``BertLMHeadModel``).
- **Plans**, per model and rate (Lambda, every other option at its default): *bound*, the
  cheapest plan within the default latency bound (``--max-slowdown`` 1.05 x whole's latency,
  none where whole fits no function); *any*, the cheapest at any latency (the bound lifted to
  ``LIFTED`` x whole's); and *whole*, the model in one function (``--strategy unsplit``),
  where it fits 10,240 MB.
- **CPU floor**: the model's predicted time at one vCPU (each layer's predicted time taken
  back to one vCPU by its op family's parallel share, as the planner's `one_vcpu` does) x
  the price of one vCPU's memory (``mb_per_vcpu``, 1,769 MB on Lambda) per second, plus one
  request fee: the least Lambda can bill for the model's work. Every price is Lambda's in
  ``profiles/platforms.json``.
- **Cold start**: the warm latency plus the INITs (``profiles/runtime.json``'s
  ``cold_start``) a request that finds every function cold waits for, the entry warming up
  the rest as its own INIT begins (`mopar.bill.cold_request`, as the Lambda handler does);
  the JSON also keeps the serial figure (every INIT in turn).
- **Goals**, checked, not asserted: the *any* plan within ``FLOOR_GOAL`` x the floor; and
  where whole pays for vCPUs it cannot use (its vCPUs x its time over ``FLOOR_GOAL`` x the
  time at one vCPU), a split cheaper than whole. A missed goal is named with the largest part
  of the bill beyond the floor.

Read in this order: `Shape`, `shape_for`, `floor_usd`, `plan_figures`, `run_model`,
`markdown`, `main`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

__all__ = [
    "DEPTH_PER_HIDDEN",
    "DTYPE_BYTES",
    "FAMILIES",
    "FLOOR_GOAL",
    "LIFTED",
    "RATES",
    "SEQ_LEN",
    "SIZES_GB",
    "Shape",
    "floor_usd",
    "goal_checks",
    "main",
    "markdown",
    "plan_figures",
    "run_model",
    "shape_for",
]

SIZES_GB = (0.1, 0.5, 1.0, 2.0, 4.0, 8.0, 20.0)
RATES = (0.001, 0.01, 0.1, 1.0, 10.0)
FAMILIES = ("decoder", "encoder")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
SEQ_LEN = 128
FLOOR_GOAL = 1.15
"""The *any* plan's goal against the CPU floor; also how far whole's vCPU-seconds may exceed
the time at one vCPU before it counts as paying for vCPUs it cannot use."""
LIFTED = 1e6
"""``max_slowdown`` for the plan at any latency: a bound no plan reaches."""
GB = 1e9

VOCAB = {"decoder": 32000, "encoder": 30522}
DEPTH_PER_HIDDEN = {"decoder": 1 / 128, "encoder": 1 / 64}
"""Layers per unit of hidden size a family keeps: Llama-2-7B 32 layers at 4,096, Llama-3.2-1B
16 at 2,048; BERT-base 12 at 768."""
HIDDEN_STEP = {"decoder": 128, "encoder": 64}
BERT_POSITIONS = 512


@dataclass(frozen=True, kw_only=True)
class Shape:
    """One model of a family.

    Attributes:
        family: ``decoder`` or ``encoder``.
        hidden: hidden size; ``layers``: blocks; ``intermediate``: the MLP's width.
        heads: attention heads (as many key-value heads).
        vocab: vocabulary.
    """

    family: str
    hidden: int
    layers: int
    intermediate: int
    heads: int
    vocab: int

    @property
    def params(self) -> int:
        """Parameters and buffers held as weights (the decoder's rotary table aside)."""
        h, i, v = self.hidden, self.intermediate, self.vocab
        if self.family == "decoder":
            block = 4 * h * h + 3 * h * i + 2 * h  # q k v o, gate up down, two RMS norms
            return 2 * v * h + self.layers * block + h
        block = 4 * (h * h + h) + 2 * h + h * i + i + i * h + h + 2 * h
        embeddings = (v + BERT_POSITIONS + 2) * h + 2 * h
        return embeddings + self.layers * block + h * h + h  # and the pooler

    def weights_gb(self, dtype: str) -> float:
        """Its weights in ``dtype``, GB (10^9 bytes)."""
        return self.params * DTYPE_BYTES[dtype] / GB

    def config(self, dtype: str) -> dict[str, Any]:
        """Its transformers config, in ``dtype``."""
        if self.family == "decoder":
            return {
                "model_type": "llama",
                "architectures": ["LlamaForCausalLM"],
                "vocab_size": self.vocab,
                "hidden_size": self.hidden,
                "intermediate_size": self.intermediate,
                "num_hidden_layers": self.layers,
                "num_attention_heads": self.heads,
                "num_key_value_heads": self.heads,
                "hidden_act": "silu",
                "max_position_embeddings": 4096,
                "rms_norm_eps": 1e-05,
                "rope_theta": 10000.0,
                "tie_word_embeddings": False,
                "dtype": dtype,
            }
        return {
            "model_type": "bert",
            "architectures": ["BertModel"],
            "vocab_size": self.vocab,
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "max_position_embeddings": BERT_POSITIONS,
            "type_vocab_size": 2,
            "dtype": dtype,
        }


def _family_shape(family: str, hidden: int, layers: int) -> Shape:
    if family == "decoder":
        intermediate = 256 * math.ceil(8 * hidden / 3 / 256)
        heads = hidden // (128 if hidden >= 2048 else 64)
    else:
        intermediate, heads = 4 * hidden, hidden // 64
    return Shape(
        family=family,
        hidden=hidden,
        layers=layers,
        intermediate=intermediate,
        heads=heads,
        vocab=VOCAB[family],
    )


def shape_for(family: str, gb: float, dtype: str) -> Shape:
    """The model of ``family`` with about ``gb`` GB of weights in ``dtype``: of the hidden sizes
    (multiples of `HIDDEN_STEP` up to 16,384) whose depth for that size is at least 2, the one
    whose depth is nearest the family's aspect (`DEPTH_PER_HIDDEN`), at the depth nearest
    the size."""
    if family not in FAMILIES:
        raise ValueError(f"no family {family!r}; choose one of {', '.join(FAMILIES)}")
    target = gb * GB / DTYPE_BYTES[dtype]
    best: tuple[float, Shape] | None = None
    step = HIDDEN_STEP[family]
    for hidden in range(2 * step, 16384 + 1, step):
        none, one = _family_shape(family, hidden, 0), _family_shape(family, hidden, 1)
        layers = round((target - none.params) / (one.params - none.params))
        if layers < 2:
            continue
        misfit = abs(math.log(layers / (hidden * DEPTH_PER_HIDDEN[family])))
        if best is None or misfit < best[0]:
            best = (misfit, _family_shape(family, hidden, layers))
    if best is None:
        raise ValueError(f"no {family} of {gb:g} GB in {dtype}: its vocabulary alone is larger")
    return best[1]


def floor_usd(t1_ms: float, platform) -> float:
    """The CPU floor of one request, USD: ``t1_ms`` (the model's time at one vCPU) at the price
    of the memory that buys one vCPU on ``platform``, plus one request fee."""
    return t1_ms / 1e3 * platform.usd_per_s(platform.mb_per_vcpu, 1.0) + platform.usd_per_request


def model_t1_ms(prediction) -> float:
    """The model's predicted time at one vCPU, ms: every layer's predicted time back at one
    vCPU (`mopar.planner.problem.one_vcpu`)."""
    from mopar.planner.problem import one_vcpu

    return sum(
        one_vcpu(t, p, prediction.threads)[0]
        for t, p in zip(prediction.time_ms, prediction.parallel)
    )


def plan_figures(plan, whole, platform, *, floor: float, t1_ms: float) -> dict[str, Any]:
    """What the table shows of ``plan`` (priced by `mopar.bill` under ``platform``'s traffic),
    against ``whole`` (None: it fits no function) and the ``floor`` (USD per request)."""
    from mopar.planner.cost import cold_latency_ms, price_plan

    bill = price_plan(plan, platform).bill
    base = None if whole is None else price_plan(whole, platform).bill
    vcpu_ms = sum(
        plan.invocation_probability(f.name) * platform.cpu_of(f.memory_mb, f.vcpus) * f.time_ms
        for f in plan.functions
    )
    return {
        "functions": len(plan.functions),
        "slices": len(plan.vertical()),
        "chain": bill.chain,
        "memory_mb": [f.memory_mb for f in plan.functions],
        "vcpus": [platform.cpu_of(f.memory_mb, f.vcpus) for f in plan.functions],
        "param_bytes": sum(f.param_bytes for f in plan.functions),
        "usd_per_1m": bill.usd * 1e6,
        "parts_per_1m": {
            "compute": bill.compute_usd * 1e6,
            "waits": bill.waits_usd * 1e6,
            "init": bill.init_usd * 1e6,
            "fees": bill.fees_usd * 1e6,
            "orchestration": bill.orchestration_usd * 1e6,
            "idle": bill.idle_usd * 1e6,
        },
        "latency_ms": bill.latency_ms,
        "cold_ms": cold_latency_ms(plan, platform, together=True),
        "cold_serial_ms": cold_latency_ms(plan, platform, together=False),
        "vcpu_s_over_t1": vcpu_ms / t1_ms if t1_ms else None,
        "vs_whole": bill.usd / base.usd if base is not None and base.usd else None,
        "vs_floor": bill.usd / floor,
        "whole_latency_ms": None if base is None else base.latency_ms,
        "notes": [str(n) for n in plan.notes],
    }


def _why(fig: dict[str, Any], floor_per_1m: float, fee_per_1m: float) -> str:
    """The largest part of ``fig``'s bill beyond the floor, in words."""
    parts = dict(fig["parts_per_1m"])
    parts["compute"] -= floor_per_1m - fee_per_1m  # the floor's own compute
    parts["fees"] -= fee_per_1m
    words = {
        "compute": "compute beyond one vCPU's worth",
        "waits": "callers billed while they wait",
        "init": "INIT of cold starts",
        "fees": "request fees beyond one",
        "orchestration": "the chain mode's charges",
        "idle": "idle charges",
    }
    ranked = sorted(parts.items(), key=lambda kv: -kv[1])
    said = [
        f"{words[k]} {v / floor_per_1m:.2f}x the floor"
        for k, v in ranked[:2]
        if v > 0.01 * floor_per_1m
    ]
    return "; ".join(said) or "nothing beyond the floor"


def goal_checks(cell: dict[str, Any]) -> list[str]:
    """The goals ``cell`` (one model at one rate) misses, each in words; empty: none."""
    floor_1m, fee_1m = cell["floor_usd_per_1m"], cell["fee_usd_per_1m"]
    anyp, whole = cell["any"], cell["whole"]
    misses = []
    if anyp["vs_floor"] > FLOOR_GOAL:
        misses.append(
            f"any-latency plan at {anyp['vs_floor']:.2f}x the floor (goal {FLOOR_GOAL}x): "
            + _why(anyp, floor_1m, fee_1m)
        )
    if whole is not None and (whole["vcpu_s_over_t1"] or 0) > FLOOR_GOAL:
        if not _split_cheaper(anyp):
            chosen = "whole" if anyp["slices"] == 1 else f"{anyp['slices']} slices"
            misses.append(
                f"whole buys {whole['vcpu_s_over_t1']:.2f}x the vCPU-seconds it needs at one "
                f"vCPU ({whole['memory_mb'][0]} MB), yet no split is cheaper: the any-latency "
                f"plan is {chosen}"
            )
    return misses


def run_model(
    family: str,
    gb: float,
    dtype: str,
    rates: Sequence[float],
    work: Path,
    tell: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    """Plan one model (``family``, ``gb``, ``dtype``) at every rate: its shape, its floor, and
    per rate its bound, any-latency and whole plans (`plan_figures`), with the time it took."""
    from mopar import api, pipeline
    from mopar.config import CompileConfig
    from mopar.errors import PartitionInfeasibleError

    shape = shape_for(family, gb, dtype)
    name = f"{family}-{gb:g}gb-{dtype}"
    path = work / f"{name}.json"
    path.write_text(json.dumps(shape.config(dtype), indent=1) + "\n")
    base = CompileConfig(target="lambda")
    started = time.perf_counter()
    analysis = api.analyze_for(base, _loaded(shape, dtype, path), [f"input_ids=1x{SEQ_LEN}:int64"])
    capture_s = time.perf_counter() - started
    facts = api.facts_for(base)
    profiled = pipeline.profile(analysis, base, facts)
    t1 = model_t1_ms(profiled.layers)
    platform = facts.platform
    out: dict[str, Any] = {
        "model": name,
        "family": family,
        "dtype": dtype,
        "target_gb": gb,
        "shape": asdict(shape),
        "params": shape.params,
        "weights_gb": shape.weights_gb(dtype),
        "planned_gb": analysis.layers.param_bytes / GB,
        "layers": len(analysis.layers.layers),
        "config": str(path),
        "t1_ms": t1,
        "floor_usd_per_1m": floor_usd(t1, platform) * 1e6,
        "fee_usd_per_1m": platform.usd_per_request * 1e6,
        "capture_s": capture_s,
        "cells": [],
    }
    tell(f"{name}: {shape.params / 1e9:.3f}B parameters, captured in {capture_s:.1f} s")
    for rate in rates:
        started = time.perf_counter()
        config = replace(base, rate=rate)
        facts = api.facts_for(config)
        plat = facts.platform
        try:
            whole = pipeline.plan(
                analysis, replace(config, strategy="unsplit"), facts, profiled
            ).plan
        except PartitionInfeasibleError:
            whole = None
        bound = pipeline.plan(analysis, config, facts, profiled).plan
        lifted = replace(config, max_slowdown=LIFTED)
        anyp = pipeline.plan(analysis, lifted, facts, profiled).plan
        floor = floor_usd(t1, plat)
        cell = {
            "rate_rps": rate,
            "floor_usd_per_1m": floor * 1e6,
            "fee_usd_per_1m": plat.usd_per_request * 1e6,
            "cold_share": plat.cold_start_rate,
            "whole": None
            if whole is None
            else plan_figures(whole, whole, plat, floor=floor, t1_ms=t1),
            "bound": plan_figures(bound, whole, plat, floor=floor, t1_ms=t1),
            "bound_ms": bound.bound_ms,
            "any": plan_figures(anyp, whole, plat, floor=floor, t1_ms=t1),
            "plan_s": time.perf_counter() - started,
        }
        cell["misses"] = goal_checks(cell)
        out["cells"].append(cell)
        tell(
            f"{name} at {rate:g}/s: bound {cell['bound']['slices']} slice(s), any "
            f"{cell['any']['slices']} at {cell['any']['vs_floor']:.2f}x the floor "
            f"({cell['plan_s']:.1f} s)"
        )
    out["plan_s"] = sum(c["plan_s"] for c in out["cells"])
    return out


def _loaded(shape: Shape, dtype: str, path: Path):
    """The model of ``shape`` on the meta device, as `mopar.frontend.load_model` takes it for
    planning: the decoder from its config file (``mopar plan CONFIG.json``'s loader), the
    encoder with ``AutoModel`` (that loader would make a BERT config a ``BertLMHeadModel``)."""
    from mopar.frontend import load_model

    if shape.family == "decoder":
        return load_model(str(path), weightless=True)
    import torch
    import transformers

    config = transformers.AutoConfig.for_model(**shape.config(dtype))
    with torch.device("meta"):
        module = transformers.AutoModel.from_config(config, dtype=getattr(torch, dtype)).eval()
    return replace(load_model(module, weightless=True), name=path.stem)


# --- the page --------------------------------------------------------------------------------


CHAIN_WORDS = {"invoke": "invoke", "stepfunctions": "sfn", "event": "event"}
"""How the tables name Lambda's chain modes (``sfn``: Step Functions Express)."""


def _plan_word(fig: dict[str, Any]) -> str:
    if fig["slices"] == 1:
        return "whole"
    return f"split {fig['functions']} ({CHAIN_WORDS.get(fig['chain'], fig['chain'])})"


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _models_table(models: Sequence[dict[str, Any]]) -> list[str]:
    lines = [
        "| model | h x L, MLP | params | GB | planned | t1 s | floor $/1M | fits | s |",
        "|---|---|---:|---:|---:|---:|---:|---|---:|",
    ]
    for m in models:
        s = m["shape"]
        fits = m["cells"][0]["whole"] is not None if m["cells"] else None
        lines.append(
            f"| {m['model']} | {s['hidden']} x {s['layers']}, {s['intermediate']} | "
            f"{m['params'] / 1e9:.3f}B | {m['weights_gb']:.2f} | {m['planned_gb']:.2f} | "
            f"{m['t1_ms'] / 1e3:.2f} | {m['floor_usd_per_1m']:.2f} | "
            f"{'yes' if fits else 'no'} | {m['capture_s'] + m['plan_s']:.0f} |"
        )
    return lines


def _cells_table(models: Sequence[dict[str, Any]], which: str) -> list[str]:
    lines = [
        "| GB | req/s | plan | vs whole | vs floor | latency s | x whole | cold s |",
        "|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for m in models:
        for c in m["cells"]:
            f = c[which]
            slow = f["latency_ms"] / f["whole_latency_ms"] if f["whole_latency_ms"] else None
            mark = "**" if which == "any" and f["vs_floor"] > FLOOR_GOAL else ""
            lines.append(
                f"| {m['weights_gb']:.2f} | {c['rate_rps']:g} | {_plan_word(f)} | "
                f"{_x(f['vs_whole'])} | {mark}{_x(f['vs_floor'])}{mark} | "
                f"{f['latency_ms'] / 1e3:.2f} | {_x(slow)} | {f['cold_ms'] / 1e3:.2f} |"
            )
    return lines


def _idles(cell: dict[str, Any]) -> bool:
    """Whether whole, in ``cell``, pays for vCPUs it cannot use (`goal_checks`' test)."""
    whole = cell["whole"]
    return whole is not None and (whole["vcpu_s_over_t1"] or 0) > FLOOR_GOAL


def _summary_table(groups: dict[tuple[str, str], list[dict[str, Any]]]) -> list[str]:
    lines = [
        "| models | cells | any in goal | whole fits | whole idles | split cheaper: any | bound |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for (family, dtype), models in groups.items():
        cells = [c for m in models for c in m["cells"]]
        idle = [c for c in cells if _idles(c)]
        lines.append(
            f"| {family}, {dtype} | {len(cells)} | "
            f"{sum(c['any']['vs_floor'] <= FLOOR_GOAL for c in cells)} | "
            f"{sum(c['whole'] is not None for c in cells)} | {len(idle)} | "
            f"{sum(_split_cheaper(c['any']) for c in idle)} of {len(idle)} | "
            f"{sum(_split_cheaper(c['bound']) for c in idle)} of {len(idle)} |"
        )
    return lines


def _split_cheaper(fig: dict[str, Any]) -> bool:
    return fig["slices"] > 1 and (fig["vs_whole"] or 1.0) < 1.0


def _wrap(text: str, indent: str = "") -> str:
    return textwrap.fill(text, width=100, subsequent_indent=indent, break_on_hyphens=False)


def markdown(results: dict[str, Any]) -> str:
    """The page's generated part: the run, the models, per family and dtype a table of the
    plans within the bound and one of the plans at any latency, and the goals missed."""
    lines = [
        _wrap(
            f"`{results['command']}`, {results['date']}, {results['cpu']} ({results['cores']} "
            f"cores), at commit {results['commit']}; `uptime` before: {results['uptime']}. "
            f"Planning took {results['seconds']:.0f} s in all; the models' last column is each "
            "one's capture and its plans at every rate, s."
        ),
        "",
        "### The models",
        "",
        *_models_table(results["models"]),
    ]
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for m in results["models"]:
        groups.setdefault((m["family"], m["dtype"]), []).append(m)
    lines += [
        "",
        "### In short",
        "",
        _wrap(
            f"Cells (a model at a rate) where: the any-latency plan is within {FLOOR_GOAL}x "
            "the floor (*any in goal*); whole fits one function; whole idles vCPUs (its vCPUs "
            f"x its time over {FLOOR_GOAL}x the time at one vCPU); of those, the any-latency "
            "plan, and the bound plan, is a split cheaper than whole (*split cheaper*)."
        ),
        "",
        *_summary_table(groups),
    ]
    for (family, dtype), models in groups.items():
        for which, title in (
            ("bound", "cheapest within the default latency bound"),
            ("any", "cheapest at any latency"),
        ):
            lines += ["", f"### {family}, {dtype}: {title}", "", *_cells_table(models, which)]
    lines += ["", "### Goals missed", ""]
    misses = [
        _wrap(f"- {m['model']} at {c['rate_rps']:g}/s: {miss}", indent="  ")
        for m in results["models"]
        for c in m["cells"]
        for miss in c["misses"]
    ]
    cells = sum(len(m["cells"]) for m in results["models"])
    lines.append(f"{len(misses)} misses in {cells} cells.")
    lines += ["", *misses] if misses else []
    return "\n".join(lines) + "\n"


def write_doc(doc: Path, results: dict[str, Any]) -> None:
    """Replace the generated part of ``doc`` (between `BEGIN` and `END`) with this run's."""
    text = doc.read_text() if doc.exists() else f"# The regime table\n\n{BEGIN}\n{END}\n"
    head, sep, rest = text.partition(BEGIN)
    _, sep2, tail = rest.partition(END)
    if not (sep and sep2):
        raise SystemExit(f"{doc} has no {BEGIN} ... {END} section to replace")
    doc.write_text(f"{head}{BEGIN}\n{markdown(results)}{END}{tail}")


BEGIN = "<!-- generated by python -m benchmarks.regime: begin -->"
END = "<!-- generated by python -m benchmarks.regime: end -->"


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(v) for v in text.split(","))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=_floats, default=SIZES_GB, help="GB of weights")
    parser.add_argument("--rates", type=_floats, default=RATES, help="requests per second")
    parser.add_argument("--families", default=",".join(FAMILIES), help="decoder,encoder")
    parser.add_argument("--dtypes", default=",".join(DTYPE_BYTES), help="float32,bfloat16")
    parser.add_argument("--work", type=Path, default=Path("build/regime"), help="configs")
    parser.add_argument("--json", type=Path, default=None, help="write the figures as JSON")
    parser.add_argument("--doc", type=Path, default=None, help="rewrite this page's tables")
    parser.add_argument(
        "--table", type=Path, default=None, metavar="FILE.json", help="a saved run's tables"
    )
    args = parser.parse_args(argv)
    if args.table:
        results = json.loads(args.table.read_text())
    else:
        results = _run(args, sys.argv[1:] if argv is None else list(argv))
    if args.doc:
        write_doc(args.doc, results)
    print(markdown(results), end="")


def _run(args, argv: list[str]) -> dict[str, Any]:
    from mopar.profile.store import cpu_model

    args.work.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    results: dict[str, Any] = {
        "command": " ".join(["python -m benchmarks.regime", *argv]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "commit": commit or "?",
        "uptime": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(),
        "sizes_gb": list(args.sizes),
        "rates_rps": list(args.rates),
        "models": [],
    }
    started = time.perf_counter()
    for family in args.families.split(","):
        for dtype in args.dtypes.split(","):
            for gb in args.sizes:
                m = run_model(
                    family, gb, dtype, args.rates, args.work, lambda s: print(s, file=sys.stderr)
                )
                results["models"].append(m)
                results["seconds"] = time.perf_counter() - started
                if args.json:
                    args.json.write_text(json.dumps(results, indent=1) + "\n")
    results["seconds"] = time.perf_counter() - started
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return results


if __name__ == "__main__":
    main()
