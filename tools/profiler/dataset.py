"""The profiler's dataset file: its columns, a resumable appender, and a reader.

One row per measured sample, operator or layer. Numbers are plain decimals; shapes and configs
are JSON; a blank cell is a missing value. Units are in the column names (``_bytes``, ``_ms``).

Columns:
    sample_id       stable 16-hex-digit id (the resume key)
    source          ``op`` (a swept operator) or ``layer`` (a layer of an example model)
    op_type         the sweep's op name (a feature family name), or ``layer``
    variant         the op's form (``regular``, ``depthwise``, ``2d``, ``max``, ``gelu``...)
    family          the feature family (`mopar.profile.features.FAMILIES`); a layer's dominant one
    dominant_op     the op itself, or the ATen name of a layer's heaviest node
    model, model_family, layer, module_type, layer_index, model_layers
                    which example layer (blank for operators)
    config          JSON: the sweep's parameters, or a layer's model factory and input specs
    params, param_bytes, flops, bytes_in, bytes_out, input_shapes, output_shape, output_shapes,
    n_inputs, groups, kernel_size
                    features, as `mopar.profile.features` reads them
    onnx_ops        JSON list of the distinct ONNX op types measured
    memory_bytes    peak RSS over the runtime baseline, loading and running (the target)
    load_bytes, session_bytes, run_bytes
                    its parts: peak while loading, held after loading, peak while running
    time_ms_1t      median run at 1 intra-op thread
    time_ms_nt      median run at ``threads_nt`` intra-op threads
    load_ms         session creation
    runs_1t, runs_nt
                    timed runs behind each median
    threads_nt, cpus, cpu_model, ort_version, opset, mem_method, collected_at
                    how and where it was measured
    error           why the sample has no measurement (blank when it has one)

See `tools.profiler.measure` for how the figures are taken.
"""

from __future__ import annotations

import csv
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mopar.errors import MoparError, Option

__all__ = ["COLUMNS", "Dataset", "read_rows"]

COLUMNS: tuple[str, ...] = (
    # identity
    "sample_id",
    "source",
    "op_type",
    "variant",
    "family",
    "dominant_op",
    "model",
    "model_family",
    "layer",
    "module_type",
    "layer_index",
    "model_layers",
    "config",
    # features
    "params",
    "param_bytes",
    "flops",
    "bytes_in",
    "bytes_out",
    "input_shapes",
    "output_shape",
    "output_shapes",
    "n_inputs",
    "groups",
    "kernel_size",
    "onnx_ops",
    # measurements
    "memory_bytes",
    "load_bytes",
    "session_bytes",
    "run_bytes",
    "time_ms_1t",
    "time_ms_nt",
    "load_ms",
    "runs_1t",
    "runs_nt",
    # run metadata
    "threads_nt",
    "cpus",
    "cpu_model",
    "ort_version",
    "opset",
    "mem_method",
    "collected_at",
    "error",
)


class Dataset:
    """A dataset file opened for appending: which samples it holds, and one row at a time.

    Raises:
        MoparError: the file exists with other columns.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.done: set[str] = set()
        # a layer row's ``config`` (its model) -> (layer rows present, layers in the model)
        self.layers_done: dict[str, tuple[int, int]] = {}
        if path.exists() and path.stat().st_size:
            self._read()
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "w", newline="") as f:
                csv.writer(f).writerow(COLUMNS)

    def _read(self) -> None:
        _drop_partial_line(self.path)
        with open(self.path, newline="") as f:
            reader = csv.DictReader(f)
            if tuple(reader.fieldnames or ()) != COLUMNS:
                raise MoparError(
                    f"{self.path} has columns {list(reader.fieldnames or ())[:6]}..., not those of "
                    "this mopar's dataset; collect into a new ",
                    Option("out"),
                    " file",
                )
            for row in reader:
                self.done.add(row["sample_id"])
                if row["source"] == "layer":
                    have, _ = self.layers_done.get(row["config"], (0, 0))
                    self.layers_done[row["config"]] = (have + 1, int(row["model_layers"] or 0))

    def append(self, row: dict[str, Any]) -> None:
        """Write ``row`` (missing columns blank) and flush it, so an interrupt loses nothing."""
        with open(self.path, "a", newline="") as f:
            csv.writer(f).writerow([row.get(c, "") for c in COLUMNS])
            f.flush()
        self.done.add(row["sample_id"])


def _drop_partial_line(path: Path) -> None:
    """Cut a last line that a killed run left unfinished, so appending starts on a fresh line."""
    with open(path, "rb+") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        f.seek(max(0, size - 1))
        if size and f.read(1) != b"\n":
            f.seek(0)
            data = f.read()
            f.truncate(data.rfind(b"\n") + 1)


def read_rows(path: Path) -> Iterator[dict[str, str]]:
    """The rows of a dataset file, as strings (blank: missing)."""
    with open(path, newline="") as f:
        yield from csv.DictReader(f)
