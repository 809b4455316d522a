// Fused elementwise ops of the decoder on the CPU (batchinfer.kernels.cpu_ext.elementwise): what
// kernels/fused.py computes in 7-25 torch ops, in one call each. At one token per step the torch
// ops cost their dispatch, not their arithmetic (~150 us a layer, ~4.5 ms a SmolLM2 decode step);
// these run in a few microseconds.
//
// Numerics follow the torch code they replace, rounding for rounding:
// - rms_norm: the residual add rounded to the dtype, then float32 (h * rsqrt(mean(h^2) + eps))
//   rounded to the dtype, times the weight rounded again. Only the sum of squares is added in
//   another order than torch's reduction (a difference in float32's last place).
// - rotary_cache: cos and sin rounded to the dtype, each product rounded, then the difference
//   (sum) rounded: bit for bit the torch path (GCC does not contract a * b - c * d into an FMA
//   under -std=c++17, and a product of two 16-bit floats is exact in float32 anyway).
//
// - silu_and_mul: float32 silu(g) = g / (1 + e^-g) (torch's formula; e^-|g| from vec.h's polynomial
//   where torch calls Sleef: within 2.1e-7 of float64, torch's 1.7e-7), rounded to the dtype, then
//   times up rounded again, as torch's silu(gate).mul_(up) rounds (tests/test_cpu_fused_ops.py).
//
// Layouts: rows with a contiguous last axis, any other strides (q, k, v are views of the qkv
// projection's output); caches [num_blocks, block_size, KVH, D] with a unit last stride.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>

#include "ops.h"
#include "vec.h"

namespace {

using batchinfer_ops::index_at;

constexpr int64_t TOKENS_PER_TASK = 16;  // parallel_for grain: a decode step's few rows stay on one thread

template <class T>
inline float to_f(T v) {
  return static_cast<float>(v);
}
template <class T>
inline T from_f(float v) {
  return static_cast<T>(v);  // round to nearest even for BFloat16 / Half, as torch's casts
}

// ---------------------------------------------------------------------------------------------
// RMSNorm (+ residual)

template <class T>
void rms_norm_rows(const at::Tensor& x, const at::Tensor& weight, double eps, const at::Tensor* residual,
                   const at::Tensor& out, const at::Tensor* sum_out) {
  const int64_t rows = x.size(0), C = x.size(1);
  const T* xp = x.data_ptr<T>();
  const T* wp = weight.data_ptr<T>();
  const T* rp = residual ? residual->data_ptr<T>() : nullptr;
  T* op = out.data_ptr<T>();
  T* sp = sum_out ? sum_out->data_ptr<T>() : nullptr;
  const int64_t xs = x.stride(0), rs = residual ? residual->stride(0) : 0;
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, rows, TOKENS_PER_TASK, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = xp + r * xs;
      T* orow = op + r * C;
      const T* src = xr;
      if (rp) {  // x + residual, rounded to the dtype: the new residual stream
        T* srow = sp + r * C;
        const T* rr = rp + r * rs;
        for (int64_t c = 0; c < C; ++c) srow[c] = from_f<T>(to_f(xr[c]) + to_f(rr[c]));
        src = srow;
      }
      float acc[16] = {0};  // 16 partial sums: vectorizable, and closer to torch's than one running sum
      int64_t c = 0;
      for (; c + 16 <= C; c += 16)
        for (int j = 0; j < 16; ++j) {
          const float h = to_f(src[c + j]);
          acc[j] += h * h;
        }
      float ss = 0.f;
      for (; c < C; ++c) ss += to_f(src[c]) * to_f(src[c]);
      for (int j = 0; j < 16; ++j) ss += acc[j];
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(C) + feps);
      for (c = 0; c < C; ++c) {
        const T h = from_f<T>(to_f(src[c]) * inv);
        orow[c] = from_f<T>(to_f(h) * to_f(wp[c]));
      }
    }
  });
}

}  // namespace

namespace batchinfer_ops {

// x [T, C] (unit last stride), weight [C] (x's dtype), residual [T, C] or none.
// Returns (normed [T, C], x + residual [T, C]); without a residual the second is an empty tensor.
std::tuple<at::Tensor, at::Tensor> rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps,
                                            const std::optional<at::Tensor>& residual) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "rms_norm: CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "rms_norm: x must be [T, C] with a contiguous last axis");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous(),
              "rms_norm: weight must be [", x.size(1), "], contiguous");
  const auto dtype = x.scalar_type();
  TORCH_CHECK(weight.scalar_type() == dtype, "rms_norm: weight and x must share a dtype");
  const at::Tensor* res = nullptr;
  if (residual.has_value()) {
    res = &*residual;
    TORCH_CHECK(res->device().is_cpu() && res->sizes() == x.sizes() && res->scalar_type() == dtype &&
                    res->stride(1) == 1,
                "rms_norm: residual must be x's shape and dtype, with a contiguous last axis");
  }
  at::Tensor out = at::empty(x.sizes(), x.options());
  at::Tensor sum = res ? at::empty(x.sizes(), x.options()) : at::empty({0}, x.options());
  at::Tensor* sum_ptr = res ? &sum : nullptr;
  if (dtype == at::kFloat) {
    rms_norm_rows<float>(x, weight, eps, res, out, sum_ptr);
  } else if (dtype == at::kBFloat16) {
    rms_norm_rows<c10::BFloat16>(x, weight, eps, res, out, sum_ptr);
  } else if (dtype == at::kHalf) {
    rms_norm_rows<c10::Half>(x, weight, eps, res, out, sum_ptr);
  } else {
    TORCH_CHECK(false, "rms_norm: float32, bfloat16 or float16 only, got ", dtype);
  }
  return {out, sum};
}

}  // namespace batchinfer_ops

namespace {

// ---------------------------------------------------------------------------------------------
// Rotary embedding in place, then the keys and values into the paged cache

template <class T>
inline void rotate_head(T* x, const T* cos, const T* sin, int64_t half, bool neox) {
  if (neox) {  // halves: [x1 cos - x2 sin, x2 cos + x1 sin]
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = to_f(x[i]), x2 = to_f(x[half + i]), c = to_f(cos[i]), s = to_f(sin[i]);
      const float a = to_f(from_f<T>(x1 * c)), b = to_f(from_f<T>(x2 * s));
      const float d = to_f(from_f<T>(x2 * c)), e = to_f(from_f<T>(x1 * s));
      x[i] = from_f<T>(a - b);
      x[half + i] = from_f<T>(d + e);
    }
  } else {  // interleaved pairs (GPT-J)
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = to_f(x[2 * i]), x2 = to_f(x[2 * i + 1]), c = to_f(cos[i]), s = to_f(sin[i]);
      const float a = to_f(from_f<T>(x1 * c)), b = to_f(from_f<T>(x2 * s));
      const float d = to_f(from_f<T>(x2 * c)), e = to_f(from_f<T>(x1 * s));
      x[2 * i] = from_f<T>(a - b);
      x[2 * i + 1] = from_f<T>(d + e);
    }
  }
}

template <class T>
void rotary_rows(const at::Tensor& positions, const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos_sin, bool neox,
                 const at::Tensor* v, const at::Tensor* k_cache, const at::Tensor* v_cache,
                 const at::Tensor* slots) {
  const int64_t tokens = q.size(0), H = q.size(1), KVH = k.size(1), D = k.size(2);
  const int64_t rot = cos_sin.size(1), half = rot / 2;
  const float* table = cos_sin.data_ptr<float>();
  T* qp = q.data_ptr<T>();
  T* kp = k.data_ptr<T>();
  const T* vp = v ? v->data_ptr<T>() : nullptr;
  T* kc = k_cache ? k_cache->data_ptr<T>() : nullptr;
  T* vc = v_cache ? v_cache->data_ptr<T>() : nullptr;
  const int64_t bs = k_cache ? k_cache->size(1) : 1;
  at::parallel_for(0, tokens, TOKENS_PER_TASK, [&](int64_t t0, int64_t t1) {
    T cs[2 * 512];  // cos | sin rounded to the dtype (rot <= 1024, checked by the caller)
    for (int64_t t = t0; t < t1; ++t) {
      const float* row = table + index_at(positions, t) * cos_sin.stride(0);
      for (int64_t i = 0; i < rot; ++i) cs[i] = from_f<T>(row[i]);
      for (int64_t h = 0; h < H; ++h) rotate_head(qp + t * q.stride(0) + h * q.stride(1), cs, cs + half, half, neox);
      for (int64_t h = 0; h < KVH; ++h) rotate_head(kp + t * k.stride(0) + h * k.stride(1), cs, cs + half, half, neox);
      if (!kc) continue;
      const int64_t slot = index_at(*slots, t);
      if (slot < 0) continue;  // -1: a padding token, nothing to keep
      const int64_t block = slot / bs, off = slot % bs;
      for (int64_t h = 0; h < KVH; ++h) {
        std::memcpy(kc + block * k_cache->stride(0) + off * k_cache->stride(1) + h * k_cache->stride(2),
                    kp + t * k.stride(0) + h * k.stride(1), D * sizeof(T));
        std::memcpy(vc + block * v_cache->stride(0) + off * v_cache->stride(1) + h * v_cache->stride(2),
                    vp + t * v->stride(0) + h * v->stride(1), D * sizeof(T));
      }
    }
  });
}

void check_rows(const at::Tensor& t, const char* name, int64_t tokens, at::ScalarType dtype) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 3 && t.size(0) == tokens && t.stride(2) == 1 &&
                  t.scalar_type() == dtype,
              "rotary_cache: ", name, " must be a CPU [", tokens, ", heads, head_dim] tensor of q's dtype with a "
              "contiguous last axis");
}

}  // namespace

namespace batchinfer_ops {

// q [T, H, D] and k [T, KVH, D] rotated in place by positions [T] (cos_sin [P, rot] float32: cos in
// the first half of a row, sin in the second); then, given the caches, k and v [T, KVH, D] written
// to slot_mapping [T] (-1: skipped). Every position and slot is checked before anything is written.
void rotary_cache(const at::Tensor& positions, const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos_sin, bool is_neox,
                  const std::optional<at::Tensor>& v, const std::optional<at::Tensor>& k_cache,
                  const std::optional<at::Tensor>& v_cache, const std::optional<at::Tensor>& slot_mapping) {
  const int64_t tokens = q.size(0);
  const auto dtype = q.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "rotary_cache: float32, bfloat16 or float16 only, got ", dtype);
  check_rows(q, "q", tokens, dtype);
  check_rows(k, "k", tokens, dtype);
  const int64_t D = k.size(2), P = cos_sin.size(0), rot = cos_sin.size(1);
  TORCH_CHECK(q.size(2) == D, "rotary_cache: q and k must share head_dim");
  TORCH_CHECK(cos_sin.device().is_cpu() && cos_sin.dim() == 2 && cos_sin.scalar_type() == at::kFloat &&
                  cos_sin.stride(1) == 1 && rot % 2 == 0 && rot <= D && rot <= 1024,
              "rotary_cache: cos_sin must be a float32 [positions, rot_dim] table, rot_dim even and <= head_dim");
  TORCH_CHECK(positions.device().is_cpu() && positions.dim() == 1 && positions.size(0) == tokens &&
                  positions.is_contiguous() &&
                  (positions.scalar_type() == at::kInt || positions.scalar_type() == at::kLong),
              "rotary_cache: positions must be a contiguous int32/int64 [", tokens, "] tensor");
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t p = index_at(positions, t);
    TORCH_CHECK_INDEX(p >= 0 && p < P, "rotary_cache: token ", t, " has position ", p, ", outside the table's ", P);
  }
  const bool cached = k_cache.has_value();
  TORCH_CHECK(cached == v_cache.has_value() && cached == slot_mapping.has_value() && cached == v.has_value(),
              "rotary_cache: v, k_cache, v_cache and slot_mapping come together");
  if (cached) {
    check_rows(*v, "v", tokens, dtype);
    TORCH_CHECK(v->sizes() == k.sizes(), "rotary_cache: v must be k's shape");
    const auto& kc = *k_cache;
    const auto& vc = *v_cache;
    TORCH_CHECK(kc.device().is_cpu() && kc.dim() == 4 && kc.sizes() == vc.sizes() && kc.scalar_type() == dtype &&
                    vc.scalar_type() == dtype && kc.size(2) == k.size(1) && kc.size(3) == D &&
                    kc.stride(3) == 1 && vc.stride(3) == 1,
                "rotary_cache: caches must be [num_blocks, block_size, ", k.size(1), ", ", D, "] of q's dtype");
    const auto& sm = *slot_mapping;
    TORCH_CHECK(sm.device().is_cpu() && sm.dim() == 1 && sm.size(0) == tokens && sm.is_contiguous() &&
                    (sm.scalar_type() == at::kInt || sm.scalar_type() == at::kLong),
                "rotary_cache: slot_mapping must be a contiguous int32/int64 [", tokens, "] tensor");
    const int64_t slots = kc.size(0) * kc.size(1);
    for (int64_t t = 0; t < tokens; ++t) {
      const int64_t s = index_at(sm, t);
      TORCH_CHECK_INDEX(s >= -1 && s < slots, "rotary_cache: token ", t, " has slot ", s, ", outside the cache's ",
                        slots);
    }
  }
  const at::Tensor* vp = cached ? &*v : nullptr;
  const at::Tensor* kcp = cached ? &*k_cache : nullptr;
  const at::Tensor* vcp = cached ? &*v_cache : nullptr;
  const at::Tensor* smp = cached ? &*slot_mapping : nullptr;
  if (dtype == at::kFloat) {
    rotary_rows<float>(positions, q, k, cos_sin, is_neox, vp, kcp, vcp, smp);
  } else if (dtype == at::kBFloat16) {
    rotary_rows<c10::BFloat16>(positions, q, k, cos_sin, is_neox, vp, kcp, vcp, smp);
  } else {
    rotary_rows<c10::Half>(positions, q, k, cos_sin, is_neox, vp, kcp, vcp, smp);
  }
}

}  // namespace batchinfer_ops

namespace {

// ---------------------------------------------------------------------------------------------
// SiLU-and-mul: silu(gate) * up for the [gate | up] projection, one pass over both halves.
// torch's silu (~1 ns an element here, twice that on the strided half of gate_up) and the mul_ after
// it spent ~3 % of a float32 prefill-heavy run (bench/engine_cpu.py --profile).

using namespace batchinfer_vec;

// silu in float32 lanes: g / (1 + e^-g). e^-g overflows for large negative g, so the exponential is
// always e^-|g| (in (0, 1]), and a negative g's silu is the same fraction times e / e: g e / (1 + e).
BATCHINFER_INLINE vf silu_f32(vf g) {
  const vf neg = vf{} - g;
  const vf e = exp_nonpositive(g < 0.f ? g : neg);  // e^-|g|, in (0, 1]
  return (g < 0.f ? g * e : g) / (1.f + e);  // one division: on Zen 4 the 512-bit divide is the costly op
}

// float32 lanes rounded to bfloat16 as c10::BFloat16 rounds (to nearest even; NaN to 0x7fc0), left
// in the high half of each lane (the low half is garbage: callers mask or shift it away).
BATCHINFER_INLINE vu round_bf16_high(vf x) {
  vu u;
  std::memcpy(&u, &x, sizeof u);
  const vu nan = (vu)(x != x);
  return ((u + 0x7fffu + ((u >> 16) & 1u)) & ~nan) | (0x7fc00000u & nan);
}

// bfloat16 in pairs: 32 values read as 16 uint32 lanes hold value 2j in the low half of lane j and
// 2j + 1 in the high half, so the even values are lane << 16 and the odd ones lane & 0xffff0000 as
// floats: no shuffles (GCC's convertvector widening of 16 halves took five).
BATCHINFER_INLINE vf bf16_even(vu w) { return (vf)(w << 16); }
BATCHINFER_INLINE vf bf16_odd(vu w) { return (vf)(w & 0xffff0000u); }

// silu(g) rounded to bfloat16, times u, rounded again (lanes of float32 bfloat16 values).
BATCHINFER_INLINE vu silu_mul_bf16_high(vf g, vf u) {
  const vf s = (vf)(round_bf16_high(silu_f32(g)) & 0xffff0000u);
  return round_bf16_high(s * u);
}

// One row's n = I elements: out[i] = round(round(silu(g[i])) * u[i]) in the dtype T.
template <class T>
BATCHINFER_INLINE void silu_mul_row(const T* g, const T* u, T* out, int64_t n) {
  int64_t i = 0;
  if constexpr (std::is_same_v<T, float>) {
    for (; i + LANES <= n; i += LANES) {
      const vf y = silu_f32(load_f32(g + i)) * load_f32(u + i);
      std::memcpy(out + i, &y, sizeof y);
    }
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    for (; i + 2 * LANES <= n; i += 2 * LANES) {  // 32 values: the even ones and the odd ones
      vu gw, uw;
      std::memcpy(&gw, g + i, sizeof gw);
      std::memcpy(&uw, u + i, sizeof uw);
      const vu y = (silu_mul_bf16_high(bf16_even(gw), bf16_even(uw)) >> 16) |
                   (silu_mul_bf16_high(bf16_odd(gw), bf16_odd(uw)) & 0xffff0000u);
      std::memcpy(out + i, &y, sizeof y);
    }
  } else {  // float16: vector silu, scalar rounding (no vector float-to-half conversion in GCC 12 here)
    const uint16_t* gh = reinterpret_cast<const uint16_t*>(g);
    for (; i + LANES <= n; i += LANES) {
      const vf s = silu_f32(load_f16(gh + i));
      for (int64_t j = 0; j < LANES; ++j) out[i + j] = from_f<T>(to_f(from_f<T>(s[j])) * to_f(u[i + j]));
    }
  }
  for (; i < n; ++i) {  // the tail, one lane at a time through the same vector code
    vf g1{};
    g1[0] = to_f(g[i]);
    out[i] = from_f<T>(to_f(from_f<T>(silu_f32(g1)[0])) * to_f(u[i]));
  }
}

// Rows [r0, r1) of x [T, 2 I] (row stride xs) into out [T, I]: one cloned entry point per dtype
// (target_clones takes no templates).
#define BATCHINFER_SILU_ROWS(NAME, T)                                                                 \
  BATCHINFER_CLONES void NAME(const T* x, int64_t xs, T* out, int64_t I, int64_t r0, int64_t r1) {    \
    for (int64_t r = r0; r < r1; ++r) silu_mul_row(x + r * xs, x + r * xs + I, out + r * I, I);     \
  }
BATCHINFER_SILU_ROWS(silu_mul_rows_f32, float)
BATCHINFER_SILU_ROWS(silu_mul_rows_bf16, c10::BFloat16)
BATCHINFER_SILU_ROWS(silu_mul_rows_f16, c10::Half)
#undef BATCHINFER_SILU_ROWS

}  // namespace

namespace batchinfer_ops {

// x [T, 2 I] ([gate | up], unit last stride) -> silu(gate) * up [T, I], contiguous, x's dtype.
at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1 && x.size(1) % 2 == 0,
              "silu_and_mul: x must be a CPU [T, 2 I] tensor with a contiguous last axis, got ", x.sizes());
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "silu_and_mul: float32, bfloat16 or float16 only, got ", dtype);
  const int64_t T = x.size(0), I = x.size(1) / 2, xs = x.stride(0);
  at::Tensor out = at::empty({T, I}, x.options());
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(I, 1));  // ~16k values a task
  at::parallel_for(0, T, grain, [&](int64_t r0, int64_t r1) {
    if (dtype == at::kFloat) {
      silu_mul_rows_f32(x.data_ptr<float>(), xs, out.data_ptr<float>(), I, r0, r1);
    } else if (dtype == at::kBFloat16) {
      silu_mul_rows_bf16(x.data_ptr<c10::BFloat16>(), xs, out.data_ptr<c10::BFloat16>(), I, r0, r1);
    } else {
      silu_mul_rows_f16(x.data_ptr<c10::Half>(), xs, out.data_ptr<c10::Half>(), I, r0, r1);
    }
  });
  return out;
}

}  // namespace batchinfer_ops

TORCH_LIBRARY_FRAGMENT(BATCHINFER_OPS_NS, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, Tensor? residual) -> (Tensor, Tensor)");
  m.def("rotary_cache(Tensor positions, Tensor(a!) q, Tensor(b!) k, Tensor cos_sin, bool is_neox, Tensor? v, "
        "Tensor(c!)? k_cache, Tensor(d!)? v_cache, Tensor? slot_mapping) -> ()");
  m.def("silu_and_mul(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(BATCHINFER_OPS_NS, CPU, m) {
  m.impl("rms_norm", &batchinfer_ops::rms_norm);
  m.impl("rotary_cache", &batchinfer_ops::rotary_cache);
  m.impl("silu_and_mul", &batchinfer_ops::silu_and_mul);
}
