"""Fixtures for the op kernels: devices, seeded inputs, poisoned outputs, relative error.

A kernel test body runs on the CPU device (through the kernel's NumPy twin) and, marked ``cuda``,
on the GPU; the GPU device is shared by a module and skips only when there is genuinely no CUDA
driver or GPU (`ep.device.cuda_available`), never on another failure.

    def test_axpy(device, rng, poison, upload, rel_error):
        s = device.default_stream
        x = upload(device, rng.standard_normal(5).astype(np.float32))
        y = device.alloc(5, np.float32, stream=s)
        poison(y)  # NaN: any element the kernel forgets stays NaN
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator

import numpy as np
import pytest
from _devices import cuda_or_skip

import ep.kernels  # noqa: F401  (registers every kernel)
from ep.device import CACHE_ENV, Buffer, Device, get_device, kernel_target
from ep.kernels.mx4f8 import MX4F8_KERNELS


@pytest.fixture(scope="session", autouse=True)
def _kernel_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Compiled test kernels go to a temporary cache, not the user's ~/.cache."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(CACHE_ENV, str(tmp_path_factory.mktemp("kernel-cache")))
        yield


@pytest.fixture(scope="module")
def cuda_device() -> Device:
    """The GPU for a whole test module (kernels load on first launch and stay loaded)."""
    return cuda_or_skip()


@pytest.fixture(scope="module")
def cpu_device() -> Device:
    return get_device("cpu")


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def device(request: pytest.FixtureRequest) -> Device:
    """Each test once on the CPU (NumPy twins) and once on the GPU (marked ``cuda``)."""
    return cuda_or_skip() if request.param == "cuda" else get_device("cpu")


@pytest.fixture
def f8_device(device: Device) -> Device:
    """`device` where the FP8 GEMVs (`ep.kernels.mx4f8`, `ep.kernels.q4f8`: wgmma, sm_90a) exist:
    the CPU (their twins) or an sm_90 GPU."""
    if (
        device.arch is not None
        and kernel_target(MX4F8_KERNELS["ep_gemv_mx4f8_bf16"], device.arch) is None
    ):
        pytest.skip(f"the FP8 GEMVs need sm_90a (wgmma); this GPU is {device.arch}")
    return device


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> np.random.Generator:
    """A generator seeded from the test's id: fixed per test, different between tests."""
    digest = hashlib.sha256(request.node.nodeid.encode()).digest()
    return np.random.default_rng(int.from_bytes(digest[:8], "little"))


def poison_buffer(buffer: Buffer) -> None:
    """Fill ``buffer`` on its device's default stream: NaN for floats, 0xFF bytes otherwise."""
    dev = buffer.device
    stream = dev.default_stream
    if buffer.dtype.kind == "f" or buffer.dtype.name == "bfloat16":
        dev.fill(buffer, float("nan"), stream=stream)
    else:
        bits = np.dtype(f"u{buffer.dtype.itemsize}")
        dev.fill(buffer.view(bits), int(np.iinfo(bits).max), stream=stream)


@pytest.fixture
def poison() -> Callable[[Buffer], None]:
    """``poison(buffer)``: fill an output with NaN (floats) or 0xFF bytes before a kernel runs."""
    return poison_buffer


def upload_array(dev: Device, array: np.ndarray, name: str = "") -> Buffer:
    """A new device buffer holding ``array`` (on the device's default stream)."""
    return dev.to_device(np.ascontiguousarray(array), stream=dev.default_stream, name=name)


@pytest.fixture
def upload() -> Callable[..., Buffer]:
    """``upload(dev, array, name="")``: a new device buffer with a copy of ``array``."""
    return upload_array


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    """max |got - want| / max |want| in float64; NaN anywhere in ``got`` gives inf."""
    g = np.asarray(got, dtype=np.float64)
    w = np.asarray(want, dtype=np.float64)
    if g.shape != w.shape:
        raise AssertionError(f"shape {g.shape} != expected {w.shape}")
    if not np.isfinite(g).all() and np.isfinite(w).all():
        return float("inf")
    return float(np.abs(g - w).max() / max(float(np.abs(w).max()), 1e-30))


@pytest.fixture
def rel_error() -> Callable[[np.ndarray, np.ndarray], float]:
    """``rel_error(got, want)``: max abs error over max abs reference (inf if got has NaN)."""
    return relative_error
