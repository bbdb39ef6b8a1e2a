"""``memory_budget``: the graph compiles under the recomputation setting whose simulated peak meets the budget;
recomputation changes no numbers; a budget out of reach is reported, never raised; the plan adds no guard."""

from __future__ import annotations

import json
import operator

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

import fxpass
from fxpass import budget
from fxpass.config import Config, ConfigError, parse_memory_budget

MiB = 1 << 20


class MLP(nn.Module):
    """Residual GELU MLP blocks: each saves its [N, 4D] activations for the backward, which recomputation can
    drop (the GELU's input and output)."""

    def __init__(self, width: int = 64, blocks: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)) for _ in range(blocks)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x).tanh()
        return x.pow(2).mean()


def _step(model: nn.Module, compiled, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor], int]:
    """One forward and backward: the loss, the parameters' gradients, and the bytes saved for the backward
    (counted by a pack hook, each storage once)."""
    model.zero_grad(set_to_none=True)
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if isinstance(tensor, FakeTensor):  # a rule propagating example values while the first call compiles
            return tensor
        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = compiled(x)
    loss.backward()
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()} | {x.untyped_storage().data_ptr()}
    saved = sum(size for pointer, size in storages.items() if pointer not in parameters)
    return loss.detach(), [p.grad.clone() for p in model.parameters()], saved


def _compiled(model: nn.Module, **options):
    return torch.compile(model, backend=fxpass.MemoptBackend(options={"inner_compiler": "aot_eager", **options}))


@pytest.mark.parametrize(
    ("text", "value"),
    [("24GiB", 24 << 30), ("512 MiB", 512 * MiB), ("2e9", 2_000_000_000), ("1.5 GB", 1_500_000_000),
     ("0.5", 0.5), ("1", 1.0), (0.35, 0.35), (4096, 4096)],
)
def test_a_budget_is_bytes_or_a_fraction(text, value):
    parsed = parse_memory_budget(text)
    assert parsed == value and type(parsed) is type(value)


@pytest.mark.parametrize("wrong", [0, -1, 1.5, 0.0, "lots", "3 parsecs", True, None, "-1GiB"])
def test_a_wrong_budget_is_refused_with_its_value(wrong):
    with pytest.raises(ConfigError, match="memory_budget must be bytes"):
        parse_memory_budget(wrong)


def test_the_environment_names_a_budget():
    assert Config.from_options(env={"MEMOPT_MEMORY_BUDGET": "8GiB"}).memory_budget == 8 << 30
    assert Config.from_options({"memory_budget": 0.5}, env={"MEMOPT_MEMORY_BUDGET": "8GiB"}).memory_budget == 0.5
    assert Config.from_options(env={}).memory_budget is None


def test_search_takes_the_largest_setting_within_the_budget():
    curve = lambda setting: int(100 + 900 * setting)  # noqa: E731  (peak rises with the setting)
    setting, peak, met = budget.search(curve, 500)
    assert met and 500 - 900 * budget.RESOLUTION <= peak <= 500
    assert setting == pytest.approx(400 / 900, abs=budget.RESOLUTION)


def test_search_does_not_assume_recomputing_everything_is_lowest():
    # recomputing every activation brings them back together at the backward's start: 0.0 is no lower than 1.0
    curve = {1.0: 1000, 0.75: 900, 0.5: 700, 0.25: 800, 0.0: 1000}
    seen = []

    def peak_at(setting):
        seen.append(setting)
        return curve.get(setting, 750 if setting > 0.5 else 720)

    assert budget.search(peak_at, 600) == (0.5, 700, False)  # out of reach: the lowest peak's setting
    setting, peak, met = budget.search(peak_at, 760)
    assert met and peak <= 760 and 0.5 < setting < 0.75
    assert len(seen) <= 2 * (len(budget.GRID) + 6)


class Unrolled(nn.Module):
    """The same blocks as attributes of their own (no numbered container of one kind): the graph has no
    repeated blocks, and the plan's forms are the partitioner's knapsack and the whole graph recomputed."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.first, self.second, self.third, self.fourth = (
            nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)) for _ in range(4)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in (self.first, self.second, self.third, self.fourth):
            x = x + block(x).tanh()
        return x.pow(2).mean()


def _fits_with_the_same_numbers(model: nn.Module, x: torch.Tensor, fraction: float) -> budget.BudgetPlan:
    """Compile with ``memory_budget=fraction``: the plan meets it in simulation, the compiled step saves less than
    without it, and loss and gradients are eager's."""
    expected_loss, expected_grads, _ = _step(model, model, x)
    _, _, saved_without = _step(model, _compiled(model), x)
    torch._dynamo.reset()
    loss, grads, saved = _step(model, _compiled(model, memory_budget=fraction), x)
    plan = fxpass.reports()[-1].budget
    assert isinstance(plan, budget.BudgetPlan), plan
    assert plan.met and plan.budget == int(fraction * plan.torch_compile)
    assert plan.after <= plan.budget < plan.before
    assert 0 <= plan.added_flops < plan.step_flops
    assert saved < 0.8 * saved_without, (saved, saved_without)  # the compiled step saves less, as simulated
    torch.testing.assert_close(loss, expected_loss, rtol=1e-6, atol=1e-7)
    for grad, expected in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-7)
    return plan


def test_repeated_blocks_are_recomputed_whole_with_the_same_numbers():
    plan = _fits_with_the_same_numbers(MLP(), torch.randn(512, 64), 0.6)
    assert plan.activation_memory_budget is None and plan.blocks == 4
    assert plan.recomputed_blocks == tuple(f"blocks.{i}" for i in range(len(plan.recomputed_blocks)))
    assert 1 <= len(plan.recomputed_blocks) < 4  # the fewest that meet it
    assert plan.added_flops > 0  # their GEMMs run again
    assert "recompute blocks.0" in str(plan) and "GFLOP recomputed" in str(plan)


def test_a_graph_without_blocks_is_fitted_by_the_partitioners_knapsack():
    plan = _fits_with_the_same_numbers(Unrolled(), torch.randn(512, 64), 0.75)
    assert plan.recomputed_blocks == () and plan.blocks == 0
    assert plan.activation_memory_budget is not None and 0 <= plan.activation_memory_budget < 1
    assert "met by the partitioner's knapsack" in plan.reason
    assert plan.added_flops == 0  # pointwise work first: the flop counter's GEMMs are not recomputed


def test_blocks_are_a_module_lists_children_and_tags_keep_their_boundaries():
    gm = torch.fx.symbolic_trace(MLP(blocks=3))
    for node in gm.graph.nodes:  # what Dynamo records; symbolic_trace does not
        if node.op == "call_module" and node.target.startswith("blocks."):
            index = node.target.split(".")[1]
            node.meta["nn_module_stack"] = {"b": (f"L['self'].blocks[{index}]", nn.Sequential)}
    found = budget.blocks(gm.graph)
    assert list(found) == ["blocks.0", "blocks.1", "blocks.2"]
    budget.tag_blocks(gm, ["blocks.0", "blocks.1"])
    tags = {node.target: node.meta.get("recompute") for node in gm.graph.nodes if node.op == "call_module"}
    policy = torch.utils.checkpoint.CheckpointPolicy
    # a block's last node is read by untagged work (the residual add): the boundary is saved, the rest recomputed
    assert tags["blocks.0.0"] == tags["blocks.0.1"] == tags["blocks.1.1"] == policy.MUST_RECOMPUTE
    assert tags["blocks.0.2"] == tags["blocks.1.2"] == policy.MUST_SAVE and tags["blocks.2.0"] is None
    # the tags are in AOTAutograd's cache key through a digest on the module: other tags, another digest
    digest = getattr(gm, budget.PLAN_ATTRIBUTE)
    budget.tag_blocks(gm, ["blocks.0"])
    assert len(digest) == 16 and getattr(gm, budget.PLAN_ATTRIBUTE) != digest


def test_fewest_blocks_steps_from_the_interpolation_to_the_boundary():
    calls = []

    def peak_of(k):
        calls.append(k)
        return 1000 - 90 * k - (60 if k >= 7 else 0)  # not quite linear: the line through 0 and 10 says 7

    assert budget.fewest_blocks(peak_of, 10, 1000, 340) == 7
    assert budget.fewest_blocks(peak_of, 10, 1000, 30) is None  # all ten reach 40
    assert budget.fewest_blocks(peak_of, 10, 1000, 910) == 1
    assert len(calls) <= 10


def test_a_budget_the_exact_rewrites_meet_adds_nothing():
    model, x = MLP(), torch.randn(512, 64)
    _step(model, _compiled(model, memory_budget=1.0), x)
    plan = fxpass.reports()[-1].budget
    assert (plan.met, plan.activation_memory_budget, plan.after) == (True, None, plan.before)
    assert plan.reason == "the exact rewrites meet it"


def test_a_budget_out_of_reach_is_reported_not_raised():
    model, x = MLP(), torch.randn(512, 64)
    expected_loss, _, _ = _step(model, model, x)
    loss, _, _ = _step(model, _compiled(model, memory_budget=4096), x)  # 4 KiB: no partition reaches it
    report = fxpass.reports()[-1]
    plan = report.budget
    assert not plan.met and plan.reason.startswith("not met: the lowest peak recomputation reaches is")
    assert plan.budget == 4096 < plan.after < plan.before
    torch.testing.assert_close(loss, expected_loss, rtol=1e-6, atol=1e-7)
    assert "memory budget 0.0 MiB: recompute blocks.0–3 (4 of 4 blocks)" in report.summary()
    assert json.loads(json.dumps(report.to_json()))["budget"]["met"] is False


def test_the_plan_adds_no_guard_and_no_recompile():
    model = MLP()
    compiled = _compiled(model, memory_budget=0.6)
    for rows in (512, 384, 256):
        x = torch.randn(rows, 64)
        torch._dynamo.mark_dynamic(x, 0)
        _step(model, compiled, x)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    [report] = fxpass.reports()
    assert report.budget.met


@pytest.mark.slow
@pytest.mark.isa_sensitive
def test_through_inductor_the_measured_peak_follows_the_plan():
    """Compiled by Inductor on CPU, the budgeted step's measured peak is the simulated one within 15 % and below
    the unbudgeted step's, and its numbers are the unbudgeted step's. The unbudgeted graph compiles first: the
    tagged one must not hit its AOTAutograd cache entry (tags are node meta, which the key leaves out)."""
    from benchmarks._common import cpu_peak

    model, x = MLP(width=128), torch.randn(1024, 128)
    peaks, results = {}, {}
    for name, options in (("memopt", {}), ("budget", {"memory_budget": 0.6})):
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=fxpass.MemoptBackend(options=options))
        _step(model, compiled, x)  # compile, and the first call's one-off buffers
        results[name], peaks[name] = cpu_peak(lambda compiled=compiled: _step(model, compiled, x))
    plan = fxpass.reports()[-1].budget
    assert plan.met and plan.recomputed_blocks
    assert peaks["budget"] < 0.8 * peaks["memopt"], peaks
    assert plan.after == pytest.approx(peaks["budget"], rel=0.15), (plan, peaks)
    torch.testing.assert_close(results["budget"][0], results["memopt"][0], rtol=1e-5, atol=1e-6)
    for grad, expected in zip(results["budget"][1], results["memopt"][1], strict=True):
        torch.testing.assert_close(grad, expected, rtol=1e-4, atol=1e-6)


def test_explain_prices_the_planned_step_from_a_laptop():
    model, x = MLP(), torch.randn(512, 64)
    ex = fxpass.explain(model, x, options={"memory_budget": 0.6}, assume_device="cuda", execute=False)
    [graph] = ex.graphs
    plan = graph.budget
    assert plan.met and plan.recomputed_blocks
    assert ex.peak_bytes() == {"torch.compile": plan.torch_compile, "memopt": plan.after}
    assert "met by block recomputation" in str(ex)


class Checkpointed(MLP):
    """The MLP with each block under ``torch.utils.checkpoint``, as HF's gradient checkpointing runs layers."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False).tanh()
        return x.pow(2).mean()


def test_blocks_already_checkpointed_are_not_recomputed_twice():
    model, x = Checkpointed(), torch.randn(512, 64)
    expected_loss, expected_grads, _ = _step(model, model, x)
    loss, grads, _ = _step(model, _compiled(model, memory_budget=0.3), x)
    plan = fxpass.reports()[-1].budget
    assert plan.recomputed_blocks == () and plan.blocks == 0
    torch.testing.assert_close(loss, expected_loss, rtol=1e-6, atol=1e-7)
    for grad, expected in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-7)


def test_wta_crs_opted_in_is_a_measure_taken_where_exact_ones_fall_short():
    """At 0.35 recomputing every block leaves the peak over the budget; the sampled weight gradients the user
    allowed bring it within, with fewer blocks recomputed. The forward stays exact."""
    model, x = MLP(), torch.randn(2048, 64)
    expected_loss, _, _ = _step(model, model, x)
    _step(model, _compiled(model, memory_budget=0.35), x)
    exact = fxpass.reports()[-1].budget
    torch._dynamo.reset()
    loss, grads, _ = _step(model, _compiled(model, memory_budget=0.35, wta_crs_budget=0.3), x)
    report = fxpass.reports()[-1]
    plan = report.budget
    assert not exact.met and plan.met and plan.wta_crs_linears == 4
    assert plan.exact_after == exact.after and plan.before == exact.before
    assert len(plan.recomputed_blocks) < len(exact.recomputed_blocks)
    assert "WTA-CRS on 4 linears" in str(plan) and plan.reason == "met with WTA-CRS"
    assert sum(record.rule == "wta_crs" and record.applied for record in report.records) == 4
    torch.testing.assert_close(loss, expected_loss, rtol=1e-6, atol=1e-7)
    assert all(grad.isfinite().all() for grad in grads)


def test_wta_crs_opted_in_is_left_out_where_the_exact_rewrites_meet_the_budget():
    model, x = MLP(), torch.randn(2048, 64)
    _, expected_grads, _ = _step(model, model, x)
    _, grads, _ = _step(model, _compiled(model, memory_budget=1.0, wta_crs_budget=0.3), x)
    report = fxpass.reports()[-1]
    assert report.budget.met and report.budget.wta_crs_linears == 0
    assert not any(record.applied for record in report.records if record.rule == "wta_crs")
    assert any("WTA-CRS opted in but not used: exact measures meet the memory budget" in record.reason
               for record in report.records)
    for grad, expected in zip(grads, expected_grads, strict=True):  # exact gradients
        torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-7)


def test_random_draws_are_kept_not_drawn_again():
    class Noisy(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = nn.functional.dropout(x, 0.1, True) + torch.rand_like(x)
            z = nn.functional.scaled_dot_product_attention(y, y, y, dropout_p=0.1)
            return nn.functional.scaled_dot_product_attention(z, z, z, dropout_p=0.0) + y.bernoulli()

    gm = torch.fx.symbolic_trace(Noisy())
    drawn = {node.name for node in gm.graph.nodes if budget.draws_randomly(node)}
    assert drawn == {"dropout", "rand_like", "scaled_dot_product_attention", "bernoulli"}

    import lowerings.flash_attention.op  # noqa: F401  (registers memopt::flash_attention)

    graph = torch.fx.Graph()
    q, k, v = (graph.placeholder(name) for name in "qkv")
    attention = torch.ops.memopt.flash_attention.default
    dropped = graph.call_function(attention, (q, k, v, None, 0.125, True, 0.1))
    by_name = graph.call_function(attention, (q, k, v, None, 0.125, True), {"dropout_p": 0.1})
    exact = graph.call_function(attention, (q, k, v, None, 0.125, True, 0.0))
    seed = graph.call_function(operator.getitem, (dropped, 2))
    assert [budget.draws_randomly(node) for node in (dropped, by_name, exact, seed)] == [True, True, False, True]


@pytest.mark.slow
def test_dropout_inside_recomputed_blocks_keeps_the_forwards_masks():
    """GPT-2 with dropout 0.1 everywhere, blocks recomputed, Inductor: the same seed gives the unbudgeted step's
    loss and gradients. Drawn again in the backward, Inductor's dropout masks differed (gradients 0.06 off), and
    the knapsack alone recomputed SDPA's dropout differently (0.008 off)."""
    from benchmarks import e2e

    torch.manual_seed(0)
    model = e2e.build_model("gpt2", "sdpa", "config", tiny=True, layers=4)
    ids, labels, _ = e2e.make_batch(model.config.vocab_size, 4, 64, False, torch.device("cpu"))
    results = {}
    for name, options in (("memopt", {}), ("budget", {"memory_budget": 0.3})):
        torch._dynamo.reset()
        step = torch.compile(lambda tokens, targets: model(input_ids=tokens, labels=targets).loss,
                             backend=fxpass.MemoptBackend(options=options))
        model.zero_grad(set_to_none=True)
        torch.manual_seed(123)
        loss = step(ids, labels)
        loss.backward()
        results[name] = (loss.detach(), [p.grad.clone() for p in model.parameters()])
    plan = fxpass.reports()[-1].budget
    assert plan.recomputed_blocks and plan.activation_memory_budget is None
    assert "knapsack left out: the graph draws random numbers" in plan.reason
    torch.testing.assert_close(results["budget"][0], results["memopt"][0], rtol=0, atol=0)
    for grad, expected in zip(results["budget"][1], results["memopt"][1], strict=True):
        torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-7)
