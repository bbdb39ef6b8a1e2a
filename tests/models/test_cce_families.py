"""HF causal-LM families whose logits are transformed between classifier and loss, compiled whole with labels under
``backend="memopt"``: Gemma 2 (final-logit softcap), Cohere / Command-R (``logit_scale``, multiplied), Granite
(``logits_scaling``, divided), and Llama (no transform) as the control.

Each returns its logits after the transform. CCE must apply all the same (``fxpass.reports()``), the returned logits
must be eager's, bit for bit, and the loss and every parameter's gradient eager's, whether the caller drops the
logits or puts a second loss on them, on every path: the loss-only step, the whole model (``cce_with_logits`` and the
row-wise op), Inductor, and HF's Trainer through ``compile_model``.

No downloads: every model is built from a tiny config with its real loss and head code. The transforms take values
that matter at this size (logits are ~0.4 here, so Gemma 2's real cap of 30 would be the identity) and are not
powers of two, so that a multiplication by 1/3 would not pass for Granite's division. The attention rule is off in
the exactness checks (its rewrite of Gemma 2's softcapped attention changes the hidden states by rounding, and is
tested on its own); one test checks the decisions with every rule on.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

import fxpass
from fxpass.integrations.transformers import compile_model

pytestmark = pytest.mark.slow

VOCAB, SEQ, BATCH, LAYERS = 384, 12, 2, 2
COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=32, bos_token_id=1, eos_token_id=2, pad_token_id=0, attention_dropout=0.0,
)


@dataclasses.dataclass(frozen=True)
class Family:
    """A family's tiny model and the transform the CCE record must name."""

    build: Callable[[int], transformers.PreTrainedModel]
    softcap: float | None = None
    logit_scale: float = 1.0
    logit_divisor: float = 1.0

    @property
    def transformed(self) -> bool:
        return (self.softcap, self.logit_scale, self.logit_divisor) != (None, 1.0, 1.0)


def _gemma2(layers: int) -> transformers.PreTrainedModel:
    config = transformers.Gemma2Config(**COMMON, num_hidden_layers=layers, head_dim=8, final_logit_softcapping=0.5)
    return transformers.Gemma2ForCausalLM(config)


def _cohere(layers: int) -> transformers.PreTrainedModel:
    return transformers.CohereForCausalLM(transformers.CohereConfig(**COMMON, num_hidden_layers=layers, logit_scale=0.3))


def _granite(layers: int) -> transformers.PreTrainedModel:
    config = transformers.GraniteConfig(**COMMON, num_hidden_layers=layers, logits_scaling=3.0)
    return transformers.GraniteForCausalLM(config)


def _llama(layers: int) -> transformers.PreTrainedModel:
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON, num_hidden_layers=layers))


FAMILIES = {
    "gemma2": Family(_gemma2, softcap=0.5),
    "cohere": Family(_cohere, logit_scale=0.3),
    "granite": Family(_granite, logit_divisor=3.0),
    "llama": Family(_llama),
}
TRANSFORMED = [name for name, family in FAMILIES.items() if family.transformed]
EXACT = {"force": True, "inner_compiler": "aot_eager", "disable": ["attention"]}


def _model(name: str, layers: int = LAYERS) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    model = FAMILIES[name].build(layers)
    model.loss_type = "ForCausalLM"
    return model


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=generator)
    labels = ids.clone()
    labels[0, :3] = -100  # a prompt that is not trained on
    return ids, labels


def _cce_record(reports: list[fxpass.GraphReport]) -> fxpass.RewriteRecord:
    """The one CCE record of the last compile of each graph, which must have applied."""
    latest = {report.graph_id: report for report in reports}.values()
    records = [record for report in latest for record in report.records if record.rule == "cce"]
    assert len(records) == 1 and records[0].applied, [record.reason for record in records]
    return records[0]


def _check_transform(record: fxpass.RewriteRecord, name: str) -> None:
    family = FAMILIES[name]
    params = record.params
    assert (params["softcap"], params["logit_scale"], params["logit_divisor"]) == (
        family.softcap, family.logit_scale, family.logit_divisor,
    ), params


def _z_loss(logits: torch.Tensor) -> torch.Tensor:
    """A second loss on the returned logits, so that a real gradient reaches them (through their transform)."""
    return 1e-2 * torch.logsumexp(logits.float(), dim=-1).square().mean()


def _gradients(loss: torch.Tensor, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    names, params = zip(*model.named_parameters(), strict=True)
    return dict(zip(names, torch.autograd.grad(loss, params), strict=True))


def _assert_gradients_close(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], **tol: Any) -> None:
    assert actual.keys() == expected.keys()
    for name, grad in actual.items():
        torch.testing.assert_close(grad, expected[name], msg=lambda m, n=name: f"gradient of {n}: {m}", **tol)


@pytest.mark.parametrize("name", list(FAMILIES))
@pytest.mark.parametrize("use_logits", [False, True], ids=["logits_dropped", "second_loss_on_logits"])
@pytest.mark.parametrize("variant", ["chunked", "rowwise"], ids=["with_logits", "rowwise"])
def test_whole_model_returns_eagers_transformed_logits(name, use_logits, variant):
    """``torch.compile(model)`` called with labels: the record applied, naming the transform; the logits the model
    returns (transformed) are eager's bits; the loss and every gradient are eager's."""
    model = _model(name)
    ids, labels = _batch()
    expected = model(input_ids=ids, labels=labels)
    expected_grads = _gradients(expected.loss + (_z_loss(expected.logits) if use_logits else 0), model)

    fxpass.clear_reports()
    compiled = torch.compile(model, backend="memopt", fullgraph=True, options={**EXACT, "cce_variant": variant})
    actual = compiled(input_ids=ids, labels=labels)
    actual_grads = _gradients(actual.loss + (_z_loss(actual.logits) if use_logits else 0), model)

    record = _cce_record(fxpass.reports())
    _check_transform(record, name)
    assert record.params["returns_logits"] is True
    assert record.params["returned_logits_transformed"] is FAMILIES[name].transformed
    assert record.params["variant"] == ("rowwise" if variant == "rowwise" else "with_logits")
    assert torch.equal(actual.logits, expected.logits)
    torch.testing.assert_close(actual.loss, expected.loss)
    _assert_gradients_close(actual_grads, expected_grads)


@pytest.mark.parametrize("name", list(FAMILIES))
@pytest.mark.parametrize("variant", ["chunked", "rowwise"])
def test_loss_only_step(name, variant):
    """A step that returns only the loss: the logits are never formed, the transform is the op's arguments."""
    model = _model(name)
    ids, labels = _batch()

    def step(ids, labels):
        return model(input_ids=ids, labels=labels).loss

    expected = step(ids, labels)
    expected_grads = _gradients(expected, model)
    fxpass.clear_reports()
    compiled = torch.compile(step, backend="memopt", fullgraph=True, options={**EXACT, "cce_variant": variant})
    actual = compiled(ids, labels)
    record = _cce_record(fxpass.reports())
    _check_transform(record, name)
    assert record.params["returns_logits"] is False and record.params["variant"] == variant
    torch.testing.assert_close(actual, expected)
    _assert_gradients_close(_gradients(actual, model), expected_grads)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_every_rule_on_still_gives_cce(name):
    """The decisions with every rule on and the size thresholds of a real run ignored (``force``): CCE applies to
    each family, returning its logits as the model does."""
    model = _model(name)
    ids, labels = _batch()
    explanation = fxpass.explain(
        lambda ids, labels: model(input_ids=ids, labels=labels), ids, labels, options={"force": True},
        fullgraph=True,
    )
    record = _cce_record(explanation.graphs)
    _check_transform(record, name)
    assert record.params["returned_logits_transformed"] is FAMILIES[name].transformed


@pytest.mark.parametrize("name", ["llama", "cohere"], ids=["untied", "tied"])
def test_bf16_tables_take_the_embedding_rule(name):
    """bf16 weights: the word table's gradient comes from memopt's embedding op (its fp32 sum over the distinct
    indices, rounded once), added to the head's where the classifier is tied (Cohere). Every other gradient is
    bit for bit the run's without the rule; the table's is within bf16 rounding of it (eager CPU, there, sums
    the table's rows in bf16)."""
    model = _model(name).bfloat16()
    ids, labels = _batch()

    def step(options: dict[str, Any]) -> dict[str, torch.Tensor]:
        torch._dynamo.reset()
        fxpass.clear_reports()
        compiled = torch.compile(model, backend="memopt", fullgraph=True, options=options)
        return _gradients(compiled(input_ids=ids, labels=labels).loss, model)

    options = {**EXACT, "cce_variant": "rowwise"}
    without = step({**options, "disable": ["attention", "embedding"]})
    actual = step(options)
    records = [r for report in fxpass.reports() for r in report.records if r.rule == "embedding"]
    assert [r.applied for r in records] == [True], [r.reason for r in records]
    table = "model.embed_tokens.weight"
    assert actual.keys() == without.keys() and table in actual
    for key, grad in actual.items():
        if key != table:
            assert torch.equal(grad, without[key]), key
    scale = without[table].float().abs().max().item()
    torch.testing.assert_close(actual[table].float(), without[table].float(), rtol=0, atol=scale * 2**-7)
    assert actual[table].dtype == torch.bfloat16


@pytest.mark.parametrize("name", ["gemma2", "granite"])
def test_through_inductor(name):
    """The default inner compiler on one layer (a cold CPU Inductor compile takes tens of seconds): Inductor
    compiles ``cce_with_logits``' body with its transform; the logits stay eager's to rounding (Inductor's own
    tanh), the gradients eager's, also through the logits."""
    model = _model(name, layers=1)
    ids, labels = _batch()
    expected = model(input_ids=ids, labels=labels)
    expected_grads = _gradients(expected.loss + _z_loss(expected.logits), model)
    fxpass.clear_reports()
    options = {"force": True, "disable": ["attention"], "cce_variant": "chunked"}
    actual = torch.compile(model, backend="memopt", fullgraph=True, options=options)(input_ids=ids, labels=labels)
    actual_grads = _gradients(actual.loss + _z_loss(actual.logits), model)
    record = _cce_record(fxpass.reports())
    assert record.params["returned_logits_transformed"] is True
    torch.testing.assert_close(actual.logits, expected.logits)
    torch.testing.assert_close(actual.loss, expected.loss)
    _assert_gradients_close(actual_grads, expected_grads)


# --- HF Trainer, through compile_model ----------------------------------------------------------------------------


class _Tokens(torch.utils.data.Dataset):
    """Token rows, right-padded: ``attention_mask`` 0 and labels -100 on the padding."""

    def __init__(self, rows: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(3, VOCAB, (rows, SEQ), generator=generator)
        self.lengths = torch.randint(SEQ // 2, SEQ + 1, (rows,), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        keep = torch.arange(SEQ) < self.lengths[index]
        ids = torch.where(keep, self.ids[index], 0)
        return {"input_ids": ids, "attention_mask": keep.long(), "labels": torch.where(keep, ids, -100)}


def _train(model: torch.nn.Module, out: Path, **arguments: Any) -> tuple[list[float], Any, dict[str, torch.Tensor]]:
    """Three SGD steps, then ``predict``: the logged losses, the evaluation logits, the trained weights."""
    args = transformers.TrainingArguments(
        output_dir=str(out), max_steps=3, per_device_train_batch_size=4, per_device_eval_batch_size=4, optim="sgd",
        learning_rate=0.1, logging_steps=1, report_to=[], use_cpu=True, seed=0, save_strategy="no",
        dataloader_num_workers=0, **arguments,
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_Tokens(16, seed=1))
    trainer.train()
    logits = trainer.predict(_Tokens(8, seed=2)).predictions
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return losses, logits, {name: p.detach().clone() for name, p in model.named_parameters()}


def _close(actual: Any, expected: Any, rel: float, what: str) -> None:
    """|actual − expected| ≤ rel · max |expected|."""
    actual, expected = torch.as_tensor(actual).double(), torch.as_tensor(expected).double()
    error, scale = (actual - expected).abs().max().item(), expected.abs().max().item()
    assert error <= rel * scale, f"{what}: max |difference| {error:.3g} > {rel:g} × {scale:.3g}"


@pytest.mark.parametrize(
    ("name", "bf16", "rel"),
    [("gemma2", False, 1e-5), ("cohere", False, 1e-5), ("granite", False, 1e-5), ("gemma2", True, 3e-2)],
    ids=["gemma2", "cohere", "granite", "gemma2_bf16"],
)
def test_trainer(name, bf16, rel, tmp_path):
    """``compile_model`` then ``Trainer``: the training graph gets CCE with the transformed logits returned
    (accelerate casts them to fp32 under ``bf16=True``: the op writes them so), and the losses, evaluation logits
    and trained weights are plain training's (bf16: a few bf16 roundings apart)."""
    plain = _train(_model(name), tmp_path / "plain", bf16=bf16)
    torch._dynamo.reset()
    fxpass.clear_reports()
    model = compile_model(_model(name), options={**EXACT, "inner_compiler": "aot_eager"})
    ours = _train(model, tmp_path / "memopt", bf16=bf16)

    record = _cce_record(fxpass.reports()[:1])  # the training graph (evaluation compiles its own)
    _check_transform(record, name)
    assert record.params["returned_logits_transformed"] is True
    if bf16:
        assert record.params["dtype"] == "bfloat16" and record.params["returned_logits_dtype"] == "float32"
    for step, (mine, theirs) in enumerate(zip(ours[0], plain[0], strict=True)):
        _close(mine, theirs, rel, f"loss of step {step + 1}")
    _close(ours[1], plain[1], rel, "evaluation logits")
    for key, weight in ours[2].items():
        _close(weight, plain[2][key], rel, f"trained {key}")


@pytest.mark.gpu
@pytest.mark.parametrize("name", TRANSFORMED)
def test_cuda_bf16_whole_model(name):
    """On CUDA in bf16 with the defaults a user gets (every rule on, Inductor, ``cce_variant="auto"``): CCE applies
    and the transformed logits, the loss and the gradients are no further from the fp32 model's than eager bf16's
    (twice its error, plus a floor)."""
    ids, labels = (t.cuda() for t in _batch())
    exact_model = _model(name).cuda()
    expected = exact_model(input_ids=ids, labels=labels)
    exact = [expected.logits, expected.loss, *_gradients(expected.loss, exact_model).values()]
    eager_model = _model(name).cuda().bfloat16()
    eager = eager_model(input_ids=ids, labels=labels)
    baseline = [eager.logits, eager.loss, *_gradients(eager.loss, eager_model).values()]
    model = _model(name).cuda().bfloat16()
    fxpass.clear_reports()
    actual = torch.compile(model, backend="memopt", fullgraph=True, options={"force": True})(input_ids=ids,
                                                                                            labels=labels)
    ours = [actual.logits, actual.loss, *_gradients(actual.loss, model).values()]
    record = _cce_record(fxpass.reports())
    _check_transform(record, name)
    assert record.params["returned_logits_transformed"] is True
    for index, (mine, theirs, truth) in enumerate(zip(ours, baseline, exact, strict=True)):
        our_error = (mine.double() - truth.double()).norm().item()
        eager_error = (theirs.double() - truth.double()).norm().item()
        assert our_error <= 2 * eager_error + 1e-4 * truth.double().norm().item(), (index, our_error, eager_error)
