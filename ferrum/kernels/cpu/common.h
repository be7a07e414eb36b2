// Shared by the CPU kernels: conversions and the float32 vector loops they are built from (written
// for the compiler to vectorize: -O3 -march=native -fopenmp-simd).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

namespace ferrum_cpu {

// A check's message, its numbers written with std::to_string: TORCH_CHECK's own formatting of numbers
// (c10::str, through a stream) crashed the process instead of raising where the library was built by
// GCC 13.3 against torch 2.11's wheel (an H100 host's Xeon); messages of strings alone raised there.
inline std::string piece(const char* text) { return text; }
inline std::string piece(const std::string& text) { return text; }
template <typename T, typename = std::enable_if_t<std::is_arithmetic_v<T>>>
inline std::string piece(T number) {
  return std::to_string(number);
}
template <typename... Parts>
inline std::string message(const Parts&... parts) {
  std::string out;
  ((out += piece(parts)), ...);
  return out;
}

template <typename T>
inline float to_float(T v) {
  return static_cast<float>(v);
}

// v rounded to T's precision, as a float (what torch's T arithmetic stores after each op)
template <typename T>
inline float rounded(float v) {
  return static_cast<float>(T(v));
}

inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

inline void axpy(float* y, float a, const float* x, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

// Where a paged KV cache's elements lie: element (block, slot within the block, kv head, d) at
// block * block + within * slot + head * head + d. Two layouts: [blocks, KV, block_size, W] (each kv
// head's slots of a block side by side) and [slots, KV, W] (slot = block * block_size + within). An
// int8 cache in tiles (below) has slot 1: the offset of (block, within, head) is its tile's plus within.
struct CacheStrides {
  int64_t block, slot, head;
};

// An int8 cache (kv_cache_dtype int8) holds each kv head's head_dim (D) values of a slot as int8 with
// their float32 scale max|x| / 127, in one of two arrangements:
//  - rows: the D values, then the scale's 4 bytes (W = D + 4 per head and slot);
//  - tiles, where the cache is [blocks, KV, block_size, D + 4] with block_size a multiple of 16 and D of
//    4 (what the engine allocates for these kernels): each (block, kv head) is one tile of
//    block_size * (D + 4) bytes, the block's values first, then its block_size float32 scales. A k
//    tile holds each 16 tokens' keys plus 128, as uint8, by 4 dimensions at a time: token t's dimension
//    d at key_byte(t, d, D). A v tile holds each 4 tokens' values side by side: value_byte(t, d, D).
//    One vpdpbusd then scores 16 keys on 4 dimensions, or adds 4 tokens' weighted values to 16
//    dimensions, with no reordering as the cache is read.
constexpr int64_t KEY_TILE = 16, VALUE_TILE = 4;
inline int64_t key_byte(int64_t t, int64_t d, int64_t D) {
  return (t / KEY_TILE) * KEY_TILE * D + (d / 4) * 4 * KEY_TILE + (t % KEY_TILE) * 4 + d % 4;
}
inline int64_t value_byte(int64_t t, int64_t d, int64_t D) {
  return (t / VALUE_TILE) * VALUE_TILE * D + d * VALUE_TILE + t % VALUE_TILE;
}

inline bool int8_tiled(const at::Tensor& cache, int64_t block_size) {
  return cache.scalar_type() == at::kChar && cache.dim() == 4 && block_size % KEY_TILE == 0 &&
         (cache.size(-1) - 4) % 4 == 0;
}

// A cache is [slots, KV, W] (contiguous) or [blocks, KV, block_size, W] whose (block, kv head) tiles of
// block_size * W are each contiguous, laid out block-major or head-major (KVCacheLayout.allocate: each kv
// head's blocks back to back, so that a work item reading one kv head over a sequence's consecutive blocks
// streams one run of memory); k and v alike.
inline CacheStrides cache_strides(const at::Tensor& cache, int64_t block_size, const char* op) {
  TORCH_CHECK(cache.dim() == 3 || (cache.dim() == 4 && cache.size(2) == block_size),
              message(op, ": the cache must be [blocks, KV, block_size (", block_size, "), W] or [slots, KV, W]"));
  const int64_t kv = cache.size(1), width = cache.size(-1);
  if (cache.dim() == 4) {
    const int64_t tile = block_size * width;
    TORCH_CHECK(cache.stride(3) == 1 && cache.stride(2) == width &&
                    ((cache.stride(1) == tile && cache.stride(0) == kv * tile) ||
                     (cache.stride(0) == tile && cache.stride(1) == cache.size(0) * tile)),
                message(op, ": a [blocks, KV, block_size, W] cache must be block-major or head-major with "
                            "contiguous tiles"));
    return {cache.stride(0), int8_tiled(cache, block_size) ? 1 : width, cache.stride(1)};
  }
  TORCH_CHECK(cache.is_contiguous(), message(op, ": a [slots, KV, W] cache must be contiguous"));
  return {block_size * kv * width, kv * width, width};
}

void paged_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_starts,
                     int64_t block_size, double scale, int64_t window, const c10::optional<at::Tensor>& k,
                     const c10::optional<at::Tensor>& v, const c10::optional<at::Tensor>& generated);
std::tuple<at::Tensor, at::Tensor> rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps,
                                            const c10::optional<at::Tensor>& residual);
at::Tensor silu_and_mul(const at::Tensor& gate_up);
void rope_write(at::Tensor qkv, const at::Tensor& positions, const at::Tensor& cos_table, const at::Tensor& sin_table,
                at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slots, int64_t num_heads,
                int64_t num_kv_heads);

at::Tensor int4_gemv(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale, const at::Tensor& offset,
                     bool zero_point, int64_t group);
at::Tensor int8_gemv(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale, int64_t group);
int64_t int4_dense_rows();
at::Tensor int4_dequantize(const at::Tensor& packed, const at::Tensor& scale, const at::Tensor& offset, bool zero_point,
                           int64_t group, at::ScalarType dtype);
at::Tensor int8_dequantize(const at::Tensor& packed, const at::Tensor& scale, int64_t group, at::ScalarType dtype);
at::Tensor decode_layers(const at::Tensor& x, at::TensorList norms, at::TensorList weights, c10::IntArrayRef layout,
                         at::TensorList k_caches, at::TensorList v_caches, const at::Tensor& positions,
                         const at::Tensor& cos_table, const at::Tensor& sin_table, const at::Tensor& slots,
                         const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_starts,
                         int64_t block_size, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps,
                         c10::IntArrayRef windows, const c10::optional<at::Tensor>& generated);
at::Tensor int8_float_gemv(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale, int64_t group);
std::tuple<at::Tensor, at::Tensor, at::Tensor> int4_fit(const at::Tensor& weight, int64_t group, bool symmetric,
                                                        at::ScalarType params);

}  // namespace ferrum_cpu
