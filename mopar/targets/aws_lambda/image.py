"""How a Lambda function's image is built: ``Dockerfile.lambda`` on the bundle root, as
``sam build`` does, with ``SLICE``; its context holds the Dockerfile, the template's
requirements, installer and runtime copy, and the function's folder."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from mopar.target import ImageBuildSpec

__all__ = ["RECIPE", "LambdaImage"]

TEMPLATE = "template/mopar-onnx"


@dataclass(frozen=True, kw_only=True)
class LambdaImage:
    """The `mopar.target.ImageRecipe` of a Lambda function (its Dockerfile also installs
    awslambdaric and boto3, not pinned to the compiler's environment)."""

    dockerfile: str = "Dockerfile.lambda"
    default_base: str = "python:3.11-slim"
    tag_suffix: str = "-lambda"
    wheels: str = f"{TEMPLATE}/wheels"
    unpinned: bool = True

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
            files={
                self.dockerfile: root / self.dockerfile,
                **{
                    f"{TEMPLATE}/{k}": p
                    for k, p in template.items()
                    if k in ("requirements.txt", "install.sh") or k.startswith("mopar/")
                },
                **{f"functions/{function}/{k}": p for k, p in own.items()},
            },
            dockerfile=self.dockerfile,
            stage=None,
            build_args={"BASE_IMAGE": base_image, "PIP_OFFLINE": "true", "SLICE": function},
        )


RECIPE = LambdaImage()
