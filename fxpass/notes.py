"""What the pricing (``compiled_cost``, ``pricing``) and the report both write down: what holds a simulated
peak, the label of memopt's in-kernel buffers, an exception in one line.

The pricing produces these and the report prints them; kept here, apart from both, neither side imports the
other (``tests/fxpass/test_imports.py`` checks that no module of the package closes an import circle).
"""

from __future__ import annotations

import dataclasses

from fxpass import shapes

# What memopt's ops allocate inside their own kernels: a key of ``pricing.Priced.describe()``, which the report
# prints under the same words.
INTERNAL = "memopt's ops inside their kernels (the largest)"


@dataclasses.dataclass(frozen=True)
class Holding:
    """One kind of buffer alive at a simulated peak: its bytes (hint) and its largest tensor. Names the thing
    that sets a step's peak, so that a user (or ``benchmarks/zoo.py``) learns what no rewrite reaches."""

    kind: str  # "saved for the backward", "gradients", "incoming gradients", "outputs", "temporaries", ...
    bytes: int
    largest: str

    def __str__(self) -> str:
        largest = f" (largest {self.largest})" if self.largest else ""
        return f"{shapes.format_bytes(self.bytes)} {self.kind}{largest}"


def error_note(error: BaseException) -> str:
    """An exception as one short line, for a report row or a warning."""
    first = (str(error).splitlines() or [""])[0]
    return f"{type(error).__name__}: {first[:160]}"
