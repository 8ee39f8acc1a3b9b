// The matmul-family kernels of genai-ep (loaded by ep/kernels/matmul.py, which appends one
// extern "C" entry per kernel and documents the launch geometry).
//
//   y[M, N] = x[M, K] @ W^T      W dense [N, K] ("nk"), dense [K, N] ("kn"),
//                                4-bit MatMulNBits blocks ("q4") or OCP MXFP4 blocks ("mx4").
//
// Decode (M <= 16): GEMV kernels that stream every weight byte exactly once per launch for all M
// rows. fp16/bf16 run the products on tensor cores (mma.sync m16n8k16: dense weights as the B
// operand with the M rows padded to 16; dequantized 4-bit/MXFP4 weights as the A operand with
// the M rows padded to 8, or 16 in two MMAs), fp32 on the SIMT cores. K is split over the warps
// of a block (kw) and, with a workspace, over blocks (gy); partial sums are added in a fixed
// order, so results never depend on timing or on M.
// Prefill (M > 16): tiled GEMMs, 64x64 output tiles; tensor cores for fp16/bf16, SIMT for fp32.
// Every kernel accumulates in fp32 and rounds once to the output type.

#include <cuda_fp16.h>
#include <cuda_bf16.h>

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;

#define EPK_W16 1u  // weight rows allow 16-byte loads (aligned base, row stride multiple of 16)
#define EPK_X16 2u  // activation rows allow 16-byte loads
#define EPK_ZP 4u   // q4: packed zero points are given (else every zero point is 8)
#define EPK_W8 8u   // q4/mx4 GEMM: weight base aligned to 8 bytes
#define EPK_EARLY 16u  // GEMV: the weights are resident (no kernel writes them): load them early
#define EPK_E8X 32u    // mx4p: some E8M0 scale is 0 or 255 (decode every scale exactly)

namespace epk {

__device__ __forceinline__ uint4 zero4() { return make_uint4(0u, 0u, 0u, 0u); }

__device__ __forceinline__ u32 word_at(const uint4& v, int i) {
  return i == 0 ? v.x : (i == 1 ? v.y : (i == 2 ? v.z : v.w));
}

// Weights are read once per launch: keep them out of L1 so the activations stay there.
__device__ __forceinline__ uint4 ld_stream(const void* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}

__device__ __forceinline__ uint2 ld_stream8(const void* p) {
  uint2 v;
  asm("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
  return v;
}

__device__ __forceinline__ uint4 ld_cached(const void* p) {
  return __ldg(reinterpret_cast<const uint4*>(p));
}

// 16 bytes at p when ok, else zeros, as one predicated load (no branch); volatile so the
// compiler keeps the program order (the dense GEMV v2 ring issues each refill right after its
// MMAs). `LD` is the PTX load: `ld_stream_if` reads weights once (.nc, no L1 allocation).
#define EPK_LD_IF(NAME, LD)                                                                   \
  __device__ __forceinline__ uint4 NAME(const void* p, bool ok) {                              \
    uint4 v;                                                                                   \
    asm volatile(                                                                              \
        "{\n\t.reg .pred q;\n\tsetp.ne.b32 q, %5, 0;\n\t"                                  \
        "mov.b32 %0, 0;\n\tmov.b32 %1, 0;\n\tmov.b32 %2, 0;\n\tmov.b32 %3, 0;\n\t"         \
        "@q " LD ".v4.u32 {%0, %1, %2, %3}, [%4];\n\t}"                                        \
        : "=&r"(v.x), "=&r"(v.y), "=&r"(v.z), "=&r"(v.w)                                       \
        : "l"(p), "r"((int)ok));                                                               \
    return v;                                                                                  \
  }
EPK_LD_IF(ld_stream_if, "ld.global.nc.L1::no_allocate")
// The split-K GEMV's FULL path loads with coherent loads: ptxas moves .nc loads across
// griddepcontrol.wait (it sank the early weight loads below it, seen in the sm_90 SASS), and an
// activation must not be read before the wait; coherent loads keep their place around it.
EPK_LD_IF(ld_weight_if, "ld.global.L1::no_allocate")
EPK_LD_IF(ld_act_if, "ld.global")
#undef EPK_LD_IF

// 4 bytes at p when ok, else 0, as one predicated read-only load (volatile: kept in place).
__device__ __forceinline__ u32 ld_u32_if(const void* p, bool ok) {
  u32 v;
  asm volatile(
      "{\n\t.reg .pred q;\n\tsetp.ne.b32 q, %2, 0;\n\tmov.b32 %0, 0;\n\t"
      "@q ld.global.nc.u32 %0, [%1];\n\t}"
      : "=&r"(v)
      : "l"(p), "r"((int)ok));
  return v;
}

// 8 bytes at p when ok, else 0, as one predicated read-only load (volatile: kept in place).
__device__ __forceinline__ uint2 ld_u64_if(const void* p, bool ok) {
  uint2 v;
  asm volatile(
      "{\n\t.reg .pred q;\n\tsetp.ne.b32 q, %3, 0;\n\tmov.b32 %0, 0;\n\tmov.b32 %1, 0;\n\t"
      "@q ld.global.nc.v2.u32 {%0, %1}, [%2];\n\t}"
      : "=&r"(v.x), "=&r"(v.y)
      : "l"(p), "r"((int)ok));
  return v;
}

// 2 bytes at p when ok, else 0, as one predicated read-only load (volatile: kept in place).
__device__ __forceinline__ u32 ld_u16_if(const void* p, bool ok) {
  unsigned short v;
  asm volatile(
      "{\n\t.reg .pred q;\n\tsetp.ne.b32 q, %2, 0;\n\tmov.b16 %0, 0;\n\t"
      "@q ld.global.nc.u16 %0, [%1];\n\t}"
      : "=&h"(v)
      : "l"(p), "r"((int)ok));
  return v;
}

// log2 of a split-K GEMV's warps per K split (kw: 1, 2, 4 or 8, a power of two), so that the
// block's group and slice of a warp are shifts, not integer divisions.
__device__ __forceinline__ int log2_kw(int kw) { return 31 - __clz(kw); }

// A split-K GEMV warp's output group (8 / kw groups a block of 8 warps) and K slice (kw a
// group, gy blocks along K: blockIdx.y).
struct WarpSplit {
  int group, slice;
  __device__ __forceinline__ explicit WarpSplit(int kw) {
    const int ks = log2_kw(kw), warp = (int)(threadIdx.x >> 5);
    group = (blockIdx.x << (3 - ks)) + (warp >> ks);
    slice = blockIdx.y * kw + (warp & (kw - 1));
  }
};

// Programmatic dependent launch (ep/device/_kernels.py): the split-K GEMVs are compiled with
// pdl_wait = "kernel" and wait for the previous kernel of their stream themselves. With
// EPK_EARLY (resident weights, which nothing in the stream writes) each thread issues its first
// round of weight loads, then waits, so those loads overlap the previous kernel; else it waits
// first. Either way every thread waits once before it reads x or writes anything.
struct PdlWait {
  bool pending;
  __device__ __forceinline__ explicit PdlWait(u32 flags) : pending((flags & EPK_EARLY) != 0u) {
    if (!pending) EP_PDL_WAIT();
  }
  __device__ __forceinline__ void operator()() {
    if (pending) {
      EP_PDL_WAIT();
      pending = false;
    }
  }
};

// --- element types ---------------------------------------------------------------------------

template <typename T>
struct Elem;

template <>
struct Elem<float> {
  typedef u32 Bits;
  static constexpr int kVec = 4;  // elements per 16 bytes
  __device__ static float from_f(float v) { return v; }
  __device__ static float to_f(float v) { return v; }
};

template <>
struct Elem<__half> {
  typedef u16 Bits;
  static constexpr int kVec = 8;
  static constexpr u32 kMagic = 0x6400u;  // 1024.0: the bits 0x6400 | q are 1024 + q exactly
  __device__ static __half from_f(float v) { return __float2half_rn(v); }
  __device__ static float to_f(__half v) { return __half2float(v); }
};

template <>
struct Elem<__nv_bfloat16> {
  typedef u16 Bits;
  static constexpr int kVec = 8;
  static constexpr u32 kMagic = 0x4300u;  // 128.0: the bits 0x4300 | q are 128 + q exactly
  __device__ static __nv_bfloat16 from_f(float v) { return __float2bfloat16_rn(v); }
  __device__ static float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }
};

// Packed pair arithmetic on two 16-bit floats in one register (low half = lower k).
template <typename T>
__device__ __forceinline__ u32 pk_sub(u32 a, u32 b);
template <typename T>
__device__ __forceinline__ u32 pk_mul(u32 a, u32 b);

template <>
__device__ __forceinline__ u32 pk_sub<__half>(u32 a, u32 b) {
  u32 r;
  asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}
template <>
__device__ __forceinline__ u32 pk_mul<__half>(u32 a, u32 b) {
  u32 r;
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}
// bf16x2 add, sub and mul are sm_90 instructions; before it the same single rounding is an FMA:
// a - b = fma(b, -1, a), a * b = fma(a, b, -0) (-0 keeps the sign of a zero product).
template <>
__device__ __forceinline__ u32 pk_sub<__nv_bfloat16>(u32 a, u32 b) {
  u32 r;
#if __CUDA_ARCH__ >= 900
  asm("sub.rn.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
#else
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(b), "r"(0xBF80BF80u), "r"(a));
#endif
  return r;
}
template <>
__device__ __forceinline__ u32 pk_mul<__nv_bfloat16>(u32 a, u32 b) {
  u32 r;
#if __CUDA_ARCH__ >= 900
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
#else
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(0x80008000u));
#endif
  return r;
}

// c[4] += A(16x16, row) * B(16x8, col); fragment layout as in the PTX ISA for m16n8k16.
template <typename T>
__device__ __forceinline__ void mma16816(float (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0,
                                         u32 b1);

template <>
__device__ __forceinline__ void mma16816<__half>(float (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3,
                                                 u32 b0, u32 b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

template <>
__device__ __forceinline__ void mma16816<__nv_bfloat16>(float (&c)[4], u32 a0, u32 a1, u32 a2,
                                                        u32 a3, u32 b0, u32 b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// 16 bytes of T from row[k0..] (elements at k >= len read as zero). `vec` says the 16-byte load
// is aligned; a chunk that crosses `len`, or any chunk when `vec` is false, is read element-wise
// by an out-of-line function, so the unrolled hot loops stay small.
template <typename T>
__device__ __noinline__ uint4 load_chunk_slow(const T* row, int k0, int len) {
  typedef typename Elem<T>::Bits B;
  const B* r = reinterpret_cast<const B*>(row);
  u32 o[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    if (sizeof(T) == 4) {
      o[e] = (k0 + e < len) ? (u32)r[k0 + e] : 0u;
    } else {
      const u32 lo = (k0 + 2 * e < len) ? (u32)r[k0 + 2 * e] : 0u;
      const u32 hi = (k0 + 2 * e + 1 < len) ? (u32)r[k0 + 2 * e + 1] : 0u;
      o[e] = lo | (hi << 16);
    }
  }
  return make_uint4(o[0], o[1], o[2], o[3]);
}

template <typename T>
__device__ __forceinline__ uint4 load_chunk(const T* row, int k0, int len, bool vec, bool stream) {
  if (vec && k0 + Elem<T>::kVec <= len) return stream ? ld_stream(row + k0) : ld_cached(row + k0);
  return load_chunk_slow<T>(row, k0, len);
}

// 16 bytes of a byte row starting at `off`, bytes at or past `len` read as zero (any alignment).
__device__ __noinline__ uint4 load_bytes(const u8* row, int off, int len) {
  u32 o[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    u32 v = 0;
#pragma unroll
    for (int b = 0; b < 4; ++b) {
      const int at = off + 4 * e + b;
      if (at < len) v |= (u32)row[at] << (8 * b);
    }
    o[e] = v;
  }
  return make_uint4(o[0], o[1], o[2], o[3]);
}

template <typename T>
__device__ __forceinline__ u32 scale_bits(const T* scales, size_t i) {
  return (u32) reinterpret_cast<const typename Elem<T>::Bits*>(scales)[i];
}

// --- 4-bit decoding --------------------------------------------------------------------------

// MatMulNBits: the 8 nibbles of `w` (k = 0..7, element 2i low nibble of byte i) as four pairs
// ((q - zp) * s) of T, pair j = (k 2j, k 2j+1). `s2` holds the scale in both halves, `z2` the
// bits of (magic + zero point) in both halves. Each nibble lands in the low byte of a half whose
// high byte is the magic exponent byte: the half is then magic + q exactly, no convert needed.
template <typename T>
__device__ __forceinline__ void q4_pairs(u32 w, u32 s2, u32 z2, u32 (&p)[4]) {
  const u32 magic = (Elem<T>::kMagic >> 8) * 0x01010101u;
  const u32 lo = w & 0x0F0F0F0Fu;         // q0 q2 q4 q6
  const u32 hi = (w >> 4) & 0x0F0F0F0Fu;  // q1 q3 q5 q7
  const u32 e0 = __byte_perm(lo, hi, 0x5140u);  // q0 q1 q2 q3
  const u32 e1 = __byte_perm(lo, hi, 0x7362u);  // q4 q5 q6 q7
  p[0] = __byte_perm(e0, magic, 0x4140u);  // q0 M q1 M
  p[1] = __byte_perm(e0, magic, 0x4342u);
  p[2] = __byte_perm(e1, magic, 0x4140u);
  p[3] = __byte_perm(e1, magic, 0x4342u);
#pragma unroll
  for (int j = 0; j < 4; ++j) p[j] = pk_mul<T>(pk_sub<T>(p[j], z2), s2);
}

// OCP E2M1: the 8 codes of `w` as four pairs of bf16 bits (exact). The magnitudes come from
// byte tables held in two registers each (prmt), the sign bit is moved to bit 15 of each half.
__device__ __forceinline__ void e2m1_pairs_bf16(u32 w, u32 (&p)[4]) {
  const u32 mag = w & 0x77777777u;
  // codes 0..7 = 0, 0.5, 1, 1.5, 2, 3, 4, 6: bf16 0000 3F00 3F80 3FC0 4000 4040 4080 40C0
  u32 h0 = __byte_perm(0x3F3F3F00u, 0x40404040u, mag);
  u32 h1 = __byte_perm(0x3F3F3F00u, 0x40404040u, mag >> 16);
  const u32 l0 = __byte_perm(0xC0800000u, 0xC0804000u, mag);
  const u32 l1 = __byte_perm(0xC0800000u, 0xC0804000u, mag >> 16);
  const u32 r0 = __byte_perm(w, 0u, 0x1100u);  // bytes b0 b0 b1 b1: signs at bits 3,15,19,31
  const u32 r1 = __byte_perm(w, 0u, 0x3322u);
  h0 |= ((r0 << 4) & 0x00800080u) | (r0 & 0x80008000u);
  h1 |= ((r1 << 4) & 0x00800080u) | (r1 & 0x80008000u);
  p[0] = __byte_perm(l0, h0, 0x5140u);
  p[1] = __byte_perm(l0, h0, 0x7362u);
  p[2] = __byte_perm(l1, h1, 0x5140u);
  p[3] = __byte_perm(l1, h1, 0x7362u);
}

// The same as fp16 bits: every E2M1 magnitude has a zero low byte in fp16.
__device__ __forceinline__ void e2m1_pairs_f16(u32 w, u32 (&p)[4]) {
  const u32 mag = w & 0x77777777u;
  // fp16 0000 3800 3C00 3E00 4000 4200 4400 4600
  u32 h0 = __byte_perm(0x3E3C3800u, 0x46444240u, mag);
  u32 h1 = __byte_perm(0x3E3C3800u, 0x46444240u, mag >> 16);
  const u32 r0 = __byte_perm(w, 0u, 0x1100u);
  const u32 r1 = __byte_perm(w, 0u, 0x3322u);
  h0 |= ((r0 << 4) & 0x00800080u) | (r0 & 0x80008000u);
  h1 |= ((r1 << 4) & 0x00800080u) | (r1 & 0x80008000u);
  p[0] = __byte_perm(h0, 0u, 0x1404u);
  p[1] = __byte_perm(h0, 0u, 0x3424u);
  p[2] = __byte_perm(h1, 0u, 0x1404u);
  p[3] = __byte_perm(h1, 0u, 0x3424u);
}

template <typename T>
__device__ __forceinline__ void e2m1_pairs(u32 w, u32 (&p)[4]);
template <>
__device__ __forceinline__ void e2m1_pairs<__half>(u32 w, u32 (&p)[4]) {
  e2m1_pairs_f16(w, p);
}
template <>
__device__ __forceinline__ void e2m1_pairs<__nv_bfloat16>(u32 w, u32 (&p)[4]) {
  e2m1_pairs_bf16(w, p);
}

// E8M0: 2^(e - 127); 255 is NaN.
__device__ __forceinline__ float e8m0_f32(u32 e) {
  return e == 255u ? __uint_as_float(0x7FC00000u)
                   : (e == 0u ? __uint_as_float(0x00400000u) : __uint_as_float(e << 23));
}

template <typename T>
__device__ __forceinline__ u32 e8m0_bits(u32 e);
template <>
__device__ __forceinline__ u32 e8m0_bits<__nv_bfloat16>(u32 e) {
  return e == 255u ? 0x7FC0u : (e == 0u ? 0x0040u : (e << 7));
}
template <>
__device__ __forceinline__ u32 e8m0_bits<__half>(u32 e) {
  return (u32)__half_as_ushort(__float2half_rn(e8m0_f32(e)));
}

// --- weight rows (GEMV policies) ---------------------------------------------------------------
//
// A lane works on one row n and, per step i, one 16-byte chunk of it; the 4 lanes of a row cover
// consecutive chunks. A chunk yields kUnits units of 8 consecutive k: `pairs` gives a unit as 4
// pairs of T (tensor-core path), `floats` as 8 floats (fp32 path); unit_k is its first k.

template <typename T>
struct DenseRows {  // W [N, K]
  const T* w;
  int K;
  bool vec;
  static constexpr int kUnits = 1;
  struct Raw {
    uint4 a, b;  // b: the second 4 floats of an fp32 unit
  };
  __device__ int steps() const { return (K + 31) >> 5; }
  __device__ int unit_k(int i, int t, int) const { return (i << 5) + (t << 3); }
  __device__ Raw load(int n, int i, int t) const {
    const T* row = w + (size_t)n * (size_t)K;
    const int k0 = unit_k(i, t, 0);
    Raw r;
    r.a = load_chunk<T>(row, k0, K, vec, true);
    r.b = sizeof(T) == 4 ? load_chunk<T>(row, k0 + 4, K, vec, true) : zero4();
    return r;
  }
  __device__ static Raw none() { return Raw{zero4(), zero4()}; }
  // `load` when every step's chunks are in range and 16-byte aligned (the GEMV's FULL path:
  // EPK_W16 and K % 32 == 0): predicated loads, no bounds checks; zeros when !ok.
  __device__ Raw load_full(int n, int i, int t, bool ok) const {
    const T* at = w + (size_t)n * (size_t)K + unit_k(i, t, 0);
    Raw r;
    r.a = ld_weight_if(at, ok);
    r.b = sizeof(T) == 4 ? ld_weight_if(at + 4, ok) : zero4();
    return r;
  }
  __device__ void pairs(const Raw& r, int, u32 (&p)[4]) const {
    p[0] = r.a.x;
    p[1] = r.a.y;
    p[2] = r.a.z;
    p[3] = r.a.w;
  }
  __device__ void floats(const Raw& r, int, float (&v)[8]) const {
    v[0] = __uint_as_float(r.a.x);
    v[1] = __uint_as_float(r.a.y);
    v[2] = __uint_as_float(r.a.z);
    v[3] = __uint_as_float(r.a.w);
    v[4] = __uint_as_float(r.b.x);
    v[5] = __uint_as_float(r.b.y);
    v[6] = __uint_as_float(r.b.z);
    v[7] = __uint_as_float(r.b.w);
  }
};

template <typename T>
struct Q4Rows {  // MatMulNBits: b [N, kb, bs/2], scales [N * kb] of T, zero points [N, ceil(kb/2)]
  const u8* b;
  const T* scales;
  const u8* zp;
  int kb, row_bytes, zp_row, bs_shift;
  bool vec, has_zp;
  static constexpr int kUnits = 4;
  struct Raw {
    uint4 q;
    // The blocks of units 0-1 and of units 2-3 (the same block unless block_size is 16):
    // fp16/bf16: scale bits and (magic | zero point) bits, each in both halves;
    // fp32: scale bits and the zero point.
    u32 s0, s1, z0, z1;
  };
  __device__ int steps() const { return (row_bytes + 63) >> 6; }
  __device__ int unit_k(int i, int t, int u) const { return (i << 7) + (t << 5) + (u << 3); }
  __device__ u32 zero_point(int n, int blk) const {
    if (!has_zp) return 8u;
    const u32 byte = zp[(size_t)n * (size_t)zp_row + (blk >> 1)];
    return (blk & 1) ? (byte >> 4) : (byte & 15u);
  }
  __device__ static u32 pack_s(u32 s) { return sizeof(T) == 4 ? s : s * 0x10001u; }
  __device__ static u32 pack_z(u32 z) {
    if constexpr (sizeof(T) == 4) {
      return z;
    } else {
      return (Elem<T>::kMagic | z) * 0x10001u;
    }
  }
  __device__ Raw load(int n, int i, int t) const {
    const int off = ((i << 2) + t) << 4;
    if (off >= row_bytes) return none();  // zero scales: the padding decodes to exact zeros
    const u8* row = b + (size_t)n * (size_t)row_bytes;
    Raw r;
    r.q = vec ? ld_stream(row + off) : load_bytes(row, off, row_bytes);
    const int blk0 = (off << 1) >> bs_shift;  // k of the chunk's first unit, in blocks
    const size_t base = (size_t)n * (size_t)kb;
    r.s0 = pack_s(scale_bits<T>(scales, base + blk0));
    r.z0 = pack_z(zero_point(n, blk0));
    if (bs_shift >= 5) {  // blocks of >= 32: the chunk's 32 weights share one block
      r.s1 = r.s0;
      r.z1 = r.z0;
    } else if (blk0 + 1 < kb) {  // blocks of 16: units 2-3 are in the next block
      r.s1 = pack_s(scale_bits<T>(scales, base + blk0 + 1));
      r.z1 = pack_z(zero_point(n, blk0 + 1));
    } else {  // a half chunk at the end of the row
      r.s1 = 0u;
      r.z1 = pack_z(8u);
    }
    return r;
  }
  __device__ static Raw none() { return Raw{zero4(), 0u, 0u, pack_z(8u), pack_z(8u)}; }
  __device__ void pairs(const Raw& r, int u, u32 (&p)[4]) const {
    q4_pairs<T>(word_at(r.q, u), u < 2 ? r.s0 : r.s1, u < 2 ? r.z0 : r.z1, p);
  }
  __device__ void floats(const Raw& r, int u, float (&v)[8]) const {
    const float s = __uint_as_float(u < 2 ? r.s0 : r.s1);
    const float z = 8388608.0f + (float)(u < 2 ? r.z0 : r.z1);
    const u32 w = word_at(r.q, u);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      // 0x4B000000 | q is 2^23 + q exactly; subtracting 2^23 + zp leaves q - zp exactly.
      v[j] = (__uint_as_float(0x4B000000u | ((w >> (4 * j)) & 15u)) - z) * s;
    }
  }
};

template <typename T>
struct Mx4Rows {  // MXFP4: b [N, K/32, 16], scales [N, K/32] E8M0
  const u8* b;
  const u8* scales;
  int kb, row_bytes;
  bool vec;
  static constexpr int kUnits = 4;
  struct Raw {
    uint4 q;
    u32 e;  // the chunk's scale (a 16-byte chunk is exactly one MX block): fp16/bf16 bits in
            // both halves, or for fp32 the E8M0 byte
  };
  __device__ int steps() const { return (row_bytes + 63) >> 6; }
  __device__ int unit_k(int i, int t, int u) const { return (i << 7) + (t << 5) + (u << 3); }
  __device__ Raw load(int n, int i, int t) const {
    const int c = (i << 2) + t;
    if ((c << 4) >= row_bytes) return none();
    const u8* row = b + (size_t)n * (size_t)row_bytes;
    Raw r;
    r.q = vec ? ld_stream(row + (c << 4)) : load_bytes(row, c << 4, row_bytes);
    const u32 e = scales[(size_t)n * (size_t)kb + c];
    if constexpr (sizeof(T) == 4) {
      r.e = e;
    } else {
      r.e = e8m0_bits<T>(e) * 0x10001u;
    }
    return r;
  }
  __device__ static Raw none() { return Raw{zero4(), 0u}; }  // codes 0 and scale 0: zeros
  __device__ void pairs(const Raw& r, int u, u32 (&p)[4]) const {
    e2m1_pairs<T>(word_at(r.q, u), p);
#pragma unroll
    for (int j = 0; j < 4; ++j) p[j] = pk_mul<T>(p[j], r.e);
  }
  __device__ void floats(const Raw& r, int u, float (&v)[8]) const {
    const float s = e8m0_f32(r.e);
    u32 p[4];
    e2m1_pairs_bf16(word_at(r.q, u), p);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      v[2 * j] = __uint_as_float(p[j] << 16) * s;
      v[2 * j + 1] = __uint_as_float(p[j] & 0xFFFF0000u) * s;
    }
  }
};

// --- GEMV output columns: plain, or gate/up pairs for a SwiGLU epilogue ----------------------
//
// A split-K GEMV block owns groups of COLS output columns (8 for row_gemv, 16 for row_gemv_wt).
// `PlainCols`: column n is weight row n, y is [M, N]. `SwigluCols<COLS>` (the
// `ep_gemv_<fmt>_swiglu_<dt>` kernels): y = silu(gate) * up of a packed gate/up weight, computed
// without the packed product ever reaching memory. Column n of the launch is, within its group
// of COLS, gate output j (first half) or up output j (second half) of the same j = (n / COLS) *
// (COLS / 2) + n % (COLS / 2), so both halves of a pair are finished by one block. Weight row of
// gate j: j * stride, of up j: j * stride + up ([gate | up] halves: stride 1, up = inter;
// interleaved g0, u0, g1, ...: stride 2, up = 1). Each sum is rounded to T first, then
// silu_mul and rounded again: bitwise the GEMV's y followed by the SwiGLUPacked kernel
// (`ep.kernels.mlp` compiles the same silu_mul). A row's sums are those of the plain GEMV at the
// same kw and gy (the plan keeps them), so the K split and the arithmetic are unchanged.
// A map with kPairs stores each pair through its store(y, m, n, sum_n, sum_n+H); one with
// kTokens also has tokens(M), run once a launch by block (0, 0). `RopeCols` (the QKV
// projection's rotary/KV-commit epilogue) is defined with its device code in attention.py.

struct PlainCols {
  int N;
  static constexpr bool kPairs = false;
  static constexpr bool kTokens = false;
  __device__ __forceinline__ int row(int n) const { return n; }
  __device__ __forceinline__ bool ok(int n) const { return n < N; }
};

template <int COLS>
struct SwigluCols {
  int inter, stride, up;
  static constexpr bool kPairs = true;
  static constexpr bool kTokens = false;
  static constexpr int H = COLS / 2;
  __device__ __forceinline__ int out(int n) const { return (n / COLS) * H + n % H; }
  __device__ __forceinline__ int row(int n) const {
    return out(n) * stride + ((n % COLS) >= H ? up : 0);
  }
  __device__ __forceinline__ bool ok(int n) const { return out(n) < inter; }
  // Row m's pair (gate column n, up column n + H) with float sums gate, upv.
  template <typename T>
  __device__ __forceinline__ void store(T* __restrict__ y, int m, int n, float gate,
                                        float upv) const {
    const float g = Elem<T>::to_f(Elem<T>::from_f(gate));
    const float u = Elem<T>::to_f(Elem<T>::from_f(upv));
    y[(size_t)m * inter + out(n)] = Elem<T>::from_f(silu_mul(g, u));
  }
};

// --- GEMV: the reduction shared by every GEMV ----------------------------------------------
//
// Block = 8 warps. Warp w works on output group (w / kw) of the block and K slice (w % kw);
// red[w][m][c] holds its partial sums for the group's COLS columns. The block adds its kw slices
// in order; with gy > 1 each block (blockIdx.y = its K range) writes its sum to the workspace
// [gy, M, N] and the last block to arrive adds the gy partial sums in order, writes y and resets
// its counter to zero for the next launch. With `SwigluCols` y is [M, inter] and each pair of
// columns becomes one output (above).

template <typename T, int COLS, class C>
__device__ __forceinline__ void gemv_finish(float (*red)[16][COLS], T* __restrict__ y, float* ws,
                                            u32* counters, int M, int N, int kw, int gy,
                                            const C& oc) {
  __shared__ u32 s_last;
  if constexpr (C::kTokens) {  // once a launch, by any one block: per-token work (RopeCols)
    if (blockIdx.x == 0 && blockIdx.y == 0) oc.tokens(M);
  }
  __syncthreads();
  constexpr int LC = COLS == 8 ? 3 : (COLS == 16 ? 4 : 6);  // log2(COLS)
  static_assert((1 << LC) == COLS, "COLS is 8, 16 or 64");
  const int lc = 3 - log2_kw(kw) + LC;  // log2(cols): the block's output columns
  const int cols = 1 << lc;
  const int nb = blockIdx.x * cols;
  const int total = M * cols;
  if constexpr (C::kPairs) {
    if (gy == 1) {
      constexpr int H = COLS / 2;
      for (int e = threadIdx.x; e < total / 2; e += blockDim.x) {
        const int m = e >> (lc - 1), pl = e & (cols / 2 - 1);
        const int grp = pl >> (LC - 1), col = pl & (H - 1);
        const int n = nb + grp * COLS + col;  // the gate column; up is n + H
        if (!oc.ok(n)) continue;
        float sg = 0.0f, su = 0.0f;
        for (int q = 0; q < kw; ++q) sg += red[grp * kw + q][m][col];
        for (int q = 0; q < kw; ++q) su += red[grp * kw + q][m][col + H];
        oc.template store<T>(y, m, n, sg, su);
      }
      return;
    }
  }
  for (int e = threadIdx.x; e < total; e += blockDim.x) {
    const int m = e >> lc, cl = e & (cols - 1);
    const int grp = cl >> LC, col = cl & (COLS - 1);
    const int n = nb + cl;
    if (!oc.ok(n)) continue;
    float s = 0.0f;
    for (int q = 0; q < kw; ++q) s += red[grp * kw + q][m][col];
    if (gy == 1) {
      y[(size_t)m * N + n] = Elem<T>::from_f(s);
    } else {
      ws[((size_t)blockIdx.y * M + m) * N + n] = s;
    }
  }
  if (gy == 1) return;
  __threadfence();  // this block's partial sums are visible before it is counted
  __syncthreads();
  if (threadIdx.x == 0) s_last = atomicAdd(&counters[blockIdx.x], 1u) == (u32)(gy - 1) ? 1u : 0u;
  __syncthreads();
  if (!s_last) return;
  __threadfence();
  if constexpr (C::kPairs) {
    constexpr int H = COLS / 2;
    for (int e = threadIdx.x; e < total / 2; e += blockDim.x) {
      const int m = e >> (lc - 1), pl = e & (cols / 2 - 1);
      const int n = nb + (pl >> (LC - 1)) * COLS + (pl & (H - 1));
      if (!oc.ok(n)) continue;
      float sg = 0.0f, su = 0.0f;
      for (int b = 0; b < gy; ++b) sg += __ldcg(&ws[((size_t)b * M + m) * N + n]);
      for (int b = 0; b < gy; ++b) su += __ldcg(&ws[((size_t)b * M + m) * N + n + H]);
      oc.template store<T>(y, m, n, sg, su);
    }
  } else {
    for (int e = threadIdx.x; e < total; e += blockDim.x) {
      const int m = e >> lc, cl = e & (cols - 1);
      const int n = nb + cl;
      if (n >= N) continue;
      float s = 0.0f;
      for (int b = 0; b < gy; ++b) s += __ldcg(&ws[((size_t)b * M + m) * N + n]);
      y[(size_t)m * N + n] = Elem<T>::from_f(s);
    }
  }
  if (threadIdx.x == 0) counters[blockIdx.x] = 0u;
}

// --- GEMV over weight rows (dense nk on fp16/bf16; nk, q4, mx4 on fp32) ----------------------
//
// Lane l: g = l / 4 is the row within the warp's group of 8 rows, t = l % 4 the chunk within a
// step. Tensor-core path: the unit's 4 weight pairs are the B fragment of two m16n8k16 MMAs (B
// column g = row n, B rows 2t, 2t+1, 2t+8, 2t+9 = the unit's k 0-1, 2-3 (first MMA) and 4-5, 6-7
// (second)); x rows g and g + 8 at the same 8 k are the A fragment, so the k order inside an MMA
// is a permutation that A and B share, and each lane loads its weights as one 16-byte vector.
// fp32 path: each lane multiplies its 8 weights with the 8 x of every row m, then the 4 lanes of
// a row are added with two shuffles.
//
// FULL (dense weights only: `DenseRows::load_full`): weights and x 16-byte aligned and K % 32 ==
// 0, so no chunk of a step is partial: every load is one predicated instruction (no bounds
// checks, no branches around them), and at M <= 8 the x chunks of a round are loaded at once;
// TWO (FULL only): M > 8, x rows g + 8 too, a step at a time, or with AHEAD2 (``ep_gemv_nk16``,
// a kernel of its own: 2 U more chunks in registers, bounded to 3 blocks an SM) the round's
// chunks of both rows at once. The loaded bytes, and so the arithmetic, are the general path's.

template <typename T, class P, int U, bool FULL, bool TWO, bool AHEAD2 = false, bool ORDER = false,
          class C>
__device__ __forceinline__ void row_gemv(const P& wp, T* __restrict__ y, const T* __restrict__ x,
                                         float* ws, u32* counters, int M, int N, int K, int kw,
                                         int gy, u32 flags, const C& oc) {
  __shared__ float red[8][16][8];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const WarpSplit split(kw);
  const int group = split.group, slice = split.slice;
  const int slices = gy * kw;
  const int n = group * 8 + g;
  const bool row_ok = oc.ok(n);
  const int wrow = oc.row(n);  // the weight row of output column n
  const bool xv = (flags & EPK_X16) != 0;
  const int steps = wp.steps();
  typedef typename P::Raw Raw;
  PdlWait ready(flags);
  if constexpr (sizeof(T) == 4) {
    float acc[16];
#pragma unroll
    for (int m = 0; m < 16; ++m) acc[m] = 0.0f;
    for (int i0 = slice; i0 < steps; i0 += U * slices) {
      Raw raw[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int i = i0 + u * slices;
        if constexpr (FULL) {
          raw[u] = wp.load_full(wrow, i, t, row_ok && i < steps);
        } else {
          raw[u] = (row_ok && i < steps) ? wp.load(wrow, i, t) : P::none();
        }
      }
      ready();
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int i = i0 + u * slices;
        if (i >= steps) break;
#pragma unroll 1  // the 16-row body is long already: unrolling units only grows the code
        for (int v = 0; v < P::kUnits; ++v) {
          float wv[8];
          wp.floats(raw[u], v, wv);
          const int kk = wp.unit_k(i, t, v);
#pragma unroll
          for (int m = 0; m < 16; ++m) {
            if (m < M) {
              const float* xr = reinterpret_cast<const float*>(x) + (size_t)m * K;
              const uint4 a = load_chunk<float>(xr, kk, K, xv, false);
              const uint4 b = load_chunk<float>(xr, kk + 4, K, xv, false);
              float s = acc[m];
              s = fmaf(__uint_as_float(a.x), wv[0], s);
              s = fmaf(__uint_as_float(a.y), wv[1], s);
              s = fmaf(__uint_as_float(a.z), wv[2], s);
              s = fmaf(__uint_as_float(a.w), wv[3], s);
              s = fmaf(__uint_as_float(b.x), wv[4], s);
              s = fmaf(__uint_as_float(b.y), wv[5], s);
              s = fmaf(__uint_as_float(b.z), wv[6], s);
              s = fmaf(__uint_as_float(b.w), wv[7], s);
              acc[m] = s;
            }
          }
        }
      }
    }
#pragma unroll
    for (int m = 0; m < 16; ++m) {
      if (m < M) {
        acc[m] += __shfl_xor_sync(0xffffffffu, acc[m], 1);
        acc[m] += __shfl_xor_sync(0xffffffffu, acc[m], 2);
      }
      if ((m & 3) == t) red[warp][m][g] = acc[m];
    }
  } else {
    // One accumulator per unit: the MMAs of a step form kUnits independent chains, not one.
    float c[P::kUnits][4];
#pragma unroll
    for (int v = 0; v < P::kUnits; ++v) c[v][0] = c[v][1] = c[v][2] = c[v][3] = 0.0f;
    const T* xa = x + (size_t)g * K;
    const T* xb = x + (size_t)(g + 8) * K;
    const bool a_ok = g < M, b_ok = g + 8 < M;
    const u32 zero = (u32)K >> 31;  // K >= 0 (ORDER below)
    // the same for every lane: rows 8..15 are all padding otherwise (FULL: known at compile time)
    const bool two = FULL ? TWO : M > 8;
    for (int i0 = slice; i0 < steps; i0 += U * slices) {
      Raw raw[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int i = i0 + u * slices;
        if constexpr (FULL) {
          raw[u] = wp.load_full(wrow, i, t, row_ok && i < steps);
        } else {
          raw[u] = (row_ok && i < steps) ? wp.load(wrow, i, t) : P::none();
        }
      }
      ready();
      // FULL: the x chunks of all U steps are loaded before the first MMA (one round trip to
      // L2 for the activations the previous kernel wrote, not one a step).
      constexpr bool AHEAD = FULL && (!TWO || AHEAD2);
      uint4 xs[AHEAD ? U : 1], xh[AHEAD && TWO ? U : 1];
      if constexpr (AHEAD) {
        static_assert(P::kUnits == 1, "FULL: dense rows, one unit a step");
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int i = i0 + u * slices;
          xs[u] = ld_act_if(xa + wp.unit_k(i, t, 0), a_ok && i < steps);
          if constexpr (TWO) xh[u] = ld_act_if(xb + wp.unit_k(i, t, 0), b_ok && i < steps);
        }
      }
      // ORDER (FULL): every load of the round is issued before its first MMA, which takes a
      // zero that depends on all of them (`zero` is 0 at run time, which ptxas cannot know; the
      // same bits). Without it ptxas may move loads below the first MMA to free registers,
      // which then wait for it: two trips to memory a round, not one (NVRTC 13.0, the SwiGLU
      // twin of ``ep_gemv_nk16``: two of its four weight loads). It costs where the schedule
      // was right already (the first MMA waits for the last load too), so only that kernel
      // takes it (`_gemv_entry`).
      if constexpr (ORDER && FULL && U > 1) {
        u32 dep = 0;
#pragma unroll
        for (int u = 1; u < U; ++u) {
          dep |= raw[u].a.x;
          if constexpr (AHEAD) dep |= xs[u].x | (TWO ? xh[u].x : 0u);
        }
        raw[0].a.x |= dep & zero;
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int i = i0 + u * slices;
        if (i >= steps) break;  // the same for the whole warp: the MMAs stay converged
        uint4 a[P::kUnits], b[P::kUnits];
#pragma unroll
        for (int v = 0; v < P::kUnits; ++v) {
          if constexpr (AHEAD) {
            a[v] = xs[u];
            b[v] = TWO ? xh[u] : zero4();
          } else if constexpr (FULL) {
            const int kk = wp.unit_k(i, t, v);
            a[v] = ld_act_if(xa + kk, a_ok);
            b[v] = ld_act_if(xb + kk, b_ok);
          } else {
            const int kk = wp.unit_k(i, t, v);
            a[v] = a_ok ? load_chunk<T>(xa, kk, K, xv, false) : zero4();
            b[v] = zero4();
            if (two && b_ok) b[v] = load_chunk<T>(xb, kk, K, xv, false);
          }
        }
#pragma unroll
        for (int v = 0; v < P::kUnits; ++v) {
          u32 p[4];
          wp.pairs(raw[u], v, p);
          mma16816<T>(c[v], a[v].x, b[v].x, a[v].y, b[v].y, p[0], p[1]);
          mma16816<T>(c[v], a[v].z, b[v].z, a[v].w, b[v].w, p[2], p[3]);
        }
      }
    }
#pragma unroll
    for (int v = 1; v < P::kUnits; ++v) {
#pragma unroll
      for (int h = 0; h < 4; ++h) c[0][h] += c[v][h];
    }
    red[warp][g][2 * t] = c[0][0];
    red[warp][g][2 * t + 1] = c[0][1];
    red[warp][g + 8][2 * t] = c[0][2];
    red[warp][g + 8][2 * t + 1] = c[0][3];
  }
  ready();  // a warp with no K step still waits before the block writes
  gemv_finish<T, 8>(red, y, ws, counters, M, N, kw, gy, oc);
}

// --- GEMV with the weights as the MMA's A operand (4-bit and MXFP4, fp16/bf16) ----------------
//
// The dequantized weights are computed in registers, so they can be written straight into A
// fragments: a warp group is 16 weight rows (A rows g and g + 8 of lane (g, t)), the activations
// are B (batch row m = B column g, up to 8 per MMA; rows 8..15 take a second MMA on the same A).
// Lane (g, t) dequantizes 8 k of rows n0 + g and n0 + g + 8 per unit; B is x[g][those 8 k] as
// loaded: a 16-byte vector is already two B fragments. C[n][m] comes back as (g | g+8, 2t | 2t+1).

template <typename T, class P, int U, bool TWO>
__device__ __forceinline__ void wt_steps(const P& wp, const T* __restrict__ x, int M, int K,
                                         int row_lo, int row_hi, bool lo_ok, bool hi_ok,
                                         int slice, int slices, bool xv, PdlWait& ready,
                                         float (&c)[2][2][4]) {
  typedef typename P::Raw Raw;
  constexpr int kStepK = 32 * P::kUnits;  // k one step covers (4 lanes x kUnits x 8)
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const bool m_lo = g < M, m_hi = g + 8 < M;
  const T* x_lo = x + (size_t)g * K;
  const T* x_hi = x + (size_t)(g + 8) * K;
  const int steps = wp.steps();
  for (int i0 = slice; i0 < steps; i0 += U * slices) {
    Raw lo[U], hi[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int i = i0 + u * slices;
      lo[u] = (lo_ok && i < steps) ? wp.load(row_lo, i, t) : P::none();
      hi[u] = (hi_ok && i < steps) ? wp.load(row_hi, i, t) : P::none();
    }
    ready();
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int i = i0 + u * slices;
      if (i >= steps) break;  // the same for the whole warp: the MMAs stay converged
      uint4 xl[P::kUnits], xh[P::kUnits];
      if (xv && (i + 1) * kStepK <= K) {  // the whole step in range and aligned (warp-uniform)
#pragma unroll
        for (int v = 0; v < P::kUnits; ++v) {
          const int kk = wp.unit_k(i, t, v);
          xl[v] = m_lo ? ld_cached(x_lo + kk) : zero4();
          if (TWO) xh[v] = m_hi ? ld_cached(x_hi + kk) : zero4();
        }
      } else {
#pragma unroll
        for (int v = 0; v < P::kUnits; ++v) {
          const int kk = wp.unit_k(i, t, v);
          xl[v] = m_lo ? load_chunk<T>(x_lo, kk, K, xv, false) : zero4();
          if (TWO) xh[v] = m_hi ? load_chunk<T>(x_hi, kk, K, xv, false) : zero4();
        }
      }
#pragma unroll
      for (int v = 0; v < P::kUnits; ++v) {
        u32 a[4], b[4];
        wp.pairs(lo[u], v, a);
        wp.pairs(hi[u], v, b);
        mma16816<T>(c[0][v & 1], a[0], b[0], a[1], b[1], xl[v].x, xl[v].y);
        mma16816<T>(c[0][v & 1], a[2], b[2], a[3], b[3], xl[v].z, xl[v].w);
        if (TWO) {
          mma16816<T>(c[1][v & 1], a[0], b[0], a[1], b[1], xh[v].x, xh[v].y);
          mma16816<T>(c[1][v & 1], a[2], b[2], a[3], b[3], xh[v].z, xh[v].w);
        }
      }
    }
  }
}

template <typename T, class P, int U, class C>
__device__ __forceinline__ void row_gemv_wt(const P& wp, T* __restrict__ y,
                                            const T* __restrict__ x, float* ws, u32* counters,
                                            int M, int N, int K, int kw, int gy, u32 flags,
                                            const C& oc) {
  __shared__ float red[8][16][16];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const WarpSplit split(kw);
  const int group = split.group, slice = split.slice;
  const int slices = gy * kw;
  const int n_lo = group * 16 + g;
  const bool xv = (flags & EPK_X16) != 0;
  float c[2][2][4];  // [batch rows 0-7 | 8-15][two independent chains][fragment]
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int q = 0; q < 2; ++q) c[h][q][0] = c[h][q][1] = c[h][q][2] = c[h][q][3] = 0.0f;
  PdlWait ready(flags);
  const int r_lo = oc.row(n_lo), r_hi = oc.row(n_lo + 8);
  const bool lo_ok = oc.ok(n_lo), hi_ok = oc.ok(n_lo + 8);
  if (M > 8) {  // warp-uniform: a branch-free loop for each case
    wt_steps<T, P, U, true>(wp, x, M, K, r_lo, r_hi, lo_ok, hi_ok, slice, slices, xv, ready, c);
  } else {
    wt_steps<T, P, U, false>(wp, x, M, K, r_lo, r_hi, lo_ok, hi_ok, slice, slices, xv, ready, c);
  }
  ready();  // a warp with no K step still waits before the block writes
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int m = 2 * t + 8 * h;
    red[warp][m][g] = c[h][0][0] + c[h][1][0];
    red[warp][m + 1][g] = c[h][0][1] + c[h][1][1];
    red[warp][m][g + 8] = c[h][0][2] + c[h][1][2];
    red[warp][m + 1][g + 8] = c[h][0][3] + c[h][1][3];
  }
  gemv_finish<T, 16>(red, y, ws, counters, M, N, kw, gy, oc);
}

// --- GEMV over weight columns (dense kn: W [K, N]) ---------------------------------------------
//
// A warp owns a strip of 64 output columns. Tensor-core path: per step of 16 k, lane (g, t) loads
// 8 consecutive columns (nbase + 8g ..) of the 4 weight rows k0 + 2t, 2t+1, 2t+8, 2t+9 as 16-byte
// vectors; MMA j (j = 0..7) takes column nbase + 8g + j as its B column g, so the 8 MMAs cover the
// 64 columns and byte permutes pair up the two k values of one column.

template <typename T, int U>
__device__ __forceinline__ void col_gemv(T* __restrict__ y, const T* __restrict__ x,
                                         const T* __restrict__ w, float* ws, u32* counters, int M,
                                         int N, int K, int kw, int gy, u32 flags) {
  __shared__ float red[8][16][64];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const WarpSplit split(kw);
  const int group = split.group, slice = split.slice;
  const int slices = gy * kw;
  const int nbase = group * 64;
  const bool wv = (flags & EPK_W16) != 0;
  if constexpr (sizeof(T) == 4) {
    // Lane: 4 consecutive columns (cg), and one of the two k pairs of a step of 4 k (kp).
    const int cg = lane & 15, kp = lane >> 4;
    const int ncol = nbase + 4 * cg;
    const int steps = (K + 3) >> 2;
    float acc[16][4];
#pragma unroll
    for (int m = 0; m < 16; ++m) acc[m][0] = acc[m][1] = acc[m][2] = acc[m][3] = 0.0f;
    for (int i0 = slice; i0 < steps; i0 += U * slices) {
      uint4 r[U][2];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int i = i0 + u * slices;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int kr = 4 * i + 2 * kp + h;
          r[u][h] = (i < steps && kr < K && ncol < N)
                        ? load_chunk<float>(w + (size_t)kr * N, ncol, N, wv, true)
                        : zero4();
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int i = i0 + u * slices;
        if (i >= steps) break;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int kr = 4 * i + 2 * kp + h;
          if (kr >= K) continue;
#pragma unroll
          for (int m = 0; m < 16; ++m) {
            if (m < M) {
              const float xs = x[(size_t)m * K + kr];
              acc[m][0] = fmaf(xs, __uint_as_float(r[u][h].x), acc[m][0]);
              acc[m][1] = fmaf(xs, __uint_as_float(r[u][h].y), acc[m][1]);
              acc[m][2] = fmaf(xs, __uint_as_float(r[u][h].z), acc[m][2]);
              acc[m][3] = fmaf(xs, __uint_as_float(r[u][h].w), acc[m][3]);
            }
          }
        }
      }
    }
#pragma unroll
    for (int m = 0; m < 16; ++m) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        if (m < M) acc[m][j] += __shfl_xor_sync(0xffffffffu, acc[m][j], 16);
        if (kp == 0) red[warp][m][4 * cg + j] = acc[m][j];
      }
    }
  } else {
    const int g = lane >> 2, t = lane & 3;
    const int ncol = nbase + 8 * g;
    const int steps = (K + 15) >> 4;
    typedef typename Elem<T>::Bits B;
    const B* xb = reinterpret_cast<const B*>(x);
    float c[8][4];
#pragma unroll
    for (int j = 0; j < 8; ++j) c[j][0] = c[j][1] = c[j][2] = c[j][3] = 0.0f;
    for (int i0 = slice; i0 < steps; i0 += U * slices) {
      uint4 r[U][4];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int i = i0 + u * slices;
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const int kr = 16 * i + 2 * t + (q & 1) + 8 * (q >> 1);
          r[u][q] = (i < steps && kr < K && ncol < N)
                        ? load_chunk<T>(w + (size_t)kr * N, ncol, N, wv, true)
                        : zero4();
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int i = i0 + u * slices;
        if (i >= steps) break;
        const int k0 = 16 * i + 2 * t;
        u32 a[4];  // A fragment: (row g, k0..k0+1), (row g+8, ..), (row g, k0+8..), (row g+8, ..)
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const int m = g + 8 * (q & 1);
          const int k = k0 + 8 * (q >> 1);
          u32 lo = 0u, hi = 0u;
          if (m < M) {
            const size_t at = (size_t)m * K + k;
            if (k < K) lo = xb[at];
            if (k + 1 < K) hi = xb[at + 1];
          }
          a[q] = lo | (hi << 16);
        }
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const u32 sel = (j & 1) ? 0x7632u : 0x5410u;
          const u32 b0 = __byte_perm(word_at(r[u][0], j >> 1), word_at(r[u][1], j >> 1), sel);
          const u32 b1 = __byte_perm(word_at(r[u][2], j >> 1), word_at(r[u][3], j >> 1), sel);
          mma16816<T>(c[j], a[0], a[1], a[2], a[3], b0, b1);
        }
      }
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      red[warp][g][16 * t + j] = c[j][0];
      red[warp][g][16 * t + 8 + j] = c[j][1];
      red[warp][g + 8][16 * t + j] = c[j][2];
      red[warp][g + 8][16 * t + 8 + j] = c[j][3];
    }
  }
  gemv_finish<T, 64>(red, y, ws, counters, M, N, kw, gy, PlainCols{N});
}

// --- tensor-core GEMM (fp16/bf16) ------------------------------------------------------------
//
// Block = 4 warps (2 x 2), tile 64 (M) x 64 (N) x 32 (K), each warp 32 x 32 = 2 x 4 MMA tiles.
// Two shared-memory stages: the next tile's loads are in flight (cp.async, or loads into
// registers stored after the MMAs) while the MMAs run on the current one. Fragments come from
// shared memory through ldmatrix; rows are padded by 16 bytes so its 8 row reads hit distinct
// banks.

constexpr int TM = 64, TN = 64, TK = 32, LDT = TK + 8, LDKN = TN + 8;

__device__ __forceinline__ u32 smem_addr(const void* p) {
  return (u32)__cvta_generic_to_shared(p);
}

__device__ __forceinline__ void cp_async16(void* dst, const void* src, u32 bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_addr(dst)), "l"(src),
               "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
__device__ __forceinline__ void cp_wait1() { asm volatile("cp.async.wait_group 1;" ::: "memory"); }

__device__ __forceinline__ void ldsm_x4(u32 (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p))
               : "memory");
}
__device__ __forceinline__ void ldsm_x4_t(u32 (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p))
               : "memory");
}

// A tile of 64 rows x 32 k of a row-major [rows, len] matrix into smem [64][LDT] (rows past
// `rows` and k past `len` are zero). Used for x and for dense [N, K] weights.
template <typename T>
struct RowTile {
  const T* src;
  int rows, len, r0;
  bool vec, stream;
  uint4 reg[2];
  __device__ void fetch(int kt, u16* dst) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int c = threadIdx.x + 128 * h;
      const int row = c >> 2, kc = (c & 3) << 3;
      const int gr = r0 + row, k = kt * TK + kc;
      if (vec) {
        const bool ok = gr < rows && k < len;
        cp_async16(dst + row * LDT + kc, ok ? (const void*)(src + (size_t)gr * len + k) : src,
                   ok ? 16u : 0u);
      } else {
        reg[h] = gr < rows ? load_chunk<T>(src + (size_t)gr * len, k, len, false, stream)
                           : zero4();
      }
    }
  }
  __device__ void commit(u16* dst) {
    if (vec) return;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int c = threadIdx.x + 128 * h;
      *reinterpret_cast<uint4*>(dst + (c >> 2) * LDT + ((c & 3) << 3)) = reg[h];
    }
  }
};

template <typename T>
struct DenseNKTile {  // W [N, K] -> smem [n][k]
  static constexpr bool kKN = false;
  RowTile<T> tile;
  __device__ DenseNKTile(const T* w, int N, int K, int n0, bool vec)
      : tile{w, N, K, n0, vec, true, {}} {}
  __device__ void fetch(int kt, u16* dst) { tile.fetch(kt, dst); }
  __device__ void commit(u16* dst) { tile.commit(dst); }
};

template <typename T>
struct DenseKNTile {  // W [K, N] -> smem [k][n]
  static constexpr bool kKN = true;
  const T* w;
  int N, K, n0;
  bool vec;
  uint4 reg[2];
  __device__ DenseKNTile(const T* w_, int N_, int K_, int n0_, bool vec_)
      : w(w_), N(N_), K(K_), n0(n0_), vec(vec_) {}
  __device__ void fetch(int kt, u16* dst) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int c = threadIdx.x + 128 * h;
      const int kr = c >> 3, nc = (c & 7) << 3;
      const int k = kt * TK + kr, n = n0 + nc;
      if (vec) {
        const bool ok = k < K && n < N;
        cp_async16(dst + kr * LDKN + nc, ok ? (const void*)(w + (size_t)k * N + n) : w,
                   ok ? 16u : 0u);
      } else {
        reg[h] = k < K ? load_chunk<T>(w + (size_t)k * N, n, N, false, true) : zero4();
      }
    }
  }
  __device__ void commit(u16* dst) {
    if (vec) return;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int c = threadIdx.x + 128 * h;
      *reinterpret_cast<uint4*>(dst + (c >> 3) * LDKN + ((c & 7) << 3)) = reg[h];
    }
  }
};

// 4-bit tiles: thread = (row = tid / 2, half = tid % 2): 8 bytes = 16 weights, one block (every
// block size is >= 16), dequantized to T pairs in registers and stored after the MMAs.
template <typename T>
struct Q4Tile {
  static constexpr bool kKN = false;
  const u8* b;
  const T* scales;
  const u8* zp;
  int N, kb, row_bytes, zp_row, bs_shift, n0;
  bool w8, has_zp;
  u32 p[8];
  __device__ void fetch(int kt, u16*) {
    const int row = threadIdx.x >> 1, half = threadIdx.x & 1;
    const int n = n0 + row;
    const int off = kt * (TK / 2) + half * 8;
#pragma unroll
    for (int j = 0; j < 8; ++j) p[j] = 0u;
    if (n >= N || off >= row_bytes) return;
    const u8* r = b + (size_t)n * (size_t)row_bytes;
    uint2 q;
    if (w8) {
      q = ld_stream8(r + off);
    } else {
      const uint4 v = load_bytes(r, off, off + 8);
      q = make_uint2(v.x, v.y);
    }
    const int blk = (off << 1) >> bs_shift;
    const u32 s = scale_bits<T>(scales, (size_t)n * kb + blk) * 0x10001u;
    u32 z = 8u;
    if (has_zp) {
      const u32 byte = zp[(size_t)n * zp_row + (blk >> 1)];
      z = (blk & 1) ? (byte >> 4) : (byte & 15u);
    }
    const u32 z2 = (Elem<T>::kMagic | z) * 0x10001u;
    u32 a[4], c[4];
    q4_pairs<T>(q.x, s, z2, a);
    q4_pairs<T>(q.y, s, z2, c);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      p[j] = a[j];
      p[4 + j] = c[j];
    }
  }
  __device__ void commit(u16* dst) {
    const int row = threadIdx.x >> 1, half = threadIdx.x & 1;
    uint4* d = reinterpret_cast<uint4*>(dst + row * LDT + half * 16);
    d[0] = make_uint4(p[0], p[1], p[2], p[3]);
    d[1] = make_uint4(p[4], p[5], p[6], p[7]);
  }
};

template <typename T>
struct Mx4Tile {  // a 32-k tile of a row is exactly one MX block
  static constexpr bool kKN = false;
  const u8* b;
  const u8* scales;
  int N, kb, row_bytes, n0;
  bool w8;
  u32 p[8];
  __device__ void fetch(int kt, u16*) {
    const int row = threadIdx.x >> 1, half = threadIdx.x & 1;
    const int n = n0 + row;
    const int off = kt * (TK / 2) + half * 8;
#pragma unroll
    for (int j = 0; j < 8; ++j) p[j] = 0u;
    if (n >= N || off >= row_bytes) return;
    const u8* r = b + (size_t)n * (size_t)row_bytes;
    uint2 q;
    if (w8) {
      q = ld_stream8(r + off);
    } else {
      const uint4 v = load_bytes(r, off, off + 8);
      q = make_uint2(v.x, v.y);
    }
    const u32 s = e8m0_bits<T>(scales[(size_t)n * kb + kt]) * 0x10001u;
    u32 a[4], c[4];
    e2m1_pairs<T>(q.x, a);
    e2m1_pairs<T>(q.y, c);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      p[j] = pk_mul<T>(a[j], s);
      p[4 + j] = pk_mul<T>(c[j], s);
    }
  }
  __device__ void commit(u16* dst) {
    const int row = threadIdx.x >> 1, half = threadIdx.x & 1;
    uint4* d = reinterpret_cast<uint4*>(dst + row * LDT + half * 16);
    d[0] = make_uint4(p[0], p[1], p[2], p[3]);
    d[1] = make_uint4(p[4], p[5], p[6], p[7]);
  }
};

template <typename T, class BT>
__device__ __forceinline__ void gemm_tc(T* __restrict__ y, const T* __restrict__ x, BT& bt, int M,
                                        int N, int K, u32 flags) {
  constexpr int kBElems = BT::kKN ? TK * LDKN : TN * LDT;
  __shared__ __align__(16) u16 As[2][TM * LDT];
  __shared__ __align__(16) u16 Bs[2][kBElems];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int wm = warp >> 1, wn = warp & 1;
  const int g = lane >> 2, t = lane & 3;
  const int m0 = blockIdx.y * TM, n0 = blockIdx.x * TN;
  const int KT = (K + TK - 1) / TK;
  RowTile<T> at{x, M, K, m0, (flags & EPK_X16) != 0, false, {}};
  float c[2][4][4];
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) c[i][j][0] = c[i][j][1] = c[i][j][2] = c[i][j][3] = 0.0f;

  at.fetch(0, As[0]);
  bt.fetch(0, Bs[0]);
  cp_commit();
  at.commit(As[0]);
  bt.commit(Bs[0]);
  for (int kt = 0; kt < KT; ++kt) {
    const int s = kt & 1;
    if (kt + 1 < KT) {
      at.fetch(kt + 1, As[s ^ 1]);
      bt.fetch(kt + 1, Bs[s ^ 1]);
    }
    cp_commit();
    cp_wait1();  // every group but the one just issued is complete: stage s has landed
    __syncthreads();
    const u16* as = As[s];
    const u16* bs = Bs[s];
#pragma unroll
    for (int ks = 0; ks < TK / 16; ++ks) {
      u32 a[2][4], b[4][2];
#pragma unroll
      for (int mi = 0; mi < 2; ++mi) {
        ldsm_x4(a[mi], as + (wm * 32 + mi * 16 + (lane & 15)) * LDT + ks * 16 + (lane >> 4) * 8);
      }
#pragma unroll
      for (int nj = 0; nj < 2; ++nj) {
        u32 r[4];
        if constexpr (BT::kKN) {
          ldsm_x4_t(r, bs + (ks * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LDKN + wn * 32 +
                           nj * 16 + (lane >> 4) * 8);
        } else {
          ldsm_x4(r, bs + (wn * 32 + nj * 16 + (lane & 7) + (lane >> 4) * 8) * LDT + ks * 16 +
                         ((lane >> 3) & 1) * 8);
        }
        b[2 * nj][0] = r[0];
        b[2 * nj][1] = r[1];
        b[2 * nj + 1][0] = r[2];
        b[2 * nj + 1][1] = r[3];
      }
#pragma unroll
      for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int nj = 0; nj < 4; ++nj)
          mma16816<T>(c[mi][nj], a[mi][0], a[mi][1], a[mi][2], a[mi][3], b[nj][0], b[nj][1]);
    }
    __syncthreads();  // stage s is free again
    if (kt + 1 < KT) {
      at.commit(As[s ^ 1]);
      bt.commit(Bs[s ^ 1]);
    }
  }
#pragma unroll
  for (int mi = 0; mi < 2; ++mi) {
#pragma unroll
    for (int nj = 0; nj < 4; ++nj) {
      const int row = m0 + wm * 32 + mi * 16 + g;
      const int col = n0 + wn * 32 + nj * 8 + 2 * t;
#pragma unroll
      for (int h = 0; h < 4; ++h) {
        const int r = row + 8 * (h >> 1), cc = col + (h & 1);
        if (r < M && cc < N) y[(size_t)r * N + cc] = Elem<T>::from_f(c[mi][nj][h]);
      }
    }
  }
}

// --- SIMT GEMM (fp32) --------------------------------------------------------------------------
//
// Block = 256 threads, tile 64 x 64 x 16, each thread a 4 x 4 block of outputs. Both tiles are
// stored k-major in shared memory ([k][m] and [k][n]) so a thread reads 4 + 4 consecutive floats
// per k.

constexpr int SM_ = 64, SN = 64, SK = 16, LDS = 68;

struct F32NKTile {
  const float* w;
  int N, K, n0;
  bool vec;
  uint4 v;
  __device__ void fetch(int kt) {
    const int nr = threadIdx.x >> 2, kq = (threadIdx.x & 3) << 2;
    const int n = n0 + nr;
    v = n < N ? load_chunk<float>(w + (size_t)n * K, kt * SK + kq, K, vec, true) : zero4();
  }
  __device__ void commit(float (*bs)[LDS]) {
    const int nr = threadIdx.x >> 2, kq = (threadIdx.x & 3) << 2;
    bs[kq][nr] = __uint_as_float(v.x);
    bs[kq + 1][nr] = __uint_as_float(v.y);
    bs[kq + 2][nr] = __uint_as_float(v.z);
    bs[kq + 3][nr] = __uint_as_float(v.w);
  }
};

struct F32KNTile {
  const float* w;
  int N, K, n0;
  bool vec;
  uint4 v;
  __device__ void fetch(int kt) {
    const int kr = threadIdx.x >> 4, nq = (threadIdx.x & 15) << 2;
    const int k = kt * SK + kr;
    v = k < K ? load_chunk<float>(w + (size_t)k * N, n0 + nq, N, vec, true) : zero4();
  }
  __device__ void commit(float (*bs)[LDS]) {
    const int kr = threadIdx.x >> 4, nq = (threadIdx.x & 15) << 2;
    *reinterpret_cast<uint4*>(&bs[kr][nq]) = v;
  }
};

// 4-bit and MXFP4 fp32 tiles: thread = (row = tid / 4, 4 consecutive k = 2 bytes).
struct F32Q4Tile {
  const u8* b;
  const float* scales;
  const u8* zp;
  int N, kb, row_bytes, zp_row, bs_shift, n0;
  bool has_zp;
  float v[4];
  __device__ void fetch(int kt) {
    const int nr = threadIdx.x >> 2, kq = (threadIdx.x & 3) << 2;
    const int n = n0 + nr, k = kt * SK + kq, off = k >> 1;
    v[0] = v[1] = v[2] = v[3] = 0.0f;
    if (n >= N || off >= row_bytes) return;
    const u8* r = b + (size_t)n * (size_t)row_bytes;
    const u32 q = (u32)r[off] | ((u32)r[off + 1] << 8);  // row_bytes is even
    const int blk = k >> bs_shift;
    const float s = scales[(size_t)n * kb + blk];
    u32 z = 8u;
    if (has_zp) {
      const u32 byte = zp[(size_t)n * zp_row + (blk >> 1)];
      z = (blk & 1) ? (byte >> 4) : (byte & 15u);
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) v[j] = ((float)((q >> (4 * j)) & 15u) - (float)z) * s;
  }
  __device__ void commit(float (*bs)[LDS]) {
    const int nr = threadIdx.x >> 2, kq = (threadIdx.x & 3) << 2;
#pragma unroll
    for (int j = 0; j < 4; ++j) bs[kq + j][nr] = v[j];
  }
};

struct F32Mx4Tile {
  const u8* b;
  const u8* scales;
  int N, kb, row_bytes, n0;
  float v[4];
  __device__ void fetch(int kt) {
    const int nr = threadIdx.x >> 2, kq = (threadIdx.x & 3) << 2;
    const int n = n0 + nr, k = kt * SK + kq, off = k >> 1;
    v[0] = v[1] = v[2] = v[3] = 0.0f;
    if (n >= N || off >= row_bytes) return;
    const u8* r = b + (size_t)n * (size_t)row_bytes;
    const u32 q = (u32)r[off] | ((u32)r[off + 1] << 8);
    const float s = e8m0_f32(scales[(size_t)n * kb + (k >> 5)]);
    u32 p[4];
    e2m1_pairs_bf16(q, p);
    v[0] = __uint_as_float(p[0] << 16) * s;
    v[1] = __uint_as_float(p[0] & 0xFFFF0000u) * s;
    v[2] = __uint_as_float(p[1] << 16) * s;
    v[3] = __uint_as_float(p[1] & 0xFFFF0000u) * s;
  }
  __device__ void commit(float (*bs)[LDS]) {
    const int nr = threadIdx.x >> 2, kq = (threadIdx.x & 3) << 2;
#pragma unroll
    for (int j = 0; j < 4; ++j) bs[kq + j][nr] = v[j];
  }
};

template <class BT>
__device__ __forceinline__ void gemm_simt(float* __restrict__ y, const float* __restrict__ x,
                                          BT& bt, int M, int N, int K, u32 flags) {
  __shared__ __align__(16) float As[SK][LDS];
  __shared__ __align__(16) float Bs[SK][LDS];
  const int tid = threadIdx.x, tx = tid & 15, ty = tid >> 4;
  const int m0 = blockIdx.y * SM_, n0 = blockIdx.x * SN;
  const bool xv = (flags & EPK_X16) != 0;
  const int KT = (K + SK - 1) / SK;
  float acc[4][4];
#pragma unroll
  for (int i = 0; i < 4; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
  for (int kt = 0; kt < KT; ++kt) {
    const int mr = tid >> 2, kq = (tid & 3) << 2;
    const uint4 a = m0 + mr < M
                        ? load_chunk<float>(x + (size_t)(m0 + mr) * K, kt * SK + kq, K, xv, false)
                        : zero4();
    bt.fetch(kt);
    __syncthreads();  // the previous tile has been used
    As[kq][mr] = __uint_as_float(a.x);
    As[kq + 1][mr] = __uint_as_float(a.y);
    As[kq + 2][mr] = __uint_as_float(a.z);
    As[kq + 3][mr] = __uint_as_float(a.w);
    bt.commit(Bs);
    __syncthreads();
#pragma unroll
    for (int k = 0; k < SK; ++k) {
      const float4 av = *reinterpret_cast<const float4*>(&As[k][ty * 4]);
      const float4 bv = *reinterpret_cast<const float4*>(&Bs[k][tx * 4]);
      const float ar[4] = {av.x, av.y, av.z, av.w};
      const float br[4] = {bv.x, bv.y, bv.z, bv.w};
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(ar[i], br[j], acc[i][j]);
    }
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int r = m0 + ty * 4 + i;
    if (r >= M) continue;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int cc = n0 + tx * 4 + j;
      if (cc < N) y[(size_t)r * N + cc] = acc[i][j];
    }
  }
}

// --- streaming GEMV: 4-bit and MXFP4 weights over many output columns (fp16/bf16) -------------
//
// For N large enough that 16-row groups outnumber the GPU's warps (the vocabulary projection):
// no K split. A persistent grid (5 blocks of 4 warps an SM, one wave; `plan_matmul` sizes it);
// global warp w owns the contiguous 16-row groups [w G / W, (w + 1) G / W) of the G = ceil(N/16),
// each over all of K, so a row's sum is one warp's fixed sequence of MMAs: independent of M, of
// timing and of the grid. A warp walks the flattened sequence (group, step); a step is the same
// 16 rows x 64 bytes (4 lanes x 16 bytes a row, 128 k) that `wt_steps` consumes, with the same
// dequantization and MMA order, so the arithmetic per row is that of `row_gemv_wt` at kw = gy = 1.
//
// Bytes in flight: a per-warp ring of kDepth = 5 shared-memory stages filled by cp.async 4 steps
// ahead of the step being multiplied, across group boundaries, so the loads of one warp never
// drain until its last group: 4 KB of weights a warp, 20 warps an SM: 80 KB of weights in
// flight per SM (HBM needs roughly 32-40 KB per SM), and no registers held by them. Occupancy:
// __launch_bounds__(128, 5) caps registers at 102 (ptxas: 96, no spills) and 5 x 38.4 KB of
// shared memory fit an SM, 6 do not: exactly the 5 blocks the plan launches per SM. The scale and zero-point words of a step are copied into the same stage (4-byte
// cp.async, L1-allocating: the 16 rows' scales share a few lines used by 4+ steps), so they never
// sit on the critical path either.
//
// Each lane reads back exactly the shared-memory words it copied itself, so cp.async.wait_group
// is all the synchronisation there is (no __syncwarp, no __syncthreads). The slot written at
// iteration s (stage s + kDepth - 1) is the one read at iteration s - 1, already consumed in
// program order.
//
// Shared-memory banks: a stage is [2][32] 16-byte weight chunks then [6][32] 4-byte words, both
// indexed by lane last: the 16-byte copies and ld.shared.v4 of a warp cover 512 contiguous bytes
// (4 wavefronts, the minimum for 512 bytes: conflict-free); the 4-byte copies and loads cover 128
// contiguous bytes (one wavefront). Global coalescing: one weight cp.async of the warp reads, for
// each of 8 rows, 64 contiguous bytes (4 lanes x 16): whole sectors, and the .L2::128B hint
// brings in the other half of the 128-byte line that the next step reads. Activations come from
// L1 (ld.global.nc, 16 bytes), as in `wt_steps`, issued before the wait for the weights.
//
// Unaligned arrays (weights not 16-byte, scales or zero points not 4-byte aligned) fall back to
// plain loads stored into the same stage layout (slower, same results). Rows past N and chunks
// past the row read as zero weights with zero scales: exact zeros, never out-of-bounds reads.

struct SStage {       // one warp's share of one step: 1920 bytes
  static constexpr int kWarps = 4;  // warps a block; the entries say __launch_bounds__(128, 5)
  static constexpr int kDepth = 5;  // stages a warp: kDepth - 1 in flight while one is used
  uint4 w[2][32];     // 16-byte weight chunks [row g | row g + 8][lane]
  u32 aux[6][32];     // words [scale of row g, row g + 8, their second block (block 16),
                      //        zero-point byte of row g, row g + 8][lane]
  u32 pad[32];        // unused: 4 x 5 x 1920 = 37.5 KB a block lets 5 blocks share an SM, not 6
};

__device__ __forceinline__ void cp_async16_l2(void* dst, const void* src, u32 bytes) {
  asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;" ::"r"(smem_addr(dst)),
               "l"(src), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void cp_async4(void* dst, const void* src, u32 bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(smem_addr(dst)), "l"(src),
               "r"(bytes)
               : "memory");
}
template <int N>
__device__ __forceinline__ void cp_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// One 16-byte weight chunk row[off..off+16) into dst; zeros when !ok. vec: aligned cp.async
// (src-size 0 reads nothing and fills zeros); else a byte-wise read stopping at the row end.
template <bool FAST>
__device__ __forceinline__ void stage_chunk(uint4* dst, const u8* row, int off, int len, bool ok,
                                            bool vec, const u8* base) {
  if (FAST || vec) {
    cp_async16_l2(dst, ok ? (const void*)(row + off) : (const void*)base, ok ? 16u : 0u);
  } else {
    *dst = ok ? load_bytes(row, off, len) : zero4();
  }
}

// The aligned 4-byte word holding the element (BYTES = 1 or 2 bytes) at p into dst, the element
// at bit 8 * (p % 4) of it; zero when !ok. The array [base, end) has a 4-byte aligned base when
// vec: the word starts at or after base and src-size stops it at end. Else a plain load of the
// element, stored at the same bits.
// FAST: the array's length is a multiple of 4 too, so every word is inside it (no clamp).
template <int BYTES, bool FAST>
__device__ __forceinline__ void stage_word(u32* dst, const u8* p, const u8* base, const u8* end,
                                           bool ok, bool vec) {
  const size_t a = reinterpret_cast<size_t>(p);
  if (FAST) {
    cp_async4(dst, ok ? (const void*)(a & ~(size_t)3) : (const void*)base, ok ? 4u : 0u);
  } else if (vec) {
    const u8* w = reinterpret_cast<const u8*>(a & ~(size_t)3);
    const long long left = end - w;  // >= 1 when ok: p < end
    cp_async4(dst, ok ? (const void*)w : (const void*)base, ok ? (u32)(left < 4 ? left : 4) : 0u);
  } else {
    u32 v = 0u;
    if (ok) {
      v = BYTES == 1 ? (u32)*p : (u32) * reinterpret_cast<const u16*>(p);
      v <<= 8 * (u32)(a & 3);
    }
    *dst = v;
  }
}

// MatMulNBits rows for the streaming GEMV. Step i of group j, lane (g, t): chunk c = 4i + t
// (bytes 16c.., k 32c..) of rows 16j + g and 16j + g + 8; its first block blk0 = 32c / bs (block
// 16: the chunk's units 2-3 are in block blk0 + 1; their zero point is the high nibble of the
// same byte, blk0 being even).
template <typename T>
struct Q4Stream {
  const u8* b;
  const u8* sc;  // scales, as bytes
  const u8* zp;
  const u8* sc_end;
  const u8* zp_end;
  int N, kb, row_bytes, zp_row, bs_shift;
  bool has_zp, wvec, avec, fast;  // fast: wvec, avec and word-multiple array lengths
  struct Dec {
    uint4 q[2];
    u32 s[2][2], z[2][2];  // [row g | g + 8][units 0-1 | 2-3]: packed scale, packed magic | zp
  };
  __device__ int steps() const { return (row_bytes + 63) >> 6; }
  template <bool FAST>
  __device__ void fetch(SStage& st, int j, int i, int lane) const {
    const int g = lane >> 2, t = lane & 3;
    const int c = (i << 2) + t, off = c << 4;
    const int blk0 = (c << 5) >> bs_shift;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int n = (j << 4) + g + 8 * h;
      const bool ok = n < N && off < row_bytes;
      stage_chunk<FAST>(&st.w[h][lane], b + (size_t)n * (size_t)row_bytes, off, row_bytes, ok,
                        wvec, b);
      const u8* s0 = sc + ((size_t)n * (size_t)kb + (size_t)blk0) * 2;
      stage_word<2, FAST>(&st.aux[h][lane], s0, sc, sc_end, ok, avec);
      if (bs_shift == 4) {
        stage_word<2, FAST>(&st.aux[2 + h][lane], s0 + 2, sc, sc_end, ok && blk0 + 1 < kb, avec);
      }
      if (has_zp) {
        const u8* z = zp + (size_t)n * (size_t)zp_row + (size_t)(blk0 >> 1);
        stage_word<1, FAST>(&st.aux[4 + h][lane], z, zp, zp_end, ok, avec);
      }
    }
  }
  __device__ void decode(const SStage& st, int j, int i, int lane, Dec& d) const {
    const int g = lane >> 2, t = lane & 3;
    const int c = (i << 2) + t;
    const int blk0 = (c << 5) >> bs_shift;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int n = (j << 4) + g + 8 * h;
      d.q[h] = st.w[h][lane];
      const size_t sa = reinterpret_cast<size_t>(sc) + ((size_t)n * (size_t)kb + blk0) * 2;
      const u32 sh = (u32)(sa & 2) << 3;  // 0 or 16
      d.s[h][0] = ((st.aux[h][lane] >> sh) & 0xFFFFu) * 0x10001u;
      // block 16: the next scale is 2 bytes on, at the other half of its word
      d.s[h][1] = bs_shift == 4 ? ((st.aux[2 + h][lane] >> (sh ^ 16u)) & 0xFFFFu) * 0x10001u
                                : d.s[h][0];
      u32 z0 = 8u, z1 = 8u;
      if (has_zp) {
        const size_t za = reinterpret_cast<size_t>(zp) + (size_t)n * (size_t)zp_row + (blk0 >> 1);
        const u32 byte = (st.aux[4 + h][lane] >> ((u32)(za & 3) << 3)) & 0xFFu;
        if (bs_shift == 4) {
          z0 = byte & 15u;
          z1 = byte >> 4;
        } else {
          z0 = (blk0 & 1) ? (byte >> 4) : (byte & 15u);
          z1 = z0;
        }
      }
      d.z[h][0] = (Elem<T>::kMagic | z0) * 0x10001u;
      d.z[h][1] = (Elem<T>::kMagic | z1) * 0x10001u;
    }
  }
  __device__ static void unit(const Dec& d, int h, int u, u32 (&p)[4]) {
    q4_pairs<T>(word_at(d.q[h], u), d.s[h][u >> 1], d.z[h][u >> 1], p);
  }
};

// MXFP4 rows for the streaming GEMV: chunk c of a row is MX block c, its E8M0 byte scale c.
template <typename T>
struct Mx4Stream {
  const u8* b;
  const u8* sc;
  const u8* sc_end;
  int N, kb, row_bytes;
  bool wvec, avec, fast;
  struct Dec {
    uint4 q[2];
    u32 s[2];  // packed scale of row g | g + 8
  };
  __device__ int steps() const { return (row_bytes + 63) >> 6; }
  template <bool FAST>
  __device__ void fetch(SStage& st, int j, int i, int lane) const {
    const int g = lane >> 2, t = lane & 3;
    const int c = (i << 2) + t, off = c << 4;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int n = (j << 4) + g + 8 * h;
      const bool ok = n < N && off < row_bytes;
      stage_chunk<FAST>(&st.w[h][lane], b + (size_t)n * (size_t)row_bytes, off, row_bytes, ok,
                        wvec, b);
      stage_word<1, FAST>(&st.aux[h][lane], sc + (size_t)n * (size_t)kb + c, sc, sc_end, ok,
                          avec);
    }
  }
  __device__ void decode(const SStage& st, int j, int i, int lane, Dec& d) const {
    const int g = lane >> 2, t = lane & 3;
    const int c = (i << 2) + t;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int n = (j << 4) + g + 8 * h;
      d.q[h] = st.w[h][lane];
      const size_t sa = reinterpret_cast<size_t>(sc) + (size_t)n * (size_t)kb + c;
      const u32 e = (st.aux[h][lane] >> ((u32)(sa & 3) << 3)) & 0xFFu;
      d.s[h] = e8m0_bits<T>(e) * 0x10001u;  // a zero-filled (absent) chunk: e = 0, codes 0: 0
    }
  }
  __device__ static void unit(const Dec& d, int h, int u, u32 (&p)[4]) {
    e2m1_pairs<T>(word_at(d.q[h], u), p);
#pragma unroll
    for (int j = 0; j < 4; ++j) p[j] = pk_mul<T>(p[j], d.s[h]);
  }
};

// A warp's finished 16-row group j (the persistent GEMVs: `stream_run`, `v2_gemv`): lane (g, t)
// holds C[n][m] at n = 16j + (g | g + 8), m = 2t | 2t + 1 (+ 8 with TWO) in two chains; their sum
// is stored where inside y [M, N] and the accumulators are cleared for the next group.
template <typename T, bool TWO>
__device__ __forceinline__ void store_group(T* __restrict__ y, float (&c)[2][2][4], int j, int g,
                                            int t, int M, int N) {
  const int n = (j << 4) + g;
#pragma unroll
  for (int h = 0; h < (TWO ? 2 : 1); ++h) {
    const int m = 2 * t + 8 * h;
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int mm = m + (r & 1), nn = n + 8 * (r >> 1);
      if (mm < M && nn < N) {
        y[(size_t)mm * (size_t)N + nn] = Elem<T>::from_f(c[h][0][r] + c[h][1][r]);
      }
      c[h][0][r] = c[h][1][r] = 0.0f;
    }
  }
}

template <typename T, class P, bool TWO, bool FAST>
__device__ __forceinline__ void stream_run(const P& wp, T* __restrict__ y,
                                           const T* __restrict__ x, int M, int N, int K,
                                           bool xv, SStage* ring, int j0, int j1) {
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  constexpr int D = SStage::kDepth;
  const int steps = wp.steps();
  const int total = (j1 - j0) * steps;  // warp-uniform, as is everything the loop branches on
  const bool m_lo = g < M, m_hi = g + 8 < M;
  const T* x_lo = x + (size_t)g * K;
  const T* x_hi = x + (size_t)(g + 8) * K;
  int lj = j0, li = 0;  // the (group, step) the loader copies next
#pragma unroll
  for (int p = 0; p < D - 1; ++p) {
    if (p < total) {
      wp.template fetch<FAST>(ring[p], lj, li, lane);
      if (++li == steps) {
        li = 0;
        ++lj;
      }
    }
    cp_commit();  // one group per stage, empty ones too: wait_group counts stay exact
  }
  float c[2][2][4];  // [batch rows 0-7 | 8-15][two independent chains][fragment]
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int q = 0; q < 2; ++q) c[h][q][0] = c[h][q][1] = c[h][q][2] = c[h][q][3] = 0.0f;
  int cj = j0, ci = 0;            // the (group, step) multiplied next
  int slot = 0, lslot = D - 1;  // ring slots of stage s and of stage s + D - 1
  for (int s = 0; s < total; ++s) {
    if (s + D - 1 < total) {
      wp.template fetch<FAST>(ring[lslot], lj, li, lane);
      if (++li == steps) {
        li = 0;
        ++lj;
      }
    }
    cp_commit();
    lslot = lslot + 1 == D ? 0 : lslot + 1;
    uint4 xl[4], xh[4];  // x rows g and g + 8 at the step's k: B fragments as loaded
    if (xv && (ci + 1) * 128 <= K) {
#pragma unroll
      for (int v = 0; v < 4; ++v) {
        const int kk = (ci << 7) + (t << 5) + (v << 3);
        xl[v] = m_lo ? ld_cached(x_lo + kk) : zero4();
        if (TWO) xh[v] = m_hi ? ld_cached(x_hi + kk) : zero4();
      }
    } else {
#pragma unroll
      for (int v = 0; v < 4; ++v) {
        const int kk = (ci << 7) + (t << 5) + (v << 3);
        xl[v] = m_lo ? load_chunk<T>(x_lo, kk, K, xv, false) : zero4();
        if (TWO) xh[v] = m_hi ? load_chunk<T>(x_hi, kk, K, xv, false) : zero4();
      }
    }
    cp_wait<D - 1>();  // all groups but the newest D - 1 are complete: stage s has landed
    typename P::Dec d;
    wp.decode(ring[slot], cj, ci, lane, d);
    slot = slot + 1 == D ? 0 : slot + 1;
#pragma unroll
    for (int v = 0; v < 4; ++v) {
      u32 a[4], e[4];
      P::unit(d, 0, v, a);
      P::unit(d, 1, v, e);
      mma16816<T>(c[0][v & 1], a[0], e[0], a[1], e[1], xl[v].x, xl[v].y);
      mma16816<T>(c[0][v & 1], a[2], e[2], a[3], e[3], xl[v].z, xl[v].w);
      if (TWO) {
        mma16816<T>(c[1][v & 1], a[0], e[0], a[1], e[1], xh[v].x, xh[v].y);
        mma16816<T>(c[1][v & 1], a[2], e[2], a[3], e[3], xh[v].z, xh[v].w);
      }
    }
    if (++ci == steps) {  // group cj is complete
      store_group<T, TWO>(y, c, cj, g, t, M, N);
      ci = 0;
      ++cj;
    }
  }
  cp_wait<0>();
}

template <typename T, class P>
__device__ __forceinline__ void stream_gemv(const P& wp, T* __restrict__ y,
                                            const T* __restrict__ x, int M, int N, int K,
                                            u32 flags) {
  __shared__ SStage ring[SStage::kWarps][SStage::kDepth];
  const int warp = threadIdx.x >> 5;
  const long long warps = (long long)gridDim.x * SStage::kWarps;
  const long long gw = (long long)blockIdx.x * SStage::kWarps + warp;
  const long long groups = ((long long)N + 15) >> 4;
  const int j0 = (int)(gw * groups / warps), j1 = (int)((gw + 1) * groups / warps);
  const bool xv = (flags & EPK_X16) != 0;
  // Uniform for the launch: one branch-free loop for each case.
  if (wp.fast) {
    if (M > 8) {
      stream_run<T, P, true, true>(wp, y, x, M, N, K, xv, ring[warp], j0, j1);
    } else {
      stream_run<T, P, false, true>(wp, y, x, M, N, K, xv, ring[warp], j0, j1);
    }
  } else if (M > 8) {
    stream_run<T, P, true, false>(wp, y, x, M, N, K, xv, ring[warp], j0, j1);
  } else {
    stream_run<T, P, false, false>(wp, y, x, M, N, K, xv, ring[warp], j0, j1);
  }
}

template <typename T>
__device__ __forceinline__ Q4Stream<T> q4_stream(const u8* b, const T* scales, const u8* zp,
                                                 int N, int kb, int bs_shift, u32 flags) {
  const bool has_zp = (flags & EPK_ZP) != 0;
  const u8* sc = reinterpret_cast<const u8*>(scales);
  const int zp_row = (kb + 1) >> 1;
  Q4Stream<T> p;
  p.b = b;
  p.sc = sc;
  p.zp = zp;
  p.sc_end = sc + (size_t)N * (size_t)kb * 2;
  p.zp_end = zp + (size_t)N * (size_t)zp_row;
  p.N = N;
  p.kb = kb;
  p.row_bytes = (kb << bs_shift) >> 1;
  p.zp_row = zp_row;
  p.bs_shift = bs_shift;
  p.has_zp = has_zp;
  p.wvec = (flags & EPK_W16) != 0;
  p.avec = (reinterpret_cast<size_t>(sc) & 3) == 0 &&
           (!has_zp || (reinterpret_cast<size_t>(zp) & 3) == 0);
  p.fast = p.wvec && p.avec && (((size_t)N * (size_t)kb) & 1) == 0 &&
           (!has_zp || (((size_t)N * (size_t)zp_row) & 3) == 0);
  return p;
}

template <typename T>
__device__ __forceinline__ Mx4Stream<T> mx4_stream(const u8* b, const u8* scales, int N, int K,
                                                   u32 flags) {
  Mx4Stream<T> p;
  p.b = b;
  p.sc = scales;
  p.sc_end = scales + (size_t)N * (size_t)(K >> 5);
  p.N = N;
  p.kb = K >> 5;
  p.row_bytes = K >> 1;
  p.wvec = (flags & EPK_W16) != 0;
  p.avec = (reinterpret_cast<size_t>(scales) & 3) == 0;
  p.fast = p.wvec && p.avec && (((size_t)N * (size_t)p.kb) & 3) == 0;
  return p;
}

// --- dense GEMV v2: W [N, K] fp16/bf16, one pass over each row, no split over blocks -----------
//
// Why: the layer projections (N 896..9728, K 896..4864) are latency bound in ep_gemv_nk: a block
// loads its 8 rows' K slice once (3.5 steps a warp), waits, reduces, exits, and the next block
// pays the whole DRAM latency again; past 4 steps a warp it also splits K over blocks (workspace,
// atomics, fences). Here every warp keeps a ring of 8 weight loads (16 bytes a lane each) in
// flight all the time, across its tiles, so the latency is paid about once per launch.
// Measured on the H200 it wins only on weights of >= ~4M elements at M = 1 (4-10%); the plan
// runs it there only (matmul.py: _V2_DENSE_MIN_ELEMENTS, with the timings).
//
// Geometry (the plan, from K, N and the SM count only): a tile is 8 weight rows (the n8 of one
// m16n8k16 MMA; the weights are its B operand, x rows 0..15 its A operand, as in row_gemv). The
// block is kw = min(16, ceil(S / 8)) warps, S = ceil(K / 32) steps of 32 k; all kw warps work on
// one tile at a time, warp w taking the steps (r * 8 + u) * kw + w of round r, slot u (so at each
// slot the block reads kw * 64 contiguous bytes of each of its 8 rows). R = ceil(S / (8 kw))
// rounds a tile (1 for K <= 4096, 2 for K = 4864). Blocks walk tiles blockIdx.x, + gridDim.x, ...
// (a persistent grid of about 16 warps an SM). Slot u of the ring is refilled with the next
// element's (the next round's, or the next tile's first round's) load right after its MMAs,
// so a warp has ~8 x 512 = 4 KB in flight and an SM ~64 KB (16 warps), with no gap between
// tiles. At the end of a tile each warp writes its 16 x 8 partial sums to shared memory
// (double-buffered by tile parity: one __syncthreads a tile), and the block adds the kw partials
// in warp order and writes y.
//
// x (M x K, at most 16 x 6144) is staged once per block in shared memory, rows padded to
// ldx = roundup(K, 64) + 32 elements: a quarter warp reads rows g, g+1 at the same 64 bytes, and
// ldx * 2 = 64 (mod 128) bytes puts the two rows in opposite halves of the 32 banks (no
// conflicts). Shared memory: 16 x ldx x 2 bytes for x (always 16 rows: the footprint and the
// occupancy do not depend on M) + kw KB of partial sums; set by the plan.
//
// Per 16 bytes of weights (8 k of one row, one lane, one step): 1 global load (ld.global.nc,
// L1::no_allocate, predicated in PTX), 1 shared load of x row g (+1 of row g + 8 when M > 8),
// 2 mma.sync (each a warp instruction covering 512 bytes of weights), ~4 integer/predicate ops;
// no converts, no shuffles (the block reduction is 4 shared stores a lane and kw - 1 adds an
// output, once a tile).
//
// Bitwise contract: a row's result is sum over w = 0..kw-1 (in order) of (c0 + c1) + (c2 + c3) of
// warp w, c0..c3 its four MMA chains (even slots' first and second MMA, odd slots' first and
// second), each in step order; an empty slot adds exact zeros. kw and R depend on K only: not on M (rows of an MMA are independent; rows >= M are zeros), not on N, the tile's
// block or the grid; no atomics. Needs K % 8 == 0 and 16-byte aligned weights (the plan checks;
// else ep_gemv_nk); x may have any alignment (staged element-wise then).

constexpr int V2_SLOTS = 8;  // weight loads in flight a lane

template <typename T>
__device__ __forceinline__ void nk_ring_gemv(T* __restrict__ y, const T* __restrict__ x,
                                             const T* __restrict__ w, int M, int N, int K,
                                             u32 flags) {
  extern __shared__ __align__(16) unsigned char epk_v2_smem[];
  const int kw = blockDim.x >> 5;
  float* red = reinterpret_cast<float*>(epk_v2_smem);        // [2][kw][16][8]
  u16* xs = reinterpret_cast<u16*>(epk_v2_smem + kw * 1024);  // [16][ldx]
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int S = (K + 31) >> 5;
  const int R = (S + V2_SLOTS * kw - 1) / (V2_SLOTS * kw);
  const int tiles = (N + 7) >> 3;
  const int ldx = ((K + 63) & ~63) + 32;
  const int G = gridDim.x;
  if ((int)blockIdx.x >= tiles) return;  // the whole block: before any barrier
  const int E = ((tiles - 1 - (int)blockIdx.x) / G + 1) * R;  // (tile, round) elements

  // The first element's weights go out before x is staged: their latency covers the staging.
  uint4 ring[V2_SLOTS];
  {
    const int n = (int)blockIdx.x * 8 + g;
    const T* row = w + (size_t)(n < N ? n : N - 1) * (size_t)K;
#pragma unroll
    for (int u = 0; u < V2_SLOTS; ++u) {
      const int kk = ((u * kw + warp) << 5) + (t << 3);
      ring[u] = ld_stream_if(row + kk, n < N && kk < K);
    }
  }
  if ((flags & EPK_X16) != 0) {
    const int cpr = K >> 3;  // 16-byte chunks a row (K % 8 == 0 here)
    for (int c = threadIdx.x; c < M * cpr; c += blockDim.x) {
      const int m = c / cpr, kc = c - m * cpr;
      const uint4 v = ld_cached(x + (size_t)m * K + (kc << 3));
      *reinterpret_cast<uint4*>(xs + m * ldx + (kc << 3)) = v;
    }
  } else {
    const u16* xb = reinterpret_cast<const u16*>(x);
    for (int c = threadIdx.x; c < M * K; c += blockDim.x) {
      const int m = c / K;
      xs[m * ldx + (c - m * K)] = xb[c];
    }
  }
  __syncthreads();

  const bool a_ok = g < M, b_ok = g + 8 < M;  // x rows g and g + 8 exist (else zeros)
  const u16* xa = xs + g * ldx;
  const u16* xb = xs + (g + 8) * ldx;
  // Four independent MMA chains (slot parity x first/second MMA of a step): a chain of 4 MMAs an
  // element instead of 16, so each slot's MMAs, and its refill, come sooner after its data.
  float c[4][4];
#pragma unroll
  for (int j = 0; j < 4; ++j) c[j][0] = c[j][1] = c[j][2] = c[j][3] = 0.0f;
  int tile = blockIdx.x, round = 0, par = 0;
  for (int e = 0; e < E; ++e) {
    int nround = round + 1, ntile = tile;
    if (nround == R) {
      nround = 0;
      ntile += G;
    }
    const int nn = ntile * 8 + g;
    const bool nrow_ok = e + 1 < E && nn < N;
    const T* nrow = w + (size_t)(nn < N ? nn : N - 1) * (size_t)K;
#pragma unroll
    for (int u = 0; u < V2_SLOTS; ++u) {
      // No branch on st < S: a slot past K holds zero weights and zero x (the MMAs add exact
      // zeros), and branch-free slots let the compiler issue each refill right after its MMAs.
      const int kk = (((round * V2_SLOTS + u) * kw + warp) << 5) + (t << 3);
      const bool kin = kk < K;
      const uint4 a = (a_ok && kin) ? *reinterpret_cast<const uint4*>(xa + kk) : zero4();
      const uint4 b = (b_ok && kin) ? *reinterpret_cast<const uint4*>(xb + kk) : zero4();
      mma16816<T>(c[(u & 1) * 2], a.x, b.x, a.y, b.y, ring[u].x, ring[u].y);
      mma16816<T>(c[(u & 1) * 2 + 1], a.z, b.z, a.w, b.w, ring[u].z, ring[u].w);
      const int nk = (((nround * V2_SLOTS + u) * kw + warp) << 5) + (t << 3);
      ring[u] = ld_stream_if(nrow + nk, nrow_ok && nk < K);
    }
    if (round == R - 1) {  // the tile is done: add the kw warps' partial sums in warp order
      float p[4];
#pragma unroll
      for (int h = 0; h < 4; ++h) p[h] = (c[0][h] + c[1][h]) + (c[2][h] + c[3][h]);
      float* r = red + (par * kw + warp) * 128;
      r[g * 8 + 2 * t] = p[0];
      r[g * 8 + 2 * t + 1] = p[1];
      r[(g + 8) * 8 + 2 * t] = p[2];
      r[(g + 8) * 8 + 2 * t + 1] = p[3];
      __syncthreads();
      const float* rr = red + par * kw * 128;
      for (int i = threadIdx.x; i < M * 8; i += blockDim.x) {
        const int n = tile * 8 + (i & 7);
        if (n < N) {
          float s = rr[i];
          for (int q = 1; q < kw; ++q) s += rr[q * 128 + i];
          y[(size_t)(i >> 3) * N + n] = Elem<T>::from_f(s);
        }
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) c[j][0] = c[j][1] = c[j][2] = c[j][3] = 0.0f;
      par ^= 1;  // the next tile writes the other buffer; this one is rewritten after a barrier
    }
    tile = ntile;
    round = nround;
  }
}

// --- v2 decode GEMV: 4-bit (block >= 32) and MXFP4 over many output columns (fp16/bf16) --------
//
// `ep_gemv_<fmt>_v2_<dt>`: the vocabulary projection at HBM speed. Same ownership as the
// streaming kernel (a warp owns whole 16-row groups over all of K, persistent grid, no K split),
// rebuilt for instruction count, which is what bounded the earlier kernels (Nsight Compute on the
// streaming one: ~470 warp-instructions per KB of weights, 0.57 issued per cycle per scheduler;
// memory-bound operation at 3.3 TB/s leaves ~300 per KB at full issue).
//
//   * Weights go global -> registers directly (16-byte ld.global.nc.L1::no_allocate), in a ring of
//     V2_DEPTH steps per warp: the loads for step s + D are issued right after step s is used, so
//     D - 1 to D steps (KB a warp; 16 warps an SM) stay in flight across group boundaries.
//     No shared-memory staging, no cp.async groups, no per-chunk bookkeeping: a lane
//     keeps one 64-bit base pointer per row (and per scale/zero-point row) for the current group,
//     recomputed once per group, and a step adds a 32-bit chunk offset to it.
//   * Step i of group j, lane (g, t): chunk c = 4i + t (bytes 16c.., k 32c..) of rows 16j + g and
//     16j + g + 8: each warp load covers 8 rows x 64 contiguous bytes (whole sectors).
//   * x (all M rows, zero past K) is staged once per block in shared memory, already in the
//     fragment order the dequantized weights come out in, so each B fragment is one ld.shared.v4
//     with a constant offset (conflict-free: a row is 256 bytes a step, rows 64 bytes apart mod
//     128). Lanes whose batch row is >= M read a zero row (a broadcast), so there is no predicate.
//   * q4 dequantization by the magic-number trick with one LOP3 per pair, in the order
//     (k0,k4) (k1,k5) (k2,k6) (k3,k7) of a word (that is why x is staged permuted):
//       fp16: t = (w & 0x000F000F) | 0x64006400 = 1024 + q   -> (t - (1024 + z)) * s
//             t = (w & 0x00F000F0) | 0x64006400 = 1024 + 16q -> fma(t, 1/16, -(64 + z)) * s
//             for w and w >> 8: 1 SHF + 4 LOP3 + 4 HADD2/HFMA2 + 4 HMUL2 = 13 per 8 weights;
//       bf16: t = ((w >> 4j) & 0x000F000F) | 0x43004300 = 128 + q -> (t - (128 + z)) * s:
//             3 SHF + 4 LOP3 + 8 HFMA2 = 15 per 8 weights.
//     (q - z) is exact and the product is rounded once: the dequantized weights are bitwise those
//     of the other 4-bit kernels. The scale is applied per weight, not per block after the dot
//     product: an MMA's k sum spans the 4 lanes of a quad, whose 16-byte chunks are 4 different
//     32-weight blocks, so a per-block partial sum would need a 4x4 transpose of every chunk
//     (shuffles or shared memory, ~12+ instructions per 16 bytes) plus per-word zero-point
//     constants: more than the 4 HMUL2 per 8 weights it saves.
//   * MXFP4: the E2M1 byte-permute tables of the other kernels (natural k order) and one HMUL2 per
//     pair for the E8M0 scale; x is staged in natural order.
//   * Products: mma.sync m16n8k16 with the weights as A straight from registers (A rows g, g + 8
//     = weight rows 16j + g, + 8), x as B (batch rows = B columns, 8 an MMA; M > 8 runs a second
//     MMA on the same A), fp32 accumulators in two chains (even / odd words).
//
// Instructions, counted in the sm_90 SASS of the NVRTC cubin (nvdisasm), steady-state step of the
// M <= 8 loop with zero points (one step = 1 KB of weights a warp = 2 chunks of 16 bytes a lane):
//   q4 fp16:  ~141 compute (104 dequantization = 32 LOP3 + 8 SHF + 64 HADD2/HFMA2/HMUL2, 8 HMMA,
//             4 LDS.128, ~25 scale/zero-point unpacking and loop control) + 24 loads/addresses
//             + ~12 a step of per-group work (row pointers, 4 stores) = ~177 warp-instructions
//             per KB, ~88 per 16 bytes a lane (the earlier kernels: ~470 per KB);
//   q4 bf16:  ~191 per KB (~95 per 16 bytes: 3 SHF a word instead of 1);
//   MXFP4:    ~160-240 per KB (table decode ~16 per word; fp16 converts the E8M0 scale per row and
//             step through float, the largest remaining overhead).
// Budget at 3.3 TB/s: ~315 per KB at one instruction per cycle per scheduler.
// Bytes in flight: D = 4 ring slots of 1 KB a warp (3 to 4 outstanding), 16 warps an SM: 48-64 KB
// an SM (M > 8: D = 3, 32-48 KB); HBM needs roughly 32-40 KB an SM. ptxas (sm_90): 126/127
// registers (q4 fp16/bf16), 115/121 (MXFP4), no spills, 16 x (256 x steps + 64) bytes of
// dynamic shared memory (29.7 KB at K = 896).

// A row's result is one warp's fixed sequence of MMAs over its group's steps: independent of M
// (lanes of other batch rows only change other B columns), of N, of the grid and of timing, so a
// piece of a weight (split_n) computes each of its rows exactly as the whole weight does.
// Rows past N and chunks past the row end load clamped (in-bounds) addresses: rows past N are
// never stored, and a chunk past the row meets x = 0 (k >= K) with the finite weights of a real
// chunk of its row. Unaligned weights fall back to `ep_gemv_<fmt>` (the plan decides).

constexpr int V2_WARPS = 16;  // warps a block; one block an SM: __launch_bounds__(512, 1)
constexpr int V2_DEPTH = 4;   // ring slots a warp (steps of 1 KB a warp); D - 1 in flight
constexpr int V2_DEPTH_TWO = 3;  // M > 8: the second B fragment set needs the registers
constexpr int V2_ZERO_ROW = 15;  // the staged x row lanes of batch rows >= M read (zero if M < 16)

template <typename T>
__device__ __forceinline__ u32 pk_fma(u32 a, u32 b, u32 c);
template <>
__device__ __forceinline__ u32 pk_fma<__half>(u32 a, u32 b, u32 c) {
  u32 r;
  asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
  return r;
}
template <>
__device__ __forceinline__ u32 pk_fma<__nv_bfloat16>(u32 a, u32 b, u32 c) {
  u32 r;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
  return r;
}

// (a & MASK) | c in one LOP3 with MASK as its immediate: c (the magic exponent) is one register
// for all four pairs, so nothing is rematerialised per pair.
template <u32 MASK>
__device__ __forceinline__ u32 and_or(u32 a, u32 c) {
  u32 r;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(a), "n"(MASK), "r"(c));
  return r;
}

// q4 word -> pairs (k0,k4) (k1,k5) (k2,k6) (k3,k7) of (q - z) * s. magic: the magic exponent in
// both halves; zc: (magic + z) in both halves; zh (fp16 only): -(64 + z) in both halves; s2: the
// scale in both halves.
template <typename T>
__device__ __forceinline__ void q4_pairs_v2(u32 w, u32 magic, u32 s2, u32 zc, u32 zh,
                                            u32 (&p)[4]);

template <>
__device__ __forceinline__ void q4_pairs_v2<__half>(u32 w, u32 magic, u32 s2, u32 zc, u32 zh,
                                                   u32 (&p)[4]) {
  const u32 w8 = w >> 8;
  const u32 t0 = and_or<0x000F000Fu>(w, magic);   // 1024 + q   (k0, k4)
  const u32 t1 = and_or<0x00F000F0u>(w, magic);   // 1024 + 16q (k1, k5)
  const u32 t2 = and_or<0x000F000Fu>(w8, magic);  // (k2, k6)
  const u32 t3 = and_or<0x00F000F0u>(w8, magic);  // (k3, k7)
  const u32 sixteenth = 0x2C002C00u;              // 1/16 in both halves (an HFMA2 immediate)
  p[0] = pk_mul<__half>(pk_sub<__half>(t0, zc), s2);
  p[1] = pk_mul<__half>(pk_fma<__half>(t1, sixteenth, zh), s2);
  p[2] = pk_mul<__half>(pk_sub<__half>(t2, zc), s2);
  p[3] = pk_mul<__half>(pk_fma<__half>(t3, sixteenth, zh), s2);
}

template <>
__device__ __forceinline__ void q4_pairs_v2<__nv_bfloat16>(u32 w, u32 magic, u32 s2, u32 zc, u32,
                                                          u32 (&p)[4]) {
  p[0] = and_or<0x000F000Fu>(w, magic);  // 128 + q (k0, k4)
  p[1] = and_or<0x000F000Fu>(w >> 4, magic);
  p[2] = and_or<0x000F000Fu>(w >> 8, magic);
  p[3] = and_or<0x000F000Fu>(w >> 12, magic);
#pragma unroll
  for (int j = 0; j < 4; ++j) p[j] = pk_mul<__nv_bfloat16>(pk_sub<__nv_bfloat16>(p[j], zc), s2);
}

// MatMulNBits rows, block size >= 32 (a 16-byte chunk lies in one block). ZP: zero points given.
template <typename T, bool ZP>
struct Q4V2 {
  static constexpr bool kPermuted = true;  // x staged in the (k0,k4)(k1,k5).. order
  const u8* b;
  const u16* sc;  // scale bits
  const u8* zp;
  int N, row_bytes, chunks, kb, zp_row, e;  // e = log2(block) - 5: chunk c is in block c >> e
  struct Rows {                              // a lane's two rows of the current group
    const u8* w[2];
    const u16* s[2];
    const u8* z[2];
  };
  struct Raw {
    uint4 q[2];
    u32 s[2], z[2];  // raw scale bits; raw zero-point byte
  };
  __device__ int steps() const { return (row_bytes + 63) >> 6; }
  __device__ void rows(int j, int g, Rows& r) const {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int n = min((j << 4) + g + 8 * h, N - 1);  // past N: an in-bounds row, never stored
      r.w[h] = b + (size_t)n * (size_t)row_bytes;
      r.s[h] = sc + (size_t)n * (size_t)kb;
      if (ZP) r.z[h] = zp + (size_t)n * (size_t)zp_row;
    }
  }
  __device__ int chunk(int i, int t) const { return min((i << 2) + t, chunks - 1); }
  __device__ void load(const Rows& r, int i, int t, Raw& o) const {
    const u32 c = (u32)chunk(i, t);
    const u32 blk = c >> e;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      o.q[h] = ld_stream(r.w[h] + (c << 4));
      o.s[h] = (u32)__ldg(r.s[h] + blk);
      if (ZP) o.z[h] = (u32)__ldg(r.z[h] + (blk >> 1));
    }
  }
  // The step's A pairs of word u for row h.
  struct Dec {
    u32 magic, s2[2], zc[2], zh[2];
  };
  __device__ void decode(const Raw& r, int i, int t, Dec& d) const {
    d.magic = Elem<T>::kMagic * 0x10001u;
    u32 shift = 0u;
    if (ZP) shift = ((u32)chunk(i, t) >> e & 1u) << 2;  // the block's nibble of its zp byte
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      d.s2[h] = __byte_perm(r.s[h], 0u, 0x1010u);
      const u32 z = ZP ? (r.z[h] >> shift) & 15u : 8u;
      d.zc[h] = d.magic + z * 0x10001u;         // magic + z
      d.zh[h] = 0xD400D400u + z * 0x00100010u;  // fp16 -(64 + z)
    }
  }
  __device__ static void pairs(const Raw& r, const Dec& d, int h, int u, u32 (&p)[4]) {
    q4_pairs_v2<T>(word_at(r.q[h], u), d.magic, d.s2[h], d.zc[h], d.zh[h], p);
  }
};

// MXFP4 rows: chunk c of a row is MX block c, its E8M0 scale byte c.
template <typename T>
struct Mx4V2 {
  static constexpr bool kPermuted = false;  // natural k order (the E2M1 tables' order)
  const u8* b;
  const u8* sc;
  int N, row_bytes, chunks;
  struct Rows {
    const u8* w[2];
    const u8* s[2];
  };
  struct Raw {
    uint4 q[2];
    u32 s[2];
  };
  struct Dec {
    u32 s2[2];
  };
  __device__ int steps() const { return (row_bytes + 63) >> 6; }
  __device__ void rows(int j, int g, Rows& r) const {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int n = min((j << 4) + g + 8 * h, N - 1);
      r.w[h] = b + (size_t)n * (size_t)row_bytes;
      r.s[h] = sc + (size_t)n * (size_t)chunks;
    }
  }
  __device__ void load(const Rows& r, int i, int t, Raw& o) const {
    const u32 c = (u32)min((i << 2) + t, chunks - 1);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      o.q[h] = ld_stream(r.w[h] + (c << 4));
      o.s[h] = (u32)__ldg(r.s[h] + c);
    }
  }
  __device__ void decode(const Raw& r, int, int, Dec& d) const {
#pragma unroll
    for (int h = 0; h < 2; ++h) d.s2[h] = e8m0_bits<T>(r.s[h]) * 0x10001u;
  }
  __device__ static void pairs(const Raw& r, const Dec& d, int h, int u, u32 (&p)[4]) {
    e2m1_pairs<T>(word_at(r.q[h], u), p);
#pragma unroll
    for (int j = 0; j < 4; ++j) p[j] = pk_mul<T>(p[j], d.s2[h]);
  }
};

// The 4 B-fragment vectors of one step: 16 bytes at addr, +64, +128, +192 of the shared window.
__device__ __forceinline__ void lds4x4(u32 addr, uint4 (&v)[4]) {
  asm volatile(
      "ld.shared.v4.u32 {%0, %1, %2, %3}, [%16];\n\t"
      "ld.shared.v4.u32 {%4, %5, %6, %7}, [%16+64];\n\t"
      "ld.shared.v4.u32 {%8, %9, %10, %11}, [%16+128];\n\t"
      "ld.shared.v4.u32 {%12, %13, %14, %15}, [%16+192];"
      : "=r"(v[0].x), "=r"(v[0].y), "=r"(v[0].z), "=r"(v[0].w), "=r"(v[1].x), "=r"(v[1].y),
        "=r"(v[1].z), "=r"(v[1].w), "=r"(v[2].x), "=r"(v[2].y), "=r"(v[2].z), "=r"(v[2].w),
        "=r"(v[3].x), "=r"(v[3].y), "=r"(v[3].z), "=r"(v[3].w)
      : "r"(addr)
      : "memory");
}

// x[M, K] -> shared rows of 256 * S + 64 bytes: row r, step i, word u, lane t at
// r * xrow + 256 i + 64 u + 16 t holds x[r][128 i + 32 t + 8 u ..+8] (zero past K), permuted to
// (k0,k4)(k1,k5)(k2,k6)(k3,k7) when PERM. Rows M..14 are never read; row 15 is zero when M < 16.
template <typename T, bool PERM>
__device__ __forceinline__ void v2_stage_x(u8* xs, const T* __restrict__ x, int M, int K, int S,
                                           int xrow, bool xv) {
  const int per_row = S << 4;
  const int units = 16 * per_row;
  for (int q = threadIdx.x; q < units; q += blockDim.x) {
    const int r = q / per_row;
    if (r >= M && r != V2_ZERO_ROW) continue;
    const int rest = q - r * per_row;
    const int i = rest >> 4, u = (rest >> 2) & 3, t = rest & 3;
    uint4 v = zero4();
    if (r < M) {
      v = load_chunk<T>(x + (size_t)r * (size_t)K, (i << 7) + (t << 5) + (u << 3), K, xv, false);
    }
    if (PERM) {
      v = make_uint4(__byte_perm(v.x, v.z, 0x5410u), __byte_perm(v.x, v.z, 0x7632u),
                     __byte_perm(v.y, v.w, 0x5410u), __byte_perm(v.y, v.w, 0x7632u));
    }
    *reinterpret_cast<uint4*>(xs + r * xrow + (i << 8) + (u << 6) + (t << 4)) = v;
  }
}

template <typename T, class P, bool TWO>
__device__ __forceinline__ void v2_run(const P& wp, T* __restrict__ y, const T* __restrict__ x,
                                       u8* xs, int M, int N, int K, bool xv, int j0, int j1) {
  constexpr int D = TWO ? V2_DEPTH_TWO : V2_DEPTH;
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const int S = wp.steps();
  const int xrow = (S << 8) + 64;
  const int total = (j1 - j0) * S;  // warp-uniform, as everything the loop branches on
  typename P::Rows lr;
  typename P::Raw ring[D];
  int lj = j0, li = 0;  // the (group, step) loaded next
  wp.rows(lj, g, lr);
  // The first D steps go out before x is staged: their latency overlaps the staging.
#pragma unroll
  for (int d = 0; d < D; ++d) {
    if (d < total) {
      wp.load(lr, li, t, ring[d]);
      if (++li == S) {
        li = 0;
        wp.rows(++lj, g, lr);
      }
    }
  }
  v2_stage_x<T, P::kPermuted>(xs, x, M, K, S, xrow, xv);
  __syncthreads();
  // B fragments: this lane's batch row g (and g + 8), or the zero row; shared-window addresses
  // that advance 256 bytes a step and return at the end of a group.
  const u32 xa0 = smem_addr(xs) + (u32)((g < M ? g : V2_ZERO_ROW) * xrow + (t << 4));
  const u32 xb0 = smem_addr(xs) + (u32)((g + 8 < M ? g + 8 : V2_ZERO_ROW) * xrow + (t << 4));
  u32 xa = xa0, xb = xb0;
  float c[2][2][4];  // [batch rows 0-7 | 8-15][even | odd words][fragment]
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int q = 0; q < 2; ++q) c[h][q][0] = c[h][q][1] = c[h][q][2] = c[h][q][3] = 0.0f;
  int ci = 0, cj = j0;  // the (group, step) multiplied next
  for (int s0 = 0; s0 < total; s0 += D) {
#pragma unroll
    for (int d = 0; d < D; ++d) {
      if (s0 + d >= total) break;
      uint4 bl[4], bh[4];
      lds4x4(xa, bl);
      if (TWO) lds4x4(xb, bh);
      xa += 256u;
      xb += 256u;
      typename P::Dec dec;
      wp.decode(ring[d], ci, t, dec);
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        u32 a[4], e[4];
        P::pairs(ring[d], dec, 0, u, a);
        P::pairs(ring[d], dec, 1, u, e);
        mma16816<T>(c[0][u & 1], a[0], e[0], a[1], e[1], bl[u].x, bl[u].y);
        mma16816<T>(c[0][u & 1], a[2], e[2], a[3], e[3], bl[u].z, bl[u].w);
        if (TWO) {
          mma16816<T>(c[1][u & 1], a[0], e[0], a[1], e[1], bh[u].x, bh[u].y);
          mma16816<T>(c[1][u & 1], a[2], e[2], a[3], e[3], bh[u].z, bh[u].w);
        }
      }
      // The slot is free: refill it with the step D ahead.
      if (s0 + d + D < total) {
        wp.load(lr, li, t, ring[d]);
        if (++li == S) {
          li = 0;
          wp.rows(++lj, g, lr);
        }
      }
      if (++ci == S) {  // group cj is complete
        store_group<T, TWO>(y, c, cj, g, t, M, N);
        ci = 0;
        ++cj;
        xa = xa0;
        xb = xb0;
      }
    }
  }
}

template <typename T, class P>
__device__ __forceinline__ void v2_gemv(const P& wp, T* __restrict__ y, const T* __restrict__ x,
                                        int M, int N, int K, u32 flags) {
  extern __shared__ __align__(16) u8 v2_xs[];
  const int warp = threadIdx.x >> 5;
  const long long warps = (long long)gridDim.x * V2_WARPS;
  const long long gw = (long long)blockIdx.x * V2_WARPS + warp;
  const long long groups = ((long long)N + 15) >> 4;
  const int j0 = (int)(gw * groups / warps), j1 = (int)((gw + 1) * groups / warps);
  const bool xv = (flags & EPK_X16) != 0;
  if (M > 8) {  // uniform for the launch: one branch-free loop for each case
    v2_run<T, P, true>(wp, y, x, v2_xs, M, N, K, xv, j0, j1);
  } else {
    v2_run<T, P, false>(wp, y, x, v2_xs, M, N, K, xv, j0, j1);
  }
}

template <typename T, bool ZP>
__device__ __forceinline__ Q4V2<T, ZP> q4_v2(const u8* b, const T* scales, const u8* zp, int N,
                                              int kb, int bs_shift) {
  Q4V2<T, ZP> p;
  p.b = b;
  p.sc = reinterpret_cast<const u16*>(scales);
  p.zp = zp;
  p.N = N;
  p.row_bytes = (kb << bs_shift) >> 1;
  p.chunks = p.row_bytes >> 4;
  p.kb = kb;
  p.zp_row = (kb + 1) >> 1;
  p.e = bs_shift - 5;
  return p;
}

template <typename T>
__device__ __forceinline__ Mx4V2<T> mx4_v2(const u8* b, const u8* scales, int N, int K) {
  Mx4V2<T> p;
  p.b = b;
  p.sc = scales;
  p.N = N;
  p.row_bytes = K >> 1;
  p.chunks = K >> 5;
  return p;
}


// --- packed 4-bit GEMV (q4p): MatMulNBits weights of block 32, repacked for the MMA -----------
//
// `ep_gemv_q4p_<dt>` (fp16/bf16, decode, M <= 16) reads a weight `ep.kernels.q4p.pack_q4`
// repacked once (at load): the v2 GEMV's A-operand design, with the layout chosen so that each
// MMA's 16 k lie in one quantization block. Then the A operand is the exact integer q - z (magic
// number, LOP3, one HSUB2 a pair; fp16 folds two of the shifts into HFMA2s by 1/16) and the
// block's scale is applied once to the fp32 product of its two MMAs, instead of one HMUL2 per
// weight pair; and a warp's weights, scales and zero points are each one contiguous stream, so a
// step's addresses are one add. By design, per 16 bytes a lane (bf16, M <= 8): 1 LDG.128 +
// 1 LDG.64 (+ 1 LDG.16 with zero points), 2 LDS.128, 12 SHF + 16 LOP3 + 16 HSUB2, 4 HMMA, 8
// FFMA, against ~95 warp-instructions for the v2 GEMV. What decided its speed on the H200 was
// bytes in flight, not instructions: with a ring of 4 steps and 3 blocks an SM (85 registers,
// spilling) it was 4 % faster than v2; with 6 steps a warp and 2 blocks an SM (121 registers, no
// spills) 32 % (ep/kernels/q4p.py: RINGS).
//
// Layout (G = ceil(N / 16) row groups, S = ceil(K / 64) steps of 64 k = two blocks):
//   weights  uint4 [G][S][32 lanes]: lane (g, t)'s 4 words; word u is MMA u of the step (block
//            u >> 1, k 64s + 16u ..) and holds its A fragment: nibbles r and 4 + r are register r's
//            low and high element, r = 0: row g, k 2t, 2t + 1; r = 1: row g + 8, the same k;
//            r = 2: row g, k 2t + 8, 2t + 9; r = 3: row g + 8, those k;
//   scales   T [G][S][8 g][4]: block b's scale of row g + 8h at 2b + h;
//   zeros    u16 [G][S][8 g]: block b's zero point of row g + 8h in nibble 2b + h.
// Rows past N and k past K are zero weights, zero scales and zero point 8 (x is zero past K).
// A warp owns whole groups (a contiguous range: one contiguous stream of each array), walked
// with a ring of D steps (the template's) in flight across group boundaries; x is staged once a
// block in shared memory in B-fragment order ([16 rows][S][t][u][b0, b1], a lane's step one
// 32-byte read).

constexpr int Q4P_WARPS = 8;  // warps a block (blocks an SM: the entry's launch bounds)

// Word w of an MMA -> its A registers of (q - z): zr[h] is (magic + z) of row g + 8h in both
// halves, zh[h] (fp16) -(64 + z).
template <typename T>
__device__ __forceinline__ void q4p_pairs(u32 w, u32 magic, const u32 (&zr)[2],
                                          const u32 (&zh)[2], u32 (&a)[4]);

template <>
__device__ __forceinline__ void q4p_pairs<__half>(u32 w, u32 magic, const u32 (&zr)[2],
                                                  const u32 (&zh)[2], u32 (&a)[4]) {
  const u32 w8 = w >> 8;
  const u32 sixteenth = 0x2C002C00u;  // 1/16 in both halves
  a[0] = pk_sub<__half>(and_or<0x000F000Fu>(w, magic), zr[0]);
  a[1] = pk_fma<__half>(and_or<0x00F000F0u>(w, magic), sixteenth, zh[1]);
  a[2] = pk_sub<__half>(and_or<0x000F000Fu>(w8, magic), zr[0]);
  a[3] = pk_fma<__half>(and_or<0x00F000F0u>(w8, magic), sixteenth, zh[1]);
}

template <>
__device__ __forceinline__ void q4p_pairs<__nv_bfloat16>(u32 w, u32 magic, const u32 (&zr)[2],
                                                         const u32 (&)[2], u32 (&a)[4]) {
  a[0] = pk_sub<__nv_bfloat16>(and_or<0x000F000Fu>(w, magic), zr[0]);
  a[1] = pk_sub<__nv_bfloat16>(and_or<0x000F000Fu>(w >> 4, magic), zr[1]);
  a[2] = pk_sub<__nv_bfloat16>(and_or<0x000F000Fu>(w >> 8, magic), zr[0]);
  a[3] = pk_sub<__nv_bfloat16>(and_or<0x000F000Fu>(w >> 12, magic), zr[1]);
}

// A scale pair (rows g, g + 8 of one block) as floats.
template <typename T>
__device__ __forceinline__ void q4p_scales(u32 v, float& lo, float& hi);
template <>
__device__ __forceinline__ void q4p_scales<__nv_bfloat16>(u32 v, float& lo, float& hi) {
  lo = __uint_as_float(v << 16);
  hi = __uint_as_float(v & 0xFFFF0000u);
}
template <>
__device__ __forceinline__ void q4p_scales<__half>(u32 v, float& lo, float& hi) {
  lo = __half2float(__ushort_as_half((unsigned short)(v & 0xFFFFu)));
  hi = __half2float(__ushort_as_half((unsigned short)(v >> 16)));
}

// A block's two MMAs (words a0, a1; B fragments b) into a fresh fp32 sum, added to acc scaled by
// the block's scales of rows g (slo) and g + 8 (shi).
template <typename T>
__device__ __forceinline__ void q4p_block(float (&acc)[4], const u32 (&a0)[4], const u32 (&a1)[4],
                                          const uint4& b, float slo, float shi) {
  float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  mma16816<T>(c, a0[0], a0[1], a0[2], a0[3], b.x, b.y);
  mma16816<T>(c, a1[0], a1[1], a1[2], a1[3], b.z, b.w);
  acc[0] = fmaf(slo, c[0], acc[0]);
  acc[1] = fmaf(slo, c[1], acc[1]);
  acc[2] = fmaf(shi, c[2], acc[2]);
  acc[3] = fmaf(shi, c[3], acc[3]);
}

// A lane's 32 bytes of a step's staged x: the B fragments of its 4 MMAs.
__device__ __forceinline__ void q4p_lds(u32 addr, uint4 (&v)[2]) {
  asm volatile(
      "ld.shared.v4.u32 {%0, %1, %2, %3}, [%8];\n\t"
      "ld.shared.v4.u32 {%4, %5, %6, %7}, [%8+16];"
      : "=r"(v[0].x), "=r"(v[0].y), "=r"(v[0].z), "=r"(v[0].w), "=r"(v[1].x), "=r"(v[1].y),
        "=r"(v[1].z), "=r"(v[1].w)
      : "r"(addr)
      : "memory");
}

// x[M, K] -> shared [16][xr bytes]: row m, step s, lane t at m * xr + 128 s + 32 t: for u = 0..3
// the B fragment (b0, b1) of MMA u = x[m][64 s + 16 u + 2t, + 1] and [.. + 8, + 9] (zero past K
// and for rows M..15).
template <typename T>
__device__ __forceinline__ void q4p_stage_x(u8* xs, const T* __restrict__ x, int M, int K, int S,
                                            int xr, bool xv) {
  const int rows = M > 8 ? 16 : 8;  // rows 8..15 are read only when M > 8
  for (int q = threadIdx.x; q < rows * S; q += blockDim.x) {
    const int m = q / S, s = q - m * S;
    u32 in[32];  // the step's 64 k as 32 pairs
#pragma unroll
    for (int c = 0; c < 8; ++c) {
      uint4 v = zero4();
      if (m < M) v = load_chunk<T>(x + (size_t)m * K, (s << 6) + (c << 3), K, xv, false);
      in[4 * c] = v.x;
      in[4 * c + 1] = v.y;
      in[4 * c + 2] = v.z;
      in[4 * c + 3] = v.w;
    }
    uint4* row = reinterpret_cast<uint4*>(xs + m * xr + (s << 7));
#pragma unroll
    for (int t = 0; t < 4; ++t) {  // pair index of (u, h): 8u + t + 4h
      row[2 * t] = make_uint4(in[t], in[t + 4], in[8 + t], in[8 + t + 4]);
      row[2 * t + 1] = make_uint4(in[16 + t], in[16 + t + 4], in[24 + t], in[24 + t + 4]);
    }
  }
}

// The formats a packed GEMV reads beside its weight words (`packed_run`'s F): where a step's scales
// (and zero points) are, and how a word and a slot become a block's A registers and its two scales.
// Q4P: MatMulNBits' scales T [G][S][8 g][4] (a lane's uint2) and zero points u16 [G][S][8 g].
template <typename T, bool ZP>
struct Q4PFormat {
  typedef uint2 Slot;  // a step's scales (its zero points: `zero`, a second ring)
  static constexpr u32 magic = Elem<T>::kMagic * 0x10001u;
  static constexpr u32 zr8 = magic + 8u * 0x10001u;  // zero point 8 (no zero points given)
  static constexpr u32 zh8 = 0xD400D400u + 8u * 0x00100010u;
  const uint2* __restrict__ sc;
  const u16* __restrict__ zp;
  __device__ __forceinline__ Q4PFormat(const void* scales, const void* zeros)
      : sc(reinterpret_cast<const uint2*>(scales)), zp(reinterpret_cast<const u16*>(zeros)) {}
  __device__ __forceinline__ void start(size_t first, int g) {
    sc += first * 8 + g;
    zp += first * 8 + g;
  }
  __device__ __forceinline__ Slot load(size_t i) const { return __ldg(sc + i * 8); }
  __device__ __forceinline__ u32 zero(size_t i) const { return ZP ? (u32)__ldg(zp + i * 8) : 0u; }
  __device__ __forceinline__ void block(const uint4& q, const Slot& v, u32 zw, int b,
                                        u32 (&a0)[4], u32 (&a1)[4], float& slo, float& shi) const {
    u32 zr[2], zh[2];
    if (ZP) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const u32 z = (zw >> (8 * b + 4 * h)) & 15u;
        zr[h] = magic + z * 0x10001u;
        zh[h] = 0xD400D400u + z * 0x00100010u;
      }
    } else {
      zr[0] = zr8, zr[1] = zr8, zh[0] = zh8, zh[1] = zh8;
    }
    q4p_pairs<T>(word_at(q, 2 * b), magic, zr, zh, a0);
    q4p_pairs<T>(word_at(q, 2 * b + 1), magic, zr, zh, a1);
    q4p_scales<T>(b == 0 ? v.x : v.y, slo, shi);
  }
};

template <typename T, int D, bool TWO, class F>
__device__ __forceinline__ void packed_run(F f, T* __restrict__ y, const T* __restrict__ x,
                                           const uint4* __restrict__ wq, u8* xs, int M, int N,
                                           int K, int S, int j0, int j1, u32 flags) {
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const int total = (j1 - j0) * S;  // warp-uniform
  const size_t first = (size_t)j0 * S;
  wq += first * 32 + lane;
  f.start(first, g);
  uint4 rq[D];
  typename F::Slot rs[D];
  u32 rz[D];  // zero points (q4p with EPK_ZP; else never read)
  PdlWait ready(flags);  // EPK_EARLY (resident weights): the ring's first steps load before it
#pragma unroll
  for (int d = 0; d < D; ++d) {
    if (d < total) {
      rq[d] = ld_stream(wq + d * 32);
      rs[d] = f.load(d);
      rz[d] = f.zero(d);
    }
  }
  ready();
  const int xr = (S << 7) + 16;
  q4p_stage_x<T>(xs, x, M, K, S, xr, (flags & EPK_X16) != 0);
  __syncthreads();
  const u32 xa = smem_addr(xs) + (u32)(g * xr + (t << 5));
  const u32 xb = xa + (u32)(8 * xr);
  float acc[2][4];
#pragma unroll
  for (int h = 0; h < 2; ++h) acc[h][0] = acc[h][1] = acc[h][2] = acc[h][3] = 0.0f;
  int si = 0, cj = j0;
  for (int s0 = 0; s0 < total; s0 += D) {
#pragma unroll
    for (int d = 0; d < D; ++d) {
      const int idx = s0 + d;
      if (idx >= total) break;
      uint4 bl[2], bh[2];
      q4p_lds(xa + (u32)(si << 7), bl);
      if (TWO) q4p_lds(xb + (u32)(si << 7), bh);
      const uint4 q = rq[d];
      const typename F::Slot sv = rs[d];
      const u32 zw = rz[d];
#pragma unroll
      for (int b = 0; b < 2; ++b) {
        u32 a0[4], a1[4];
        float slo, shi;
        f.block(q, sv, zw, b, a0, a1, slo, shi);
        q4p_block<T>(acc[0], a0, a1, bl[b], slo, shi);
        if (TWO) q4p_block<T>(acc[1], a0, a1, bh[b], slo, shi);
      }
      if (idx + D < total) {  // the slot is free: refill it with the step D ahead
        rq[d] = ld_stream(wq + (size_t)(idx + D) * 32);
        rs[d] = f.load((size_t)(idx + D));
        rz[d] = f.zero((size_t)(idx + D));
      }
      if (++si == S) {  // group cj is complete: rows 16 cj + g (+ 8), batch rows 2t, 2t + 1 (+ 8)
        const int n = (cj << 4) + g;
#pragma unroll
        for (int h = 0; h < (TWO ? 2 : 1); ++h) {
          const int m = 2 * t + 8 * h;
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int mm = m + (e & 1), nn = n + ((e >> 1) << 3);
            if (mm < M && nn < N) y[(size_t)mm * N + nn] = Elem<T>::from_f(acc[h][e]);
            acc[h][e] = 0.0f;
          }
        }
        si = 0;
        ++cj;
      }
    }
  }
}

// A warp's range of row groups [j0, j1) of a packed GEMV's persistent grid.
__device__ __forceinline__ void packed_range(int N, int& j0, int& j1) {
  const long long warps = (long long)gridDim.x * Q4P_WARPS;
  const long long gw = (long long)blockIdx.x * Q4P_WARPS + (threadIdx.x >> 5);
  const long long groups = ((long long)N + 15) >> 4;
  j0 = (int)(gw * groups / warps);
  j1 = (int)((gw + 1) * groups / warps);
}

// A packed GEMV over the format `fa` (when `a`) or `fb` (two compile-time variants of one format:
// q4p with and without zero points, mx4p with the exact or the fast E8M0 decode). D: ring slots a
// warp (steps of 512 bytes a warp; D - 1 in flight while one is used). M > 8 or not is uniform for
// the launch: one branch-free loop for each case and each variant.
template <typename T, int D, class FA, class FB>
__device__ __forceinline__ void packed_gemv(const FA& fa, const FB& fb, bool a,
                                            T* __restrict__ y, const T* __restrict__ x,
                                            const u8* b, int M, int N, int K, u32 flags) {
  extern __shared__ __align__(16) u8 q4p_xs[];
  const int S = (K + 63) >> 6;
  int j0, j1;
  packed_range(N, j0, j1);
  const uint4* wq = reinterpret_cast<const uint4*>(b);
  if (M > 8) {
    if (a) packed_run<T, D, true>(fa, y, x, wq, q4p_xs, M, N, K, S, j0, j1, flags);
    else packed_run<T, D, true>(fb, y, x, wq, q4p_xs, M, N, K, S, j0, j1, flags);
  } else {
    if (a) packed_run<T, D, false>(fa, y, x, wq, q4p_xs, M, N, K, S, j0, j1, flags);
    else packed_run<T, D, false>(fb, y, x, wq, q4p_xs, M, N, K, S, j0, j1, flags);
  }
}

template <typename T, int D>
__device__ __forceinline__ void q4p_gemv(T* __restrict__ y, const T* __restrict__ x,
                                         const u8* b, const T* scales, const void* zp, int M,
                                         int N, int K, u32 flags) {
  packed_gemv<T, D>(Q4PFormat<T, true>(scales, zp), Q4PFormat<T, false>(scales, zp),
                    (flags & EPK_ZP) != 0, y, x, b, M, N, K, flags);
}

// --- packed MXFP4 GEMV (mx4p): OCP MXFP4 weights in the q4p layout -------------------------------
//
// `ep_gemv_mx4p_<dt>` (fp16/bf16, decode, M <= 16) runs `packed_run` over a weight
// `ep.kernels.q4p.pack_mx4` repacked once: the q4p geometry (each MMA's 16 k in one 32-block, a
// warp's weights and scales two contiguous streams), no zero points, and E8M0 scale bytes
// [G][S][8 g][4] (block b's scale of row g + 8h at byte 2b + h; a lane reads one u32 a step).
//
// Dequantization in registers, exact, without tables: an E2M1 code (s, e1 e0, m) whose 3
// magnitude bits sit in the lowest exponent bits and the top mantissa bit of a 16-bit float (bf16:
// bits 8..6, fp16: 11..9) and whose sign sits in bit 15 is e2m1 x 2^(1 - bias) exactly (e = 0 is a
// subnormal, which is exactly E2M1's subnormal); one HMUL2 by 2^(bias - 1) (bf16 2^126, fp16 2^14)
// on the CUDA cores (which keep subnormals) makes it the normal e2m1 value the MMA takes, and the
// block's E8M0 scale is applied once, in fp32, to the sum of its two MMAs (as q4p's scale).
// Putting the sign 7 (bf16) or 4 (fp16) bits above the magnitude is what a single shift-and-mask
// cannot do for all four registers of a word (those 4-bit shapes do not tile the word; checked
// exhaustively, also with funnel shifts over a step's four words). So the packer stores each word
// XOR-encoded over GF(2): register r of a word w is ((rotl(w, a) ^ rotl(w, b)) & MASK) or
// (rotl(w, a) & MASK), with rotations chosen so that the map from w to the four registers' 32
// bits is invertible; `pack_mx4` stores its inverse applied to the codes (ep/kernels/q4p.py:
// _MX4_ROTATIONS; the NumPy twin decodes with these same rotations). Four registers need at
// least four distinct non-zero rotations (fewer leave the map singular: exhaustive search).
//
// Per 16 bytes a lane (one step, bf16 or fp16, M <= 8): 1 LDG.128 + 1 LDG.32 (the scales), 2
// LDS.128, 16 SHF + 16 LOP3 + 16 HMUL2 (q4p: 12 SHF + 16 LOP3 + 16 HSUB2, no zero points), 4 HMMA,
// 8 FFMA, 8 SHF/LOP3 for the four scales (q4p: 4), so about 8 instructions a step more than q4p.
// E8M0 bytes 0 (2^-127, an fp32 subnormal) and 255 (NaN) do not fit the scale's two-instruction
// decode (byte << 23): `pack_mx4` reports them and the launch then takes the exact decode
// (`e8m0_f32`, EPK_E8X) for the whole weight.

__device__ __forceinline__ u32 rotl(u32 w, int n) { return __funnelshift_l(w, w, n); }

template <u32 MASK>
__device__ __forceinline__ u32 xor_and(u32 a, u32 b) {
  u32 r;
  asm("lop3.b32 %0, %1, %2, %3, 0x28;" : "=r"(r) : "r"(a), "r"(b), "n"(MASK));  // (a ^ b) & c
  return r;
}

// An XOR-encoded word -> the four A registers of its MMA, each pair e2m1 exactly (fix: 2^(bias-1)
// in both halves). The rotations are _MX4_ROTATIONS in ep/kernels/q4p.py.
template <typename T>
__device__ __forceinline__ void mx4p_pairs(u32 w, u32 fix, u32 (&a)[4]);
template <typename T>
__device__ __forceinline__ u32 mx4p_fix();  // 2^(bias - 1) in both halves
template <>
__device__ __forceinline__ u32 mx4p_fix<__nv_bfloat16>() { return 0x7E807E80u; }  // 2^126
template <>
__device__ __forceinline__ u32 mx4p_fix<__half>() { return 0x74007400u; }  // 2^14

template <>
__device__ __forceinline__ void mx4p_pairs<__nv_bfloat16>(u32 w, u32 fix, u32 (&a)[4]) {
  constexpr u32 kMask = 0x81C081C0u;  // sign 15, exponent bits 8..7, mantissa bit 6 (each half)
  const u32 w2 = rotl(w, 2);
  a[0] = pk_mul<__nv_bfloat16>(w & kMask, fix);
  a[1] = pk_mul<__nv_bfloat16>(rotl(w, 12) & kMask, fix);
  a[2] = pk_mul<__nv_bfloat16>(xor_and<kMask>(w2, rotl(w, 6)), fix);
  a[3] = pk_mul<__nv_bfloat16>(xor_and<kMask>(w2, rotl(w, 8)), fix);
}

template <>
__device__ __forceinline__ void mx4p_pairs<__half>(u32 w, u32 fix, u32 (&a)[4]) {
  constexpr u32 kMask = 0x8E008E00u;  // sign 15, exponent bits 11..10, mantissa bit 9 (each half)
  a[0] = pk_mul<__half>(rotl(w, 2) & kMask, fix);
  a[1] = pk_mul<__half>(xor_and<kMask>(w, rotl(w, 6)), fix);
  a[2] = pk_mul<__half>(xor_and<kMask>(w, rotl(w, 9)), fix);
  a[3] = pk_mul<__half>(xor_and<kMask>(w, rotl(w, 13)), fix);
}

// MX4P: E8M0 bytes [G][S][8 g][4] (a lane's u32). XS: decode every byte exactly (0: 2^-127, 255:
// NaN, `e8m0_f32`); else byte << 23 (exact for 1..254, which is all `pack_mx4` lets through then).
template <typename T, bool XS>
struct MX4PFormat {
  typedef u32 Slot;
  const u32* __restrict__ sc;
  u32 fix;
  __device__ __forceinline__ explicit MX4PFormat(const void* scales)
      : sc(reinterpret_cast<const u32*>(scales)),
        fix(mx4p_fix<T>()) {}
  __device__ __forceinline__ void start(size_t first, int g) { sc += first * 8 + g; }
  __device__ __forceinline__ Slot load(size_t i) const { return __ldg(sc + i * 8); }
  __device__ __forceinline__ u32 zero(size_t) const { return 0u; }  // no zero points
  __device__ __forceinline__ void block(const uint4& q, const Slot& v, u32, int b, u32 (&a0)[4],
                                        u32 (&a1)[4], float& slo, float& shi) const {
    mx4p_pairs<T>(word_at(q, 2 * b), fix, a0);
    mx4p_pairs<T>(word_at(q, 2 * b + 1), fix, a1);
    if (XS) {
      slo = e8m0_f32((v >> (16 * b)) & 0xFFu);
      shi = e8m0_f32((v >> (16 * b + 8)) & 0xFFu);
    } else if (b == 0) {
      slo = __uint_as_float((v << 23) & 0x7F800000u);
      shi = __uint_as_float((v << 15) & 0x7F800000u);
    } else {
      slo = __uint_as_float((v << 7) & 0x7F800000u);
      shi = __uint_as_float((v >> 1) & 0x7F800000u);
    }
  }
};

template <typename T, int D>
__device__ __forceinline__ void mx4p_gemv(T* __restrict__ y, const T* __restrict__ x,
                                          const u8* b, const u8* scales, int M, int N, int K,
                                          u32 flags) {
  packed_gemv<T, D>(MX4PFormat<T, true>(scales), MX4PFormat<T, false>(scales),
                    (flags & EPK_E8X) != 0, y, x, b, M, N, K, flags);
}


// --- MXFP4 GEMV on the FP8 tensor cores (mx4f8, sm_90a) ------------------------------------------
//
// `ep_gemv_mx4f8_bf16` (bf16 activations, decode, M <= 16) reads a weight `ep.kernels.mx4f8.
// pack_mx4f8` repacked once and runs its products on Hopper's FP8 tensor cores (wgmma, a
// warpgroup of 4 warps, A from registers, B from shared memory), which only sm_90a has
// (mma.sync on e4m3 is emulated on sm_90: it unpacks to f16 first).
//
// Weights: an E2M1 code (s, e1 e0, m) placed at bits 7, 4 3, 2 of a byte is the e4m3 value
// e2m1 x 2^-6 exactly (e = 0 is the subnormal on both sides), so a code needs no arithmetic at
// all: the packer stores each word so that its two A registers are `w & MASK` and
// `(rotl(w, 2) ^ rotl(w, 4)) & MASK` (4 instructions for 8 weights, against mx4p's 12). The 2^6
// goes into the row's output factor.
//
// Activations: bf16 has 8 significant bits and e4m3 4, so x = hi + lo with hi = e4m3(x) and lo
// = e4m3(x - hi), exactly, as long as lo's exponent stays in e4m3's range. Each row of x is first
// scaled by a power of two, 2^e, that puts its largest magnitude in [128, 256): the split is then
// exact for the binade of the row's largest and the 9 below it, within 2^-17 of it below. hi and
// lo are two columns of B (column 2m: row m's hi, 2m + 1: its lo), so one wgmma of N = 8 serves
// 4 rows, and a lane's accumulator pair (columns 2t, 2t + 1) is one row's hi and lo sum. A row
// holding inf or NaN gives NaN outputs (the split has no inf).
//
// Layout (T = ceil(N / 64) tiles of 64 rows, S = ceil(K / 64) steps of two 32-blocks):
//   weights  uint4 [T][S][4 warps][32 lanes]: lane (g, t) of warp w, word 2b + j: block b's A
//            registers 2j (row 16w + g) and 2j + 1 (row 16w + g + 8), byte i of both at k 32b +
//            16j + 4t + i; register 2j from the word's bits at MASK, 2j + 1 from the rotations;
//   scales   E8M0 bytes [T][S][4 warps][8 g][4]: block b's scale of row 16w + g + 8h at 2b + h.
// Rows past N and k past K are zero codes with scale byte 0. A warpgroup owns whole tiles (the
// four warps step together, as wgmma needs), walked with a ring of D steps a warp in flight.
// x is staged once a block in shared memory as the B operand of every block: [2S blocks]
// [2 k halves][NB rows][16 bytes] (K-major, no swizzle: a k half is one 8 x 16-byte core matrix
// a row group), NB = 8, 16 or 32 for M <= 4, 8 or 16 (one wgmma of N = NB a block).
//
// Per step and lane (M <= 4): 1 LDG.128 + 1 LDG.32, 8 LOP3 + 8 SHF, 2 wgmma, 4 FADD + 4 FFMA,
// and the scale decode (mx4p: 48 decode instructions and 4 HMMA). On the H200 that alone did not
// make it faster than mx4p; deeper rings did (bytes in flight: ep/kernels/mx4f8.py, RINGS).
//
// `ep_gemv_q4f8_bf16` runs 4-bit MatMulNBits weights (block 32) through the same loop (`f8_run`,
// formats F8_Q4, F8_Q4_ZP and F8_Q4_ZP_U32): a code q in the low half of a byte is the e4m3 value
// q x 2^-9, so a word's A registers are `w & 0x0F0F0F0F` (row g) and `(w >> 4) & 0x0F0F0F0F`
// (row g + 8); `ep.kernels.q4f8.pack_q4f8` places the codes so. Its scales are bf16 ([T][S][4
// warps][8 g][4]; a lane's ring slot: `F8Scales`), its zero points 4 nibbles a lane's step
// ([T][S][4][8] uint16, read by `ep_gemv_q4f8_bf16`; `ep_gemv_q4f8_sym_bf16` takes every one as
// 8). The zero points stay out of the MMA: a block adds s (its products - z sum x) 2^-9, with
// each row of x's 32-block sums (times 2^e) staged after the row factors, and each zero point
// read as the e4m3 value of its nibble, z 2^-9 (`e4m3x2_f32`, two a conversion: exact, and 3
// instructions a step fewer than shifts, masks and int-to-float conversions; H200, d4b3, M = 1:
// 23.05 us against 23.35-23.39 in one run); the factor is 2^(9 - e).

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

constexpr int MX4F8_WARPS = 8;  // two warpgroups a block
constexpr u32 MX4F8_MASK = 0x9C9C9C9Cu;

// The weight formats F of the FP8 GEMV: MXFP4 with E8M0 scale bytes (F8_MX4; F8_MX4_EXACT decodes
// the bytes 0 and 255 exactly), and 4-bit block-quantized (MatMulNBits, block 32; q4f8 below)
// with bf16 scales and zero points 8 (F8_Q4) or given (F8_Q4_ZP, F8_Q4_ZP_U32). A lane's ring
// slot holds its scales of a step (`F8Scales`): MXFP4, its rows' 4 E8M0 bytes (u32); 4-bit with
// zero points, its rows' 4 bf16 (uint2); 4-bit without (and F8_Q4_ZP_U32), the two bf16 of its
// block t & 1 (u32), the other block's two taken from the lane beside it with a shuffle: a ring
// register a step less (107 registers for the symmetric d8b2 kernel, 120 with zero points), and
// on the H200 (NVRTC 13.0, 896 x 151936) M = 16 in 37.5 us against 41.0, M <= 8 unchanged. With
// zero points at 2 blocks an SM the shuffle was slower (d8b2: 24.5 -> 25.6 us at M = 1; 24.4 ->
// 24.9 in the twenty-fifth session), so F8_Q4_ZP keeps the uint2; at 3 blocks an SM (80
// registers; also d6b1's 24 warps) only the u32 slot leaves a ring without spills
// (`ep.kernels.q4f8`, its `_scale_slot`: F8_Q4_ZP_U32). The same bytes are read either way.
constexpr int F8_MX4 = 0, F8_MX4_EXACT = 1, F8_Q4 = 2, F8_Q4_ZP = 3, F8_Q4_ZP_U32 = 4;
template <int F>
struct F8Scales {
  typedef u32 type;
  static constexpr int kStep = 32, kLane = 1;  // a step's slots; a lane's slot: 8 g x 4 warps
};
template <>
struct F8Scales<F8_Q4> {
  typedef u32 type;
  static constexpr int kStep = 64, kLane = 2;  // a g's two slots: blocks 0 and 1
};
template <>
struct F8Scales<F8_Q4_ZP> {
  typedef uint2 type;
  static constexpr int kStep = 32, kLane = 1;
};
template <>
struct F8Scales<F8_Q4_ZP_U32> : F8Scales<F8_Q4> {};
__device__ __forceinline__ u32 f8_scales(const u32* p) { return __ldg(p); }
__device__ __forceinline__ uint2 f8_scales(const uint2* p) { return __ldg(p); }
__device__ __forceinline__ u32 f8_scales_if(const u32* p, bool ok) { return ld_u32_if(p, ok); }
__device__ __forceinline__ uint2 f8_scales_if(const uint2* p, bool ok) { return ld_u64_if(p, ok); }

// A 4-bit lane's four bf16 scales of a step as (block 0, block 1) pairs: its uint2, or its u32 of
// block t & 1 and the lane t ^ 1's of the other.
__device__ __forceinline__ uint2 f8_q4_pairs(uint2 v, int) { return v; }
__device__ __forceinline__ uint2 f8_q4_pairs(u32 v, int t) {
  const u32 other = __shfl_xor_sync(0xFFFFFFFFu, v, 1);
  return (t & 1) ? make_uint2(other, v) : make_uint2(v, other);
}

// A lane's accumulators of one block's wgmma (NB columns: NB / 2 floats).
template <int NB>
struct F8Acc {
  float d[NB / 2];
};

// Shared-memory matrix descriptor (K-major, no swizzle) as two words: the low one holds the
// address and LBO (bytes between the two k halves; `f8_desc_lo`), the high one SBO (bytes between
// row groups of 8: always 128 here), a constant the wgmma takes as an immediate, so that a step
// adds to the low word only (32-bit arithmetic; before, a 64-bit multiply-add and its carry a
// step. H200, 896 x 151936, M = 1, with the unzeroed ring slots below: the symmetric 4-bit GEMV
// 21.6-22.2 us against 22.4-22.8, docs/benchmarks/h200.md, twenty-fifth session).
constexpr unsigned long long F8_DESC_HI = (unsigned long long)(128 >> 4) << 32;
__device__ __forceinline__ u32 f8_desc_lo(u32 addr, u32 lbo) {
  return ((addr & 0x3FFFFu) >> 4) | ((lbo >> 4) << 16);
}

// D = A x B (scale-d 0) for one 32-block: A from registers, B from the descriptor (low word lo).
template <int NB>
__device__ __forceinline__ void wgmma_f8(F8Acc<NB>& c, const u32 (&a)[4], u32 lo);

template <>
__device__ __forceinline__ void wgmma_f8<8>(F8Acc<8>& c, const u32 (&a)[4], u32 lo) {
  asm volatile(
      "{\n\t.reg .pred p;\n\t.reg .b64 d;\n\tsetp.ne.b32 p, %10, 0;\n\t"
      "cvt.u64.u32 d, %8;\n\tor.b64 d, d, %9;\n\t"
      "wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 {%0, %1, %2, %3}, "
      "{%4, %5, %6, %7}, d, p, 1, 1;\n}"
      : "=f"(c.d[0]), "=f"(c.d[1]), "=f"(c.d[2]), "=f"(c.d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(lo), "n"(F8_DESC_HI), "r"(0));
}

template <>
__device__ __forceinline__ void wgmma_f8<16>(F8Acc<16>& c, const u32 (&a)[4], u32 lo) {
  asm volatile(
      "{\n\t.reg .pred p;\n\t.reg .b64 d;\n\tsetp.ne.b32 p, %14, 0;\n\t"
      "cvt.u64.u32 d, %12;\n\tor.b64 d, d, %13;\n\t"
      "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7}, "
      "{%8, %9, %10, %11}, d, p, 1, 1;\n}"
      : "=f"(c.d[0]), "=f"(c.d[1]), "=f"(c.d[2]), "=f"(c.d[3]), "=f"(c.d[4]), "=f"(c.d[5]),
        "=f"(c.d[6]), "=f"(c.d[7])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(lo), "n"(F8_DESC_HI), "r"(0));
}

template <>
__device__ __forceinline__ void wgmma_f8<32>(F8Acc<32>& c, const u32 (&a)[4], u32 lo) {
  asm volatile(
      "{\n\t.reg .pred p;\n\t.reg .b64 d;\n\tsetp.ne.b32 p, %22, 0;\n\t"
      "cvt.u64.u32 d, %20;\n\tor.b64 d, d, %21;\n\t"
      "wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, "
      "%8, %9, %10, %11, %12, %13, %14, %15}, {%16, %17, %18, %19}, d, p, 1, 1;\n}"
      : "=f"(c.d[0]), "=f"(c.d[1]), "=f"(c.d[2]), "=f"(c.d[3]), "=f"(c.d[4]), "=f"(c.d[5]),
        "=f"(c.d[6]), "=f"(c.d[7]), "=f"(c.d[8]), "=f"(c.d[9]), "=f"(c.d[10]), "=f"(c.d[11]),
        "=f"(c.d[12]), "=f"(c.d[13]), "=f"(c.d[14]), "=f"(c.d[15])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(lo), "n"(F8_DESC_HI), "r"(0));
}

// The accumulators are read only after the wait: tie them to it.
template <int NB>
__device__ __forceinline__ void wgmma_wait_all(F8Acc<NB>& c0, F8Acc<NB>& c1) {
  asm volatile("wgmma.commit_group.sync.aligned;\n\twgmma.wait_group.sync.aligned 0;" ::: "memory");
#pragma unroll
  for (int i = 0; i < NB / 2; ++i) {
    asm volatile("" : "+f"(c0.d[i]), "+f"(c1.d[i])::"memory");
  }
}

// An encoded word -> A registers (2j, 2j + 1) of its block (the rotations: _MX4F8_ROTATIONS in
// ep/kernels/q4p.py).
__device__ __forceinline__ void mx4f8_regs(u32 w, u32& lo, u32& hi) {
  lo = w & MX4F8_MASK;
  hi = xor_and<MX4F8_MASK>(rotl(w, 2), rotl(w, 4));
}

// A 4-bit word -> A registers (2j, 2j + 1) of its block: its low nibbles and its high ones, each
// the low half of a byte, which as e4m3 is q x 2^-9 exactly (q < 8: the subnormal m x 2^-9;
// q >= 8: exponent 1, (8 + m) x 2^-9).
__device__ __forceinline__ void q4f8_regs(u32 w, u32& lo, u32& hi) {
  lo = w & 0x0F0F0F0Fu;
  hi = (w >> 4) & 0x0F0F0F0Fu;
}

// Two e4m3 bytes (the low 16 bits of v) -> two floats, exactly.
__device__ __forceinline__ float2 e4m3x2_f32(u32 v) {
  u32 h;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h) : "h"((unsigned short)v));
  return __half22float2(*reinterpret_cast<const __half2*>(&h));
}

// Eight bf16 of a row of x: one 16-byte load, or four 4-byte ones when x is not 16-byte aligned.
__device__ __forceinline__ uint4 mx4f8_x8(const __nv_bfloat16* __restrict__ row, int c, bool x16) {
  if (x16) return __ldg(reinterpret_cast<const uint4*>(row) + c);
  const u32* w = reinterpret_cast<const u32*>(row) + 4 * c;
  return make_uint4(__ldg(w), __ldg(w + 1), __ldg(w + 2), __ldg(w + 3));
}

// Two bf16 (times f) -> their e4m3 hi bytes and lo bytes (hi = e4m3(v), lo = e4m3(v - hi)).
__device__ __forceinline__ void mx4f8_split2(u32 v, float f, u32& hi, u32& lo) {
  const float v0 = __uint_as_float(v << 16) * f, v1 = __uint_as_float(v & 0xFFFF0000u) * f;
  unsigned short h, l;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(h) : "f"(v1), "f"(v0));
  const float2 b = e4m3x2_f32(h);
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(l) : "f"(v1 - b.y), "f"(v0 - b.x));
  hi = h;
  lo = l;
}

// x [M, K] -> the B tiles in shared memory (see the layout above) and each row's output factor
// 2^(6 - e) (NaN for a row holding inf or NaN) in `factor`. Warp w stages rows w, w + 8 (rows
// M .. NB/2 - 1 are zeros): its lanes read the row 8 elements at a time, take its largest
// magnitude with shuffles, then read each 8 again (from L1) as 8 hi and 8 lo bytes. No block-wide
// step until the tiles are complete. Q4 (the 4-bit formats): the factor is 2^(9 - e), and each
// 32-block's sum of x 2^e goes to xsum [S][NB / 2 rows][2 blocks] (the zero points' term).
template <int NB, int W = MX4F8_WARPS, bool Q4 = false>
__device__ __forceinline__ void mx4f8_stage_x(u8* xs, float* factor,
                                              const __nv_bfloat16* __restrict__ x, int M, int K,
                                              int S, bool x16, float* xsum = nullptr) {
  const int lane = threadIdx.x & 31;
  const int chunks = K >> 3, padded = S << 3;  // 8 elements a chunk; K padded to the step
  for (int m = threadIdx.x >> 5; m < (NB >> 1); m += W) {
    const __nv_bfloat16* row = x + (size_t)m * K;
    u32 mx = 0u;  // the largest |x| of the row as bf16 bits, in both halves
    if (m < M) {
#pragma unroll 4
      for (int c = lane; c < chunks; c += 32) {
        const uint4 v = mx4f8_x8(row, c, x16);
        mx = __vmaxu2(mx, __vmaxu2(__vmaxu2(v.x & 0x7FFF7FFFu, v.y & 0x7FFF7FFFu),
                                   __vmaxu2(v.z & 0x7FFF7FFFu, v.w & 0x7FFF7FFFu)));
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) mx = __vmaxu2(mx, __shfl_xor_sync(0xFFFFFFFFu, mx, o));
    }
    const int ex = (int)(max(mx & 0xFFFFu, mx >> 16) >> 7);  // biased exponent (255: inf, NaN)
    const int e = min(134 - ex, 127);                        // 2^e puts it in [128, 256)
    const float f = ex == 255 ? 1.0f : __uint_as_float((u32)(e + 127) << 23);
    if (lane == 0 && m < M)
      factor[m] = ex == 255 ? __uint_as_float(0x7FC00000u)
                            : __uint_as_float((u32)((Q4 ? 136 : 133) - e) << 23);
    const int passes = Q4 ? (padded + 31) & ~31 : padded;  // Q4: whole warps (the shuffles)
    for (int c = lane; c < passes; c += 32) {
      uint2 hi = make_uint2(0u, 0u), lo = make_uint2(0u, 0u);
      float part = 0.0f;  // Q4: the chunk's sum of x
      if (m < M && c < chunks) {
        const uint4 v = mx4f8_x8(row, c, x16);
        if constexpr (Q4) {
          const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
          for (int i = 0; i < 4; ++i)
            part += __uint_as_float(w[i] << 16) + __uint_as_float(w[i] & 0xFFFF0000u);
        }
        u32 h[4], l[4];
        mx4f8_split2(v.x, f, h[0], l[0]);
        mx4f8_split2(v.y, f, h[1], l[1]);
        mx4f8_split2(v.z, f, h[2], l[2]);
        mx4f8_split2(v.w, f, h[3], l[3]);
        hi = make_uint2(h[0] | (h[1] << 16), h[2] | (h[3] << 16));
        lo = make_uint2(l[0] | (l[1] << 16), l[2] | (l[3] << 16));
      }
      if constexpr (Q4) {  // 4 chunks a 32-block, on lanes 4i .. 4i + 3
        part += __shfl_xor_sync(0xFFFFFFFFu, part, 1);
        part += __shfl_xor_sync(0xFFFFFFFFu, part, 2);
        if (c >= padded) continue;
        const int blk = c >> 2;
        if ((lane & 3) == 0)
          xsum[((blk >> 1) * (NB >> 1) + m) * 2 + (blk & 1)] = part * f;
      }
      const int k = c << 3;  // a chunk is 8 bytes of one k half of one block's tile
      u8* at = xs + (k >> 5) * (NB * 32) + ((k >> 4) & 1) * (NB * 16) + (k & 15);
      *reinterpret_cast<uint2*>(at + (2 * m) * 16) = hi;
      *reinterpret_cast<uint2*>(at + (2 * m + 1) * 16) = lo;
    }
  }
}

// tools/trace_mx4f8.py compiles the kernel with EPK_TRACE: each warpgroup records the global
// timer at its start, after the PDL wait, after staging x and at its end, then its SM clock at
// start and end, its SM and its steps (8 u64 a warpgroup in `trace`). Without it, nothing.
#ifdef EPK_TRACE
__device__ __forceinline__ unsigned long long f8_gtime() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ u32 f8_smid() {
  u32 sm;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
  return sm;
}
#define F8_TRACE(i, v) \
  if (trace != nullptr && (threadIdx.x & 127) == 0) trace[wg * 8 + (i)] = (unsigned long long)(v)
#else
#define F8_TRACE(i, v) ((void)0)
#endif

template <int D, int NB, int F, int W = MX4F8_WARPS>
__device__ __forceinline__ void f8_run(__nv_bfloat16* __restrict__ y,
                                       const __nv_bfloat16* __restrict__ x,
                                       const uint4* __restrict__ wq, const void* scales,
                                       const void* zeros, u8* xs, int M, int N, int K, int S,
                                       u32 flags, unsigned long long* trace) {
  constexpr bool Q4 = F >= F8_Q4, ZP = F >= F8_Q4_ZP;
  typedef typename F8Scales<F>::type SV;
  constexpr int NT = NB / 8;  // token groups of 4 a lane holds: rows t + 4j
  const int lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3;
  const int g = lane >> 2, t = lane & 3;
  const long long wgs = (long long)gridDim.x * (W / 4);
  const long long wg = (long long)blockIdx.x * (W / 4) + (threadIdx.x >> 7);
  const long long tiles = ((long long)N + 63) >> 6;
  const int j0 = (int)(wg * tiles / wgs), j1 = (int)((wg + 1) * tiles / wgs);
  const int total = (j1 - j0) * S;  // warpgroup-uniform
  const size_t first = (size_t)j0 * S;
  F8_TRACE(0, f8_gtime());
  F8_TRACE(4, clock64());
  wq += (first * 4 + warp) * 32 + lane;
  constexpr int SSTEP = F8Scales<F>::kStep, SLANE = F8Scales<F>::kLane;
  const SV* __restrict__ sc = reinterpret_cast<const SV*>(scales) +
                              ((first * 4 + warp) * 8 + g) * SLANE + (SLANE == 2 ? (t & 1) : 0);
  const unsigned short* __restrict__ zs =
      reinterpret_cast<const unsigned short*>(zeros) + (first * 4 + warp) * 8 + g;
  uint4 rq[D];
  SV rs[D];
  u32 rz[ZP ? D : 1];  // zero points (F8_Q4_ZP, F8_Q4_ZP_U32)
  PdlWait ready(flags);
#pragma unroll
  for (int d = 0; d < D; ++d) {
    rq[d] = zero4();
    rs[d] = SV{};
    if constexpr (ZP) rz[d] = 0u;
    if (d < total) {
      rq[d] = ld_stream(wq + (size_t)d * 128);
      rs[d] = f8_scales(sc + (size_t)d * SSTEP);
      if constexpr (ZP) rz[d] = __ldg(zs + (size_t)d * 32);
    }
  }
  ready();
  F8_TRACE(1, f8_gtime());
  float* factor = reinterpret_cast<float*>(xs + 2 * S * NB * 32);
  float* xsum = factor + 16;  // Q4: [S][NB / 2][2]
  mx4f8_stage_x<NB, W, Q4>(xs, factor, x, M, K, S, (flags & EPK_X16) != 0, xsum);
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // generic writes -> wgmma reads
  __syncthreads();
  F8_TRACE(2, f8_gtime());
  const u32 xa = smem_addr(xs);
  const u32 dlo = f8_desc_lo(xa, NB * 16);  // a step moves the address (its low word)
  constexpr u32 dstep = (NB * 32) >> 4;      // one block's tile
  float acc[NT][2];
#pragma unroll
  for (int j = 0; j < NT; ++j) acc[j][0] = acc[j][1] = 0.0f;
  int si = 0, cj = j0;
  // Whole rounds of D steps (the last one padded with zero steps that store nothing): no exit
  // inside the round, so ptxas keeps the wgmmas of a step in flight together.
  for (int s0 = 0; s0 < total; s0 += D) {
#pragma unroll
    for (int d = 0; d < D; ++d) {
      const int idx = s0 + d;
      const uint4 q = rq[d];
      const SV sv = rs[d];
      const u32 zv = ZP ? rz[d] : 0u;
      u32 a0[4], a1[4];
      if constexpr (Q4) {
        q4f8_regs(q.x, a0[0], a0[1]);
        q4f8_regs(q.y, a0[2], a0[3]);
        q4f8_regs(q.z, a1[0], a1[1]);
        q4f8_regs(q.w, a1[2], a1[3]);
      } else {
        mx4f8_regs(q.x, a0[0], a0[1]);
        mx4f8_regs(q.y, a0[2], a0[3]);
        mx4f8_regs(q.z, a1[0], a1[1]);
        mx4f8_regs(q.w, a1[2], a1[3]);
      }
      F8Acc<NB> c0, c1;
      const u32 dsc = dlo + (u32)(2 * si) * dstep;
      asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
      wgmma_f8<NB>(c0, a0, dsc);
      wgmma_f8<NB>(c1, a1, dsc + dstep);
      // The slot is free: refill it with the step D ahead. At M <= 8 as volatile predicated
      // loads, which ptxas issues every 2-3 steps: plain conditional loads there were sunk to
      // the end of each round of D steps (nvdisasm), so a warp's ring drained to about one step
      // in flight before refilling all at once (H200, 896 x 151936, d8b3: 22.5 -> 21.4 us at
      // M = 1, 23.5 -> 21.6 at M = 4). At M > 8 plain loads measured faster (d8b1: 28.2 us
      // against 28.5-29.9).
      if constexpr (NB <= 16) {
        const bool more = idx + D < total;
        rq[d] = ld_stream_if(wq + (size_t)(idx + D) * 128, more);
        rs[d] = f8_scales_if(sc + (size_t)(idx + D) * SSTEP, more);
        if constexpr (ZP) rz[d] = ld_u16_if(zs + (size_t)(idx + D) * 32, more);
      } else if (idx + D < total) {
        rq[d] = ld_stream(wq + (size_t)(idx + D) * 128);
        rs[d] = f8_scales(sc + (size_t)(idx + D) * SSTEP);
        if constexpr (ZP) rz[d] = __ldg(zs + (size_t)(idx + D) * 32);
      }
      float s[2][2];  // [block][row g | g + 8]
      if constexpr (Q4) {  // bf16 at 2b + h
        const uint2 p = f8_q4_pairs(sv, t);
        s[0][0] = __uint_as_float(p.x << 16);
        s[0][1] = __uint_as_float(p.x & 0xFFFF0000u);
        s[1][0] = __uint_as_float(p.y << 16);
        s[1][1] = __uint_as_float(p.y & 0xFFFF0000u);
      } else if constexpr (F == F8_MX4_EXACT) {
#pragma unroll
        for (int i = 0; i < 4; ++i) s[i >> 1][i & 1] = e8m0_f32((sv >> (8 * i)) & 0xFFu);
      } else {  // E8M0 bytes at 2b + h
        s[0][0] = __uint_as_float((sv << 23) & 0x7F800000u);
        s[0][1] = __uint_as_float((sv << 15) & 0x7F800000u);
        s[1][0] = __uint_as_float((sv << 7) & 0x7F800000u);
        s[1][1] = __uint_as_float((sv >> 1) & 0x7F800000u);
      }
      wgmma_wait_all<NB>(c0, c1);
      if constexpr (Q4) {  // s (sum of q x - z x): the codes' products less the zero points'
        float z[2][2];  // z 2^-9 (a nibble as the low half of an e4m3 byte), against x 2^e sums
        if constexpr (ZP) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {  // nibble 2b + h: h = 0 at bits 0 and 8, h = 1 at 4 and 12
            const float2 v = e4m3x2_f32((zv >> (4 * h)) & 0x0F0Fu);
            z[0][h] = v.x;
            z[1][h] = v.y;
          }
        } else {
          z[0][0] = z[0][1] = z[1][0] = z[1][1] = 0x1p-6f;  // 8 x 2^-9
        }
        const float2* xb2 = reinterpret_cast<const float2*>(xsum) + si * (NB >> 1);
#pragma unroll
        for (int j = 0; j < NT; ++j) {
          const float2 xb = xb2[t + 4 * j];
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const float p0 = c0.d[4 * j + 2 * h] + c0.d[4 * j + 2 * h + 1];
            const float p1 = c1.d[4 * j + 2 * h] + c1.d[4 * j + 2 * h + 1];
            acc[j][h] = fmaf(s[0][h], fmaf(-z[0][h], xb.x, p0), acc[j][h]);
            acc[j][h] = fmaf(s[1][h], fmaf(-z[1][h], xb.y, p1), acc[j][h]);
          }
        }
      } else {
#pragma unroll
        for (int j = 0; j < NT; ++j) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            acc[j][h] = fmaf(s[0][h], c0.d[4 * j + 2 * h] + c0.d[4 * j + 2 * h + 1], acc[j][h]);
            acc[j][h] = fmaf(s[1][h], c1.d[4 * j + 2 * h] + c1.d[4 * j + 2 * h + 1], acc[j][h]);
          }
        }
      }
      if (++si == S) {  // tile cj is complete: rows 64 cj + 16 warp + g (+ 8), x rows t + 4j
        const int n = (cj << 6) + (warp << 4) + g;  // (cj >= j1: a padding step's, not stored)
#pragma unroll
        for (int j = 0; j < NT; ++j) {
          const int m = t + 4 * j;
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int nn = n + 8 * h;
            if (cj < j1 && m < M && nn < N)
              y[(size_t)m * N + nn] = __float2bfloat16_rn(acc[j][h] * factor[m]);
            acc[j][h] = 0.0f;
          }
        }
        si = 0;
        ++cj;
      }
    }
  }
  F8_TRACE(3, f8_gtime());
  F8_TRACE(5, clock64());
  F8_TRACE(6, f8_smid());
  F8_TRACE(7, total);
}
#undef F8_TRACE

// D4, D8, D16: ring steps a warp at M <= 4, 8, 16 (the wider accumulators take registers); W
// warps a block (8: two warpgroups; 24: an SM's six warpgroups in one block). The loop of format
// F0, or F1 when `f1` (MXFP4: the exact scale decode; 4-bit: zero points given).
template <int F0, int F1, int D4, int D8, int D16, int W>
__device__ __forceinline__ void f8_gemv(__nv_bfloat16* __restrict__ y,
                                        const __nv_bfloat16* __restrict__ x, const u8* b,
                                        const void* scales, const void* zeros, int M, int N, int K,
                                        u32 flags, bool f1, unsigned long long* trace) {
  extern __shared__ __align__(128) u8 f8_xs[];
  const int S = (K + 63) >> 6;
  const uint4* wq = reinterpret_cast<const uint4*>(b);
  if (M > 8) {
    if (f1) f8_run<D16, 32, F1, W>(y, x, wq, scales, zeros, f8_xs, M, N, K, S, flags, trace);
    else f8_run<D16, 32, F0, W>(y, x, wq, scales, zeros, f8_xs, M, N, K, S, flags, trace);
  } else if (M > 4) {
    if (f1) f8_run<D8, 16, F1, W>(y, x, wq, scales, zeros, f8_xs, M, N, K, S, flags, trace);
    else f8_run<D8, 16, F0, W>(y, x, wq, scales, zeros, f8_xs, M, N, K, S, flags, trace);
  } else {
    if (f1) f8_run<D4, 8, F1, W>(y, x, wq, scales, zeros, f8_xs, M, N, K, S, flags, trace);
    else f8_run<D4, 8, F0, W>(y, x, wq, scales, zeros, f8_xs, M, N, K, S, flags, trace);
  }
}

template <int D4, int D8, int D16, int W = MX4F8_WARPS>
__device__ __forceinline__ void mx4f8_gemv(__nv_bfloat16* __restrict__ y,
                                           const __nv_bfloat16* __restrict__ x, const u8* b,
                                           const u8* scales, int M, int N, int K, u32 flags,
                                           unsigned long long* trace = nullptr) {
  f8_gemv<F8_MX4, F8_MX4_EXACT, D4, D8, D16, W>(y, x, b, scales, nullptr, M, N, K, flags,
                                                (flags & EPK_E8X) != 0, trace);
}

// The 4-bit GEMV on the FP8 tensor cores: the same loop over a `ep.kernels.q4f8.pack_q4f8`
// weight in format F, one kernel a zero-point form (`ep_gemv_q4f8_bf16`: zero points given,
// F8_Q4_ZP or at 3 blocks an SM F8_Q4_ZP_U32; `ep_gemv_q4f8_sym_bf16`: every zero point 8,
// F8_Q4), so that each form's loops are scheduled without the other's: with both in one kernel,
// the symmetric form's u32 scales made the zero points' M > 8 loop slower (H200, M = 16: 39.7 ->
// 42.9 us).
template <int F, int D4, int D8, int D16, int W = MX4F8_WARPS>
__device__ __forceinline__ void q4f8_gemv(__nv_bfloat16* __restrict__ y,
                                          const __nv_bfloat16* __restrict__ x, const u8* b,
                                          const u8* scales, const u8* zeros, int M, int N, int K,
                                          u32 flags) {
  f8_gemv<F, F, D4, D8, D16, W>(y, x, b, scales, zeros, M, N, K, flags, false, nullptr);
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

}  // namespace epk
