// The decoder layer's small ops on the CPU, each one pass over its rows, in the order of operations
// of the plain-PyTorch path (ferrum.models.layers.ops, ferrum.models.layers.rotary): the same
// roundings to the activations' dtype after each step, so that both paths agree.

#include "common.h"
#include "simd.h"

#include <type_traits>

namespace ferrum_cpu {
namespace {

// the vector path: float32 or bfloat16 rows whose length is a multiple of 16
template <typename T>
constexpr bool vector_type = std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>;

template <typename T>
inline F16 rounded16(F16 v) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) return round_bf16(v);
  return v;
}

template <typename T>
void rms_norm_row(const T* x, const T* res, const T* w, T* summed, T* normed, int64_t N, float eps, float* h) {
  if constexpr (vector_type<T>) {
    if (N % 16 == 0) {
      F16 squares = zero16();
      for (int64_t i = 0; i < N; i += 16) {
        F16 v = load16(x + i);
        if (res != nullptr) {
          v = rounded16<T>(add16(v, load16(res + i)));
          store16(summed + i, v);
        }
        store16(h + i, v);
        squares = fma16(v, v, squares);
      }
      float total[16];
      store16(total, squares);
      float sum = 0.f;
      for (float t : total) sum += t;
      const F16 inv = splat(1.f / std::sqrt(sum / float(N) + eps));
      for (int64_t i = 0; i < N; i += 16)
        store16(normed + i, rounded16<T>(mul16(load16(w + i), rounded16<T>(mul16(load16(h + i), inv)))));
      return;
    }
  }
  for (int64_t i = 0; i < N; ++i) {
    if (res != nullptr) {
      summed[i] = T(to_float(x[i]) + to_float(res[i]));
      h[i] = to_float(summed[i]);
    } else {
      h[i] = to_float(x[i]);
    }
  }
  const float inv = 1.f / std::sqrt(dot(h, h, N) / float(N) + eps);
  for (int64_t i = 0; i < N; ++i) normed[i] = T(to_float(w[i]) * rounded<T>(h[i] * inv));
}

template <typename T>
void silu_mul_row(const T* gate, const T* up, T* out, int64_t n) {
  int64_t i = 0;
  if constexpr (vector_type<T>) {
    for (; i + 16 <= n; i += 16) {
      const F16 g = load16(gate + i);
      const F16 e = exp16(mul16(g, splat(-1.f)));
      float denominator[16], numerator[16];
      store16(denominator, add16(e, splat(1.f)));
      store16(numerator, g);
      for (int j = 0; j < 16; ++j) numerator[j] /= denominator[j];
      store16(out + i, rounded16<T>(mul16(rounded16<T>(load16(static_cast<const float*>(numerator))), load16(up + i))));
    }
  }
  for (; i < n; ++i) {
    const float g = to_float(gate[i]);
    out[i] = T(rounded<T>(g / (1.f + std::exp(-g))) * to_float(up[i]));
  }
}

// One head's D values quantized for an int8 cache (common.h): round(x / scale) with scale max|x| / 127,
// so |error| <= scale / 2; as a row (the values, then the scale) or into token t of a k or v tile.
template <typename T>
inline float int8_head(const T* x, int64_t D, int32_t* q) {
  float amax = 0.f;
  for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(to_float(x[d])));
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  for (int64_t d = 0; d < D; ++d) q[d] = static_cast<int32_t>(std::nearbyint(to_float(x[d]) * inv));
  return amax / 127.f;
}

template <typename T>
inline void write_int8_row(const T* x, int8_t* dst, int64_t D, int32_t* q) {
  const float scale = int8_head(x, D, q);
  for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<int8_t>(q[d]);
  std::memcpy(dst + D, &scale, sizeof scale);
}

template <bool Key, typename T>
inline void write_int8_tile(const T* x, int8_t* tile, int64_t t, int64_t block_size, int64_t D, int32_t* q) {
  const float scale = int8_head(x, D, q);
  for (int64_t d = 0; d < D; ++d) {
    if constexpr (Key) tile[key_byte(t, d, D)] = static_cast<int8_t>(static_cast<uint8_t>(q[d] + 128));
    else tile[value_byte(t, d, D)] = static_cast<int8_t>(q[d]);
  }
  std::memcpy(tile + block_size * D + 4 * t, &scale, sizeof scale);
}

}  // namespace


// (x [+ residual]) -> (RMSNorm of it times weight, x [+ residual]); float32 statistics.
std::tuple<at::Tensor, at::Tensor> rms_norm(const at::Tensor& x_in, const at::Tensor& weight, double eps,
                                            const c10::optional<at::Tensor>& residual) {
  TORCH_CHECK(x_in.dim() == 2 && weight.dim() == 1 && weight.size(0) == x_in.size(1),
              "rms_norm: x must be [T, N] and weight [N]");
  TORCH_CHECK(weight.scalar_type() == x_in.scalar_type(), "rms_norm: weight and x must share a dtype");
  const at::Tensor x = x_in.contiguous();
  at::Tensor summed = x;
  if (residual.has_value()) {
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type(),
                "rms_norm: residual must be shaped and typed like x");
    summed = at::empty_like(x);
  }
  const at::Tensor res = residual.has_value() ? residual->contiguous() : x;
  at::Tensor normed = at::empty_like(x);
  const at::Tensor w = weight.contiguous();
  const int64_t T = x.size(0), N = x.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* rp = res.data_ptr<scalar_t>();
    const scalar_t* wp = w.data_ptr<scalar_t>();
    scalar_t* sp = summed.data_ptr<scalar_t>();
    scalar_t* np = normed.data_ptr<scalar_t>();
    const bool add = residual.has_value();
    at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> h(N);
      for (int64_t t = begin; t < end; ++t)
        rms_norm_row(xp + t * N, add ? rp + t * N : nullptr, wp, sp + t * N, np + t * N, N, float(eps), h.data());
    });
  });
  return {normed, summed};
}

// [T, 2n] (gate then up) -> silu(gate) * up [T, n]
at::Tensor silu_and_mul(const at::Tensor& gate_up_in) {
  TORCH_CHECK(gate_up_in.dim() == 2 && gate_up_in.size(1) % 2 == 0, "silu_and_mul: expected [T, 2n]");
  const at::Tensor gate_up = gate_up_in.contiguous();
  const int64_t T = gate_up.size(0), n = gate_up.size(1) / 2;
  at::Tensor out = at::empty({T, n}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "silu_and_mul", [&] {
    const scalar_t* gp = gate_up.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, T, std::max<int64_t>(1, 8192 / std::max<int64_t>(n, 1)), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) silu_mul_row(gp + t * 2 * n, gp + t * 2 * n + n, op + t * n, n);
    });
  });
  return out;
}

// D values from `src` into a bfloat16 or float16 `cache` at element `at`, each rounded to the nearest
template <typename T>
inline void copy_rounded(const T* src, at::Tensor& cache, int64_t at, int64_t D) {
  if (cache.scalar_type() == at::kBFloat16) {
    c10::BFloat16* dst = static_cast<c10::BFloat16*>(cache.data_ptr()) + at;
    for (int64_t d = 0; d < D; ++d) dst[d] = c10::BFloat16(to_float(src[d]));
  } else {
    c10::Half* dst = static_cast<c10::Half*>(cache.data_ptr()) + at;
    for (int64_t d = 0; d < D; ++d) dst[d] = c10::Half(to_float(src[d]));
  }
}

// Rotates the q and k heads of qkv [T, (H + 2 KV) * D] in place by each row's position (the
// half-split layout; cos and sin rounded to the dtype first, as the torch path does) and writes
// each row's k and v heads to its slot of the caches, [blocks, KV, block_size, W] or [slots, KV, W]
// (common.h's CacheStrides): W = D in qkv's dtype (or under float32 qkv in bfloat16 or float16, each value
// rounded), or int8 with W = D + 4, each head's values quantized
// with a float32 scale of their own, in rows or tiles (common.h).
void rope_write(at::Tensor qkv, const at::Tensor& positions, const at::Tensor& cos_table, const at::Tensor& sin_table,
                at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slots, int64_t num_heads,
                int64_t num_kv_heads) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1, "rope_write: qkv must be [T, width] with contiguous rows");
  const bool int8_cache = k_cache.scalar_type() == at::kChar;
  const bool cache16 = qkv.scalar_type() == at::kFloat &&
                          (k_cache.scalar_type() == at::kBFloat16 || k_cache.scalar_type() == at::kHalf);
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes() && k_cache.strides() == v_cache.strides() &&
                  v_cache.scalar_type() == k_cache.scalar_type() &&
                  (k_cache.scalar_type() == qkv.scalar_type() || int8_cache || cache16),
              "rope_write: the caches must be of one shape and layout, in qkv's dtype, int8, or (for float32 qkv) "
              "bfloat16 or float16");
  const int64_t block_size = k_cache.dim() == 4 ? k_cache.size(2) : 1;
  const CacheStrides strides = cache_strides(k_cache, block_size, "rope_write");
  const int64_t T = qkv.size(0), D = k_cache.size(-1) - (int8_cache ? 4 : 0), half = D / 2;
  TORCH_CHECK(k_cache.size(1) == num_kv_heads && qkv.size(1) == (num_heads + 2 * num_kv_heads) * D,
              "rope_write: qkv's width is not (heads + 2 kv heads) * head_dim");
  TORCH_CHECK(positions.scalar_type() == at::kLong && slots.scalar_type() == at::kLong && positions.size(0) == T &&
                  slots.size(0) == T && positions.is_contiguous() && slots.is_contiguous(),
              "rope_write: positions and slots must be int64 [T]");
  TORCH_CHECK(cos_table.scalar_type() == at::kFloat && sin_table.scalar_type() == at::kFloat &&
                  cos_table.is_contiguous() && sin_table.is_contiguous() && cos_table.size(1) == D,
              "rope_write: the cos / sin tables must be float32 [max_positions, head_dim]");
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t max_pos = cos_table.size(0), num_slots = k_cache.size(0) * block_size;
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_pos && slot[t] >= 0 && slot[t] < num_slots,
                message("rope_write: row ", t, " has position ", pos[t], " (table of ", max_pos, ") and slot ", slot[t],
                        " (cache of ", num_slots, ")"));
  const float* ct = cos_table.data_ptr<float>();
  const float* st = sin_table.data_ptr<float>();
  const int64_t rotated = num_heads + num_kv_heads, row_stride = qkv.stride(0);
  const bool tiled = int8_tiled(k_cache, block_size);
  int8_t* k8 = int8_cache ? static_cast<int8_t*>(k_cache.data_ptr()) : nullptr;
  int8_t* v8 = int8_cache ? static_cast<int8_t*>(v_cache.data_ptr()) : nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rope_write", [&] {
    scalar_t* base = qkv.data_ptr<scalar_t>();
    at::parallel_for(0, T, 8, [&](int64_t begin, int64_t end) {
      std::vector<float> x(D);
      std::vector<int32_t> q(D);
      for (int64_t t = begin; t < end; ++t) {
        scalar_t* row = base + t * row_stride;
        const float* c = ct + pos[t] * D;
        const float* s = st + pos[t] * D;
        for (int64_t h = 0; h < rotated; ++h) {
          scalar_t* head = row + h * D;
          for (int64_t d = 0; d < D; ++d) x[d] = to_float(head[d]);
          for (int64_t d = 0; d < D; ++d) {
            const float turned = d < half ? -x[d + half] : x[d - half];
            const float a = rounded<scalar_t>(x[d] * rounded<scalar_t>(c[d]));
            const float b = rounded<scalar_t>(turned * rounded<scalar_t>(s[d]));
            head[d] = scalar_t(a + b);
          }
        }
        const scalar_t* k = row + num_heads * D;
        const scalar_t* v = row + rotated * D;
        const int64_t block = slot[t] / block_size;
        const int64_t offset = block * strides.block + (slot[t] - block * block_size) * strides.slot;
        for (int64_t h = 0; h < num_kv_heads; ++h) {
          const int64_t at = offset + h * strides.head;
          if (tiled) {
            const int64_t t_in = slot[t] - block * block_size;  // at = the tile's offset + t_in
            write_int8_tile<true>(k + h * D, k8 + at - t_in, t_in, block_size, D, q.data());
            write_int8_tile<false>(v + h * D, v8 + at - t_in, t_in, block_size, D, q.data());
          } else if (int8_cache) {
            write_int8_row(k + h * D, k8 + at, D, q.data());
            write_int8_row(v + h * D, v8 + at, D, q.data());
          } else if (cache16) {  // float32 rows rounded to the cache's 16 bits
            copy_rounded(k + h * D, k_cache, at, D);
            copy_rounded(v + h * D, v_cache, at, D);
          } else {
            std::copy(k + h * D, k + (h + 1) * D, k_cache.data_ptr<scalar_t>() + at);
            std::copy(v + h * D, v + (h + 1) * D, v_cache.data_ptr<scalar_t>() + at);
          }
        }
      }
    });
  });
}

}  // namespace ferrum_cpu
