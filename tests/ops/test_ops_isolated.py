"""A test plugin's misbehaving ops inside real sessions, observed from a fresh process.

`isolated_checks.py` registers the built-in pack plus a test plugin ("badops") whose ops raise,
return the wrong dtype/shape/count, break their infer function, or read a JSON attribute; it runs
them in ONNX Runtime sessions and reports what came out. The process must survive all of it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

SCRIPT = Path(__file__).with_name("isolated_checks.py")
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def seen() -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert done.returncode == 0, (
        f"the isolated process died (rc {done.returncode}; -6 is SIGABRT: an exception reached "
        f"ONNX Runtime):\n{done.stderr[-4000:]}"
    )
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_an_op_that_raises_becomes_an_op_error_naming_op_node_and_plugin(seen) -> None:
    out = seen["raises"]
    assert out["raised"] == "OpError" and out["cause"] == "ZeroDivisionError"
    msg = out["message"]
    assert "ai.genai_ep::Raises" in msg and "'boom'" in msg
    assert "plugin 'badops' (module badops_module, badops-dist 9.9)" in msg
    assert "isolated_checks.py" in msg  # where it was raised


def test_the_process_lives_and_later_runs_work(seen) -> None:
    expected = seen["good_before"]["value"]
    assert seen["good_after"] == {"raised": None, "value": expected}
    assert seen["good_at_end"] == {"raised": None, "value": expected}
    assert seen["raises_again"]["raised"] == "OpError"  # the failing node fails every time


@pytest.mark.parametrize(
    ("key", "fragment"),
    [
        ("BadDtype", "output 0 'y' should be float32[2, 3] but came back as float64[2, 3]"),
        ("BadShape", "output 0 'y' should be float32[2, 3] but came back as float32[1, 3]"),
        ("BadCount", "returned 2 output(s); the schema declares 1"),
        ("BadInfer", "raised RuntimeError: infer is broken"),
    ],
)
def test_output_violations_are_addressed_to_the_plugin_author(
    seen, key: str, fragment: str
) -> None:
    out = seen[key]
    assert out["raised"] == "OpError", out
    assert fragment in out["message"]
    assert "badops" in out["message"] and f"ai.genai_ep::{key}" in out["message"]


def test_the_ops_error_wins_over_the_failure_it_caused_downstream(seen) -> None:
    out = seen["chained"]
    assert out["raised"] == "OpError" and "'inf2'" in out["message"]
    assert out["context"] == "Fail"  # ORT's own failure (the Add) is kept as the context


def test_keyboard_interrupt_inside_an_op_is_re_raised_after_the_run(seen) -> None:
    assert seen["interrupt"]["raised"] == "KeyboardInterrupt"


def test_json_attributes_reach_the_op_as_objects(seen) -> None:
    assert seen["json"] == {"raised": None, "value": [[3.0, 5.5, 8.0], [10.5, 13.0, 15.5]]}


def test_plain_session_run_keeps_the_error_for_raise_op_errors(seen) -> None:
    assert seen["plain_run"]["raised"] is None
    assert seen["plain_then_check"]["raised"] == "OpError"
    assert "'boom'" in seen["plain_then_check"]["message"]


def test_errors_from_parallel_execution_reach_the_caller(seen) -> None:
    assert seen["parallel"]["raised"] == "OpError" and "'par'" in seen["parallel"]["message"]


def test_ops_defined_the_stock_way_still_work(seen) -> None:
    assert seen["foreign"] == {"raised": None, "value": [[-0.0, -1.0, -2.0], [-3.0, -4.0, -5.0]]}


def test_defining_after_the_freeze_is_refused_and_defines_nothing(seen) -> None:
    assert seen["frozen"] is True
    assert seen["late_define"]["raised"] == "ContractError"
    assert "TooLate" in seen["late_define"]["message"]
    assert seen["late_define_count_unchanged"] is True
