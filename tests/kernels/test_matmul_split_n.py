"""``split_n``: a piece of a weight gets the K split of the whole weight, so its columns match."""

from __future__ import annotations

import numpy as np
import pytest

from ep.device import Device
from ep.errors import KernelArgumentError
from ep.kernels import matmul

F32 = np.dtype(np.float32)
BF16 = matmul._BF16


class _Workspace:
    """Only the sizes `plan_matmul` reads (no buffers: planning allocates nothing)."""

    floats = 1 << 22
    slots = 1 << 16


@pytest.mark.parametrize(("fmt", "dtype"), [("nk", BF16), ("kn", BF16), ("q4", BF16),
                                             ("mx4", F32), ("nk", F32)])  # fmt: skip
def test_a_piece_planned_with_split_n_splits_k_as_the_whole_weight(
    fmt: str, dtype: np.dtype
) -> None:
    ws = _Workspace()
    whole = matmul.plan_matmul(fmt, dtype, M=1, N=151936, K=896, workspace=ws)  # type: ignore[arg-type]
    piece = matmul.plan_matmul(fmt, dtype, M=1, N=2048, K=896, workspace=ws,  # type: ignore[arg-type]
                               split_n=151936)  # fmt: skip
    alone = matmul.plan_matmul(fmt, dtype, M=1, N=2048, K=896, workspace=ws)  # type: ignore[arg-type]
    assert (piece.kw, piece.gy) == (whole.kw, whole.gy)
    assert piece.grid[0] < whole.grid[0]  # only the piece's column groups are launched
    # the negative oracle: without split_n a piece splits K its own way (other arithmetic)
    assert (alone.kw, alone.gy) != (whole.kw, whole.gy)


@pytest.mark.parametrize("bad", [100, 0, True, 2.5])
def test_split_n_must_cover_the_piece(bad: object) -> None:
    with pytest.raises(KernelArgumentError, match="split_n"):
        matmul.plan_matmul("nk", F32, M=1, N=128, K=64, split_n=bad)  # type: ignore[arg-type]


def test_pieces_with_split_n_equal_the_whole_product(device: Device) -> None:
    s = device.default_stream
    rng = np.random.default_rng()
    m, n_all, k = 3, 320, 96
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((n_all, k)).astype(np.float32)
    ws = matmul.matmul_workspace(device, stream=s)
    xb = device.to_device(x, stream=s)
    whole = device.alloc((m, n_all), np.float32, stream=s)
    matmul.gemm(device, whole, xb, device.to_device(w, stream=s), M=m, N=n_all, K=k,
                transpose_b=1, stream=s, workspace=ws)  # fmt: skip
    parts = []
    for n0 in range(0, n_all, 128):
        n1 = min(n0 + 128, n_all)
        out = device.alloc((m, n1 - n0), np.float32, stream=s)
        piece = device.to_device(np.ascontiguousarray(w[n0:n1]), stream=s)
        matmul.gemm(device, out, xb, piece, M=m, N=n1 - n0, K=k, transpose_b=1, stream=s,
                    workspace=ws, split_n=n_all)  # fmt: skip
        parts.append(out.to_host(stream=s))
    assert np.array_equal(np.concatenate(parts, axis=1), whole.to_host(stream=s))
