"""Meta-tests: every hookspec is documented in the house shape and has a test; the public API."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

import ep
from ep import hookspecs

SPECS = [
    fn
    for name, fn in vars(hookspecs).items()
    if name.startswith("ep_") and callable(fn) and hasattr(fn, "genai_ep_spec")
]


def test_there_are_hookspecs() -> None:
    assert {fn.__name__ for fn in SPECS} >= {
        "ep_register_kv_layouts",
        "ep_register_capture_policies",
        "ep_register_offload_policies",
        "ep_register_ops",
    }


@pytest.mark.parametrize("spec", SPECS, ids=lambda f: f.__name__)
def test_hookspec_is_documented(spec) -> None:
    doc = inspect.getdoc(spec) or ""
    params = list(inspect.signature(spec).parameters)
    for param in params:
        assert f":param {param}:" in doc, f"{spec.__name__} does not document {param}"
    assert ":return:" in doc
    assert "Called " in doc, "say when the hook is called"
    assert "For plugin authors:" in doc


@pytest.mark.parametrize("spec", SPECS, ids=lambda f: f.__name__)
def test_hookspec_has_a_test(spec) -> None:
    tests = "".join(p.read_text() for p in Path(__file__).parent.rglob("test_*.py"))
    assert f"def test_hook_{spec.__name__}(" in tests


def test_public_api_is_what_we_mean() -> None:
    assert set(ep.__all__) >= {
        "Config",
        "EPError",
        "Option",
        "Register",
        "hookimpl",
        "load_config",
        "get_host",
    }
    for name in ep.__all__:
        assert hasattr(ep, name), name
