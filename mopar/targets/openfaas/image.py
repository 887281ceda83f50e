"""How an OpenFaaS function's image is built: the template's ``Dockerfile``, on the context
``faas-cli build`` assembles in ``build/<function>/`` (the template folder, and the function's
folder as ``function/``). The stage built is ``function`` (the function server alone), or with
``watchdog`` the last one, ``ship``, which adds OpenFaaS's of-watchdog and is what
``faas-cli build`` builds (tagged also as ``stack.yml``'s image)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from mopar.target import ImageBuildSpec

__all__ = ["RECIPE", "TemplateImage"]


@dataclass(frozen=True, kw_only=True)
class TemplateImage:
    """The `mopar.target.ImageRecipe` of an OpenFaaS function."""

    dockerfile: str = "template/mopar-onnx/Dockerfile"
    default_base: str = "python:3.11-slim-bookworm"
    tag_suffix: str = ""
    wheels: str = "wheels"
    unpinned: bool = False

    def spec(
        self,
        *,
        root: Path,
        model: str,
        function: str,
        template: Mapping[str, Path],
        own: Mapping[str, Path],
        base_image: str,
        watchdog: bool,
    ) -> ImageBuildSpec:
        return ImageBuildSpec(
            files={**template, **{f"function/{k}": p for k, p in own.items()}},
            dockerfile="Dockerfile",
            stage=None if watchdog else "function",
            build_args={"BASE_IMAGE": base_image, "PIP_OFFLINE": "true"},
            aliases=(f"localhost/{model}-{function}:latest".lower(),) if watchdog else (),
        )


RECIPE = TemplateImage()
