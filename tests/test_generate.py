"""Text generation (``--generate``): a decoder saved by another process with ``save_pretrained``,
compiled in a fresh one, generates the tokens transformers' ``generate`` does.

Each family's model is built from a small transformers config with random weights, saved with
its greedy tokens (32 after a 16-token prompt, from ``model.generate(do_sample=False)``) by one
process; ``mopar compile FOLDER --generate`` and ``mopar generate`` run in others. Llama (in
float32 and bfloat16) and Mixtral (its experts as functions) run by default, their folders saved
by one process; the other families and dtypes are slow tests.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from click.testing import CliRunner

from mopar.bundle.generation import CachePair, GenerationSpec
from mopar.errors import BundleError
from mopar.runtime.generate import GenerateRequest, GenerateRequestError
from tests.conftest import mopar

_SAVE = """
import json, sys, torch, transformers
small = dict(vocab_size=256, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=128)
configs = {
    "gpt2": lambda: transformers.GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4,
                                            n_positions=128, bos_token_id=0, eos_token_id=0),
    "llama": lambda: transformers.LlamaConfig(hidden_size=64, intermediate_size=128,
                                              num_key_value_heads=2, **small),
    "mixtral": lambda: transformers.MixtralConfig(
        hidden_size=64, intermediate_size=96, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, **small),
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
        hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        shared_expert_intermediate_size=64, num_key_value_heads=2, num_experts=4,
        num_experts_per_tok=2, **small),
    "olmoe": lambda: transformers.OlmoeConfig(
        hidden_size=64, intermediate_size=32, num_key_value_heads=4, num_experts=4,
        num_experts_per_tok=2, pad_token_id=1, eos_token_id=255, **small),
}


def save(family, out, dtype):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(configs[family]()).eval().to(dtype)
    model.save_pretrained(out)
    prompt = torch.randint(0, 256, (1, 16))
    # the reference is the folder's model as transformers loads it: .to(dtype) also cast
    # buffers that loading computes in float32 (rotary frequencies), which moves a bfloat16
    # model's logits
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype="auto").eval()
    with torch.no_grad():
        tokens = model.generate(prompt, max_new_tokens=32, do_sample=False)
    expected = {"prompt": prompt[0].tolist(), "tokens": tokens[0, 16:].tolist()}
    if family == "llama":  # a tokenizer of 256 words, as save_pretrained writes one
        from tokenizers import Tokenizer, models, pre_tokenizers
        words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(256)}, unk_token="w0"))
        words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        transformers.PreTrainedTokenizerFast(tokenizer_object=words).save_pretrained(out)
        expected["prompt_text"] = " ".join(f"w{i}" for i in expected["prompt"])
        expected["text"] = words.decode(expected["tokens"])
    json.dump(expected, open(out + "/expected.json", "w"))


# FAMILY OUT DTYPE, for each folder to save
for at in range(1, len(sys.argv), 3):
    save(sys.argv[at], sys.argv[at + 1], getattr(torch, sys.argv[at + 2]))
"""

# The folders the default tests compile, saved by one process (each process that saves pays
# some 7 s to import torch and transformers): (family, dtype).
SAVED_BY_DEFAULT = (("llama", "float32"), ("llama", "bfloat16"), ("mixtral", "float32"))


def _save(folders: dict[tuple[str, str], Path]) -> None:
    """Save each (family, dtype) folder of ``folders`` in one fresh process."""
    args = [str(a) for (family, dtype), out in folders.items() for a in (family, out, dtype)]
    subprocess.run([sys.executable, "-c", _SAVE, *args], check=True, timeout=600)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[tuple[str, str], Path]:
    """The folders of `SAVED_BY_DEFAULT`, each ``ROOT/model`` in a ROOT of its own."""
    folders = {key: tmp_path_factory.mktemp("-".join(key)) / "model" for key in SAVED_BY_DEFAULT}
    _save(folders)
    return folders


def _compiled(tmp_path_factory, family: str, *more: str, dtype: str = "float32", saved=None):
    """(bundle, expected) of ``family`` in ``dtype``: saved by one process (taken from
    ``saved``, the `saved` fixture, where it holds it), compiled by another."""
    if saved is not None and (family, dtype) in saved:
        folder = saved[family, dtype]
    else:
        folder = tmp_path_factory.mktemp(family) / "model"
        _save({(family, dtype): folder})
    bundle = folder.parent / "bundle"
    proc = mopar(
        "compile", folder, "--generate", "--max-seq-len", "48", "--out", bundle, *more, timeout=600
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return bundle, json.loads((folder / "expected.json").read_text())


def _generate(bundle, expected, *more: str) -> dict:
    ids = ",".join(map(str, expected["prompt"]))
    proc = mopar("generate", bundle, "--input-ids", ids, "--max-new-tokens", "32", "--json", *more)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def llama(tmp_path_factory, saved):
    return _compiled(tmp_path_factory, "llama", saved=saved)


@pytest.mark.parametrize("transport", ["http", "inprocess"])
def test_greedy_tokens_are_transformers_own(llama, transport):
    bundle, expected = llama
    answer = _generate(bundle, expected, "--transport", transport)
    assert answer["tokens"] == expected["tokens"]
    assert answer["new_tokens"] == len(expected["tokens"])
    assert answer["first_token_p50_ms"] > 0 and answer["tokens_per_s"] > 0


def test_the_bundle_names_its_main_function_and_cache(llama):
    bundle, _ = llama
    plan = json.loads((bundle / "plan.json").read_text())
    spec = GenerationSpec.from_dict(plan["generation"], where="plan.json")
    assert [f["name"] for f in plan["plan"]["functions"]] == [spec.function]
    assert len(spec.cache) == 4  # 2 layers, keys and values
    assert spec.max_seq_len == 48 and spec.vocab_size == 256
    function = json.loads((bundle / "functions" / spec.function / "function.json").read_text())
    assert function["generation"] == {k: v for k, v in plan["generation"].items() if k != "timing"}
    past = {t["name"]: t for t in function["receives"]}
    assert all(past[c.past]["min_shape"][c.axis] == 0 for c in spec.cache)  # empty at prefill


def test_a_seed_gives_the_same_sample_and_another_seed_another(llama):
    bundle, expected = llama
    sample = lambda seed: _generate(  # noqa: E731
        bundle, expected, "--temperature", "1.0", "--seed", str(seed), "--transport", "inprocess"
    )["tokens"]
    seven = sample(7)
    assert sample(7) == seven
    assert sample(8) != seven


def test_the_function_server_refuses_a_bad_request_in_one_line(llama):
    from mopar.runner.bundle import read_manifest
    from mopar.runner.generation import Generation

    bundle, expected = llama
    with Generation.of(read_manifest(bundle)) as generation:
        url = generation._server.url + "generate"
        for body, said in [
            (b"{not json", "is JSON"),
            (json.dumps({"input_ids": [1, 999]}).encode(), "token ids from 0 to 255"),
            (json.dumps({"input_ids": [1] * 40, "max_new_tokens": 9}).encode(), "1 to 8"),
        ]:
            post = urllib.request.Request(
                url, data=body, headers={"Content-Type": "application/json"}, method="POST"
            )
            with pytest.raises(urllib.error.HTTPError) as err:
                urllib.request.urlopen(post, timeout=30)
            assert err.value.code == 400
            assert said in json.loads(err.value.read())["error"]


def test_a_bundle_without_generation_is_refused_with_the_fix(skipnet_bundle):
    proc = mopar("generate", skipnet_bundle, "--input-ids", "1,2")
    assert proc.returncode == 1
    (line,) = proc.stderr.strip().splitlines()
    assert "serves one forward pass" in line and "--generate" in line


def _spec(**more) -> GenerationSpec:
    """A one-cache generation section, as a bundle's ``plan.json`` gives it."""
    return GenerationSpec(
        **{
            "function": "s0",
            "input_ids": "input_ids",
            "logits": "output_0",
            "cache": (CachePair(past="past_0", present="output_1", axis=2),),
            "max_seq_len": 10,
            "vocab_size": 4,
            **more,
        }
    )


@pytest.mark.parametrize(
    ("body", "said"),
    [
        ([1, 2], "is a JSON object"),
        ({"input_ids": []}, "non-empty list"),
        ({"input_ids": [1], "top_p": 0.5}, "unknown field 'top_p'"),
        ({"input_ids": [1], "max_new_tokens": 0}, "expected 1 to 9"),
        ({"input_ids": [1] * 10}, "the prompt has 10 tokens, and the bundle takes 10"),
        ({"input_ids": [1], "temperature": -1}, "temperature"),
        ({"input_ids": [1], "seed": "x"}, "seed"),
    ],
)
def test_requests_are_checked_against_the_bundle(body, said):
    spec = _spec()
    with pytest.raises(GenerateRequestError, match=said.replace("(", r"\(")):
        GenerateRequest.parse(body, spec)


def test_generation_stops_at_an_end_of_sequence_token_and_keeps_it():
    import numpy as np

    from mopar.runtime.generate import generate

    spec = _spec(
        cache=(CachePair(past="past_0", present="output_1", axis=1),),
        max_seq_len=16,
        vocab_size=8,
        eos_token_ids=(3,),
    )
    picks, seen = iter([5, 3, 6]), []

    def step(feeds):
        seen.append(feeds["past_0"].shape[1])  # the cache the step before returned
        logits = np.zeros((1, 8), np.float32)
        logits[0, next(picks)] = 1.0
        grown = np.zeros((1, feeds["past_0"].shape[1] + feeds["input_ids"].shape[1]), np.float32)
        return {"output_0": logits, "output_1": grown}

    request = GenerateRequest(input_ids=(1, 2, 4), max_new_tokens=10)
    done = generate(step, spec, request, {"past_0": np.zeros((1, 0), np.float32)})
    assert done.tokens == (5, 3) and done.stopped == "eos"  # the end-of-sequence token kept
    assert seen == [0, 3]  # the prompt's step, then one token's


def test_a_malformed_generation_section_is_a_bundle_error():
    with pytest.raises(BundleError, match="recompile the bundle with --generate"):
        GenerationSpec.from_dict({"function": "s0"}, where="plan.json")


def test_generate_refuses_a_pt2_which_holds_one_forward(tmp_path):
    import torch

    from mopar.cli import cli

    m = torch.nn.Linear(4, 4)
    torch.export.save(torch.export.export(m, (torch.randn(1, 4),)), tmp_path / "m.pt2")
    args = ["compile", str(tmp_path / "m.pt2"), "--generate", "--out", str(tmp_path / "b")]
    result = CliRunner().invoke(cli, args)  # in process: the refusal is no process's
    assert result.exit_code == 1
    assert "save_pretrained folder" in result.stderr
    assert not (tmp_path / "b").exists()


# The default run's llama folder (test_greedy_tokens_are_transformers_own, and the bfloat16 one
# below) covers the decoding loop and its cache; each other family runs with the slow ones.
@pytest.mark.parametrize(
    "family",
    [
        pytest.param("gpt2", marks=pytest.mark.slow),
        pytest.param("mixtral", marks=pytest.mark.slow),
        pytest.param("qwen2_moe", marks=pytest.mark.slow),
        pytest.param("olmoe", marks=pytest.mark.slow),
    ],
)
def test_each_family_generates_transformers_greedy_tokens(tmp_path_factory, family):
    bundle, expected = _compiled(tmp_path_factory, family)
    for transport in ("shm", "http"):
        assert _generate(bundle, expected, "--transport", transport)["tokens"] == expected["tokens"]


# slow since 16-bit weights are cast at each use (30 s): the default tests cover its parts, a
# bfloat16 slice exact through the handler (test_dtypes) and greedy decoding (float32, above)
@pytest.mark.parametrize(
    ("family", "dtype"),
    [
        pytest.param("llama", "bfloat16", marks=pytest.mark.slow),
        pytest.param("llama", "float16", marks=pytest.mark.slow),
        pytest.param("mixtral", "bfloat16", marks=pytest.mark.slow),
        pytest.param("qwen2_moe", "bfloat16", marks=pytest.mark.slow),
    ],
)
def test_a_half_precision_folder_generates_transformers_greedy_tokens(
    tmp_path_factory, request, family, dtype
):
    """A bfloat16 cache, which numpy cannot hold, is carried as float32 (each of its values
    exactly) and cast back in the step; the step computes in float32 (`float32_compute`)."""
    saved = request.getfixturevalue("saved") if (family, dtype) in SAVED_BY_DEFAULT else None
    bundle, expected = _compiled(tmp_path_factory, family, dtype=dtype, saved=saved)
    assert json.loads((bundle.parent / "model" / "config.json").read_text())["dtype"] == dtype
    for transport in ("shm", "http"):
        assert _generate(bundle, expected, "--transport", transport)["tokens"] == expected["tokens"]


def test_the_lambda_handler_generates_for_a_direct_invoke_and_an_http_event(llama):
    from mopar.runtime.aws import LambdaFunction

    bundle, expected = llama
    plan = json.loads((bundle / "plan.json").read_text())
    handler = LambdaFunction(bundle / "functions" / plan["generation"]["function"], {})
    request = {"input_ids": expected["prompt"], "max_new_tokens": 32}
    assert handler(request, None)["tokens"] == expected["tokens"]
    event = {"body": json.dumps(request), "headers": {"Content-Type": "application/json"}}
    answer = handler(event, None)
    assert answer["statusCode"] == 200
    assert json.loads(answer["body"])["tokens"] == expected["tokens"]
    refused = handler({**event, "body": json.dumps({"input_ids": [-1]})}, None)
    assert refused["statusCode"] == 400
    assert "token ids from 0 to 255" in json.loads(refused["body"])["error"]
    assert handler({"input_ids": [1], "max_new_tokens": 99}, None)["status"] == 400
    said = handler({"text": expected["prompt_text"], "max_new_tokens": 32}, None)
    assert said["tokens"] == expected["tokens"] and said["text"] == expected["text"]


def test_compile_times_a_generation_and_simulate_bills_whole_generations(llama):
    from mopar.bundle.document import read_document
    from mopar.config import PROFILES_DIR
    from mopar.facts import load_platform
    from mopar.sim.model import functions_of

    bundle, _ = llama
    document = read_document(bundle)
    timing = document.generation.timing
    assert timing.prompt_tokens == 8 and timing.new_tokens == 32  # 48 - 8 leaves room for 32
    assert 0 < timing.token_p50_ms <= timing.token_p95_ms
    (billed,) = [n for n in document.plan["notes"] if "per 1,000 tokens" in n]
    steps = timing.request_ms(32) / timing.first_token_ms  # the timed shape, the priced step
    said = re.search(r"([\d.]+) times the priced step, as compile's timed generation", billed)
    assert said and float(said[1]) == pytest.approx(steps, rel=0.01) and "prompt of 8:" in billed
    function = json.loads((bundle / "functions" / "s0" / "function.json").read_text())
    assert "timing" not in function["generation"]  # a measurement, not what the function needs
    platform = load_platform(PROFILES_DIR, "lambda")
    for tokens in (1, 10):
        (main,) = functions_of(document, platform, new_tokens=tokens)
        assert main.service.median_ms == pytest.approx(timing.request_ms(tokens))
        assert f"a generation of {tokens} tokens" in main.service.source
    (long,) = functions_of(document, platform, new_tokens=10, prompt_tokens=32)  # 4x the prompt
    assert long.service.median_ms == pytest.approx(
        4 * timing.first_token_ms + 9 * timing.token_p50_ms
    )
    bills = {}
    for prompt in ("8", "32"):
        proc = mopar("simulate", bundle, "--rate", "1", "--requests", "50", "--new-tokens", "10",
                     "--prompt-tokens", prompt, "--target", "lambda", "--json")  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        result = bills[prompt] = json.loads(proc.stdout)
        assert result["new_tokens"] == 10
        assert result["cost_per_1k_tokens_usd"] == pytest.approx(
            result["cost_per_1m_usd"] / 1e3 / 10, rel=1e-5
        )
    assert bills["32"]["usd"] > bills["8"]["usd"]  # a longer prompt's step, billed per ms


def test_run_times_generations_of_the_reference_prompt(llama):
    bundle, _ = llama
    proc = mopar("run", bundle, "--requests", "3", "--max-new-tokens", "5", "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    figures = json.loads(proc.stdout)["generation"]
    assert figures["requests"] == 3 and figures["new_tokens"] == 15
    assert figures["token_p50_ms"] <= figures["token_p95_ms"]


@pytest.fixture(scope="module")
def mixtral_experts(tmp_path_factory, saved):
    return _compiled(
        tmp_path_factory, "mixtral", "--experts", "functions", "--hot-experts", "none", saved=saved
    )


@pytest.mark.parametrize("transport", ["shm", "http", "inprocess"])
def test_a_main_function_calls_its_expert_functions_per_step(mixtral_experts, transport):
    bundle, expected = mixtral_experts
    spec = json.loads((bundle / "plan.json").read_text())["generation"]
    assert spec["path"][0] == spec["function"] and len(spec["path"]) > 1
    assert len(spec["callees"]) >= 2 and all(".e" in name for name in spec["callees"])
    answer = _generate(bundle, expected, "--transport", transport)
    assert answer["tokens"] == expected["tokens"]
    by_step = answer["prewarm_by_step"]
    assert len(by_step) == len(expected["tokens"])  # the prompt's step, then each token's
    assert 0 <= answer["prewarm_precision"] <= 1 and 0 <= answer["prewarm_recall"] <= 1


@pytest.mark.parametrize("transport", ["inprocess", "http"])
def test_text_to_a_bundle_without_a_tokenizer_is_refused_in_one_line(mixtral_experts, transport):
    bundle, _ = mixtral_experts
    proc = mopar("generate", bundle, "--text", "hello", "--transport", transport)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "carries no tokenizer" in proc.stderr


def test_foresight_scores_each_layer_against_the_prediction_before_it():
    from mopar.runtime.generate import Foresight

    f = Foresight()
    f.begin()
    f.layer(["b.e0", "b.e1"], ["a.e0"])  # the first layer: nothing foreseen it
    f.layer(["c.e1"], ["b.e1", "b.e2"])  # 1 of 2 predicted called; 1 of 2 called predicted
    f.layer(None, ["c.e1"])  # foreseen; predicts nothing of a next one
    f.begin()
    f.layer(None, ["a.e0"])
    f.layer(["c.e0"], ["b.e0"])  # no layer before b predicted: b is not scored
    assert f.scores() == ((2, 3, 3), (0, 0, 0))
    assert f.cold() == ()  # no gateway told of a wait


def test_foresight_counts_the_calls_that_waited_for_a_start_and_the_steps_wait():
    from mopar.runtime.generate import Foresight

    f = Foresight()
    f.begin()
    f.layer(["b.e0"], ["a.e0", "a.e1"], [0.0, 0.0])
    f.layer(None, ["b.e0", "b.e1"], [300.0, 500.0])  # side by side: the step waits 500
    f.begin()
    f.layer(["b.e1"], ["a.e0"], [0.0])
    f.layer(None, ["b.e1"], [40.0])  # a warm-up that came late: the rest of the start
    assert f.cold() == ((2, 500.0), (1, 40.0))


def test_cold_expert_functions_start_behind_a_gateway_and_steps_count_their_waits(
    mixtral_experts,
):
    bundle, expected = mixtral_experts
    answer = _generate(bundle, expected, "--transport", "shm", "--cold-experts", "--requests", "2")
    assert answer["tokens"] == expected["tokens"]
    g = answer["gateway"]
    assert g["calls"] == g["warm"] + g["prewarmed"] + g["late"] + g["cold"]
    assert g["cold"] >= 1 and g["start_ms"] > 0  # scaled to zero: the first calls start them
    assert answer["cold_calls"] == g["cold"] + g["late"]  # each waited, and its step knew
    assert 0 < answer["warm_steps"] < 1  # the first request's first steps waited
    assert g["unused_starts"] == 0  # never idle long enough to be stopped
    refused = mopar("generate", bundle, "--input-ids", "1", "--transport", "inprocess",
                    "--cold-experts")  # fmt: skip
    assert refused.returncode == 1 and "--transport shm or http" in refused.stderr


def test_the_gateway_starts_on_a_call_or_a_warm_up_and_stops_the_idle(mixtral_experts, tmp_path):
    from mopar.runner.gateway import ColdGateway
    from mopar.runtime.server import COLD_HEADER, WARM_HEADER
    from mopar.runtime.transports.http import HttpClient

    bundle, _ = mixtral_experts
    spec = json.loads((bundle / "plan.json").read_text())["generation"]
    a, b = spec["callees"][:2]
    env = {**os.environ, "PORT": "0", "MOPAR_HOST": "127.0.0.1", "MOPAR_TRANSPORT": "http"}
    gateway = ColdGateway(
        {n: bundle / "functions" / n for n in (a, b)}, env, idle_s=1.0, timeout_s=60
    )  # idle long enough that a busy machine does not stop a before its second warm-up
    try:
        first = HttpClient(gateway.url(a)).post(b"", {WARM_HEADER: "1"})
        assert first.status == 200 and gateway.counts().warm_starts == 1
        assert gateway._instances[a].ready.wait(60)  # started by the warm-up alone
        warmed = HttpClient(gateway.url(a)).post(b"", {WARM_HEADER: "1"})
        assert warmed.status == 200 and gateway.counts().warm_starts == 1  # already up
        none = HttpClient(gateway.url(b)).post(b"{}", {"Content-Type": "application/json"})
        assert float(none.headers[COLD_HEADER.lower()]) > 0  # b was stopped: it waited
        deadline = time.monotonic() + 30
        while gateway._instances and time.monotonic() < deadline:  # idle 1 s: stopped
            time.sleep(0.05)
        counts = gateway.counts()
        assert not gateway._instances and counts.unused_starts == 1  # a's start, never called
        assert (counts.calls, counts.cold, counts.warmups) == (1, 1, 2)
        missing = HttpClient(gateway.url("nobody")).post(b"", {})
        assert missing.status == 404
    finally:
        gateway.close()


def test_simulate_deploys_a_main_function_that_calls_its_experts_per_token(mixtral_experts):
    from mopar.bundle.document import read_document
    from mopar.config import PROFILES_DIR
    from mopar.facts import load_platform
    from mopar.sim.model import functions_of

    bundle, _ = mixtral_experts
    document = read_document(bundle)
    spec = document.generation
    planned = {f["name"]: f["memory_mb"] for f in document.plan["functions"]}
    lam = load_platform(PROFILES_DIR, "lambda")
    main, *callees = functions_of(document, lam, new_tokens=7)
    assert main.name == spec.function and main.steps == 7 and not main.called
    timing = spec.timing  # the main function measured in a process of its own, as deployed
    assert 0 < timing.main_peak_rss_mb < timing.main_need_mb
    assert main.memory_mb == lam.round_mb(timing.main_need_mb)
    assert main.memory_mb < sum(max(planned[u], lam.min_mb) for u in spec.path)  # runtime once
    assert [c.name for c in callees] == list(spec.callees)
    assert all(c.called and c.caller == main.name and 0 < c.probability <= 1 for c in callees)
    proc = mopar(
        "simulate", bundle, "--rate", "1", "--requests", "30", "--new-tokens", "7", "--json"
    )
    assert proc.returncode == 0, proc.stderr
    figures = {f["name"]: f for f in json.loads(proc.stdout)["functions"]}
    assert set(figures) == {main.name, *spec.callees}


@pytest.mark.parametrize("transport", ["http", "inprocess"])
def test_text_in_and_out_with_the_folders_tokenizer(llama, transport):
    bundle, expected = llama
    proc = mopar(
        "generate", bundle, "--text", expected["prompt_text"], "--max-new-tokens", "32",
        "--transport", transport, "--json",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    answer = json.loads(proc.stdout)
    assert answer["tokens"] == expected["tokens"]
    assert answer["text"] == expected["text"]
    main = json.loads((bundle / "plan.json").read_text())["generation"]["function"]
    assert (bundle / "functions" / main / "tokenizer.json").is_file()  # the function tokenizes
    from importlib import metadata

    reqs = (bundle / "functions" / main / "requirements.txt").read_text().split()
    assert f"tokenizers=={metadata.version('tokenizers')}" in reqs  # its image installs it
    both = mopar("generate", bundle, "--text", "w1", "--input-ids", "1")
    assert both.returncode == 1 and "one of --input-ids" in both.stderr


def test_plan_prices_the_step_from_the_config_alone(llama):
    from mopar.cli import cli

    bundle, _ = llama
    args = ["plan", str(bundle.parent / "model"), "--generate", "--max-seq-len", "48", "--json"]
    result = CliRunner().invoke(cli, args)  # in process: compile's subprocess loaded it fresh
    assert result.exit_code == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["functions"] and any("generation:" in note for note in plan["notes"])
    cost = plan["bill"]["generation"]  # a whole generation billed, not one step
    step = plan["bill"]["cost_per_1m_usd"]
    assert cost["new_tokens"] == 32 and cost["prompt_tokens"] >= 1
    generation = cost["cost_per_1m_generations_usd"]  # one fee, 32 steps' time (6 digits)
    assert step * (1 - 1e-5) <= generation <= 32 * step
    step_ms = sum(f["time_ms"] for f in plan["functions"])  # the main function runs them all
    assert cost["generation_ms"] == pytest.approx(32 * step_ms, rel=1e-3)
    per_1k = cost["cost_per_1m_generations_usd"] / 1e6 / 32 * 1e3
    assert cost["cost_per_1k_tokens_usd"] == pytest.approx(per_1k, rel=1e-4)
    assert any("per 1,000 tokens" in note for note in plan["notes"])


def test_a_decoder_that_fits_no_main_function_is_refused_with_what_would_fit():
    from mopar.cli import cli

    config = Path(__file__).parent.parent / "examples" / "configs" / "llama-2-7b.json"
    result = CliRunner().invoke(cli, ["plan", str(config), "--target", "lambda", "--generate"])
    assert result.exit_code == 1, result.output
    said = result.stderr.strip()
    assert len(said.splitlines()) == 1 and "Traceback" not in said
    assert "one main function of" in said and "lambda's 10,240 MB" in said
    assert "a decoder of at most" in said and "--target openfaas" in said


def test_a_main_function_deploys_with_its_units_and_calls_its_expert_functions(
    mixtral_experts, tmp_path
):
    import yaml

    bundle, _ = mixtral_experts
    spec = json.loads((bundle / "plan.json").read_text())["generation"]
    main = bundle / "functions" / spec["function"]
    assert sorted(p.name for p in (main / "units").iterdir()) == sorted(spec["path"][1:])
    assert all((main / "units" / u / "model.onnx").is_file() for u in spec["path"][1:])
    stack = yaml.safe_load((bundle / "stack.yml").read_text())["functions"]
    handlers = {f["handler"].rsplit("/", 1)[1]: f for f in stack.values()}
    assert set(handlers) == {spec["function"], *spec["callees"]}  # the other units: inside
    calls = handlers[spec["function"]]["environment"]["MOPAR_CALLS"].split(",")
    assert len(calls) == len(spec["callees"])
    assert not handlers[spec["function"]]["environment"]["MOPAR_NEXT"]
    from tests.test_sam import _cfn_lint, lambda_template_of

    lambda_template_of(bundle, tmp_path / "template.yaml")  # the same plan for Lambda
    template = (tmp_path / "template.yaml").read_text()
    assert template.count("AWS::Serverless::Function") == 1 + len(spec["callees"])
    linted = _cfn_lint(tmp_path / "template.yaml")
    assert linted.returncode == 0, linted.stdout + linted.stderr


def test_a_main_function_sends_warm_ups_for_the_experts_its_dispatches_predict(
    mixtral_experts,
):
    from mopar.bundle.layout import FUNCTIONS_DIR
    from mopar.runner.generation import local_fork
    from mopar.runtime.framed import SliceFunction
    from mopar.runtime.generate import MainFunction

    bundle, expected = mixtral_experts
    spec = json.loads((bundle / "plan.json").read_text())["generation"]
    folders = {n: bundle / FUNCTIONS_DIR / n for n in (*spec["path"], *spec["callees"])}
    sent: list[list[str]] = []
    main = MainFunction.of(
        SliceFunction(folders[spec["function"]]), local_fork(folders), sent.append
    )
    done = main.answer({"input_ids": expected["prompt"], "max_new_tokens": 4})
    assert done.tokens == tuple(expected["tokens"][:4])
    assert len(sent) == 4  # one prediction a step, by the first layer's dispatch
    assert all(names and set(names) <= set(spec["callees"]) for names in sent)


def test_a_transformers_model_object_compiles_for_generation_in_the_api(tmp_path):
    import torch
    import transformers

    import mopar
    from mopar.runner.bundle import read_manifest
    from mopar.runner.generation import Generation

    torch.manual_seed(1)
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    prompt = torch.randint(0, 128, (1, 10))
    with torch.no_grad():
        want = model.generate(prompt, max_new_tokens=12, do_sample=False)[0, 10:].tolist()
    mopar.compile(model, out=tmp_path / "b", generate=True, max_seq_len=32)
    request = GenerateRequest(input_ids=tuple(prompt[0].tolist()), max_new_tokens=12)
    with Generation.of(read_manifest(tmp_path / "b"), transport="inprocess") as generation:
        got, _ = generation.run(request)
    assert list(got.tokens) == want


def test_serve_generates_for_openais_client_and_at_generate(llama):
    """`mopar serve` of a --generate bundle serves the generation loop: the openai client's
    completions get transformers' greedy tokens, as token ids and as text; /generate answers
    as documented; what is not served is refused in OpenAI's error form."""
    openai = pytest.importorskip("openai")
    from tests.conftest import served

    bundle, expected = llama
    model = json.loads((bundle / "plan.json").read_text())["plan"]["model"]
    with served(bundle, "--transport", "http") as (address, _):
        client = openai.OpenAI(base_url=f"http://{address}/v1", api_key="none")
        assert [m.id for m in client.models.list().data] == [model]
        done = client.completions.create(model=model, prompt=expected["prompt"], max_tokens=32)
        (choice,) = done.choices
        assert choice.model_extra["token_ids"] == expected["tokens"]
        assert choice.text == expected["text"] and choice.finish_reason == "length"
        assert done.usage.prompt_tokens == len(expected["prompt"])
        assert done.usage.completion_tokens == 32
        said = client.completions.create(model=model, prompt=expected["prompt_text"], max_tokens=32)
        assert said.choices[0].model_extra["token_ids"] == expected["tokens"]
        with pytest.raises(openai.BadRequestError, match="n 2 is not served"):
            client.completions.create(model=model, prompt=[1, 2], max_tokens=2, n=2)
        with pytest.raises(openai.NotFoundError, match="not served here"):
            client.completions.create(model="other", prompt=[1, 2], max_tokens=2)
        body = json.dumps({"input_ids": expected["prompt"], "max_new_tokens": 32}).encode()
        request = urllib.request.Request(
            f"http://{address}/generate", data=body,
            headers={"Content-Type": "application/json"},
        )  # fmt: skip
        with urllib.request.urlopen(request, timeout=120) as answer:
            assert json.loads(answer.read())["tokens"] == expected["tokens"]
