// The library's entry points as C++ functions (namespace batchinfer_ops): each source registers its
// own as torch ops, and layer_loop.cpp calls them directly, without the dispatcher or Python between;
// and the small pieces the sources share.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <tuple>

namespace batchinfer_ops {

// Element i of an int32 / int64 index tensor (positions, slots, block tables, offsets).
inline int64_t index_at(const at::Tensor& t, int64_t i) {
  return t.scalar_type() == at::kLong ? t.data_ptr<int64_t>()[i] : t.data_ptr<int32_t>()[i];
}

// fused_ops.cpp: (normed, x + residual); without a residual the second is an empty tensor.
std::tuple<at::Tensor, at::Tensor> rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps,
                                            const std::optional<at::Tensor>& residual);

// fused_ops.cpp: q and k rotated in place; with the caches, k and v written to their slots.
void rotary_cache(const at::Tensor& positions, const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos_sin,
                  bool is_neox, const std::optional<at::Tensor>& v, const std::optional<at::Tensor>& k_cache,
                  const std::optional<at::Tensor>& v_cache, const std::optional<at::Tensor>& slot_mapping);

// fused_ops.cpp: silu(gate) * up [T, I] of x [T, 2 I] = [gate | up].
at::Tensor silu_and_mul(const at::Tensor& x);

// gemv.cpp: x [M <= GEMV_MAX_ROWS, K] @ w [N, K].T (+ bias) in x's dtype.
constexpr int64_t GEMV_MAX_ROWS = 8;
at::Tensor gemv_dense(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias);
// Whether gemv_dense is the faster product for these rows and this weight (kernels.cpu_ext.gemv.supports
// asks the same of the Python side's tensors).
bool gemv_dense_takes(const at::Tensor& x, const at::Tensor& w);

// gemv.cpp: (x [M <= GEMV_INT8_MAX_ROWS, K] @ q [N, K].T) * scales (+ bias) for int8 codes, where
// gemv_int8_runs() (AVX-512), M <= GEMV_INT8_VNNI_MAX_ROWS with AVX512-VNNI; gemv_int8_takes: that, the
// rows and the codes' layout (gemv.int8_supports).
constexpr int64_t GEMV_INT8_MAX_ROWS = 4;
constexpr int64_t GEMV_INT8_VNNI_MAX_ROWS = 8;
at::Tensor gemv_int8(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales,
                     const std::optional<at::Tensor>& bias);
bool gemv_int8_runs();
bool gemv_int8_takes(const at::Tensor& x, const at::Tensor& q);

// paged_decode.cpp: attention of every decode row over its paged context, into out.
void paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& block_tables, const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens,
                  double scale, int64_t sliding_window, double softcap, int64_t work, const at::Tensor& out);

}  // namespace batchinfer_ops
