"""acme's images: its own Dockerfile, the function's folder as ``function/``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from mopar.target import ImageBuildSpec


@dataclass(frozen=True, kw_only=True)
class AcmeImage:
    dockerfile: str = "Dockerfile.acme"
    default_base: str = "python:3.11-slim"
    tag_suffix: str = "-acme"
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
            files={
                self.dockerfile: root / self.dockerfile,
                **{f"function/{k}": p for k, p in own.items()},
            },
            dockerfile=self.dockerfile,
            stage=None,
            build_args={"BASE_IMAGE": base_image},
        )


RECIPE = AcmeImage()
