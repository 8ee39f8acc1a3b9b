"""The dense fp16/bf16 GEMV at 9..16 rows (``ep_gemv_nk16_<dt>``): ``ep_gemv_nk``'s arithmetic
with the x chunks of a round loaded at once, in a kernel of its own. Its rows must be bitwise
those of ``ep_gemv_nk`` running the same rows alone (DESIGN.md section 6, batch row identity),
plain and with the SwiGLU epilogue, with a K split over blocks, and with unaligned activations
(the general loads). The plan tests run on the CPU device; the kernels' tests are marked
``cuda``."""

from __future__ import annotations

from collections.abc import Callable

import ml_dtypes
import numpy as np
import pytest

from ep.device import Buffer, Device
from ep.kernels import matmul
from ep.kernels.matmul import gemm, matmul_workspace, plan_matmul
from ep.ops import mlp as mlp_ref

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
Upload = Callable[..., Buffer]
Poison = Callable[[Buffer], None]
RelError = Callable[[np.ndarray, np.ndarray], float]


# --- the plan (CPU) ------------------------------------------------------------------------------


def test_plan_takes_nk16_past_8_rows_at_the_same_k_split_and_grid(cpu_device: Device) -> None:
    ws = matmul_workspace(cpu_device, stream=cpu_device.default_stream)
    # (K, N, epilogue) of the 0.5B decode graph on a 132-SM GPU -> nk16 at 9..16 rows
    cases = {
        (896, 151936, None): True,  # the vocabulary projection: 2374 blocks
        (896, 9728, "swiglu"): True,  # gate/up: 304 blocks, one wave at 3 an SM
        (896, 896, None): True,  # O: 112 blocks
        (896, 1152, "rope"): True,  # QKV with the rotary epilogue: 144 blocks
        (4864, 896, None): False,  # down: 112 x 4 blocks, one wave at 4 an SM, two at 3
    }
    for (K, N, epilogue), rows16 in cases.items():
        plans = [
            plan_matmul("nk", BF16, M=m, N=N, K=K, workspace=ws, sm_count=132, epilogue=epilogue)
            for m in range(1, 17)
        ]
        one = plans[0]
        assert "_nk_" in one.kernel
        for m, p in enumerate(plans, 1):
            want = one.kernel.replace("_nk_", "_nk16_") if m > 8 and rows16 else one.kernel
            assert p.kernel == want, (K, N, m, p.reason)
            assert (p.grid, p.block, p.kw, p.gy) == (one.grid, one.block, one.kw, one.gy)
        why = plans[-1].reason
        if rows16:
            assert "16 rows: x rows g and g + 8 of a round at once (nk16)" in why
        else:
            assert "nk16 not taken: 448 blocks are one wave at 4 blocks an SM only" in why
    # fp32 has no tensor-core GEMV; GENAI_EP_GEMV=v1 plans the earlier kernels only
    assert plan_matmul("nk", np.dtype(np.float32), M=16, N=896, K=896).kernel == "ep_gemv_nk_f32"


def test_v1_switch_keeps_ep_gemv_nk_at_16_rows(
    cpu_device: Device, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(matmul.GEMV_ENV, "v1")
    assert plan_matmul("nk", BF16, M=16, N=151936, K=896).kernel == "ep_gemv_nk_bf16"


def test_kernel_entries_keep_their_registers_unroll_and_load_order() -> None:
    """What the compiled entries are promised (matmul.py's table): ``ep_gemv_nk`` 5 steps a round
    bounded to 4 blocks an SM (64 registers), its epilogue twins 4 steps unbounded as before,
    ``ep_gemv_nk16`` 4 steps at 3 blocks an SM, and only its SwiGLU twin with the round's loads
    ordered before the first MMA (`row_gemv`'s ORDER: 8.19 -> 7.19 us at 16 rows on the H200)."""
    from ep.kernels.attention import ROPE_GEMV_KERNELS

    kernels = {**matmul.MATMUL_KERNELS, **ROPE_GEMV_KERNELS}
    for dt in ("bf16", "f16"):
        entry = {
            family: kernels[f"ep_gemv_{family}_{dt}"].source.rsplit("typedef", 1)[1]
            for family in ("nk", "nk_swiglu", "nk_rope", "nk16", "nk16_swiglu", "nk16_rope")
        }
        assert "__launch_bounds__(256, 4)" in entry["nk"]
        assert "DenseRows<T>, 5, true, true>" in entry["nk"]
        for twin in ("nk_swiglu", "nk_rope"):
            assert "__launch_bounds__(256, 1)" in entry[twin]
            assert "DenseRows<T>, 4, true, true>" in entry[twin]
        for family in ("nk16", "nk16_swiglu", "nk16_rope"):
            assert "__launch_bounds__(256, 3)" in entry[family]
            ordered = "DenseRows<T>, 4, true, true, true, true>" in entry[family]
            assert ordered == (family == "nk16_swiglu"), family
            assert ordered or "DenseRows<T>, 4, true, true, true>" in entry[family]


def test_nk16_runs_its_numpy_twin_on_the_cpu(cpu_device: Device, rng: np.random.Generator) -> None:
    dev, s = cpu_device, cpu_device.default_stream
    M, N, K = 12, 40, 64
    x = rng.standard_normal((M, K)).astype(BF16)
    w = (rng.standard_normal((N, K)) / 8).astype(BF16)
    out = dev.alloc((M, N), BF16, stream=s, name="y")
    plan = gemm(dev, out, dev.to_device(x, stream=s), dev.to_device(w, stream=s), M=M, N=N, K=K,
                transpose_b=1, stream=s)  # fmt: skip
    assert plan.kernel == "ep_gemv_nk16_bf16"
    want = np.concatenate([x[i : i + 1].astype(np.float32) @ w.astype(np.float32).T
                           for i in range(M)]).astype(BF16)  # fmt: skip
    np.testing.assert_array_equal(out.to_host(stream=s), want)


# --- the kernels (GPU) ---------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize(
    ("K", "N", "swiglu"),
    [
        (896, 1000, False),  # 125 column groups: a part-filled block
        (4864, 256, False),  # the K split over blocks too (gy > 1)
        (96, 72, False),  # 3 steps: a round part-filled
        (896, 2 * 328, True),  # gate/up with SwiGLU
    ],
)
@pytest.mark.parametrize("dtype", [F16, BF16], ids=["f16", "bf16"])
def test_nk16_rows_are_bitwise_ep_gemv_nk_alone(
    device: Device,
    rng: np.random.Generator,
    poison: Poison,
    upload: Upload,
    rel_error: RelError,
    dtype: np.dtype,
    K: int,
    N: int,
    swiglu: bool,
) -> None:
    dev, s = device, device.default_stream
    ws = matmul_workspace(dev, stream=s)
    x = rng.standard_normal((16, K)).astype(np.float32).astype(dtype)
    w = (rng.standard_normal((N, K)) / np.sqrt(K)).astype(np.float32).astype(dtype)
    wb = upload(dev, w)
    cols = N // 2 if swiglu else N

    def run(rows: np.ndarray) -> tuple[np.ndarray, matmul.MatmulPlan]:
        M = rows.shape[0]
        out = dev.alloc(M * cols + 40, dtype, stream=s, name="y")  # 40 spare elements stay NaN
        poison(out)
        plan = gemm(dev, out, upload(dev, rows), wb, M=M, N=N, K=K, transpose_b=1, stream=s,
                    workspace=ws, swiglu=0 if swiglu else None)  # fmt: skip
        got = out.to_host(stream=s)
        assert np.isnan(got[M * cols :].astype(np.float32)).all()  # nothing written past y
        return got[: M * cols].reshape(M, cols), plan

    batch, plan = run(x)
    assert "_nk16_" in plan.kernel, plan
    assert (plan.gy > 1) == (K == 4864)
    product = x.astype(np.float32) @ w.astype(np.float32).T
    want = (
        mlp_ref.swiglu(product[:, :cols].astype(dtype), product[:, cols:].astype(dtype))
        if swiglu
        else product.astype(dtype)
    )
    assert rel_error(batch, want) < 1e-2
    alone, one = run(x[5:6])
    assert "_nk_" in one.kernel
    np.testing.assert_array_equal(alone, batch[5:6])
    np.testing.assert_array_equal(run(x[:8])[0], batch[:8])  # ep_gemv_nk at 8 rows
    nine, _ = run(x[7:16])  # nk16 at 9 rows: row 7 of the batch is its row 0
    np.testing.assert_array_equal(nine, batch[7:16])


@pytest.mark.cuda
def test_nk16_unaligned_activations_take_the_general_loads_with_the_same_bits(
    device: Device, rng: np.random.Generator, poison: Poison, upload: Upload
) -> None:
    dev, s = device, device.default_stream
    M, N, K = 16, 512, 896
    ws = matmul_workspace(dev, stream=s)
    x = rng.standard_normal((M, K)).astype(BF16)
    w = (rng.standard_normal((N, K)) / 30).astype(BF16)
    wb = upload(dev, w)

    def run(offset: int) -> np.ndarray:
        # x one element past an aligned address: rows no longer 16-byte aligned (EPK_X16 off)
        xb = upload(dev, np.concatenate([np.zeros(offset, BF16), x.reshape(-1)]))
        out = dev.alloc((M, N), BF16, stream=s, name="y")
        poison(out)
        xv = xb.view(BF16, (M, K), offset=2 * offset)
        plan = gemm(dev, out, xv, wb, M=M, N=N, K=K, transpose_b=1, stream=s, workspace=ws)
        assert "_nk16_" in plan.kernel
        return out.to_host(stream=s)

    np.testing.assert_array_equal(run(1), run(0))
