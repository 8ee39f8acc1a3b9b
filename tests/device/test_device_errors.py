"""CUDA errors as sentences, the one-time CUDA probe, device selection and the base template."""

from __future__ import annotations

import numpy as np
import pytest
from cuda.bindings import driver

from ep.device import Device, cuda_available, describe_cuda_error, get_device
from ep.device import _probe as probe_module
from ep.device._cuda_errors import check_cuda, cuda_error
from ep.device._probe import NO_DEVICE_MESSAGE, NO_DRIVER_MESSAGE, CudaProbe, is_missing_driver
from ep.errors import ConfigError, CudaCallError, DeviceError, DeviceUnavailableError


def test_cuda_error_sentence_names_call_code_and_meaning() -> None:
    text = describe_cuda_error("cuMemAlloc(1 TiB)", "CUDA_ERROR_OUT_OF_MEMORY")
    assert text.startswith("cuMemAlloc(1 TiB) failed with CUDA_ERROR_OUT_OF_MEMORY: the GPU ran")
    assert "offload" in text
    assert "uncommon code" in describe_cuda_error("x", "CUDA_ERROR_SOMETHING_NEW")


def test_check_cuda_raises_on_a_real_error_code_only() -> None:
    check_cuda("cuInit", driver.CUresult.CUDA_SUCCESS)
    check_cuda("cuMemGetInfo", (driver.CUresult.CUDA_SUCCESS, 1, 2))
    with pytest.raises(CudaCallError) as info:
        check_cuda("cuLaunchKernel", (driver.CUresult.CUDA_ERROR_ILLEGAL_ADDRESS,))
    assert info.value.code == "CUDA_ERROR_ILLEGAL_ADDRESS" and info.value.call == "cuLaunchKernel"
    assert "restart the process" in str(info.value)
    assert isinstance(info.value, DeviceError)


def test_exceptions_from_cuda_core_become_sentences() -> None:
    err = cuda_error("Device.allocate", RuntimeError("CUDA_ERROR_OUT_OF_MEMORY: out of memory"))
    assert err.code == "CUDA_ERROR_OUT_OF_MEMORY"
    assert "Device.allocate failed with CUDA_ERROR_OUT_OF_MEMORY" in str(err)
    odd = cuda_error("launch", TypeError("the argument is of unsupported type"))
    assert odd.code == "TypeError" and "unsupported type" in str(odd)


def test_probe_answers_absent_only_for_a_missing_driver_or_gpu() -> None:
    try:  # what cuda.bindings raises when libcuda.so is missing (its home moved between releases)
        from cuda.pathfinder import DynamicLibNotFoundError
    except ImportError:
        DynamicLibNotFoundError = type("DynamicLibNotFoundError", (RuntimeError,), {})

    assert is_missing_driver(DynamicLibNotFoundError('"cuda" is an NVIDIA driver library'))
    assert is_missing_driver(OSError("libcuda.so.1: cannot open shared object file"))
    assert not is_missing_driver(RuntimeError("CUDA_ERROR_INSUFFICIENT_DRIVER"))
    assert not is_missing_driver(ValueError("bad argument"))


def test_cuda_available_is_cached_and_plain() -> None:
    ok, reason = cuda_available()
    assert probe_module.probe_cuda() is probe_module.probe_cuda()  # probed once
    if ok:
        assert "CUDA device" in reason
    else:
        assert reason in (NO_DRIVER_MESSAGE, NO_DEVICE_MESSAGE)


def test_broken_driver_is_an_error_not_a_skip(monkeypatch: pytest.MonkeyPatch) -> None:
    broken = CudaProbe(False, False, "cuInit failed with CUDA_ERROR_INSUFFICIENT_DRIVER: ...")
    monkeypatch.setattr(probe_module, "probe_cuda", lambda: broken)
    with pytest.raises(DeviceUnavailableError, match="installed but not usable"):
        cuda_available()
    absent = CudaProbe(False, True, NO_DRIVER_MESSAGE)
    monkeypatch.setattr(probe_module, "probe_cuda", lambda: absent)
    assert cuda_available() == (False, NO_DRIVER_MESSAGE)


def test_package_docstring_example_runs() -> None:
    import doctest

    import ep.device

    result = doctest.testmod(ep.device, raise_on_error=False, verbose=False)
    assert result.attempted >= 10 and result.failed == 0


def test_get_device_names() -> None:
    cpu = get_device("cpu")
    assert get_device("CPU") is cpu and get_device(cpu) is cpu
    assert cpu.kind == "cpu" and cpu.arch is None
    for bad in ("gpu", "cuda:x", "cpu:0", "cuda:-1", ""):
        with pytest.raises(ConfigError, match="expected 'cpu', 'cuda' or 'cuda:N'"):
            get_device(bad)


def test_cuda_without_a_driver_says_so_in_words() -> None:
    ok, reason = cuda_available()
    if ok:
        pytest.skip("this machine has a GPU; the no-driver message cannot be seen here")
    with pytest.raises(DeviceUnavailableError) as info:
        get_device("cuda")
    assert str(info.value) == reason
    assert info.value.__cause__ is None and info.value.__context__ is None  # no deep traceback


def test_missing_backend_hook_is_named() -> None:
    class HalfDevice(Device):
        kind = "half"

    half = HalfDevice("half", None)
    with pytest.raises(DeviceError, match="HalfDevice does not implement _create_stream"):
        half.create_stream()


def test_missing_copy_hook_is_named() -> None:
    cpu = get_device("cpu")

    class NoCopyDevice(type(cpu)):  # type: ignore[misc]
        _copy = Device._copy

    dev = NoCopyDevice()
    s = dev.default_stream
    a = dev.alloc(4, np.uint8, stream=s)
    b = dev.alloc(4, np.uint8, stream=s)
    before = dev.counters()
    with pytest.raises(DeviceError, match="NoCopyDevice does not implement _copy"):
        dev.copy(a, b, stream=s)
    assert dev.counters() == before  # nothing counted for a copy that did not happen


# --- CUDA only -------------------------------------------------------------------------------


@pytest.mark.cuda
def test_cuda_device_facts(cuda_dev: Device) -> None:
    dev = cuda_dev
    assert dev.kind == "cuda" and dev.name == "cuda:0"
    assert dev.arch is not None and dev.arch.startswith("sm_")
    assert get_device("cuda:0") is dev
    assert dev.granule % (2 << 20) == 0
    with pytest.raises(DeviceUnavailableError, match="asked for GPU 99"):
        get_device("cuda:99")


@pytest.mark.cuda
def test_cuda_out_of_memory_is_a_sentence_and_changes_nothing(cuda_dev: Device) -> None:
    dev = cuda_dev
    s = dev.default_stream
    before = dev.counters()
    with pytest.raises(CudaCallError) as info:
        dev.alloc(1 << 50, np.uint8, stream=s, name="too_big")  # 1 PiB
    assert "allocating 1125899906842624 bytes of device memory" in str(info.value)
    assert info.value.code.startswith("CUDA_ERROR_")
    assert dev.counters() == before


@pytest.mark.cuda
def test_declared_parameters_must_match_the_cubin(cuda_dev: Device) -> None:
    from ep.device import KernelSource
    from ep.device._builtin_kernels import AXPY_F32

    dev = cuda_dev
    wrong = KernelSource(
        name="test_axpy_declared_wrong",
        source=AXPY_F32.source.replace("axpy_f32", "test_axpy_declared_wrong"),
        params=("f32*", "f32*", "f64", "u64"),  # `a` is a float (4 bytes), not 8
    )
    with pytest.raises(DeviceError, match=r"take \[8, 8, 8, 8\] bytes each.*\[8, 8, 4, 8\]"):
        dev.kernel(wrong).load()
