"""Per-block compilation (the torchtitan / FSDP2 habit) and the classifier + loss compiled as one graph.

Each block is its own graph, so attention and WTA-CRS rewrite inside it; the loss is outside every block, so
cut cross-entropy needs ``HeadLoss``. Left eager, the head has no graph and no record (the recipe says so).
"""

from __future__ import annotations

import pytest
import torch
import transformers

import fxpass
from examples.distributed.train import build_model
from fxpass.integrations.blocks import HeadLoss, compile_blocks, find_blocks

pytestmark = pytest.mark.isa_sensitive


@pytest.fixture(autouse=True)
def _dynamo_limit_restored():
    """``compile_blocks`` raises Dynamo's recompile limit for the process (``allow_a_graph_per_block``), as a user
    wants it; each test here has it put back."""
    with torch._dynamo.config.patch(recompile_limit=torch._dynamo.config.recompile_limit):
        yield

OPTIONS = {"inner_compiler": "aot_eager", "force": True, "strict": True}


def twins(name: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    model = build_model(name, full=False, attention="eager")
    reference = build_model(name, full=False, attention="eager")
    reference.load_state_dict(model.state_dict())
    return model, reference


def applied_rules() -> list[str]:
    return sorted(r.rule for report in fxpass.reports() for r in report.records if r.applied)


@pytest.mark.parametrize("name", ["gpt2", "llama-1b"])
def test_blocks_and_head_loss_match_eager(name):
    model, reference = twins(name)
    assert compile_blocks(model, options=OPTIONS) == [n for n, _ in find_blocks(reference)]
    step = HeadLoss(model, backend=fxpass.MemoptBackend(options=OPTIONS))
    ids = torch.randint(0, model.config.vocab_size, (2, 16))
    loss = step(ids, ids)
    loss.backward()
    expected = reference(input_ids=ids, labels=ids).loss
    expected.backward()
    assert applied_rules() == ["attention", "cce"]  # without the KV cache both blocks share one graph
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)
    for (param_name, param), other in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(param.grad, other.grad, rtol=1e-5, atol=1e-6, msg=param_name)


def test_head_left_eager_has_no_cce_record():
    """torchtitan's default: blocks compiled, head and loss eager; the logits are not memopt's to cut."""
    model, _ = twins("gpt2")
    compile_blocks(model, "transformer.h", options=OPTIONS)
    ids = torch.randint(0, model.config.vocab_size, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    assert applied_rules() == ["attention"]  # one graph for both blocks
    assert all(r.rule != "cce" for report in fxpass.reports() for r in report.records)


@pytest.mark.parametrize("use_cache", [True, False])
def test_wta_crs_applies_inside_each_block(use_cache):
    """Inside each block, QKV and the MLP's input projection (reading LayerNorm outputs that only they keep) and
    the MLP's output projection (reading GELU's output) sample; the attention output projection is declined
    (the flash op saves its input). With HF's KV cache each block guards on its own cache layer and gets a graph
    of its own; without it the blocks share one graph, whose groups then serve every block (two steps run)."""
    model, reference = twins("gpt2")
    model.config.use_cache = reference.config.use_cache = use_cache
    compile_blocks(model, options={**OPTIONS, "wta_crs_budget": 0.5, "wta_crs_min_tokens": 1})
    ids = torch.randint(0, model.config.vocab_size, (2, 16))
    for _ in range(2):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    graphs = model.config.n_layer if use_cache else 1
    assert applied_rules().count("wta_crs") == 3 * graphs, [r.reason for rep in fxpass.reports() for r in rep.records]
    torch.testing.assert_close(loss, reference(input_ids=ids, labels=ids).loss)  # the forward stays exact


def test_find_blocks_by_class_and_path():
    model = build_model("llama-1b", full=False, attention="eager")
    layer = transformers.models.llama.modeling_llama.LlamaDecoderLayer
    by_class = [name for name, _ in find_blocks(model, layer)]
    assert by_class == [name for name, _ in find_blocks(model, "model.layers")] == ["model.layers.0", "model.layers.1"]
    with pytest.raises(ValueError, match="names no block classes"):
        find_blocks(torch.nn.Linear(2, 2))


@pytest.mark.slow
def test_every_block_gets_its_graph_past_dynamo_recompile_limit():
    """Ten blocks with HF's KV cache on: each guards on its own cache layer and compiles a graph of its own.
    ``compile_blocks`` raises Dynamo's limit (8 by default), past which the rest would run eagerly, unrewritten."""
    config = transformers.GPT2Config(
        n_embd=32, n_layer=10, n_head=2, vocab_size=64, n_positions=32, attn_implementation="eager"
    )
    model = transformers.GPT2LMHeadModel(config)
    compile_blocks(model, options={"inner_compiler": "aot_eager", "force": True})
    model(input_ids=torch.randint(0, 64, (1, 8)), use_cache=True)
    attention = [r for report in fxpass.reports() for r in report.records if r.rule == "attention" and r.applied]
    assert len(attention) == 10
