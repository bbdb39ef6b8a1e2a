"""What a compiled fine-tuning step keeps for its backward: every saved tensor by shape and dtype, per variant.

    python benchmarks/saved_tensors.py                                 # GPT-2-medium width, 2 layers, 4 × 512
    python benchmarks/saved_tensors.py --model bert-base --variants "memopt,memopt + WTA-CRS 0.1"
    python benchmarks/saved_tensors.py --tiny                          # a smoke run of the script itself

The step is ``benchmarks/wta_crs.py``'s (same models, bf16 autocast, AdamW). A
``torch.autograd.graph.saved_tensors_hooks`` pack hook sees what the compiled graph saves for its backward;
running the step again one sample larger (one graph: the batch dimension is dynamic) separates the
activations, whose shapes follow the batch, from what does not (autocast's low-precision copies of the
weights), counted per shape, since an activation can share a weight's shape: at 4 × 512 tokens a
[tokens, 2048] activation looks like a [2048, 2048] weight. It shows what a rewrite freed and which tensors
remain out of its reach, on any device, without a profiler.
"""

from __future__ import annotations

import argparse
import collections
import logging
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import header, release_memory, set_up, write_report
from benchmarks.wta_crs import add_model_arguments, add_step_arguments, backends, training_step

log = logging.getLogger("benchmarks.saved_tensors")
MiB = 1 << 20
Key = tuple[tuple[int, ...], torch.dtype]


def saved_by_shape(step, batch: int) -> collections.Counter[Key]:
    """How many tensors of each (shape, dtype) one training step saves for its backward."""
    seen: collections.Counter[Key] = collections.Counter()

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        seen[(tuple(tensor.shape), tensor.dtype)] += 1
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        step(batch)
    return seen


def nbytes(key: Key, count: int) -> int:
    shape, dtype = key
    return torch.Size(shape).numel() * dtype.itemsize * count


def scaling(key: Key, count: int, larger: collections.Counter[Key]) -> int:
    """How many of the ``count`` tensors of this (shape, dtype) follow the batch: those the one-sample-larger
    step no longer saves under the same shape. (At 4 × 512 tokens a [tokens, 2048] activation has the shape
    of a [2048, 2048] weight; the weight stays at the larger batch, the activation moves.)"""
    return count - min(count, larger.get(key, 0))


def table(saved: collections.Counter[Key], larger: collections.Counter[Key], floor: int) -> list[str]:
    """Markdown rows, largest first, entries under ``floor`` bytes folded into one row."""
    lines = ["| saved tensor | count | of which follow the batch | MiB |", "|---|---|---|---|"]
    rows = sorted(saved.items(), key=lambda item: -nbytes(*item))
    small = sum(nbytes(key, count) for key, count in rows if nbytes(key, count) < floor)
    for key, count in rows:
        if nbytes(key, count) >= floor:
            shape, dtype = key
            lines.append(f"| {list(shape)} {str(dtype).removeprefix('torch.')} | {count} "
                         f"| {scaling(key, count, larger)} | {nbytes(key, count) / MiB:.1f} |")
    if small:
        lines.append(f"| smaller ones | | | {small / MiB:.1f} |")
    activations = sum(nbytes(key, scaling(key, count, larger)) for key, count in saved.items())
    total = sum(nbytes(key, count) for key, count in saved.items())
    lines.append(f"| **total** | {sum(saved.values())} | | {total / MiB:.1f} (activations {activations / MiB:.1f}) |")
    return lines


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser, layers=2, batch=4)
    parser.add_argument("--variants", default=None, help="comma-separated variant names (benchmarks/wta_crs.py)")
    parser.add_argument("--floor-mib", type=float, default=1.0, help="fold smaller entries into one row")
    add_step_arguments(parser)
    args = parser.parse_args(argv)
    set_up(quiet_rules=True)
    device = torch.device(args.device)
    variants = backends([args.budget], args.mode)
    default = f"torch.compile,memopt,memopt + WTA-CRS {args.budget}"
    names = (args.variants or default).split(",")
    sections = [
        header("Saved tensors of one training step", device)
        + f"; {args.model} × {args.layers} layers, batch {args.batch} × {args.seq}, bf16 autocast"
    ]
    for name in names:
        train_step, optimizer = training_step(args.model, variants[name], args, device, layers=args.layers)
        train_step(args.batch)  # compile
        saved = saved_by_shape(train_step, args.batch)
        larger = saved_by_shape(train_step, args.batch + 1)
        sections += ["", f"### {name}", "", *table(saved, larger, int(args.floor_mib * MiB))]
        optimizer.state.clear()
        del train_step, optimizer
        release_memory()
        log.info("%s done", name)
    return write_report(args.out, "saved_tensors.md", "\n".join(sections))


if __name__ == "__main__":
    main()
