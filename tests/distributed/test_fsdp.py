"""FSDP2 (``fully_shard`` on every block, then the root) on CPU over gloo, two processes, and on one GPU.

memopt's ops receive the parameters FSDP2 all-gathered for the forward: the compiled graphs break at each
sharded module's hooks (Dynamo skips FSDP2's hooks), so each block is a graph of its own whether the whole model
or each block is compiled, and the classifier and loss share the root's graph. Gradients come back sharded
(DTensor) and are gathered here to compare.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.common import applied, assert_same_grads, rank_results, records, run_driver

pytestmark = pytest.mark.slow

TOL = dict(rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("layout", ["whole", "blocks"])
def test_fsdp2_matches_torch_compile(tmp_path, layout):
    reports = run_driver(tmp_path, "--parallel", "fsdp", "--compile", layout)
    results = rank_results(tmp_path)
    for report in reports:
        # each sharded block is a frame of its own; without a KV cache they guard alike, so one rewritten graph
        # serves both blocks (with the cache each block recompiled, and past 8 blocks fell back to eager)
        assert applied(report) == ["attention", "cce"], report["rank"]
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
    assert applied(report) == ["attention", "cce"]  # one rewritten graph serves both blocks
    (result,) = rank_results(tmp_path, world=1)
    assert_same_grads(result["memopt"]["grads"], result["torch.compile"]["grads"], rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("name", ["gpt2", "llama-1b"])
def test_the_driver_trains_without_a_kv_cache(name):
    """Each sharded block is a frame of its own: with HF's KV cache on it would guard on its cache layer and
    recompile per block, past Dynamo's limit of 8 (GPT-2 small has 12)."""
    from examples.distributed.train import build_model

    model = build_model(name, full=False, attention="sdpa")
    ids = torch.randint(0, model.config.vocab_size, (1, 8))
    assert model(input_ids=ids).past_key_values is None
