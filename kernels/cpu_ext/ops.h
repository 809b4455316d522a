// The library's entry points as C++ functions (namespace batchinfer_ops): each source registers its
// own as torch ops, and layer_loop.cpp calls them directly, without the dispatcher or Python between.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <tuple>

namespace batchinfer_ops {

// fused_ops.cpp: (normed, x + residual); without a residual the second is an empty tensor.
std::tuple<at::Tensor, at::Tensor> rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps,
                                            const std::optional<at::Tensor>& residual);

// fused_ops.cpp: q and k rotated in place; with the caches, k and v written to their slots.
void rotary_cache(const at::Tensor& positions, const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos_sin,
                  bool is_neox, const std::optional<at::Tensor>& v, const std::optional<at::Tensor>& k_cache,
                  const std::optional<at::Tensor>& v_cache, const std::optional<at::Tensor>& slot_mapping);

// gemv.cpp: x [M <= 4, K] @ w [N, K].T (+ bias) in x's dtype.
at::Tensor gemv_dense(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias);

// gemv.cpp: (x [M <= 4, K] @ q [N, K].T) * scales (+ bias) for int8 codes, where gemv_int8_runs().
at::Tensor gemv_int8(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales,
                     const std::optional<at::Tensor>& bias);
bool gemv_int8_runs();

// paged_decode.cpp: attention of every decode row over its paged context, into out.
void paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& block_tables, const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens,
                  double scale, int64_t sliding_window, double softcap, int64_t work, const at::Tensor& out);

}  // namespace batchinfer_ops
