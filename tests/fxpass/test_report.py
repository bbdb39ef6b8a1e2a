"""How decisions reach users: the debug dir, the ``fxpass`` logger, tlparse artifacts, ``fxpass.reports()``,
Dynamo counters, and the report's JSON and markdown renderings."""

from __future__ import annotations

import json
import logging
import os
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

import fxpass
import fxpass.report
from fxpass.report import GraphReport, RewriteRecord, current_graph_id, publish, tracing_enabled, write_debug_dir

V, D = 40, 8
EAGER = {"force": True, "inner_compiler": "eager"}
RECORD_KEYS = {
    "rule", "applied", "reason", "nodes", "source", "saved_bytes", "saved_bytes_hint", "proof", "params", "memory",
    "against_compile",
}


def _step():
    """``linear → .float() → view → cross_entropy``; the loss is on the line after ``def``."""
    weight = nn.Parameter(torch.randn(V, D) / D**0.5)

    def step(h, t):
        return F.cross_entropy(F.linear(h, weight).float().view(-1, V), t.view(-1))

    return step


def _loss_line(fn) -> int:
    return fn.__code__.co_firstlineno + 1


def _args():
    return torch.randn(2, 3, D), torch.randint(0, V, (2, 3))


def _run(step, **options):
    return torch.compile(step, backend="memopt", options={**EAGER, **options})(*_args())


def _assert_points_at(source: str, fn) -> None:
    file, _, line = source.rpartition(":")
    assert os.path.samefile(file, __file__)
    assert int(line) == _loss_line(fn)


def _one_graph_folder(root) -> dict[str, str]:
    [folder] = list(root.glob("graph_*"))
    return {path.name: path.read_text() for path in folder.iterdir()}


class TestDebugDir:
    """A debug dir holds, per graph, before.py, after.py, report.json and report.md."""

    def test_option(self, tmp_path):
        step = _step()
        _run(step, debug_dir=tmp_path)
        files = _one_graph_folder(tmp_path)
        assert set(files) == {"before.py", "after.py", "report.json", "report.md"}
        assert "= torch.nn.functional.cross_entropy(" in files["before.py"]
        assert "torch.ops.memopt.cce" not in files["before.py"]
        assert "= torch.ops.memopt.cce.default(" in files["after.py"]
        assert "= torch.nn.functional.cross_entropy(" not in files["after.py"]

        report = json.loads(files["report.json"])
        assert set(report) == {"schema", "graph", "torch", "rewrites"}
        assert report["schema"] == fxpass.report.SCHEMA_VERSION == 2
        assert report["graph"] == fxpass.reports()[-1].graph_id
        assert report["torch"] == torch.__version__
        [rewrite] = report["rewrites"]
        assert set(rewrite) == RECORD_KEYS
        assert rewrite["rule"] == "cce"
        assert rewrite["applied"] is True
        assert rewrite["reason"].startswith("logits never materialized; forced (force=True)")
        assert rewrite["nodes"][-1] == "cross_entropy"
        _assert_points_at(rewrite["source"], step)
        assert rewrite["saved_bytes"] == str(rewrite["saved_bytes_hint"])  # static shapes: a number
        assert rewrite["proof"] == "static"
        assert rewrite["params"]["vocab"] == str(V)
        assert rewrite["params"]["tokens"] == "6"
        assert set(rewrite["memory"]) == {"before", "after"}
        assert rewrite["memory"]["before"]["saved: log-probabilities [N, V]"] == str(6 * V * 4)

    def test_markdown(self, tmp_path):
        step = _step()
        _run(step, debug_dir=tmp_path)
        markdown = _one_graph_folder(tmp_path)["report.md"]
        assert markdown.startswith(f"# memopt report: graph {fxpass.reports()[-1].graph_id}")
        assert "| rule | applied | where | frees vs torch.compile (hint) | proof | reason |" in markdown
        assert "- frees against torch.compile: `" in markdown
        assert "  - torch.compile keeps: " in markdown  # the logits, in the classifier's dtype
        assert f"| cce | yes | test_report.py:{_loss_line(step)} |" in markdown
        assert "## 0. cce: applied" in markdown
        diff = markdown.split("```diff\n", 1)[1].split("```", 1)[0]
        assert diff.startswith("--- before.py\n+++ after.py")
        assert any(line.startswith("+") and "torch.ops.memopt.cce" in line for line in diff.splitlines())
        assert any(line.startswith("-") and "cross_entropy(" in line for line in diff.splitlines())

    def test_environment_variable(self, tmp_path, monkeypatch):
        monkeypatch.setenv("MEMOPT_DEBUG_DIR", str(tmp_path / "from_env"))
        _run(_step())
        files = _one_graph_folder(tmp_path / "from_env")
        assert set(files) == {"before.py", "after.py", "report.json", "report.md"}
        assert json.loads(files["report.json"])["rewrites"][0]["applied"] is True

    def test_one_folder_per_graph(self, tmp_path):
        weight = nn.Parameter(torch.randn(V, D))

        def split(h, t):
            logits = F.linear(h, weight)
            torch._dynamo.graph_break()
            return F.cross_entropy(logits, t)

        torch.compile(split, backend="memopt", options={**EAGER, "debug_dir": str(tmp_path)})(
            torch.randn(6, D), torch.randint(0, V, (6,))
        )
        folders = sorted(tmp_path.glob("graph_*"))
        assert len(folders) == 2
        graphs = {json.loads((f / "report.json").read_text())["graph"] for f in folders}
        assert graphs == {r.graph_id for r in fxpass.reports()[-2:]}

    def test_same_graph_id_gets_a_fresh_folder(self, tmp_path):
        report = GraphReport("3/1", [], before="a\n", after="b\n")
        first = write_debug_dir(report, tmp_path)
        second = write_debug_dir(report, tmp_path)
        assert first.name == "graph_3_1"
        assert second.name == "graph_3_1.1"
        assert (second / "after.py").read_text() == "b\n"

    def test_no_code_files_without_code(self, tmp_path):
        folder = write_debug_dir(GraphReport("g", []), tmp_path)
        assert sorted(p.name for p in folder.iterdir()) == ["report.json", "report.md"]

    def test_nothing_rendered_without_a_debug_dir(self, tmp_path, monkeypatch):
        """Without a debug dir or tracing, graph code is not rendered and no files are written."""
        monkeypatch.chdir(tmp_path)
        _run(_step())
        report = fxpass.reports()[-1]
        assert report.before is None and report.after is None
        assert list(tmp_path.iterdir()) == []


class TestLogging:
    """Each decision is logged at DEBUG and each graph's summary at INFO on the ``fxpass`` logger."""

    def test_decisions_and_summary(self, caplog):
        caplog.set_level(logging.DEBUG, logger="fxpass")
        step = _step()
        _run(step)
        ours = [r for r in caplog.records if r.name.startswith("fxpass")]
        debug = [r.getMessage() for r in ours if r.levelno == logging.DEBUG]
        info = [r.getMessage() for r in ours if r.levelno == logging.INFO]
        [decision] = [m for m in debug if m.startswith("cce ")]
        assert re.fullmatch(r"cce applied at (.+):(\d+): logits never materialized; forced .*", decision)
        _assert_points_at(decision.split(" at ", 1)[1].split(": ", 1)[0], step)
        [summary] = info
        assert summary.startswith("memopt graph ")
        assert "1 of 1 candidates rewritten" in summary
        assert "| cce | yes |" in summary

    def test_declined_is_logged(self, caplog):
        caplog.set_level(logging.DEBUG, logger="fxpass")
        torch.compile(
            lambda x, t: F.cross_entropy(torch.relu(x), t), backend="memopt", options={"inner_compiler": "eager"}
        )(torch.randn(6, V), torch.randint(0, V, (6,)))
        messages = [r.getMessage() for r in caplog.records if r.name.startswith("fxpass")]
        assert any(m.startswith("cce declined at ") and "not from a linear classifier" in m for m in messages)

    def test_debug_dir_is_logged(self, caplog, tmp_path):
        caplog.set_level(logging.INFO, logger="fxpass")
        _run(_step(), debug_dir=str(tmp_path))
        [folder] = list(tmp_path.glob("graph_*"))
        assert any(
            "memopt debug dump for graph" in r.getMessage() and str(folder) in r.getMessage() for r in caplog.records
        )

    def test_quiet_above_info(self, caplog):
        caplog.set_level(logging.WARNING, logger="fxpass")
        _run(_step())
        assert not [r for r in caplog.records if r.name.startswith("fxpass")]

    def test_no_summary_for_a_graph_without_candidates(self, caplog):
        caplog.set_level(logging.DEBUG, logger="fxpass")
        torch.compile(lambda x: x.sin() + 1, backend="memopt", options={"inner_compiler": "eager"})(torch.randn(3))
        assert not [r for r in caplog.records if r.name.startswith("fxpass")]


@pytest.fixture
def artifacts(monkeypatch):
    """memopt's tlparse artifacts, recorded instead of traced: a list of (metadata, payload)."""
    calls = []

    def record(name, metadata_fn=dict, *, payload_fn=lambda: None, **kwargs):
        if name != "artifact":
            return
        metadata = metadata_fn()
        if str(metadata.get("name", "")).startswith("memopt"):
            calls.append((metadata, payload_fn()))

    monkeypatch.setattr(torch._logging, "trace_structured", record)
    return calls


class TestTlparse:
    """``trace_structured`` artifacts: the report as JSON always, the rewritten code when code is kept."""

    def test_report_artifact(self, artifacts):
        _run(_step())
        [(metadata, payload)] = artifacts
        assert metadata == {"name": "memopt_report", "encoding": "json"}
        document = json.loads(payload)
        assert document == json.loads(json.dumps(fxpass.reports()[-1].to_json(), default=str))
        assert [r["applied"] for r in document["rewrites"]] == [True]

    def test_after_rewrite_artifact_when_code_is_kept(self, artifacts, tmp_path):
        _run(_step(), debug_dir=str(tmp_path))
        names = [metadata["name"] for metadata, _ in artifacts]
        assert names == ["memopt_report", "memopt_after_rewrite"]
        metadata, code = artifacts[1]
        assert metadata["encoding"] == "string"
        assert code == fxpass.reports()[-1].after
        assert "torch.ops.memopt.cce" in code

    def test_tracing_keeps_code(self, monkeypatch, tmp_path):
        """Under TORCH_TRACE both artifacts reach the trace log (a capturing handler stands in for tlparse's)."""
        from torch._logging._internal import trace_log

        class Capture(logging.Handler):
            def __init__(self):
                super().__init__()
                self.artifacts = []

            def emit(self, record):
                metadata = getattr(record, "metadata", {}).get("artifact")
                if metadata and metadata["name"].startswith("memopt"):
                    self.artifacts.append((metadata["name"], getattr(record, "payload", None)))

        assert not tracing_enabled()
        handler = Capture()
        trace_log.addHandler(handler)
        monkeypatch.setenv("TORCH_TRACE", str(tmp_path))
        try:
            assert tracing_enabled()
            _run(_step())
        finally:
            trace_log.removeHandler(handler)
        monkeypatch.delenv("TORCH_TRACE")
        assert not tracing_enabled()
        assert [name for name, _ in handler.artifacts] == ["memopt_report", "memopt_after_rewrite"]
        assert json.loads(handler.artifacts[0][1])["rewrites"][0]["rule"] == "cce"
        assert "torch.ops.memopt.cce" in handler.artifacts[1][1]


class TestHistory:
    """``fxpass.reports()`` lists compiled graphs oldest first (the last 64); ``clear_reports`` empties it."""

    def test_reports_and_clear(self):
        fxpass.clear_reports()
        assert fxpass.reports() == []
        step = _step()
        _run(step)
        torch.compile(lambda x: x.cos(), backend="memopt", options=EAGER)(torch.randn(3))
        first, second = fxpass.reports()
        assert [r.applied for r in first.records] == [True]
        assert second.records == []
        assert first.graph_id != second.graph_id
        fxpass.clear_reports()
        assert fxpass.reports() == []

    def test_reports_is_a_copy(self):
        fxpass.clear_reports()
        fxpass.reports().append(GraphReport("x", []))
        assert fxpass.reports() == []

    def test_keeps_the_last_64(self):
        fxpass.clear_reports()
        for index in range(70):
            publish(GraphReport(f"h{index}", []), None)
        history = fxpass.reports()
        assert len(history) == 64
        assert [r.graph_id for r in history[:2]] == ["h6", "h7"]
        assert history[-1].graph_id == "h69"
        fxpass.clear_reports()


class TestCounters:
    """``counters["memopt"]`` counts applied and declined candidates per rule."""

    def test_applied_and_declined(self):
        weight = nn.Parameter(torch.randn(V, D))

        def two_losses(h, x, t):
            return F.cross_entropy(F.linear(h, weight), t) + F.cross_entropy(torch.relu(x), t)

        torch.compile(two_losses, backend="memopt", options=EAGER)(
            torch.randn(6, D), torch.randn(6, V), torch.randint(0, V, (6,))
        )
        assert dict(counters["memopt"]) == {"cce_applied": 1, "cce_declined": 1}
        assert "1 of 2 candidates rewritten" in fxpass.reports()[-1].summary()

    def test_counted_per_compile(self):
        step = _step()
        compiled = torch.compile(step, backend="memopt", options=EAGER)
        compiled(*_args())
        compiled(*_args())  # cached: no second rewrite
        assert counters["memopt"]["cce_applied"] == 1


def _record(applied: bool, hint: int | None, **changes) -> RewriteRecord:
    fields = dict(
        rule="cce",
        applied=applied,
        reason="because",
        nodes=("linear", "cross_entropy"),
        source="/some/where/model.py:12",
        saved_bytes=None if hint is None else f"{hint}",
        saved_bytes_hint=hint,
        proof=None if hint is None else "static",
        params={"vocab": "40"},
        memory=None if hint is None else {"before": {"logits": "2048"}, "after": {"lse": "512"}},
    )
    return RewriteRecord(**{**fields, **changes})


class TestRenderings:
    """GraphReport's JSON, table, summary and markdown from hand-made records."""

    def test_record_json(self):
        document = _record(True, 1536).to_json()
        assert set(document) == RECORD_KEYS
        assert document["nodes"] == ["linear", "cross_entropy"]
        assert json.loads(json.dumps(document)) == document

    def test_applied_and_saving_count_applied_records_only(self):
        report = GraphReport("0/0", [_record(True, 1024), _record(False, 4096), _record(True, 512), _record(False, None)])
        assert len(report.applied) == 2
        assert report.saved_bytes_hint == 1536
        assert report.summary().splitlines()[0] == (
            "memopt graph 0/0: 2 of 4 candidates rewritten, about 1.5 KiB saved at the example shapes"
        )

    def test_table(self):
        report = GraphReport("0/0", [_record(True, 2048), _record(False, None, source=None, reason="no")])
        assert report.table().splitlines()[2:] == [
            "| cce | yes | model.py:12 | 2.0 KiB | static | because |",
            "| cce | no | - | - | - | no |",
        ]

    def test_summary_without_records_has_no_table(self):
        assert GraphReport("1/0", []).summary() == (
            "memopt graph 1/0: 0 of 0 candidates rewritten, about 0 B saved at the example shapes"
        )

    def test_markdown_sections(self):
        markdown = GraphReport("0/0", [_record(True, 1536), _record(False, None)]).to_markdown()
        assert "## 0. cce: applied" in markdown
        assert "## 1. cce: declined" in markdown
        assert "- frees against the graph as written: `1536` (= 1536 at the hint, static)" in markdown
        assert "- the graph as written (eager's accounting):" in markdown
        assert "  - before: logits: `2048`" in markdown
        assert "  - after: lse: `512`" in markdown
        assert '- params: `{"vocab": "40"}`' in markdown
        assert "- source: `/some/where/model.py:12`" in markdown
        assert "## graph diff" not in markdown  # no code kept

    def test_markdown_against_compile(self):
        against = {
            "saved": "1024", "transient": "-8", "peak": "1016", "saved_hint": 1024, "transient_hint": -8,
            "peak_hint": 1016, "torch.compile keeps": ["mm: [4, 64] bfloat16"], "memopt keeps": [],
            fxpass.report.INTERNAL: "256",
        }
        markdown = GraphReport("0/0", [_record(True, 1016, against_compile=against)]).to_markdown()
        assert "- frees against torch.compile: `1016` (= 1016 at the hint, static)" in markdown
        assert "  - saved for the backward: `1024`; transient: `-8`" in markdown
        assert "  - torch.compile keeps: mm: [4, 64] bfloat16" in markdown
        assert "  - memopt keeps: nothing" in markdown
        assert "  - memopt's ops inside their kernels (the largest): `256`" in markdown

    def test_markdown_diff(self):
        markdown = GraphReport("0/0", [], before="x = 1\ny = f(x)\n", after="x = 1\ny = g(x)\n").to_markdown()
        assert "## graph diff" in markdown
        assert "-y = f(x)" in markdown
        assert "+y = g(x)" in markdown


class TestGraphIds:
    """Graph ids are Dynamo's compile ids while compiling, a process-wide counter otherwise."""

    def test_outside_compilation(self):
        first, second = current_graph_id(), current_graph_id()
        assert re.fullmatch(r"g\d+", first)
        assert int(second[1:]) == int(first[1:]) + 1

    def test_inside_compilation(self):
        _run(_step())
        assert re.fullmatch(r"\d+/\d+", fxpass.reports()[-1].graph_id)

    def test_pieces_of_one_compile(self):
        """Dynamo's DDP optimizer compiles each bucket's piece of a graph under one compile id: each piece gets its
        own graph id; a later compile that reuses the id's text (after ``torch._dynamo.reset()``) starts over."""
        from torch._guards import CompileContext, CompileId, compile_context

        for _ in range(2):
            with compile_context(CompileContext(CompileId(frame_id=7, frame_compile_id=0))):
                assert [current_graph_id() for _ in range(3)] == ["7/0", "7/0.2", "7/0.3"]
