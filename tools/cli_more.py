"""What docs/cli.md's option rows say after each option's ``--help`` line (its `Spec`'s
``help``): the docs' own detail, which ``--help`` does not show and the installed package does not
ship. `tools.cli_docs` adds each to its row, and fails on a key that names no row.

Keyed ``"TABLE FLAG"``: the table as docs/cli.md marks it (``<!-- options: TABLE ... -->``, a
command as typed after ``mopar`` or a group of `mopar.cli.options`), then the option's first
spelling.
"""

from __future__ import annotations

from mopar.runner.load import MAX_RATE_RPS

__all__ = ["MORE"]

MORE: dict[str, str] = {
    "INPUTS --input": (
        "E.g. `input_ids=1x128:int64:0..30000` (HIGH exclusive; integers default to `0..2`). "
        "Floats are seeded standard normal. dtypes: float32, float16, float64, int64, int32, "
        "bool. Inputs larger than the machine's memory are refused before they are allocated."
    ),
    "INPUTS --example-inputs": (
        "A bundle's `reference.npz` works too. One array under any key is a one-input model's "
        "input; for a `.pt2` exported for batch 1, an (N, C, H, W) array gives its first "
        "sample. A note says what was assumed."
    ),
    "INPUTS --trust-pickle": (
        "Only for files you trust. Without it, `weights_only` loading is used and a pickled "
        "module is refused."
    ),
    "INPUTS --depth": "N components of the path.",
    "compile --slices": "N is 1 to the number of layers; it removes the default latency bound.",
    "compile --strategy": (
        "`mopar`, `mopar-paper`, `unsplit`, `uniform`, `params` or `latency` "
        "([partition](partition.md))."
    ),
    "compile --target": (
        "`openfaas`, `lambda`, or a pricing-only target added to `profiles/platforms.json` "
        "(deployed as OpenFaaS). A bundle holds that target's files alone: `stack.yml` for "
        "OpenFaaS, `template.yaml` and `Dockerfile.lambda` for Lambda, and a `README.md` "
        "([bundle](bundle.md)); `all` is refused in one line: compile once per target."
    ),
    "compile --arch": "`arm64` is cheaper per GB-s.",
    "compile --transport": (
        "One of `shm`, `http`, `redis`; the target offers some (OpenFaaS: http, redis, and "
        "shm with `--colocate`; Lambda: http, redis: shm needs functions that share a tmpfs), "
        "and one it does not offer is refused (`--transport shm` without `--colocate`)."
    ),
    "compile --colocate": (
        "Without it an OpenFaaS bundle deploys on Community Edition with `faas-cli up` as "
        "written; with it the plan may take the `shm` chain mode, and the bundle's `k8s/` "
        "and README say what to apply ([deploy-openfaas](deploy-openfaas.md)). What it needs "
        "is `platforms.json`'s `colocation.needs`; a target without one refuses it."
    ),
    "compile --slo-ms": "Infeasible bounds are refused with the fastest achievable figure.",
    "compile --max-slowdown": "The notes say what 1.1x, 1.25x and 1.5x would buy.",
    "compile --max-memory-mb": "A layer that cannot fit alone is named.",
    "compile --cold-start-rate": (
        "Applies to every function; the keep-alive is Lambda's 10 minutes "
        "([billing](billing.md#traffic)); since August 2025 Lambda bills INIT, and each "
        "invocation is charged its share of its function's predicted INIT time "
        "(`profiles/runtime.json` `cold_start`: 200 ms + 2.3 ms per MB of weights, measured from a cold page cache)."
    ),
    "compile --min-memory": "An ablation; it matters on Lambda.",
    "compile --parallel": "Faster: by 5% or more ([horizontal](horizontal.md)).",
    "compile --force-parallel": "The largest η a sharding rule allows, up to `--parallel`.",
    "compile --rate": (
        "Cold starts (INIT billed on Lambda), idle reserved replicas (OpenFaaS) and the chain "
        "modes' hourly charges follow from it ([billing](billing.md)); the plan is the "
        "cheapest under it within the bound. For a mixture-of-experts model the most loaded "
        "cold experts get replicas until the load per replica varies by a CV of at most 0.2 "
        "(or their weights reach 2x), packed longest-processing-time first."
    ),
    "compile --trace": (
        "`#` comments and blank lines are skipped; a file that cannot be read, or a line that "
        "is no number, is one line of error."
    ),
    "compile --chain": (
        "[Billing](billing.md#chain-modes); `plan.json` records the mode as `chain`."
    ),
    "compile --hot-experts": "[MoE](moe.md#placement-policies).",
    "compile --expert-group": "Given, it is forced (no inline fallback).",
    "compile --experts": (
        "`functions` puts each expert, or group of experts, in a function of its own, called "
        "by a dispatch function only when tokens reach it (a layer stays inline where the "
        "planner finds that cheaper, and says so); `inline` keeps the experts in their slice "
        "as their dense translation ([MoE](moe.md))."
    ),
    "compile --profiles": (
        "What the folder lacks comes from the shipped `profiles/`. Read once, before the "
        "model is loaded (a bad `--target`, `--arch` or `--transport` fails first); the "
        "Python API can take a platform built in code instead ([API](api.md))."
    ),
    "compile --dynamic": "`x:0=1..8` for a batch; see [dynamic shapes](#dynamic-shapes).",
    "compile --generate": "MODEL is a `save_pretrained` folder ([generation](generate.md)).",
    "compile --rtol": (
        "A bfloat16 model's float32 logits count as bfloat16; the steps are rtol = 4 x the "
        "type's machine epsilon (float16 0.0039, bfloat16 0.031), atol = 4 x `np.spacing` at "
        "the output's largest value, never below 1e-3 and 1e-4, the widest over the outputs "
        "([float16 and bfloat16](exportable.md#float16-and-bfloat16))."
    ),
    "compile --atol": (
        "A bfloat16 model's float32 logits count as bfloat16; the steps are rtol = 4 x the "
        "type's machine epsilon (float16 0.0039, bfloat16 0.031), atol = 4 x `np.spacing` at "
        "the output's largest value, never below 1e-3 and 1e-4, the widest over the outputs "
        "([float16 and bfloat16](exportable.md#float16-and-bfloat16))."
    ),
    "compile --codec": (
        "`ae` puts an autoencoder wherever one fits ([codecs](codecs.md)); the others: `ae4`, "
        "`ae16`, `ae4+fp16`, `ae16+fp16`, `ae2+int8+zstd`, `ae4+int8+zstd` (an autoencoder "
        "whose code is sent as int8, then zstd)."
    ),
    "compile --calibration": (
        "Token data are sequences by input name, cut into requests of the example's shape "
        "([MoE](moe.md)). An `.npz` holds arrays keyed by input name, samples on a new first "
        "axis or along the model's batch axis: (N, C, H, W) for an example of (1, C, H, W); "
        "one array is read as a one-input model's input whatever its key; a note says what "
        "was assumed."
    ),
    "compile --max-output-error": (
        "Without it (or the next two) only lossless codecs and float weights are chosen."
    ),
    "compile --max-top1-change": "Rows: a classifier's class; a language model's next token.",
    "compile --quantize": "[Quantize](quantize.md); `auto` needs a budget.",
    "compile --seed": "Calibration: the augmentation of the samples.",
    "compile --until": (
        "Written atomically; export's has no verification, no `stack.yml` or `template.yaml`. "
        '`plan.json` says `"until": "STAGE"`; `mopar run` refuses such a bundle.'
    ),
    "compile --check-latency/--no-check-latency": (
        "With `--strategy mopar` (no `--slo-ms`, `--slices` or `--codec`), for a plan of two "
        "or more functions (below)."
    ),
    "compile --measure": (
        "In a container it is limited to 2x the host size while measured, and sized from the "
        "larger of the two peaks; `containers` builds the images first (`mopar build`), so it "
        "is opt-in."
    ),
    "compile --base-image": "`make base-image` is for where no registry is reachable.",
    "compile --image-prefix": (
        "Lower-case names separated by `/`, a registry host (with a port) first, no scheme "
        "([OpenFaaS](deploy-openfaas.md#commands))."
    ),
    "compile --gateway": "An `http://` or `https://` URL.",
    "compile --redis-url": (
        "`redis://HOST:PORT/DB`, or `rediss://` (TLS). In `stack.yml` it is set, empty, where "
        "a cut uses Redis without it; on Lambda it serves over-limit handoffs, `redis` cuts "
        "and `Chain=event`."
    ),
    "compile --force": (
        "Only an empty folder or a bundle mopar wrote, holding nothing its compile did not "
        "list (docs/api.md); anything else is refused before any work."
    ),
    "compile --json": (
        'That is `{"bundle", "plan", "max_abs_err", "max_rel_err", "rtol", "atol", "until", '
        '"stages"}` (the errors are null with `--until`).'
    ),
    "plan --target": (
        "`openfaas`, `lambda`, or a pricing-only target added to `profiles/platforms.json`."
    ),
    "plan --compare": (
        "Each is sized by mopar's rule and priced by the same bill in the chain mode cheapest "
        "for it within mopar's bound: functions, chain mode, predicted cost per 1M requests "
        "and its ratio to unsplit's, latency, and whether it runs (`small` where a slice fits "
        "no function by mopar's rule and keeps the paper's sizing; `slow` over the bound). "
        "The default plan is never dearer than a row that runs within the bound."
    ),
    "plan --pareto": "The plans within the bound are marked.",
    "plan --plot": "One panel per strategy with `--compare`.",
    "plan --json": (
        'The plan, format 3: `{"strategy", "target", "functions": [{"name", "kind", "layers", '
        '"memory_mb", "time_ms", ...}], "edges": [{"src", "dst", "tensors", "bytes", '
        '"transport", "probability", ...}], "cost_per_1m_usd", "latency_ms", "mc_gb_s", '
        '"bound_ms", "chain", "frontier", "notes", "priced_for": {"target", "time_factor", '
        '"source", "trained_on"}, "bill": {"chain", "traffic", "cost_per_1m_usd", '
        '"latency_ms", "includes_per_1m_usd": {"compute_usd", "waits_usd", "init_usd", '
        '"fees_usd", "orchestration_usd", "idle_usd"}, "unsplit": {"chain", '
        '"cost_per_1m_usd", "latency_ms"} (null where the model fits no single function), '
        '"vs_unsplit"}, "compare": {strategy: {"slices", "functions", "chain", '
        '"cost_per_1m_usd", "latency_ms", "mc_gb_s", "fits", "within_bound"}}}` (`compare` '
        "with `--compare`)."
    ),
    "run --input": "Keys `input.NAME` or bare `NAME`.",
    "run --check": (
        "As `numpy.allclose`, on the reference outputs (`output.NAME`): an element passes "
        "when |a - b| <= atol + rtol·|b|; the error names the first output that fails."
    ),
    "run --transport": "See above.",
    "run --redis-url": "A URL is `redis://host:port/db`.",
    "run --rtol": (
        "That is what compile verified the bundle with (rtol 1e-3, atol 1e-4 for float32 "
        "outputs; 4 rounding steps of float16 or bfloat16 outputs' type; atol wider when "
        "lossy codecs were chosen)."
    ),
    "run --atol": (
        "That is what compile verified the bundle with (rtol 1e-3, atol 1e-4 for float32 "
        "outputs; 4 rounding steps of float16 or bfloat16 outputs' type; atol wider when "
        "lossy codecs were chosen)."
    ),
    "run --timeout": (
        "That is, seconds one instance may work on one request; past it (shm) the instance is "
        "killed, its requests fail, and a new one serves the next. Under `http` and `redis` a "
        "slice past it, or a server that died, ends the run naming the slice; each server "
        "waits 1 s longer per slice after it, so the innermost late slice is the one named."
    ),
    "run --concurrency": "The slices pipeline them.",
    "run --cold-experts": "The report gains `cold`.",
    "run --prewarm/--no-prewarm": (
        "The same wherever functions can be cold (`--cold`, `--idle-s`), and when a request "
        "finds the chain's first function cold, the chain's other functions start at once "
        "([MoE](moe.md#placement-policies))."
    ),
    "run --instances": (
        "Busy: each running one holds `--instance-concurrency` requests; the start is timed."
    ),
    "run --instance-concurrency": "At `--instances` they wait at the least-loaded one.",
    "run --cold": "As `cold.first_request_ms`.",
    "run --enforce-memory": (
        "They fail naming the slice, its peak and its allocation; the next request starts a "
        "new instance; `oom_kills` counts them."
    ),
    "run --containers": (
        "The limits are kernel-enforced; `--transport http|redis` forces one; an OOM kill "
        "(exit 137) fails the requests it held, is counted and named with the allocation and "
        "the cgroup's peak, and the container starts again; containers and volumes are "
        "removed at the end, on failure and on Ctrl-C ([local containers](deploy-local.md))."
    ),
    "run --max-new-tokens": (
        "One after another, its expert functions called through /dev/shm (`--transport shm`) "
        'or over HTTP (the others); `"generation"` in `--json`, and with expert functions the '
        "next layer's prediction precision and recall."
    ),
    "run --json": "Below.",
    "load --rate": (
        "No coordinated omission; a higher rate is refused before anything starts "
        "([serving](serving.md))."
    ),
    "load --seed": "`mopar simulate --seed N` draws the same ones.",
    "load --target": "Below.",
    "load --json": "As `mopar run --json`, with `load`.",
    "max-rate --rate": f"The search goes no higher than {MAX_RATE_RPS:g}.",
    "max-rate --json": "Below.",
    "generate --input-ids": "Give it or `--text`.",
    "generate --max-new-tokens": (
        "More tokens than the bundle's `--max-seq-len` (prompt and new ones) are refused in "
        "one line."
    ),
    "generate --seed": "Sampling with a seed is repeatable.",
    "generate --cold-experts": (
        "The gateway listens on 127.0.0.1; the report adds `warm_steps`, the calls that "
        "waited for a start and what the gateway counted (`gateway`: calls warm, pre-warmed "
        "in time, late, cold; warm-ups; starts no call used; start p50) "
        "([generation](generate.md#pre-warming-per-step)); `shm` or `http` only."
    ),
    "generate --idle-s": (
        "As a platform reaps it; the main function takes S as their keep-alive when it picks "
        "whom to warm."
    ),
    "generate --prewarm/--no-prewarm": "Off: a warm-up is answered and starts none.",
    "serve --timeout": "A slice past it is named in a 502.",
    "simulate --trace": "`#` comments are skipped.",
    "simulate --traffic": "Bursty arrivals come only in `--on-s` of every `--on-s` + `--off-s`.",
    "simulate --chain": (
        "`invoke`, `stepfunctions`, `event` (Lambda); `http`, `callback`, `shm` (OpenFaaS)."
    ),
    "simulate --profile": (
        "Each call's `samples_ms`; without it, `plan.json`'s measured p50 (else its "
        "prediction) with a log-normal `--spread`, and the INIT model of "
        "`profiles/runtime.json`."
    ),
    "simulate --keep-alive-s": "Down to `--min-instances`.",
    "simulate --parallel-share": "The CPU-share model's.",
    "simulate --new-tokens": (
        "It calls its expert functions per token "
        "([generation](generate.md#the-bill-of-a-generation)); adds `new_tokens` and "
        "`cost_per_1k_tokens_usd`."
    ),
    "simulate --prompt-tokens": (
        "The prompt's step is compile's timed first token scaled by N over the timed prompt's "
        "tokens."
    ),
    "simulate --seed": "The arrivals are the same as `mopar load --seed N`'s.",
    "simulate --json": (
        'That is `{"target", "chain", "requests", "span_s", "usd", "cost_per_1m_usd", '
        '"latency_ms": {"p50", "p95", "p99"}, "cold_share", "functions": [{"name", '
        '"memory_mb", "invocations", "usd", "cost_per_1m_usd", "p50_ms", "p95_ms", "p99_ms", '
        '"cold_starts", "cold_share", "instances", "instance_s"}], "notes"}`.'
    ),
    "build --watchdog": "That is the template's `ship` stage; without it, `function`.",
    "build --json": (
        'That is `{"engine", "images": [{"function", "kind", "tag", "size_mb", '
        '"above_base_mb", "weights_mb", "runtime_mb", "seconds", "cached"}]}`.'
    ),
}
