"""Backend configuration: memopt's own keys, read from ``torch.compile(options=...)`` and the environment.

Two routes exist because HF Trainer and other string-only users can name a backend but cannot pass options;
environment variables are their route. Explicit options win over the environment.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

RULE_NAMES: tuple[str, ...] = ("cce", "attention", "wta_crs", "embedding")
INNER_COMPILERS: tuple[str, ...] = ("inductor", "aot_eager", "eager")
DEVICE_TYPES: tuple[str, ...] = ("cuda", "cpu")
CCE_VARIANTS: tuple[str, ...] = ("auto", "chunked", "rowwise")
WTA_CRS_SAMPLINGS: tuple[str, ...] = ("traced", "opaque")
ATTENTION_KERNELS: tuple[str, ...] = ("auto", "memopt")
PRICINGS: tuple[str, ...] = ("compile", "eager")
# Recomputation's price of memory, the default of ``wta_crs_max_us_per_mib``: memopt with AOTAutograd's
# activation_memory_budget freed 1.58 GiB of GPT-2 small's step for 9.8 ms on an H100 (`benchmarks/wta_crs.py
# --match-peak`; BENCHMARKS.md, "WTA-CRS", has the current comparison).
RECOMPUTE_US_PER_MIB = 6.0

ENV_DEBUG_DIR = "MEMOPT_DEBUG_DIR"
ENV_DISABLE = "MEMOPT_DISABLE"
ENV_STRICT = "MEMOPT_STRICT"
ENV_INNER = "MEMOPT_INNER_COMPILER"
ENV_MIN_SAVED = "MEMOPT_MIN_SAVED_BYTES"
ENV_FORCE = "MEMOPT_FORCE"
ENV_WTA_BUDGET = "MEMOPT_WTA_CRS_BUDGET"
ENV_WTA_MAX_US = "MEMOPT_WTA_CRS_MAX_US_PER_MIB"
ENV_CCE_FILTER = "MEMOPT_CCE_FILTER_EPS"
ENV_ASSUME_DEVICE = "MEMOPT_ASSUME_DEVICE"
ENV_CCE_VARIANT = "MEMOPT_CCE_VARIANT"
ENV_WTA_CRS_SAMPLING = "MEMOPT_WTA_CRS_SAMPLING"
ENV_ATTENTION_KERNEL = "MEMOPT_ATTENTION_KERNEL"
ENV_PRECOMPILE = "MEMOPT_PRECOMPILE"
ENV_PRICING = "MEMOPT_PRICING"
ENV_MEMORY_BUDGET = "MEMOPT_MEMORY_BUDGET"
_BYTE_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
               "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


class ConfigError(ValueError):
    """A memopt option or environment variable has a value memopt cannot use."""


@dataclasses.dataclass(frozen=True)
class Config:
    """What the backend does for one ``torch.compile`` call.

    Attributes:
        inner_compiler: compiler run on the rewritten graph: "inductor" (default), or "aot_eager" / "eager"
            to debug a rewrite without Inductor in the way.
        debug_dir: if set, each compiled graph writes before.py, after.py, report.json and report.md under it.
        disable: rules that must not run (names from ``RULE_NAMES``).
        strict: re-raise a rule's exception instead of warning and leaving the graph as it was (tests).
        min_saved_bytes: a rewrite applies only if it frees at least this many bytes.
        force: apply every rewrite that is possible even where the memory model says it does not pay
            (to debug a rewrite at toy sizes; the report says the decision was forced).
        wta_crs_budget: fraction of activation rows WTA-CRS linears keep for the weight gradient (0 < b ≤ 1);
            None leaves it off. It changes weight gradients (unbiased, with variance), so it is opt-in.
        wta_crs_min_tokens: WTA-CRS only rewrites linears over at least this many token rows.
        wta_crs_max_us_per_mib: on CUDA a WTA-CRS group applies only where its modelled extra step time, per MiB
            it frees against torch.compile, is at most this many µs (``fxpass/rules/wta_crs.py``, ``step_cost``):
            a group costs a roughly fixed draw and host work a step, less the weight-gradient GEMM work its
            sample saves, and recomputation frees activations at about 6 µs a MiB (GPT-2 small on an H100,
            BENCHMARKS.md, "WTA-CRS"), so dearer groups are left to torch.compile. None applies every group that
            frees memory.
        wta_crs_winners: keep the deterministic "winner" rows (WTA-CRS); False samples every row (plain
            column-row sampling), for comparisons.
        wta_crs_sampling: how a WTA-CRS group's sample gets into the graph: "traced" (the default: PyTorch that
            Inductor fuses with its neighbours, so no Python runs at training time, but every group's sampling
            compiles kernels of its own) or "opaque" (``memopt::wta_crs_sample``, one op per group that runs its
            PyTorch and kernels as they are: Inductor compiles nothing for it). On the H200 both step GPT-2
            small's loss-only SDPA step at 1.14-1.34× torch.compile's time, every group sampled
            (`benchmarks/e2e.py`, BENCHMARKS.md, "End to end").
        cce_filter_eps: CCE's gradient filter on CUDA: logit-gradient tiles whose every |softmax − target| is
            below it are skipped (faster, approximate gradients). None or 0 keeps gradients exact; "auto" is
            the input dtype's machine epsilon / 32, as Apple's CCE (2⁻¹² for bf16).
        assume_device: the device whose op implementations the memory models charge ("cuda" or "cpu"); None
            charges the graph's own device. ``"cuda"`` on a CPU-only machine shows what a GPU run would decide;
            the graph still runs on its own device.
        cce_variant: which CCE op serves a scalar loss: "chunked" (``memopt.cce``, 8·N·D·V FLOPs, keeps only an
            [N] log-sum-exp), "rowwise" (``memopt.cce_rowwise``, 6·N·D·V, keeps the loss's gradients from
            forward to backward) or "auto" (the row-wise op where it keeps 3/4 of the chunked one's saving,
            each priced against torch.compile under ``pricing="compile"``, else the chunked one; logits the graph
            also returns get ``cce_with_logits`` on CUDA: see ``fxpass/rules/cce.py``). "auto" is the default:
            the row-wise op takes 1.05-1.06× torch.compile's time for the loss and gradients, the chunked one
            1.56-1.59× (`benchmarks/cce.py` on an H100, BENCHMARKS.md, "The CCE op").
        attention_kernel: which kernel computes a rewritten attention on CUDA: "auto" (default) takes cuDNN's
            fused attention (``aten._scaled_dot_product_cudnn_attention``, which accepts a causal flag and a key
            bias together) wherever it serves the case and memopt's Triton kernel elsewhere; "memopt" always
            takes memopt's kernel. On the H200 cuDNN was the faster of the two in every case it serves
            (BENCHMARKS.md, "Which kernel serves which attention").
        pricing: what a rewrite's saving is measured against: "compile" (default) prices the replaced nodes and
            the inserted ones as torch.compile runs them (AOTAutograd's partitioner and Inductor's joint-graph
            passes, on fake tensors: ``fxpass/pricing.py``); "eager" prices the graph as written, as eager
            PyTorch keeps it, which overstates the saving (CCE at Llama-3's head: 8.3 GiB against the 1.0 GiB
            torch.compile's peak drops by) but costs no tracing at compile time. Checkpointed regions are
            priced as written either way.
        memory_budget: the most the compiled graph may hold beyond its inputs (as ``fxpass.explain`` counts a
            step's peak): bytes (``"24GiB"`` or an int) or a fraction in (0, 1] of torch.compile's simulated peak
            for the graph. Where the exact rewrites leave memopt's simulated peak above it, the graph compiles under
            the ``activation_memory_budget`` (AOTAutograd's recomputation knapsack) whose simulated peak meets it,
            or at the lowest peak recomputation reaches (``fxpass/budget.py``). None (default): no budget.
        precompile: compile the Triton kernels that memopt's opaque ops launch at run time (the CCE backward,
            the row-wise CCE, WTA-CRS's draw and store) in a background thread while Inductor compiles the graph,
            instead of at their first launch inside the first step (``lowerings/precompile.py``). CUDA only;
            False compiles them at their launch, as before.
    """

    inner_compiler: str = "inductor"
    debug_dir: str | None = None
    disable: frozenset[str] = frozenset()
    strict: bool = False
    min_saved_bytes: int = 1 << 20
    force: bool = False
    wta_crs_budget: float | None = None
    wta_crs_min_tokens: int = 256
    wta_crs_max_us_per_mib: float | None = RECOMPUTE_US_PER_MIB
    wta_crs_winners: bool = True
    wta_crs_sampling: str = "traced"
    cce_filter_eps: float | str | None = None
    assume_device: str | None = None
    cce_variant: str = "auto"
    attention_kernel: str = "auto"
    precompile: bool = True
    pricing: str = "compile"
    memory_budget: int | float | str | None = None

    def __post_init__(self) -> None:
        if self.memory_budget is not None:  # normalized: bytes (int) or a fraction (float)
            object.__setattr__(self, "memory_budget", parse_memory_budget(self.memory_budget))
        _check_type("strict", self.strict, bool)
        _check_type("precompile", self.precompile, bool)
        _check_type("force", self.force, bool)
        _check_type("min_saved_bytes", self.min_saved_bytes, int)
        _check_type("debug_dir", self.debug_dir, (str, type(None)))
        _check_type("wta_crs_min_tokens", self.wta_crs_min_tokens, int)
        _check_type("wta_crs_winners", self.wta_crs_winners, bool)
        if self.wta_crs_budget is not None:
            _check_type("wta_crs_budget", self.wta_crs_budget, (int, float))
            if isinstance(self.wta_crs_budget, bool) or not 0 < self.wta_crs_budget <= 1:
                raise ConfigError(f"wta_crs_budget must be in (0, 1], got {self.wta_crs_budget!r}")
        if self.wta_crs_max_us_per_mib is not None:
            _check_type("wta_crs_max_us_per_mib", self.wta_crs_max_us_per_mib, (int, float))
            if isinstance(self.wta_crs_max_us_per_mib, bool) or not self.wta_crs_max_us_per_mib >= 0:
                raise ConfigError(f"wta_crs_max_us_per_mib must be >= 0 or None, got {self.wta_crs_max_us_per_mib!r}")
        if self.cce_filter_eps is not None and self.cce_filter_eps != "auto":
            _check_type("cce_filter_eps", self.cce_filter_eps, (int, float))
            if isinstance(self.cce_filter_eps, bool) or not 0 <= self.cce_filter_eps < 1:
                raise ConfigError(f"cce_filter_eps must be in [0, 1) or 'auto', got {self.cce_filter_eps!r}")
        if self.assume_device is not None and self.assume_device not in DEVICE_TYPES:
            raise ConfigError(f"assume_device must be one of {DEVICE_TYPES} or None, got {self.assume_device!r}")
        if self.wta_crs_sampling not in WTA_CRS_SAMPLINGS:
            raise ConfigError(f"wta_crs_sampling must be one of {WTA_CRS_SAMPLINGS}, got {self.wta_crs_sampling!r}")
        if self.cce_variant not in CCE_VARIANTS:
            raise ConfigError(f"cce_variant must be one of {CCE_VARIANTS}, got {self.cce_variant!r}")
        if self.pricing not in PRICINGS:
            raise ConfigError(f"pricing must be one of {PRICINGS}, got {self.pricing!r}")
        if self.attention_kernel not in ATTENTION_KERNELS:
            raise ConfigError(f"attention_kernel must be one of {ATTENTION_KERNELS}, got {self.attention_kernel!r}")
        if not all(isinstance(name, str) for name in self.disable):
            raise ConfigError(f"disable must name rules, got {sorted(map(repr, self.disable))}")
        if self.inner_compiler not in INNER_COMPILERS:
            raise ConfigError(f"inner_compiler must be one of {INNER_COMPILERS}, got {self.inner_compiler!r}")
        unknown = set(self.disable) - set(RULE_NAMES)
        if unknown:
            raise ConfigError(f"cannot disable unknown rules {sorted(unknown)}; rules are {RULE_NAMES}")
        if self.min_saved_bytes < 0:
            raise ConfigError(f"min_saved_bytes must be >= 0, got {self.min_saved_bytes}")

    def rule_enabled(self, name: str) -> bool:
        return name not in self.disable

    def cce_filter_for(self, dtype) -> float:
        """The filter threshold for a CCE op computing in ``dtype`` (0: exact gradients)."""
        if self.cce_filter_eps == "auto":
            import torch

            return torch.finfo(dtype).eps / 32
        return float(self.cce_filter_eps or 0.0)

    def memory_device(self, actual: torch.device) -> torch.device:
        """The device whose implementation a memory model charges for a tensor on ``actual``."""
        return assumed_device(actual, self.assume_device)

    @classmethod
    def option_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_options(
        cls, options: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None
    ) -> Config:
        """Build a config from memopt keys in ``options`` over values from ``env`` (default ``os.environ``).

        ``options`` must hold only memopt keys; the backend splits Inductor keys off before calling this.
        """
        env = os.environ if env is None else env
        values: dict[str, Any] = _from_env(env)
        for key, value in (options or {}).items():
            if key not in cls.option_names():
                raise ConfigError(_unknown_key_message(key, cls.option_names()))
            values[key] = value
        if "disable" in values:
            values["disable"] = _parse_rule_list(values["disable"])
        if isinstance(values.get("debug_dir"), os.PathLike):
            values["debug_dir"] = os.fspath(values["debug_dir"])
        return cls(**values)


def _from_env(env: Mapping[str, str]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    if env.get(ENV_DEBUG_DIR):
        values["debug_dir"] = env[ENV_DEBUG_DIR]
    if env.get(ENV_DISABLE):
        values["disable"] = env[ENV_DISABLE]
    if env.get(ENV_STRICT):
        values["strict"] = _parse_bool(ENV_STRICT, env[ENV_STRICT])
    if env.get(ENV_FORCE):
        values["force"] = _parse_bool(ENV_FORCE, env[ENV_FORCE])
    if env.get(ENV_PRECOMPILE):
        values["precompile"] = _parse_bool(ENV_PRECOMPILE, env[ENV_PRECOMPILE])
    if env.get(ENV_WTA_BUDGET):
        try:
            values["wta_crs_budget"] = float(env[ENV_WTA_BUDGET])
        except ValueError as e:
            raise ConfigError(f"{ENV_WTA_BUDGET} must be a number in (0, 1], got {env[ENV_WTA_BUDGET]!r}") from e
    if env.get(ENV_WTA_MAX_US):
        text = env[ENV_WTA_MAX_US].strip().lower()
        try:
            values["wta_crs_max_us_per_mib"] = None if text in ("none", "off") else float(text)
        except ValueError as e:
            raise ConfigError(f"{ENV_WTA_MAX_US} must be a number or 'none', got {env[ENV_WTA_MAX_US]!r}") from e
    if env.get(ENV_CCE_FILTER):
        text = env[ENV_CCE_FILTER]
        try:
            values["cce_filter_eps"] = text if text == "auto" else float(text)
        except ValueError as e:
            raise ConfigError(f"{ENV_CCE_FILTER} must be a number or 'auto', got {text!r}") from e
    if env.get(ENV_ASSUME_DEVICE):
        device = env[ENV_ASSUME_DEVICE].strip().lower()
        if device not in DEVICE_TYPES:
            raise ConfigError(f"{ENV_ASSUME_DEVICE} must be one of {DEVICE_TYPES}, got {env[ENV_ASSUME_DEVICE]!r}")
        values["assume_device"] = device
    if env.get(ENV_CCE_VARIANT):
        values["cce_variant"] = env[ENV_CCE_VARIANT].strip().lower()
    if env.get(ENV_WTA_CRS_SAMPLING):
        values["wta_crs_sampling"] = env[ENV_WTA_CRS_SAMPLING].strip().lower()
    if env.get(ENV_ATTENTION_KERNEL):
        values["attention_kernel"] = env[ENV_ATTENTION_KERNEL].strip().lower()
    if env.get(ENV_PRICING):
        values["pricing"] = env[ENV_PRICING].strip().lower()
    if env.get(ENV_MEMORY_BUDGET):
        values["memory_budget"] = env[ENV_MEMORY_BUDGET]
    if env.get(ENV_INNER):
        values["inner_compiler"] = env[ENV_INNER]
    if env.get(ENV_MIN_SAVED):
        try:
            values["min_saved_bytes"] = int(env[ENV_MIN_SAVED])
        except ValueError as e:
            raise ConfigError(f"{ENV_MIN_SAVED} must be an integer, got {env[ENV_MIN_SAVED]!r}") from e
    return values


def parse_memory_budget(value: Any) -> int | float:
    """``memory_budget`` as bytes (an int, or a string such as ``"24GiB"``, ``"512 MiB"``, ``"2e9"``) or as a
    fraction of torch.compile's simulated peak (a float in (0, 1], or such a string: ``"0.5"``)."""
    wrong = f"memory_budget must be bytes (an int, '24GiB', '512MiB') or a fraction in (0, 1], got {value!r}"
    if isinstance(value, str):
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*", value.lower())
        if match is None or match.group(2) not in _BYTE_UNITS:
            raise ConfigError(wrong)
        number, unit = float(match.group(1)), match.group(2)
        return parse_memory_budget(int(number * _BYTE_UNITS[unit]) if unit or number > 1 else number)
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    if isinstance(value, float) and 0 < value <= 1:
        return value
    raise ConfigError(wrong)


def assumed_device(actual: torch.device, assume: str | None) -> torch.device:
    """``actual``, or the device of type ``assume`` when one is assumed."""
    import torch

    return actual if assume is None else torch.device(assume)


def _parse_bool(name: str, text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ConfigError(f"{name} must be 0/1/true/false, got {text!r}")


def _parse_rule_list(value: str | Any) -> frozenset[str]:
    if isinstance(value, str):
        return frozenset(part.strip() for part in value.split(",") if part.strip())
    if not isinstance(value, (list, tuple, set, frozenset)):
        raise ConfigError(f"disable must be a comma-separated string or a list of rule names, got {value!r}")
    return frozenset(value)


def _check_type(name: str, value: Any, kind: type | tuple[type, ...]) -> None:
    """Options arrive untyped (dicts, env): say which one is wrong instead of failing later."""
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        expected = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise ConfigError(f"{name} must be {expected}, got {value!r}")


def _unknown_key_message(key: str, known: tuple[str, ...]) -> str:
    close = difflib.get_close_matches(key, known, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"unknown memopt option {key!r}{hint} (memopt options: {', '.join(known)})"
