"""The decoding loop of a main function: a prompt in, one token at a time out. torch-free.

Read in this order: `GenerateRequest.parse` (a request's JSON, checked against the bundle's
`GenerationSpec`), `empty_cache`, `generate`, then `MainFunction` (a main function's folder
ready to answer requests: what the function server and the Lambda handler hold).

The loop runs where the key-value cache lives: in the main function, for the whole request. Each
step runs the step model (``step``: the main function's own model, and whatever it calls) on
this step's token ids and the cache so far; its logits give the next token, greedily (the
largest logit, the first of equals, as ``torch.argmax``) or sampled at a temperature from a
seeded generator, so that a seed gives the same tokens again. The step's grown cache becomes
the next step's. Generation ends at ``max_new_tokens`` or at an end-of-sequence token, which is
kept, as transformers' ``generate`` keeps it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from mopar.bundle.function import FunctionSpec
from mopar.bundle.generation import GenerationSpec
from mopar.bundle.layout import TOKENIZER_FILE, UNITS_DIR
from mopar.runtime.core import FunctionCore, RequestError
from mopar.runtime.framed import Fork, SliceFunction, call_experts

if TYPE_CHECKING:
    from tokenizers import Tokenizer

__all__ = [
    "GenerateRequest",
    "Generated",
    "empty_cache",
    "generate",
    "GenerateRequestError",
    "MainFunction",
    "Foresight",
]

DEFAULT_NEW_TOKENS = 16
"""Tokens a request that names no ``max_new_tokens`` gets, at most (fewer where the sequence
has less room)."""

Step = Callable[[dict[str, np.ndarray]], Mapping[str, np.ndarray]]


class GenerateRequestError(RequestError):
    """A generation request this bundle cannot serve, by the caller's fault (an HTTP 400)."""


@dataclass(frozen=True, kw_only=True)
class GenerateRequest:
    """One generation: the prompt's token ids, how many tokens to add at most, and how to pick
    them (temperature 0: greedy; above: sampled, from ``seed`` where given)."""

    input_ids: tuple[int, ...]
    max_new_tokens: int
    temperature: float = 0.0
    seed: int | None = None

    @classmethod
    def parse(cls, body: object, spec: GenerationSpec) -> GenerateRequest:
        """``{"input_ids": [...], "max_new_tokens": N, "temperature": T, "seed": S}``,
        checked against ``spec``.

        Raises:
            GenerateRequestError: naming the field, its value and what it may be.
        """
        if not isinstance(body, dict):
            raise GenerateRequestError(
                f"a generation request is a JSON object, got {type(body).__name__}; send "
                '{"input_ids": [1, 2, 3], "max_new_tokens": 16}'
            )
        unknown = sorted(set(body) - {"input_ids", "max_new_tokens", "temperature", "seed"})
        if unknown:
            raise GenerateRequestError(
                f"unknown field {unknown[0]!r} in a generation request; the fields are "
                "input_ids, max_new_tokens, temperature and seed"
            )
        ids = body.get("input_ids")
        if (
            not isinstance(ids, list)
            or not ids
            or not all(type(t) is int and 0 <= t < spec.vocab_size for t in ids)
        ):
            raise GenerateRequestError(
                f"input_ids must be a non-empty list of token ids from 0 to {spec.vocab_size - 1},"
                f" got {_short(ids)}"
            )
        room = spec.max_seq_len - len(ids)
        if room < 1:
            raise GenerateRequestError(
                f"the prompt has {len(ids)} tokens, and the bundle takes {spec.max_seq_len} in "
                "all, the new ones included; give a shorter prompt, or recompile with a larger "
                "--max-seq-len"
            )
        new = body.get("max_new_tokens", min(DEFAULT_NEW_TOKENS, room))
        if type(new) is not int or not 1 <= new <= room:
            raise GenerateRequestError(
                f"max_new_tokens is {_short(new)}, expected 1 to {room}: the bundle "
                f"takes {spec.max_seq_len} tokens in all and the prompt has {len(ids)}; "
                "recompile with a larger --max-seq-len for more"
            )
        temperature = body.get("temperature", 0.0)
        if type(temperature) not in (int, float) or not 0 <= temperature <= 100:
            raise GenerateRequestError(
                f"temperature is {_short(temperature)}, expected a number from 0 (greedy) to 100"
            )
        seed = body.get("seed")
        if seed is not None and (type(seed) is not int or seed < 0):
            raise GenerateRequestError(f"seed is {_short(seed)}, expected an integer >= 0")
        return cls(
            input_ids=tuple(ids), max_new_tokens=new, temperature=float(temperature), seed=seed
        )

    def to_dict(self) -> dict:
        body: dict = {"input_ids": list(self.input_ids), "max_new_tokens": self.max_new_tokens}
        if self.temperature:
            body["temperature"] = self.temperature
        if self.seed is not None:
            body["seed"] = self.seed
        return body


@dataclass(frozen=True, kw_only=True)
class Generated:
    """A generation's tokens and times.

    Attributes:
        tokens: the new tokens, the end-of-sequence token included where one ended it.
        first_token_s: from the request to the first new token (the prefill step), s.
        token_s: each later token's step, s.
        stopped: ``eos`` or ``length``.
        foresight: per step of a mixture of experts whose dispatches predict the next layer's
            expert functions (`Foresight`): (predicted and then called, predicted, called),
            summed over the layers; empty where none predicts.
        cold: per step, where the expert functions' gateway tells how long each call waited
            for its function to start (`mopar.runtime.server.COLD_HEADER`): (calls that
            waited, ms the step waited: each layer's longest wait, summed); else empty.
        text: the new tokens as text, for a request that came as text.
    """

    tokens: tuple[int, ...]
    first_token_s: float
    token_s: tuple[float, ...]
    stopped: str
    foresight: tuple[tuple[int, int, int], ...] = ()
    cold: tuple[tuple[int, float], ...] = ()
    text: str | None = None

    def to_dict(self) -> dict:
        out = {
            "tokens": list(self.tokens),
            **({"text": self.text} if self.text is not None else {}),
            "stopped": self.stopped,
            "first_token_ms": round(self.first_token_s * 1e3, 3),
            "token_ms": [round(s * 1e3, 3) for s in self.token_s],
        }
        if self.foresight:
            out["prewarm"] = [list(step) for step in self.foresight]
        if self.cold:
            out["cold"] = [[n, round(ms, 3)] for n, ms in self.cold]
        return out

    @classmethod
    def from_dict(cls, data: dict) -> Generated:
        return cls(
            tokens=tuple(int(t) for t in data["tokens"]),
            first_token_s=float(data["first_token_ms"]) / 1e3,
            token_s=tuple(float(ms) / 1e3 for ms in data["token_ms"]),
            stopped=str(data["stopped"]),
            foresight=tuple((int(a), int(b), int(c)) for a, b, c in data.get("prewarm", ())),
            cold=tuple((int(n), float(ms)) for n, ms in data.get("cold", ())),
            text=data.get("text"),
        )


def empty_cache(spec: GenerationSpec, shapes: Mapping[str, tuple[str, Sequence[int]]]) -> dict:
    """The cache before the prompt: each cache input of ``shapes`` (name -> dtype and its
    largest shape) with its sequence axis at 0."""
    cache = {}
    for pair in spec.cache:
        dtype, shape = shapes[pair.past]
        empty = list(shape)
        empty[pair.axis] = 0
        cache[pair.past] = np.zeros(empty, dtype=dtype)
    return cache


def generate(
    step: Step,
    spec: GenerationSpec,
    request: GenerateRequest,
    cache: Mapping[str, np.ndarray],
    *,
    clock: Callable[[], float] = time.perf_counter,
) -> Generated:
    """Run ``request``: the prompt's step, then one step per new token, each fed the cache the
    step before returned (``cache``: the empty one, `empty_cache`)."""
    rng = np.random.default_rng(request.seed)
    feeds = dict(cache)
    ids = np.asarray([request.input_ids], dtype=np.int64)
    tokens: list[int] = []
    times: list[float] = []
    stopped = "length"
    start = clock()
    while len(tokens) < request.max_new_tokens:
        feeds[spec.input_ids] = ids
        out = step(feeds)
        token = _pick(out[spec.logits][0], request.temperature, rng)
        now = clock()
        times.append(now - start)
        start = now
        tokens.append(token)
        if token in spec.eos_token_ids:
            stopped = "eos"
            break
        feeds = {pair.past: out[pair.present] for pair in spec.cache}
        ids = np.asarray([[token]], dtype=np.int64)
    return Generated(
        tokens=tuple(tokens), first_token_s=times[0], token_s=tuple(times[1:]), stopped=stopped
    )


class MainFunction:
    """A ``--generate`` bundle's main function, ready to answer generation requests.

    Each step runs the units of its path in order (`GenerationSpec.units`: its own slice, and
    for a mixture of experts the slices and dispatches after it), each through its
    `FunctionCore` (the same checks and models as a frame's), handing tensors on in memory;
    a dispatch calls its expert functions through ``fork`` (the server's hops, a Lambda
    invoke, or expert functions loaded in process).

    Args:
        units: each unit's spec and core, in path order; the first is the main function's own.
        fork: how to reach the expert functions (None: it calls none).
        warm: how to send warm-ups to the expert functions a dispatch predicts the next layer
            calls (the server's `Warmer` picks the cold ones; None: predicted and scored only).
        cold: after a dispatch's calls, how long each waited for its function to start, ms
            (the server reads its gateway's answers; None: it cannot tell).

    Raises:
        RequestError: (404) the first unit is not a main function (no ``generation``).
    """

    def __init__(
        self,
        units: Sequence[tuple[FunctionSpec, FunctionCore]],
        fork: Fork | None = None,
        warm: Callable[[list[str]], None] | None = None,
        cold: Callable[[], list[float]] | None = None,
    ) -> None:
        spec = units[0][0]
        if spec.generation is None:
            raise RequestError(
                f"function {spec.slice} generates no text: it is no main function of a bundle "
                "compiled with --generate; send it frames",
                404,
            )
        self.spec = spec.generation
        self.units = tuple(units)
        self.fork = fork
        self.warm = warm
        self.cold = cold
        self.tokenizer: Path | None = None  # its tokenizer file, where its folder has one
        self._reader: Tokenizer | None = None
        receives = {t.name: (t.dtype, t.shape) for u, _ in units for t in u.receives}
        self.empty = empty_cache(self.spec, receives)

    @classmethod
    def of(
        cls,
        function: SliceFunction,
        fork: Fork | None = None,
        warm: Callable[[list[str]], None] | None = None,
        *,
        cold: Callable[[], list[float]] | None = None,
    ) -> MainFunction:
        """The main function whose own unit is ``function``; the other units of its path are
        in its folder (``units/<name>``, as deployed), else its sibling folders (the bundle's
        ``functions/``)."""
        units = [(function.spec, function.core)]
        generation = function.spec.generation
        for name in generation.units[1:] if generation is not None else ():
            inside = function.dir / UNITS_DIR / name
            unit = SliceFunction(inside if inside.is_dir() else function.dir.parent / name)
            units.append((unit.spec, unit.core))
        main = cls(units, fork, warm, cold)
        if (function.dir / TOKENIZER_FILE).is_file():
            main.tokenizer = function.dir / TOKENIZER_FILE
        return main

    def step(
        self, feeds: dict[str, np.ndarray], foresight: Foresight | None = None
    ) -> dict[str, np.ndarray]:
        """One step: ``feeds`` (the step's token ids and cache) through every unit; the
        model's outputs by their public names. With ``foresight``, each dispatch that can
        predicts the next MoE layer's expert functions, and ``foresight`` keeps the score."""
        values = dict(feeds)
        if foresight is not None:
            foresight.begin()
        for spec, core in self.units:
            feeds = {t.name: values[t.name] for t in spec.receives}
            door = _StepDoor(spec, feeds, self.fork, foresight is not None, self.warm)
            core.run(door)
            values.update(door.results)
            if foresight is not None and spec.dispatch is not None:
                waits = self.cold() if self.cold is not None and door.called else []
                foresight.layer(door.warmed, door.called, waits)
        last = self.units[-1][0]
        return {public: values[value] for value, public in last.returns.items()}

    def answer(self, body: object) -> Generated:
        """Generate for a request's JSON ``body`` (`GenerateRequest.parse`; ``"text"`` in place
        of ``"input_ids"``: tokenized, and answered as text too), scoring the dispatches'
        predictions of the next layer's expert functions where they make any."""
        text = body.get("text") if isinstance(body, dict) else None
        if isinstance(body, dict) and text is not None:
            body = {
                **{k: v for k, v in body.items() if k != "text"},
                "input_ids": self._encode(body),
            }
        request = GenerateRequest.parse(body, self.spec)
        foresight = Foresight() if self.spec.callees else None
        done = generate(lambda feeds: self.step(feeds, foresight), self.spec, request, self.empty)
        said = (
            self._tokenizer().decode(list(done.tokens), skip_special_tokens=True) if text else None
        )
        return replace(
            done,
            foresight=foresight.scores() if foresight else (),
            cold=foresight.cold() if foresight else (),
            text=said,
        )

    def _encode(self, body: dict) -> list[int]:
        """The token ids of a request's ``"text"``, as transformers' tokenizer gives them (its
        special tokens added), with the tokenizer its folder carries (`TOKENIZER_FILE`, read as
        data by the ``tokenizers`` library, loaded at the first text).

        Raises:
            GenerateRequestError: the text is no string, or comes with input_ids too; (501) the
                function has no tokenizer, or no ``tokenizers`` to read it with.
        """
        text = body["text"]
        if not isinstance(text, str) or not text or "input_ids" in body:
            raise GenerateRequestError(
                "give the prompt as one of input_ids (token ids) and text (a non-empty string)"
            )
        return list(self._tokenizer().encode(text).ids)

    def _tokenizer(self) -> Tokenizer:
        """The function's tokenizer, read at the first text.

        Raises:
            GenerateRequestError: (501) the function has no tokenizer, or no ``tokenizers`` to
                read it with.
        """
        if self._reader is None:
            if self.tokenizer is None:
                raise GenerateRequestError(
                    "this function carries no tokenizer (its model folder had none); send "
                    "input_ids",
                    501,
                )
            try:
                from tokenizers import Tokenizer
            except ImportError:
                raise GenerateRequestError(
                    "text needs the tokenizers package where this function runs; install "
                    "the function's requirements.txt (it names tokenizers), or send input_ids",
                    501,
                ) from None
            try:
                self._reader = Tokenizer.from_file(str(self.tokenizer))
            except Exception as exc:  # noqa: BLE001 - the library's own errors, as one line
                raise GenerateRequestError(
                    f"this function's {TOKENIZER_FILE} does not read ({exc}); recompile the "
                    "bundle, or send input_ids",
                    501,
                ) from None
        return self._reader


class Foresight:
    """How well one request's dispatches foresaw the next MoE layer's expert functions, step
    by step: MoEless's layer-aware prediction (the next layer's router on this layer's hidden
    states), scored as MoE-Infinity scores its prefetching, by precision (of the functions
    predicted, the share the next layer then called) and recall (of those it called, the share
    predicted). A layer is scored only after one that predicts: the first MoE layer of each
    step, whose experts no layer of the step before foresees, is not. It also keeps, per step,
    the calls that waited for their function to start, and how long the step waited for them:
    whether the experts were warm in time."""

    def __init__(self) -> None:
        self._steps: list[list[int]] = []
        self._cold: list[list[float]] = []
        self._told = False  # whether any call's wait for a start was told
        self._expected: set[str] | None = None

    def begin(self) -> None:
        """A new step: no layer's prediction carries over from the step before."""
        self._steps.append([0, 0, 0])
        self._cold.append([0, 0.0])
        self._expected = None

    def layer(
        self, predicted: Sequence[str] | None, called: Sequence[str], waits: Sequence[float] = ()
    ) -> None:
        """One MoE layer of this step: the functions it called, against what the layer before
        predicted; then what it predicts for the next (None: it predicts nothing). ``waits``:
        how long each call waited for its function to start, ms (they ran side by side)."""
        self._told = self._told or bool(waits)
        self._cold[-1][0] += sum(1 for w in waits if w > 0)
        self._cold[-1][1] += max(waits, default=0.0)
        if self._expected is not None:
            score = self._steps[-1]
            score[0] += len(self._expected & set(called))
            score[1] += len(self._expected)
            score[2] += len(set(called))
        self._expected = set(predicted) if predicted is not None else None

    def scores(self) -> tuple[tuple[int, int, int], ...]:
        """Per step: (predicted and called, predicted, called)."""
        return tuple((a, b, c) for a, b, c in self._steps)

    def cold(self) -> tuple[tuple[int, float], ...]:
        """Per step: (calls that waited for a start, ms the step waited); empty where no call
        was told its wait (no gateway that starts functions told it)."""
        return tuple((int(n), float(ms)) for n, ms in self._cold) if self._told else ()


class _StepDoor:
    """One unit's tensors in, as arrays, and its results out (`mopar.runtime.core.Door`); a
    dispatch's expert functions through ``fork``."""

    def __init__(
        self,
        spec: FunctionSpec,
        feeds: dict[str, np.ndarray],
        fork: Fork | None,
        predicts: bool,
        send_warm: Callable[[list[str]], None] | None,
    ) -> None:
        self.spec = spec
        self.feeds = feeds
        self.fork = fork
        self.send_warm = send_warm
        self.prewarms = predicts  # a dispatch with a router of the next layer runs it
        self.results: dict[str, np.ndarray] = {}
        self.warmed: list[str] | None = None
        self.called: list[str] = []

    def received(self) -> dict[str, np.ndarray]:
        return self.feeds

    def describe(self, item: np.ndarray) -> tuple[np.dtype, tuple[int, ...], str]:
        return item.dtype, tuple(item.shape), "none"

    def decode(self, names: Collection[str]) -> dict[str, np.ndarray]:
        return {n: a for n, a in self.feeds.items() if n in names}

    def gather(self, calls: Sequence[FunctionSpec]) -> None:
        raise RuntimeError(
            f"unit {self.spec.slice} of a main function joins {len(calls)} parts, which "
            "generation does not run yet"
        )

    def call(self, calls: Sequence) -> list[np.ndarray]:
        if self.fork is None:
            raise RuntimeError(
                f"unit {self.spec.slice} calls expert functions, and the main function was "
                "given no way to reach them; set MOPAR_CALLS"
            )
        self.called = [c.function for c in calls]
        return call_experts(calls, self.fork)

    def warm(self, names: list[str]) -> None:
        self.warmed = list(names)
        if self.send_warm is not None:
            self.send_warm(self.warmed)

    def send(self, results: Mapping[str, np.ndarray]) -> None:
        self.results = dict(results)


def _pick(logits: np.ndarray, temperature: float, rng: np.random.Generator) -> int:
    if temperature == 0:
        return int(np.argmax(logits))
    scaled = logits.astype(np.float64) / temperature
    weights = np.exp(scaled - scaled.max())
    return int(rng.choice(len(weights), p=weights / weights.sum()))


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
