"""The platform simulator: a bundle's functions as instance pools under traffic, billed as the
platforms bill (``mopar simulate``), and the bill of what ``mopar run`` served by the same rules.

Read in this order: `traffic` (arrival times), `model` (the functions and the platforms' pool
rules), `engine` (the SimPy model), `result` (figures and bill), `bundle` (all of it for one
bundle), `served` (the bill of a local run). Built on SimPy's processes and resources; no event
loop of its own.
"""

from __future__ import annotations

from mopar.sim.bundle import simulate_bundle
from mopar.sim.engine import SimConfig, simulate
from mopar.sim.model import PoolRules, SimFunction, functions_of, pool_rules
from mopar.sim.result import SimResult
from mopar.sim.served import RunBill, bill_run
from mopar.sim.traffic import SHAPES, Traffic, arrivals, read_trace

__all__ = [
    "SHAPES",
    "PoolRules",
    "RunBill",
    "SimConfig",
    "SimFunction",
    "SimResult",
    "Traffic",
    "arrivals",
    "bill_run",
    "functions_of",
    "pool_rules",
    "read_trace",
    "simulate",
    "simulate_bundle",
]
