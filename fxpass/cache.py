"""Keys Inductor's on-disk caches to memopt's own source, so that a changed op never meets stale compiled code.

Inductor's FX-graph and AOTAutograd caches hash the graph and the configuration, not the Python behind a
custom op (its fake implementation decides the strides Inductor compiles against). A custom graph pass's
``uuid()`` is part of the key, so memopt installs a pass that changes nothing and whose uuid is a hash of the
fxpass and lowerings sources: editing or upgrading memopt invalidates exactly the entries it could affect.

The AOTAutograd cache also refuses ("bypasses") a graph that calls a Python function it does not know, such as
the WTA-CRS rule's ``lowerings.wta_crs.op.sample``, so such a graph was traced again on every start (GPT-2 small
with WTA-CRS on 2 CPU cores: 17.9 s to the first step with warm caches, against 7.9 s for torch.compile).
``cacheable_functions`` names memopt's functions in a graph for ``unsafe_marked_cacheable_functions``, with
the source hash as the value torch mixes into the key.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch.fx
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

_PACKAGES = ("fxpass", "lowerings")


@functools.cache
def source_hash() -> bytes:
    root = Path(__file__).resolve().parents[1]
    files = sorted(str(path) for package in _PACKAGES for path in (root / package).rglob("*.py"))
    return get_hash_for_files(tuple(files))


class SourceKeyedPass(CustomGraphPass):
    """A post-grad pass that leaves the graph alone; it exists for its ``uuid``."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        return None

    def uuid(self) -> bytes:
        return source_hash()


SOURCE_KEYED_PASS = SourceKeyedPass()


def cacheable_functions(gm: torch.fx.GraphModule) -> dict[str, str]:
    """{qualified name: source hash} of memopt's Python functions that ``gm`` (or a subgraph, such as a checkpointed
    region's body) calls, in the form ``torch._inductor.config.unsafe_marked_cacheable_functions`` takes."""
    names = {
        f"{node.target.__module__}.{node.target.__name__}"
        for module in gm.modules()
        if isinstance(module, torch.fx.GraphModule)
        for node in module.graph.nodes
        if node.op == "call_function" and str(getattr(node.target, "__module__", "")).split(".")[0] in _PACKAGES
    }
    return dict.fromkeys(sorted(names), source_hash().hex())
