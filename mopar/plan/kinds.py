"""The kinds of function a plan may hold, each defined here once.

A kind says how a function takes part in a request, and nothing else in mopar tests a kind by
name: walks ask the `Kind` (`mopar.plan.graph`), the rewrite builds units per kind
(`mopar.rewrite.units`), the runtime reads the two facts a kind decides from ``function.json``
(``answers``: does it answer its caller; ``calls``: what it invokes).

*On the path* functions receive the request (or the previous path function's frame), run, and
hand on to the next one on the path. *Called* functions are invoked by the function that
consumes their outputs, with the tensors they read, and answer it; their caller waits, so its
billed time includes theirs. Sub-slices of a parameter-sharded slice are called by their join;
expert functions of a mixture-of-experts layer are called by the layer's dispatch function, only
when tokens reach them (an edge taken with a probability).

To add a kind: add a `Kind` to `KINDS`, build its units in `mopar.rewrite.units`, price it where
a planner pass makes it (`mopar.planner.horizontal` for shards and joins), and give it a label
for `mopar plan`.
"""

from __future__ import annotations

from dataclasses import dataclass

from mopar.errors import BundleError

__all__ = ["Kind", "KINDS", "kind_of"]


@dataclass(frozen=True, kw_only=True)
class Kind:
    """What a kind of function is.

    Attributes:
        name: the kind's name in ``plan.json``.
        called: invoked by the function consuming its outputs (it answers that caller), rather
            than reached along the request path.
        fed_by_caller: its inputs are made by its caller for each call (the tokens a dispatch
            sends an expert function), not read from the functions before it.
        routes: it routes a mixture-of-experts layer's tokens to their experts: the ones it
            holds itself (its hot experts) and the expert functions it calls.
        label: how tables and graphs name one: ``{name}``, ``{group}``, ``{k}`` (the index of a
            called function among its caller's), ``{parallel}`` are filled in.
        colour: its fill in ``mopar plan --graph``.
    """

    name: str
    called: bool
    label: str
    colour: str
    fed_by_caller: bool = False
    routes: bool = False


KINDS: dict[str, Kind] = {
    k.name: k
    for k in (
        Kind(name="slice", called=False, label="{name}", colour="#dbe9f6"),
        Kind(
            name="shard",
            called=True,
            label="sub-slice {k} of {parallel} of {group}",
            colour="#fde9c9",
        ),
        Kind(
            name="join",
            called=False,
            label="{name} (joins {parallel} sub-slices)",
            colour="#e3f1dc",
        ),
        Kind(
            name="dispatch",
            called=False,
            routes=True,
            label="{name} (dispatches to experts)",
            colour="#f3e3f6",
        ),
        Kind(
            name="expert",
            called=True,
            fed_by_caller=True,
            label="experts {experts} of {group}",
            colour="#f6d9e8",
        ),
    )
}


def kind_of(name: str) -> Kind:
    """The `Kind` named ``name``.

    Raises:
        BundleError: no such kind (a plan from a newer mopar, or edited by hand).
    """
    try:
        return KINDS[name]
    except KeyError:
        raise BundleError(
            f"unknown function kind {name!r}, expected one of {sorted(KINDS)}; "
            "recompile the bundle with this mopar"
        ) from None
