"""HF transformers models from tiny configs under ``backend="memopt"``: one CCE rewrite, eager's loss and gradients.

No downloads: every model is built from a config, with all dropout probabilities 0 so eager and compiled runs see
the same function. A step that returns only the loss gets ``memopt.cce``; the whole model compiled, which returns its logits
too, gets ``memopt.cce_with_logits`` and still returns eager's logits, with their gradient.
"""

from __future__ import annotations

import pytest
import torch
import transformers

import fxpass

pytestmark = [pytest.mark.slow, pytest.mark.isa_sensitive]

VOCAB, SEQ, BATCH = 384, 12, 2
FAST = {"force": True, "inner_compiler": "aot_eager"}


def _gpt2(n_layer: int = 2) -> transformers.GPT2LMHeadModel:
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=n_layer, n_head=2, bos_token_id=1, eos_token_id=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )
    model = transformers.GPT2LMHeadModel(config)
    model.loss_type = "ForCausalLM"  # as compile_model names it; test_gpt2_as_built_compiles_whole runs without
    assert model.lm_head.weight is model.transformer.wte.weight  # tied, as in the real GPT-2
    return model


def _llama() -> transformers.LlamaForCausalLM:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        attention_dropout=0.0,
    )
    model = transformers.LlamaForCausalLM(config)
    model.loss_type = "ForCausalLM"
    return model


def _opt() -> transformers.OPTForCausalLM:
    """OPT, whose head returns ``self.lm_head(h).contiguous()``: a copy of the classifier's output, served as it."""
    config = transformers.OPTConfig(
        vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=2,
        max_position_embeddings=32, word_embed_proj_dim=32, dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, layerdrop=0.0, pad_token_id=1, bos_token_id=2, eos_token_id=2,
    )
    model = transformers.OPTForCausalLM(config)
    model.loss_type = "ForCausalLM"
    return model


def _bert() -> transformers.BertForMaskedLM:
    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        max_position_embeddings=32, pad_token_id=0, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    model = transformers.BertForMaskedLM(config)
    model.loss_type = "ForMaskedLM"
    return model


MODELS = {"gpt2": _gpt2, "llama": _llama, "opt": _opt, "bert": _bert}


def _batch(masked_lm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, VOCAB, (BATCH, SEQ))
    labels = ids.clone()
    if masked_lm:
        keep = torch.rand(BATCH, SEQ) < 0.3
        keep[:, 0] = True
        labels[~keep] = -100
    else:
        labels[0, :3] = -100  # e.g. a prompt that is not trained on
    return ids, labels


def _parameters(model: torch.nn.Module) -> tuple[list[str], list[torch.nn.Parameter]]:
    names, params = zip(*model.named_parameters(), strict=True)  # shared (tied) parameters appear once
    return list(names), list(params)


def _grads(loss: torch.Tensor, params: list[torch.nn.Parameter]) -> list[torch.Tensor | None]:
    return list(torch.autograd.grad(loss, params, allow_unused=True))


def _final_reports() -> list[fxpass.GraphReport]:
    """One report per compiled graph: the latest for each graph id (a graph may reach the backend twice)."""
    return list({report.graph_id: report for report in fxpass.reports()}.values())


def _cce_records(applied: bool) -> list[fxpass.RewriteRecord]:
    return [r for g in _final_reports() for r in g.records if r.rule == "cce" and r.applied == applied]


def _check_against_eager(model, step, *args, options=FAST, **tol):
    """Compile ``step`` (fullgraph); its loss and every parameter gradient equal eager's; one CCE rewrite."""
    names, params = _parameters(model)
    expected = step(*args)
    expected_grads = _grads(expected, params)

    fxpass.clear_reports()
    compiled = torch.compile(step, backend="memopt", fullgraph=True, options=options)
    actual = compiled(*args)
    actual_grads = _grads(actual, params)

    applied = _cce_records(applied=True)
    assert len(applied) == 1, [r.reason for g in _final_reports() for r in g.records]
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    torch.testing.assert_close(actual, expected, **tol)
    assert len(actual_grads) == len(expected_grads) == len(names)
    for name, a, e in zip(names, actual_grads, expected_grads, strict=True):
        assert (a is None) == (e is None), name
        if a is not None:
            torch.testing.assert_close(a, e, msg=lambda m, n=name: f"gradient of {n}: {m}", **tol)
    assert all(g is not None for g in actual_grads)  # every parameter is trained, the tied head included
    return applied[0]


@pytest.mark.parametrize("name", list(MODELS))
def test_loss_only_step_is_rewritten_and_matches_eager(name):
    model = MODELS[name]()
    ids, labels = _batch(masked_lm=name == "bert")

    def step(ids, labels):
        return model(input_ids=ids, labels=labels).loss

    record = _check_against_eager(model, step, ids, labels)
    assert record.params["vocab"] == str(VOCAB)
    assert record.params["reduction"] == "mean" and record.params["ignore_index"] == -100
    assert record.params["bias"] is (name == "bert")  # BERT's MLM decoder has a bias; the causal LMs do not
    # The causal LMs shift the labels by padding them, so the op still sees B·T rows (the padded ones ignored).
    assert record.params["tokens"] == str(BATCH * SEQ) and record.params["hidden_dim"] == "32"


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_num_items_in_batch_rewrites_with_sum(name):
    """HF's gradient-accumulation path: ``reduction="sum"`` then ``/ num_items_in_batch``."""
    model = MODELS[name]()
    ids, labels = _batch(masked_lm=False)
    num_items = torch.tensor(int((labels[:, 1:] != -100).sum()) + 5)  # as if from a larger accumulated batch

    def step(ids, labels, num_items):
        return model(input_ids=ids, labels=labels, num_items_in_batch=num_items).loss

    record = _check_against_eager(model, step, ids, labels, num_items)
    assert record.params["reduction"] == "sum"
    # and it is not the plain mean: the division by num_items really reached the compiled graph
    mean_loss = model(input_ids=ids, labels=labels).loss
    assert not torch.allclose(step(ids, labels, num_items), mean_loss)


def _z_loss(logits: torch.Tensor) -> torch.Tensor:
    """A second loss on the returned logits (z-loss), so that a real gradient reaches them."""
    return 1e-2 * torch.logsumexp(logits.float(), dim=-1).square().mean()


def _check_whole_model(model, ids, labels, use_logits: bool, options=FAST, **tol) -> fxpass.RewriteRecord:
    """``torch.compile(model)`` as users call it: the output's loss and logits equal eager's, and so do the
    gradients of the loss alone (the logits dropped) or of the loss plus a second loss on the logits."""
    names, params = _parameters(model)
    expected = model(input_ids=ids, labels=labels)
    expected_total = expected.loss + (_z_loss(expected.logits) if use_logits else 0)
    expected_grads = _grads(expected_total, params)

    fxpass.clear_reports()
    compiled = torch.compile(model, backend="memopt", fullgraph=True, options=options)
    actual = compiled(input_ids=ids, labels=labels)
    actual_grads = _grads(actual.loss + (_z_loss(actual.logits) if use_logits else 0), params)

    applied = _cce_records(applied=True)
    assert len(applied) == 1, [r.reason for g in _final_reports() for r in g.records]
    assert applied[0].params["returns_logits"] is True
    # "auto" serves returned logits with the detached cce_with_logits on every device
    wanted = "rowwise" if options.get("cce_variant", "auto") == "rowwise" else "with_logits"
    assert applied[0].params["variant"] == wanted, applied[0].params
    torch.testing.assert_close(actual.loss, expected.loss, **tol)
    torch.testing.assert_close(actual.logits, expected.logits, **tol)
    for name, a, e in zip(names, actual_grads, expected_grads, strict=True):
        assert a is not None and e is not None, name
        torch.testing.assert_close(a, e, msg=lambda m, n=name: f"gradient of {n}: {m}", **tol)
    return applied[0]


ROWWISE = {**FAST, "cce_variant": "rowwise"}


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("use_logits", [False, True], ids=["logits_dropped", "second_loss_on_logits"])
@pytest.mark.parametrize("options", [FAST, ROWWISE], ids=["with_logits", "rowwise"])
def test_whole_model_compile_returns_exact_logits(name, use_logits, options):
    """Both ways of serving a loss whose logits are returned: ``cce_with_logits`` (the CPU default), and the
    row-wise op returning the logits with their own gradient re-attached outside the graph (the CUDA default;
    ``fxpass/returned_logits.py``)."""
    model = MODELS[name]()
    ids, labels = _batch(masked_lm=name == "bert")
    _check_whole_model(model, ids, labels, use_logits, options)


@pytest.mark.parametrize("options", [FAST, ROWWISE], ids=["with_logits", "rowwise"])
def test_opt_returns_eagers_contiguous_logits(options):
    """OPT's ``.contiguous()`` logits, the model compiled whole (fullgraph): the op's logits stand in for them,
    eager's bits and contiguous, beside eager's loss and gradients."""
    model = _opt()
    ids, labels = _batch(masked_lm=False)
    expected = model(input_ids=ids, labels=labels).logits
    record = _check_whole_model(model, ids, labels, use_logits=True, options=options)
    assert record.params["returned_logits_transformed"] is False
    logits = torch.compile(model, backend="memopt", fullgraph=True, options=options)(input_ids=ids, labels=labels).logits
    assert torch.equal(logits, expected) and logits.is_contiguous()


def test_gpt2_as_built_compiles_whole():
    """GPT-2 as transformers builds it: ``loss_type`` None, so its ``loss_function`` logs a ``warning_once`` on
    every call. ``import fxpass`` has Dynamo skip that call (``fxpass.integrations.transformers_logging``), so
    the card's ``torch.compile(model, backend="memopt")`` holds head and loss in one graph (fullgraph) and CCE
    applies without the user setting anything."""
    model = _gpt2()
    model.loss_type = None
    _check_whole_model(model, *_batch(masked_lm=False), use_logits=False)


def _saved_tensor_shapes(fn) -> list[tuple[int, ...]]:
    """Shapes of every tensor autograd saves while ``fn`` runs (the compiled graph's saved activations)."""
    shapes: list[tuple[int, ...]] = []

    def pack(tensor):
        shapes.append(tuple(tensor.shape))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        fn()
    return shapes


@pytest.mark.parametrize("memopt", [False, "auto", "rowwise"], ids=["plain_compile", "memopt", "memopt_rowwise"])
def test_whole_model_saves_nothing_logits_sized(memopt):
    """Plain compile keeps [N, V] (log-probabilities) for backward; memopt keeps nothing with V columns but the
    classifier itself (and, row-wise, its fp32 gradient), so logits dropped by the caller die at once."""
    model = _gpt2()
    ids, labels = _batch(masked_lm=False)
    compiled = torch.compile(model, backend="memopt" if memopt else "aot_eager", fullgraph=True,
                             options={**FAST, "cce_variant": memopt} if memopt else None)
    shapes = _saved_tensor_shapes(lambda: compiled(input_ids=ids, labels=labels))
    logits_sized = [shape for shape in shapes if shape and shape[-1] == VOCAB and shape != (VOCAB, 32)]
    assert bool(logits_sized) is not memopt, shapes


def test_gpt2_through_inductor():
    """The default inner compiler: Inductor compiles the rewritten graph, memopt.cce stays an opaque op on CPU.

    One layer: a cold Inductor compile on CPU costs tens of seconds per layer-sized graph.
    """
    model = _gpt2(n_layer=1)
    ids, labels = _batch(masked_lm=False)

    def step(ids, labels):
        return model(input_ids=ids, labels=labels).loss

    _check_against_eager(model, step, ids, labels, options={"force": True})


@pytest.mark.parametrize("variant", ["auto", "rowwise"])
def test_gpt2_whole_model_through_inductor(variant):
    """The whole model under Inductor. ``cce_with_logits``: the returned logits' gradient (zeros when dropped, a
    z-loss's here) reaches the fused backward through AOTAutograd's tangents. The row-wise op: the logits leave
    the graph without a gradient input, and the wrapper adds their z-loss gradient outside it."""
    options = {"force": True, "cce_variant": variant}
    _check_whole_model(_gpt2(n_layer=1), *_batch(masked_lm=False), use_logits=True, options=options)
