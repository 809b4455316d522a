// CPU decode attention straight from the paged KV cache (batchinfer.kernels.cpu_ext.decode).
//
// Every sequence of the batch with exactly one query this step (a decode row) attends over its
// context [lo, len) (lo = len - window with a sliding window, else 0), read block by block from
// the block table: no gather copy. Per work item (a whole sequence by default, or one of its KV
// heads when sequences are too few for the threads), three passes: the scores of the item's query
// heads over the whole context (each block read once for all its heads, each key row once for two or
// three query heads; per-key partial sums folded 16 keys at a time), one softmax per query head, then the
// values. Compute is float32 whatever the cache dtype (float32, bfloat16, float16). The rows of the
// block two ahead are prefetched while a block is computed; past a pass's end, the first blocks of the
// next pass (values after keys, the next item's keys after values), so only a thread's first pass
// starts from memory unprefetched.
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

// Sums of 16 vectors at once, lane i of the result = the sum of vector i's lanes: four rounds of
// "shuffle two vectors' halves apart, add", 30 shuffles and 15 adds for 16 dot products, where
// reducing each alone costs ~8 instructions. Round r folds the results of 2^r keys into half as many
// lanes each: fold8 for pairs of keys, fold4 for fours, fold2 for eights, fold1 for all 16.
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

// Blocks ahead whose rows are prefetched: 2 read float32 K/V from memory 5-10 % faster than 1 or 4
// (bench/engine_cpu.py --attention shapes, Xeon VM).
constexpr int64_t kPrefetchBlocks = 2;

// Sequences a thread needs before the default work items are whole sequences: ragged contexts handed
// out longest first balance over the threads with a few items each.
constexpr int64_t kItemsPerThread = 4;

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

// Scratch of one work item of QH query heads, in vf units (see `attend`): `span` = the longest
// context's blocks x BP.
int64_t scratch_size(int64_t QH, int64_t D, int64_t bs, int64_t span) {
  const int64_t NV = D / LANES, BP = (bs + LANES - 1) / LANES * LANES;
  return 2 * QH * NV + BP * NV + (QH * span + 2 * QH + LANES - 1) / LANES;
}

// The first position a context of `len` keys attends to (0 without a sliding window): the kernel's
// checks, its scratch size and its passes all start there.
BATCHINFER_INLINE int64_t window_lo(int64_t window, int64_t len) {
  return window > 0 ? std::max<int64_t>(0, len - window) : 0;
}

// What a pass reads: heads [h, h + nh)'s rows of a cache (strides sb / st / sh: block, token, head)
// over the context of sequence `seq`; cache null: nothing.
template <class T>
struct Rows {
  const T* cache;
  int64_t sb, st, sh, h, nh, seq, len;
};

// Block j of a pass over `cur` (nb blocks): its id, its rows [t0, t1) inside the context, and what to
// prefetch meanwhile: the block kPrefetchBlocks ahead or, past the pass's end, the first blocks of the
// pass after it (`after`: the values after the keys, the next head's or item's keys after the values),
// so that no pass but the first starts cold.
template <class T>
struct BlockRows {
  int64_t blk, t0, t1;
  const T* next;  // the first head's rows of the block to prefetch (null: none, and the counts 0)
  int64_t next_rows, next_st, next_sh, next_nh;

  // Head hh's rows of that block (null past its heads: the pass after may cover fewer).
  BATCHINFER_INLINE const T* next_head(int64_t hh) const { return hh < next_nh ? next + hh * next_sh : nullptr; }
};
template <class T>
BATCHINFER_INLINE BlockRows<T> block_rows(const Problem& p, const Rows<T>& cur, const Rows<T>& after, int64_t lo,
                                          int64_t j, int64_t nb) {
  const int64_t b = lo / p.bs + j;
  BlockRows<T> r{block_id(p, cur.seq, b), std::max<int64_t>(lo - b * p.bs, 0),
                 std::min<int64_t>(cur.len - b * p.bs, p.bs), nullptr, 0, 0, 0, 0};
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
  r.next_sh = to->sh;
  r.next_nh = to->nh;
  return r;
}

// One KV head's key rows of a block, read for GC query heads at a time (scores pass).
template <class S>
struct KeyRows {
  const typename S::T* rows;  // row t at rows + t * st
  int64_t st, t1;  // rows [t1, ...) are no keys: their sums are 0, their rows not read
  const vf* q;  // [GC, NV] the query heads' scaled rows
  int64_t NV;
  const typename S::T* pf;  // the block to come's rows of this head (prefetched below pf_rows)
  int64_t pf_st, pf_rows;
};

// x[g] = per-lane partial dot products of key row t with query head g (lane l: the sum over the lane
// groups c of q[g, c * 16 + l] * k[t, c * 16 + l]); the row is loaded once for the GC heads.
template <class S, int NVT, int GC>
BATCHINFER_INLINE void key_dots(const KeyRows<S>& kr, int64_t t, vf* __restrict x) {
  if (t < kr.pf_rows) prefetch_row<S>(kr.pf + t * kr.pf_st, kr.NV * LANES);
  if (t >= kr.t1) {
    for (int g = 0; g < GC; ++g) x[g] = vf{};
    return;
  }
  const int64_t NV = NVT > 0 ? NVT : kr.NV;
  const typename S::T* kt = kr.rows + t * kr.st;
  const vf k0 = S::load(kt);
  for (int g = 0; g < GC; ++g) x[g] = kr.q[g * NV] * k0;
  for (int64_t c = 1; c < NV; ++c) {
    const vf kc = S::load(kt + c * LANES);
    for (int g = 0; g < GC; ++g) x[g] += kr.q[g * NV + c] * kc;
  }
}

// The scores of keys [t, t + N) folded as they are computed (the fold tree's state, a vector per
// level, stays in registers; storing the 16 partial vectors and reading them back cost two memory
// operations per key and head): after N = 16, lane i of out[g] is query head g's score of key t + i.
template <class S, int NVT, int GC, int N>
BATCHINFER_INLINE void key_sums(const KeyRows<S>& kr, int64_t t, vf* __restrict out) {
  if constexpr (N == 1) {
    key_dots<S, NVT, GC>(kr, t, out);
  } else {
    vf a[GC], b[GC];
    key_sums<S, NVT, GC, N / 2>(kr, t, a);
    key_sums<S, NVT, GC, N / 2>(kr, t + N / 2, b);
    for (int g = 0; g < GC; ++g) {
      if constexpr (N == 2) out[g] = fold8(a[g], b[g]);
      else if constexpr (N == 4) out[g] = fold4(a[g], b[g]);
      else if constexpr (N == 8) out[g] = fold2(a[g], b[g]);
      else out[g] = fold1(a[g], b[g]);
    }
  }
}

// acc[g, c] += sum over keys t in [t0, t1) of w[g * w_stride + t] * v[t, c] for GN query heads and
// NVT lane groups, the GN x NVT sums held in registers; value rows of element type R (the cache's own,
// converted as they are loaded, or floats converted before). Meanwhile row t of `pf` (a block to come
// of the cache, element type S, rows below `pf_rows`) is prefetched with value row t: spread over the
// work, as in the scores pass, rather than in one burst before it (float32 reads from memory
// 1.04-1.16x faster).
template <class S, class R, int NVT, int GN>
BATCHINFER_INLINE void values_tile(const typename R::T* __restrict vr, int64_t vst, int64_t t0, int64_t t1,
                                   const float* __restrict w, int64_t w_stride, vf* __restrict acc,
                                   const typename S::T* pf, int64_t pf_st, int64_t pf_rows) {
  vf a[GN][NVT];
  for (int g = 0; g < GN; ++g) {
    for (int c = 0; c < NVT; ++c) a[g][c] = acc[g * NVT + c];
  }
  for (int64_t t = t0; t < t1; ++t) {
    if (t < pf_rows) prefetch_row<S>(pf + t * pf_st, NVT * LANES);
    const typename R::T* vt = vr + t * vst;
    for (int c = 0; c < NVT; ++c) {
      const vf x = R::load(vt + c * LANES);
      for (int g = 0; g < GN; ++g) a[g][c] += w[g * w_stride + t] * x;
    }
  }
  for (int g = 0; g < GN; ++g) {
    for (int c = 0; c < NVT; ++c) acc[g * NVT + c] = a[g][c];
  }
}

// The value pass over one head's rows of a block for its G query heads, GT at a time (values_tile).
template <class S, class R, int NVT, int GT>
BATCHINFER_INLINE void values_tiles(const typename R::T* __restrict vr, int64_t vst, int64_t t0, int64_t t1, int64_t G,
                                    const float* __restrict w, int64_t w_stride, vf* __restrict acc,
                                    const typename S::T* pf, int64_t pf_st, int64_t pf_rows) {
  for (int64_t g0 = 0; g0 < G; g0 += GT) {
    const float* wg = w + g0 * w_stride;
    vf* ag = acc + g0 * NVT;
    switch (std::min<int64_t>(GT, G - g0)) {
      case 1: values_tile<S, R, NVT, 1>(vr, vst, t0, t1, wg, w_stride, ag, pf, pf_st, pf_rows); break;
      case 2: values_tile<S, R, NVT, 2>(vr, vst, t0, t1, wg, w_stride, ag, pf, pf_st, pf_rows); break;
      case 3:
        if constexpr (GT >= 3) values_tile<S, R, NVT, 3>(vr, vst, t0, t1, wg, w_stride, ag, pf, pf_st, pf_rows);
        break;
      default:
        if constexpr (GT >= 4) values_tile<S, R, NVT, 4>(vr, vst, t0, t1, wg, w_stride, ag, pf, pf_st, pf_rows);
        break;
    }
  }
}

// One work item: KV heads [h0, h1) of one sequence, whose query is row `row` and context `len`.
// Three passes over the context [lo, len), the blocks of positions (lo / bs) * bs..:
//   1. scores of the item's query heads (G per KV head), block by block and, inside a block, head by
//      head: per key a partial vector per query head, folded 16 keys at a time as they come
//      (key_sums), into s[hh * G + g, j * BP + t] (-inf where no key is);
//   2. the softmax of each query head's scores at once (one max, one vector exp a 16 keys);
//   3. the values, block by block and, inside a block, head by head: acc[g] += w[g, t] * v[t]
//      (values_tile: sums in registers).
// An item of several KV heads reads each block's rows of all of them in one visit (with the cache's
// [block, token, head, dim] layout, the block's one contiguous span), where a pass per head read one
// head's run of every token's row and came back for the next head later: as plain reads of shuffled
// blocks with the same prefetching, 0.65-0.88 of a contiguous read whole against 0.55-0.70 a head at a
// time (bench/kv_read.c, docs/benchmarks.md "Whole blocks per visit").
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
  const int64_t HN = h1 - h0, G = p.G, QH = HN * G;  // KV heads and query heads of the item
  const int64_t NV = NVT > 0 ? NVT : p.D / LANES, bs = p.bs, BP = (bs + LANES - 1) / LANES * LANES;
  vf* __restrict qf = w;  // [QH, NV] scaled queries
  vf* __restrict acc = qf + QH * NV;  // [QH, NV] unnormalized outputs
  vf* __restrict buf = acc + QH * NV;  // [BP, NV] a block's value rows of one head as floats (non-float32)
  float* __restrict s = reinterpret_cast<float*>(buf + BP * NV);  // [QH, span] scores, then weights
  float* __restrict l = s + QH * span;  // [QH] softmax sums
  const int64_t lo = window_lo(p.window, len);
  const int64_t b0 = lo / bs, nb = (len + bs - 1) / bs - b0, n = nb * BP;  // n <= span
  const vi lane = vi{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const vf neg_inf = vf{} - std::numeric_limits<float>::infinity();
  const Rows<T> keys{k, p.k_sb, p.k_st, p.k_sh, h0, HN, seq, len}, values{v, p.v_sb, p.v_st, p.v_sh, h0, HN, seq, len};
  for (int64_t i = 0; i < QH; ++i) {  // query head i = (h0 + i / G) * G + i % G = h0 * G + i
    const T* qr = q + row * p.q_sr + (h0 * G + i) * p.q_sh;
    for (int64_t c = 0; c < NV; ++c) qf[i * NV + c] = S::load(qr + c * LANES) * p.scale;
  }
  // 1. Scores, block by block and, inside a block, head by head: 16 keys at a time for two or three
  // of the head's query heads (each key row loaded once for them), the fold tree in registers (key_sums);
  // the first such pass over a head also prefetches its rows of the block to come, a row per key.
  for (int64_t j = 0; j < nb; ++j) {
    const BlockRows<T> br = block_rows(p, keys, values, lo, j, nb);
    const int64_t t0 = br.t0, t1 = br.t1;
    for (int64_t hh = 0; hh < HN; ++hh) {
      const T* next = br.next_head(hh);
      KeyRows<S> kr{k + br.blk * p.k_sb + (h0 + hh) * p.k_sh, p.k_st, t1, nullptr, NV,
                    next, br.next_st, next == nullptr ? 0 : br.next_rows};
      // two query heads a pass, three for the last three (G = 3: SmolLM2's 9 heads over 3)
      for (int64_t g0 = 0, gc; g0 < G; g0 += gc) {
        gc = G - g0 == 3 ? 3 : std::min<int64_t>(2, G - g0);
        kr.q = qf + (hh * G + g0) * NV;
        for (int64_t t = 0; t < BP; t += LANES) {  // rows below t0 are read but masked out below
          vf sums[3];
          switch (gc) {
            case 3: key_sums<S, NVT, 3, 16>(kr, t, sums); break;
            case 2: key_sums<S, NVT, 2, 16>(kr, t, sums); break;
            default: key_sums<S, NVT, 1, 16>(kr, t, sums); break;
          }
          const vi pos = lane + static_cast<int32_t>(t);
          const auto keep = (pos >= static_cast<int32_t>(t0)) & (pos < static_cast<int32_t>(t1));
          for (int64_t g = 0; g < gc; ++g) {
            const vf x = keep ? sums[g] : neg_inf;
            std::memcpy(s + (hh * G + g0 + g) * span + j * BP + t, &x, sizeof x);
          }
        }
        kr.pf_rows = 0;  // asked for once
      }
    }
  }
  // 2. Softmax per query head (softcap first: tanh keeps -inf at -softcap, so masked lanes are
  // skipped).
  for (int64_t i = 0; i < QH; ++i) {
    float* __restrict sg = s + i * span;
    if (p.softcap > 0.0f) {
      for (int64_t x = 0; x < n; ++x) {
        if (sg[x] != -std::numeric_limits<float>::infinity()) sg[x] = p.softcap * std::tanh(sg[x] / p.softcap);
      }
    }
    vf mv = neg_inf;
    for (int64_t x = 0; x < n; x += LANES) {
      const vf y = load_f32(sg + x);
      mv = mv > y ? mv : y;
    }
    float mx = mv[0];
    for (int64_t x = 1; x < LANES; ++x) mx = std::max(mx, mv[x]);
    vf sum = vf{};
    for (int64_t x = 0; x < n; x += LANES) {
      const vf e = exp_nonpositive(load_f32(sg + x) - mx);  // -inf (no key) gives 0
      std::memcpy(sg + x, &e, sizeof e);
      sum += e;
    }
    l[i] = hsum(sum);
    for (int64_t c = 0; c < NV; ++c) acc[i * NV + c] = vf{};
  }
  // 3. Values. GT query heads a tile (NVT > 0): with G <= GT one tile reads a head's value rows once
  // and prefetches the rows to come as it goes; the rows it does not read (below t0, past t1), and
  // with several tiles or the generic head_dim every row, are asked for before.
  constexpr int64_t GT = NVT <= 4 ? 4 : 2;
  const bool one_tile = NVT > 0 && G <= GT;
  for (int64_t j = 0; j < nb; ++j) {
    const BlockRows<T> br = block_rows(p, values, follow, lo, j, nb);
    const int64_t t0 = br.t0, t1 = br.t1;
    for (int64_t hh = 0; hh < HN; ++hh) {
      const T* next = br.next_head(hh);
      const int64_t next_rows = next == nullptr ? 0 : br.next_rows;
      for (int64_t t = 0; t < next_rows; ++t) {
        if (!one_tile || t < t0 || t >= t1) prefetch_row<S>(next + t * br.next_st, NV * LANES);
      }
      const T* vh = v + br.blk * p.v_sb + (h0 + hh) * p.v_sh;
      const float* wh = s + hh * G * span + j * BP;
      int64_t vst;
      if constexpr (NVT > 0) {
        // GT query heads at a time, their GT x NVT sums in registers: each value row is loaded once
        // for them and the sums are independent (one running sum per lane group and key costs an
        // FMA latency a key). One tile converts a 16-bit cache's rows as it loads them; several
        // convert them into `buf` once, first.
        if (one_tile) {
          values_tiles<S, S, NVT, GT>(vh, p.v_st, t0, t1, G, wh, span, acc + hh * G * NV, next, br.next_st,
                                      next_rows);
        } else {
          const float* vr = rows_f32<S>(vh, p.v_st, t0, t1, NV, buf, &vst);
          values_tiles<S, F32, NVT, GT>(vr, vst, t0, t1, G, wh, span, acc + hh * G * NV, next, br.next_st, 0);
        }
      } else {
        const float* vr = rows_f32<S>(vh, p.v_st, t0, t1, NV, buf, &vst);
        for (int64_t g = 0; g < G; ++g) {
          const float* __restrict wg = s + (hh * G + g) * span + j * BP;
          vf* __restrict ag = acc + (hh * G + g) * NV;
          for (int64_t c = 0; c < NV; ++c) {  // two sums per lane group: two keys in flight
            const float* vc = vr + c * LANES;
            vf a0 = ag[c], a1 = vf{};
            int64_t t = t0;
            for (; t + 2 <= t1; t += 2) {
              a0 += wg[t] * load_f32(vc + t * vst);
              a1 += wg[t + 1] * load_f32(vc + (t + 1) * vst);
            }
            if (t < t1) a0 += wg[t] * load_f32(vc + t * vst);
            ag[c] = a0 + a1;
          }
        }
      }
    }
  }
  for (int64_t i = 0; i < QH; ++i) {
    T* orow = out + row * p.o_sr + (h0 * G + i) * p.o_sh;
    const float inv = 1.0f / l[i];
    for (int64_t c = 0; c < NV; ++c) {
      const vf a = acc[i * NV + c] * inv;
      for (int64_t x = 0; x < LANES; ++x) orow[c * LANES + x] = S::store(a[x]);
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

// work: 0 = one item per sequence (all its KV heads), 1 = one per (sequence, KV head), -1 = the default:
// per sequence once there are kItemsPerThread sequences a thread, else per KV head.
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
  // Per sequence by default: a sequence's blocks are read in one visit each for all its KV heads
  // (1.1-1.4x per-head items at 128-2,048 keys in float32, bench/engine_cpu.py --attention --ragged);
  // per (sequence, KV head) when sequences are too few to share out over the threads.
  if (work < 0) work = n >= kItemsPerThread * threads ? 0 : 1;
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
  const int64_t scratch = scratch_size(p.G * per_item, D, bs, span);
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
        const Rows<T> follow{a ? static_cast<const T*>(kp) : nullptr, p.k_sb, p.k_st, p.k_sh, ah, per_item,
                             a ? a->seq : 0, a ? a->len : 0};
        attend_f32(p, static_cast<const T*>(qp), static_cast<const T*>(kp), static_cast<const T*>(vp),
                   static_cast<T*>(op), r.row, r.seq, r.len, h0, h1, follow, span, w);
      } else {
        using T = uint16_t;
        const Rows<T> follow{a ? static_cast<const T*>(kp) : nullptr, p.k_sb, p.k_st, p.k_sh, ah, per_item,
                             a ? a->seq : 0, a ? a->len : 0};
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
