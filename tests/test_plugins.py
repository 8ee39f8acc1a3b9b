"""The plugin host: discovery, allow/block lists, local modules, clashes, broken plugins."""

from __future__ import annotations

import importlib.metadata as md

import pytest

from ep.errors import ContractError, PluginConflictError, PluginLoadError
from ep.plugins import PluginHost, get_host

BUILTIN_LAYOUT = """
import ep
from ep_builtin.kv_head_major import HeadMajorLayout

@ep.hookimpl
def ep_register_kv_layouts(register):
    register.add("{name}", lambda options: HeadMajorLayout())
"""


def test_builtins_load_through_entry_points() -> None:
    host = PluginHost(environ={})
    origins = {info.ref.name: info.origin for info in host.plugins}
    assert origins["kv_head_major"] == "builtin"
    assert "head_major" in host.registry.names("kv_layout")
    assert "never" in host.registry.names("capture")
    assert "resident" in host.registry.names("offload")
    entry = host.registry.get("kv_layout", "head_major")
    assert entry.plugin.distribution == "genai-ep"
    assert entry.plugin.version == md.version("genai-ep")


def test_allowlist_keeps_only_named_plugins() -> None:
    host = PluginHost(environ={"GENAI_EP_PLUGINS": "kv_head_major"})
    assert [p.ref.name for p in host.plugins] == ["kv_head_major"]
    assert host.registry.names("capture") == []


def test_blocklist_drops_named_plugins() -> None:
    host = PluginHost(environ={"GENAI_EP_DISABLE_PLUGINS": "capture_never,capture_warmup"})
    loaded = [p.ref.name for p in host.plugins]
    assert "capture_never" not in loaded and "capture_warmup" not in loaded
    assert "never" not in host.registry.names("capture")
    assert "warmup" not in host.registry.names("capture")
    assert "head_major" in host.registry.names("kv_layout")


def test_local_module_with_plugin_flag(plugin_module) -> None:
    mod = plugin_module("my_local_layout", BUILTIN_LAYOUT.format(name="local_hm"))
    host = PluginHost(extra_modules=[mod], environ={})
    entry = host.registry.get("kv_layout", "local_hm")
    assert entry.plugin.module == "my_local_layout"
    assert entry.plugin.distribution == ""
    assert [p.origin for p in host.plugins if p.ref.name == mod] == ["local"]


def test_local_module_from_environment(plugin_module) -> None:
    mod = plugin_module("env_layout", BUILTIN_LAYOUT.format(name="env_hm"))
    host = PluginHost(environ={"GENAI_EP_PLUGINS_EXTRA": mod})
    assert "env_hm" in host.registry.names("kv_layout")


def test_name_clash_names_both_plugins(plugin_module) -> None:
    mod = plugin_module("clashing_layout", BUILTIN_LAYOUT.format(name="head_major"))
    with pytest.raises(PluginConflictError) as info:
        PluginHost(extra_modules=[mod], environ={})
    msg = str(info.value)
    assert "'head_major'" in msg
    assert "kv_head_major" in msg and "genai-ep" in msg  # the built-in and its distribution
    assert "clashing_layout" in msg and "no distribution" in msg
    assert "GENAI_EP_DISABLE_PLUGINS" in msg


def test_plugin_that_raises_on_import_is_named_and_can_be_excluded(plugin_module) -> None:
    mod = plugin_module("broken_plugin", "import ep\nraise RuntimeError('missing libfoo')\n")
    with pytest.raises(PluginLoadError, match=r"broken_plugin.*RuntimeError: missing libfoo"):
        PluginHost(extra_modules=[mod], environ={})
    host = PluginHost(extra_modules=[mod], environ={"GENAI_EP_DISABLE_PLUGINS": mod})
    assert "head_major" in host.registry.names("kv_layout")


def test_broken_entry_point_is_named_with_its_distribution() -> None:
    ep = md.EntryPoint("ghost", "ep_no_such_module_anywhere", "genai_ep")
    with pytest.raises(
        PluginLoadError, match=r"(?s)ghost.*ModuleNotFoundError.*DISABLE_PLUGINS=ghost"
    ):
        PluginHost(environ={}, entry_points=[ep])
    host = PluginHost(environ={"GENAI_EP_DISABLE_PLUGINS": "ghost"}, entry_points=[ep])
    assert host.plugins == []


def test_misspelled_hook_fails_loudly(plugin_module) -> None:
    mod = plugin_module(
        "typo_plugin",
        """
        import ep

        @ep.hookimpl
        def ep_register_kv_layout(register):
            pass
        """,
    )
    with pytest.raises(
        PluginLoadError, match=r"ep_register_kv_layout'.*did you mean 'ep_register_kv_layouts'"
    ):
        PluginHost(extra_modules=[mod], environ={})


def test_hook_raising_is_reported_with_the_plugin(plugin_module) -> None:
    mod = plugin_module(
        "raising_hook",
        """
        import ep

        @ep.hookimpl
        def ep_register_offload_policies(register):
            raise KeyError("budget")
        """,
    )
    with pytest.raises(
        PluginLoadError, match=r"raising_hook.*ep_register_offload_policies.*KeyError"
    ):
        PluginHost(extra_modules=[mod], environ={})


@pytest.mark.parametrize(
    ("call", "message"),
    [
        ('register.add("bad name", lambda o: None)', "must be a Python identifier"),
        ('register.add("x", 42)', "is not callable"),
        ('register.add("x", lambda o: None, options=["page_size"])', "must be an ep.Option"),
        (
            'register.add("x", lambda o: None, options=[ep.Option("n", int, "a", "help")])',
            "default of option 'n'",
        ),
    ],
)
def test_register_contract_is_checked(plugin_module, call: str, message: str) -> None:
    mod = plugin_module(
        "contract_breaker",
        f"""
        import ep

        @ep.hookimpl
        def ep_register_capture_policies(register):
            {call}
        """,
    )
    with pytest.raises(ContractError, match=message) as info:
        PluginHost(extra_modules=[mod], environ={})
    assert "contract_breaker" in str(info.value)


def test_registry_is_frozen_after_start_up() -> None:
    host = PluginHost(environ={})
    entry = host.registry.get("kv_layout", "head_major")
    with pytest.raises(ContractError, match="after start-up"):
        host.registry.add(entry)


def test_trace_hooks_prints_hook_calls(capsys: pytest.CaptureFixture[str]) -> None:
    PluginHost(environ={"GENAI_EP_TRACE_HOOKS": "1"})
    err = capsys.readouterr().err
    assert "ep_register_kv_layouts" in err and "[genai-ep]" in err


def test_default_host_is_shared_and_extra_modules_make_a_new_one(plugin_module) -> None:
    assert get_host() is get_host()
    mod = plugin_module("another_layout", BUILTIN_LAYOUT.format(name="another"))
    assert "another" in get_host([mod]).registry.names("kv_layout")
    assert "another" not in get_host().registry.names("kv_layout")


# --- one test per hook (the meta-test in test_hookspecs.py checks these exist) --------------


def _one_hook_plugin(plugin_module, hook: str, body: str) -> PluginHost:
    mod = plugin_module(
        f"only_{hook}",
        f"""
        import ep

        @ep.hookimpl
        def {hook}(register):
            {body}
        """,
    )
    return PluginHost(extra_modules=[mod], environ={"GENAI_EP_PLUGINS": f"only_{hook}"})


def test_hook_ep_register_kv_layouts(plugin_module) -> None:
    host = _one_hook_plugin(
        plugin_module, "ep_register_kv_layouts", 'register.add("mine", lambda o: None)'
    )
    assert host.registry.names("kv_layout") == ["mine"]


def test_hook_ep_register_capture_policies(plugin_module) -> None:
    host = _one_hook_plugin(
        plugin_module, "ep_register_capture_policies", 'register.add("mine", lambda o: None)'
    )
    assert host.registry.names("capture") == ["mine"]


def test_hook_ep_register_offload_policies(plugin_module) -> None:
    host = _one_hook_plugin(
        plugin_module, "ep_register_offload_policies", 'register.add("mine", lambda o: None)'
    )
    assert host.registry.names("offload") == ["mine"]


def test_hook_ep_register_ops(plugin_module) -> None:
    host = _one_hook_plugin(plugin_module, "ep_register_ops", 'register.add("MyOp", object())')
    assert host.registry.names("op") == ["MyOp"]
