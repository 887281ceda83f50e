"""The compile-memory bench (benchmarks.compile_memory) and the Llama examples (examples.llm)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from benchmarks.compile_memory import (
    EXIT,
    STARTUP,
    UNSPLIT,
    CompileMemory,
    Sample,
    _hook_stages,
    by_stage,
    label_at,
    sample_until_exit,
    stage_timeline,
    table,
    tree_sample,
)

MB = 10**6

# A process that touches ``MB`` megabytes, starts a child that touches ``CHILD`` megabytes, says
# "ready" once both hold them, and waits for its stdin to close.
_TREE = textwrap.dedent(
    """
    import subprocess, sys
    held = bytearray(b"\\1") * ({mb} * 10**6)
    child = subprocess.Popen(
        [sys.executable, "-c",
         "import sys; b = bytearray(b'\\\\1') * ({child} * 10**6); print('up', flush=True); "
         "sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    child.stdout.readline()
    print("ready", flush=True)
    sys.stdin.read()
    child.stdin.close()
    child.wait()
    """
)


@pytest.fixture
def tree():
    """A root process holding 60 MB with a child holding 40 MB; both end at teardown."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _TREE.format(mb=60, child=40)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "ready"
    yield proc
    proc.stdin.close()
    proc.wait(timeout=30)


def test_a_tree_sample_sums_the_root_and_its_descendants(tree):
    s = tree_sample(tree.pid)
    assert s is not None and s.processes == 2
    assert s.root_rss_bytes >= 60 * MB
    assert s.rss_bytes >= s.root_rss_bytes + 40 * MB
    # PSS splits the interpreter's shared pages between the two: never above RSS
    assert 100 * MB <= s.pss_bytes <= s.rss_bytes


def test_a_tree_sample_without_pss_reads_rss_alone(tree):
    s = tree_sample(tree.pid, pss=False)
    assert s.pss_bytes is None and s.rss_bytes >= 100 * MB


def test_a_gone_process_has_no_sample():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert tree_sample(proc.pid) is None


def test_sampling_until_exit_reaps_with_the_exit_code_and_the_kernels_peak():
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; b = bytearray(b'\\1') * (50 * 10**6); sys.exit(3)"]
    )
    samples, ended = sample_until_exit(proc, interval=0.01)
    assert ended.returncode == 3 and proc.returncode == 3
    assert ended.max_rss_bytes >= 50 * MB  # ru_maxrss: exact, however few samples were taken
    assert all(s.processes == 1 for s in samples)


def test_a_tree_past_its_limit_is_killed_descendants_included():
    import psutil

    proc = subprocess.Popen(
        [sys.executable, "-c", _TREE.format(mb=60, child=40)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "ready"
    child = psutil.Process(proc.pid).children()[0]
    samples, ended = sample_until_exit(proc, interval=0.01, limit_bytes=50 * MB)
    assert ended.killed and ended.returncode < 0
    assert max(s.rss_bytes for s in samples) > 50 * MB
    child.wait(timeout=10)  # gone too: reaped by init once its parent died
    assert not child.is_running()


def _events(*rows):
    out = []
    for t, kind, value in rows:
        out.append({"t": t, kind: value})
    return out


def test_the_innermost_running_stage_labels_a_moment():
    points = stage_timeline(
        _events(
            (1, "start", "capture"),
            (2, "end", "capture"),
            (2, "start", "plan"),
            (3, "end", "plan"),
            (4, "start", "export"),
            (5, "start", "rewrite"),
            (6, "end", "rewrite"),
            (8, "end", "export"),
            (9, "log", "export unsplit (0/1)"),
            (10, "start", "export"),
            (12, "end", "export"),
            (13, "start", "export"),
            (14, "end", "export"),
        ),
        t0=0,
    )
    at = {t: label_at(points, t) for t in (0.5, 1.5, 2.5, 3.5, 4.5, 5.5, 7, 9.5, 11, 13.5, 15)}
    assert at == {
        0.5: STARTUP,
        1.5: "capture",
        2.5: "plan",
        3.5: "plan",  # between stages: the last one's
        4.5: "export",
        5.5: "rewrite",  # nested in export
        7: "export",  # export again once rewrite ends
        9.5: "export",
        11: UNSPLIT,  # the export after the latency check's progress line
        13.5: "export",  # only the next export is the unsplit one
        15: EXIT,
    }


def test_without_start_events_the_stage_log_records_give_the_spans():
    points = stage_timeline(
        _events(
            (5, "log", "stage capture: 4.000 s"),
            (7, "log", "stage plan: 1.000 s"),
            (7, "log", "verify (1/1)"),
        ),
        t0=0,
    )
    assert [label_at(points, t) for t in (0.5, 2, 5.5, 6.5, 8)] == [
        STARTUP,
        "capture",
        "capture",
        "plan",
        EXIT,
    ]


def test_stage_start_log_records_keep_the_nesting():
    points = stage_timeline(
        _events(
            (1, "log", "stage export: start"),
            (2, "log", "stage rewrite: start"),
            (3, "log", "stage rewrite: 1.000 s"),
            (5, "log", "stage export: 3.000 s"),
        ),
        t0=0,
    )
    assert [label_at(points, t) for t in (0.5, 1.5, 2.5, 4, 6)] == [
        STARTUP,
        "export",
        "rewrite",
        "export",
        EXIT,
    ]


def _sample(t, rss, pss=None, root=0, n=1):
    return Sample(t=t, rss_bytes=rss * MB, pss_bytes=pss, root_rss_bytes=root * MB, processes=n)


def test_each_stage_keeps_its_own_peaks_and_seconds():
    points = ((0.0, STARTUP), (1.0, "capture"), (3.0, "measure"), (4.0, "capture"))
    samples = [
        _sample(0.5, 100, root=100),
        _sample(1.5, 900, pss=800 * MB, root=900),
        _sample(2.5, 700, pss=600 * MB, root=700),
        _sample(3.5, 1500, pss=1000 * MB, root=600, n=4),
        _sample(4.5, 800, pss=700 * MB, root=800),
    ]
    rows = {r.stage: r for r in by_stage(samples, points, t_end=5.0)}
    assert list(rows) == [STARTUP, "capture", "measure"]
    assert rows["capture"].seconds == 3.0  # 1..3 and 4..5
    assert rows["capture"].peak_rss_mb == 900.0 and rows["capture"].peak_pss_mb == 800.0
    assert rows["measure"].peak_rss_mb == 1500.0 and rows["measure"].processes == 4
    assert rows["measure"].peak_root_rss_mb == 600.0
    assert rows[STARTUP].peak_pss_mb is None and rows[STARTUP].samples == 1


def test_the_hook_records_each_stopwatch_stage_and_capture(monkeypatch):
    from mopar import pipeline

    monkeypatch.setattr(pipeline.Stopwatch, "stage", pipeline.Stopwatch.stage)
    monkeypatch.setattr(pipeline, "capture", lambda *a, **kw: "captured")
    seen = []
    _hook_stages(lambda **event: seen.append(event))
    watch = pipeline.Stopwatch()
    with watch.stage("export"), watch.stage("rewrite"):
        pass
    assert pipeline.capture() == "captured"
    assert seen == [
        {"start": "export"},
        {"start": "rewrite"},
        {"end": "rewrite"},
        {"end": "export"},
        {"start": "capture"},
        {"end": "capture"},
    ]
    assert [t.stage for t in watch.times()] == ["rewrite", "export"]  # still timed


def test_the_table_fits_80_columns_and_states_the_ratios():
    m = CompileMemory(
        command=("compile", "m.pt2", "--target", "lambda"),
        returncode=0,
        seconds=100.0,
        weights_bytes=1_500_000_000,
        stages=by_stage(
            [_sample(1.5, 3000, pss=2500 * MB, root=3000)],
            ((0.0, STARTUP), (1.0, "capture")),
            t_end=2.0,
        ),
        peak_rss_mb=3000.0,
        peak_pss_mb=2500.0,
        peak_root_rss_mb=3000.0,
        kernel_max_rss_mb=3100.0,
        functions=2,
        memory_mb=(900, 900),
        largest_function_peak_mb=450.0,
    )
    text = table(m)
    assert max(len(line) for line in text.splitlines()) <= 80
    assert "2.00" in text and "66.7 s per GB" in text
    assert m.to_dict()["stages"][1]["rss_x_weights"] == 2.0


def test_the_llama_shapes_count_their_parameters():
    from examples.llm import SHAPES

    assert SHAPES["llama374m"].parameters() == 373_867_520  # 1.50 GB of float32
    assert SHAPES["tinyllama1b"].parameters() == 1_100_048_384  # TinyLlama-1.1B's count


@pytest.mark.slow
def test_the_tiny_llama_is_saved_by_a_process_of_its_own(tmp_path):
    import torch
    import transformers.modeling_outputs  # noqa: F401 - registers the output type the file names

    from examples.llm import SHAPES, save_in_subprocess

    path = tmp_path / "llama_tiny.pt2"
    done = save_in_subprocess("llama_tiny", path, seq=16)
    assert done.returncode == 0, done.stderr[-2000:]
    ep = torch.export.load(str(path))
    assert sum(p.numel() for p in ep.state_dict.values()) == SHAPES["llama_tiny"].parameters()
    (logits,) = ep.module()(**ep.example_inputs[1]).values()  # the logits alone
    assert logits.shape == (1, 16, SHAPES["llama_tiny"].vocab)


@pytest.mark.slow
def test_the_cap_search_finds_the_smallest_cap_planning_accepts():
    from dataclasses import replace

    from benchmarks.caps import smallest_cap
    from mopar import api
    from mopar.config import CompileConfig
    from mopar.errors import MoparError

    found = smallest_cap("examples.llm:llama_tiny", ["input_ids=1x16:int64:0..128"])
    assert found.cap_mb is not None and found.functions >= 1
    analysis = api.analyze("examples.llm:llama_tiny", ["input_ids=1x16:int64:0..128"])
    base = CompileConfig(target="lambda")
    prediction = api.predict(analysis.layers, base)

    def plan(cap):
        config = replace(base, max_memory_mb=cap)
        return api.plan_from(analysis, config, prediction, facts=api.facts_for(config))

    plan(found.cap_mb)
    if found.refused_mb is not None:
        with pytest.raises(MoparError):
            plan(found.refused_mb)
