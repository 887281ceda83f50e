"""The deployment model every phase shares: a plan is a graph of functions (torch-free).

`mopar.plan.graph` holds the data (`Plan`, `Function`, `Edge`), `mopar.plan.kinds` the kinds of
function. The planner makes a `Plan`; the rewrite, the exporter, the emitters and `mopar plan`
walk it; the compiler derives each deployed function's ``function.json`` from it.
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
]
