"""The int8 kernels a function's quantised weights run on, and the int8 schemes worth measuring
for them.

onnxruntime's CPU int8 kernels differ by instruction set, and so does what int8 does to a
model's outputs (onnxruntime's quantisation notes; its issues 6004 and 5849):

- ``avx2``: x86 without VNNI. u8 x s8 products are summed in pairs into 16 bits
  (``vpmaddubsw``), which saturates: 255 x 127 x 2 is over 32,767. 7-bit weights
  (``reduce_range``) keep every pair within it; u8 x u8 takes a kernel that widens first,
  exact and slower.
- ``vnni``: x86 with AVX512-VNNI or AVX-VNNI. ``vpdpbusd`` sums into 32 bits: nothing saturates.
- ``arm64-dot``: Armv8.2's dot-product instructions (Graviton2's Neoverse N1), into 32 bits.

The target's kernels are a fact of the target (``platforms.json``'s ``int8_kernels``); the
compiling machine's are read from its CPU (`this_machine`). Accuracy is measured here, so a
scheme whose outputs depend on the kernels (8-bit signed weights, which saturate on ``avx2``
only) is measured for a target only where this machine's kernels are at least as lossy as the
target's (`Scheme.judged_here`).

Read in this order: `Scheme`, `SCHEMES`, `schemes_for`, `this_machine`.
"""

from __future__ import annotations

import platform as _platform
from dataclasses import dataclass
from pathlib import Path

__all__ = ["KERNELS", "SCHEMES", "Scheme", "schemes_for", "this_machine", "describe"]

KERNELS = {
    "avx2": "AVX2 u8 x s8 (vpmaddubsw: pairs summed in 16 bits, saturating)",
    "vnni": "AVX512-VNNI or AVX-VNNI (vpdpbusd: summed in 32 bits)",
    "arm64-dot": "Armv8.2 dot product (sdot/udot: summed in 32 bits)",
}
"""Each int8 kernel family, in words."""

SATURATES = frozenset({"avx2"})
"""The kernel families whose u8 x s8 sums saturate with 8-bit weights."""


@dataclass(frozen=True)
class Scheme:
    """How a function's int8 weights are made (`mopar.compress.quantize.write_form`).

    Attributes:
        weights: ``s8`` (signed 8-bit weights: u8 x s8 kernels) or ``u8`` (u8 x u8).
        reduce_range: 7-bit weights, so no pair of products saturates on ``avx2``.
        float_convs: how many convolutions, first in the graph, keep float weights (the
            layers whose error every later one carries).
    """

    weights: str = "s8"
    reduce_range: bool = False
    float_convs: int = 0

    @property
    def name(self) -> str:
        """``u8s8``, ``u8s8 7-bit``, ``u8u8``, with ``, first 3 convs float`` where so."""
        text = f"u8{self.weights}" + (" 7-bit" if self.reduce_range else "")
        return text + (f", first {self.float_convs} convs float" if self.float_convs else "")

    def judged_here(self, target: str, here: str) -> bool:
        """Whether this machine's kernels (``here``) measure this scheme's accuracy for the
        ``target``'s: exactly, or more lossily (only signed 8-bit weights differ by kernel)."""
        if self.weights != "s8" or self.reduce_range:
            return True
        return target == here or here in SATURATES or target not in SATURATES


SCHEMES = (
    Scheme(),
    Scheme(reduce_range=True),
    Scheme(reduce_range=True, float_convs=1),
    Scheme(reduce_range=True, float_convs=3),
    Scheme(weights="u8"),
)
"""The int8 schemes measured, fastest first where they apply: u8 x s8 with 8-bit weights, with
7-bit ones, with the first convolutions left float, and u8 x u8 (on ``avx2`` the slowest:
0.23x the speed of u8 x s8 on EfficientNet-Lite0 here)."""


def schemes_for(target: str, here: str, *, convs: bool) -> tuple[Scheme, ...]:
    """The schemes worth measuring for a function run on ``target``'s kernels, measured on
    ``here``'s: those this machine judges for it, and those that leave convolutions float only
    where the function has convolutions."""
    return tuple(s for s in SCHEMES if s.judged_here(target, here) and (convs or not s.float_convs))


def this_machine(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The int8 kernel family of this machine's CPU, from its flags."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        text = ""
    flags = set()
    for line in text.splitlines():
        if line.split(":")[0].strip() in ("flags", "Features"):
            flags |= set(line.split(":", 1)[1].split())
            break
    if _platform.machine() in ("aarch64", "arm64"):
        return "arm64-dot" if "asimddp" in flags else "arm64"
    if flags & {"avx512_vnni", "avx_vnni"}:
        return "vnni"
    return "avx2"


def describe(kernels: str) -> str:
    """``kernels`` in words."""
    return KERNELS.get(kernels, kernels)
