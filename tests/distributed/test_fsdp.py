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


@pytest.mark.parametrize("layout", ["whole", "blocks"])
def test_fsdp2_matches_torch_compile(tmp_path, layout):
    reports = run_driver(tmp_path, "--parallel", "fsdp", "--compile", layout)
    results = rank_results(tmp_path)
    for report in reports:
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
    assert applied(report) == ["attention", "cce"]
    (result,) = rank_results(tmp_path, world=1)
    assert_same_grads(result["memopt"]["grads"], result["torch.compile"]["grads"], rtol=2e-2, atol=2e-3)


def test_every_block_gets_its_graph_past_dynamo_recompile_limit():
    """Ten blocks compiled one by one (as under FSDP2): HF's KV cache makes each guard on its own cache layer, so
    each compiles a graph; past Dynamo's default limit of 8 the rest would run eagerly, unrewritten."""
    import transformers

    import fxpass
    from examples.distributed.train import allow_a_graph_per_block
    from fxpass.integrations.blocks import compile_blocks

    config = transformers.GPT2Config(
        n_embd=32, n_layer=10, n_head=2, vocab_size=64, n_positions=32, attn_implementation="eager"
    )
    model = transformers.GPT2LMHeadModel(config)
    limit = torch._dynamo.config.recompile_limit
    try:
        allow_a_graph_per_block(model)
        compile_blocks(model, options={"inner_compiler": "aot_eager", "force": True})
        torch._dynamo.reset()
        fxpass.clear_reports()
        model(input_ids=torch.randint(0, 64, (1, 8)))
    finally:
        torch._dynamo.config.recompile_limit = limit
    attention = [r for report in fxpass.reports() for r in report.records if r.rule == "attention" and r.applied]
    assert len(attention) == 10
