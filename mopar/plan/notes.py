"""A plan's notes: records, each of a kind with its values, rendered to a sentence at the edge.

A note is a frozen record (`Note`): its ``kind``, its values (the record's fields) and the
sentence rendered from them, ``str(note)``, which `mopar plan` and `mopar compile` print after
``note:`` and ``plan.json`` keeps (a list of sentences, as before notes were records: the
bytes are the same). Code that needs a fact of a note reads the record (its type and fields),
never the sentence: the planner replaces a plan's `ChainMode`, `BillIncludes` and `Traffic`
notes when it prices the plan again, and the latency check its `CheckAhead` and `Replanned`
notes when it records what it measured.

``plan.json`` keeps the sentences alone, so a plan read back has each note as a `Remark` (its
sentence). Two notes are equal when they say the same, whatever their kind: a plan survives
``plan.json`` whole, and what replaces notes by kind does so on the plan it is making, never
on one read back. Where a plan's making goes on in another process (compile's measure stage,
`mopar.pipeline.finish`), its notes go as records (`note_record`, read back by `note_of`).

Kinds: `Remark` (a sentence and nothing a caller reads from it: what was assumed, the bound,
what simplification merged, ...), `ChainMode`, `BillIncludes`, `Traffic` (made by
`mopar.planner.strategies`), `CheckAhead`, `Replanned` (by `mopar.pipeline.latency`), `GenerationCost` (by
`mopar.bill.bill_generation`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

__all__ = [
    "Note",
    "Remark",
    "ModeBest",
    "ChainMode",
    "BillIncludes",
    "Traffic",
    "CheckAhead",
    "Replanned",
    "GenerationCost",
    "as_notes",
    "note_record",
    "note_of",
]


@dataclass(frozen=True, eq=False)
class Note:
    """A plan note: a kind (``kind``) with its values (the fields of the kind's record);
    ``str(note)`` is its sentence. Equal, and hashed alike, to any note that says the same."""

    kind: ClassVar[str] = "note"

    def __str__(self) -> str:
        raise NotImplementedError(f"{type(self).__name__} renders no sentence")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Note) and str(self) == str(other)

    def __hash__(self) -> int:
        return hash(str(self))


@dataclass(frozen=True, eq=False)
class Remark(Note):
    """A note that is its sentence: nothing reads a fact from it (and every note of a plan
    read back from ``plan.json``).

    Attributes:
        text: the sentence.
    """

    kind: ClassVar[str] = "remark"
    text: str

    def __str__(self) -> str:
        return self.text


def as_notes(*items: Note | str) -> tuple[Note, ...]:
    """``items`` as a plan's notes: a note as it is, a sentence as a `Remark`."""
    return tuple(n if isinstance(n, Note) else Remark(n) for n in items)


@dataclass(frozen=True)
class ModeBest:
    """One chain mode's best plan, as `ChainMode` compares them.

    Attributes:
        chain: the chain mode (`mopar.bill.CHAINS`).
        cost_per_1m_usd: its best plan's predicted cost of a million requests, USD.
        within_bound: whether that plan's predicted latency is within the bound.
    """

    chain: str
    cost_per_1m_usd: float
    within_bound: bool


@dataclass(frozen=True, eq=False)
class ChainMode(Note):
    """Which chain mode the plan takes, and why: each mode's best plan.

    Attributes:
        chain: the plan's chain mode.
        best: each mode's best plan, cheapest first.
        skipped: the modes left out, each with why.
        needs: what deploying the plan needs beyond a stock install, in words (its functions
            co-located: the platform's ``colocation``); empty: nothing.
    """

    kind: ClassVar[str] = "chain_mode"
    chain: str
    best: tuple[ModeBest, ...] = ()
    skipped: tuple[str, ...] = ()
    needs: str = ""

    def __str__(self) -> str:
        others = ", ".join(
            f"{b.chain} ${b.cost_per_1m_usd:.4g}" + ("" if b.within_bound else " (over the bound)")
            for b in self.best
        )
        skipped = f"; left out: {'; '.join(self.skipped)}" if self.skipped else ""
        needs = f"; its functions are co-located (--colocate), which needs {self.needs}"
        return (
            f"chain mode {self.chain}: the cheapest within the bound (per 1M requests, each "
            f"mode's best plan: {others or 'none within the bound'}){skipped}"
            f"{needs if self.needs else ''}"
        )


@dataclass(frozen=True, eq=False)
class BillIncludes(Note):
    """What the plan's bill includes.

    Attributes:
        cost_per_1m_usd: the plan's predicted cost of a million requests, USD.
        includes: what it is made of, in words (`mopar.bill.Bill.includes`).
        rate_rps: the traffic's mean rate, requests per second (None: no month is stated).
    """

    kind: ClassVar[str] = "bill"
    cost_per_1m_usd: float
    includes: str
    rate_rps: float | None = None

    def __str__(self) -> str:
        month = ""
        if self.rate_rps:  # 30 days, as `mopar.bill.MONTH_S`
            usd = self.cost_per_1m_usd / 1e6 * self.rate_rps * 30 * 86400
            each = "request" if self.rate_rps == 1 else "requests"
            month = f" (${usd:,.4g} a month at {self.rate_rps:g} {each}/s)"
        return (
            f"the bill, ${self.cost_per_1m_usd:.4g} per 1M requests{month}, includes "
            f"{self.includes}"
        )


@dataclass(frozen=True, eq=False)
class Traffic(Note):
    """The traffic the plan was priced for.

    Attributes:
        traffic: the traffic, in words (`mopar.traffic.Traffic.describe`).
    """

    kind: ClassVar[str] = "traffic"
    traffic: str

    def __str__(self) -> str:
        return f"traffic: {self.traffic}"


@dataclass(frozen=True, eq=False)
class CheckAhead(Note):
    """That compile measures the plan before writing it (`mopar plan` says so of a plan that
    compile's latency check will serve), and may write another.

    Attributes:
        max_slowdown: the bound on the plan's latency over the unsplit model's, a factor.
        confidence: the confidence of the measurement's interval, 0..1.
    """

    kind: ClassVar[str] = "check_ahead"
    max_slowdown: float
    confidence: float

    def __str__(self) -> str:
        return (
            "compile measures this plan before writing it: it serves the plan beside the "
            "unsplit model, requests interleaved, and plans again from the measured times only "
            f"where the plan is slower than --max-slowdown {self.max_slowdown:g} beyond the "
            f"measurement's spread (its whole {self.confidence:.0%} interval above the bound); "
            "the bundle may then hold another plan (--no-check-latency writes this one)"
        )


@dataclass(frozen=True, eq=False)
class Replanned(Note):
    """A round of compile's latency check that planned again: the plan served was slower than
    the bound beyond the noise.

    Attributes:
        functions: how many functions the plan served had.
        served: what was measured, in words (`mopar.pipeline.latency.Slowdown.describe`).
        max_slowdown: the bound, a factor over the unsplit model's latency.
        scale: what every layer's predicted time was multiplied by for the next round.
        extra_ms: the time added per cut for the next round, ms.
    """

    kind: ClassVar[str] = "replanned"
    functions: int
    served: str
    max_slowdown: float
    scale: float
    extra_ms: float

    def __str__(self) -> str:
        return (
            f"measured: a plan of {self.functions} functions served at {self.served}: over "
            f"--max-slowdown {self.max_slowdown:g} beyond the noise; planned again with layer "
            f"times x{self.scale:.2f} and {self.extra_ms:.2f} ms more per cut"
        )


@dataclass(frozen=True, eq=False)
class GenerationCost(Note):
    """A ``--generate`` plan's bill of one whole generation, as its users count it.

    Attributes:
        prompt_tokens: the prompt's tokens.
        new_tokens: the tokens generated.
        generation_ms: how long the main function is busy with it, ms.
        usd: one generation's bill, USD.
        timed: where ``generation_ms`` comes from, in words.
    """

    kind: ClassVar[str] = "generation"
    prompt_tokens: int
    new_tokens: int
    generation_ms: float
    usd: float
    timed: str

    @property
    def usd_per_1k_tokens(self) -> float:
        return self.usd / self.new_tokens * 1e3

    def to_dict(self) -> dict[str, object]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens,
            "generation_ms": round(self.generation_ms, 3),
            "cost_per_1k_tokens_usd": float(f"{self.usd_per_1k_tokens:.6g}"),
            "cost_per_1m_generations_usd": float(f"{self.usd * 1e6:.6g}"),
            "timed": self.timed,
        }

    def __str__(self) -> str:
        return (
            f"a generation of {self.new_tokens} tokens after a prompt of "
            f"{self.prompt_tokens}: ${self.usd_per_1k_tokens:.4g} per 1,000 tokens, "
            f"${self.usd * 1e6:.4g} per 1M generations (the main function busy "
            f"{self.generation_ms:,.0f} ms: {self.timed}; other lengths: "
            "`mopar simulate --new-tokens N`)"
        )


def note_record(note: Note) -> dict[str, Any]:
    """``note`` as a JSON object: its kind and its values (`note_of` reads it back)."""
    return {"kind": note.kind, **asdict(note)}


def note_of(record: Mapping[str, Any]) -> Note:
    """The note `note_record` made ``record`` of."""
    kinds = (Remark, ChainMode, BillIncludes, Traffic, CheckAhead, Replanned, GenerationCost)
    values = {k: v for k, v in record.items() if k != "kind"}
    if record["kind"] == ChainMode.kind:
        values["best"] = tuple(ModeBest(**b) for b in values.get("best", ()))
        values["skipped"] = tuple(values.get("skipped", ()))
    return next(k for k in kinds if k.kind == record["kind"])(**values)
