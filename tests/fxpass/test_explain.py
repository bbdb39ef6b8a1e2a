"""``fxpass.explain``: the decisions, rewritten graphs and result of one run, without Inductor."""

from __future__ import annotations

import re

import pytest
import torch
import torch._inductor.compile_fx
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.exc import BackendCompilerFailed

import fxpass

V, D = 40, 8


def _step():
    weight = nn.Parameter(torch.randn(V, D) / D**0.5)

    def step(h, t):
        return F.cross_entropy(F.linear(h, weight).float().view(-1, V), t.view(-1))

    return step


def _args():
    return torch.randn(2, 3, D), torch.randint(0, V, (2, 3))


class TestExplanation:
    """The Explanation holds each graph's report, all records, the applied ones and eager's result."""

    def test_rewrite(self):
        step = _step()
        h, t = _args()
        ex = fxpass.explain(step, h, t, options={"force": True})
        assert isinstance(ex, fxpass.Explanation)
        [graph] = ex.graphs
        assert isinstance(graph, fxpass.GraphReport)
        assert ex.records == graph.records
        [record] = ex.applied
        assert record.rule == "cce" and record.applied
        torch.testing.assert_close(ex.result, step(h, t))

    def test_graph_code_and_module_are_kept(self):
        ex = fxpass.explain(_step(), *_args(), options={"force": True})
        [graph] = ex.graphs
        assert "torch.nn.functional.cross_entropy(" in graph.before
        assert "torch.ops.memopt.cce.default(" in graph.after
        targets = [node.target for node in graph.graph_module.graph.nodes]
        assert torch.ops.memopt.cce.default in targets

    def test_str(self):
        ex = fxpass.explain(_step(), *_args(), options={"force": True})
        text = str(ex)
        assert text.startswith(f"memopt graph {ex.graphs[0].graph_id}: 1 of 1 candidates rewritten")
        assert "| rule | applied | where | saves (hint) | proof | reason |" in text
        assert "| cce | yes | test_explain.py:" in text

    def test_declined_without_force(self):
        """Options reach the rules: the default threshold declines a toy head."""
        step = _step()
        h, t = _args()
        ex = fxpass.explain(step, h, t)
        [record] = ex.records
        assert not record.applied
        assert ex.applied == []
        assert record.reason.startswith("saving ") and "below min_saved_bytes" in record.reason
        assert "torch.ops.memopt.cce" not in ex.graphs[0].after
        torch.testing.assert_close(ex.result, step(h, t))

    def test_disable_option(self):
        ex = fxpass.explain(_step(), *_args(), options={"force": True, "disable": "cce"})
        assert ex.records == []
        assert len(ex.graphs) == 1

    def test_graph_break_gives_two_graphs_in_capture_order(self):
        weight = nn.Parameter(torch.randn(V, D))

        def split(h, t):
            logits = F.linear(h, weight)
            torch._dynamo.graph_break()
            return F.cross_entropy(logits, t)

        h, t = torch.randn(6, D), torch.randint(0, V, (6,))
        ex = fxpass.explain(split, h, t, options={"force": True})
        assert len(ex.graphs) == 2
        assert [r.rule for r in ex.graphs[0].records] == ["wta_crs"]  # the head alone: a linear, no loss
        [record] = ex.graphs[1].records
        assert "graph break" in record.reason
        torch.testing.assert_close(ex.result, split(h, t))
        assert str(ex).count("memopt graph ") == 2

    def test_fullgraph_turns_a_break_into_an_error(self):
        def split(x):
            y = x.sin()
            torch._dynamo.graph_break()
            return y.cos()

        with pytest.raises(torch._dynamo.exc.Unsupported):
            fxpass.explain(split, torch.randn(3), fullgraph=True)

    def test_no_graph(self):
        ex = fxpass.explain(lambda x: x, torch.randn(3))
        assert ex.graphs == [] and ex.records == [] and ex.applied == []
        assert str(ex) == "memopt: Dynamo captured no graph"

    def test_kwargs_are_passed(self):
        step = _step()
        h, t = _args()
        ex = fxpass.explain(step, h, t=t, options={"force": True})
        torch.testing.assert_close(ex.result, step(h, t))
        assert len(ex.applied) == 1

    def test_dynamic(self):
        ex = fxpass.explain(_step(), *_args(), options={"force": True}, dynamic=True)
        [record] = ex.applied
        assert record.proof in ("static", "hint")
        assert re.fullmatch(r"s\d+\*s\d+", record.params["tokens"])  # batch × sequence, symbolic

    def test_unknown_option(self):
        with pytest.raises(fxpass.ConfigError, match="did you mean 'force'"):
            fxpass.explain(_step(), *_args(), options={"forse": True})


class TestNoInductor:
    """explain forces the eager inner compiler, so Inductor never runs, whatever the options say."""

    @pytest.fixture
    def inductor_raises(self, monkeypatch):
        def refuse(*args, **kwargs):
            raise RuntimeError("Inductor must not run")

        monkeypatch.setattr(torch._inductor.compile_fx, "compile_fx", refuse)

    def test_the_patch_bites(self, inductor_raises):
        """Control: compiling with memopt's default inner compiler does reach the patched Inductor."""
        compiled = torch.compile(_step(), backend=fxpass.MemoptBackend(options={"force": True}))
        with pytest.raises(BackendCompilerFailed, match="Inductor must not run"):
            compiled(*_args())

    def test_explain_without_inductor(self, inductor_raises):
        step = _step()
        h, t = _args()
        ex = fxpass.explain(step, h, t, options={"force": True, "inner_compiler": "inductor"})
        assert len(ex.applied) == 1
        torch.testing.assert_close(ex.result, step(h, t))
