"""``benchmarks/tools/profile_step.py``: the GPU's busy and idle time per phase, read from a Chrome trace, and a
CPU run that writes one."""

from __future__ import annotations

import json

import pytest

from benchmarks.e2e import BACKWARD_RANGE, FORWARD_RANGE
from benchmarks.tools import profile_step


def _op(cat: str, name: str, ts: float, dur: float, correlation: int | None = None) -> dict:
    event = {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": {}}
    if correlation is not None:
        event["args"]["correlation"] = correlation
    return event


def _launched(correlation: int, at: float, start: float, dur: float, cat: str = "kernel", name: str = "") -> list[dict]:
    return [_op("cuda_runtime", "cudaLaunchKernel", at, 5, correlation),
            _op(cat, name or f"k{correlation}", start, dur, correlation)]


def test_phase_times_split_busy_and_idle_by_the_launching_range():
    """Two steps. Step 1: the forward (CPU 0–100 µs) launches kernels at 200–300 and 250–350 (overlapping: 150
    busy in a 150 span) and a copy at 400–450 (busy 200 in a 250 span); the backward (CPU 500–900) launches
    kernels at 1000–1100 and 1500–1600 (busy 200 in a 600 span: the GPU waited 400). Step 2 repeats it 2000 µs
    later with a backward kernel twice as long. Kernels launched outside both ranges count nowhere."""
    events = []
    for step, offset in enumerate((0, 2000)):
        base = 10 * step
        events += [_op("user_annotation", FORWARD_RANGE, offset, 100),
                   _op("user_annotation", BACKWARD_RANGE, offset + 500, 400)]
        events += _launched(base + 1, offset + 10, offset + 200, 100)
        events += _launched(base + 2, offset + 20, offset + 250, 100)
        events += _launched(base + 3, offset + 30, offset + 400, 50, cat="gpu_memcpy")
        events += _launched(base + 4, offset + 600, offset + 1000, 100)
        events += _launched(base + 5, offset + 700, offset + 1500, 100 * (1 + step))
    events += _launched(99, 1950, 1960, 30)  # zero_grad between the steps
    found = profile_step.phase_times({"traceEvents": events})
    forward, backward = found[FORWARD_RANGE], found[BACKWARD_RANGE]
    assert (forward.steps, backward.steps) == (2, 2)
    assert forward.cpu_ms == pytest.approx(0.1) and backward.cpu_ms == pytest.approx(0.4)
    assert forward.gpu_span_ms == pytest.approx(0.25) and forward.gpu_busy_ms == pytest.approx(0.2)
    assert backward.gpu_span_ms == pytest.approx((0.6 + 0.7) / 2)
    assert backward.gpu_busy_ms == pytest.approx((0.2 + 0.3) / 2)
    assert backward.gpu_idle_ms == pytest.approx(0.4)
    assert "| step.backward | 2 | 0.40 | 0.65 | 0.25 | 0.40 |" in profile_step.phase_table(found)


def test_phase_times_without_device_work():
    events = [_op("user_annotation", FORWARD_RANGE, 0, 100), _op("cpu_op", "aten::mm", 10, 50)]
    found = profile_step.phase_times({"traceEvents": events})
    assert found[FORWARD_RANGE].steps == 1 and found[FORWARD_RANGE].gpu_busy_ms == 0
    assert found[BACKWARD_RANGE].steps == 0 and found[BACKWARD_RANGE].cpu_ms == 0


@pytest.mark.slow
def test_tiny_cpu_run_writes_the_trace_and_the_phases(tmp_path, caplog):
    """On CPU the trace has the two ranges of every profiled step and no device work."""
    caplog.set_level("INFO", logger="profile_step")
    profile_step.main(["--model", "gpt2", "--tiny", "--device", "cpu", "--seq", "16", "--batch", "2", "--variants",
                       "torch.compile", "--warmup", "1", "--steps", "2", "--top", "3", "--trace", str(tmp_path)])
    (trace,) = tmp_path.glob("*.json")
    assert trace.name == "torch_compile.json"
    found = profile_step.phase_times(json.loads(trace.read_text()))
    assert found[FORWARD_RANGE].steps == 2 and found[BACKWARD_RANGE].steps == 2
    assert found[FORWARD_RANGE].cpu_ms > 0 and found[BACKWARD_RANGE].cpu_ms > 0
    assert "| step.forward | 2 |" in caplog.text


def test_a_zoo_family_is_profiled_only_as_the_zoo_steps_it():
    """The zoo compiles the whole model: a loss-only flow or an unknown family is refused before any model is built."""
    with pytest.raises(SystemExit, match="--flow whole_model or padded"):
        profile_step.main(["--model", "zoo:gemma", "--tiny", "--device", "cpu", "--flow", "loss_only"])
    with pytest.raises(SystemExit, match="no zoo family 'gemma9'"):
        profile_step.main(["--model", "zoo:gemma9", "--tiny", "--device", "cpu", "--flow", "padded"])


@pytest.mark.slow
def test_tiny_zoo_family_profiles_both_backends(caplog):
    """A zoo family's padded step under both backends: each variant's table, and memopt's rewrites (forced at
    the tiny size) in its compiled step."""
    caplog.set_level("INFO", logger="profile_step")
    profile_step.main(["--model", "zoo:llama", "--tiny", "--device", "cpu", "--flow", "padded", "--seq", "16",
                       "--batch", "2", "--variants", 'torch.compile,memopt:{"force": true}', "--warmup", "1",
                       "--steps", "1", "--top", "40"])
    assert "## torch.compile:" in caplog.text and '## memopt:{"force": true}:' in caplog.text
    memopt_table = caplog.text.split('## memopt:{"force": true}:')[1]
    assert "memopt::" in memopt_table


def test_idle_gaps_name_the_cpu_op_that_launched_the_work_after_them():
    """Two steps of a forward whose GPU waits before a kernel launched under ``memopt::cce_rowwise`` (400, then
    300 µs), before one launched under ``aten::mm`` (950, then 1050 µs), and for 20 µs (under the threshold)."""
    events = []
    for step, offset in enumerate((0, 5000)):
        base = 10 * step
        events.append(_op("user_annotation", FORWARD_RANGE, offset, 2000))
        events.append(_op("cpu_op", "memopt::cce_rowwise", offset + 100, 1000))
        events.append(_op("cpu_op", "aten::mm", offset + 1500, 100))
        events += _launched(base + 1, offset + 10, offset + 100, 100, name="first")  # busy until 200
        events += _launched(base + 2, offset + 500, offset + 600 - 100 * step, 50, name="chunk")
        events += _launched(base + 3, offset + 1550, offset + 1600, 50, name="gemm")
        events += _launched(base + 4, offset + 1560, offset + 1670, 10, name="tail")  # 20 µs after the gemm
    gaps = profile_step.idle_gaps({"traceEvents": events})
    assert [(op, after, n) for _, op, after, _, n in gaps] == [("aten::mm", "gemm", 2),
                                                              ("memopt::cce_rowwise", "chunk", 2)]
    assert [ms for *_, ms, _ in gaps] == [pytest.approx(1.0), pytest.approx(0.35)]  # per step, the longest first
    assert "| step.forward | aten::mm | gemm | 1.00 | 2 |" in profile_step.gap_table(gaps)
