"""Registers and spill bytes a thread of the kernels at each setting the GPU sweeps time, compiled for sm_90 on
a machine without a GPU (no timing: a shortlist for ``attention_tune.py`` and ``cce_tune.py``).

    python benchmarks/tools/kernel_resources.py                         # attention d64/d128/d256 and CCE, bf16
    python benchmarks/tools/kernel_resources.py --head-dims 128 --no-cce

Runs without ``TRITON_INTERPRET``, behind the stand-in driver of ``tests/lowerings/sm90_compile.py`` (an
sm_90 device with the H200's limits that launches nothing); registers and stack bytes come from each cubin
(``cuobjdump -res-usage``). Stack above zero is local memory, mostly spills. Settings over the shared memory
fail as they do on the GPU.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks._common import error_note


def _usage(names: tuple[str, ...], run) -> str:
    from tests.lowerings import sm90_compile

    sm90_compile.RESOURCES.clear()
    sm90_compile.forget_compiled()
    try:
        run()
    except Exception as error:  # a setting over the shared memory: reported, the sweep goes on
        return error_note(error)
    found = {name: max(sm90_compile.RESOURCES[name]) for name in names if name in sm90_compile.RESOURCES}
    return ", ".join(f"{name.strip('_')} {regs} regs / {stack} B" for name, (regs, stack) in found.items())


def attention_rows(head_dim: int) -> list[str]:
    from benchmarks.tools.attention_tune import BACKWARD, BACKWARD_KEYS, FORWARD, FORWARD_KEYS
    from tests.lowerings.sm90_compile import _attention

    rows = []
    for setting in FORWARD:
        if setting[4]:  # TMA needs a device allocator for its descriptors
            continue
        tiles = dict(zip(FORWARD_KEYS, setting, strict=True))
        run = _attention(torch.bfloat16, head_dim, False, with_backward=False, forward=tiles)
        usage = _usage(("_forward_kernel",), run)
        rows.append(f"| attention d{head_dim} | forward {setting} | {usage} |")
    for setting in BACKWARD:
        tiles = dict(zip(BACKWARD_KEYS, setting, strict=True))
        usage = _usage(("_dkdv_kernel", "_dq_kernel"), _attention(torch.bfloat16, head_dim, False, backward=tiles))
        rows.append(f"| attention d{head_dim} | backward {setting} | {usage} |")
    return rows


def cross_entropy_rows() -> list[str]:
    from benchmarks.tools.cce_tune import TILE_CONFIGS
    from lowerings.cce import kernels
    from tests.lowerings.sm90_compile import _cross_entropy

    rows = []
    for softcap in (None, 30.0):
        for bn, bv, bd, warps, stages in TILE_CONFIGS:
            config = dict(BLOCK_N=bn, BLOCK_V=bv, BLOCK_D=bd, num_warps=warps, num_stages=stages)
            with kernels.forced_blocks(config):
                usage = _usage(("_lse_forward_kernel", "_grad_logits_kernel"), _cross_entropy(torch.bfloat16, softcap))
            name = "cross-entropy, softcap" if softcap else "cross-entropy"
            rows.append(f"| {name} | {(bn, bv, bd, warps, stages)} | {usage} |")
    return rows


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head-dims", default="64,128,256")
    parser.add_argument("--no-cce", dest="cce", action="store_false")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("run without TRITON_INTERPRET: the point is Triton's real code generator")
    from triton.runtime.driver import driver

    from tests.lowerings.sm90_compile import CompileOnlyDriver

    driver.set_active(CompileOnlyDriver())
    lines = ["| kernels | setting | registers / stack bytes a thread |", "|---|---|---|"]
    for head_dim in map(int, args.head_dims.split(",")):
        lines += attention_rows(head_dim)
    if args.cce:
        lines += cross_entropy_rows()
    text = "\n".join(lines)
    print(text)
    return text


if __name__ == "__main__":
    main()
