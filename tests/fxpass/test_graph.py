"""Graph queries and edits shared by the rules, on small Dynamo graphs and hand-built FX graphs."""

from __future__ import annotations

import operator
import os

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch._dynamo.testing import EagerAndRecordGraphs

from fxpass.graph import (
    GraphFacts,
    ViewKind,
    bind_args,
    canonicalize_operator_methods,
    copy_memory_format,
    describe_node,
    erase_unused,
    fake_mode_of,
    insert_node,
    is_param_transpose,
    source_location,
    tensor_value,
    view_kind,
)


def capture(fn, *args) -> fx.GraphModule:
    """The one graph Dynamo captures for ``fn(*args)`` (node names follow the local variable names)."""
    backend = EagerAndRecordGraphs()
    torch.compile(fn, backend=backend, fullgraph=True)(*args)
    [gm] = backend.graphs
    return gm


def by_name(gm: fx.GraphModule) -> dict[str, fx.Node]:
    return {node.name: node for node in gm.graph.nodes}


def _views(x):
    a = x.float()
    b = x.to(torch.float16)
    c = x.type(torch.float64)
    d = x.contiguous()
    e = x.clone()
    f = x.view(-1)
    g = x.reshape(2, -1)
    h = x.flatten()
    i = torch.reshape(x, (-1,))
    j = torch.flatten(x)
    k = x.view(torch.int32)
    m = x[0]
    n = x[:, 1:]
    o = x.sum()
    p = torch.split(x, 2)[0]
    q = x.to("cpu")
    r = x.t()
    s = x.to("meta")
    z = torch.clone(x)
    u = torch.ops.aten.clone.default(x)
    v = torch.ops.aten.contiguous.default(x)
    w = x.clone(memory_format=torch.contiguous_format)
    y = torch.Tensor.contiguous(x)
    return a, b, c, d, e, f, g, h, i, j, k, m, n, o, p, q, r, s, u, v, w, y, z


class TestViewKind:
    """``view_kind`` classifies casts, copies, reshapes and indexing; everything else is None."""

    EXPECTED = {  # noqa: RUF012
        "a": ViewKind.CAST,
        "b": ViewKind.CAST,
        "c": ViewKind.CAST,
        "d": ViewKind.COPY,
        "e": ViewKind.COPY,
        "f": ViewKind.RESHAPE,
        "g": ViewKind.RESHAPE,
        "h": ViewKind.RESHAPE,
        "i": ViewKind.RESHAPE,
        "j": ViewKind.RESHAPE,
        "k": None,  # x.view(torch.int32) reinterprets bytes
        "m": ViewKind.INDEX,
        "n": ViewKind.INDEX,
        "o": None,
        "q": ViewKind.CAST,  # .to() that keeps device and layout counts as a cast (here: a no-op)
        "r": None,  # a transpose moves the class dimension; not a view kind
        "s": None,  # .to("meta") changes the device
        "u": ViewKind.COPY,  # ATen's overloads called directly
        "v": ViewKind.COPY,
        "w": ViewKind.COPY,
        "y": ViewKind.COPY,  # torch.Tensor.contiguous(x), recorded as x.contiguous()
        "z": ViewKind.COPY,  # torch.clone, recorded as a function
    }

    @pytest.fixture(scope="class")
    @classmethod
    def nodes(cls):
        return by_name(capture(_views, torch.randn(4, 6)))

    @pytest.mark.parametrize("name", sorted(EXPECTED))
    def test_kind(self, nodes, name):
        assert view_kind(nodes[name]) is self.EXPECTED[name]

    def test_getitem_on_a_tuple_is_not_a_view(self, nodes):
        [split_item] = [n for n in nodes.values() if n.target is operator.getitem and n.args[0].name == "split"]
        assert view_kind(split_item) is None

    def test_placeholder(self, nodes):
        assert view_kind(nodes["l_x_"]) is None

    # The layout each copy promises: ``contiguous`` the contiguous format, ``clone`` its input's unless told one; a
    # cast or a reshape is no copy.
    MEMORY_FORMATS = {  # noqa: RUF012
        "d": torch.contiguous_format,
        "e": None,
        "u": None,
        "v": torch.contiguous_format,
        "w": torch.contiguous_format,
        "y": torch.contiguous_format,
        "z": None,
        "a": None,
        "f": None,
    }

    @pytest.mark.parametrize("name", sorted(MEMORY_FORMATS))
    def test_copy_memory_format(self, nodes, name):
        assert copy_memory_format(nodes[name]) is self.MEMORY_FORMATS[name]


def _transposes(w, w3, wc):
    t1 = w.T
    t2 = w.t()
    t3 = torch.t(w)
    t4 = w.transpose(0, 1)
    t5 = w.transpose(-1, -2)
    t6 = w.permute(1, 0)
    t7 = w.mT
    t8 = w.permute(0, 1)
    t9 = w3.transpose(0, 1)
    t10 = torch.transpose(w, 1, 0)
    t11 = wc.H
    t12 = w.transpose(0, 0)
    t13 = w.permute((1, 0))
    t14 = w.sum(0)
    return t1, t2, t3, t4, t5, t6, t7, t8, t9, t10, t11, t12, t13, t14


class TestIsParamTranspose:
    """``is_param_transpose`` recognizes every spelling of a 2-D transpose and nothing else."""

    TRUE = ("t1", "t2", "t3", "t4", "t5", "t6", "t7", "t10", "t13")
    FALSE = (
        "t8",  # identity permutation
        "t9",  # 3-D
        "t11",  # conjugate transpose of a complex tensor
        "t12",  # transpose(0, 0)
        "t14",  # not a transpose
        "l_w_",  # a placeholder
    )

    @pytest.fixture(scope="class")
    @classmethod
    def nodes(cls):
        return by_name(
            capture(_transposes, torch.randn(3, 5), torch.randn(2, 3, 4), torch.randn(3, 5, dtype=torch.complex64))
        )

    @pytest.mark.parametrize("name", TRUE)
    def test_transpose(self, nodes, name):
        assert is_param_transpose(nodes[name])

    @pytest.mark.parametrize("name", FALSE)
    def test_not_a_transpose(self, nodes, name):
        assert not is_param_transpose(nodes[name])


def _call(target, args, kwargs=None) -> fx.Node:
    graph = fx.Graph()
    x, y = graph.placeholder("x"), graph.placeholder("y")
    args = tuple({"x": x, "y": y}.get(a, a) if isinstance(a, str) else a for a in args)
    return graph.call_function(target, args, kwargs or {})


class TestBindArgs:
    """``bind_args`` maps positional and keyword args onto names, with defaults; bad calls give None."""

    NAMES = ("input", "target", "weight", "ignore_index")

    def test_positional_keyword_and_defaults(self):
        node = _call(F.cross_entropy, ("x", "y"), {"ignore_index": 5})
        bound = bind_args(node, self.NAMES, {"weight": None, "ignore_index": -100})
        assert bound == {"input": node.args[0], "target": node.args[1], "weight": None, "ignore_index": 5}

    def test_all_positional(self):
        node = _call(F.cross_entropy, ("x", "y", None, 3))
        assert bind_args(node, self.NAMES)["ignore_index"] == 3

    def test_missing_without_default_is_absent(self):
        node = _call(F.cross_entropy, ("x",))
        assert bind_args(node, self.NAMES) == {"input": node.args[0]}

    def test_defaults_not_mutated(self):
        defaults = {"ignore_index": -100}
        bind_args(_call(F.cross_entropy, ("x", "y", None, 7)), self.NAMES, defaults)
        assert defaults == {"ignore_index": -100}

    def test_too_many_positional(self):
        assert bind_args(_call(F.cross_entropy, ("x", "y", None, 1, 2)), self.NAMES) is None

    def test_unknown_keyword(self):
        assert bind_args(_call(F.cross_entropy, ("x", "y"), {"reduction": "sum"}), self.NAMES) is None

    def test_keyword_also_given_positionally(self):
        assert bind_args(_call(F.cross_entropy, ("x", "y"), {"target": 1}), self.NAMES) is None


class TestEraseUnused:
    """``erase_unused`` removes the given compute nodes left without users, users first; never placeholders."""

    @staticmethod
    def _graph():
        graph = fx.Graph()
        x = graph.placeholder("x")
        unused = graph.placeholder("unused")
        a = graph.call_method("relu", (x,))
        b = graph.call_method("sin", (a,))  # dead chain a -> b
        c = graph.call_method("cos", (x,))
        d = graph.call_function(operator.add, (c, 1))
        graph.output(d)
        return graph, {"x": x, "unused": unused, "a": a, "b": b, "c": c, "d": d}

    def test_dead_chain_is_erased_users_first(self):
        graph, n = self._graph()
        erase_unused([n["a"], n["b"]])  # a listed before its user b
        graph.lint()
        assert [node.name for node in graph.nodes] == ["x", "unused", "cos", "add", "output"]

    def test_nodes_with_users_stay(self):
        graph, n = self._graph()
        erase_unused([n["c"], n["d"]])
        assert {"cos", "add"} <= {node.name for node in graph.nodes}

    def test_placeholders_are_never_erased(self):
        graph, n = self._graph()
        erase_unused([n["unused"], n["x"], n["a"], n["b"]])
        graph.lint()
        assert [node.name for node in graph.nodes if node.op == "placeholder"] == ["x", "unused"]
        assert "relu" not in {node.name for node in graph.nodes}

    def test_only_the_given_nodes(self):
        graph, n = self._graph()
        erase_unused([n["a"]])  # a still has a user (b), which was not given
        assert "relu" in {node.name for node in graph.nodes}

    def test_nothing_to_do(self):
        graph, n = self._graph()
        before = len(graph.nodes)
        erase_unused([])
        erase_unused([n["x"], n["unused"]])
        assert len(graph.nodes) == before


class TestSourceLocation:
    """``source_location`` is the innermost ``file:line`` of a node's stack trace."""

    def test_innermost_frame(self):
        node = _call(torch.relu, ("x",))
        node.meta["stack_trace"] = (
            '  File "/a/train.py", line 10, in main\n    loss = step(batch)\n'
            '  File "/a/model.py", line 42, in forward\n    return F.cross_entropy(logits, t)\n'
        )
        assert source_location(node) == "/a/model.py:42"
        assert describe_node(node) == "relu (call_function relu) at /a/model.py:42"

    def test_missing(self):
        node = _call(torch.relu, ("x",))
        assert source_location(node) is None
        node.meta["stack_trace"] = "no frames here"
        assert source_location(node) is None
        assert describe_node(node) == "relu (call_function relu)"

    def test_dynamo_graph_points_at_user_code(self):
        def fn(x):
            y = x.sin()
            return y.cos()

        nodes = by_name(capture(fn, torch.randn(3)))
        for name, offset in (("y", 1), ("cos", 2)):
            file, _, line = source_location(nodes[name]).rpartition(":")
            assert os.path.samefile(file, __file__)
            assert int(line) == fn.__code__.co_firstlineno + offset


def _uses(x):
    a = x.sin()
    b = a.cos()
    c = a + 1
    d = c * 2
    return b, d


class TestGraphFacts:
    """``outside_users`` lists uses that leave a region (the escape check of every rule)."""

    @pytest.fixture
    def graph(self):
        gm = capture(_uses, torch.randn(3))
        return GraphFacts(gm), by_name(gm)

    def test_outside_users(self, graph):
        facts, n = graph
        assert facts.outside_users([n["a"]]) == [(n["a"], n["b"]), (n["a"], n["c"])]
        assert facts.outside_users([n["a"]], inside=[n["b"]]) == [(n["a"], n["c"])]
        assert facts.outside_users([n["a"], n["b"], n["c"]]) == [(n["b"], facts.output), (n["c"], n["d"])]
        assert facts.outside_users([n["a"], n["b"], n["c"], n["d"]], inside=[facts.output]) == []


class TestInsertNode:
    """Inserted nodes get an example value from the graph's fake mode and the user's metadata."""

    def test_example_value_and_meta(self):
        gm = capture(_uses, torch.randn(3, 4))
        n = by_name(gm)
        fake_mode = fake_mode_of(gm.graph.nodes)
        assert fake_mode is not None
        with gm.graph.inserting_after(n["a"]):
            new = insert_node(gm.graph, "call_method", "sum", (n["a"], 0), meta_from=n["a"], fake_mode=fake_mode)
        value = tensor_value(new)
        assert value is not None and tuple(value.shape) == (4,)
        assert value.fake_mode is fake_mode
        assert new.meta["stack_trace"] == n["a"].meta["stack_trace"]
        gm.graph.lint()

    def test_no_fake_mode_without_example_values(self):
        graph = fx.Graph()
        graph.output(graph.placeholder("x"))
        assert fake_mode_of(graph.nodes) is None


class TestCanonicalizeOperatorMethods:
    """Dunder method calls on tensors become the operator functions rules match, reflected ones with their
    operands swapped; a dunder on a non-tensor or with keywords is left alone."""

    def test_rewrites(self):
        graph = fx.Graph()
        x = graph.placeholder("x")
        x.meta["example_value"] = torch.ones(3)
        eq = graph.call_method("__eq__", (x, 0))
        rsub = graph.call_method("__rsub__", (x, 1))
        inverted = graph.call_method("__invert__", (eq,))
        eq.meta["example_value"] = torch.ones(3, dtype=torch.bool)
        kept = graph.call_method("__add__", (x,), {"alpha": 2})
        graph.output((rsub, inverted, kept))
        assert canonicalize_operator_methods(graph) == 3
        assert (eq.op, eq.target, eq.args) == ("call_function", operator.eq, (x, 0))
        assert (rsub.target, rsub.args) == (operator.sub, (1, x))
        assert (inverted.target, inverted.args) == (operator.invert, (eq,))
        assert (kept.op, kept.target) == ("call_method", "__add__")

    def test_the_rewritten_graph_computes_the_same(self):
        graph = fx.Graph()
        x = graph.placeholder("x")
        x.meta["example_value"] = torch.ones(3)
        graph.output(graph.call_method("__rtruediv__", (x, 2.0)))
        module = fx.GraphModule(torch.nn.Module(), graph)
        values = torch.tensor([1.0, 2.0, 4.0])
        expected = module(values)
        canonicalize_operator_methods(graph)
        module.recompile()
        torch.testing.assert_close(module(values), expected)
        torch.testing.assert_close(expected, 2.0 / values)
