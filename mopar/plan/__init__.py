"""The deployment model every phase shares: a plan is a graph of functions (torch-free).

`mopar.plan.graph` holds the data (`Plan`, `Function`, `Edge`), `mopar.plan.kinds` the kinds of
function, `mopar.plan.notes` the plan's notes (records, each a kind and its values). The
planner makes a `Plan`; the rewrite, the exporter, the emitters and `mopar plan` walk it; the
compiler derives each deployed function's ``function.json`` from it.
"""

from mopar.plan.graph import (
    PLAN_FORMAT_VERSION,
    PROBABILITY_SOURCES,
    REQUEST,
    RESPONSE,
    STRATEGIES,
    Edge,
    Function,
    Plan,
    data_edges,
)
from mopar.plan.kinds import KINDS, Kind, kind_of
from mopar.plan.notes import Note, Remark

__all__ = [
    "PLAN_FORMAT_VERSION",
    "PROBABILITY_SOURCES",
    "REQUEST",
    "RESPONSE",
    "STRATEGIES",
    "Edge",
    "Function",
    "Plan",
    "data_edges",
    "KINDS",
    "Kind",
    "kind_of",
    "Note",
    "Remark",
]
