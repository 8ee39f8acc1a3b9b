"""The FP8 GEMV's read pattern with no arithmetic: how fast its bytes stream in its own order.

`ep_gemv_q4f8` and `ep_gemv_mx4f8` (the .cu file's ``f8_run``) read a weight in steps of
2 KiB (64 rows x 64 k of 4-bit codes: 512 bytes for each warp of a warpgroup) and a step's
scales (256 bytes for q4f8's bf16, 128 for mx4f8's E8M0); a warpgroup walks its own tiles of
S steps (S = K / 64), each warp keeping D steps in flight, B blocks an SM. This script times
kernels that read exactly those bytes in that order and do nothing else (a checksum of every
word, compared with NumPy's), as tools/bench_kernels.py times the GEMVs: a CUDA graph of
launches over copies of the weight that together exceed the L2, each launch's first loads
issued before its programmatic-dependent-launch wait. Each is reported as a fraction of the
device-to-device copy bandwidth measured in the same run: what the GEMV would reach if its
arithmetic, its staging of x and its stores cost nothing.

Rings (``--rings``): ``dDbB`` as the GEMVs name them (blocks of warps as
`ep.kernels.mx4f8.block_warps` says: 24 at B = 1, else 8). Orders (``--orders``): ``tiles``
(each warpgroup's tiles contiguous, the GEMVs' order) and ``round-robin`` (warpgroup j reads
tiles j, j + W, j + 2W, ... of W warpgroups). Streams (``--stream``): ``q4f8`` (weights, then
bf16 scales), ``mx4f8`` (E8M0 scales), ``weights`` (no scales).

    python3 tools/bench_read_pattern.py                 # q4f8 at 896 x 151936, default rings
    python3 tools/bench_read_pattern.py --stream mx4f8 --rings d8b3,d8b1 --orders tiles
    python3 tools/bench_read_pattern.py --device cpu --shape 896x4096 --reps 1   # smoke run
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
for _path in (ROOT, ROOT / "tools"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from bench_kernels import Timing, copy_bandwidth, machine_info, time_graph  # noqa: E402

from ep.device import KERNELS, Device, KernelSource, get_device, register_kernel  # noqa: E402
from ep.kernels.matmul import sm_count  # noqa: E402
from ep.kernels.mx4f8 import block_warps  # noqa: E402

STEP = 2048  # weight bytes of a warpgroup's step
SCALE_WORDS = {"q4f8": 16, "mx4f8": 8, "weights": 0}  # u32 scale words of a warp's step
ORDERS = ("tiles", "round-robin")
DEFAULT_RINGS = "d8b2,d8b3,d12b2,d6b4"

# One kernel per (ring, order, stream): `register` puts its name and its constants before it: D
# (steps a warp in flight), WARPS (a block's), B (blocks an SM), RR (1: round-robin tiles) and SW
# (scale words a warp's step).
SOURCE = r"""
__device__ __forceinline__ uint4 rp_load(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

extern "C" __global__ void __launch_bounds__(WARPS * 32, B)
NAME(const uint4* __restrict__ w, const unsigned* __restrict__ sc, int T, int S, unsigned* sum) {
  const int lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3;
  const int wgs = gridDim.x * (WARPS / 4), wg = blockIdx.x * (WARPS / 4) + (threadIdx.x >> 7);
  int tile, count, hop;  // the first tile, the tiles, the next tile's distance
  if (RR) {
    tile = wg;
    count = wg < T ? (T - 1 - wg) / wgs + 1 : 0;
    hop = wgs;
  } else {
    tile = (int)((long long)wg * T / wgs);
    count = (int)((long long)(wg + 1) * T / wgs) - tile;
    hop = 1;
  }
  const int total = count * S;  // steps of this warpgroup
  const uint4* wp = w + warp * 32 + lane;
  const bool counted = SW > 0 && lane < SW;  // the lanes whose scale word goes into the sum
  const unsigned* sp = sc + warp * SW + (SW > 0 ? lane % (SW > 0 ? SW : 1) : 0);
  int step = 0;  // the step in its tile of the next load
  auto next = [&]() -> size_t {  // the next load's step of the weight, then move on
    const size_t at = (size_t)tile * S + step;
    if (++step == S) {
      step = 0;
      tile += hop;
    }
    return at;
  };
  uint4 r[D];
  unsigned rs[D];
#pragma unroll
  for (int d = 0; d < D; ++d) {
    const size_t at = next();
    r[d] = d < total ? rp_load(wp + at * 128) : make_uint4(0u, 0u, 0u, 0u);
    rs[d] = SW > 0 && d < total ? __ldg(sp + at * 4 * SW) : 0u;
  }
  EP_PDL_WAIT();
  unsigned acc = 0u;
  for (int s0 = 0; s0 < total; s0 += D) {
#pragma unroll
    for (int d = 0; d < D; ++d) {
      acc += r[d].x + r[d].y + r[d].z + r[d].w + (counted ? rs[d] : 0u);
      const bool more = s0 + d + D < total;
      const size_t at = next();
      r[d] = more ? rp_load(wp + at * 128) : make_uint4(0u, 0u, 0u, 0u);
      rs[d] = SW > 0 && more ? __ldg(sp + at * 4 * SW) : 0u;
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xFFFFFFFFu, acc, o);
  if (lane == 0) atomicAdd(sum, acc);
}
"""


def parse_ring(ring: str) -> tuple[int, int]:
    """``dDbB`` -> (D steps a warp in flight, B blocks an SM)."""
    try:
        depth, per_sm = (int(v) for v in ring.removeprefix("d").split("b"))
    except ValueError:
        raise ValueError(f"ring {ring!r}: expected dDbB, e.g. d8b2") from None
    if not (1 <= depth <= 32 and 1 <= per_sm <= 8):
        raise ValueError(f"ring {ring!r}: expected 1 <= D <= 32 steps and 1 <= B <= 8 blocks")
    return depth, per_sm


def kernel_name(ring: str, order: str, stream: str) -> str:
    return f"read_pattern_{stream}_{ring}_{order.replace('-', '_')}"


def _twin(
    w: np.ndarray, sc: np.ndarray, T: np.int32, S: np.int32, total: np.ndarray, *, sw: int
) -> None:
    """The NumPy twin: the sum (mod 2^32) of every weight word and every scale word (``sw`` a
    warp's step)."""
    steps = int(T) * int(S)
    words = int(w[: steps * STEP // 4].sum(dtype=np.uint64))
    words += int(sc[: steps * 4 * sw].sum(dtype=np.uint64))
    total[0] = np.uint32((int(total[0]) + words) & 0xFFFFFFFF)


def register(ring: str, order: str, stream: str) -> KernelSource:
    """The kernel of one (ring, order, stream), registered once."""
    depth, per_sm = parse_ring(ring)
    name = kernel_name(ring, order, stream)
    if name in KERNELS.names():
        return KERNELS.get(name)
    sw = SCALE_WORDS[stream]
    constants = (
        f"constexpr int D = {depth}, WARPS = {block_warps(per_sm)}, B = {per_sm}, "
        f"RR = {int(order == 'round-robin')}, SW = {sw};\n"
    )
    return register_kernel(
        KernelSource(
            name=name,
            source=constants + SOURCE.replace("NAME(", f"{name}("),
            params=("u32*", "u32*", "i32", "i32", "u32*"),
            cpu=functools.partial(_twin, sw=sw),
            pdl_wait="kernel",
        )
    )


@dataclass
class Row:
    ring: str
    order: str
    stream: str
    K: int
    N: int
    bytes: int  # weights and scales one launch reads
    blocks: int
    timing: Timing
    bytes_per_s: float
    ratio: float  # over the copy bandwidth


def measure(
    dev: Device, ring: str, order: str, stream: str, shape: tuple[int, int], *, pool_bytes: int,
    reps: int, copy_bps: float,
) -> Row:  # fmt: skip
    """Check one pattern's checksum against NumPy's, then time it as the GEMVs are timed (its
    ratio: over ``copy_bps``)."""
    K, N = shape
    s = dev.default_stream
    T, S = -(-N // 64), -(-K // 64)
    wbytes, sbytes = T * S * STEP, T * S * 4 * SCALE_WORDS[stream] * 4
    rng = np.random.default_rng(7)
    host_w = rng.integers(0, 2**32, wbytes // 4, dtype=np.uint32)
    host_s = rng.integers(0, 2**32, max(sbytes // 4, 1), dtype=np.uint32)
    copies = max(2, -(-pool_bytes // (wbytes + sbytes)))
    pool = [(dev.to_device(host_w, stream=s, name=f"rp.w{c}"),
             dev.to_device(host_s, stream=s, name=f"rp.s{c}")) for c in range(copies)]  # fmt: skip
    total = dev.alloc(1, np.uint32, stream=s, name="rp.sum")
    kernel = dev.kernel(register(ring, order, stream).name)
    kernel.load()
    per_sm = parse_ring(ring)[1]
    warps = block_warps(per_sm)
    blocks = max(1, min(per_sm * sm_count(dev), -(-T // (warps // 4))))

    def launch(i: int) -> None:
        w, sc = pool[i % copies]
        kernel.launch(blocks, 32 * warps, w, sc, T, S, total, stream=s)

    total.copy_from_host(np.zeros(1, np.uint32), stream=s)
    launch(0)
    want = int(host_w.sum(dtype=np.uint64)) + int(host_s[: sbytes // 4].sum(dtype=np.uint64))
    got = int(total.to_host(stream=s)[0])
    if got != want & 0xFFFFFFFF:
        raise SystemExit(
            f"{kernel.name}: checksum {got:#010x}, expected {want & 0xFFFFFFFF:#010x}: the kernel "
            "does not read every word of the weight and its scales exactly once"
        )
    launches = max(copies, 8)

    def record() -> int:
        for i in range(launches):
            launch(i)
        return launches

    timing = time_graph(dev, record, lambda: None, reps)
    for w, sc in pool:
        w.free()
        sc.free()
    total.free()
    rate = (wbytes + sbytes) / (timing.median_ms * 1e-3)
    return Row(ring, order, stream, K, N, wbytes + sbytes, blocks, timing, rate, rate / copy_bps)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--shape", default="896x151936", help="K x N of the weight")
    p.add_argument("--stream", choices=sorted(SCALE_WORDS), default="q4f8")
    p.add_argument("--rings", default=DEFAULT_RINGS, help="dDbB, comma-separated")
    p.add_argument("--orders", default=",".join(ORDERS), help="tiles, round-robin")
    p.add_argument("--reps", type=int, default=20, help="timed graph replays a pattern")
    p.add_argument("--rounds", type=int, default=2, help="times every pattern is measured")
    p.add_argument("--pool-mib", type=int, default=256, help="weight copies per pattern (> L2)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a smoke run")
    p.add_argument("--out", help="folder for read_pattern.json")
    args = p.parse_args(argv)
    try:
        K, N = (int(v) for v in args.shape.lower().split("x"))
        rings = [r for r in args.rings.split(",") if r]
        for ring in rings:
            parse_ring(ring)
    except ValueError as exc:
        p.error(f"--shape {args.shape!r} / --rings {args.rings!r}: {exc}")
    orders = [o for o in args.orders.split(",") if o]
    if not rings or not orders or any(o not in ORDERS for o in orders):
        p.error(f"--orders {args.orders!r}: expected a comma-separated subset of {ORDERS}")
    if K < 64 or N < 64 or args.reps < 1 or args.rounds < 1:
        p.error("--shape needs K, N >= 64; --reps and --rounds at least 1")
    dev = get_device(args.device)
    for ring in rings:  # compiled before any capture
        for order in orders:
            dev.kernel(register(ring, order, args.stream).name).load()
    copy = copy_bandwidth(dev, 1 << 30 if args.device == "cuda" else 1 << 20, reps=20)
    print(f"copy: {copy['bytes_per_s'] / 1e12:.3f} TB/s; {args.stream} stream of {K} x {N}",
          flush=True)  # fmt: skip
    rows: list[Row] = []
    started = time.perf_counter()
    for _ in range(args.rounds):
        for ring in rings:
            for order in orders:
                row = measure(dev, ring, order, args.stream, (K, N), pool_bytes=args.pool_mib << 20,
                              reps=args.reps, copy_bps=copy["bytes_per_s"])  # fmt: skip
                rows.append(row)
                t = row.timing
                spread = f"({t.min_ms * 1e3:.2f}..{t.max_ms * 1e3:.2f})"
                rate = f"{row.bytes_per_s / 1e12:.3f} TB/s  {row.ratio:.3f}"
                print(f"  {ring:6s} {order:11s} {row.blocks:4d} blocks  "
                      f"{t.median_ms * 1e3:7.2f} us {spread}  {rate}", flush=True)  # fmt: skip
    took = time.perf_counter() - started
    print(f"ratio = (bytes read / median launch) / copy bandwidth; {took:.0f} s")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        payload: dict[str, Any] = {"machine": machine_info(dev), "copy": copy,
                                   "rows": [asdict(r) for r in rows]}  # fmt: skip
        (out / "read_pattern.json").write_text(json.dumps(payload, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
