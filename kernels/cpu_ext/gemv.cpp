// Dense matrix-vector products for a few rows of activations (batchinfer.kernels.cpu_ext.gemv):
// a linear layer at the decode step of one to four sequences, where every weight is read once per
// step and the step is bound by how fast the weights stream in from memory. It converts each weight
// vector once for all rows, computes four output rows together (four independent accumulator
// chains), prefetches the rows two groups ahead into L2 and splits the output rows over torch's
// intra-op threads: 1.3-3x torch's matmul at 1-8 rows (docs/benchmarks.md, "The layer loop"); from
// five rows on two output rows at a time, so that the accumulators stay in registers. (Before the
// prefetch, 5-8 rows ran at 0.7-1.5x of torch's and the kernel stopped at 4.)
//
// Weights w [N, K] (N outputs, K input features): float32, bfloat16 or float16, K a multiple of 16.
// x [M, K] (M <= 8) of any of the three dtypes, converted to float32 once. Sums are float32; the
// output is rounded to x's dtype, then the bias added and rounded again, as torch's
// ``linear(x, w) + bias`` in that dtype rounds. int8 codes have kernels of their own below (AVX-512;
// with VNNI, 16-bit integer activations and exact integer sums);
// int4 ones stay on torch's packed kernel (a version of this loop for them, before the prefetch, ran
// at 0.6-0.9 of its speed).
//
// Vectorization: vec.h's 16-float vectors, the hot functions cloned per instruction set.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "ops.h"
#include "vec.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define BATCHINFER_X86_GCC 1
#include <immintrin.h>
#else
#define BATCHINFER_X86_GCC 0
#endif

namespace {

using namespace batchinfer_vec;

constexpr int64_t MAX_ROWS = batchinfer_ops::GEMV_MAX_ROWS;  // activation rows a dense call takes
constexpr int64_t INT8_MAX_ROWS = batchinfer_ops::GEMV_INT8_MAX_ROWS;  // from 5 on QuantizedLinear reads its
                                                                       // dense copy
constexpr int64_t NR = 4;        // output rows computed together (two above four activation rows)
constexpr int64_t GRAIN = 64;    // output rows per parallel task (at least)
// Software prefetch of the weight rows two groups ahead, into L2 (prefetcht1): streaming a model's
// weights from memory, one core's hardware prefetchers alone read 7-9 GB/s here; with this 21-27 at
// one row, 13-14 at four (AMD EPYC VM, docs/benchmarks.md). Nearer (one group) or into L1 (t0) or
// non-temporal (nta) each gave half the gain or less; farther, the same.
constexpr int64_t PREFETCH_ROWS = 2 * NR;
constexpr int PREFETCH_LOCALITY = 2;

struct Args {
  const float* x;  // [M, K] float32 (converted once)
  int64_t M, K, N;
  float* y;  // [M, N] float32 sums
};

// Dense: y[m, n] = sum_k w[n, k] * x[m, k].
template <int M, class W, vf (*load)(const W*)>
BATCHINFER_INLINE void rows_dense(const Args& a, const W* w, int64_t n0, int64_t n1) {
  constexpr int64_t NR = M <= 4 ? 4 : 2;  // accumulators NR x M stay in registers
  const int64_t K = a.K;
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) {
    vf acc[NR][M] = {};
    const W* ahead = w + std::min(n + PREFETCH_ROWS, a.N - NR) * K;  // the last rows: these again
    for (int64_t k = 0; k < K; k += LANES) {
      vf xv[M];
      for (int m = 0; m < M; ++m) xv[m] = load_f32(a.x + m * K + k);
      if ((k * sizeof(W)) % 64 == 0)  // once per cache line
        for (int r = 0; r < NR; ++r) __builtin_prefetch(ahead + r * K + k, 0, PREFETCH_LOCALITY);
      for (int r = 0; r < NR; ++r) {
        const vf wv = load(w + (n + r) * K + k);
        for (int m = 0; m < M; ++m) acc[r][m] += wv * xv[m];
      }
    }
    for (int r = 0; r < NR; ++r)
      for (int m = 0; m < M; ++m) a.y[m * a.N + n + r] = hsum(acc[r][m]);
  }
  for (; n < n1; ++n) {
    vf acc[M] = {};
    for (int64_t k = 0; k < K; k += LANES) {
      const vf wv = load(w + n * K + k);
      for (int m = 0; m < M; ++m) acc[m] += wv * load_f32(a.x + m * K + k);
    }
    for (int m = 0; m < M; ++m) a.y[m * a.N + n] = hsum(acc[m]);
  }
}

// One entry point per (kind, row count), each compiled per instruction set.
#define BATCHINFER_DENSE(NAME, M, W, LOAD)                                                             \
  BATCHINFER_CLONES void NAME(const Args& a, const W* w, int64_t n0, int64_t n1) { \
    rows_dense<M, W, LOAD>(a, w, n0, n1);                                          \
  }
#define BATCHINFER_DENSE_ALL(KIND, W, LOAD) \
  BATCHINFER_DENSE(KIND##_1, 1, W, LOAD)    \
  BATCHINFER_DENSE(KIND##_2, 2, W, LOAD)    \
  BATCHINFER_DENSE(KIND##_3, 3, W, LOAD)    \
  BATCHINFER_DENSE(KIND##_4, 4, W, LOAD)    \
  BATCHINFER_DENSE(KIND##_5, 5, W, LOAD)    \
  BATCHINFER_DENSE(KIND##_6, 6, W, LOAD)    \
  BATCHINFER_DENSE(KIND##_7, 7, W, LOAD)    \
  BATCHINFER_DENSE(KIND##_8, 8, W, LOAD)
BATCHINFER_DENSE_ALL(f32, float, load_f32)
BATCHINFER_DENSE_ALL(bf16, uint16_t, load_bf16)
BATCHINFER_DENSE_ALL(f16, uint16_t, load_f16)

#define BATCHINFER_PICK(KIND, M) \
  std::array<decltype(&KIND##_1), MAX_ROWS>{KIND##_1, KIND##_2, KIND##_3, KIND##_4, KIND##_5, KIND##_6, KIND##_7, KIND##_8}[(M) - 1]

// int8 codes times M rows (AVX-512 only: GCC's generic vectors widen bytes into shuffles, which
// ran at 7-8 GB/s, below torch's packed kernel; this reads 17-19 GB/s against its 7-12). The same
// structure as rows_dense: four output rows together, the rows ahead prefetched into L2;
// y[m, n] = sum_k q[n, k] * x[m, k] in float32.
// (A copy of rows_dense's loop: an always_inline load with target("avx512f") cannot be inlined into
// that template, which is compiled for every target clone.)
#if BATCHINFER_X86_GCC
constexpr int64_t I8_PREFETCH_ROWS = 8 * NR;  // 16-64 rows ahead measured alike; a row is half a bf16 one

__attribute__((target("avx512f"))) inline __m512 load_i8_avx512(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

template <int M>
__attribute__((target("avx512f"))) void rows_i8(const Args& a, const int8_t* q, int64_t n0, int64_t n1) {
  const int64_t K = a.K;
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) {
    __m512 acc[NR][M];
    for (int r = 0; r < NR; ++r)
      for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
    const int8_t* ahead = q + std::min(n + I8_PREFETCH_ROWS, a.N - NR) * K;  // the last rows: these again
    for (int64_t k = 0; k < K; k += LANES) {
      __m512 xv[M];
      for (int m = 0; m < M; ++m) xv[m] = _mm512_loadu_ps(a.x + m * K + k);
      if (k % 64 == 0)  // once per cache line
        for (int r = 0; r < NR; ++r) _mm_prefetch(reinterpret_cast<const char*>(ahead + r * K + k), _MM_HINT_T1);
      for (int r = 0; r < NR; ++r) {
        const __m512 wv = load_i8_avx512(q + (n + r) * K + k);
        for (int m = 0; m < M; ++m) acc[r][m] = _mm512_fmadd_ps(wv, xv[m], acc[r][m]);
      }
    }
    for (int r = 0; r < NR; ++r)
      for (int m = 0; m < M; ++m) a.y[m * a.N + n + r] = _mm512_reduce_add_ps(acc[r][m]);
  }
  for (; n < n1; ++n) {
    __m512 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += LANES) {
      const __m512 wv = load_i8_avx512(q + n * K + k);
      for (int m = 0; m < M; ++m) acc[m] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(a.x + m * K + k), acc[m]);
    }
    for (int m = 0; m < M; ++m) a.y[m * a.N + n] = _mm512_reduce_add_ps(acc[m]);
  }
}

bool int8_kernel_runs() {
  static const bool ok = __builtin_cpu_supports("avx512f");
  return ok;
}

// int8 codes times int16 activations (AVX512-VNNI): vpdpwssd multiplies 32 pairs of 16-bit integers
// and adds them into 16 int32 sums, one instruction for what the kernel above does with a widening,
// a conversion and an FMA per 16 codes (which streamed 20-26 GB/s of codes on the AMD EPYC VM, this
// one the read rate, 27-30: docs/benchmarks.md, "int8 through VNNI"). Each activation row is
// scaled per chunk of I8Q_CHUNK features by a power of two that puts its largest magnitude in
// [2^14, 2^15) (quantize_rows): a bfloat16 activation within 2^-7 of that largest is an exact
// integer there, a smaller one is rounded at 2^-16 of it (the float32 kernel keeps every bit, so
// the two differ in the last bits of the float32 sum, below the output's rounding). The products
// then add exactly: a chunk of 4096 features puts at most 256 products of |code| <= 128 and
// |x| <= 32767 in a lane (< 2^31); the lanes become floats once a chunk.
constexpr int64_t I8Q_CHUNK = 4096;
constexpr int64_t INT8_VNNI_MAX_ROWS = batchinfer_ops::GEMV_INT8_VNNI_MAX_ROWS;
constexpr int64_t I8Q_STEP = 32;  // codes a vpdpwssd takes per row
// 16 rows ahead streamed 25-30 GB/s of codes on the AMD VM, one thread (the read rate: 29); 32 and 64
// rows 21-27, 8 rows 18, none 9.5; into L1 (t0) or non-temporally (nta) as slow as none.
constexpr int64_t I8Q_PREFETCH_ROWS = 4 * NR;

struct QArgs {
  const int16_t* x;  // [M, Kp] activations as integers, Kp = K rounded up to I8Q_STEP, zero-padded
  const float* xs;   // [M, chunks] the power of two each chunk's integers are in units of
  int64_t M, K, Kp, chunks, N;
  float* y;  // [M, N] float32 sums
};

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni")
template <int M>
void rows_i8_vnni(const QArgs& a, const int8_t* q, int64_t n0, int64_t n1) {
  constexpr int64_t NR = M <= 4 ? 4 : 2;  // accumulators NR x M stay in registers
  const int64_t K = a.K;
  for (int64_t n = n0; n < n1; n += NR) {
    const int64_t nr = std::min<int64_t>(NR, n1 - n);  // the last group may be short
    const int8_t* ahead = q + std::max<int64_t>(0, std::min(n + I8Q_PREFETCH_ROWS, a.N - NR)) * K;  // N < NR: row 0
    float sums[NR][M] = {};
    for (int64_t c = 0; c < a.chunks; ++c) {
      const int64_t c0 = c * I8Q_CHUNK, c1 = std::min(K, c0 + I8Q_CHUNK);
      __m512i acc[NR][M];
      for (int r = 0; r < NR; ++r)
        for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_si512();
      for (int64_t k = c0; k < c1; k += I8Q_STEP) {
        __m512i xv[M];
        for (int m = 0; m < M; ++m) xv[m] = _mm512_loadu_si512(a.x + m * a.Kp + k);
        if (k % 64 == 0 && nr == NR)  // once per cache line
          for (int r = 0; r < NR; ++r) _mm_prefetch(reinterpret_cast<const char*>(ahead + r * K + k), _MM_HINT_T1);
        const bool half = k + I8Q_STEP > c1;  // K % 32 == 16: the last 16 codes (x is zero-padded)
        for (int r = 0; r < NR; ++r) {
          if (r >= nr) break;
          const int8_t* row = q + (n + r) * K + k;
          const __m512i wv = half ? _mm512_zextsi256_si512(_mm256_cvtepi8_epi16(
                                        _mm_loadu_si128(reinterpret_cast<const __m128i*>(row))))
                                  : _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row)));
          for (int m = 0; m < M; ++m) acc[r][m] = _mm512_dpwssd_epi32(acc[r][m], wv, xv[m]);
        }
      }
      for (int r = 0; r < nr; ++r)
        for (int m = 0; m < M; ++m)
          sums[r][m] += _mm512_reduce_add_ps(_mm512_cvtepi32_ps(acc[r][m])) * a.xs[m * a.chunks + c];
    }
    for (int r = 0; r < nr; ++r)
      for (int m = 0; m < M; ++m) a.y[m * a.N + n + r] = sums[r][m];
  }
}
#pragma GCC pop_options

bool int8_vnni_runs() {
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
  return ok;
}

// x [M, K] float32 as QArgs' integers and chunk units, into x16 / xs; false where a row holds an
// infinity or NaN (the float32 kernel then runs, which carries them into the output as torch does).
bool quantize_rows(const std::vector<float>& xf, int64_t M, int64_t K, int64_t Kp, int64_t chunks,
                   std::vector<int16_t>& x16, std::vector<float>& xs) {
  x16.assign(M * Kp, 0);
  xs.assign(M * chunks, 0.0f);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t c = 0; c < chunks; ++c) {
      const float* x = xf.data() + m * K;
      const int64_t c0 = c * I8Q_CHUNK, c1 = std::min(K, c0 + I8Q_CHUNK);
      float big = 0.0f;
      for (int64_t k = c0; k < c1; ++k) big = std::max(big, std::fabs(x[k]));
      if (!std::isfinite(big)) return false;
      if (big == 0.0f) continue;  // all zero: integers 0, unit 0
      int e;
      std::frexp(big, &e);  // big in [2^(e-1), 2^e)
      const float inv = std::ldexp(1.0f, 15 - e);
      xs[m * chunks + c] = std::ldexp(1.0f, e - 15);
      for (int64_t k = c0; k < c1; ++k) {  // |x * inv| < 2^15, rounded: 32768 at most, kept to 32767
        const float v = std::nearbyint(x[k] * inv);
        x16[m * Kp + k] = static_cast<int16_t>(std::clamp(v, -32767.0f, 32767.0f));
      }
    }
  }
  return true;
}
#else
bool int8_kernel_runs() { return false; }
bool int8_vnni_runs() { return false; }
#endif

// x [M, K] (float32 / bfloat16 / float16, M <= 8) as float32 rows.
std::vector<float> rows_as_float(const at::Tensor& x) {
  const int64_t M = x.size(0), K = x.size(1);
  std::vector<float> out(M * K);
  for (int64_t m = 0; m < M; ++m) {
    float* o = out.data() + m * K;
    if (x.scalar_type() == at::kFloat) {
      std::memcpy(o, x.data_ptr<float>() + m * x.stride(0), K * sizeof(float));
    } else if (x.scalar_type() == at::kBFloat16) {
      const c10::BFloat16* p = x.data_ptr<c10::BFloat16>() + m * x.stride(0);
      for (int64_t k = 0; k < K; ++k) o[k] = static_cast<float>(p[k]);
    } else {
      const c10::Half* p = x.data_ptr<c10::Half>() + m * x.stride(0);
      for (int64_t k = 0; k < K; ++k) o[k] = static_cast<float>(p[k]);
    }
  }
  return out;
}

template <class T>
void finish_as(const std::vector<float>& y, const std::optional<at::Tensor>& bias, const at::Tensor& out) {
  const int64_t M = out.size(0), N = out.size(1);
  T* o = out.data_ptr<T>();
  const T* b = bias.has_value() ? bias->data_ptr<T>() : nullptr;
  for (int64_t i = 0; i < M * N; ++i) {
    const T v = static_cast<T>(y[i]);
    o[i] = b ? static_cast<T>(static_cast<float>(v) + static_cast<float>(b[i % N])) : v;
  }
}

// The output in x's dtype: the float32 sums rounded, then the bias added and rounded.
at::Tensor finish(const at::Tensor& x, const std::vector<float>& y, int64_t N, const std::optional<at::Tensor>& bias) {
  at::Tensor out = at::empty({x.size(0), N}, x.options());
  if (x.scalar_type() == at::kFloat) {
    finish_as<float>(y, bias, out);
  } else if (x.scalar_type() == at::kBFloat16) {
    finish_as<c10::BFloat16>(y, bias, out);
  } else {
    finish_as<c10::Half>(y, bias, out);
  }
  return out;
}

void check_x(const at::Tensor& x, int64_t K, int64_t multiple, const std::optional<at::Tensor>& bias, int64_t N) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1, "gemv: x must be a CPU [M, K] tensor with "
              "a contiguous last axis");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= MAX_ROWS, "gemv: 1 to ", MAX_ROWS, " rows, got ", x.size(0));
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
              "gemv: x must be float32, bfloat16 or float16, got ", x.scalar_type());
  TORCH_CHECK(x.size(1) == K, "gemv: x has ", x.size(1), " features, the weight ", K);
  TORCH_CHECK(K % multiple == 0, "gemv: in_features must be a multiple of ", multiple, ", got ", K);
  if (bias.has_value()) {
    TORCH_CHECK(bias->device().is_cpu() && bias->dim() == 1 && bias->size(0) == N && bias->is_contiguous() &&
                    bias->scalar_type() == x.scalar_type(),
                "gemv: bias must be a contiguous [", N, "] tensor of x's dtype");
  }
}

template <class F>
void over_rows(int64_t N, F body) {
  at::parallel_for(0, N, GRAIN, [&](int64_t n0, int64_t n1) { body(n0, n1); });
}

}  // namespace

namespace batchinfer_ops {

using namespace batchinfer_vec;

// y = x @ w.T (+ bias), w dense [N, K] (float32 / bfloat16 / float16, any dtype against x's).
at::Tensor gemv_dense(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(w.device().is_cpu() && w.dim() == 2 && w.is_contiguous(), "gemv_dense: w must be a contiguous "
              "CPU [N, K] tensor");
  const int64_t N = w.size(0), K = w.size(1), M = x.size(0);
  check_x(x, K, LANES, bias, N);
  const std::vector<float> xf = rows_as_float(x);
  std::vector<float> y(M * N);
  const Args a{xf.data(), M, K, N, y.data()};
  if (w.scalar_type() == at::kFloat) {
    auto f = BATCHINFER_PICK(f32, M);
    over_rows(N, [&](int64_t n0, int64_t n1) { f(a, w.data_ptr<float>(), n0, n1); });
  } else if (w.scalar_type() == at::kBFloat16 || w.scalar_type() == at::kHalf) {
    auto f = w.scalar_type() == at::kBFloat16 ? BATCHINFER_PICK(bf16, M) : BATCHINFER_PICK(f16, M);
    const auto* p = reinterpret_cast<const uint16_t*>(w.data_ptr());
    over_rows(N, [&](int64_t n0, int64_t n1) { f(a, p, n0, n1); });
  } else {
    TORCH_CHECK(false, "gemv_dense: w must be float32, bfloat16 or float16, got ", w.scalar_type());
  }
  return finish(x, y, N, bias);
}

// y = (x @ q.T) * scales (+ bias): int8 codes q [N, K] with one scale per output row, as torch's
// _weight_int8pack_mm computes it (float32 sums of code x activation, times the scale, rounded to
// x's dtype); then the bias added and rounded. Only where gemv_int8_runs(): AVX-512. With VNNI the
// activations go in as 16-bit integers (rows_i8_vnni); widen = true keeps the float32 kernel.
static at::Tensor int8_product(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales,
                               const std::optional<at::Tensor>& bias, bool widen) {
  TORCH_CHECK(int8_kernel_runs(), "gemv_int8: needs AVX-512 (gemv_int8_runs() is false here)");
  TORCH_CHECK(q.device().is_cpu() && q.dim() == 2 && q.is_contiguous() && q.scalar_type() == at::kChar,
              "gemv_int8: q must be a contiguous CPU [N, K] int8 tensor");
  const int64_t N = q.size(0), K = q.size(1), M = x.size(0);
  TORCH_CHECK(scales.device().is_cpu() && scales.dim() == 1 && scales.size(0) == N && scales.is_contiguous() &&
                  (scales.scalar_type() == at::kBFloat16 || scales.scalar_type() == at::kFloat ||
                   scales.scalar_type() == at::kHalf),
              "gemv_int8: scales must be a contiguous [", N, "] tensor of float32, bfloat16 or float16");
  check_x(x, K, LANES, bias, N);
  const bool vnni = !widen && int8_vnni_runs();
  TORCH_CHECK(M <= (vnni ? INT8_VNNI_MAX_ROWS : INT8_MAX_ROWS), "gemv_int8: 1 to ",
              vnni ? INT8_VNNI_MAX_ROWS : INT8_MAX_ROWS, " rows, got ", M);
  const std::vector<float> xf = rows_as_float(x);
  std::vector<float> y(M * N);
#if BATCHINFER_X86_GCC
  const int64_t Kp = (K + I8Q_STEP - 1) / I8Q_STEP * I8Q_STEP, chunks = (K + I8Q_CHUNK - 1) / I8Q_CHUNK;
  std::vector<int16_t> x16;
  std::vector<float> xs;
  if (vnni && quantize_rows(xf, M, K, Kp, chunks, x16, xs)) {
    const QArgs a{x16.data(), xs.data(), M, K, Kp, chunks, N, y.data()};
    auto f = std::array<decltype(&rows_i8_vnni<1>), INT8_VNNI_MAX_ROWS>{
        rows_i8_vnni<1>, rows_i8_vnni<2>, rows_i8_vnni<3>, rows_i8_vnni<4>,
        rows_i8_vnni<5>, rows_i8_vnni<6>, rows_i8_vnni<7>, rows_i8_vnni<8>}[M - 1];
    over_rows(N, [&](int64_t n0, int64_t n1) { f(a, q.data_ptr<int8_t>(), n0, n1); });
  } else {
    for (int64_t m0 = 0; m0 < M; m0 += INT8_MAX_ROWS) {  // up to 8 rows here only with VNNI: 4 at a time
      const int64_t rows = std::min(INT8_MAX_ROWS, M - m0);
      const Args a{xf.data() + m0 * K, rows, K, N, y.data() + m0 * N};
      auto f = std::array<decltype(&rows_i8<1>), INT8_MAX_ROWS>{rows_i8<1>, rows_i8<2>, rows_i8<3>, rows_i8<4>}[rows - 1];
      over_rows(N, [&](int64_t n0, int64_t n1) { f(a, q.data_ptr<int8_t>(), n0, n1); });
    }
  }
#endif
  auto scale_rows = [&](const auto* s) {
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) y[m * N + n] *= static_cast<float>(s[n]);
  };
  if (scales.scalar_type() == at::kBFloat16) {
    scale_rows(scales.data_ptr<c10::BFloat16>());
  } else if (scales.scalar_type() == at::kFloat) {
    scale_rows(scales.data_ptr<float>());
  } else {
    scale_rows(scales.data_ptr<c10::Half>());
  }
  return finish(x, y, N, bias);
}

at::Tensor gemv_int8(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales,
                     const std::optional<at::Tensor>& bias) {
  return int8_product(x, q, scales, bias, false);
}

// The float32 kernel even where VNNI runs: the tests' and the bench's other side.
at::Tensor gemv_int8_widened(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales,
                             const std::optional<at::Tensor>& bias) {
  return int8_product(x, q, scales, bias, true);
}

bool gemv_int8_runs() { return int8_kernel_runs(); }
bool gemv_int8_vnni() { return int8_vnni_runs(); }

// Not one row of float16 weights: there torch's product streams them faster (0.8x).
bool gemv_dense_takes(const at::Tensor& x, const at::Tensor& w) {
  const int64_t M = x.size(0);
  const auto dtype = w.scalar_type();
  return x.dim() == 2 && M >= 1 && M <= MAX_ROWS && x.stride(1) == 1 &&
         (dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf) && w.size(1) % LANES == 0 &&
         w.is_contiguous() && !(M == 1 && dtype == at::kHalf);
}

bool gemv_int8_takes(const at::Tensor& x, const at::Tensor& q) {
  return x.dim() == 2 && x.size(0) >= 1 && x.size(0) <= (int8_vnni_runs() ? INT8_VNNI_MAX_ROWS : INT8_MAX_ROWS) &&
         x.stride(1) == 1 &&
         q.scalar_type() == at::kChar && q.size(1) % LANES == 0 && q.is_contiguous() && int8_kernel_runs();
}

}  // namespace batchinfer_ops

TORCH_LIBRARY_FRAGMENT(BATCHINFER_OPS_NS, m) {
  m.def("gemv_dense(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("gemv_int8(Tensor x, Tensor q, Tensor scales, Tensor? bias) -> Tensor");
  m.def("gemv_int8_widened(Tensor x, Tensor q, Tensor scales, Tensor? bias) -> Tensor");
  m.def("gemv_int8_runs() -> bool", &batchinfer_ops::gemv_int8_runs);  // no tensors: one kernel for all
  m.def("gemv_int8_vnni() -> bool", &batchinfer_ops::gemv_int8_vnni);
}

TORCH_LIBRARY_IMPL(BATCHINFER_OPS_NS, CPU, m) {
  m.impl("gemv_dense", &batchinfer_ops::gemv_dense);
  m.impl("gemv_int8", &batchinfer_ops::gemv_int8);
  m.impl("gemv_int8_widened", &batchinfer_ops::gemv_int8_widened);
}
