"""``mopar generate``: text generation with a ``--generate`` bundle, on this machine."""

from __future__ import annotations

import click

from mopar.cli.common import Number, emit_json, stdout
from mopar.cli.options import Spec, json_output, options, timeout

__all__ = ["generate_cmd"]


def _token_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise click.BadParameter(f"{text!r} is not comma-separated token ids, e.g. 1,2,3") from None
    if not ids:
        raise click.BadParameter("give at least one token id, e.g. --input-ids 1,2,3")
    return ids


PROMPT: tuple[Spec, ...] = (
    Spec(
        decls=("--input-ids", "input_ids"),
        help="The prompt's token ids, comma-separated.",
        metavar="ID,ID,...",
    ),
    Spec(
        decls=("--text",),
        help="The prompt as text, tokenized by the main function with the tokenizer its model "
        "folder had; the answer is printed as text too.",
        arg="TEXT",
    ),
    Spec(
        decls=("--max-new-tokens",),
        help="Tokens to generate at most (fewer where an end-of-sequence token comes first).",
        type=click.IntRange(min=1),
        default=32,
        arg="N",
    ),
    Spec(
        decls=("--temperature",),
        help="0: greedy (the largest logit); above: sampled from softmax(logits / T).",
        type=click.FloatRange(0, 100),
        default=0.0,
        arg="T",
    ),
    Spec(decls=("--seed",), help="Seed of the sampling.", type=click.IntRange(min=0), arg="S"),
    Spec(
        decls=("--requests",),
        help="Serve the same request this many times, one after another, and report the figures.",
        type=click.IntRange(min=1, max=1000),
        default=1,
        arg="N",
    ),
    Spec(
        decls=("--transport",),
        help="The main function as its own function server on 127.0.0.1, sent JSON as a client "
        "would, calling its expert functions (each a server too) through /dev/shm (shm) or over "
        "HTTP (http); or all in this process (inprocess).",
        type=click.Choice(["shm", "http", "inprocess"]),
        default="http",
    ),
    Spec(
        decls=("--cold-experts",),
        help="Expert functions start scaled to zero behind a local gateway: each starts when a "
        "call or a warm-up reaches it; report the share of steps that found them warm.",
        extra={"is_flag": True},
    ),
    Spec(
        decls=("--idle-s",),
        help="With --cold-experts: stop an expert function idle this many seconds (default: "
        "never).",
        type=Number(min=0),
        arg="S",
        shown="never",
    ),
    Spec(
        decls=("--prewarm/--no-prewarm",),
        help="With --cold-experts: a warm-up for the experts the main function predicts starts "
        "them.",
        default=True,
    ),
    json_output("Print the tokens and figures as JSON."),
    timeout(default=120.0, help="Seconds to wait for each answer."),
)


@click.command("generate")
@click.argument("bundle", type=click.Path(file_okay=False))
@options(PROMPT)
def generate_cmd(
    bundle,
    input_ids,
    text,
    max_new_tokens,
    temperature,
    seed,
    requests,
    transport,
    cold_experts,
    idle_s,
    prewarm,
    as_json,
    timeout_s,
) -> None:
    """Generate tokens after --input-ids with BUNDLE (compiled with --generate): its main
    function holds the key-value cache and runs the decoding loop, as deployed.

    Prints the new tokens, the time to the first token, the per-token latency (p50, p95) and
    tokens per second. Exit codes: 0 ok; 1 a bad bundle or a refused request."""
    from pathlib import Path

    from mopar.errors import OptionError
    from mopar.runner.bundle import read_manifest
    from mopar.runner.generation import Generation, generation_of, summary
    from mopar.runtime.generate import GenerateRequest, GenerateRequestError

    if (input_ids is None) == (text is None):
        raise OptionError("give the prompt as one of --input-ids 1,2,3 and --text 'TEXT'")
    if cold_experts and transport == "inprocess":
        raise OptionError(
            "--cold-experts starts expert functions as processes; use --transport shm or http"
        )
    if not cold_experts and (idle_s is not None or not prewarm):
        raise OptionError("--idle-s and --no-prewarm need --cold-experts")
    manifest = read_manifest(Path(bundle))
    spec = generation_of(manifest)
    if cold_experts and not spec.callees:
        raise OptionError(
            f"bundle {bundle!r} calls no expert functions, so none can start cold; drop "
            "--cold-experts"
        )
    body: dict = {"max_new_tokens": max_new_tokens}
    if temperature:
        body["temperature"] = temperature
    if seed is not None:
        body["seed"] = seed
    if text is None:
        body["input_ids"] = _token_ids(input_ids)
        try:  # checked here, before anything starts
            GenerateRequest.parse(body, spec)
        except GenerateRequestError as exc:
            raise OptionError(str(exc)) from None
    else:
        body["text"] = text  # tokenized, and checked, by the main function
    with Generation.of(
        manifest,
        transport=transport,
        timeout_s=timeout_s,
        cold_experts=cold_experts,
        idle_s=idle_s,
        prewarm=prewarm,
    ) as generation:
        answers = [generation.run(body) for _ in range(requests)]
        counts = generation.gateway.counts() if generation.gateway is not None else None
    figures = summary(answers, counts)
    first = answers[0][0]
    said = {"text": first.text} if first.text is not None else {}
    if as_json:
        emit_json(
            {"tokens": list(first.tokens), **said, "stopped": first.stopped, **figures.to_dict()}
        )
        return
    stdout.print(said["text"] if said else ",".join(map(str, first.tokens)), highlight=False)
    stdout.print(f"stopped: {first.stopped}; {figures.describe()} ({transport})", highlight=False)
