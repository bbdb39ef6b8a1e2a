"""House style that a linter cannot see: the code base stays ruff clean (rules and line length in pyproject.toml),
and no file dates a figure or a choice by the round of work that produced it (``.ci/check-labels``)."""

from __future__ import annotations

import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHECK_LABELS = ROOT / ".ci" / "check-labels"
# The script has no .py suffix (it is a command), so it is loaded by path; its main() does not run.
check = runpy.run_path(str(CHECK_LABELS))


def test_ruff_clean():
    result = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", str(ROOT)], capture_output=True, text=True, cwd=ROOT
    )
    assert result.returncode == 0, result.stdout + result.stderr


LABELLED = [
    "measured in the ninth session",
    "the op took 0.91× (eighteenth session)",
    "see session 18",
    "logs in benchmarks/results/*-session18*",
    "sessions 11–19 kept the chunked op",
    "sessions 6 to 9",
    "the 19th session",
    "in the fifth round the rule learned padding masks",
    "the 2nd round",
    "the ninth pass of work",
    "re-measured in the third GPU session",
    "Twenty-first session",
    "0.90× in the fifteenth, 0.85× in the fourteenth",
    "since the eleventh",
    "(tenth)",
    "| fourteenth, A | bf16 |",
    "the next GPU session's first item",
    "Earlier sessions: 0.76× the time",
    "e2e-gpt2-h200-2026-12-02-session8.log",
    "gpu-tests-h200-fourth-session-2026-12-01.log",
]

ORDINARY = [
    "time to the first call",
    "the second loss of the pair",
    "a session's time on the device",
    "each training step",
    "third-party wheels",
    "the first pass over the logits, then the second",
    "the draw's threshold rounds are loops over on-chip data",
    "calls are queued in rounds of one per warmer",
    "round(ms, 3)",
    "logits rounded to bf16",
    "the second round trip to the host",
    '@pytest.fixture(scope="session")',
    "session-scoped fixtures",
    "One device-machine session: install carried wheels",
    "the fourth dimension of the scores",
    "in the fifth column of the table",
    "the 95th percentile",
    "a 4th-order polynomial",
]


@pytest.mark.parametrize("text", LABELLED)
def test_labels_of_work_rounds_are_found(text):
    assert check["labels"](text), text


@pytest.mark.parametrize("text", ORDINARY)
def test_ordinary_words_are_not_labels(text):
    assert check["labels"](text) == [], text


def test_findings_name_the_line_where_a_label_starts():
    text = b"an ordinary line\nmeasured in the third\nsession, as it happens\n"
    assert list(check["findings"]("notes.md", text)) == ["notes.md:2: measured in the third"]
    assert list(check["findings"]("results/step-session19.log", b"clean\n")) == [
        "results/step-session19.log:0: file name: session19"
    ]
    assert list(check["findings"]("plot.png", b"\x89PNG\0the ninth session")) == []  # binary content is skipped


def test_command_line_exit_status(tmp_path):
    (tmp_path / "clean.md").write_text("Time to the first call: 0.95× torch.compile's.\n")
    (tmp_path / "dated.md").write_text("ok\n0.95× (thirteenth session)\n")
    run = [sys.executable, str(CHECK_LABELS)]
    clean = subprocess.run([*run, "clean.md"], cwd=tmp_path, capture_output=True, text=True)
    assert (clean.returncode, clean.stdout) == (0, "")
    dated = subprocess.run([*run, "clean.md", "dated.md"], cwd=tmp_path, capture_output=True, text=True)
    assert dated.returncode == 1
    assert dated.stdout == "dated.md:2: 0.95× (thirteenth session)\n"


def test_check_labels_is_an_executable_command():
    assert CHECK_LABELS.read_text().startswith("#!/usr/bin/env python3\n")
    assert os.access(CHECK_LABELS, os.X_OK), ".ci/run calls it directly"


def test_repository_has_no_labels_of_work_rounds():
    found = check["scan"](ROOT, check["tracked_files"](ROOT))
    assert not found, "labels of work rounds (cite the benchmark and its figure instead):\n" + "\n".join(found)
