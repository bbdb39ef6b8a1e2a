"""Backend configuration: environment variables, explicit options over them, validation, option splitting."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fxpass.backend import split_options
from fxpass.config import Config, ConfigError


class TestDefaults:
    """With no options and an empty environment memopt compiles with Inductor and conservative settings."""

    def test_defaults(self):
        config = Config.from_options({}, env={})
        assert config == Config()
        assert config.inner_compiler == "inductor"
        assert config.debug_dir is None
        assert config.disable == frozenset()
        assert config.strict is False
        assert config.min_saved_bytes == 1 << 20
        assert config.force is False
        assert config.wta_crs_budget is None  # WTA-CRS changes gradients: off unless asked for

    def test_none_options(self):
        assert Config.from_options(None, env={}) == Config()

    def test_reads_os_environ_by_default(self, monkeypatch):
        """Without ``env`` the process environment is read (HF Trainer's only route to options)."""
        monkeypatch.setenv("MEMOPT_INNER_COMPILER", "aot_eager")
        monkeypatch.setenv("MEMOPT_STRICT", "0")
        config = Config.from_options()
        assert config.inner_compiler == "aot_eager"
        assert config.strict is False

    def test_frozen(self):
        with pytest.raises(dataclasses.FrozenInstanceError):
            Config().force = True  # type: ignore[misc]

    def test_config_error_is_value_error(self):
        assert issubclass(ConfigError, ValueError)

    def test_option_names(self):
        assert set(Config.option_names()) == {
            "inner_compiler", "debug_dir", "disable", "strict", "min_saved_bytes", "force", "wta_crs_budget",
            "wta_crs_min_tokens", "wta_crs_max_us_per_mib", "wta_crs_winners", "wta_crs_sampling", "cce_filter_eps", "assume_device",
            "cce_variant", "attention_kernel", "precompile", "pricing", "memory_budget",
        }

    def test_wta_crs_sampling(self):
        assert Config().wta_crs_sampling == "traced"
        assert Config.from_options({}, env={"MEMOPT_WTA_CRS_SAMPLING": "Opaque"}).wta_crs_sampling == "opaque"
        with pytest.raises(ConfigError, match="wta_crs_sampling must be one of"):
            Config(wta_crs_sampling="auto")


class TestEnvironment:
    """Each MEMOPT_* variable sets its key; malformed values raise ConfigError naming the variable."""

    def test_debug_dir(self):
        assert Config.from_options({}, env={"MEMOPT_DEBUG_DIR": "/tmp/dump"}).debug_dir == "/tmp/dump"

    def test_empty_variable_is_ignored(self):
        config = Config.from_options({}, env={"MEMOPT_DEBUG_DIR": "", "MEMOPT_STRICT": "", "MEMOPT_DISABLE": ""})
        assert config == Config()

    def test_disable(self):
        config = Config.from_options({}, env={"MEMOPT_DISABLE": "cce"})
        assert config.disable == frozenset({"cce"})
        assert not config.rule_enabled("cce")
        assert config.rule_enabled("attention")

    def test_disable_list_with_spaces(self):
        config = Config.from_options({}, env={"MEMOPT_DISABLE": " cce , wta_crs,,"})
        assert config.disable == frozenset({"cce", "wta_crs"})

    def test_disable_unknown_rule(self):
        with pytest.raises(ConfigError, match=r"unknown rules \['flash'\]"):
            Config.from_options({}, env={"MEMOPT_DISABLE": "cce,flash"})

    @pytest.mark.parametrize(
        ("text", "expected"),
        [("1", True), ("true", True), ("YES", True), (" on ", True), ("0", False), ("false", False), ("off", False)],
    )
    def test_strict(self, text, expected):
        assert Config.from_options({}, env={"MEMOPT_STRICT": text}).strict is expected

    def test_strict_invalid(self):
        with pytest.raises(ConfigError, match=r"MEMOPT_STRICT must be 0/1/true/false, got 'maybe'"):
            Config.from_options({}, env={"MEMOPT_STRICT": "maybe"})

    @pytest.mark.parametrize("name", ["inductor", "aot_eager", "eager"])
    def test_inner_compiler(self, name):
        assert Config.from_options({}, env={"MEMOPT_INNER_COMPILER": name}).inner_compiler == name

    def test_inner_compiler_invalid(self):
        with pytest.raises(ConfigError, match=r"inner_compiler must be one of .* got 'tvm'"):
            Config.from_options({}, env={"MEMOPT_INNER_COMPILER": "tvm"})

    def test_min_saved_bytes(self):
        assert Config.from_options({}, env={"MEMOPT_MIN_SAVED_BYTES": "4096"}).min_saved_bytes == 4096
        assert Config.from_options({}, env={"MEMOPT_MIN_SAVED_BYTES": "0"}).min_saved_bytes == 0

    def test_min_saved_bytes_not_an_integer(self):
        with pytest.raises(ConfigError, match=r"MEMOPT_MIN_SAVED_BYTES must be an integer, got '1MiB'"):
            Config.from_options({}, env={"MEMOPT_MIN_SAVED_BYTES": "1MiB"})

    def test_min_saved_bytes_negative(self):
        with pytest.raises(ConfigError, match=r"min_saved_bytes must be >= 0, got -5"):
            Config.from_options({}, env={"MEMOPT_MIN_SAVED_BYTES": "-5"})

    def test_force(self):
        assert Config.from_options({}, env={"MEMOPT_FORCE": "1"}).force is True
        assert Config.from_options({}, env={"MEMOPT_FORCE": "0"}).force is False

    def test_precompile(self):
        assert Config.from_options({}, env={}).precompile is True
        assert Config.from_options({}, env={"MEMOPT_PRECOMPILE": "0"}).precompile is False
        with pytest.raises(ConfigError, match="precompile"):
            Config.from_options({"precompile": "no"})

    def test_pricing(self):
        assert Config().pricing == "compile"
        assert Config.from_options({}, env={"MEMOPT_PRICING": "Eager"}).pricing == "eager"
        with pytest.raises(ConfigError, match="pricing must be one of"):
            Config.from_options({"pricing": "inductor"})

    def test_wta_crs_budget(self):
        assert Config.from_options(env={"MEMOPT_WTA_CRS_BUDGET": "0.3"}).wta_crs_budget == 0.3

    @pytest.mark.parametrize("text", ["0", "1.5", "-0.1", "lots"])
    def test_wta_crs_budget_invalid(self, text):
        with pytest.raises(ConfigError, match=r"wta_crs_budget|MEMOPT_WTA_CRS_BUDGET"):
            Config.from_options(env={"MEMOPT_WTA_CRS_BUDGET": text})

    def test_wta_crs_max_us_per_mib(self):
        assert Config().wta_crs_max_us_per_mib == 6.0
        assert Config.from_options(env={"MEMOPT_WTA_CRS_MAX_US_PER_MIB": "2.5"}).wta_crs_max_us_per_mib == 2.5
        assert Config.from_options(env={"MEMOPT_WTA_CRS_MAX_US_PER_MIB": "None"}).wta_crs_max_us_per_mib is None
        assert Config.from_options({"wta_crs_max_us_per_mib": None}).wta_crs_max_us_per_mib is None

    @pytest.mark.parametrize("options, env", [({"wta_crs_max_us_per_mib": -1.0}, {}),
                                              ({"wta_crs_max_us_per_mib": True}, {}),
                                              ({}, {"MEMOPT_WTA_CRS_MAX_US_PER_MIB": "cheap"})])
    def test_wta_crs_max_us_per_mib_invalid(self, options, env):
        with pytest.raises(ConfigError, match=r"wta_crs_max_us_per_mib|MEMOPT_WTA_CRS_MAX_US_PER_MIB"):
            Config.from_options(options, env=env)

    def test_force_invalid(self):
        with pytest.raises(ConfigError, match="MEMOPT_FORCE"):
            Config.from_options({}, env={"MEMOPT_FORCE": "2"})

    def test_cce_filter_eps(self):
        assert Config.from_options(env={"MEMOPT_CCE_FILTER_EPS": "0.001"}).cce_filter_eps == 0.001
        assert Config.from_options(env={"MEMOPT_CCE_FILTER_EPS": "auto"}).cce_filter_for(torch.bfloat16) == 2**-12
        assert Config.from_options(env={}).cce_filter_for(torch.bfloat16) == 0.0

    @pytest.mark.parametrize("text", ["1.5", "-0.1", "lots"])
    def test_cce_filter_eps_invalid(self, text):
        with pytest.raises(ConfigError, match=r"cce_filter_eps|MEMOPT_CCE_FILTER_EPS"):
            Config.from_options(env={"MEMOPT_CCE_FILTER_EPS": text})

    @pytest.mark.parametrize(("text", "expected"), [("cuda", "cuda"), (" CPU ", "cpu")])
    def test_assume_device(self, text, expected):
        assert Config.from_options({}, env={"MEMOPT_ASSUME_DEVICE": text}).assume_device == expected

    def test_assume_device_invalid(self):
        with pytest.raises(ConfigError, match="MEMOPT_ASSUME_DEVICE must be one of"):
            Config.from_options({}, env={"MEMOPT_ASSUME_DEVICE": "tpu"})

    def test_attention_kernel(self):
        assert Config().attention_kernel == "auto"
        assert Config.from_options({}, env={"MEMOPT_ATTENTION_KERNEL": " Memopt "}).attention_kernel == "memopt"
        assert Config.from_options({"attention_kernel": "auto"}, env={"MEMOPT_ATTENTION_KERNEL": "memopt"}) \
            .attention_kernel == "auto"  # the option wins over the environment

    @pytest.mark.parametrize("value", ["cudnn", "flash", ""])
    def test_attention_kernel_invalid(self, value):
        with pytest.raises(ConfigError, match="attention_kernel must be one of"):
            Config.from_options({"attention_kernel": value}, env={})


class TestOptions:
    """Explicit options win over the environment and are validated like it."""

    ENV = {  # noqa: RUF012
        "MEMOPT_DEBUG_DIR": "/from/env",
        "MEMOPT_DISABLE": "cce",
        "MEMOPT_STRICT": "1",
        "MEMOPT_INNER_COMPILER": "eager",
        "MEMOPT_MIN_SAVED_BYTES": "7",
        "MEMOPT_FORCE": "1",
    }

    def test_environment_alone(self):
        config = Config.from_options({}, env=self.ENV)
        assert config == Config(
            inner_compiler="eager",
            debug_dir="/from/env",
            disable=frozenset({"cce"}),
            strict=True,
            min_saved_bytes=7,
            force=True,
        )

    def test_options_override_environment(self):
        options = {
            "debug_dir": "/from/options",
            "disable": (),
            "strict": False,
            "inner_compiler": "aot_eager",
            "min_saved_bytes": 0,
            "force": False,
        }
        assert Config.from_options(options, env=self.ENV) == Config(
            inner_compiler="aot_eager", debug_dir="/from/options", strict=False, min_saved_bytes=0
        )

    def test_partial_override_keeps_the_rest_of_the_environment(self):
        config = Config.from_options({"strict": False}, env=self.ENV)
        assert config.strict is False
        assert config.inner_compiler == "eager"
        assert config.disable == frozenset({"cce"})

    @pytest.mark.parametrize("disable", ["cce", "cce,attention", ["cce"], ("cce", "attention"), {"cce"}])
    def test_disable_forms(self, disable):
        config = Config.from_options({"disable": disable}, env={})
        assert isinstance(config.disable, frozenset)
        assert "cce" in config.disable
        assert not config.rule_enabled("cce")

    def test_unknown_key_suggests(self):
        with pytest.raises(ConfigError, match=r"unknown memopt option 'forse'; did you mean 'force'\?"):
            Config.from_options({"forse": True}, env={})

    def test_unknown_key_without_close_match(self):
        with pytest.raises(ConfigError, match=r"unknown memopt option 'zzz' \(memopt options: ") as info:
            Config.from_options({"zzz": 1}, env={})
        assert "did you mean" not in str(info.value)

    def test_unknown_rule(self):
        with pytest.raises(ConfigError, match=r"cannot disable unknown rules \['ccee'\]"):
            Config.from_options({"disable": ["ccee"]}, env={})

    def test_bad_inner_compiler(self):
        with pytest.raises(ConfigError, match="inner_compiler must be one of"):
            Config.from_options({"inner_compiler": "cudagraphs"}, env={})

    def test_negative_min_saved_bytes(self):
        with pytest.raises(ConfigError, match="min_saved_bytes must be >= 0, got -1"):
            Config.from_options({"min_saved_bytes": -1}, env={})

    @pytest.mark.parametrize(
        ("key", "value", "message"),
        [
            ("strict", "0", "strict must be bool"),
            ("force", 1, "force must be bool"),
            ("min_saved_bytes", "1024", "min_saved_bytes must be int"),
            ("min_saved_bytes", True, "min_saved_bytes must be int"),
            ("debug_dir", 3, "debug_dir must be str or NoneType"),
            ("disable", None, "disable must be a comma-separated string"),
            ("disable", [1], "disable must name rules"),
        ],
    )
    def test_wrongly_typed_option(self, key, value, message):
        """Untyped option dicts get a ConfigError naming the option, not a TypeError later on."""
        with pytest.raises(ConfigError, match=message):
            Config.from_options({key: value}, env={})

    def test_assume_device(self):
        """The device whose implementations the memory models charge: the graph's own unless one is assumed."""
        cpu, cuda = torch.device("cpu"), torch.device("cuda")
        assert Config().assume_device is None
        assert Config().memory_device(cpu) == cpu
        assumed = Config.from_options({"assume_device": "cuda"}, env={"MEMOPT_ASSUME_DEVICE": "cpu"})
        assert assumed.memory_device(cpu) == cuda  # the option wins over the environment
        assert Config(assume_device="cpu").memory_device(cuda) == cpu

    @pytest.mark.parametrize("value", ["gpu", "cuda:0", 1])
    def test_assume_device_invalid(self, value):
        with pytest.raises(ConfigError, match="assume_device must be one of"):
            Config.from_options({"assume_device": value}, env={})

    def test_path_debug_dir(self, tmp_path):
        assert Config.from_options({"debug_dir": tmp_path}, env={}).debug_dir == str(tmp_path)

    def test_invalid_option_not_rescued_by_valid_environment(self):
        with pytest.raises(ConfigError):
            Config.from_options({"inner_compiler": "tvm"}, env={"MEMOPT_INNER_COMPILER": "eager"})


class TestSplitOptions:
    """``split_options`` separates memopt keys from Inductor config keys and rejects anything else."""

    def test_split(self):
        ours, inductor = split_options(
            {"force": True, "debug_dir": "d", "max_autotune": False, "epilogue_fusion": True}
        )
        assert ours == {"force": True, "debug_dir": "d"}
        assert inductor == {"max_autotune": False, "epilogue_fusion": True}

    def test_dashed_inductor_key(self):
        """Inductor accepts "max-autotune" for "max_autotune"; the key is passed on unchanged."""
        ours, inductor = split_options({"max-autotune": False})
        assert ours == {}
        assert inductor == {"max-autotune": False}

    def test_empty(self):
        assert split_options(None) == ({}, {})
        assert split_options({}) == ({}, {})

    def test_unknown_key(self):
        with pytest.raises(ConfigError, match=r"unknown option 'max_autotunee'; did you mean 'max_autotune'\?"):
            split_options({"max_autotunee": True})

    def test_unknown_memopt_like_key(self):
        with pytest.raises(ConfigError, match=r"unknown option 'inner_compilr'; did you mean 'inner_compiler'\?"):
            split_options({"force": True, "inner_compilr": "eager"})

    def test_unknown_key_lists_memopt_options(self):
        with pytest.raises(ConfigError, match=r"memopt options: inner_compiler, debug_dir, .*Inductor config"):
            split_options({"qqqqqqqq": 1})
