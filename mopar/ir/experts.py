"""The experts of a mixture-of-experts block as modules of their own, and their dense translation.

Each expert becomes an ``nn.Module`` mapping ``(n, H)`` tokens to ``(n, H)``, holding exactly its
own weights, written in ATen operators so that it inlines into the captured graph and exports to
ONNX for any token count:

- ``modules`` form: the nodes of one expert module (``experts.3``) copied out of the graph
  (`module_experts`);
- ``stacked`` form: a gated MLP over one row of each stacked projection (`stacked_experts`),
  in each layout and gate/up split transformers' ``*Experts`` use; `mopar.ir.moe` keeps the
  first candidate whose dense translation reproduces the block.

`dense_translation` is the block's output as a sum over every expert, weighted by each token's
top-k weight where the expert was chosen and 0 elsewhere: exact, and static in shape.
`inline_dense` writes that translation into the captured graph in place of the block's nodes.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch
from torch import fx, nn

from mopar.ir.flops import op_name
from mopar.ir.graph import module_paths, normal_path
from mopar.ir.subgraph import param_tensor

__all__ = [
    "ACTIVATIONS",
    "GatedExpert",
    "module_experts",
    "stacked_experts",
    "dense_translation",
    "inline_dense",
]

aten = torch.ops.aten

ACTIVATIONS = ("silu", "gelu", "relu", "tanh", "sigmoid")
"""Activation op names an expert may use (as `mopar.ir.flops.op_name` names them)."""

MOE_TYPE = "mopar.MoeExperts"
"""The module type the dense translation's nodes carry when the experts had no module of their
own (an ``nn.ModuleList`` is never called, so the graph names none)."""


class GatedExpert(nn.Module):
    """One expert of a stacked form: ``down(act(gate(x)) * up(x))``.

    ``gate_up`` is ``(2I, H)``: the gate rows then the up rows (``split="chunk"``), or the two
    interleaved (``split="interleave"``); ``down`` is ``(H, I)``.
    """

    def __init__(
        self,
        gate_up: torch.Tensor,
        down: torch.Tensor,
        act: fx.Node,
        *,
        split: str,
        gate_up_bias: torch.Tensor | None = None,
        down_bias: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.gate_up, self.down = _frozen(gate_up.contiguous()), _frozen(down.contiguous())
        self.gate_up_bias, self.down_bias = _frozen(gate_up_bias), _frozen(down_bias)
        self.act_target = act.target
        self.act_extra = tuple(act.args[1:])
        self.act_kwargs = dict(act.kwargs)
        self.split = split
        self.rows = int(gate_up.shape[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = aten.linear.default(x, self.gate_up, self.gate_up_bias)
        if self.split == "chunk":
            half = self.rows // 2
            gate = aten.slice.Tensor(h, -1, 0, half)
            up = aten.slice.Tensor(h, -1, half, 2 * half)
        else:
            gate = aten.slice.Tensor(h, -1, 0, self.rows, 2)
            up = aten.slice.Tensor(h, -1, 1, self.rows, 2)
        act = self.act_target(gate, *self.act_extra, **self.act_kwargs)
        return aten.linear.default(aten.mul.Tensor(act, up), self.down, self.down_bias)


def _frozen(t: torch.Tensor | None) -> nn.Parameter | None:
    """A copy of ``t`` as a parameter that needs no gradient (None stays None)."""
    return None if t is None else nn.Parameter(t.detach().clone(), requires_grad=False)


def module_experts(
    gm: fx.GraphModule, region: Sequence[fx.Node], num_experts: int
) -> tuple[list[tuple[nn.Module, ...]], str] | None:
    """The experts of a ``modules`` form (``<list>.0`` .. ``<list>.E-1``), each its nodes copied
    into a module of its own; None when the region holds no such sibling modules."""
    groups: dict[str, set[int]] = {}
    for n in region:
        for p in module_paths(n):
            m = re.fullmatch(r"(.+)\.(\d+)", p)
            if m:
                groups.setdefault(m.group(1), set()).add(int(m.group(2)))
    prefix = next((p for p, ids in groups.items() if ids == set(range(num_experts))), None)
    if prefix is None:
        return None
    experts = []
    for e in range(num_experts):
        nodes = [n for n in region if f"{prefix}.{e}" in module_paths(n)]
        module = _copy_subgraph(gm, nodes)
        if module is None:
            return None
        experts.append(module)
    return [tuple(experts)], prefix


def _copy_subgraph(gm: fx.GraphModule, nodes: list[fx.Node]) -> fx.GraphModule | None:
    """``nodes`` as a module of one input (the one tensor they read from outside) and one output."""
    inside = set(nodes)
    reads = {a for n in nodes for a in n.all_input_nodes if a not in inside and a.op != "get_attr"}
    leaving = [n for n in nodes if any(u not in inside for u in n.users)]
    if len(reads) != 1 or len(leaving) != 1:
        return None
    root, graph = nn.Module(), fx.Graph()
    env: dict[fx.Node, fx.Node] = {next(iter(reads)): graph.placeholder("x")}

    def lookup(a: fx.Node) -> fx.Node:
        if a not in env:  # a parameter or buffer
            name = f"w{len(env)}"
            root.register_buffer(name, param_tensor(gm, str(a.target)).detach().clone())
            env[a] = graph.get_attr(name)
        return env[a]

    for n in nodes:
        env[n] = graph.node_copy(n, lookup)
    graph.output(env[leaving[0]])
    return fx.GraphModule(root, graph)


def stacked_experts(
    gm: fx.GraphModule, region: Sequence[fx.Node], num_experts: int, hidden: int, activation: str
) -> list[tuple[nn.Module, ...]] | str:
    """Candidate experts of a ``stacked`` form, one tuple per layout worth trying; or why
    there are none."""
    stacked = {}
    for n in region:
        if n.op == "get_attr":
            t = param_tensor(gm, str(n.target))
            if isinstance(t, torch.Tensor) and t.dim() in (2, 3) and t.shape[0] == num_experts:
                stacked[str(n.target)] = t
    act = next(n for n in region if n.op == "call_function" and op_name(n) == activation)

    def by_name(*keys: str) -> list[str]:
        return [
            k
            for k, t in stacked.items()
            if t.dim() == 3 and all(s in k.rsplit(".", 1)[-1].lower() for s in keys)
        ]

    gate_up, down = by_name("gate", "up"), by_name("down")
    if not gate_up:
        gate, up = by_name("gate"), by_name("up")
        if len(gate) == 1 and len(up) == 1:
            gu = torch.cat([_rows(stacked[gate[0]], hidden), _rows(stacked[up[0]], hidden)], dim=1)
            gate_up = [gu]
    else:
        gate_up = [stacked[gate_up[0]]]
    if len(gate_up) != 1 or len(down) != 1:
        return f"stacked weights {sorted(stacked)} are not a gate/up and a down projection"
    gu = gate_up[0]
    dn = stacked[down[0]]
    bias = {k: t for k, t in stacked.items() if t.dim() == 2}
    gub = next((t for k, t in bias.items() if "gate_up" in k), None)
    db = next((t for k, t in bias.items() if "down" in k), None)
    out = []
    for gu_rows in _layouts(gu, hidden):
        for dn_rows in _layouts(dn, hidden, out_dim=True):
            for split in ("chunk", "interleave"):
                out.append(
                    tuple(
                        GatedExpert(
                            gu_rows[e],
                            dn_rows[e],
                            act,
                            split=split,
                            gate_up_bias=None if gub is None else gub[e],
                            down_bias=None if db is None else db[e],
                        )
                        for e in range(num_experts)
                    )
                )
    return out


def _rows(t: torch.Tensor, hidden: int) -> torch.Tensor:
    """A stacked input projection as ``(E, out, H)``."""
    return t if t.shape[-1] == hidden else t.transpose(-2, -1)


def _layouts(t: torch.Tensor, hidden: int, *, out_dim: bool = False) -> list[torch.Tensor]:
    """The ``(E, out, in)`` readings of a stacked projection whose input (or, for the down
    projection, output) is ``hidden`` wide; both when either dimension fits."""
    fits = [t] if (t.shape[-2] if out_dim else t.shape[-1]) == hidden else []
    flipped = t.transpose(-2, -1)
    if (flipped.shape[-2] if out_dim else flipped.shape[-1]) == hidden:
        fits.append(flipped)
    return fits


def dense_translation(
    experts: Sequence[nn.Module], x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """Every expert on every token of ``x`` (T, H), each weighted by the token's top-k weight
    where ``index`` (T, k) chose it and by 0 elsewhere, summed."""
    out = None
    for e, expert in enumerate(experts):
        w = (weights * (index == e)).sum(-1, keepdim=True)
        term = expert(x) * w
        out = term if out is None else out + term
    return out


def inline_dense(
    gm: fx.GraphModule, block, experts: Sequence[nn.Module], region: Sequence[str]
) -> str:
    """Write the dense translation of ``block`` into ``gm`` in place of its ``region``; return
    the name of the node that now holds the block's output."""
    from torch._guards import detect_fake_mode

    nodes = {n.name: n for n in gm.graph.nodes}
    x, index, weights, old = (
        nodes[name] for name in (block.hidden, block.index, block.weights, block.output)
    )
    fake = detect_fake_mode(
        [n.meta["val"] for n in gm.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)]
    )
    stack = _stack(nodes, region, old, block.name)
    graph = gm.graph
    made: list[fx.Node] = []

    def call(target, *args, **kwargs) -> fx.Node:
        n = graph.call_function(target, args, kwargs)
        made.append(n)
        return n

    h, k = block.hidden_size, block.top_k
    safe = re.sub(r"\W", "_", block.name)
    with graph.inserting_before(old):
        # tokens as -1: a model with a dynamic sequence (a generation step) takes any number
        # of tokens (`mopar.ir.dynamic`); the dimensions before the sequence stay as traced
        xs = call(aten.reshape.default, x, [-1, h])
        ix = call(aten.reshape.default, index, [-1, k])
        ws = call(aten.reshape.default, weights, [-1, k])
        total = None
        for e, expert in enumerate(experts):
            y = _inline(gm, expert, xs, f"moe_{safe}_e{e}", made)
            chosen = call(aten.eq.Scalar, ix, e)
            w = call(aten.sum.dim_IntList, call(aten.mul.Tensor, ws, chosen), [-1], True)
            term = call(aten.mul.Tensor, y, w)
            total = term if total is None else call(aten.add.Tensor, total, term)
        shape = [int(d) for d in old.meta["val"].shape[:-2]]  # leading: fixed (batch 1)
        out = call(aten.reshape.default, total, [*shape, -1, h])
    for n in made:
        n.meta["nn_module_stack"] = dict(stack)
        if n.op == "get_attr":
            n.meta["val"] = fake.from_tensor(param_tensor(gm, str(n.target)), static_shapes=True)
        else:
            args = fx.node.map_arg((n.args, n.kwargs), lambda a: a.meta["val"])
            with fake:
                n.meta["val"] = n.target(*args[0], **args[1])
    old.replace_all_uses_with(out)
    targets = []
    for name in reversed(region):
        n = nodes[name]
        if not n.users:
            if n.op == "get_attr":
                targets.append(str(n.target))
            graph.erase_node(n)
    used = {str(n.target) for n in graph.nodes if n.op == "get_attr"}
    for target in targets:
        if target not in used:
            owner, _, attr = target.rpartition(".")
            delattr(param_tensor(gm, owner) if owner else gm, attr)
    return out.name


def _stack(nodes: dict[str, fx.Node], region: Sequence[str], old: fx.Node, name: str) -> dict:
    """The module stack of the translation's nodes: the experts' own entry when the graph has
    one (so that glue of the same call joins the layer), else one made for them."""
    for n in (nodes[r] for r in region):
        stack = n.meta.get("nn_module_stack") or {}
        for i, key in enumerate(stack):
            if normal_path(stack[key][0]) == name:
                return dict(list(stack.items())[: i + 1])
    base = {
        k: v
        for k, v in (old.meta.get("nn_module_stack") or {}).items()
        if name.startswith(normal_path(v[0]) + ".") or not normal_path(v[0])
    }
    return {**base, f"moe:{name}": (name, MOE_TYPE)}


def _inline(
    gm: fx.GraphModule, expert: nn.Module, x: fx.Node, prefix: str, made: list[fx.Node]
) -> fx.Node:
    """Copy ``expert``'s graph into ``gm`` reading ``x``; its weights become ``gm``'s
    parameters named ``prefix_*``."""
    sub = expert if isinstance(expert, fx.GraphModule) else fx.symbolic_trace(expert)
    env: dict[fx.Node, fx.Node] = {}
    result = None
    for n in sub.graph.nodes:
        if n.op == "placeholder":
            env[n] = x
        elif n.op == "get_attr":
            name = prefix + "_" + re.sub(r"\W", "_", str(n.target))
            tensor = param_tensor(sub, str(n.target))
            gm.register_parameter(name, nn.Parameter(tensor.detach(), requires_grad=False))
            env[n] = gm.graph.get_attr(name)
            made.append(env[n])
        elif n.op == "output":
            result = env[n.args[0]]
        else:
            env[n] = gm.graph.node_copy(n, lambda a: env[a])
            made.append(env[n])
    return result
