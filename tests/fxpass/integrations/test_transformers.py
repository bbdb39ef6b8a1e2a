"""A real ``transformers.Trainer`` on tiny models with memopt's route (``compile_model``) against the same Trainer
without memopt: the same per-step losses and trained weights, the same evaluation logits, and the rewrites applied.

Each run builds its model from a config under a fixed seed, so both runs start from the same weights and, with
``TrainingArguments(seed=0)``, see the same batches. The data is right-padded (attention mask 0, labels -100).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from torch.utils.data import Dataset

import fxpass
from fxpass.integrations.transformers import compile_model, missing_loss_type

VOCAB, SEQ, LAYERS, PAD = 384, 12, 2, 0
EVAL_ROWS = 8  # two full batches: a smaller last batch would add a dynamic-shape recompile
FAST = {"force": True, "inner_compiler": "aot_eager"}


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """Largest differences allowed, relative to the largest magnitude of the plain run's value."""

    losses: float  # per-step training losses, gradient norms, the evaluation loss
    logits: float  # evaluation logits after training
    weights: float  # trained weights (plain SGD: their differences are the accumulated gradient differences)


FP32 = Tolerance(losses=1e-5, logits=1e-5, weights=1e-5)
# Both runs compute in bf16 and round differently: a few bf16 ulps (2⁻⁸ relative) apart. A zero-initialized bias
# after three steps is the sum of three bf16 gradients, so its scale is theirs.
BF16 = Tolerance(losses=5e-3, logits=3e-2, weights=2e-2)


class PaddedTokens(Dataset):
    """Token rows of varying length, right-padded: ``attention_mask`` 0 and labels -100 on the padding."""

    def __init__(self, rows: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(3, VOCAB, (rows, SEQ), generator=generator)
        self.lengths = torch.randint(SEQ // 2, SEQ + 1, (rows,), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        keep = torch.arange(SEQ) < self.lengths[index]
        ids = torch.where(keep, self.ids[index], PAD)
        return {"input_ids": ids, "attention_mask": keep.long(), "labels": torch.where(keep, ids, -100)}


def _gpt2() -> transformers.PreTrainedModel:
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=LAYERS, n_head=2, bos_token_id=1, eos_token_id=2,
        pad_token_id=PAD, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )
    return transformers.GPT2LMHeadModel._from_config(config, attn_implementation="eager")


def _llama() -> transformers.PreTrainedModel:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, bos_token_id=1, eos_token_id=2, pad_token_id=PAD,
        attention_dropout=0.0,
    )
    return transformers.LlamaForCausalLM._from_config(config, attn_implementation="eager")


MODELS: dict[str, Callable[[], transformers.PreTrainedModel]] = {"gpt2": _gpt2, "llama": _llama}


def _model(name: str) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    return MODELS[name]()


@dataclasses.dataclass
class Run:
    losses: list[float]
    grad_norms: list[float]
    weights: dict[str, torch.Tensor]
    logits: np.ndarray
    eval_loss: float
    trainer: transformers.Trainer


def _train(model: torch.nn.Module, out: Path, **arguments: Any) -> Run:
    """Three logged optimizer steps, then ``predict`` on held-out rows (the logits and the evaluation loss).

    Plain SGD, because AdamW's first steps move each weight by about the learning rate whatever the size of its
    gradient: a rounding difference in a near-zero gradient would flip a whole step."""
    args = transformers.TrainingArguments(
        output_dir=str(out), max_steps=3, per_device_train_batch_size=4, per_device_eval_batch_size=4,
        optim="sgd", learning_rate=0.1, logging_steps=1, report_to=[], use_cpu=True, seed=0, save_strategy="no",
        dataloader_num_workers=0, **arguments,
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=PaddedTokens(32, seed=1))
    trainer.train()
    prediction = trainer.predict(PaddedTokens(EVAL_ROWS, seed=2))
    steps = [entry for entry in trainer.state.log_history if "loss" in entry]
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    return Run(
        [entry["loss"] for entry in steps], [entry["grad_norm"] for entry in steps], weights,
        prediction.predictions, prediction.metrics["test_loss"], trainer,
    )


def _assert_close_scaled(actual: Any, expected: Any, rel: float, what: str) -> None:
    actual, expected = torch.as_tensor(actual).double(), torch.as_tensor(expected).double()
    assert actual.shape == expected.shape, what
    error, scale = (actual - expected).abs().max().item(), expected.abs().max().item()
    assert error <= rel * scale, f"{what}: max |difference| {error:.3g} > {rel:g} × max |plain| {scale:.3g}"


def _compare(name: str, tmp_path: Path, options: dict[str, Any] = FAST, tol: Tolerance = FP32, **arguments) -> Run:
    """Train the plain model and the memopt-compiled one alike; assert they agree; return the memopt run."""
    plain_model = _model(name)
    # as compile_model does: the Trainer also reads loss_type, to count num_items_in_batch over shifted labels
    plain_model.loss_type = "ForCausalLM"
    plain = _train(plain_model, tmp_path / "plain", **arguments)
    torch._dynamo.reset()
    fxpass.clear_reports()
    model = _model(name)
    assert compile_model(model, options=options) is model
    ours = _train(model, tmp_path / "memopt", **arguments)

    assert len(ours.losses) == len(plain.losses) == 3
    for step in range(3):
        _assert_close_scaled(ours.losses[step], plain.losses[step], tol.losses, f"loss of step {step + 1}")
        _assert_close_scaled(ours.grad_norms[step], plain.grad_norms[step], tol.losses, f"grad norm {step + 1}")
    _assert_close_scaled(ours.eval_loss, plain.eval_loss, tol.losses, "evaluation loss")
    assert ours.logits.shape == (EVAL_ROWS, SEQ, VOCAB)  # evaluation got the logits
    _assert_close_scaled(ours.logits, plain.logits, tol.logits, "evaluation logits")
    assert ours.weights.keys() == plain.weights.keys()  # compiled in place: the same parameter names
    for key, weight in ours.weights.items():
        _assert_close_scaled(weight, plain.weights[key], tol.weights, f"trained {key}")
    return ours


def _training_graph() -> fxpass.GraphReport:
    """The first graph memopt compiled: the training forward (evaluation compiles its own graph later)."""
    reports = fxpass.reports()
    assert reports, "memopt compiled no graph"
    return reports[0]


def _applied(report: fxpass.GraphReport, rule: str) -> list[fxpass.RewriteRecord]:
    return [r for r in report.applied if r.rule == rule]


def _reasons(report: fxpass.GraphReport) -> list[str]:
    return [f"{r.rule}: {r.reason}" for r in report.records if r.rule != "wta_crs"]


# --- the route ----------------------------------------------------------------------------------------------


def test_compile_model_compiles_in_place_and_names_the_loss():
    gpt2, llama = _model("gpt2"), _model("llama")
    keys = list(gpt2.state_dict())
    assert gpt2.loss_type is None  # GPT2LMHeadModel names no loss: transformers warns and falls back
    assert missing_loss_type(gpt2) == "ForCausalLM" and missing_loss_type(llama) is None

    assert compile_model(gpt2) is gpt2 and compile_model(llama) is llama
    assert gpt2.loss_type == llama.loss_type == "ForCausalLM"
    assert isinstance(gpt2._compiled_call_impl, Callable)
    assert list(gpt2.state_dict()) == keys  # no _orig_mod prefix: Trainer, accelerate and checkpoints see the same


def test_compile_model_refuses_what_it_cannot_honour():
    model = _model("gpt2")
    with pytest.raises(TypeError, match="pass the module itself"):
        compile_model(torch.compile(model))
    with pytest.raises(TypeError, match="backend"):
        compile_model(model, backend="inductor")
    with pytest.raises(fxpass.ConfigError, match="unknown option"):
        compile_model(model, options={"inner_compilr": "eager"})


def test_a_custom_loss_function_keeps_its_loss_type():
    model = _model("gpt2")
    model.loss_function = lambda *args, **kwargs: None
    assert missing_loss_type(model) is None
    assert missing_loss_type(torch.nn.Linear(2, 2)) is None  # not a transformers model


def test_the_backend_name_is_refused_by_accelerate(tmp_path):
    """Why the route is ``compile_model``: accelerate validates Trainer's backend name against its own enum.

    If this starts to pass, accelerate accepts any registered backend and the README can name the string route.
    """
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), torch_compile_backend="memopt", use_cpu=True, report_to=[]
    )
    with pytest.raises(ValueError, match="not a valid DynamoBackend"):
        transformers.Trainer(model=_model("gpt2"), args=args, train_dataset=PaddedTokens(4, seed=1))


# --- Trainer runs -------------------------------------------------------------------------------------------


@pytest.mark.isa_sensitive
@pytest.mark.parametrize("name", [n if n == "gpt2" else pytest.param(n, marks=pytest.mark.slow) for n in MODELS])
def test_trainer_matches_plain_training_and_evaluation(name, tmp_path):
    ours = _compare(name, tmp_path)
    graph = _training_graph()
    assert len(_applied(graph, "attention")) == LAYERS, _reasons(graph)
    assert len(_applied(graph, "cce")) == 1, _reasons(graph)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2  # training, then evaluation
    assert not torch._dynamo.utils.counters["graph_break"]  # the loss_type warning would break here

    ours.trainer.save_model(str(tmp_path / "saved"))  # the compiled module saves and reloads as itself
    reloaded = type(ours.trainer.model).from_pretrained(tmp_path / "saved")
    for key, weight in reloaded.state_dict().items():
        torch.testing.assert_close(weight, ours.trainer.model.state_dict()[key])


@pytest.mark.slow
@pytest.mark.isa_sensitive
@pytest.mark.parametrize("name", list(MODELS))
def test_bf16_autocast(name, tmp_path):
    """``bf16=True`` on CPU: accelerate wraps ``forward`` in CPU autocast to bf16 over the fp32 weights; the
    compiled call goes through that forward, so the rewritten ops run in bf16 as the replaced matmuls did."""
    _compare(name, tmp_path, tol=BF16, bf16=True)
    graph = _training_graph()
    cce = _applied(graph, "cce")
    assert len(cce) == 1, _reasons(graph)
    assert cce[0].params["dtype"] == "bfloat16"
    # accelerate's convert_to_fp32 returns the logits as fp32: the op writes them so, with no bf16 copy beside
    assert cce[0].params["returned_logits_dtype"] == "float32", cce[0].params
    attention = _applied(graph, "attention")
    # Llama's RoPE leaves q and k fp32 beside a bf16 v under autocast: the rule casts them as autocast did.
    assert len(attention) == LAYERS, _reasons(graph)
    assert {r.params["dtype"] for r in attention} == {"bfloat16"}


@pytest.mark.slow
@pytest.mark.isa_sensitive
@pytest.mark.parametrize("variant", ["auto", "rowwise"])
def test_gradient_accumulation_keeps_the_sum_then_divide_loss(tmp_path, variant):
    """With ``gradient_accumulation_steps=2`` the Trainer passes ``num_items_in_batch`` and the model's loss is a
    sum divided by it: CCE takes the sum. "rowwise" is what CUDA takes for the Trainer's returned logits (the
    row-wise op returns them, their gradient re-attached outside the graph); evaluation, under ``no_grad``,
    keeps ``cce_with_logits``."""
    _compare("gpt2", tmp_path, options={**FAST, "cce_variant": variant}, gradient_accumulation_steps=2)
    graph = _training_graph()
    assert len(_applied(graph, "attention")) == LAYERS, _reasons(graph)
    cce = _applied(graph, "cce")
    assert len(cce) == 1, _reasons(graph)
    assert cce[0].params["reduction"] == "sum"
    assert cce[0].params["variant"] == ("rowwise" if variant == "rowwise" else "with_logits")


@pytest.mark.slow
def test_through_inductor(tmp_path):
    """The default inner compiler, on a one-graph GPT-2 run (a cold CPU Inductor compile takes tens of seconds)."""
    _compare("gpt2", tmp_path, options={"force": True})
    graph = _training_graph()
    assert len(_applied(graph, "attention")) == LAYERS, _reasons(graph)
    assert len(_applied(graph, "cce")) == 1, _reasons(graph)
