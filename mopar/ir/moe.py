"""Mixture-of-experts blocks in the captured graph: find them, and give their experts one form.

A mixture-of-experts (MoE) block routes each token to ``k`` of ``E`` experts: a router (the gate
linear, softmax or sigmoid, top-k, and often a normalisation of the top-k weights) picks them,
the experts run on the tokens they were given, and their outputs are summed, weighted. In a
captured graph that sum is written in many ways: transformers 5's grouped matmuls over sorted
tokens (``*Experts`` modules with stacked ``gate_up_proj``/``down_proj``), a loop over an
``nn.ModuleList`` of expert modules, dense or gathered. mopar recognises the block by what it
computes, not by how:

1. the router: an ``aten.topk`` whose input is a softmax or sigmoid of a linear map of the
   hidden states;
2. the block's output: the first tensor of the hidden states' size that every path from the
   top-k indices and weights to the model's outputs passes through;
3. the experts: between the two, either stacked parameters with one row per expert, or the
   nodes of ``E`` sibling modules ``<list>.0 .. <list>.E-1``. Each expert becomes a module of
   its own that maps any number of tokens ``(n, H)`` to ``(n, H)`` (`mopar.ir.experts`).

Then it checks, on the example inputs, that the dense translation -- every expert on every
token, weighted by its top-k weight where it was chosen and by 0 elsewhere -- gives the block's
output, and only then replaces the block's nodes by that translation (`apply_moe`). A block
whose experts do not reproduce it stays as it was, and a note says why. After the rewrite the
experts of a block are one layer (named by the experts' module path) whose inputs are the hidden
states, the top-k indices and the top-k weights, and whose output is the block's.

The dense translation is the analysis form: static in shape, so every layer has sizes, FLOPs and
a predicted time, though for top-k of E it does E/k times the experts' arithmetic. What a slice
holding the layer exports is its sparse translation (`SparseExperts`), checked on the example
inputs like the dense one (`MoeBlock.sparse`); `mopar.rewrite.experts` puts it in the slices.

Read in this order: `MoeBlock`, `SparseExperts`, `find_moe` (decide), `apply_moe` (apply).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import networkx as nx
import numpy as np
import torch
from torch import fx, nn

from mopar.ir.experts import (
    ACTIVATIONS,
    dense_translation,
    inline_dense,
    module_experts,
    stacked_experts,
)
from mopar.ir.flops import op_name
from mopar.ir.graph import module_paths

__all__ = ["MoeBlock", "MoeFound", "SparseExperts", "find_moe", "apply_moe", "probe", "router_of"]

log = logging.getLogger(__name__)

_ROUTING = {"softmax": "softmax", "_softmax": "softmax", "sigmoid": "sigmoid"}
_GATES = {"linear", "addmm", "mm", "matmul"}
_PASS = {
    "to",
    "_to_copy",
    "_assert_tensor_metadata",
    "view",
    "reshape",
    "clone",
    "contiguous",
    "alias",
    "type_as",
    "float",
    "add",
    "div",
    "mul",
}
_VIEWS = {
    "view",
    "reshape",
    "_unsafe_view",
    "flatten",
    "to",
    "_to_copy",
    "clone",
    "contiguous",
    "alias",
    "_assert_tensor_metadata",
}


@dataclass(frozen=True, kw_only=True)
class MoeBlock:
    """One recognised mixture-of-experts block.

    Attributes:
        name: the experts' module path (``model.layers.0.mlp.experts``); after `apply_moe`, also
            the name of the layer holding their dense translation.
        router: the router's module path (the gate linear's owner).
        num_experts: E.
        top_k: k, the experts each token is routed to.
        hidden_size: H, the width of a token's hidden state.
        tokens: tokens per request at the captured shapes (batch x sequence).
        form: ``stacked`` (one parameter per projection, a row per expert: transformers 5's
            ``*Experts``) or ``modules`` (one module per expert).
        routing: ``softmax`` or ``sigmoid``.
        activation: the experts' activation (``silu``, ``gelu``...).
        params_per_expert: parameters one expert holds.
        shared: module path of a shared expert beside the routed ones ("" when none).
        hidden, index, weights: the FX nodes the experts read: the hidden states, the top-k
            indices and the top-k weights.
        output: the FX node of the block's weighted sum.
        sparse: the sparse translation (`SparseExperts`) reproduces the block's output on the
            example inputs too: a slice that holds the experts runs them sparse.
    """

    name: str
    router: str
    num_experts: int
    top_k: int
    hidden_size: int
    tokens: int
    form: str
    routing: str
    activation: str
    params_per_expert: int
    shared: str = ""
    hidden: str
    index: str
    weights: str
    output: str
    sparse: bool = False

    def roles(self, layers: list[str]) -> dict[str, str]:
        """The role of each of ``layers`` (layer names) that is a part of this block."""
        out = {}
        for name in layers:
            if name == self.name:
                out[name] = "experts"
            elif name == self.router or name.startswith(self.router + "."):
                out[name] = "router"
            elif self.shared and (name == self.shared or name.startswith(self.shared)):
                out[name] = "shared expert"
        return out

    def describe(self) -> dict:
        return {
            "experts": self.num_experts,
            "top_k": self.top_k,
            "form": self.form,
            "routing": self.routing,
            "router": self.router,
            "shared": self.shared,
            "params_per_expert": self.params_per_expert,
            "sparse": self.sparse,
        }


class SparseExperts(nn.Module):
    """A block's experts as a model runs them: forward(x (T, H), index (T, k), weights (T, k))
    -> (T, H), each expert only on the tokens routed to it.

    Per expert ``e``: each token's weight for it (0 where its top-k did not choose it), the
    tokens with a weight (NonZero), their hidden states and weights (Gather), the expert on
    those rows, and its weighted answer added into their rows (ScatterND, reduction add). A
    token reaches an expert at most once, so each row's sum is the dense translation's, term by
    term in the same expert order (a skipped term is the dense one's ``0 * y``). An expert no
    token reached runs on zero rows. For top-k of E that is k/E of the dense translation's
    expert arithmetic, plus a NonZero, two Gathers and a ScatterND per expert.
    """

    def __init__(self, experts: Sequence[nn.Module]) -> None:
        super().__init__()
        self.experts = nn.ModuleList(experts)

    def forward(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            gate = (weights * (index == e)).sum(-1).to(x.dtype)
            rows = torch.nonzero(gate).squeeze(-1)
            y = expert(x.index_select(0, rows)) * gate.index_select(0, rows).unsqueeze(-1)
            out = out.index_put((rows,), y, accumulate=True)
        return out


@dataclass(frozen=True, kw_only=True)
class MoeFound:
    """What `find_moe` decided: each block with its expert modules, and why others were not
    taken."""

    blocks: tuple[MoeBlock, ...] = ()
    experts: Mapping[str, tuple[nn.Module, ...]] = field(default_factory=dict)
    region: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    notes: tuple[str, ...] = ()


def probe(gm: fx.GraphModule, names: set[str]):
    """A callable that runs only what ``gm`` needs to compute the nodes named ``names`` and
    returns their values by name: ``gm``'s graph with those nodes as its outputs, generated
    code rather than an interpreter (a trace runs it hundreds of times)."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    graph.graph_copy(gm.graph, env)
    kept = [n.name for n in gm.graph.nodes if n.name in names]
    graph.output(tuple(env[n] for n in gm.graph.nodes if n.name in names))
    graph.eliminate_dead_code()
    module = fx.GraphModule(gm, graph)

    def run(args: list[torch.Tensor]) -> dict:
        with torch.no_grad():
            return dict(zip(kept, module(*args)))

    return run


def router_of(gm: fx.GraphModule, block: MoeBlock) -> fx.GraphModule | None:
    """``block``'s router as a module of its own: hidden states shaped like ``block.hidden`` in,
    the top-k expert indices out. None when the router reads anything else than the hidden
    states and the model's parameters (the pre-warm predictor feeds it another layer's)."""
    nodes = {n.name: n for n in gm.graph.nodes}
    hidden, index = nodes[block.hidden], nodes[block.index]
    dag = _dag(gm)
    keep = (nx.ancestors(dag, index) & nx.descendants(dag, hidden)) | {index}
    before = nx.ancestors(dag, hidden)
    stack = [a for n in keep for a in n.all_input_nodes if a not in keep and a is not hidden]
    while stack:  # what the router reads besides the hidden states: constants only
        a = stack.pop()
        if a in keep:
            continue
        if a.op == "placeholder" or a in before:
            return None
        keep.add(a)
        stack.extend(a.all_input_nodes)
    graph = fx.Graph()
    env = {hidden: graph.placeholder("hidden")}
    for n in gm.graph.nodes:
        if n in keep:
            env[n] = graph.node_copy(n, lambda a: env[a])
    graph.output(env[index])
    return fx.GraphModule(gm, graph)


def find_moe(gm: fx.GraphModule, inputs: Mapping[str, np.ndarray]) -> MoeFound:
    """Find the mixture-of-experts blocks of ``gm`` and build their experts (decide only).

    Args:
        gm: the captured graph.
        inputs: the example inputs, in placeholder order: each block is checked on them.
    """
    topks = [n for n in gm.graph.nodes if n.op == "call_function" and op_name(n) == "topk"]
    if not topks:
        return MoeFound()
    dag = _dag(gm)
    candidates, notes = [], []
    for t in topks:
        found = _candidate(gm, dag, t)
        if isinstance(found, str):
            notes.append(found)
        elif found is not None:  # None: a top-k that is no router (beam search, say)
            candidates.append(found)
    if not candidates:
        return MoeFound(notes=tuple(notes))
    wanted = {
        n.name for c in candidates for n in (c["hidden"], c["index"], c["weights"], c["output"])
    }
    args = [torch.from_numpy(np.ascontiguousarray(v)) for v in inputs.values()]
    if any(t.is_meta for t in gm.state_dict().values()):  # no weights: shapes alone, inputs too
        args = [a.to("meta") for a in args]
    values = probe(gm, wanted)(args)
    blocks, experts, region = [], {}, {}
    if any(v.is_meta for v in values.values() if isinstance(v, torch.Tensor)):
        notes.append(
            "the model has no weights: its experts were recognised by their shapes alone, and "
            "their sparse translation is assumed exact (compile checks both on the weights)"
        )
    for c in candidates:
        made = _experts(gm, c, values)
        if isinstance(made, str):
            notes.append(made)
            continue
        block, modules = made
        blocks.append(block)
        experts[block.name] = modules
        region[block.name] = tuple(n.name for n in c["region"])
    return MoeFound(blocks=tuple(blocks), experts=experts, region=region, notes=tuple(notes))


def apply_moe(gm: fx.GraphModule, found: MoeFound) -> tuple[MoeBlock, ...]:
    """Replace each found block's nodes in ``gm`` by the dense translation of its experts.

    Returns the blocks with ``output`` naming the new output node.
    """
    applied = []
    for block in found.blocks:
        output = inline_dense(gm, block, found.experts[block.name], found.region[block.name])
        applied.append(replace(block, output=output))
    if applied:
        gm.recompile()
    return tuple(applied)


# --- deciding -----------------------------------------------------------------------------------


def _dag(gm: fx.GraphModule) -> nx.DiGraph:
    g = nx.DiGraph()
    g.add_nodes_from(gm.graph.nodes)
    g.add_edges_from((a, n) for n in gm.graph.nodes for a in n.all_input_nodes)
    return g


def _shape(n: fx.Node) -> tuple[int, ...] | None:
    val = n.meta.get("val")
    return tuple(int(d) for d in val.shape) if isinstance(val, torch.Tensor) else None


def _numel(n: fx.Node) -> int:
    s = _shape(n)
    return int(np.prod(s)) if s is not None else -1


def _getitem(node: fx.Node, i: int) -> fx.Node | None:
    return next((u for u in node.users if op_name(u) == "getitem" and u.args[1] == i), None)


def _owner(n: fx.Node) -> str:
    paths = module_paths(n)
    return paths[-1] if paths else ""


def _router(topk: fx.Node) -> tuple[fx.Node, fx.Node, str] | None:
    """(gate node, its hidden-state input, routing) walking back from the top-k's input; None
    when no linear map under a softmax or sigmoid feeds it (or a linear map feeds it straight,
    and a softmax or sigmoid of the top-k values makes the weights)."""
    node, routing = topk.args[0], ""
    for _ in range(12):
        if not isinstance(node, fx.Node) or node.op != "call_function":
            break
        name = op_name(node)
        if name in _ROUTING:
            routing = routing or _ROUTING[name]
        elif name in _GATES:
            if not routing:  # the routing may come after the top-k, on its values (GraniteMoE)
                after = _getitem(topk, 0)
                routing = next(
                    (
                        _ROUTING[op_name(u)]
                        for u in (after.users if after else ())
                        if op_name(u) in _ROUTING
                    ),
                    "",
                )
            if not routing:
                return None
            x = node.args[0] if name != "addmm" else node.args[1]
            return node, x, routing
        elif name not in _PASS:
            break
        tensors = [a for a in node.all_input_nodes if _shape(a) is not None and a.op != "get_attr"]
        if len(tensors) != 1:
            break
        node = tensors[0]
    return None


def _candidate(gm: fx.GraphModule, dag: nx.DiGraph, topk: fx.Node) -> dict | str | None:
    """The parts of the block around ``topk`` (graph only; nothing is run), why a router's
    experts are not recognised, or None for a top-k that is no router."""
    routed = _router(topk)
    if routed is None:
        return None
    gate, x, routing = routed
    index, values = _getitem(topk, 1), _getitem(topk, 0)
    xs, ks = _shape(x), _shape(topk.args[0])
    if (
        index is None
        or values is None
        or xs is None
        or ks is None
        or not isinstance(topk.args[1], int)
    ):
        return f"top-k at {topk.name} is not used as a router's indices and weights"
    hidden, experts, k = xs[-1], ks[-1], int(topk.args[1])
    tokens = int(np.prod(xs)) // hidden
    # the hidden states: the gate's input and the views of it the experts may read instead
    chain, node = {x}, x
    while node.op == "call_function" and op_name(node) in _VIEWS:
        node = node.args[0]
        chain.add(node)
    # the weights: the top-k values and what is computed from them alone (a normalisation)
    only = {values}
    for n in nx.topological_sort(dag.subgraph(nx.descendants(dag, values))):
        ins = [a for a in n.all_input_nodes if a.op != "get_attr" and _shape(a) is not None]
        if ins and all(a in only for a in ins) and _shape(n) is not None:
            only.add(n)
    output = _join(dag, index, tokens * hidden)
    if output is None:
        return f"the experts of the router at {topk.name} do not sum into one tensor"
    before = nx.ancestors(dag, output)
    frontier = [
        n
        for n in only
        if n in before and any(u not in only and (u in before or u is output) for u in n.users)
    ]
    if len(frontier) != 1 or _numel(frontier[0]) != tokens * k:
        return f"the top-k weights of the router at {topk.name} are not one tensor"
    weights = frontier[0]
    upstream = {index, weights} | nx.ancestors(dag, index) | nx.ancestors(dag, weights) | only
    top = max(chain, key=lambda c: len(nx.descendants(dag, c)))
    reach = nx.descendants(dag, index) | nx.descendants(dag, weights) | nx.descendants(dag, top)
    region = {n for n in (before | {output}) if n in reach and n not in upstream and n not in chain}
    region |= _constants(gm, region)
    region |= {
        n
        for n in gm.graph.nodes
        if n.op == "call_function"
        and not n.users
        and n.all_input_nodes
        and all(a in region for a in n.all_input_nodes)
    }
    outside = {a for n in region for a in n.all_input_nodes if a not in region}
    extra = [a for a in outside if a not in chain and a not in (index, weights)]
    if extra:
        return (
            f"the experts of the router at {topk.name} read {extra[0].name}, which is "
            "neither the hidden states nor the top-k indices and weights"
        )
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    used = sorted((c for c in chain if c in outside), key=order.__getitem__) or [x]
    return {
        "topk": topk,
        "gate": gate,
        "hidden": x,
        "reads": used,
        "index": index,
        "weights": weights,
        "output": output,
        "routing": routing,
        "top_k": k,
        "chain": chain,
        "num_experts": experts,
        "hidden_size": hidden,
        "tokens": tokens,
        "region": sorted(region, key=order.__getitem__),
    }


def _join(dag: nx.DiGraph, index: fx.Node, size: int) -> fx.Node | None:
    """The first node every path from ``index`` to the outputs passes through that holds
    ``size`` floating-point values: the experts' weighted sum."""
    out = next(n for n in dag.nodes if n.op == "output")
    live = nx.ancestors(dag, out) | {out}  # nodes without effect on the outputs (asserts) aside
    rev = dag.subgraph(live).reverse(copy=True)
    ipdom = nx.immediate_dominators(rev, out)
    node = index
    while node in ipdom and ipdom[node] is not node and ipdom[node] is not out:
        node = ipdom[node]
        val = node.meta.get("val") if isinstance(node, fx.Node) else None
        if isinstance(val, torch.Tensor) and val.is_floating_point() and val.numel() == size:
            return node
    return None


def _constants(gm: fx.GraphModule, region: set[fx.Node]) -> set[fx.Node]:
    """Nodes outside ``region`` that compute only from parameters and constants and feed only
    it (a transpose of a stacked weight, an arange): they go with it."""
    const: set[fx.Node] = set()
    for n in gm.graph.nodes:
        if n.op == "get_attr" or (
            n.op == "call_function" and all(a in const for a in n.all_input_nodes)
        ):
            const.add(n)
    extra: set[fx.Node] = set()
    for n in reversed(list(gm.graph.nodes)):
        if (
            n in const
            and n not in region
            and n.users
            and all(u in region or u in extra for u in n.users)
        ):
            extra.add(n)
    return extra


def _experts(
    gm: fx.GraphModule, c: dict, values: dict
) -> tuple[MoeBlock, tuple[nn.Module, ...]] | str:
    """Build the experts of candidate ``c`` and check their dense translation on the example."""
    region, where = c["region"], c["topk"].name
    acts = sorted({op_name(n) for n in region if n.op == "call_function"} & set(ACTIVATIONS))
    modules, form, name = module_experts(gm, region, c["num_experts"]), "modules", ""
    if isinstance(modules, tuple):
        modules, name = modules
    else:
        if len(acts) != 1:
            return (
                f"the experts of the router at {where} were not recognised (no expert "
                f"modules, and activations {acts or 'none'}); they stay as they are"
            )
        form = "stacked"
        modules = stacked_experts(gm, region, c["num_experts"], c["hidden_size"], acts[0])
        if isinstance(modules, str):
            return (
                f"the experts of the router at {where} were not recognised ({modules}); "
                "they stay as they are"
            )
    if not name:
        name = _owner(next(n for n in region if n.op == "call_function" and _owner(n)))
    x = values[c["hidden"].name].reshape(c["tokens"], c["hidden_size"])
    index = values[c["index"].name].reshape(c["tokens"], c["top_k"])
    weights = values[c["weights"].name].reshape(c["tokens"], c["top_k"])
    want = values[c["output"].name].reshape(c["tokens"], c["hidden_size"])
    for candidate in modules if isinstance(modules, list) else [modules]:
        try:
            with torch.no_grad():
                got = dense_translation(candidate, x, index, weights)
        except Exception as exc:  # noqa: BLE001 - an expert that does not run is not recognised
            log.info("experts of %s: %s", where, exc)
            continue
        if want.is_meta:  # a model without weights: shapes are all there is to check
            if got.shape != want.shape:
                continue
            sparse = True  # exact by construction where it runs (SparseExperts); find_moe notes it
        else:
            scale = max(1.0, float(want.abs().max()))
            if got.shape != want.shape or float((got - want).abs().max()) > 1e-5 * scale:
                continue
            sparse = _sparse_exact(candidate, x, index, weights, want, scale, where)
        params = sum(p.numel() for p in _tensors(candidate[0]))
        block = MoeBlock(
            name=name,
            router=_owner(c["gate"]),
            num_experts=c["num_experts"],
            top_k=c["top_k"],
            hidden_size=c["hidden_size"],
            tokens=c["tokens"],
            form=form,
            routing=c["routing"],
            activation=acts[0] if acts else "",
            params_per_expert=params,
            shared=_shared(gm, c),
            hidden=c["reads"][0].name,
            index=c["index"].name,
            weights=c["weights"].name,
            output=c["output"].name,
            sparse=sparse,
        )
        return block, tuple(candidate)
    return (
        f"the experts of the router at {where} were recognised as {form}, but their dense "
        "translation does not reproduce the block's output; they stay as they are"
    )


def _sparse_exact(
    experts: Sequence[nn.Module],
    x: torch.Tensor,
    index: torch.Tensor,
    weights: torch.Tensor,
    want: torch.Tensor,
    scale: float,
    where: str,
) -> bool:
    """Whether `SparseExperts` reproduces the block's output ``want`` as the dense translation
    did (within 1e-5 of its scale)."""
    try:
        with torch.no_grad():
            got = SparseExperts(experts)(x, index, weights)
    except Exception as exc:  # noqa: BLE001 - an expert that does not run on a subset stays dense
        log.info("sparse experts of %s: %s", where, exc)
        return False
    return got.shape == want.shape and float((got - want).abs().max()) <= 1e-5 * scale


def _tensors(module: nn.Module) -> list[torch.Tensor]:
    return [*module.parameters(), *module.buffers()]


def _shared(gm: fx.GraphModule, c: dict) -> str:
    """A shared expert: a module whose path says so, reading the block's hidden states."""
    for n in gm.graph.nodes:
        paths = [p for p in module_paths(n) if re.search(r"shared_experts?$", p)]
        if paths and any(a in c["chain"] for a in n.all_input_nodes):
            return paths[-1]
    return ""
