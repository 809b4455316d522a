// CPU decode attention straight from the paged KV cache (batchinfer.kernels.cpu_ext.decode).
//
// Every sequence of the batch with exactly one query this step (a decode row) attends over its
// context [lo, len) (lo = len - window with a sliding window, else 0), read block by block from
// the block table: no gather copy. Per work item (a sequence's KV head by default, or a whole
// sequence) and KV head, three passes: the scores of the head's G query heads over the whole
// context (each key row read once for all of them; per-key partial sums reduced 16 keys at a time),
// one softmax per query head, then the values. Compute is float32 whatever the cache dtype (float32,
// bfloat16, float16). The rows of the block two ahead are prefetched while a block is computed; past a
// pass's end, the first blocks of the next pass (values after keys, the next head's or item's keys
// after values), so only a thread's first pass starts from memory unprefetched.
//
// Layout (the kernels contract): k_cache, v_cache [num_blocks, block_size, KVH, D], any strides
// with a unit last one (so a cache stored [num_blocks, KVH, block_size, D], viewed back, is read too).
//
// Vectorization: GCC/Clang vector extensions of 16 floats (-O3, no intrinsics), the hot function
// compiled for x86-64-v4 (AVX-512), x86-64-v3 (AVX2 + FMA) and the baseline, chosen at load by the
// CPU (GCC's target_clones): no -march=native, so a cached build runs on any x86-64 machine that
// shares it. head_dim must be a multiple of 16.
// Threads: torch's intra-op pool (at::parallel_for, torch.set_num_threads), items handed out
// longest first from an atomic counter, since contexts are ragged; a thread claims its next item
// before it runs the current one (to prefetch its keys).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <type_traits>
#include <vector>

#include "ops.h"
#include "vec.h"

namespace {

using namespace batchinfer_vec;

// Cache element types: 16 elements as floats, one float back as an element.
struct F32 {
  using T = float;
  static BATCHINFER_INLINE vf load(const T* p) { return load_f32(p); }
  static BATCHINFER_INLINE T store(float v) { return v; }
};
struct BF16 {  // the high half of a float32
  using T = uint16_t;
  static BATCHINFER_INLINE vf load(const T* p) { return load_bf16(p); }
  static BATCHINFER_INLINE T store(float v) { return c10::BFloat16(v).x; }
};
struct F16 {
  using T = uint16_t;
  static BATCHINFER_INLINE vf load(const T* p) { return load_f16(p); }
  static BATCHINFER_INLINE T store(float v) { return c10::detail::fp16_ieee_from_fp32_value(v); }
};

#if defined(__clang__)
#define BATCHINFER_SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define BATCHINFER_SHUFFLE(a, b, ...) __builtin_shuffle(a, b, vi{__VA_ARGS__})
#endif

// Sums of 16 vectors at once: lane i of the result = the sum of p[i]'s lanes. Four rounds of
// "shuffle two vectors' halves apart, add": 30 shuffles and 15 adds for 16 dot products, where
// reducing each alone costs ~8 instructions.
BATCHINFER_INLINE vf fold8(vf a, vf b) {
  return BATCHINFER_SHUFFLE(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
         BATCHINFER_SHUFFLE(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
}
BATCHINFER_INLINE vf fold4(vf a, vf b) {
  return BATCHINFER_SHUFFLE(a, b, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
         BATCHINFER_SHUFFLE(a, b, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
}
BATCHINFER_INLINE vf fold2(vf a, vf b) {
  return BATCHINFER_SHUFFLE(a, b, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
         BATCHINFER_SHUFFLE(a, b, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
}
BATCHINFER_INLINE vf fold1(vf a, vf b) {
  return BATCHINFER_SHUFFLE(a, b, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         BATCHINFER_SHUFFLE(a, b, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}
BATCHINFER_INLINE vf reduce16(const vf* __restrict p) {
  vf a[8], b[4];
  for (int i = 0; i < 8; ++i) a[i] = fold8(p[2 * i], p[2 * i + 1]);
  for (int i = 0; i < 4; ++i) b[i] = fold4(a[2 * i], a[2 * i + 1]);
  return fold1(fold2(b[0], b[1]), fold2(b[2], b[3]));
}

BATCHINFER_INLINE vf exp_nonpositive(vf x) {  // e^x for x <= 0 (Cephes' expf polynomial); 0 below -87
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

struct Problem {
  int64_t G, D, bs;
  int64_t k_sb, k_st, k_sh, v_sb, v_st, v_sh;  // cache strides (elements): block, token, head
  int64_t q_sr, q_sh, o_sr, o_sh;  // q / out strides: row, head
  const void* tables;
  bool tables64;
  int64_t table_stride;
  float scale, softcap;  // softcap 0 = off
  int64_t window;  // 0 = off
};

BATCHINFER_INLINE int64_t block_id(const Problem& p, int64_t seq, int64_t b) {
  return p.tables64 ? static_cast<const int64_t*>(p.tables)[seq * p.table_stride + b]
                    : static_cast<const int32_t*>(p.tables)[seq * p.table_stride + b];
}

// Rows [t0, t1) of one head of a cache block as float rows: the cache itself for float32, else
// converted into `buf` (each element is then converted once, not once per query head).
template <class S>
BATCHINFER_INLINE const float* rows_f32(const typename S::T* base, int64_t st, int64_t t0, int64_t t1, int64_t NV,
                                        vf* __restrict buf, int64_t* stride) {
  if constexpr (std::is_same_v<S, F32>) {
    *stride = st;
    return base;
  } else {
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t c = 0; c < NV; ++c) buf[t * NV + c] = S::load(base + t * st + c * LANES);
    }
    *stride = NV * LANES;
    return reinterpret_cast<const float*>(buf);
  }
}

BATCHINFER_INLINE vf loadf(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// Blocks ahead whose rows are prefetched: 2 read float32 K/V from memory 5-10 % faster than 1 or 4
// (bench/engine_cpu.py --attention shapes, Xeon VM).
constexpr int64_t kPrefetchBlocks = 2;

// Ask for one key or value row (D elements) into L2 (prefetcht2: L1 keeps the block being computed).
// The scores pass asks for one row per key it computes, so the misses go out spread over the work
// rather than in one burst that fills the line-fill buffers.
template <class S>
BATCHINFER_INLINE void prefetch_row(const typename S::T* row, int64_t D) {
  const char* r = reinterpret_cast<const char*>(row);
  for (int64_t off = 0; off < D * static_cast<int64_t>(sizeof(typename S::T)); off += 64) {
    __builtin_prefetch(r + off, 0, 1);
  }
}

// Scratch of one work item, in vf units (see `attend`): `span` = the longest context's blocks x BP.
int64_t scratch_size(int64_t G, int64_t D, int64_t bs, int64_t span) {
  const int64_t NV = D / LANES, BP = (bs + LANES - 1) / LANES * LANES;
  return 2 * G * NV + BP + BP * NV + (G * span + 2 * G + LANES - 1) / LANES;
}

// The first position a context of `len` keys attends to (0 without a sliding window): the kernel's
// checks, its scratch size and its passes all start there.
BATCHINFER_INLINE int64_t window_lo(int64_t window, int64_t len) {
  return window > 0 ? std::max<int64_t>(0, len - window) : 0;
}

// What a pass reads: head h's rows of a cache (strides sb / st / sh: block, token, head) over the
// context of sequence `seq`; cache null: nothing.
template <class T>
struct Rows {
  const T* cache;
  int64_t sb, st, sh, h, seq, len;
};

// Block j of a pass over `cur` (nb blocks): its id, its rows [t0, t1) inside the context, and what to
// prefetch meanwhile: the block kPrefetchBlocks ahead or, past the pass's end, the first blocks of the
// pass after it (`after`: the values after the keys, the next head's or item's keys after the values),
// so that no pass but the first starts cold.
template <class T>
struct BlockRows {
  int64_t blk, t0, t1;
  const T* next;
  int64_t next_rows, next_st;
};
template <class T>
BATCHINFER_INLINE BlockRows<T> block_rows(const Problem& p, const Rows<T>& cur, const Rows<T>& after, int64_t lo,
                                          int64_t j, int64_t nb) {
  const int64_t b = lo / p.bs + j;
  BlockRows<T> r{block_id(p, cur.seq, b), std::max<int64_t>(lo - b * p.bs, 0),
                 std::min<int64_t>(cur.len - b * p.bs, p.bs), nullptr, 0, 0};
  const Rows<T>* to = &cur;
  int64_t pb = b + kPrefetchBlocks;  // the block prefetched
  if (j + kPrefetchBlocks >= nb) {
    if (after.cache == nullptr) return r;
    to = &after;
    pb = window_lo(p.window, after.len) / p.bs + (j + kPrefetchBlocks - nb);
    if (pb * p.bs >= after.len) return r;
  }
  r.next = to->cache + block_id(p, to->seq, pb) * to->sb + to->h * to->sh;
  r.next_rows = std::min<int64_t>(to->len - pb * p.bs, p.bs);
  r.next_st = to->st;
  return r;
}

// acc[g, c] += sum over keys t in [t0, t1) of w[g * w_stride + t] * v[t, c] for GN query heads and
// NVT lane groups, the GN x NVT sums held in registers.
template <int NVT, int GN>
BATCHINFER_INLINE void values_tile(const float* __restrict vr, int64_t vst, int64_t t0, int64_t t1,
                                   const float* __restrict w, int64_t w_stride, vf* __restrict acc) {
  vf a[GN][NVT];
  for (int g = 0; g < GN; ++g) {
    for (int c = 0; c < NVT; ++c) a[g][c] = acc[g * NVT + c];
  }
  for (int64_t t = t0; t < t1; ++t) {
    const float* vt = vr + t * vst;
    for (int c = 0; c < NVT; ++c) {
      const vf x = loadf(vt + c * LANES);
      for (int g = 0; g < GN; ++g) a[g][c] += w[g * w_stride + t] * x;
    }
  }
  for (int g = 0; g < GN; ++g) {
    for (int c = 0; c < NVT; ++c) acc[g * NVT + c] = a[g][c];
  }
}

// One work item: KV heads [h0, h1) of one sequence, whose query is row `row` and context `len`.
// Per KV head, in three passes over its context [lo, len), the blocks of positions (lo / bs) * bs..:
//   1. scores of its G query heads, block by block: per key a partial vector per query head, summed
//      16 keys at a time (reduce16), into s[g, j * BP + t] (-inf where no key is);
//   2. the softmax of each query head's scores at once (one max, one vector exp a 16 keys);
//   3. the values, block by block: acc[g] += w[g, t] * v[t] (values_tile: sums in registers).
// Scores of a whole context fit in scratch (4 bytes a key and query head) and the passes read K, then
// V, once each: no running max, no rescaling, no per-block horizontal sums, the online-softmax
// bookkeeping that cost more than the keys' arithmetic in the form this replaced (docs/kernels.md).
// NVT: head_dim / 16 when a compile-time constant (4, 8), else 0 (read from p.D).
template <class S, int NVT>
BATCHINFER_INLINE void attend(const Problem& p, const typename S::T* __restrict q, const typename S::T* __restrict k,
                              const typename S::T* __restrict v, typename S::T* __restrict out, int64_t row,
                              int64_t seq, int64_t len, int64_t h0, int64_t h1, const Rows<typename S::T>& follow,
                              int64_t span, vf* __restrict w) {
  using T = typename S::T;
  const int64_t G = p.G, NV = NVT > 0 ? NVT : p.D / LANES, bs = p.bs, BP = (bs + LANES - 1) / LANES * LANES;
  vf* __restrict qf = w;  // [G, NV] scaled queries of the head
  vf* __restrict acc = qf + G * NV;  // [G, NV] unnormalized outputs
  vf* __restrict part = acc + G * NV;  // [BP] per-key partial dot products of one query head
  vf* __restrict buf = part + BP;  // [BP, NV] a block's key or value rows as floats (non-float32 caches)
  float* __restrict s = reinterpret_cast<float*>(buf + BP * NV);  // [G, span] scores, then weights
  float* __restrict l = s + G * span;  // [G] softmax sums
  const int64_t lo = window_lo(p.window, len);
  const int64_t b0 = lo / bs, nb = (len + bs - 1) / bs - b0, n = nb * BP;  // n <= span
  const vi lane = vi{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const vf neg_inf = vf{} - std::numeric_limits<float>::infinity();
  for (int64_t h = h0; h < h1; ++h) {
    const Rows<T> keys{k, p.k_sb, p.k_st, p.k_sh, h, seq, len}, values{v, p.v_sb, p.v_st, p.v_sh, h, seq, len};
    // after the values: the next head's keys, or the item this thread takes next
    const Rows<T> then = h + 1 < h1 ? Rows<T>{k, p.k_sb, p.k_st, p.k_sh, h + 1, seq, len} : follow;
    for (int64_t g = 0; g < G; ++g) {
      const T* qr = q + row * p.q_sr + (h * G + g) * p.q_sh;
      for (int64_t c = 0; c < NV; ++c) qf[g * NV + c] = S::load(qr + c * LANES) * p.scale;
    }
    // 1. Scores.
    for (int64_t j = 0; j < nb; ++j) {
      const auto [blk, t0, t1, next, next_rows, next_st] = block_rows(p, keys, values, lo, j, nb);
      int64_t kst;
      const float* kr = rows_f32<S>(k + blk * p.k_sb + h * p.k_sh, p.k_st, t0, t1, NV, buf, &kst);
      for (int64_t g = 0; g < G; ++g) {
        const vf* __restrict qg = qf + g * NV;
        for (int64_t t = 0; t < t1; ++t) {  // rows below t0 are read but masked out below
          if (g == 0 && t < next_rows) prefetch_row<S>(next + t * next_st, NV * LANES);
          const float* kt = kr + t * kst;
          vf x = qg[0] * loadf(kt);
          for (int64_t c = 1; c < NV; ++c) x += qg[c] * loadf(kt + c * LANES);
          part[t] = x;
        }
        if (g == 0) {  // a part block (the last) asks for the rest of a whole one
          for (int64_t t = t1; t < next_rows; ++t) prefetch_row<S>(next + t * next_st, NV * LANES);
        }
        for (int64_t t = t1; t < BP; ++t) part[t] = vf{};
        for (int64_t t = 0; t < BP; t += LANES) {
          const vi pos = lane + static_cast<int32_t>(t);
          const vf sums = (pos >= static_cast<int32_t>(t0)) & (pos < static_cast<int32_t>(t1)) ? reduce16(part + t)
                                                                                                : neg_inf;
          std::memcpy(s + g * span + j * BP + t, &sums, sizeof sums);
        }
      }
    }
    // 2. Softmax per query head (softcap first: tanh keeps -inf at -softcap, so masked lanes are
    // skipped).
    for (int64_t g = 0; g < G; ++g) {
      float* __restrict sg = s + g * span;
      if (p.softcap > 0.0f) {
        for (int64_t i = 0; i < n; ++i) {
          if (sg[i] != -std::numeric_limits<float>::infinity()) sg[i] = p.softcap * std::tanh(sg[i] / p.softcap);
        }
      }
      vf mv = neg_inf;
      for (int64_t i = 0; i < n; i += LANES) {
        const vf x = loadf(sg + i);
        mv = mv > x ? mv : x;
      }
      float mx = mv[0];
      for (int64_t i = 1; i < LANES; ++i) mx = std::max(mx, mv[i]);
      vf sum = vf{};
      for (int64_t i = 0; i < n; i += LANES) {
        const vf e = exp_nonpositive(loadf(sg + i) - mx);  // -inf (no key) gives 0
        std::memcpy(sg + i, &e, sizeof e);
        sum += e;
      }
      l[g] = hsum(sum);
      for (int64_t c = 0; c < NV; ++c) acc[g * NV + c] = vf{};
    }
    // 3. Values.
    for (int64_t j = 0; j < nb; ++j) {
      const auto [blk, t0, t1, next, next_rows, next_st] = block_rows(p, values, then, lo, j, nb);
      for (int64_t t = 0; t < next_rows; ++t) prefetch_row<S>(next + t * next_st, NV * LANES);
      int64_t vst;
      const float* vr = rows_f32<S>(v + blk * p.v_sb + h * p.v_sh, p.v_st, t0, t1, NV, buf, &vst);
      if constexpr (NVT > 0) {
        // GT query heads at a time, their GT x NVT sums in registers: each value row is loaded once
        // for them and the sums are independent (one running sum per lane group and key costs an
        // FMA latency a key).
        constexpr int64_t GT = NVT <= 4 ? 4 : 2;
        for (int64_t g0 = 0; g0 < G; g0 += GT) {
          const float* wg = s + g0 * span + j * BP;
          vf* ag = acc + g0 * NV;
          switch (std::min<int64_t>(GT, G - g0)) {
            case 1: values_tile<NVT, 1>(vr, vst, t0, t1, wg, span, ag); break;
            case 2: values_tile<NVT, 2>(vr, vst, t0, t1, wg, span, ag); break;
            case 3: if constexpr (GT >= 3) values_tile<NVT, 3>(vr, vst, t0, t1, wg, span, ag); break;
            default: if constexpr (GT >= 4) values_tile<NVT, 4>(vr, vst, t0, t1, wg, span, ag); break;
          }
        }
      } else {
        for (int64_t g = 0; g < G; ++g) {
          const float* __restrict wg = s + g * span + j * BP;
          vf* __restrict ag = acc + g * NV;
          for (int64_t c = 0; c < NV; ++c) {  // two sums per lane group: two keys in flight
            const float* vc = vr + c * LANES;
            vf a0 = ag[c], a1 = vf{};
            int64_t t = t0;
            for (; t + 2 <= t1; t += 2) {
              a0 += wg[t] * loadf(vc + t * vst);
              a1 += wg[t + 1] * loadf(vc + (t + 1) * vst);
            }
            if (t < t1) a0 += wg[t] * loadf(vc + t * vst);
            ag[c] = a0 + a1;
          }
        }
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      T* orow = out + row * p.o_sr + (h * G + g) * p.o_sh;
      const float inv = 1.0f / l[g];
      for (int64_t c = 0; c < NV; ++c) {
        const vf a = acc[g * NV + c] * inv;
        for (int64_t i = 0; i < LANES; ++i) orow[c * LANES + i] = S::store(a[i]);
      }
    }
  }
}

// The cloned entry points (one per cache dtype): the CPU picks AVX-512, AVX2 or baseline code; the
// usual head_dims (64, 128) get their own unrolled code.
#define BATCHINFER_ENTRY(NAME, S)                                                                              \
  BATCHINFER_CLONES void NAME(const Problem& p, const S::T* q, const S::T* k, const S::T* v, S::T* out,     \
                              int64_t row, int64_t seq, int64_t len, int64_t h0, int64_t h1,               \
                              const Rows<S::T>& follow, int64_t span, vf* w) {                               \
    if (p.D == 64) {                                                                                           \
      attend<S, 4>(p, q, k, v, out, row, seq, len, h0, h1, follow, span, w);                                        \
    } else if (p.D == 128) {                                                                                   \
      attend<S, 8>(p, q, k, v, out, row, seq, len, h0, h1, follow, span, w);                                        \
    } else {                                                                                                   \
      attend<S, 0>(p, q, k, v, out, row, seq, len, h0, h1, follow, span, w);                                        \
    }                                                                                                          \
  }
BATCHINFER_ENTRY(attend_f32, F32)
BATCHINFER_ENTRY(attend_bf16, BF16)
BATCHINFER_ENTRY(attend_f16, F16)

}  // namespace

namespace batchinfer_ops {

using namespace batchinfer_vec;

// work: 0 = one item per sequence (all its KV heads), 1 = one per (sequence, KV head), -1 = default (1).
void paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& block_tables, const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens,
                  double scale, int64_t sliding_window, double softcap, int64_t work, const at::Tensor& out) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu() &&
                  out.device().is_cpu() && block_tables.device().is_cpu() && cu_seqlens_q.device().is_cpu() &&
                  seq_lens.device().is_cpu(),
              "paged_decode: CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && out.sizes() == q.sizes(),
              "paged_decode: q/out [T, H, D], k_cache/v_cache [num_blocks, block_size, KVH, D]");
  const auto dtype = k_cache.scalar_type();
  TORCH_CHECK(q.scalar_type() == dtype && v_cache.scalar_type() == dtype && out.scalar_type() == dtype,
              "paged_decode: q, k_cache, v_cache and out must share a dtype");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "paged_decode: float32, bfloat16 or float16 only, got ", dtype);
  const int64_t H = q.size(1), D = q.size(2), KVH = k_cache.size(2), bs = k_cache.size(1);
  TORCH_CHECK(k_cache.size(3) == D && KVH > 0 && H % KVH == 0, "paged_decode: head_dim / head count mismatch");
  TORCH_CHECK(D % LANES == 0, "paged_decode: head_dim must be a multiple of ", LANES, ", got ", D);
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1 && k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
              "paged_decode: the head_dim axis must be contiguous");
  for (const auto* t : {&block_tables, &cu_seqlens_q, &seq_lens}) {
    TORCH_CHECK(t->scalar_type() == at::kInt || t->scalar_type() == at::kLong, "paged_decode: int32/int64 indices");
    TORCH_CHECK(t->is_contiguous(), "paged_decode: contiguous index tensors");
  }
  TORCH_CHECK(block_tables.dim() == 2 && seq_lens.dim() == 1 && cu_seqlens_q.dim() == 1 &&
                  block_tables.size(0) == seq_lens.size(0) && cu_seqlens_q.size(0) == seq_lens.size(0) + 1,
              "paged_decode: block_tables [S, max_blocks], cu_seqlens_q [S + 1], seq_lens [S]");
  const int64_t S = seq_lens.size(0), max_blocks = block_tables.size(1), num_blocks = k_cache.size(0);
  TORCH_CHECK(sliding_window >= 0 && softcap >= 0, "paged_decode: sliding_window and softcap >= 0 (0 = off)");

  // The decode rows, checked before any thread reads a block: every block id they use must exist.
  struct Row { int64_t row, seq, len; };
  std::vector<Row> rows;
  for (int64_t i = 0; i < S; ++i) {
    const int64_t row = index_at(cu_seqlens_q, i);
    if (index_at(cu_seqlens_q, i + 1) - row != 1) continue;
    const int64_t len = index_at(seq_lens, i);
    TORCH_CHECK(len >= 1 && row >= 0 && row < q.size(0), "paged_decode: sequence ", i, ": bad length or row");
    const int64_t lo = window_lo(sliding_window, len);
    TORCH_CHECK((len + bs - 1) / bs <= max_blocks, "paged_decode: sequence ", i,
                " needs more blocks than the table has");
    for (int64_t b = lo / bs; b * bs < len; ++b) {
      const int64_t id = index_at(block_tables, i * max_blocks + b);
      TORCH_CHECK_INDEX(id >= 0 && id < num_blocks, "paged_decode: sequence ", i, " block ", b, " is ", id,
                        ", outside the cache's ", num_blocks, " blocks");
    }
    rows.push_back({row, i, len});
  }
  if (rows.empty()) return;

  Problem p{H / KVH, D, bs,
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            block_tables.data_ptr(), block_tables.scalar_type() == at::kLong, max_blocks,
            static_cast<float>(scale), static_cast<float>(softcap), sliding_window};
  const int64_t threads = at::get_num_threads(), n = static_cast<int64_t>(rows.size());
  // Per (sequence, KV head) by default: more items for the threads, and within 10 % of per-sequence
  // items in every case of the micro-bench (bench/engine_cpu.py --attention).
  if (work < 0) work = 1;
  const int64_t per_item = work == 1 ? 1 : KVH;  // KV heads per work item
  const int64_t splits = KVH / per_item, items = n * splits;
  // Longest context first: ragged work handed out greedily balances over the threads.
  std::vector<int64_t> order(items);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return rows[a / splits].len > rows[b / splits].len; });
  // Scores of the longest context, from its window's first block.
  int64_t span = 0;
  for (const Row& r : rows) {
    const int64_t lo = window_lo(sliding_window, r.len);
    span = std::max(span, ((r.len + bs - 1) / bs - lo / bs) * ((bs + LANES - 1) / LANES * LANES));
  }
  const int64_t scratch = scratch_size(p.G, D, bs, span);
  const void* qp = q.data_ptr();
  const void* kp = k_cache.data_ptr();
  const void* vp = v_cache.data_ptr();
  void* op = out.data_ptr();
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min(threads, items), 1, [&](int64_t, int64_t) {
    std::vector<float> raw((scratch + 1) * LANES);  // aligned by hand below: vf loads/stores assume 64 bytes
    vf* w = reinterpret_cast<vf*>((reinterpret_cast<uintptr_t>(raw.data()) + 63) & ~uintptr_t(63));
    // Each thread claims its next item before it runs the current one, so the current item's last
    // blocks prefetch the next one's first keys (the longest items go first: what a thread holds
    // ahead at the end is a short one).
    int64_t i = next.fetch_add(1, std::memory_order_relaxed);
    while (i < items) {
      const int64_t after = next.fetch_add(1, std::memory_order_relaxed);
      const Row& r = rows[order[i] / splits];
      const int64_t h0 = (order[i] % splits) * per_item, h1 = h0 + per_item;
      const Row* a = after < items ? &rows[order[after] / splits] : nullptr;
      const int64_t ah = after < items ? (order[after] % splits) * per_item : 0;
      if (dtype == at::kFloat) {
        using T = float;
        const Rows<T> follow{a ? static_cast<const T*>(kp) : nullptr, p.k_sb, p.k_st, p.k_sh, ah, a ? a->seq : 0,
                             a ? a->len : 0};
        attend_f32(p, static_cast<const T*>(qp), static_cast<const T*>(kp), static_cast<const T*>(vp),
                   static_cast<T*>(op), r.row, r.seq, r.len, h0, h1, follow, span, w);
      } else {
        using T = uint16_t;
        const Rows<T> follow{a ? static_cast<const T*>(kp) : nullptr, p.k_sb, p.k_st, p.k_sh, ah, a ? a->seq : 0,
                             a ? a->len : 0};
        (dtype == at::kBFloat16 ? attend_bf16 : attend_f16)(
            p, static_cast<const T*>(qp), static_cast<const T*>(kp), static_cast<const T*>(vp), static_cast<T*>(op),
            r.row, r.seq, r.len, h0, h1, follow, span, w);
      }
      i = after;
    }
  });
}

}  // namespace batchinfer_ops

TORCH_LIBRARY(BATCHINFER_OPS_NS, m) {
  m.def("paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor cu_seqlens_q, "
        "Tensor seq_lens, float scale, int sliding_window, float softcap, int work, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(BATCHINFER_OPS_NS, CPU, m) { m.impl("paged_decode", &batchinfer_ops::paged_decode); }
