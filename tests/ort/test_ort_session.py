"""ep.ort.session: the session options hook, execution provider choice, load failures."""

from __future__ import annotations

from pathlib import Path

import onnxruntime as ort
import pytest

from ep.errors import ConfigError, DeviceError, ModelError
from ep.ort import SessionConfig, add_session_options_hook, create_session
from ep.ort.session import remove_session_options_hook

MODEL = Path(__file__).parents[1] / "data" / "genai-llama-tiny" / "genai-fp32" / "model.onnx"


def test_hooks_see_the_options_before_the_session_exists() -> None:
    calls: list[str] = []

    def global_hook(options: ort.SessionOptions) -> None:
        calls.append("global")
        options.add_session_config_entry("session.genai_ep.test", "global")

    def local_hook(options: ort.SessionOptions) -> None:
        calls.append("local")
        assert options.get_session_config_entry("session.genai_ep.test") == "global"
        options.intra_op_num_threads = 1

    add_session_options_hook(global_hook)
    add_session_options_hook(global_hook)  # registering twice runs it once
    try:
        sess = create_session(MODEL, session_options_hook=local_hook)
    finally:
        remove_session_options_hook(global_hook)
    assert calls == ["global", "local"]
    assert sess.get_session_options().intra_op_num_threads == 1
    create_session(MODEL)
    assert calls == ["global", "local"], "a removed hook still ran"


def test_a_failing_hook_is_named() -> None:
    def register_ops(options: ort.SessionOptions) -> None:
        raise RuntimeError("library not found")

    with pytest.raises(
        ConfigError,
        match=r"hook 'test_a_failing_hook_is_named\.<locals>\.register_ops' failed: .*not found",
    ):
        create_session(MODEL, session_options_hook=register_ops)


def test_cuda_without_the_gpu_package() -> None:
    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this onnxruntime has the CUDA execution provider")
    with pytest.raises(DeviceError, match="install onnxruntime-gpu instead of onnxruntime"):
        create_session(MODEL, SessionConfig(device="cuda"))


def test_bad_config_values() -> None:
    with pytest.raises(ConfigError, match="device='tpu'"):
        SessionConfig(device="tpu")
    with pytest.raises(ConfigError, match="intra_op_threads=-1"):
        SessionConfig(intra_op_threads=-1)


def test_unloadable_model_is_a_model_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"garbage")
    with pytest.raises(ModelError, match=r"cannot load .*bad\.onnx"):
        create_session(bad)
