"""FSDP2 (``fully_shard`` on every block, then the root) on CPU over gloo, two processes, and on one GPU.

memopt's ops receive the parameters FSDP2 all-gathered for the forward: the compiled graphs break at each
sharded module's hooks (Dynamo skips FSDP2's hooks), so each block is a frame of its own whether the whole model
or each block is compiled, and the classifier and loss share the root's graph. Without the KV cache (the
driver's training setup) the blocks pass the same guards and share one graph: one attention record serves both. Gradients come back sharded
(DTensor) and are gathered here to compare.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.common import applied, assert_same_grads, rank_results, records, run_driver

pytestmark = pytest.mark.slow

TOL = dict(rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("layout", "variant"), [("whole", "auto"), ("blocks", "auto"), ("whole", "rowwise")])
def test_fsdp2_matches_torch_compile(tmp_path, layout, variant):
    """"rowwise": the CUDA default for returned logits, forced on CPU; the wrapper casts the all-gathered
    classifier weight the root's graph received, and its gradient comes back sharded like the others."""
    options = f'{{"force": true, "strict": true, "cce_variant": "{variant}"}}'
    reports = run_driver(tmp_path, "--parallel", "fsdp", "--compile", layout, "--options", options)
    results = rank_results(tmp_path)
    for report in reports:
        assert applied(report) == ["attention", "cce"], report["rank"]
        if variant == "rowwise":
            assert [r["variant"] for r in records(report) if r["rule"] == "cce"] == ["rowwise"]
        attention = [r for r in records(report) if r["rule"] == "attention"]
        # the causal mask is built outside the sharded block and arrives as an input: an exact additive bias
        assert all(r["causal"] is False for r in attention), attention
    for result in results:
        assert_same_grads(result["memopt"]["grads"], result["torch.compile"]["grads"], **TOL)
        torch.testing.assert_close(result["memopt"]["loss"], result["torch.compile"]["loss"], **TOL)
    assert_same_grads(results[1]["memopt"]["grads"], results[0]["memopt"]["grads"], rtol=0, atol=0)


@pytest.mark.gpu
def test_fsdp2_world_of_one_on_gpu(tmp_path):
    """One GPU, NCCL, a world of one, Inductor and memopt's Triton kernels under bf16 autocast."""
    args = ("--parallel", "fsdp", "--inner", "inductor", "--autocast", "--seq", "64")
    (report,) = run_driver(tmp_path, *args, world=1, gpu=True)
    assert applied(report) == ["attention", "cce"]
    (result,) = rank_results(tmp_path, world=1)
    assert_same_grads(result["memopt"]["grads"], result["torch.compile"]["grads"], rtol=2e-2, atol=2e-3)
