"""The ``torch.compile`` backend: entry point and callable routes, options, inner compilers, failing rules,
disabling rules, and dynamic shapes (one compile, no guards from memopt)."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
import warnings

import pytest
import torch
import torch._functorch.config as functorch_config
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.exc import BackendCompilerFailed
from torch._dynamo.utils import counters

import fxpass
import fxpass.backend
import fxpass.rewrite
from fxpass.graph import fake_mode_of
from fxpass.rules import cce
from tests.helpers import assert_close_all, grads

V, D = 40, 8
FAST = {"force": True, "inner_compiler": "aot_eager"}


def _step():
    """A classifier weight and ``linear → .float() → view(-1, V) → cross_entropy`` over it."""
    weight = nn.Parameter(torch.randn(V, D) / D**0.5)

    def step(h, t):
        return F.cross_entropy(F.linear(h, weight).float().view(-1, V), t.view(-1))

    return weight, step


def _batch(batch: int = 2, seq: int = 3):
    return torch.randn(batch, seq, D, requires_grad=True), torch.randint(0, V, (batch, seq))


def _check_against_eager(compiled, step, weight, h, t):
    """The compiled step gives eager's loss and gradients."""
    expected = step(h, t)
    expected_grads = grads(expected, [h, weight])
    actual = compiled(h, t)
    torch.testing.assert_close(actual, expected)
    assert_close_all(grads(actual, [h, weight]), expected_grads)
    return actual


FRESH_PROCESS = """
import json, sys
import torch
import torch.nn.functional as F

imported_with_torch = "fxpass" in sys.modules
w = torch.nn.Parameter(torch.randn(40, 8))

def step(h, t):
    return F.cross_entropy(F.linear(h, w).float().view(-1, 40), t.view(-1))

h, t = torch.randn(2, 3, 8), torch.randint(0, 40, (2, 3))
compiled = torch.compile(step, backend="memopt", options={"force": True, "inner_compiler": "aot_eager"})
loss = compiled(h, t)

import fxpass
from torch._dynamo.backends.registry import lookup_backend

backend = lookup_backend("memopt")
try:
    torch._dynamo.register_backend(lambda gm, example_inputs: gm.forward, name="memopt")
    register_again = "registered twice"
except Exception as error:
    register_again = f"{type(error).__name__}: {error}"

print(json.dumps({
    "imported_with_torch": imported_with_torch,
    "applied": torch._dynamo.utils.counters["memopt"]["cce_applied"],
    "records": [[r.rule, r.applied] for g in fxpass.reports() for r in g.records],
    "resolves_to": backend.__module__ + "." + backend.__name__,
    "same_loss": bool(torch.allclose(loss, step(h, t))),
    "register_again": register_again,
}))
"""


@pytest.fixture(scope="module")
def fresh_process(tmp_path_factory) -> dict:
    """Run FRESH_PROCESS in a new interpreter (one start for both registry tests: starting one is slow)."""
    result = subprocess.run(
        [sys.executable, "-c", FRESH_PROCESS],
        capture_output=True,
        text=True,
        cwd=tmp_path_factory.mktemp("fresh"),
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


class TestRegistration:
    """``backend="memopt"`` resolves through the entry point; the name is not registered twice."""

    def test_entry_point_in_fresh_process(self, fresh_process):
        """Without importing fxpass, ``backend="memopt"`` loads it and the CCE rewrite happens."""
        assert fresh_process["imported_with_torch"] is False
        assert fresh_process["resolves_to"] == "fxpass.backend.memopt_backend"
        assert fresh_process["applied"] == 1
        assert fresh_process["records"] == [["cce", True]]
        assert fresh_process["same_loss"] is True

    def test_registering_the_name_again_fails(self, fresh_process):
        """The entry point owns the name: registering "memopt" in code after it was loaded is a duplicate.

        Done in the fresh process so that this process's registry is not polluted.
        """
        assert "duplicate name: memopt" in fresh_process["register_again"]

    def test_lookup_in_process(self):
        from torch._dynamo.backends.registry import lookup_backend

        assert lookup_backend("memopt") is fxpass.memopt_backend


class TestRoutes:
    """The string, callable and configured-object routes all rewrite and match eager."""

    def test_string_backend(self):
        weight, step = _step()
        compiled = torch.compile(step, backend="memopt", options=FAST)
        _check_against_eager(compiled, step, weight, *_batch())
        assert counters["memopt"]["cce_applied"] == 1

    def test_callable_backend_with_options(self):
        weight, step = _step()
        compiled = torch.compile(step, backend=fxpass.memopt_backend, options=FAST)
        _check_against_eager(compiled, step, weight, *_batch())
        assert counters["memopt"]["cce_applied"] == 1
        assert [r.applied for r in fxpass.reports()[-1].records] == [True]

    def test_backend_object(self):
        weight, step = _step()
        backend = fxpass.MemoptBackend(options=FAST)
        assert backend.config.force and backend.config.inner_compiler == "aot_eager"
        _check_against_eager(torch.compile(step, backend=backend), step, weight, *_batch())
        assert counters["memopt"]["cce_applied"] == 1

    def test_without_force_toy_sizes_are_declined(self):
        """The memory model declines a toy head; the backend still compiles it unchanged."""
        weight, step = _step()
        compiled = torch.compile(step, backend="memopt", options={"inner_compiler": "aot_eager"})
        _check_against_eager(compiled, step, weight, *_batch())
        assert counters["memopt"]["cce_declined"] == 1
        assert "cce_applied" not in counters["memopt"]
        assert fxpass.reports()[-1].records[0].reason.startswith("saving ")


class TestPrecompile:
    """The rewritten graph goes to ``lowerings.precompile`` (the opaque ops' kernels compile beside Inductor)
    before the inner compile, unless ``precompile=False`` or nothing was rewritten."""

    @pytest.mark.parametrize("enabled", [True, False])
    def test_start_gets_the_rewritten_graph(self, monkeypatch, enabled):
        started: list[set] = []
        monkeypatch.setattr(
            fxpass.backend.precompile, "start", lambda gm: started.append({node.target for node in gm.graph.nodes})
        )
        weight, step = _step()
        backend = fxpass.MemoptBackend(options={**FAST, "precompile": enabled})
        _check_against_eager(torch.compile(step, backend=backend), step, weight, *_batch())
        if enabled:
            assert len(started) == 1 and torch.ops.memopt.cce.default in started[0]
        else:
            assert started == []

    def test_nothing_rewritten_nothing_to_start(self, monkeypatch):
        started = []
        monkeypatch.setattr(fxpass.backend.precompile, "start", started.append)
        weight, step = _step()
        compiled = torch.compile(step, backend=fxpass.MemoptBackend(options={"inner_compiler": "aot_eager"}))
        _check_against_eager(compiled, step, weight, *_batch())
        assert started == []


class TestOptions:
    """Inductor config keys and modes pass through; unknown keys are errors that name the key."""

    @pytest.fixture
    def inductor_calls(self, monkeypatch):
        """Record the config patches Inductor's compile_fx receives, then compile for real."""
        import torch._inductor.compile_fx as compile_fx_module

        calls = []
        real = compile_fx_module.compile_fx

        def spy(model, inputs, *args, **kwargs):
            calls.append(dict(kwargs.get("config_patches") or {}))
            return real(model, inputs, *args, **kwargs)

        monkeypatch.setattr(compile_fx_module, "compile_fx", spy)
        return calls

    def test_inductor_keys_pass_through(self, inductor_calls):
        weight, step = _step()
        compiled = torch.compile(step, backend="memopt", options={"force": True, "max_autotune": False})
        _check_against_eager(compiled, step, weight, *_batch())
        assert counters["memopt"]["cce_applied"] == 1
        assert inductor_calls  # the first call carries the patches (compile_fx re-enters itself without them)
        assert inductor_calls[0]["max_autotune"] is False
        assert "force" not in inductor_calls[0]

    def test_mode_accepted_on_cpu(self, inductor_calls, monkeypatch):
        """torch.compile refuses mode with options, so force comes from the environment here."""
        monkeypatch.setenv("MEMOPT_FORCE", "1")
        weight, step = _step()
        compiled = torch.compile(step, backend="memopt", mode="max-autotune-no-cudagraphs")
        _check_against_eager(compiled, step, weight, *_batch())
        assert counters["memopt"]["cce_applied"] == 1
        assert inductor_calls
        mode_options = torch._inductor.list_mode_options("max-autotune-no-cudagraphs")
        assert mode_options["max_autotune"] is True
        assert mode_options.items() <= inductor_calls[0].items()

    def test_unknown_key_in_torch_compile(self):
        _, step = _step()
        compiled = torch.compile(step, backend="memopt", options={"force": True, "forse": 1})
        with pytest.raises(BackendCompilerFailed, match=r"unknown option 'forse'; did you mean 'force'\?"):
            compiled(*_batch())

    def test_unknown_key_in_backend_object(self):
        with pytest.raises(fxpass.ConfigError, match="'not_a_key'"):
            fxpass.MemoptBackend(options={"not_a_key": 1})

    @pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
    def test_activation_memory_budget_keeps_the_rewrite(self, device):
        """memopt's graph goes through AOTAutograd's budgeted partitioner (recomputation) unchanged: torch
        2.11's partitioner failed on an output-less node the CCE body once traced, and memopt fell back."""
        weight, step = _step()
        weight.data = weight.data.to(device)
        h, t = (x.detach().to(device).requires_grad_(x.requires_grad) for x in _batch(4, 16))
        compiled = torch.compile(step, backend="memopt", options={"force": True, "strict": True})
        with functorch_config.patch(activation_memory_budget=0.5):
            _check_against_eager(compiled, step, weight, h, t)
        assert counters["memopt"]["cce_applied"] == 1

    def test_split_between_memopt_and_inductor(self):
        backend = fxpass.MemoptBackend(options={"force": True, "epilogue_fusion": False})
        assert backend.config.force is True
        assert backend.inductor_options == {"epilogue_fusion": False}


class TestInnerCompilers:
    """Each inner compiler gives eager's loss and gradients for linear → cross_entropy after the rewrite."""

    @pytest.mark.parametrize("inner", ["eager", "aot_eager", "inductor"])
    def test_same_as_eager(self, inner):
        weight, step = _step()
        compiled = torch.compile(step, backend="memopt", options={"force": True, "inner_compiler": inner})
        h, t = _batch(3, 5)
        loss = _check_against_eager(compiled, step, weight, h, t)
        assert counters["memopt"]["cce_applied"] == 1
        if inner == "eager":  # the rewritten Dynamo graph runs as it is
            assert "memopt_cce" in loss.grad_fn.name()


class TestFailingRule:
    """A rule that raises leaves the graph as it was, warns once per reason, records why; strict re-raises."""

    @pytest.fixture(autouse=True)
    def _fresh_warnings(self, monkeypatch):
        monkeypatch.setattr(fxpass.rewrite, "_WARNED", set())

    @staticmethod
    def _break_rule(monkeypatch, where: str, message: str = "boom") -> None:
        def failing_match(facts):
            raise RuntimeError(message)

        def failing_decide(candidate, config):
            raise RuntimeError(message)

        def failing_apply(gm, candidate, config):
            cce.apply(gm, candidate, config)  # edit the graph halfway, then fail
            raise RuntimeError(message)

        failing = {"match": failing_match, "decide": failing_decide, "apply": failing_apply}[where]
        rule = dataclasses.replace(cce.RULE, **{where: failing})
        monkeypatch.setattr(fxpass.rewrite, "RULES", (rule,))

    @staticmethod
    def _backend(**options):
        return fxpass.MemoptBackend(options={**FAST, "strict": False, **options}, keep_code=True)

    @pytest.mark.parametrize("where", ["match", "decide", "apply"])
    def test_graph_unchanged_and_result_correct(self, monkeypatch, where):
        self._break_rule(monkeypatch, where)
        weight, step = _step()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _check_against_eager(torch.compile(step, backend=self._backend()), step, weight, *_batch())

        failures = [w for w in caught if issubclass(w.category, fxpass.RewriteFailedWarning)]
        assert [str(w.message) for w in failures] == ["memopt: cce: rule failed and was skipped: RuntimeError: boom"]

        report = fxpass.reports()[-1]
        assert report.before == report.after
        assert "torch.ops.memopt.cce" not in report.after
        assert "cross_entropy" in report.after
        assert not report.applied
        failed = report.records[-1]
        assert failed.rule == "cce"
        assert failed.applied is False
        assert failed.reason.startswith("rule failed")
        assert failed.reason == "rule failed and was skipped: RuntimeError: boom"
        assert "cce_applied" not in counters["memopt"]
        if where == "apply":  # the decision taken before the failure is reported as undone
            assert [r.reason for r in report.records[:-1]] == ["undone: the rule failed later on this graph"]

    def test_warns_once_per_distinct_reason(self, monkeypatch):
        _, step = _step()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            self._break_rule(monkeypatch, "apply", "first reason")
            for _ in range(2):
                torch._dynamo.reset()
                torch.compile(step, backend=self._backend())(*_batch())
            self._break_rule(monkeypatch, "apply", "second reason")
            torch._dynamo.reset()
            torch.compile(step, backend=self._backend())(*_batch())
        messages = [str(w.message) for w in caught if issubclass(w.category, fxpass.RewriteFailedWarning)]
        assert messages == [
            "memopt: cce: rule failed and was skipped: RuntimeError: first reason",
            "memopt: cce: rule failed and was skipped: RuntimeError: second reason",
        ]
        assert sum(r.reason.startswith("rule failed") for g in fxpass.reports()[-3:] for r in g.records) == 3

    def test_strict_reraises(self, monkeypatch):
        self._break_rule(monkeypatch, "apply", "strict boom")
        _, step = _step()
        compiled = torch.compile(step, backend=self._backend(strict=True))
        with pytest.raises(BackendCompilerFailed, match="strict boom") as info:
            compiled(*_batch())
        assert isinstance(info.value.inner_exception, RuntimeError)

    def test_strict_from_environment(self, monkeypatch):
        monkeypatch.setenv("MEMOPT_STRICT", "1")
        self._break_rule(monkeypatch, "match", "env boom")
        _, step = _step()
        compiled = torch.compile(step, backend="memopt", options=FAST)
        with pytest.raises(BackendCompilerFailed, match="env boom"):
            compiled(*_batch())


class TestFailingCompile:
    """The rewritten graph fails to compile (a kernel that does not build, say): memopt compiles the graph as
    Dynamo captured it, warns once, and reports the rewrites as undone; strict re-raises."""

    @pytest.fixture(autouse=True)
    def _fresh_warnings(self, monkeypatch):
        monkeypatch.setattr(fxpass.rewrite, "_WARNED", set())

    @staticmethod
    def _refusing_backend(**options):
        class Refusing(fxpass.MemoptBackend):
            def _compile(self, gm, example_inputs):
                if any(str(node.target).startswith("memopt.") for node in gm.graph.nodes):
                    raise RuntimeError("kernel failed to build")
                return super()._compile(gm, example_inputs)

        return Refusing(options={**FAST, "strict": False, **options})

    def test_falls_back_to_the_captured_graph(self):
        weight, step = _step()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _check_against_eager(torch.compile(step, backend=self._refusing_backend()), step, weight, *_batch())
        messages = [str(w.message) for w in caught if issubclass(w.category, fxpass.RewriteFailedWarning)]
        assert messages == [
            "memopt: backend: compiling the rewritten graph failed (RuntimeError: kernel failed to build); "
            "compiled it without the rewrites"
        ]
        report = fxpass.reports()[-1]
        assert not report.applied
        assert [r.reason.startswith("undone: compiling the rewritten graph failed") for r in report.records] == [True]

    def test_strict_reraises(self):
        _, step = _step()
        with pytest.raises(BackendCompilerFailed, match="kernel failed to build"):
            torch.compile(step, backend=self._refusing_backend(strict=True))(*_batch())


class TestDynamoControlFlow:
    """Dynamo's restarts and frame skips raised inside the backend reach Dynamo untouched: no fallback, no
    warning, and only the graph that is finally compiled is reported."""

    @pytest.fixture(autouse=True)
    def _fresh_warnings(self, monkeypatch):
        monkeypatch.setattr(fxpass.rewrite, "_WARNED", set())

    @pytest.mark.parametrize("strict", [False, True])
    def test_tensorify_restart_passes_through(self, strict):
        """A float argument that ``torch.full`` reads: AOTAutograd's scalar-tensorify pass specializes it and
        raises ``TensorifyScalarRestartAnalysis``; Dynamo traces again and the rewrite applies to that graph."""
        weight, step = _step()

        def scaled(h, t, scale: float):
            return step(h, t) * torch.full((), scale)

        raised = []

        class Recording(fxpass.MemoptBackend):
            def _compile(self, gm, example_inputs):
                try:
                    return super()._compile(gm, example_inputs)
                except Exception as error:
                    raised.append(type(error).__name__)
                    raise

        compiled = torch.compile(scaled, backend=Recording(options={**FAST, "strict": strict}), dynamic=True)
        h, t = _batch()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            actual = compiled(h, t, 2.5)
        assert not [w for w in caught if issubclass(w.category, fxpass.RewriteFailedWarning)]
        expected = scaled(h, t, 2.5)
        torch.testing.assert_close(actual, expected)
        assert_close_all(grads(actual, [h, weight]), grads(expected, [h, weight]))
        assert raised == ["TensorifyScalarRestartAnalysis"]  # the graph does restart Dynamo
        assert [[r.applied for r in report.records] for report in fxpass.reports()] == [[True]]
        assert counters["memopt"]["cce_applied"] == 1

    def test_skip_frame_passes_through(self):
        """A ``SkipFrame`` from the inner compiler makes Dynamo run the frame eagerly, with no memopt warning."""
        from torch._dynamo.exc import SkipFrame

        class Skipping(fxpass.MemoptBackend):
            def _compile(self, gm, example_inputs):
                raise SkipFrame("inner compiler skips this frame")

        weight, step = _step()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            compiled = torch.compile(step, backend=Skipping(options={**FAST, "strict": False}))
            _check_against_eager(compiled, step, weight, *_batch())
        assert not [w for w in caught if issubclass(w.category, fxpass.RewriteFailedWarning)]
        assert fxpass.reports() == []


class TestDisable:
    """A disabled rule does not run: no rewrite, no records, eager's result."""

    @pytest.mark.parametrize("route", ["env", "option", "option list"])
    def test_disable_cce(self, monkeypatch, route):
        options = {"force": True, "inner_compiler": "eager"}
        if route == "env":
            monkeypatch.setenv("MEMOPT_DISABLE", "cce")
        else:
            options["disable"] = "cce" if route == "option" else ["cce"]
        weight, step = _step()
        loss = _check_against_eager(torch.compile(step, backend="memopt", options=options), step, weight, *_batch())
        assert "memopt" not in loss.grad_fn.name()
        assert fxpass.reports()[-1].records == []
        assert not any(key.startswith("cce") for key in counters["memopt"])


class _Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.head = nn.Linear(D, V, bias=False)

    def forward(self, h, t):
        return F.cross_entropy(self.head(h).float().view(-1, V), t.view(-1))


class TestDynamicShapes:
    """With dynamic=True, changing the batch size reuses one graph, rewritten, and memopt adds no guard."""

    BATCHES = (2, 3, 5, 7)

    def test_one_compile_rewritten_every_call(self):
        model = _Head()
        compiled = torch.compile(model, backend="memopt", options={**FAST, "strict": True}, dynamic=True)
        for batch in self.BATCHES:
            h, t = _batch(batch, 4)
            with torch.profiler.profile() as prof:
                loss = compiled(h, t)
                loss.backward()
            ops = {event.name for event in prof.events()}
            assert any(name.startswith("memopt::cce") for name in ops), sorted(ops)
            torch.testing.assert_close(loss, model(h, t))
        assert counters["stats"]["unique_graphs"] == 1
        assert counters["memopt"]["cce_applied"] == 1
        reports = fxpass.reports()
        assert len({report.graph_id for report in reports}) == 1
        [record] = reports[-1].records
        assert record.applied
        assert record.proof in ("static", "hint")
        assert record.params["vocab"] == str(V)  # a module parameter keeps the vocabulary static
        assert re.fullmatch(r"s\d+\*s\d+", record.params["tokens"])  # batch × sequence, symbolic

    def test_no_guards_from_the_rewrite(self, monkeypatch):
        """Guards in the shape env are the same before and after the rewrite, and the same as plain eager's."""
        seen = []
        real_rewrite = fxpass.backend.rewrite_graph

        def counting_rewrite(gm, config, keep_code=False, example_inputs=()):
            env = fake_mode_of(gm.graph.nodes).shape_env
            before = [str(g.expr) for g in env.guards]
            report = real_rewrite(gm, config, keep_code, example_inputs)
            seen.append((before, [str(g.expr) for g in env.guards], report))
            return report

        monkeypatch.setattr(fxpass.backend, "rewrite_graph", counting_rewrite)

        def guards_after_run(backend) -> list[str]:
            envs = []

            def recording(gm, example_inputs):
                envs.append(fake_mode_of(gm.graph.nodes).shape_env)
                return backend(gm, example_inputs)

            torch._dynamo.reset()
            compiled = torch.compile(_Head(), backend=recording, dynamic=True)
            for batch in self.BATCHES:
                compiled(*_batch(batch, 4))
            assert len(envs) == 1  # no recompilation
            return sorted(str(g.expr) for g in envs[0].guards)

        memopt = fxpass.MemoptBackend(options={"force": True, "inner_compiler": "eager", "strict": True})
        with_memopt = guards_after_run(memopt)
        plain = guards_after_run(lambda gm, example_inputs: gm.forward)

        [(before, after, report)] = seen
        assert report.applied
        assert before == after
        assert with_memopt == plain


def test_inductor_caches_are_keyed_on_memopt_sources(monkeypatch):
    """The no-op post-grad pass memopt installs carries a hash of its sources into Inductor's cache key."""
    from pathlib import Path

    from torch._inductor.custom_graph_pass import get_hash_for_files

    from fxpass.cache import SOURCE_KEYED_PASS

    root = Path(fxpass.__file__).resolve().parents[1]
    files = sorted(str(p) for package in ("fxpass", "lowerings") for p in (root / package).rglob("*.py"))
    assert SOURCE_KEYED_PASS.uuid() == get_hash_for_files(tuple(files))
    seen = {}
    real = torch._inductor.compile_fx.compile_fx

    def spy(gm, example_inputs, **kwargs):
        seen.update(kwargs.get("config_patches") or {})
        return real(gm, example_inputs, **kwargs)

    monkeypatch.setattr(torch._inductor.compile_fx, "compile_fx", spy)
    torch.compile(lambda x: x.sin(), backend="memopt")(torch.randn(3))
    assert seen.get("post_grad_custom_pre_pass") is SOURCE_KEYED_PASS


@pytest.mark.parametrize("sampling", [pytest.param("traced", marks=pytest.mark.slow), "opaque"])
def test_a_graph_calling_memopt_functions_is_served_from_the_autograd_cache(sampling):
    """With traced sampling the WTA-CRS rule puts ``lowerings.wta_crs.op.sample`` in the graph; the AOTAutograd
    cache would bypass such a graph and trace it again on every start. Marked cacheable (keyed on memopt's
    sources), the second compile of the same graph is a cache hit and trains the same. The opaque sampling op
    needs no mark."""
    from torch._inductor.utils import fresh_cache

    from fxpass.cache import cacheable_functions, source_hash

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

        def forward(self, x):
            return self.down(F.gelu(self.up(x))).square().mean()

    options = {"wta_crs_budget": 0.5, "wta_crs_min_tokens": 1, "force": True, "strict": True,
               "wta_crs_sampling": sampling}
    seen = []
    backend = fxpass.MemoptBackend(options=options, sink=lambda report: seen.append(report.graph_module))
    x = torch.randn(4, 6, 8)
    losses = []
    with fresh_cache():
        for _ in range(2):
            torch._dynamo.reset()
            counters.clear()
            torch.manual_seed(0)
            block = Block()
            torch.manual_seed(1)
            loss = torch.compile(block, backend=backend)(x)
            loss.backward()
            losses.append((loss.detach(), block.up.weight.grad))
            assert fxpass.reports()[-1].applied
        assert counters["aot_autograd"]["autograd_cache_hit"] == 1, dict(counters["aot_autograd"])
    marked = {"lowerings.wta_crs.op.sample": source_hash().hex()} if sampling == "traced" else {}
    assert cacheable_functions(seen[-1]) == marked
    (first_loss, first_grad), (second_loss, second_grad) = losses
    torch.testing.assert_close(second_loss, first_loss, rtol=0, atol=0)
    torch.testing.assert_close(second_grad, first_grad, rtol=0, atol=0)
