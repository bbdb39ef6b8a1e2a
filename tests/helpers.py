"""Helpers shared by the tests: graph snapshots with stable names, float64 comparisons, tiny models."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch._dynamo.testing import normalize_gm

import fxpass


def normalize_code(code: str) -> str:
    """Graph code without file comments, with shape symbols renamed s0, s1, ... in order of appearance."""
    code = normalize_gm(code)
    names: dict[str, str] = {}

    def rename(found: re.Match) -> str:
        return names.setdefault(found.group(0), f"s{len(names)}")

    code = re.sub(r"\bs\d+\b", rename, code)
    return re.sub(r"\n\s*\n", "\n", code).strip()


def rewritten(fn: Callable, *args: Any, **options: Any) -> fxpass.Explanation:
    """Explain ``fn`` with strict rules; options are memopt options (force=True by default)."""
    options = {"strict": True, "force": True, **options}
    dynamic = options.pop("dynamic", None)
    return fxpass.explain(fn, *args, options=options, dynamic=dynamic, fullgraph=True)


def after_code(explanation: fxpass.Explanation, index: int = 0) -> str:
    return normalize_code(explanation.graphs[index].after)


def record_lines(explanation: fxpass.Explanation) -> str:
    """One stable line per decision: rule, applied, reason (paths stripped), and the key parameters."""
    lines = []
    for r in explanation.records:
        reason = re.sub(r" at \S+:\d+", "", r.reason)
        reason = re.sub(r"-?\d+(\.\d+)? (GiB|MiB|KiB|B)\b", "<bytes>", reason)
        lines.append(f"{r.rule} applied={r.applied} proof={r.proof}: {reason}")
    return "\n".join(lines)


def grads(loss: torch.Tensor, inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    return torch.autograd.grad(loss, list(inputs), allow_unused=True)


def assert_close_all(actual: Sequence[torch.Tensor | None], expected: Sequence[torch.Tensor | None], **tol: Any):
    assert len(actual) == len(expected)
    for index, (a, e) in enumerate(zip(actual, expected, strict=True)):
        if a is None or e is None:
            assert a is None and e is None, f"gradient {index}: one side is None"
            continue
        torch.testing.assert_close(a, e, msg=lambda m, i=index: f"tensor {i}: {m}", **tol)


def max_abs(tensors: torch.Tensor | Sequence[torch.Tensor | None]) -> float:
    """The largest magnitude over one tensor or several (``None`` skipped): the scale of a set of results."""
    if isinstance(tensors, torch.Tensor):
        tensors = [tensors]
    return max((t.detach().abs().max().item() for t in tensors if t is not None and t.numel()), default=0.0)


def assert_close_scaled(
    actual: torch.Tensor, expected: torch.Tensor, *, rel: float, scale: float | None = None, name: str = ""
) -> None:
    """Elementwise ``|actual − expected| ≤ rel·(|expected| + scale)``; ``scale`` defaults to ``max_abs(expected)``.

    Why not a fixed atol: two computations of the same value in another reduction order (another kernel,
    Inductor's vector width on another instruction set) differ by rounding proportional to the magnitude of
    the terms summed, not of the result. An element that is zero in exact arithmetic (a gradient that
    cancels; a parameter AdamW moved only on such a gradient's rounding noise) has no magnitude of its own,
    so a fixed atol passes or fails by machine. Pass ``scale`` (a global gradient or update max-abs) when the
    whole tensor can be such noise.
    """
    scale = max_abs(expected) if scale is None else scale
    message = f"(allowed: {rel:g}·(|expected| + {scale:.3g}))"
    torch.testing.assert_close(actual, expected, rtol=rel, atol=rel * scale, msg=lambda m: f"{name}: {m}\n{message}")
