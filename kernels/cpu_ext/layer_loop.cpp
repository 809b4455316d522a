// The decoder's layer loop of a decode step in one call (batchinfer.kernels.cpu_ext.layers).
//
// At one token a sequence a step's arithmetic is small and the Python around it is not: on the
// ~20M tiny Llama a decode step spent ~1.2 ms of ~3 in the model's Python (module calls, views, the
// wrappers' checks), ~200 us a layer. This runs what workers/models/decoder.py runs for a plain
// pre-norm block (Llama, Qwen2, SmolLM2: RMSNorm, fused qkv, RoPE, paged attention, SwiGLU), layer
// after layer, calling the same ops in the same order: the library's own entry points directly
// (ops.h) and torch's (at::linear, the packed int8 / int4 matmuls) through the dispatcher. So
// its output is the Python path's bit for bit; only the Python is gone.
//
// Per layer, ``weights`` holds PER_LAYER optional tensors: the input norm's weight, the post-
// attention norm's, then for qkv_proj, o_proj, gate_up_proj, down_proj each (weight, qweight,
// scales or scales_and_zeros, bias); the final norm's weight follows the last layer. ``kinds`` says
// how each linear runs (Kind below, as workers/quant's modules run it), ``packed_max_rows`` a
// quantized linear's row limit for its packed kernel. Every sequence must have at most one query
// (a decode step); the caller (workers/quant/layer_loop.py) sends other steps down the Python path.

#include <ATen/core/Tensor.h>
#include <ATen/ops/_weight_int4pack_mm_for_cpu.h>
#include <ATen/ops/_weight_int8pack_mm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <ATen/core/List.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

#include "ops.h"
#include "vec.h"

namespace {

enum Kind : int64_t {
  TORCH = 0,  // nn.Linear: at::linear
  GEMV = 1,   // GemvLinear: gemv_dense where gemv_dense_takes the rows, at::linear otherwise
  INT8 = 2,   // QuantizedLinear int8: the packed kernel (gemv_int8 where it takes them) up to
              // packed_max_rows rows, the dense copy above (through gemv_dense where it takes them)
  INT4 = 3,   // QuantizedLinear int4: the same with the int4 pack
};
constexpr int64_t LINEARS = 4;      // qkv_proj, o_proj, gate_up_proj, down_proj
constexpr int64_t PER_LINEAR = 4;   // weight, qweight, scales / scales_and_zeros, bias
constexpr int64_t PER_LAYER = 2 + LINEARS * PER_LINEAR;
constexpr int64_t INT4_GROUP = 32;  // workers/quant/linear.py's GROUP_SIZE

using Slots = std::vector<std::optional<at::Tensor>>;

const at::Tensor& need(const Slots& w, int64_t i, const char* what) {
  TORCH_CHECK(w[i].has_value(), "decode_layers: weights[", i, "] (", what, ") is missing");
  return *w[i];
}

// x [M, K] -> [M, N], as the module of kind ``kind`` computes it (workers/quant/dense.py, linear.py).
at::Tensor linear(const at::Tensor& x, const Slots& w, int64_t at_slot, int64_t kind, int64_t packed_max_rows) {
  const at::Tensor& weight = need(w, at_slot, "a linear's weight");
  const std::optional<at::Tensor>& bias = w[at_slot + 3];
  const int64_t M = x.size(0);
  if (kind == TORCH || kind == GEMV) {
    const bool gemv = kind == GEMV && batchinfer_ops::gemv_dense_takes(x, weight);  // as GemvLinear picks
    return gemv ? batchinfer_ops::gemv_dense(x, weight, bias) : at::linear(x, weight, bias);
  }
  TORCH_CHECK(kind == INT8 || kind == INT4, "decode_layers: unknown linear kind ", kind);
  at::Tensor xb = x.scalar_type() == at::kBFloat16 ? x : x.to(at::kBFloat16);
  at::Tensor y;
  if (M > packed_max_rows) {  // the dense bfloat16 copy, through the GEMV as QuantizedLinear runs it
    y = batchinfer_ops::gemv_dense_takes(xb, weight) ? batchinfer_ops::gemv_dense(xb, weight, bias)
                                                     : at::linear(xb, weight, bias);
  } else {
    xb = xb.contiguous();
    const at::Tensor& packed = need(w, at_slot + 1, "a quantized linear's qweight");
    const at::Tensor& scales = need(w, at_slot + 2, "a quantized linear's scales");
    if (kind == INT8 && batchinfer_ops::gemv_int8_takes(xb, packed)) {  // as QuantizedLinear picks
      y = batchinfer_ops::gemv_int8(xb, packed, scales, bias);
    } else {
      y = kind == INT8 ? at::_weight_int8pack_mm(xb, packed, scales)
                       : at::_weight_int4pack_mm_for_cpu(xb, packed, INT4_GROUP, scales);
      if (bias.has_value()) y = y.add(*bias);
    }
  }
  return y.scalar_type() == x.scalar_type() ? y : y.to(x.scalar_type());
}

}  // namespace

namespace batchinfer_ops {

// x [T, C]: the step's embedded tokens (one per sequence at most). Returns the final hidden states
// [T, C] after the last norm, as Decoder.forward does; the caches get this step's keys and values.
at::Tensor decode_layers(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos_sin,
                         const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                         const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens, at::TensorList k_caches,
                         at::TensorList v_caches, const c10::List<std::optional<at::Tensor>>& weights,
                         at::IntArrayRef kinds, at::IntArrayRef packed_max_rows, at::IntArrayRef sliding_windows,
                         int64_t num_heads, int64_t num_kv_heads, double scale, double eps) {
  const int64_t L = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(L >= 1 && static_cast<int64_t>(v_caches.size()) == L, "decode_layers: one k and v cache per layer");
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == L * PER_LAYER + 1, "decode_layers: ", L * PER_LAYER + 1,
              " weight slots for ", L, " layers, got ", weights.size());
  TORCH_CHECK(static_cast<int64_t>(kinds.size()) == L * LINEARS &&
                  static_cast<int64_t>(packed_max_rows.size()) == L * LINEARS &&
                  static_cast<int64_t>(sliding_windows.size()) == L,
              "decode_layers: kinds and packed_max_rows need ", LINEARS, " entries a layer, sliding_windows one");
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2, "decode_layers: x must be a CPU [T, C] tensor");
  const int64_t T = x.size(0), D = k_caches[0].size(3);
  TORCH_CHECK(num_heads > 0 && num_kv_heads > 0 && num_heads % num_kv_heads == 0,
              "decode_layers: bad head counts ", num_heads, " / ", num_kv_heads);
  const int64_t q_size = num_heads * D, kv_size = num_kv_heads * D;
  // A decode step: every sequence has zero or one query, the rows are the queries.
  const at::Tensor cu = cu_seqlens_q.contiguous(), lens = seq_lens.contiguous(), table = block_tables.contiguous();
  TORCH_CHECK(cu.dim() == 1 && cu.size(0) >= 1 && (cu.scalar_type() == at::kInt || cu.scalar_type() == at::kLong),
              "decode_layers: cu_seqlens_q must be int32/int64 [S + 1]");
  for (int64_t i = 0; i + 1 < cu.size(0); ++i) {
    const int64_t n = index_at(cu, i + 1) - index_at(cu, i);
    TORCH_CHECK(n == 0 || n == 1, "decode_layers: sequence ", i, " has ", n, " queries; a decode step has at most 1");
  }
  TORCH_CHECK(index_at(cu, 0) == 0 && index_at(cu, cu.size(0) - 1) == T, "decode_layers: cu_seqlens_q must span the ",
              T, " rows of x");
  const at::Tensor pos = positions.contiguous(), slots = slot_mapping.contiguous();
  const Slots w = weights.vec();

  at::Tensor h = x, residual;
  for (int64_t l = 0; l < L; ++l) {
    const int64_t base = l * PER_LAYER, lin = l * LINEARS;
    const at::Tensor& input_norm = need(w, base, "input_layernorm");
    if (l == 0) {
      residual = h;
      h = std::get<0>(rms_norm(h, input_norm, eps, std::nullopt));
    } else {
      std::tie(h, residual) = rms_norm(h, input_norm, eps, residual);
    }
    const at::Tensor qkv = linear(h, w, base + 2, kinds[lin], packed_max_rows[lin]);  // [T, Q + 2 KV]
    TORCH_CHECK(qkv.size(1) == q_size + 2 * kv_size, "decode_layers: layer ", l, "'s qkv_proj gives ", qkv.size(1),
                " features, the heads need ", q_size + 2 * kv_size);
    const at::Tensor q = qkv.narrow(1, 0, q_size).view({T, num_heads, D});
    const at::Tensor k = qkv.narrow(1, q_size, kv_size).view({T, num_kv_heads, D});
    const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({T, num_kv_heads, D});
    rotary_cache(pos, q, k, cos_sin, true, v, k_caches[l], v_caches[l], slots);
    const at::Tensor o = at::empty({T, num_heads, D}, q.options());  // [T, H, D]
    paged_decode(q, k_caches[l], v_caches[l], table, cu, lens, scale, sliding_windows[l], 0.0, -1, o);
    h = linear(o.view({T, q_size}), w, base + 2 + PER_LINEAR, kinds[lin + 1], packed_max_rows[lin + 1]);
    std::tie(h, residual) = rms_norm(h, need(w, base + 1, "post_attention_layernorm"), eps, residual);
    const at::Tensor gate_up = linear(h, w, base + 2 + 2 * PER_LINEAR, kinds[lin + 2], packed_max_rows[lin + 2]);
    // [T, 2 I] -> silu(gate) * up [T, I]
    h = silu_and_mul(gate_up);
    h = linear(h, w, base + 2 + 3 * PER_LINEAR, kinds[lin + 3], packed_max_rows[lin + 3]);
  }
  return std::get<0>(rms_norm(h, need(w, L * PER_LAYER, "the final norm"), eps, residual));
}

}  // namespace batchinfer_ops

TORCH_LIBRARY_FRAGMENT(BATCHINFER_OPS_NS, m) {
  m.def("decode_layers(Tensor x, Tensor positions, Tensor cos_sin, Tensor slot_mapping, Tensor block_tables, "
        "Tensor cu_seqlens_q, Tensor seq_lens, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, Tensor?[] weights, "
        "int[] kinds, int[] packed_max_rows, int[] sliding_windows, int num_heads, int num_kv_heads, "
        "float scale, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(BATCHINFER_OPS_NS, CPU, m) {
  m.impl("decode_layers", &batchinfer_ops::decode_layers);
}
