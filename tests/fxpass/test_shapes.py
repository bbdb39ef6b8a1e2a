"""Symbolic memory reasoning: hints, constants, rendering, byte formatting, memory models and the
guard-free ``clears`` decision, with plain ints and with SymInts from a real ShapeEnv."""

from __future__ import annotations

import pytest
import sympy
import torch
from torch._dynamo.source import ConstantSource
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from fxpass import shapes
from fxpass.shapes import MemoryModel, Verdict, clears, constant, format_bytes, hint, render


@pytest.fixture
def env() -> ShapeEnv:
    return ShapeEnv()


def _size(env: ShapeEnv, name: str, value: int) -> torch.SymInt:
    """A backed size symbol (values >= 2) with ``value`` as its hint."""
    return env.create_symintnode(env.create_symbol(value, ConstantSource(name)), hint=value)


def _name(value: torch.SymInt) -> str:
    return str(value.node.expr)


class TestGuardControl:
    """The guard count is a real witness: reading a SymInt as an int does install a guard."""

    def test_int_installs_a_guard(self, env):
        n = _size(env, "n", 64)
        assert len(env.guards) == 0
        assert int(n) == 64
        assert len(env.guards) == 1


class TestHintAndConstant:
    """``hint`` and ``constant`` read a value without guarding on it."""

    def test_plain_ints(self):
        assert hint(7) == 7
        assert constant(7) == 7
        assert isinstance(hint(7), int)

    def test_symint(self, env):
        n = _size(env, "n", 64)
        assert hint(n) == 64
        assert hint(3 * n + 1) == 193
        assert constant(n) is None
        assert constant(2 * n) is None
        assert len(env.guards) == 0

    def test_symint_with_constant_expression(self, env):
        n = _size(env, "n", 64)
        five = n - n + 5
        assert isinstance(five, torch.SymInt)
        assert constant(five) == 5
        assert len(env.guards) == 0

    def test_unbacked_falls_back(self, env):
        u = env.create_unbacked_symint()
        assert hint(u) == shapes.UNBACKED_FALLBACK == 4096
        assert constant(u) is None
        assert len(env.guards) == 0


class TestRender:
    """``render`` prints an expanded expression; plain ints print as numbers."""

    def test_int(self):
        assert render(5) == "5"
        assert render(-984) == "-984"

    def test_symint(self, env):
        n = _size(env, "n", 64)
        s = _name(n)
        assert render(n) == s
        assert render(2 * n + 3) == f"2*{s} + 3"
        assert render(n * (n + 1)) == f"{s}**2 + {s}"
        assert len(env.guards) == 0

    def test_two_symbols(self, env):
        a, b = _size(env, "a", 4), _size(env, "b", 1024)
        symbols = {_name(a): a.node.expr, _name(b): b.node.expr}
        text = render(8 * a * b - 4096)
        assert text.endswith(" - 4096")
        assert sympy.sympify(text, locals=symbols) == 8 * a.node.expr * b.node.expr - 4096
        assert len(env.guards) == 0

    def test_expr(self, env):
        n = _size(env, "n", 64)
        assert shapes.expr(3) == sympy.Integer(3)
        assert shapes.expr(n) == n.node.expr


class TestFormatBytes:
    """``format_bytes`` uses binary units from KiB up with one decimal, plain bytes below."""

    @pytest.mark.parametrize(
        ("n", "text"),
        [
            (0, "0 B"),
            (1023, "1023 B"),
            (1024, "1.0 KiB"),
            (1536, "1.5 KiB"),
            (96 * 1024, "96.0 KiB"),
            (12 << 20, "12.0 MiB"),
            (int(3.2 * (1 << 30)), "3.2 GiB"),
            (5 << 40, "5120.0 GiB"),
            (-40, "-40 B"),
            (-2048, "-2.0 KiB"),
            (-(3 << 20), "-3.0 MiB"),
        ],
    )
    def test_format(self, n, text):
        assert format_bytes(n) == text


class TestNbytes:
    """``numel``/``nbytes`` multiply sizes (symbolically for symbolic sizes)."""

    def test_concrete(self):
        t = torch.empty(3, 4)
        assert shapes.numel(t) == 12
        assert shapes.nbytes(t) == 48
        assert shapes.nbytes(t, torch.bfloat16) == 24
        assert shapes.numel(torch.empty(())) == 1


class TestMemoryModel:
    """``saved`` is the sum of terms before minus after; ``describe`` renders each term."""

    def test_ints(self):
        model = MemoryModel({"logits": 100, "copy": 50}, {"lse": 30})
        assert model.saved == 120
        assert model.describe() == {"before": {"logits": "100", "copy": "50"}, "after": {"lse": "30"}}

    def test_empty_side(self):
        assert MemoryModel({"a": 10}, {}).saved == 10
        assert MemoryModel({}, {"a": 10}).saved == -10

    def test_symints(self, env):
        n = _size(env, "n", 64)
        s = _name(n)
        model = MemoryModel({"logits": 8 * n, "bias": 16}, {"lse": 2 * n})
        assert render(model.saved) == f"6*{s} + 16"
        assert hint(model.saved) == 6 * 64 + 16
        assert model.describe() == {"before": {"logits": f"8*{s}", "bias": "16"}, "after": {"lse": f"2*{s}"}}
        assert len(env.guards) == 0


class TestClears:
    """``clears(saved, threshold)``: proved for every shape when it can be ("static"), else on the hint."""

    def test_ints_are_static(self):
        assert clears(2048, 1024) == Verdict(True, "static", 2048)
        assert clears(1024, 1024) == Verdict(True, "static", 1024)
        assert clears(10, 1024) == Verdict(False, "static", 10)
        assert clears(-984, 0) == Verdict(False, "static", -984)

    def test_pays_for_every_shape(self, env):
        """1024·n ≥ 1024 holds for every n ≥ 2: proved, no guard."""
        n = _size(env, "n", 64)
        assert clears(1024 * n, 1024) == Verdict(True, "static", 65536)
        assert len(env.guards) == 0

    def test_never_pays(self, env):
        n = _size(env, "n", 64)
        assert clears(-n, 0) == Verdict(False, "static", -64)
        assert clears(4 * torch.sym_min(n, 10), 100) == Verdict(False, "static", 40)
        assert len(env.guards) == 0

    def test_depends_on_the_size(self, env):
        """100·n − 6000 ≥ 0 holds at the hint n = 64 but not for n = 2: decided on the hint."""
        n = _size(env, "n", 64)
        assert clears(100 * n - 6000, 0) == Verdict(True, "hint", 400)
        assert clears(100 * n - 7000, 0) == Verdict(False, "hint", -600)
        assert len(env.guards) == 0

    def test_two_symbols(self, env):
        a, b = _size(env, "a", 4), _size(env, "b", 1024)
        verdict = clears(a * b * 160 - torch.sym_min(a * b, 209715) * 480, 1 << 20)
        assert verdict.proof == "hint"
        assert verdict.pays is False
        assert verdict.saved_hint == 4 * 1024 * 160 - 4 * 1024 * 480
        assert len(env.guards) == 0

    def test_unbacked(self, env):
        u = env.create_unbacked_symint()
        verdict = clears(u * 1000, 1 << 20)
        assert verdict == Verdict(True, "hint", 4096 * 1000)
        assert len(env.guards) == 0
