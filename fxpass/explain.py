"""``fxpass.explain``: what memopt would rewrite in a function, without running Inductor.

In the spirit of ``torch._dynamo.explain``: the function runs once under ``torch.compile`` with memopt's
rewrites and an eager inner compiler, and the reports and rewritten graphs come back. ``assume_device="cuda"``
answers for a GPU from a CPU-only machine: the memory models charge the CUDA implementations while the function
runs where its tensors are.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch

from fxpass.backend import MemoptBackend
from fxpass.report import GraphReport, RewriteRecord


@dataclasses.dataclass
class Explanation:
    """Reports of every graph Dynamo captured, in capture order; ``result`` is what the function returned."""

    graphs: list[GraphReport]
    result: Any = None

    @property
    def records(self) -> list[RewriteRecord]:
        return [record for graph in self.graphs for record in graph.records]

    @property
    def applied(self) -> list[RewriteRecord]:
        return [record for record in self.records if record.applied]

    def saved_bytes(self) -> dict[str, int] | None:
        """Bytes every graph's compiled forward saves for the backward, summed, under torch.compile and under
        memopt (their hints); None where a graph was not priced."""
        totals = {"torch.compile": 0, "memopt": 0}
        for graph in self.graphs:
            if graph.step is None or "error" in graph.step:
                return None
            for name in totals:
                totals[name] += graph.step[name].hints()["saved"]
        return totals

    def peak_bytes(self, returned_held: bool = True) -> dict[str, int] | None:
        """The step's simulated peak beyond its inputs under torch.compile and under memopt (hints); None where a
        graph was not priced. Graphs run one after another, each while the tensors the earlier ones saved for
        the backward are alive: the largest of those sums (``GraphReport.peaks``). ``returned_held``: whether the
        caller holds the returned logits through the backward (``out.loss.backward()``) or keeps only the loss."""
        totals = {"torch.compile": 0, "memopt": 0}
        held = dict.fromkeys(totals, 0)
        for graph in self.graphs:
            peaks = graph.peaks(returned_held)
            if peaks is None:
                return None
            for name in totals:
                totals[name] = max(totals[name], held[name] + peaks[name])
                held[name] += graph.step[name].hints()["saved"]
        return totals

    def __str__(self) -> str:
        if not self.graphs:
            return "memopt: Dynamo captured no graph"
        return "\n\n".join(graph.summary() for graph in self.graphs)


def explain(
    fn: Callable,
    *args: Any,
    options: Mapping[str, Any] | None = None,
    dynamic: bool | None = None,
    fullgraph: bool = False,
    assume_device: str | None = None,
    price_steps: bool = True,
    execute: bool = True,
    **kwargs: Any,
) -> Explanation:
    """Run ``fn(*args, **kwargs)`` once under memopt's rewrites and return what was decided.

    ``options`` are memopt options (as for ``torch.compile``); the inner compiler is forced to "eager".
    ``assume_device`` ("cuda" or "cpu") is the ``assume_device`` option: decide as that device's
    implementations would, whatever device the tensors are on. ``price_steps`` prices each whole graph as
    torch.compile runs it, before and after the rewrites: the step's saved-for-backward bytes under
    torch.compile and under memopt, known before anything runs on a GPU (``Explanation.saved_bytes``).
    ``execute=False`` captures, rewrites and prices the first graph and stops there, running nothing: a step at
    a GPU's sizes is explained on a laptop in seconds (its CPU would take minutes to run it). A step that
    compiles into one graph (an HF model's loss step) is seen whole; after a graph break the rest is not seen,
    and ``result`` is None.
    """
    graphs: list[GraphReport] = []
    options = {**(options or {}), "inner_compiler": "eager"}
    if assume_device is not None:
        options["assume_device"] = assume_device
    backend = MemoptBackend(options=options, sink=graphs.append, keep_code=True, price_steps=price_steps)
    compiled = torch.compile(fn, backend=backend if execute else _stopping(backend), dynamic=dynamic,
                             fullgraph=fullgraph)
    try:
        result = compiled(*args, **kwargs)
    except _Stopped:
        result = None
    return Explanation(graphs, result)


class _Stopped(Exception):
    """Raised by a graph compiled with ``execute=False`` in place of running it."""


def _stopping(backend: MemoptBackend) -> Callable:
    """``backend``, whose compiled graphs stop the call instead of running."""

    def compile_without_running(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable:
        backend(gm, example_inputs)

        def stop(*args: Any) -> Any:
            raise _Stopped

        return stop

    return compile_without_running
