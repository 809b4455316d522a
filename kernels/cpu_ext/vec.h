// Shared by the CPU library's sources (paged_decode.cpp, fused_ops.cpp, gemv.cpp): the op
// namespace's default, the per-CPU cloning of hot functions, 16-float vectors and their exp.
//
// Vectors are GCC/Clang vector extensions of 16 floats (one AVX-512 register, two AVX2 or four SSE
// ones), so each target clone lowers the same code to its own instructions; hot functions are
// compiled for x86-64-v4 (AVX-512), x86-64-v3 (AVX2 + FMA) and the baseline and chosen by the CPU
// at load time (GCC's target_clones): no -march=native, so a cached build runs on any x86-64
// machine that shares it.
#pragma once

#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

#ifndef BATCHINFER_OPS_NS
#define BATCHINFER_OPS_NS batchinfer_cpu_decode
#endif

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define BATCHINFER_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define BATCHINFER_CLONES
#endif
#define BATCHINFER_INLINE inline __attribute__((always_inline))

namespace batchinfer_vec {

typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));
typedef uint32_t vu __attribute__((vector_size(64)));
typedef uint16_t vh __attribute__((vector_size(32)));
typedef float vf8 __attribute__((vector_size(32)));
typedef float vf4 __attribute__((vector_size(16)));
constexpr int64_t LANES = 16;

// The sum of a vector's 16 lanes (halving adds: 8 + 8, 4 + 4, then pairs).
BATCHINFER_INLINE float hsum(vf v) {
  vf8 a, b;
  std::memcpy(&a, &v, sizeof a);
  std::memcpy(&b, reinterpret_cast<const char*>(&v) + sizeof a, sizeof b);
  a += b;
  vf4 c, d;
  std::memcpy(&c, &a, sizeof c);
  std::memcpy(&d, reinterpret_cast<const char*>(&a) + sizeof c, sizeof d);
  c += d;
  return (c[0] + c[2]) + (c[1] + c[3]);
}

// 16 elements as floats, per storage type.
BATCHINFER_INLINE vf load_f32(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// bfloat16: the high halves of float32s.
BATCHINFER_INLINE vf load_bf16(const uint16_t* p) {
  vh h;
  std::memcpy(&h, p, sizeof h);
  return (vf)(__builtin_convertvector(h, vu) << 16);
}

// float16, in vectors (F. Giesen's half-to-float): exponent and mantissa moved into a float's place
// and rebiased by a multiply with 2^112 (exact, subnormal halves included unless the thread flushes
// denormals), infinities and NaNs given the full exponent, the sign put back. (A loop of scalar
// conversions ran the float16 GEMV at 1.6 GB/s; GCC 12 has no vector _Float16 conversion here.)
BATCHINFER_INLINE vf load_f16(const uint16_t* p) {
  vh h;
  std::memcpy(&h, p, sizeof h);
  const vu u = __builtin_convertvector(h, vu);
  const vu em = (u & 0x7fffu) << 13;
  const vu special = (vu)(em >= (0x7c00u << 13));  // all ones where the half is an infinity or NaN
  const vu finite = (vu)((vf)em * 0x1p112f);
  return (vf)((finite & ~special) | ((em | 0x7f800000u) & special) | ((u & 0x8000u) << 16));
}

// e^x for x <= 0, in vectors (Cephes' expf polynomial); 0 below -87. The decode
// kernel's softmax and the SiLU of fused_ops.cpp (as e^-|x|) both call it.
BATCHINFER_INLINE vf exp_nonpositive(vf x) {
  const vf xc = x < -87.0f ? vf{} - 87.0f : x;
  const vf magic = vf{} + 12582912.0f;  // 1.5 * 2^23: adding and subtracting it rounds to an integer
  const vf n = (xc * 1.44269504088896341f + magic) - magic;
  const vf r = xc - n * 0.693359375f + n * 2.12194440e-4f;  // x - n ln 2 in two parts
  vf y = vf{} + 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  const vi e = (__builtin_convertvector(n, vi) + 127) << 23;  // 2^n
  return x < -87.0f ? vf{} : y * (vf)e;
}

}  // namespace batchinfer_vec
