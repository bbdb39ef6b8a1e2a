"""The model-zoo benchmark on tiny models (CPU, aot_eager): both backends run each family with and without a padded
mask, memopt's side reports its rewrites, their losses agree; a family this transformers lacks gets a row."""

from __future__ import annotations

import dataclasses
import json

import pytest
import transformers

from benchmarks import zoo
from tests.leaks import loggers_restored

FAMILIES = ("gpt2", "gemma2", "cohere", "bert")  # plain, logit softcap, logit scale, masked LM
QUICK = ["--tiny", "--device", "cpu", "--steps", "1", "--inner", "aot_eager", "--seq", "32"]


def run(tmp_path, *argv: str) -> list[zoo.Case]:
    with loggers_restored("", "fxpass"):  # main sets logging up as a script does
        return zoo.main([*QUICK, "--out", str(tmp_path), *argv])


def assert_both_backends_agree(case: zoo.Case) -> None:
    assert set(case.runs) == set(zoo.BACKENDS), case
    assert all(run.error is None and run.step_ms > 0 and run.peak_mib > 0 for run in case.runs.values()), case
    # the same weights and batch: memopt's fused loss (and attention) give torch.compile's loss
    assert case.runs["memopt"].loss == pytest.approx(case.runs["torch.compile"].loss, rel=1e-4), case
    assert case.rules["cce"] == "applied 1/1", case  # every family's head and loss, the masked LM's too
    assert case.cce_variant == "with_logits", case  # the step returns its logits: on CPU the op that returns them
    assert case.graphs == 1, case  # the whole step in one graph: no break between head and loss
    # the step simulated under both backends, and what holds memopt's peak named
    assert case.simulated_mib is not None and min(case.simulated_mib.values()) > 0, case
    assert case.held_by.startswith("memopt's peak is in the "), case


@pytest.mark.slow
def test_padded_run_fills_the_table(tmp_path):
    cases = run(tmp_path, "--families", ",".join(FAMILIES), "--masks", "padded")

    assert [(case.family, case.mask) for case in cases] == [(family, "padded") for family in FAMILIES]
    for case in cases:
        assert_both_backends_agree(case)
        # a padded mask reaches SDPA as a [B, 1, T, T] boolean (Gemma 2's eager attention as a bias under a
        # softcap), which the rule rewrites in both layers
        assert case.rules["attention"] == "applied 2/2", case
    report = (tmp_path / "zoo.md").read_text()
    assert "| gpt2 | padded | applied 1/1 (with_logits) | applied 2/2 |" in report and "| bert | padded |" in report
    assert "Families missing the targets" in report
    assert len(json.loads((tmp_path / "zoo.json").read_text())) == len(cases)


@pytest.mark.slow
def test_without_a_mask_sdpa_is_left_as_it_is(tmp_path):
    [case] = run(tmp_path, "--families", "gpt2", "--masks", "none")

    assert_both_backends_agree(case)
    assert case.rules["attention"] == "applied 0/2", case  # causal SDPA without a mask is already fused
    assert "attention declined: F.scaled_dot_product_attention is already a fused kernel" in case.note


def test_a_family_missing_from_transformers_gets_a_row(tmp_path, monkeypatch):
    monkeypatch.setitem(zoo.FAMILIES, "future", zoo.Family("FutureConfig", "FutureForCausalLM", {}))
    [case] = run(tmp_path, "--families", "future", "--masks", "none")

    version = ".".join(transformers.__version__.split(".")[:2])
    assert case.note == f"not in transformers {version} (FutureConfig, FutureForCausalLM)"
    assert case.runs == {}
    report = (tmp_path / "zoo.md").read_text()
    assert f"| future | none | - | - | - | - | - | - | - | - | - | - | not in transformers {version}" in report
    assert "future (no CCE (none), not measured (none))" in report


@pytest.mark.parametrize("name", list(zoo.FAMILIES))
def test_every_family_config_has_its_layers_and_no_dropout(name):
    family = zoo.FAMILIES[name]
    config_class, _ = zoo.family_classes(family)
    config = config_class(**zoo.config_sizes(family, layers=3, tiny=True))
    zoo.without_dropout(config)

    assert config.num_hidden_layers == 3  # T5's encoder; its decoder too:
    assert getattr(config, "num_decoder_layers", 3) == 3
    assert config.vocab_size == zoo.TINY_SIZES["vocab_size"]
    dropouts = {key: value for key, value in config.to_dict().items() if "dropout" in key or "pdrop" in key}
    assert all(value in (0.0, None) for value in dropouts.values()), dropouts


def test_targets_name_the_families_that_miss_them():
    def case(family: str, cce: str, peak: float, step: float, decoder: bool = True) -> zoo.Case:
        runs = {"torch.compile": zoo.Run("torch.compile", step_ms=10.0, peak_mib=100.0),
                "memopt": zoo.Run("memopt", step_ms=step, peak_mib=peak)}
        return zoo.Case(family, "none", decoder, rules={"cce": cce}, runs=runs, held_by=f"{family}'s holders")

    text = zoo.targets_line([
        case("good", "applied 1/1", 60.0, 10.0),
        case("heavy", "applied 1/1", 80.0, 9.0),
        case("slow", "applied 1/1", 50.0, 10.5),
        case("encoder", "applied 1/1", 95.0, 12.0, decoder=False),  # an encoder needs CCE only
        case("uncut", "applied 0/1", 100.0, 10.0, decoder=False),
    ])
    line, _, held = text.partition("\n\n")

    assert line.endswith(": heavy (peak 0.80× (none)); slow (time 1.05× (none)); uncut (no CCE (none))"), line
    # only the family above the peak target gets what holds its peak named
    assert held.splitlines()[1:] == ["- heavy (none): heavy's holders"], held


@pytest.mark.slow
def test_predict_only_prices_each_step_for_a_gpu_without_running_it(tmp_path):
    """``--predict-only``: memopt's decisions and the simulated peaks for a GPU, no step run, no measured
    figure; a decoder above the peak target by the simulation is named with what holds its peak."""
    with loggers_restored("", "fxpass"):
        [case] = zoo.main(["--tiny", "--predict-only", "--families", "gpt2", "--masks", "padded", "--seq", "32",
                           "--batch", "2", "--out", str(tmp_path)])

    assert case.runs == {} and case.rules["cce"] == "applied 1/1" and case.rules["attention"] == "applied 2/2"
    assert set(case.simulated_mib) == {"torch.compile", "memopt"} and case.held_by.startswith("memopt's peak")
    report = (tmp_path / "zoo.md").read_text()
    assert "predicted for a GPU, nothing run" in report
    assert f"| {case.simulated_ratio():.2f} | - | - | - |" in report
    # forced at tiny sizes, the rewrites raise the peak (their kernels' buffers): above the target, named
    assert case.simulated_ratio() > zoo.PEAK_TARGET
    assert f"gpt2 (simulated peak {case.simulated_ratio():.2f}× (padded))" in report
    assert f"- gpt2 (padded): {case.held_by}" in report


def test_a_table_rendered_later_names_where_each_run_measured(tmp_path):
    """``--render`` on another machine: the title is the runs' own first lines, not the rendering machine's."""
    def line(family: str, measured_on: str) -> str:
        runs = {"torch.compile": zoo.Run("torch.compile", step_ms=10.0, peak_mib=100.0),
                "memopt": zoo.Run("memopt", step_ms=9.0, peak_mib=60.0)}
        case = zoo.Case(family, "none", True, rules={"cce": "applied 1/1"}, runs=runs, measured_on=measured_on)
        return json.dumps(dataclasses.asdict(case))

    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    first.write_text(line("gpt2", "Model zoo (bf16), NVIDIA H100 80GB HBM3") + "\n")
    second.write_text(line("llama", "Model zoo (bf16), NVIDIA H200") + "\n" + line("gpt2", "") + "\n")
    with loggers_restored("", "fxpass"):
        cases = zoo.main(["--render", str(first), str(second), "--out", str(tmp_path / "out")])

    assert [case.family for case in cases] == ["gpt2", "llama"]  # a case measured twice keeps its latest line
    title = (tmp_path / "out" / "zoo.md").read_text().split("\n\n")[0]
    assert title.splitlines() == ["Model zoo, rendered from these runs:",
                                  "- (a run that did not record where it ran)", "- Model zoo (bf16), NVIDIA H200"]
    assert "cpu" not in title and "torch" not in title


TABLE = """# Model zoo, a fixture

| family | mask | CCE | attention | embedding | peak torch.compile MiB | peak memopt MiB | peak ratio | \
simulated peak ratio | step torch.compile ms | step memopt ms | time ratio | note |
|---|---|---|---|---|---|---|---|---|---|---|---|---|
| gpt2 | none | applied 1/1 (rowwise) | applied 2/2 | applied 1/2 | 3752 | 1600 | 0.43 | 0.43 | 9.9 | 8.5 | 0.86 | - |
| starcoder2 | none | applied 1/1 (rowwise) | applied 2/2 | applied 1/1 | 4311 | 3035 | 0.70 | 0.75 | 32.5 | 30.8 | 0.95 | - |
| phi3 | padded | applied 1/1 (rowwise) | applied 2/2 | applied 1/1 | 3535 | 2977 | 0.84 | 0.87 | 30.7 | 29.5 | 0.96 | - |
| bert | none | applied 1/1 (rowwise) | applied 2/2 | applied 1/3 | 3240 | 1132 | 0.35 | 0.35 | 13.2 | 7.4 | 0.56 | a note |

Families missing the targets (…): starcoder2 (peak 0.70× (none)); phi3 (peak 0.84× (padded))

What holds memopt's peak where it misses (the simulation):
- starcoder2 (none): memopt's peak is in the backward: 1.8 GiB saved for the backward
- phi3 (padded): memopt's peak is in the backward: 1.5 GiB saved for the backward
"""


def render(tmp_path, *paths) -> list[zoo.Case]:
    with loggers_restored("", "fxpass"):
        return zoo.main(["--render", *map(str, paths), "--out", str(tmp_path / "out")])


def test_a_rendered_table_reads_back_as_it_was_printed(tmp_path):
    """``--render`` of a rendered ``zoo.md`` (as kept in benchmarks/results/): the same rows, ratios and misses."""
    (tmp_path / "zoo-fixture.md").write_text(TABLE)
    cases = render(tmp_path, tmp_path / "zoo-fixture.md")

    gpt2, starcoder2, phi3, bert = cases
    assert gpt2.rules == {"cce": "applied 1/1", "attention": "applied 2/2", "embedding": "applied 1/2"}
    assert gpt2.cce_variant == "rowwise" and gpt2.runs["memopt"].peak_mib == 1600 and gpt2.measured_on.endswith("fixture")
    assert starcoder2.ratio("peak_mib") == pytest.approx(3035 / 4311)  # 0.704, printed 0.70: still a miss
    assert phi3.ratio("step_ms") == pytest.approx(29.5 / 30.7)  # rounds to the 0.96 printed: the figures' own
    assert bert.ratio("step_ms") == pytest.approx(7.4 / 13.2) and not bert.decoder and bert.note == "a note"
    assert starcoder2.held_by == "memopt's peak is in the backward: 1.8 GiB saved for the backward"
    rendered = (tmp_path / "out" / "zoo.md").read_text()
    rows = [line for line in rendered.splitlines() if line.startswith("| ")]
    assert rows == [line for line in TABLE.splitlines() if line.startswith("| ")]
    assert "starcoder2 (peak 0.70× (none)); phi3 (peak 0.84× (padded))" in rendered


def test_a_ratio_printed_from_unrounded_figures_wins(tmp_path):
    """Times print rounded to 0.1 ms: where they give another ratio than the run printed, the printed one."""
    (tmp_path / "zoo-fixture.md").write_text(TABLE.replace("| 30.7 | 29.5 | 0.96 |", "| 31.4 | 29.1 | 0.92 |"))
    phi3 = render(tmp_path, tmp_path / "zoo-fixture.md")[2]

    assert round(29.1 / 31.4, 2) == 0.93 and phi3.ratio("step_ms") == 0.92
    assert phi3.simulated_ratio() == 0.87


def test_the_ratios_are_plotted_with_their_targets(tmp_path):
    """With matplotlib, ``zoo.png`` beside the table: each family's peak and time ratio, the targets as lines."""
    pytest.importorskip("matplotlib")
    (tmp_path / "zoo-fixture.md").write_text(TABLE)
    cases = render(tmp_path, tmp_path / "zoo-fixture.md")

    assert (tmp_path / "out" / "zoo.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert zoo.plot(cases, tmp_path / "again.png") and (tmp_path / "again.png").stat().st_size > 10_000
    predicted = [dataclasses.replace(case, runs={}, ratios={}) for case in cases]  # ``--predict-only``: nothing to draw
    assert not zoo.plot(predicted, tmp_path / "none.png") and not (tmp_path / "none.png").exists()
