"""Configuration: precedence, sources, plugin options and every kind of bad value."""

from __future__ import annotations

from pathlib import Path

import pytest

from ep.config import load_config, parse_budget
from ep.errors import ConfigError, ContractError
from ep.plugins import PluginHost


@pytest.fixture(scope="module")
def registry():
    return PluginHost(environ={}).registry


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "genai-ep.toml"
    path.write_text(text)
    return path


def test_defaults_have_source_default(registry, tmp_path: Path) -> None:
    config = load_config(registry, environ={}, cwd=tmp_path)
    assert config["decode.backend"] == "ort"
    assert config.source("decode.backend") == "default"
    assert config["kv_layout.head_major.min_capacity"] == 16
    assert config.file is None


def test_each_layer_overrides_the_one_below(registry, tmp_path: Path) -> None:
    path = write(
        tmp_path,
        '[decode]\nbackend = "native"\nsync_every = 4\n[kv_layout.head_major]\nmin_capacity = 32\n'
        '[offload]\nbudget = "2GiB"\n',
    )
    env = {"GENAI_EP_DECODE__SYNC_EVERY": "8", "GENAI_EP_OFFLOAD__BUDGET": "25%"}
    cli = {"offload.budget": ("75%", "command line --set offload.budget")}
    config = load_config(registry, config_file=path, environ=env, cli=cli)
    assert (config["decode.backend"], config.source("decode.backend")) == (
        "native",
        f"config file {path}",
    )
    assert config["decode.sync_every"] == 8
    assert config.source("decode.sync_every") == "environment GENAI_EP_DECODE__SYNC_EVERY"
    assert config["kv_layout.head_major.min_capacity"] == 32
    assert config["offload.budget"] == "75%"
    assert config.source("offload.budget") == "command line --set offload.budget"
    assert config.describe("offload.budget") == "'75%' (from command line --set offload.budget)"
    assert config.file == path


def test_genai_ep_toml_in_the_working_directory_is_read(registry, tmp_path: Path) -> None:
    write(tmp_path, '[decode]\ncapture = "never"\n')
    config = load_config(registry, environ={}, cwd=tmp_path)
    assert config.source("decode.capture").startswith("config file")


def test_plugin_options_and_create(registry, tmp_path: Path) -> None:
    config = load_config(
        registry,
        environ={"GENAI_EP_KV_LAYOUT__HEAD_MAJOR__MIN_CAPACITY": "64"},
        cwd=tmp_path,
    )
    assert config.plugin_options("kv_layout", "head_major") == {"min_capacity": 64}
    layout = config.create("kv_layout")
    assert layout.name == "head_major" and layout.min_capacity == 64


def test_config_is_frozen(registry, tmp_path: Path) -> None:
    config = load_config(registry, environ={}, cwd=tmp_path)
    with pytest.raises(AttributeError):
        config.settings = {}  # type: ignore[misc]


@pytest.mark.parametrize(
    ("toml", "env", "cli", "message"),
    [
        ('[decode]\nbackend = "onnx"\n', {}, {}, r"decode.backend = 'onnx' \(from config file "
         r".*\): 'onnx' is not allowed; expected one of 'ort', 'native'"),
        ('[decode]\nkv_layout = "head_majr"\n', {}, {}, r"unknown kv layout 'head_majr'.*"
         r"did you mean 'head_major'"),
        ("", {"GENAI_EP_DECODE__CAPTURE": "sometimes"}, {}, r"decode.capture = 'sometimes' "
         r"\(from environment GENAI_EP_DECODE__CAPTURE\): unknown capture 'sometimes'"),
        ("", {}, {"decode.offload": ("lru2", "command line --offload")}, r"command line --offload"),
        ('[decode]\nsync_every = 0\n', {}, {}, r"sync_every = 0 .*must be at least 1"),
        ('[decode]\nsync_every = "four"\n', {}, {}, r"'four' is not a valid int"),
        ("", {"GENAI_EP_DECODE__SYNC_EVERY": "2.5"}, {}, r"'2.5' is not a valid int"),
        ('[decode]\nbakend = "ort"\n', {}, {}, r"unknown config key 'decode.bakend'.*"
         r"did you mean 'decode.backend'"),
        ('[kv_layout.paeged]\npage_size = 16\n', {}, {}, r"no kv layout plugin 'paeged'"),
        ('[kv_layout.head_major]\nmin_cap = 8\n', {}, {}, r"has no option 'min_cap'.*min_capacity"),
        ('[kv_layout.head_major]\nmin_capacity = 24\n', {}, {}, r"must be a power of two"),
        ('[offload]\nbudget = "lots"\n', {}, {}, r"budget 'lots' is not a size"),
        ('[offload]\nbudget = "150%"\n', {}, {}, r"must be a share in \(0%, 100%\]"),
        ("", {"GENAI_EP_DECODE__BACKND": "ort"}, {}, r"GENAI_EP_DECODE__BACKND='ort' is not a "
         r"genai-ep setting \(did you mean GENAI_EP_DECODE__BACKEND\?\)"),
        ("[decode\n", {}, {}, r"is not valid TOML"),
    ],
)  # fmt: skip
def test_bad_values_name_key_value_source_and_fix(
    registry, tmp_path: Path, toml: str, env: dict, cli: dict, message: str
) -> None:
    path = write(tmp_path, toml)
    with pytest.raises(ConfigError, match=message):
        load_config(registry, config_file=path, environ=env, cli=cli)


def test_missing_explicit_config_file(registry, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"does not exist"):
        load_config(registry, config_file=tmp_path / "nope.toml", environ={})


def test_non_config_variables_are_not_settings(registry, tmp_path: Path) -> None:
    env = {"GENAI_EP_PLUGINS": "x", "GENAI_EP_TRACE_HOOKS": "1", "GENAI_EP_CACHE": "/tmp/c",
           "GENAI_EP_PDL": "0", "GENAI_EP_FUSE": "0"}  # fmt: skip
    load_config(registry, environ=env, cwd=tmp_path)  # no error


@pytest.mark.parametrize(
    ("text", "nbytes", "share"),
    [("50%", None, 0.5), ("2GiB", 2 * 2**30, None), ("1500000000", 1_500_000_000, None),
     ("512 MB", 512_000_000, None), ("100%", None, 1.0), ("12.5%", None, 0.125)],
)  # fmt: skip
def test_budget_parsing(text: str, nbytes: int | None, share: float | None) -> None:
    budget = parse_budget(text)
    assert (budget.nbytes, budget.share) == (nbytes, share)
    assert budget.resolve(1000) == (nbytes if nbytes is not None else int(1000 * share))


@pytest.mark.parametrize("text", ["0%", "-5%", "0", "2 parsecs", "", "%"])
def test_bad_budgets(text: str) -> None:
    with pytest.raises(ConfigError, match="budget"):
        parse_budget(text)


def test_a_factory_breaking_its_protocol_is_named(plugin_module, tmp_path: Path) -> None:
    mod = plugin_module(
        "half_layout",
        """
        import ep

        class Half:
            name = "half"
            def geometry(self, **kw): ...

        @ep.hookimpl
        def ep_register_kv_layouts(register):
            register.add("half", lambda options: Half())
        """,
    )
    registry = PluginHost(extra_modules=[mod], environ={}).registry
    config = load_config(
        registry, environ={}, cwd=tmp_path, cli={"decode.kv_layout": ("half", "command line")}
    )
    with pytest.raises(ContractError, match=r"half_layout.*'half'.*missing: bytes_per_token"):
        config.create("kv_layout")


@pytest.mark.parametrize("seam", ["kv_layout", "capture", "offload"])
def test_builtin_defaults_satisfy_their_protocols(registry, tmp_path: Path, seam) -> None:
    load_config(registry, environ={}, cwd=tmp_path).create(seam)
