"""DDP on CPU over gloo, two processes: memopt's step equals plain torch.compile's after the all-reduce.

Dynamo's DDP optimizer splits the captured graph where a gradient bucket fills and calls the backend once per
piece. A bucket boundary falls between parameters, and neither pattern has a parameter inside it (attention is
parameter-free from ``q @ kᵀ`` to ``@ v``; CCE's classifier weight is the last op's input), so both survive any
bucket size. What a split changes: a block's attention mask may arrive from another piece as an input, so it is
passed as a bias instead of a proved causal flag, and a linear whose input crosses a piece boundary cannot have
it freed (WTA-CRS declines: a graph input stays alive). ``optimize_ddp="python_reducer"`` keeps one graph.
"""

from __future__ import annotations

import pytest

from tests.distributed.common import applied, assert_same_grads, rank_results, records, run_driver

pytestmark = pytest.mark.slow

TOL = dict(rtol=1e-5, atol=1e-6)  # the flash and CCE references sum in another order than eager attention


def test_ddp_small_buckets_keep_patterns_whole(tmp_path):
    """Buckets of 10 KiB split tiny GPT-2 into ~8 pieces; attention and CCE still rewrite on every rank."""
    reports = run_driver(tmp_path, "--parallel", "ddp", "--bucket-mb", "0.01")
    results = rank_results(tmp_path)
    for report in reports:
        assert applied(report) == ["attention", "attention", "cce"], report["rank"]
        graphs = [graph["graph"] for graph in report["variants"]["memopt"]["graphs"]]
        assert len(graphs) > 3, "the DDP optimizer did not split the graph"
        assert len(set(graphs)) == len(graphs), f"pieces share a graph id: {graphs}"
        # the causal mask is built in the first piece and reaches the blocks as an input: an exact bias
        assert all(r["causal"] is False for r in records(report) if r["rule"] == "attention")
        declined = [r for r in records(report) if r["rule"] == "wta_crs" and "placeholder" in r["reason"]]
        assert declined, "a linear reading a piece's input is declined with the reason"
    for rank, result in enumerate(results):
        assert_same_grads(result["memopt"]["grads"], result["torch.compile"]["grads"], **TOL)
        torch_loss, memopt_loss = result["torch.compile"]["loss"], result["memopt"]["loss"]
        assert abs(torch_loss - memopt_loss) < 1e-5, rank
    assert results[0]["memopt"]["loss"] != results[1]["memopt"]["loss"], "ranks must see different batches"
    for variant in ("memopt", "torch.compile"):  # all-reduced: every rank holds the same gradients
        assert_same_grads(results[1][variant]["grads"], results[0][variant]["grads"], rtol=0, atol=0)


def test_ddp_small_buckets_with_the_rowwise_op_returning_logits(tmp_path):
    """The CUDA default for returned logits, forced on CPU: the piece holding the loss returns the logits from
    the row-wise op and the backend re-attaches their gradient outside it; gradients still equal plain
    torch.compile's after the all-reduce."""
    options = '{"force": true, "strict": true, "cce_variant": "rowwise"}'
    reports = run_driver(tmp_path, "--parallel", "ddp", "--bucket-mb", "0.01", "--options", options)
    results = rank_results(tmp_path)
    for report in reports:
        assert applied(report) == ["attention", "attention", "cce"], report["rank"]
        assert [r["variant"] for r in records(report) if r["rule"] == "cce"] == ["rowwise"]
    for result in results:
        assert_same_grads(result["memopt"]["grads"], result["torch.compile"]["grads"], **TOL)
        assert abs(result["torch.compile"]["loss"] - result["memopt"]["loss"]) < 1e-5


def test_ddp_per_block_compile_with_compiled_head_loss(tmp_path):
    """Llama's shape, each block compiled alone, classifier + loss in one graph: CCE and attention apply (the
    blocks share one graph: one attention record)."""
    reports = run_driver(tmp_path, "--parallel", "ddp", "--compile", "blocks", "--model", "llama-1b")
    results = rank_results(tmp_path)
    for report in reports:
        assert applied(report) == ["attention", "cce"], report["rank"]
    for result in results:
        assert_same_grads(result["memopt"]["grads"], result["torch.compile"]["grads"], **TOL)
    assert_same_grads(results[1]["memopt"]["grads"], results[0]["memopt"]["grads"], rtol=0, atol=0)


def test_ddp_python_reducer_keeps_one_graph(tmp_path):
    """``torch._dynamo.config.optimize_ddp = "python_reducer"`` (compiled autograd's reducer) does not split: one
    graph, the causal mask proved and passed as a flag, gradients still equal after the all-reduce."""
    reports = run_driver(tmp_path, "--parallel", "ddp", "--bucket-mb", "0.01", "--optimize-ddp", "python_reducer")
    results = rank_results(tmp_path)
    for report in reports:
        assert applied(report) == ["attention", "attention", "cce"]
        assert len(report["variants"]["memopt"]["graphs"]) == 1
        assert all(r["causal"] is True for r in records(report) if r["rule"] == "attention")
    for result in results:
        assert_same_grads(result["memopt"]["grads"], result["torch.compile"]["grads"], **TOL)
    assert_same_grads(results[1]["memopt"]["grads"], results[0]["memopt"]["grads"], rtol=0, atol=0)
