"""The reference users would deploy instead of mopar: the model served by eager PyTorch in one
function, as the usual Lambda container does (python, torch, the model's code and weights).

Read in this order: `TorchRun` (what is measured), `measure_torch` (the parent: starts a fresh
process and reads its one-line JSON answer), then `serve` (the child: load, one warm-up request,
the measured requests, peak RSS).

The child is a fresh interpreter running this file by its path, so that it imports neither mopar
nor anything of the compiler: its peak RSS is what a function holding torch and the model would
peak at. No pickle crosses the pipe: inputs go over as an ``.npz`` file (read with
``allow_pickle=False``) and the answer comes back as JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = ["TorchRun", "measure_torch", "serve"]


@dataclass(frozen=True, kw_only=True)
class TorchRun:
    """One eager-PyTorch run of a model.

    Attributes:
        p50_ms, p95_ms: median and 95th percentile of the measured requests, ms.
        peak_rss_mb: the serving process's peak RSS (VmHWM), MB: interpreter, torch, the model.
        load_ms: importing torch and building the model, ms (a cold start's INIT).
        max_rel_err: max |out - expected| / max |expected| over the outputs, in flatten order.
        requests: measured requests, after one warm-up.
    """

    p50_ms: float
    p95_ms: float
    peak_rss_mb: float
    load_ms: float
    max_rel_err: float
    requests: int


def measure_torch(
    factory: str,
    inputs: dict[str, np.ndarray],
    expected: dict[str, np.ndarray],
    *,
    requests: int,
    timeout_s: float = 600.0,
) -> TorchRun:
    """Serve ``requests`` requests of ``inputs`` through ``factory`` (``"package.module:fn"``,
    called with no arguments) in a fresh process under eager PyTorch.

    Raises:
        MoparError: the process failed or timed out; the message holds its last error line.
    """
    from mopar.errors import MoparError

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    with tempfile.TemporaryDirectory(prefix="mopar-torch-ref-") as tmp:
        npz = Path(tmp) / "request.npz"
        np.savez(
            npz,
            **{f"input.{k}": v for k, v in inputs.items()},
            **{f"output.{k}": v for k, v in expected.items()},
        )
        try:
            proc = subprocess.run(
                [sys.executable, __file__, factory, str(npz), str(requests)],
                capture_output=True,
                text=True,
                timeout=timeout_s,
                env=env,
            )
        except subprocess.TimeoutExpired:
            raise MoparError(
                f"the eager PyTorch reference of {factory} took over {timeout_s:g} s; "
                "pass fewer --requests"
            ) from None
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no error output"])[-1]
        raise MoparError(f"the eager PyTorch reference of {factory} failed: {last}")
    return TorchRun(**json.loads(proc.stdout.strip().splitlines()[-1]))


def serve(factory: str, npz: Path, requests: int) -> TorchRun:
    """The child's work: build the model, serve one warm-up and ``requests`` measured requests."""
    start = time.perf_counter()
    import importlib

    import torch
    from torch.utils._pytree import tree_leaves

    module, _, name = factory.partition(":")
    model = getattr(importlib.import_module(module), name)().eval()
    load_ms = (time.perf_counter() - start) * 1e3
    with np.load(npz, allow_pickle=False) as data:
        kwargs = {
            k.removeprefix("input."): torch.from_numpy(data[k])
            for k in data.files
            if k.startswith("input.")
        }
        expected = [data[k] for k in data.files if k.startswith("output.")]
    times = []
    with torch.inference_mode():
        out = model(**kwargs)  # warm-up
        for _ in range(requests):
            t0 = time.perf_counter()
            out = model(**kwargs)
            times.append((time.perf_counter() - t0) * 1e3)
    got = [t.detach().numpy() for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
    return TorchRun(
        p50_ms=round(float(np.percentile(times, 50)), 3),
        p95_ms=round(float(np.percentile(times, 95)), 3),
        peak_rss_mb=round(_peak_rss_mb(), 1),
        load_ms=round(load_ms, 1),
        max_rel_err=_max_rel_err(got, expected),
        requests=requests,
    )


def _max_rel_err(got: list[np.ndarray], expected: list[np.ndarray]) -> float:
    if len(got) != len(expected) or any(g.shape != e.shape for g, e in zip(got, expected)):
        return float("inf")
    errors = [
        float(np.max(np.abs(g - e))) / max(float(np.max(np.abs(e))), 1e-12)
        for g, e in zip(got, expected)
        if e.size
    ]
    return max(errors, default=0.0)


def _peak_rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


if __name__ == "__main__":
    from dataclasses import asdict

    run = serve(sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]))
    print(json.dumps(asdict(run)))
