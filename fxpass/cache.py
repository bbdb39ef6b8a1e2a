"""Keys Inductor's on-disk caches to memopt's own source, so that a changed op never meets stale compiled code.

Inductor's FX-graph and AOTAutograd caches hash the graph and the configuration, not the Python behind a
custom op (its fake implementation decides the strides Inductor compiles against). A custom graph pass's
``uuid()`` is part of the key, so memopt installs a pass that changes nothing and whose uuid is a hash of the
fxpass and lowerings sources: editing or upgrading memopt invalidates exactly the entries it could affect.
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
