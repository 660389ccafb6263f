"""Tuning's progress on stderr: one line per template tuned where stderr is a file, a tqdm bar
that gives way to that line on a terminal, nothing under KILN_PROGRESS=0; and what the compile's
record (`kiln.log.recording`) keeps of tuning.

The GPU is faked (device info, NVRTC, loading and timing), so these run anywhere."""
from __future__ import annotations

import io
import sys
from types import SimpleNamespace

import pytest

from kiln.device import Device
from kiln.ir import TensorInput, Task, compute
from kiln.log import recording
from kiln.runtime import cuda as rt
from kiln.schedule import tuner

TILES = (32, 64, 128, 256)


class FakeTemplate:
    """A template of four knob settings whose 64-wide tile is the fastest."""

    suggest = None

    def __init__(self, name: str):
        self.name = name

    def space(self, level):
        return [{"tile": t} for t in TILES]

    def render(self, task, tile):
        return SimpleNamespace(source=f"// {self.name} {tile}", kernel_names=["k"], tile=tile,
                               arch_for=lambda arch: f"sm_{arch}")


@pytest.fixture
def fake_gpu(monkeypatch, tmp_path):
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("KILN_PROGRESS", raising=False)
    monkeypatch.setattr(rt, "device_info", lambda index: {"sm_count": 132, "name": "Fake GPU", "arch": 90})
    monkeypatch.setattr(rt, "nvrtc_version", lambda: "12.4")
    monkeypatch.setattr(rt, "compile_many", lambda jobs: [])
    monkeypatch.setattr(tuner, "backend_for", lambda device: SimpleNamespace(load=lambda program, device: program))
    monkeypatch.setattr(tuner, "time_runner", lambda program, task, device: abs(program.tile - 64) + 1.0)


def tune_two_templates(monkeypatch, stream) -> list[dict]:
    """Tune two templates for one task with `stream` as stderr; the winners."""
    monkeypatch.setattr(sys, "stderr", stream)
    x = TensorInput("x", (8, 8), "float32")
    task = Task("double", [x], [compute([8, 8], lambda i, j: x[i, j] * 2)])
    return [tuner.tune(task, FakeTemplate(name), Device("cuda"), 1) for name in ("first", "second")]


def test_stderr_redirected_to_a_file_gets_one_line_per_template_tuned(fake_gpu, monkeypatch, tmp_path):
    with open(tmp_path / "stderr.txt", "w") as stream:
        assert tune_two_templates(monkeypatch, stream) == [{"tile": 64}, {"tile": 64}]
    lines = (tmp_path / "stderr.txt").read_text().split("\n")
    assert lines[-1] == "" and len(lines) == 3, lines
    for name, line in zip(("first", "second"), lines):
        assert line.startswith(f"kiln: tuned {name} for Task double(x: float32[8, 8])")
        assert "{'tile': 64} at 1.0000 ms" in line and line.endswith(" s)") and "(4 candidates, " in line
    assert "\r" not in "".join(lines)


def test_a_terminal_gets_a_bar_that_gives_way_to_the_line(fake_gpu, monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    terminal = Terminal()
    tune_two_templates(monkeypatch, terminal)
    text = terminal.getvalue()
    assert "\rkiln: tuning first:   0%" in text and "0/4" in text, "tqdm drew its bar"
    # each bar is cleared ('\r' and blanks), then the template's line is written
    lines = [chunk.rsplit("\r", 1)[-1] for chunk in text.split("\n")[:-1]]
    assert [line.split(" for ")[0] for line in lines] == ["kiln: tuned first", "kiln: tuned second"]


def test_kiln_progress_0_silences_it(fake_gpu, monkeypatch):
    monkeypatch.setenv("KILN_PROGRESS", "0")
    stream = io.StringIO()
    assert tune_two_templates(monkeypatch, stream) == [{"tile": 64}, {"tile": 64}]
    assert stream.getvalue() == ""


def test_failed_candidates_are_counted_on_the_line(fake_gpu, monkeypatch, tmp_path):
    def time_or_fail(program, task, device):
        if program.tile == 256:
            raise rt.CudaError("too much shared memory")
        return abs(program.tile - 64) + 1.0

    monkeypatch.setattr(tuner, "time_runner", time_or_fail)
    stream = io.StringIO()
    tune_two_templates(monkeypatch, stream)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2 and all(", 1 failed (4 candidates, " in line for line in lines), lines


def test_the_compile_record_keeps_what_was_tuned_and_what_was_reused(fake_gpu, monkeypatch):
    monkeypatch.setenv("KILN_PROGRESS", "0")
    with recording() as record:
        tune_two_templates(monkeypatch, io.StringIO())
        tune_two_templates(monkeypatch, io.StringIO())      # the winners are on disk now
    assert [(t["template"], t["best"], t["candidates"], t["failed"]) for t in record.tuned] == \
        [("first", {"tile": 64}, 4, 0), ("second", {"tile": 64}, 4, 0)]
    assert record.tuned[0]["task"] == "Task double(x: float32[8, 8]) -> float32[8, 8]"
    assert record.tuning_reused == 2
