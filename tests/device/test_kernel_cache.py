"""NVRTC compilation to cubin and the on-disk cache: NVRTC needs no GPU, so all of it runs here."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from ep.device import (
    KERNELS,
    CompileOptions,
    KernelCache,
    KernelRegistry,
    KernelSource,
    compile_all,
    compile_all_kernels,
    compile_kernel,
    cuda_available,
    default_cache,
)
from ep.device._kernels import cubin_symbols, kernel_target
from ep.errors import (
    DeviceUnavailableError,
    KernelCompileError,
    KernelRegistryError,
    KernelUnavailableError,
)

SCALE = KernelSource(
    name="test_scale_f32",
    source="""
extern "C" __global__ void test_scale_f32(float* y, float a, unsigned long long n) {
    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] *= a;
}
""",
    params=("f32*", "f32", "u64"),
)


def _only_file(folder: Path) -> Path:
    files = [p for p in folder.iterdir() if p.is_file()]
    assert len(files) == 1, files
    return files[0]


def test_miss_then_hit_returns_the_same_cubin(tmp_path: Path) -> None:
    cache = KernelCache(tmp_path)
    first = compile_kernel(SCALE, "sm_90", cache=cache)
    assert first.report.cache == "miss"
    assert first.cubin[:4] == b"\x7fELF"
    assert "test_scale_f32" in cubin_symbols(first.cubin)
    assert first.report.cubin_bytes == len(first.cubin)
    assert Path(first.report.path) == _only_file(tmp_path)

    second = compile_kernel(SCALE, "sm_90", cache=cache)
    assert second.report.cache == "hit"
    assert second.cubin == first.cubin


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty", "garbage"])
def test_damaged_cache_file_is_recompiled_not_loaded(tmp_path: Path, damage: str) -> None:
    cache = KernelCache(tmp_path)
    good = compile_kernel(SCALE, "sm_90", cache=cache).cubin
    path = _only_file(tmp_path)
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[-10] ^= 0xFF
    elif damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "empty":
        data = bytearray()
    else:
        data = bytearray(b"not a cubin at all" * 20)
    path.write_bytes(bytes(data))

    again = compile_kernel(SCALE, "sm_90", cache=cache)
    assert again.report.cache == "corrupt"
    assert "recompiled" in again.report.note
    assert again.cubin == good
    assert path.read_bytes() != bytes(data)  # rewritten
    assert compile_kernel(SCALE, "sm_90", cache=cache).report.cache == "hit"


def test_key_changes_with_source_arch_and_options() -> None:
    base = KernelCache.key(SCALE, "sm_90")
    assert KernelCache.key(SCALE, "sm_90") == base
    variants = [
        KernelCache.key(SCALE, "sm_80"),
        KernelCache.key(
            KernelSource(SCALE.name, SCALE.source, SCALE.params, options=CompileOptions(fma=False)),
            "sm_90",
        ),
        KernelCache.key(
            KernelSource(
                SCALE.name,
                SCALE.source,
                SCALE.params,
                options=CompileOptions(defines=(("TILE", "64"),)),
            ),
            "sm_90",
        ),
        KernelCache.key(
            KernelSource(SCALE.name, SCALE.source + "\n// changed\n", SCALE.params), "sm_90"
        ),
    ]
    assert len({base, *variants}) == 5


def test_different_options_give_different_files(tmp_path: Path) -> None:
    cache = KernelCache(tmp_path)
    no_fma = KernelSource(SCALE.name, SCALE.source, SCALE.params, options=CompileOptions(fma=False))
    compile_kernel(SCALE, "sm_90", cache=cache)
    assert compile_kernel(no_fma, "sm_90", cache=cache).report.cache == "miss"
    assert len(list(tmp_path.iterdir())) == 2


def test_failed_write_leaves_no_partial_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = KernelCache(tmp_path)
    key = KernelCache.key(SCALE, "sm_90")
    cache.store(key, b"\x7fELF old contents", SCALE.name)
    target = _only_file(tmp_path)

    def failing_fsync(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(OSError, match="No space left"):
        cache.store(key, b"\x7fELF new contents that never land", SCALE.name)
    assert _only_file(tmp_path) == target  # no temporary file left behind
    assert cache.load(key, SCALE.name).cubin == b"\x7fELF old contents"


def test_unwritable_cache_still_compiles(tmp_path: Path) -> None:
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("in the way")
    compiled = compile_kernel(SCALE, "sm_90", cache=KernelCache(not_a_folder / "kernels"))
    assert compiled.cubin[:4] == b"\x7fELF"
    assert "not cached" in compiled.report.note


def test_cache_location_follows_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GENAI_EP_KERNEL_CACHE", str(tmp_path / "here"))
    assert default_cache().root == tmp_path / "here"
    monkeypatch.delenv("GENAI_EP_KERNEL_CACHE")
    assert default_cache().root == Path.home() / ".cache" / "genai-ep" / "kernels"


def test_compile_error_shows_the_log_and_the_kernel(tmp_path: Path) -> None:
    broken = KernelSource(
        name="test_broken",
        source='extern "C" __global__ void test_broken(float* y) { y[0] = not_declared; }',
        params=("f32*",),
    )
    with pytest.raises(KernelCompileError) as info:
        compile_kernel(broken, "sm_90", cache=KernelCache(tmp_path))
    text = str(info.value)
    assert "'test_broken' did not compile for sm_90" in text
    assert "not_declared" in text and "is undefined" in text
    assert list(tmp_path.iterdir()) == []


def test_mangled_entry_is_reported(tmp_path: Path) -> None:
    mangled = KernelSource(
        name="test_mangled",
        source="__global__ void test_mangled(float* y) { y[0] = 1.0f; }",
        params=("f32*",),
    )
    with pytest.raises(KernelCompileError, match=r'found mangled .*test_mangled.*extern "C"'):
        compile_kernel(mangled, "sm_90", cache=KernelCache(tmp_path))


@pytest.mark.parametrize("arch", ["compute_90", "90", "sm90", "sm_9"])
def test_only_cubin_architectures_are_accepted(tmp_path: Path, arch: str) -> None:
    with pytest.raises(KernelCompileError, match="sm_XX"):
        compile_kernel(SCALE, arch, cache=KernelCache(tmp_path))


def test_compile_all_for_sm90_without_a_gpu(tmp_path: Path) -> None:
    registry = KernelRegistry()
    registry.register(SCALE)
    reports = compile_all("sm_90", registry=registry, cache=KernelCache(tmp_path))
    assert [(r.name, r.arch, r.cache) for r in reports] == [("test_scale_f32", "sm_90", "miss")]


def test_compile_all_kernels_covers_the_registry() -> None:
    reports = compile_all_kernels("sm_90")
    assert [r.name for r in reports] == KERNELS.names()
    assert {"fill_u8", "fill_u16", "fill_u32", "fill_u64", "axpy_f32"} <= set(KERNELS.names())
    for report in reports:  # sm_90, or sm_90a for a kernel of wgmma (KernelSource.targets)
        assert report.arch == kernel_target(KERNELS.get(report.name), "sm_90")
        assert report.cubin_bytes > 0 and report.seconds >= 0 and report.cache in ("hit", "miss")
    assert "sm_90a" in {r.arch for r in reports}
    assert {r.cache for r in compile_all_kernels("sm_90")} == {"hit"}


def test_an_architecture_specific_kernel_exists_for_its_target_only(tmp_path: Path) -> None:
    """``targets``: compiled for sm_90 as sm_90a (and cached under it), skipped by compile_all
    elsewhere, refused elsewhere with what exists."""
    kernel = dataclasses.replace(SCALE, name="test_scale_f32_90a", targets=("sm_90a",))
    cache = KernelCache(tmp_path)
    compiled = compile_kernel(kernel, "sm_90", cache=cache)
    assert (compiled.arch, compiled.report.arch, compiled.report.cache) == (
        "sm_90a",
        "sm_90a",
        "miss",
    )
    registry = KernelRegistry()
    registry.register(kernel)
    assert [r.cache for r in compile_all("sm_90", registry=registry, cache=cache)] == ["hit"]
    [skipped] = compile_all("sm_80", registry=registry, cache=cache)
    assert (skipped.arch, skipped.cache, skipped.note) == ("sm_80", "skipped", "only for sm_90a")
    with pytest.raises(
        KernelUnavailableError, match=r"only sm_90a has; it does not exist for sm_100"
    ):
        compile_kernel(kernel, "sm_100", cache=cache)
    assert compile_kernel(SCALE, "sm_90", cache=cache).arch == "sm_90"  # the plain one: as given


def test_compile_all_kernels_without_arch_needs_a_gpu() -> None:
    ok, _ = cuda_available()
    if ok:
        reports = compile_all_kernels(None)
        assert reports and all(r.arch.startswith("sm_") for r in reports)
        return
    with pytest.raises(DeviceUnavailableError, match="--arch sm_90"):
        compile_all_kernels(None)


# --- the registry ----------------------------------------------------------------------------


def test_registering_twice_is_idempotent_but_a_clash_is_an_error() -> None:
    registry = KernelRegistry()
    assert registry.register(SCALE) is SCALE
    assert registry.register(KernelSource(SCALE.name, SCALE.source, SCALE.params)) is SCALE
    with pytest.raises(KernelRegistryError, match="already registered"):
        registry.register(KernelSource(SCALE.name, SCALE.source, ("f32*", "f64", "u64")))
    assert registry.get("test_scale_f32") is SCALE
    with pytest.raises(KernelRegistryError, match=r"no kernel named 'nope' .*test_scale_f32"):
        registry.get("nope")


def test_kernel_source_is_validated() -> None:
    with pytest.raises(KernelRegistryError, match="unknown kernel parameter type 'float'"):
        KernelSource("test_bad", SCALE.source.replace("test_scale_f32", "test_bad"), ("float",))
    with pytest.raises(KernelRegistryError, match=r"no '__global__ \.\.\. test_other\('"):
        KernelSource("test_other", SCALE.source, SCALE.params)
    with pytest.raises(KernelRegistryError, match="not valid"):
        KernelSource("has space", SCALE.source, SCALE.params)


def test_cuda_headers_compile_bf16_and_fp16(tmp_path) -> None:
    """fp16/bf16 kernels include the runtime headers from the nvidia-cuda-runtime wheel."""
    from ep.device import CompileOptions, KernelCache, KernelSource, compile_kernel

    src = KernelSource(
        name="headers_probe",
        source=(
            "#include <cuda_bf16.h>\n#include <cuda_fp16.h>\n"
            'extern "C" __global__ void headers_probe(__nv_bfloat16* x, const __half* y) {\n'
            "  int i = threadIdx.x;\n"
            "  x[i] = __float2bfloat16(__bfloat162float(x[i]) + __half2float(y[i]));\n}\n"
        ),
        params=("bf16*", "f16*"),
        options=CompileOptions(cuda_headers=True),
    )
    without = KernelSource(src.name, src.source, src.params, options=CompileOptions())
    assert src.options.key_fields()["cuda_headers"].startswith("nvidia-cuda-runtime")
    assert compile_kernel(src, "sm_90", cache=KernelCache(tmp_path)).report.cubin_bytes > 0

    with pytest.raises(KernelCompileError, match=r"cuda_bf16\.h"):
        compile_kernel(without, "sm_90", cache=KernelCache(tmp_path))


def test_sm90_kernels_open_with_the_pdl_prologue() -> None:
    from ep.device._kernels import (
        NO_PDL_WAIT_MACRO,
        PDL_PROLOGUE,
        PDL_WAIT_MACRO,
        compiled_source,
        pdl_arch,
        with_pdl_prologue,
    )

    assert [pdl_arch(a) for a in ("sm_80", "sm_89", "sm_90", "sm_90a", "sm_100f")] == [
        False, False, True, True, True,
    ]  # fmt: skip

    text = compiled_source(SCALE, "sm_90")
    body = text.split("{", 1)[1]
    assert body.lstrip().startswith(PDL_PROLOGUE)  # the first statement: nothing runs before it
    assert text.startswith(PDL_WAIT_MACRO)
    # no PDL before compute 9.0: the source as written, EP_PDL_WAIT() a no-op
    assert compiled_source(SCALE, "sm_80") == NO_PDL_WAIT_MACRO + SCALE.source
    assert KernelCache.key(SCALE, "sm_90") != KernelCache.key(SCALE, "sm_80")
    bounded = (
        'extern "C" __global__ void __launch_bounds__(256, 2) k(int* a, int (*f)[2]) {\n'
        "  a[0] = 1;\n}\n"
    )
    assert with_pdl_prologue(bounded, "k").index(PDL_PROLOGUE) > bounded.index(") {")
    with pytest.raises(KernelCompileError, match="body does not follow"):
        with_pdl_prologue('extern "C" __global__ void k(int* a);', "k")
    # and it compiles: griddepcontrol is sm_90 PTX
    assert compile_kernel(SCALE, "sm_90", use_cache=False).cubin[:4] == b"\x7fELF"


_EARLY = KernelSource(
    name="early_scale",
    source=(
        'extern "C" __global__ void early_scale(float* y, const float* w, int n) {\n'
        "  const int i = blockIdx.x * blockDim.x + threadIdx.x;\n"
        "  const float v = i < n ? w[i] : 0.0f;  // a weight no kernel writes: before the wait\n"
        "  EP_PDL_WAIT();\n"
        "  if (i < n) y[i] *= v;\n"
        "}\n"
    ),
    params=("f32*", "f32*", "i32"),
    pdl_wait="kernel",
)


def test_a_kernel_placing_its_own_pdl_wait_gets_only_the_trigger() -> None:
    from ep.device._kernels import (
        NO_PDL_WAIT_MACRO,
        PDL_PROLOGUE,
        PDL_TRIGGER,
        PDL_WAIT_MACRO,
        compiled_source,
    )

    text = compiled_source(_EARLY, "sm_90")
    assert text.startswith(PDL_WAIT_MACRO)
    body = text.split("{", 1)[1]
    assert body.lstrip().startswith(PDL_TRIGGER) and PDL_PROLOGUE not in text
    assert compiled_source(_EARLY, "sm_80") == NO_PDL_WAIT_MACRO + _EARLY.source
    assert KernelCache.key(_EARLY, "sm_90") != KernelCache.key(
        dataclasses.replace(_EARLY, pdl_wait="entry"), "sm_90"
    )
    assert not _EARLY.same_kernel(dataclasses.replace(_EARLY, pdl_wait="entry"))
    for arch in ("sm_90", "sm_80"):  # the macro compiles both ways
        assert compile_kernel(_EARLY, arch, use_cache=False).cubin[:4] == b"\x7fELF"


def test_pdl_wait_must_be_known_and_a_kernel_wait_must_be_called() -> None:
    with pytest.raises(KernelRegistryError, match="never calls EP_PDL_WAIT"):
        KernelSource(
            name="k", source='extern "C" __global__ void k(int* a) { a[0] = 1; }', params=("i32*",),
            pdl_wait="kernel",
        )  # fmt: skip
    with pytest.raises(KernelRegistryError, match="expected 'entry'"):
        dataclasses.replace(_EARLY, pdl_wait="late")  # type: ignore[arg-type]
