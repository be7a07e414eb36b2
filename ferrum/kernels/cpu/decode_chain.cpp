// A step of few rows through every decoder layer in one call: the same kernels, in the same order, as
// the layered forward with the CPU's ops (ferrum.models.cpu_decode), without a Python round trip per
// op. Per layer: RMSNorm (+ residual) -> qkv (+ bias) -> rope + KV write -> paged attention -> o_proj
// -> RMSNorm (+ residual) -> gate_up -> silu * mul -> down_proj; then the final RMSNorm.
//
// Every projection is int4 or int8 storage in the integer GEMV's layout, four tensors each in
// `weights` (packed, scale, offset or an empty tensor, bias or an empty tensor) and four ints in
// `layout` (bits, group, zero_point, out_features), in the order qkv, o, gate_up, down per layer.

#include "common.h"

namespace ferrum_cpu {
namespace {

constexpr int64_t PER_PROJECTION = 4, PROJECTIONS = 4;

at::Tensor project(const at::Tensor& x, const at::TensorList weights, c10::IntArrayRef layout, int64_t index) {
  const at::Tensor& packed = weights[index * PER_PROJECTION];
  const at::Tensor& scale = weights[index * PER_PROJECTION + 1];
  const at::Tensor& offset = weights[index * PER_PROJECTION + 2];
  const at::Tensor& bias = weights[index * PER_PROJECTION + 3];
  const int64_t bits = layout[index * PER_PROJECTION], group = layout[index * PER_PROJECTION + 1];
  const bool zero_point = layout[index * PER_PROJECTION + 2] != 0;
  const int64_t out_features = layout[index * PER_PROJECTION + 3];
  at::Tensor y = bits == 4 ? int4_gemv(x, packed, scale, offset, zero_point, group) : int8_gemv(x, packed, scale, group);
  if (y.size(1) != out_features) y = y.narrow(1, 0, out_features).contiguous();
  if (bias.numel()) y.add_(bias);
  return y;
}

}  // namespace

at::Tensor decode_layers(const at::Tensor& x_in, at::TensorList norms, at::TensorList weights, c10::IntArrayRef layout,
                         at::TensorList k_caches, at::TensorList v_caches, const at::Tensor& positions,
                         const at::Tensor& cos_table, const at::Tensor& sin_table, const at::Tensor& slots,
                         const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_starts,
                         int64_t block_size, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps,
                         c10::IntArrayRef windows, const c10::optional<at::Tensor>& generated) {
  const int64_t layers = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(v_caches.size() == k_caches.size() && static_cast<int64_t>(norms.size()) == 2 * layers + 1 &&
                  static_cast<int64_t>(weights.size()) == layers * PROJECTIONS * PER_PROJECTION &&
                  static_cast<int64_t>(layout.size()) == layers * PROJECTIONS * PER_PROJECTION,
              message("decode_layers: per layer two norms, ", PROJECTIONS, " projections of ", PER_PROJECTION,
                      " tensors and ints each, and a k and v cache; then the final norm"));
  TORCH_CHECK(static_cast<int64_t>(windows.size()) == layers, "decode_layers: one window per layer (0: none)");
  const int64_t rows = x_in.size(0), q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  const double scale = std::pow(static_cast<double>(head_dim), -0.5);  // as Python's head_dim**-0.5
  at::Tensor x = x_in.contiguous();
  c10::optional<at::Tensor> residual;
  // a cache narrower than the activations (int8, or 16 bits under float32) gives paged_attention the step's
  // own keys and values where a prompt starts in this step (it reads them as computed); decodes read every
  // key from the cache and need no views of them
  bool fresh = false;
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* starts = query_starts.data_ptr<int32_t>();
  for (int64_t b = 0; b < seq_lens.size(0); ++b) fresh = fresh || lens[b] == starts[b + 1] - starts[b];
  for (int64_t l = 0; l < layers; ++l) {
    auto [normed, summed] = rms_norm(x, norms[2 * l], eps, residual);
    residual = summed;
    at::Tensor qkv = project(normed, weights, layout, l * PROJECTIONS);
    rope_write(qkv, positions, cos_table, sin_table, k_caches[l], v_caches[l], slots, num_heads, num_kv_heads);
    at::Tensor out = at::empty({rows, num_heads, head_dim}, qkv.options());
    c10::optional<at::Tensor> k, v;
    if (fresh && k_caches[l].scalar_type() != qkv.scalar_type()) {
      k = qkv.narrow(1, q_size, kv_size).view({rows, num_kv_heads, head_dim});
      v = qkv.narrow(1, q_size + kv_size, kv_size).view({rows, num_kv_heads, head_dim});
    }
    paged_attention(out, qkv.narrow(1, 0, q_size).view({rows, num_heads, head_dim}), k_caches[l], v_caches[l],
                    block_tables, seq_lens, query_starts, block_size, scale, windows[l], k, v, generated);
    x = project(out.view({rows, q_size}), weights, layout, l * PROJECTIONS + 1);
    std::tie(normed, summed) = rms_norm(x, norms[2 * l + 1], eps, residual);
    residual = summed;
    x = project(silu_and_mul(project(normed, weights, layout, l * PROJECTIONS + 2)), weights, layout,
                l * PROJECTIONS + 3);
  }
  return std::get<0>(rms_norm(x, norms[2 * layers], eps, residual));
}

}  // namespace ferrum_cpu
