// Attention over the paged KV cache on the CPU, reading the cache blocks in place.
//
// A step's queries are packed by sequence (query_starts); sequence b has seq_lens[b] tokens in the
// cache after this step's write, its queries are its last tokens, and query i of n sits at position
// seq_lens[b] - n + i and sees the keys at positions 0 .. that position (causal). Key position p of
// sequence b lives in block block_tables[b][p / block_size], at p % block_size within it. The cache is
// [blocks, KV, block_size, W] (each kv head's keys of a block side by side: what the engine allocates
// for this kernel) or [slots, KV, W]; W is head_dim, or head_dim + 4 for an int8 cache.
//
// Work items are (sequence, kv head, tile of up to TILE query rows, range of keys): each computes,
// for the tile's rows times the kv head's query heads, the softmax-weighted sum of its keys' values
// with an online softmax (running max, running sum), in float32. Where one sequence's rows and kv
// heads alone leave threads idle (decode), its keys are split into ranges whose partial results
// (max, sum, weighted values) are merged afterwards: flash-decoding on the CPU.
//
// The cache holds the activations' dtype, or int8 (kv_cache_dtype int8): then each kv head of a slot is
// head_dim int8 values followed by their float32 scale (4 bytes), written by rope_write, and keys and
// values are converted to float32 with their scale as they are read, so a step reads about half the
// bytes of a bfloat16 cache.

#include "common.h"
#include "simd.h"

namespace ferrum_cpu {
namespace {

constexpr int64_t TILE = 16;       // query rows of one work item
constexpr int64_t SUB = 64;        // keys scored at a time (a multiple of 16)
constexpr int64_t MIN_SPLIT = 256; // fewest keys a split range holds

struct Item {
  int64_t seq, kv_head, row0, rows, key0, key1, partial;  // partial: index into the split buffer, or -1
};

struct Partial {  // one work item's running state for each of its R = rows * group query vectors
  float* max;
  float* sum;
  float* acc;  // [R, D]
};

// Item arguments shared by both item kernels.
template <typename T, typename C>
struct ItemArgs {
  const T* q;  // the sequence's first query row
  int64_t q_row_stride, q_head_stride;
  const C* k_cache;
  const C* v_cache;
  CacheStrides strides;
  const int32_t* table;  // the sequence's block table
  int64_t block_size, past, group, head_dim;
  float scale;
};

// One cached head as float32: a float cache's values as they are, an int8 cache's times their scale.
template <typename C>
inline void head_to_float(const C* head, float* dst, int64_t D) {
  if constexpr (std::is_same_v<C, int8_t>) {
    float s;
    std::memcpy(&s, head + D, sizeof s);
    for (int64_t d = 0; d < D; ++d) dst[d] = float(head[d]) * s;
  } else {
    for (int64_t d = 0; d < D; ++d) dst[d] = to_float(head[d]);
  }
}

// The same for head_dim = 16 * NV, an int8 head's values left unscaled: its scale is returned (1 for a
// float cache), for the caller to apply to the head's score or weight rather than to every value.
template <int NV, typename C>
inline float head_to_float(const C* head, float* dst) {
  for (int v = 0; v < NV; ++v) store16(dst + 16 * v, load16(head + 16 * v));
  if constexpr (std::is_same_v<C, int8_t>) {
    float s;
    std::memcpy(&s, head + 16 * NV, sizeof s);
    return s;
  }
  return 1.f;
}

// The cache offsets (elements) of keys k0 .. k0 + n of kv head `kv_head`: one division for the range,
// then block by block.
template <typename T, typename C>
inline void key_offsets(const ItemArgs<T, C>& a, int64_t kv_head, int64_t k0, int64_t n, int64_t* out) {
  const CacheStrides& c = a.strides;
  int64_t block = k0 / a.block_size, within = k0 - block * a.block_size;
  int64_t base = int64_t(a.table[block]) * c.block + kv_head * c.head;
  for (int64_t j = 0; j < n; ++j) {
    out[j] = base + within * c.slot;
    if (++within == a.block_size) {
      within = 0;
      if (j + 1 < n) base = int64_t(a.table[++block]) * c.block + kv_head * c.head;
    }
  }
}

template <typename T, typename C>
void init_item(const Item& it, const ItemArgs<T, C>& a, Partial st, float* qf) {
  const int64_t R = it.rows * a.group, D = a.head_dim;
  for (int64_t r = 0; r < R; ++r) {  // r = row * group + head within the group
    const T* src = a.q + (it.row0 + r / a.group) * a.q_row_stride + (it.kv_head * a.group + r % a.group) * a.q_head_stride;
    for (int64_t d = 0; d < D; ++d) qf[r * D + d] = to_float(src[d]) * a.scale;
    st.max[r] = -std::numeric_limits<float>::infinity();
    st.sum[r] = 0.f;
    std::fill(st.acc + r * D, st.acc + (r + 1) * D, 0.f);
  }
}

// The keys of this range the tile's row r (0-based within the item) sees: n, or fewer for rows
// whose position comes before the range's last key.
inline int64_t visible(const Item& it, int64_t r_row, int64_t past, int64_t k0, int64_t n) {
  return std::max<int64_t>(0, std::min(n, past + it.row0 + r_row - k0 + 1));
}

// Folds row r's new scores s[0..n) (n_vis of them visible) into its running softmax; s becomes the weights.
inline void softmax_step(float* s, int64_t n, int64_t n_vis, Partial st, int64_t r, int64_t D) {
  if (n_vis == 0) {
    std::fill(s, s + n, 0.f);
    return;
  }
  float m = st.max[r];
  for (int64_t j = 0; j < n_vis; ++j) m = std::max(m, s[j]);
  const float correction = std::exp(st.max[r] - m);
  for (int64_t j = 0; j < n_vis; ++j) s[j] = std::exp(s[j] - m);
  std::fill(s + n_vis, s + n, 0.f);
  float total = 0.f;
  for (int64_t j = 0; j < n_vis; ++j) total += s[j];
  st.sum[r] = st.sum[r] * correction + total;
  st.max[r] = m;
  if (correction != 1.f) {
    float* acc = st.acc + r * D;
    for (int64_t d = 0; d < D; ++d) acc[d] *= correction;
  }
}

// The same 16 lanes at a time over s[0..n16), n16 a multiple of 16: the max and the exponentials in
// vectors; the sum in vectors too (VectorSum), or one weight after another as softmax_step adds them,
// which a float cache keeps so that its results stay what they were: bf16's roundings of the demo model
// decide its greedy answers (a sum in another order turned "Paris" into "L'Étoile, ..."), where an int8
// cache's are new anyway.
template <bool VectorSum>
inline void softmax_step16(float* s, int64_t n16, int64_t n_vis, Partial st, int64_t r, int64_t D) {
  if (n_vis == 0) {
    std::fill(s, s + n16, 0.f);
    return;
  }
  const int64_t vis16 = (n_vis + 15) / 16 * 16;
  std::fill(s + n_vis, s + vis16, -std::numeric_limits<float>::infinity());
  F16 top = splat(st.max[r]);
  for (int64_t j = 0; j < vis16; j += 16) top = max16(top, load16(s + j));
  const float m = hmax16(top);
  const F16 shift = splat(-m);
  for (int64_t j = 0; j < vis16; j += 16) store16(s + j, exp16(add16(load16(s + j), shift)));
  std::fill(s + n_vis, s + n16, 0.f);  // exactly: exp16 of -inf is tiny, not 0
  float sum = 0.f;
  if constexpr (VectorSum) {
    F16 total = zero16();
    for (int64_t j = 0; j < vis16; j += 16) total = add16(total, load16(s + j));
    sum = hsum16(total);
  } else {
    for (int64_t j = 0; j < n_vis; ++j) sum += s[j];
  }
  const float correction = std::exp(st.max[r] - m);
  st.sum[r] = st.sum[r] * correction + sum;
  st.max[r] = m;
  if (correction != 1.f) {
    float* acc = st.acc + r * D;
    for (int64_t d = 0; d < D; ++d) acc[d] *= correction;
  }
}

// Any head_dim: one key at a time.
template <typename T, typename C>
void run_item_scalar(const Item& it, const ItemArgs<T, C>& a, Partial st, float* qf, float* kf, float* scores) {
  const int64_t R = it.rows * a.group, D = a.head_dim;
  init_item(it, a, st, qf);
  const int64_t key_end = std::min(it.key1, a.past + it.row0 + it.rows);
  for (int64_t k0 = it.key0; k0 < key_end; k0 += SUB) {
    const int64_t n = std::min(SUB, key_end - k0);
    int64_t offsets[SUB];
    key_offsets(a, it.kv_head, k0, n, offsets);
    for (int64_t j = 0; j < n; ++j) {
      head_to_float(a.k_cache + offsets[j], kf, D);
      for (int64_t r = 0; r < R; ++r) scores[r * SUB + j] = dot(qf + r * D, kf, D);
    }
    for (int64_t r = 0; r < R; ++r)
      softmax_step(scores + r * SUB, n, visible(it, r / a.group, a.past, k0, n), st, r, D);
    for (int64_t j = 0; j < n; ++j) {
      head_to_float(a.v_cache + offsets[j], kf, D);
      for (int64_t r = 0; r < R; ++r) {
        const float w = scores[r * SUB + j];
        if (w != 0.f) axpy(st.acc + r * D, w, kf, D);
      }
    }
  }
}

// head_dim = 16 * NV: a range's keys (then values) are converted to float32 once into buf [SUB, D];
// scores take 16 keys at a time per query vector, the weighted values RB query vectors at a time
// with their sums in registers (`value(j)`: value j in buf, or an int8 cache's row read in place).
template <int NV, int RB, typename Values>
inline void accumulate_values(float* acc, const float* weights, int64_t n, Values value) {
  constexpr int64_t D = 16 * NV;
  F16 sum[RB][NV];
  for (int r = 0; r < RB; ++r)
    for (int v = 0; v < NV; ++v) sum[r][v] = load16(acc + r * D + 16 * v);
  for (int64_t j = 0; j < n; ++j) {
    F16 val[NV];
    for (int v = 0; v < NV; ++v) val[v] = load16(value(j) + 16 * v);  // value j: float32 or int8, unscaled
    for (int r = 0; r < RB; ++r) {
      const F16 w = splat(weights[r * SUB + j]);
      for (int v = 0; v < NV; ++v) sum[r][v] = fma16(w, val[v], sum[r][v]);
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int v = 0; v < NV; ++v) store16(acc + r * D + 16 * v, sum[r][v]);
}

// accumulate_values for R query vectors, 4 at a time
template <int NV>
inline void accumulate_rows(float* acc, const float* weights, const float* buf, int64_t n, int64_t R) {
  constexpr int64_t D = 16 * NV;
  const auto value = [buf](int64_t j) { return buf + j * D; };
  int64_t r = 0;
  for (; r + 4 <= R; r += 4) accumulate_values<NV, 4>(acc + r * D, weights + r * SUB, n, value);
  switch (R - r) {
    case 3: accumulate_values<NV, 3>(acc + r * D, weights + r * SUB, n, value); break;
    case 2: accumulate_values<NV, 2>(acc + r * D, weights + r * SUB, n, value); break;
    case 1: accumulate_values<NV, 1>(acc + r * D, weights + r * SUB, n, value); break;
    default: break;
  }
}

template <typename T, typename C, int NV>
void run_item_simd(const Item& it, const ItemArgs<T, C>& a, Partial st, float* qf, float* buf, float* scores) {
  constexpr int64_t D = 16 * NV;
  constexpr bool scaled = std::is_same_v<C, int8_t>;
  const int64_t R = it.rows * a.group;
  init_item(it, a, st, qf);
  const int64_t key_end = std::min(it.key1, a.past + it.row0 + it.rows);
  alignas(64) float head_scale[SUB];  // an int8 cache's per-key scales (keys, then values)
  int64_t offsets[SUB], next[SUB];
  key_offsets(a, it.kv_head, it.key0, std::min(SUB, key_end - it.key0), next);
  constexpr int64_t head_bytes = D * sizeof(C) + (std::is_same_v<C, int8_t> ? 4 : 0);
  for (int64_t k0 = it.key0; k0 < key_end; k0 += SUB) {
    const int64_t n = std::min(SUB, key_end - k0), n16 = (n + 15) / 16 * 16;
    std::copy(next, next + n, offsets);
    const int64_t n_next = std::min(SUB, key_end - k0 - n);
    if (n_next > 0) key_offsets(a, it.kv_head, k0 + n, n_next, next);
    for (int64_t j = 0; j < n_next; ++j) {  // the next range's keys and values, while this one computes
      const char* kp = reinterpret_cast<const char*>(a.k_cache + next[j]);
      const char* vp = reinterpret_cast<const char*>(a.v_cache + next[j]);
      for (int64_t b = 0; b < head_bytes; b += 64) {
        __builtin_prefetch(kp + b);
        __builtin_prefetch(vp + b);
      }
    }
    for (int64_t j = 0; j < n; ++j) head_scale[j] = head_to_float<NV>(a.k_cache + offsets[j], buf + j * D);
    std::fill(buf + n * D, buf + n16 * D, 0.f);  // the last range's padding scores 0
    std::fill(head_scale + n, head_scale + n16, 0.f);
    for (int64_t r = 0; r < R; ++r) {
      F16 q[NV];
      for (int v = 0; v < NV; ++v) q[v] = load16(qf + r * D + 16 * v);
      for (int64_t j0 = 0; j0 < n16; j0 += 16) {
        F16 dots[16];
        const float* k = buf + j0 * D;
        for (int64_t jj = 0; jj < 16; ++jj) {
          F16 d = mul16(q[0], load16(k + jj * D));
          for (int v = 1; v < NV; ++v) d = fma16(q[v], load16(k + jj * D + 16 * v), d);
          dots[jj] = d;
        }
        F16 sums = sum16(dots);
        if constexpr (scaled) sums = mul16(sums, load16(head_scale + j0));
        store16(scores + r * SUB + j0, sums);
      }
    }
    for (int64_t r = 0; r < R; ++r)
      softmax_step16<std::is_same_v<C, int8_t>>(scores + r * SUB, n16, visible(it, r / a.group, a.past, k0, n), st, r, D);
    for (int64_t j = 0; j < n; ++j) head_scale[j] = head_to_float<NV>(a.v_cache + offsets[j], buf + j * D);
    if constexpr (scaled) {
      for (int64_t r = 0; r < R; ++r)
        for (int64_t j0 = 0; j0 < n16; j0 += 16)
          store16(scores + r * SUB + j0, mul16(load16(scores + r * SUB + j0), load16(head_scale + j0)));
    }
    accumulate_rows<NV>(st.acc, scores, buf, n, R);
  }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// An int8 cache on AVX512-VNNI, head_dim = 64 * NZ: keys are scored in integers without converting them.
// Each query vector is quantized in two parts, q = s1 * q1 + s2 * q2 with s1 = max|q| / 127 and
// s2 = s1 / 128 (|q2| <= 64, so the error is at most s1 / 256), both offset by 128 to be vpdpbusd's
// unsigned operand against the cache's signed int8 keys: sum((q1 + 128) k) * 128 + sum((q2 + 128) k)
// = 128 sum(q1 k) + sum(q2 k) + 16512 sum(k), and sum(k) comes from one more vpdpbusd per key against ones.
// Values are converted to float32 as they are read and summed with the weights times their scales.

// lane j: the sum of the lanes of a[j] (int32)
inline __m512i isum16(const __m512i* a) {
  __m512i x[8], y[4];
  for (int i = 0; i < 8; ++i)
    x[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_epi32(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i)
    y[i] = _mm512_add_epi32(_mm512_unpacklo_epi64(x[2 * i], x[2 * i + 1]), _mm512_unpackhi_epi64(x[2 * i], x[2 * i + 1]));
  const __m512i u0 =
      _mm512_add_epi32(_mm512_shuffle_i32x4(y[0], y[1], 0x88), _mm512_shuffle_i32x4(y[0], y[1], 0xDD));
  const __m512i u1 =
      _mm512_add_epi32(_mm512_shuffle_i32x4(y[2], y[3], 0x88), _mm512_shuffle_i32x4(y[2], y[3], 0xDD));
  return _mm512_add_epi32(_mm512_shuffle_i32x4(u0, u1, 0x88), _mm512_shuffle_i32x4(u0, u1, 0xDD));
}

#if defined(__AVX512VBMI__)
// Values in integers too: 4 keys' 64-byte value rows a, b, c, d -> out[z] whose dword lane l holds the 4
// keys' bytes of dimension 16 z + l, so that one vpdpbusd adds 4 keys' weighted values to 16 dimensions.
inline void interleave4(__m512i a, __m512i b, __m512i c, __m512i d, int8_t* out) {
  alignas(64) static const struct Indices {
    uint8_t pairs[2][64];
    uint16_t quads[2][32];
    Indices() {
      for (int half = 0; half < 2; ++half)
        for (int i = 0; i < 64; ++i) pairs[half][i] = uint8_t((i % 2 ? 64 : 0) + 32 * half + i / 2);
      for (int part = 0; part < 2; ++part)
        for (int i = 0; i < 32; ++i) quads[part][i] = uint16_t((i % 2 ? 32 : 0) + 16 * part + i / 2);
    }
  } idx;
  for (int half = 0; half < 2; ++half) {
    const __m512i pick = _mm512_load_si512(idx.pairs[half]);
    const __m512i ab = _mm512_permutex2var_epi8(a, pick, b), cd = _mm512_permutex2var_epi8(c, pick, d);
    for (int part = 0; part < 2; ++part)
      _mm512_storeu_si512(out + 64 * (2 * half + part),
                          _mm512_permutex2var_epi16(ab, _mm512_load_si512(idx.quads[part]), cd));
  }
}

// acc[.] += sum_j weights[j] * value_j over n keys whose values `interleaved` holds (interleave4's
// layout, 4 * NZ vectors per 4 keys). The weights (>= 0) are quantized in two unsigned parts,
// w = s1 u1 + s2 u2 with s1 = max w / 255 (u1 = floor(w / s1)) and s2 = s1 / 256, an error of at most
// s1 / 512 per weight; each part's sums are int32 (at most 64 keys * 255 * 127).
template <int NZ>
inline void accumulate_interleaved(float* acc, const float* weights, const int8_t* interleaved, int64_t n) {
  constexpr int NV = 4 * NZ;
  __m512 top = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 16) top = _mm512_max_ps(top, _mm512_loadu_ps(weights + j));
  const float w_max = _mm512_reduce_max_ps(top);
  if (!(w_max > 0.f)) return;
  const float s1 = w_max / 255.f, s2 = s1 / 256.f;
  alignas(64) uint8_t u1[SUB], u2[SUB];
  const __m512 inv1 = _mm512_set1_ps(255.f / w_max), inv2 = _mm512_set1_ps(1.f / s2), step1 = _mm512_set1_ps(s1);
  const __m512 most = _mm512_set1_ps(255.f), none = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 16) {  // weights past n are 0 (the caller's padding)
    const __m512 w = _mm512_loadu_ps(weights + j);
    const __m512 a1 = _mm512_min_ps(most, _mm512_roundscale_ps(_mm512_mul_ps(w, inv1), _MM_FROUND_TO_NEG_INF));
    const __m512 rest = _mm512_max_ps(none, _mm512_fnmadd_ps(a1, step1, w));
    const __m512 a2 = _mm512_min_ps(most, _mm512_roundscale_ps(_mm512_mul_ps(rest, inv2),
                                                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    _mm_store_si128(reinterpret_cast<__m128i*>(u1 + j), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(a1)));
    _mm_store_si128(reinterpret_cast<__m128i*>(u2 + j), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(a2)));
  }
  __m512i sum1[NV], sum2[NV];
  for (int v = 0; v < NV; ++v) sum1[v] = sum2[v] = _mm512_setzero_si512();
  for (int64_t g = 0; g < n / 4; ++g) {
    int32_t w1, w2;
    std::memcpy(&w1, u1 + 4 * g, 4);
    std::memcpy(&w2, u2 + 4 * g, 4);
    const __m512i b1 = _mm512_set1_epi32(w1), b2 = _mm512_set1_epi32(w2);
    const int8_t* vals = interleaved + g * NV * 64;
    for (int v = 0; v < NV; ++v) {
      const __m512i values = _mm512_loadu_si512(vals + 64 * v);
      sum1[v] = _mm512_dpbusd_epi32(sum1[v], b1, values);
      sum2[v] = _mm512_dpbusd_epi32(sum2[v], b2, values);
    }
  }
  const __m512 f1 = _mm512_set1_ps(s1), f2 = _mm512_set1_ps(s2);
  for (int v = 0; v < NV; ++v) {
    const __m512 add = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum1[v]), f1, _mm512_mul_ps(_mm512_cvtepi32_ps(sum2[v]), f2));
    _mm512_storeu_ps(acc + 16 * v, _mm512_add_ps(_mm512_loadu_ps(acc + 16 * v), add));
  }
}
#endif

template <typename T, int NZ>
void run_item_vnni(const Item& it, const ItemArgs<T, int8_t>& a, Partial st, float* qf, float* buf, float* scores) {
  constexpr int64_t D = 64 * NZ, NV = 4 * NZ, RB = 16 / NV;  // RB query vectors' sums fit in registers
  const int64_t R = it.rows * a.group;
  init_item(it, a, st, qf);
  // buf: SUB values as float32 (when more than RB query vectors share them), then the quantized queries:
  // [R, D] bytes of each part, then R float scales (s2)
  uint8_t* q1 = reinterpret_cast<uint8_t*>(buf + SUB * D);
  uint8_t* q2 = q1 + R * D;
  float* q_scale = reinterpret_cast<float*>(q2 + R * D);
  const __m512 sign_off = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
  const __m512i offset128 = _mm512_set1_epi32(128);
  for (int64_t r = 0; r < R; ++r) {
    const float* x = qf + r * D;
    __m512 top = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 16) top = _mm512_max_ps(top, _mm512_and_ps(_mm512_loadu_ps(x + d), sign_off));
    const float amax = _mm512_reduce_max_ps(top);
    const float s1 = amax > 0.f ? amax / 127.f : 1.f, s2 = s1 / 128.f;
    const __m512 inv1 = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f), inv2 = _mm512_set1_ps(1.f / s2);
    const __m512 step1 = _mm512_set1_ps(s1), lo = _mm512_set1_ps(-64.f), hi = _mm512_set1_ps(64.f);
    for (int64_t d = 0; d < D; d += 16) {
      const __m512 v = _mm512_loadu_ps(x + d);
      const __m512 a1 = _mm512_roundscale_ps(_mm512_mul_ps(v, inv1), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      const __m512 rest = _mm512_fnmadd_ps(a1, step1, v);
      const __m512 a2 = _mm512_min_ps(hi, _mm512_max_ps(lo, _mm512_roundscale_ps(
          _mm512_mul_ps(rest, inv2), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q1 + r * D + d),
                       _mm512_cvtepi32_epi8(_mm512_add_epi32(_mm512_cvtps_epi32(a1), offset128)));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q2 + r * D + d),
                       _mm512_cvtepi32_epi8(_mm512_add_epi32(_mm512_cvtps_epi32(a2), offset128)));
    }
    q_scale[r] = s2;
  }
  const int64_t key_end = std::min(it.key1, a.past + it.row0 + it.rows);
  alignas(64) float head_scale[SUB];
  alignas(64) static const int8_t zeros[D] = {};
  const __m512i ones = _mm512_set1_epi8(1), bias = _mm512_set1_epi32(16512);
  int64_t offsets[SUB], next[SUB];
  key_offsets(a, it.kv_head, it.key0, std::min(SUB, key_end - it.key0), next);
  for (int64_t k0 = it.key0; k0 < key_end; k0 += SUB) {
    const int64_t n = std::min(SUB, key_end - k0), n16 = (n + 15) / 16 * 16;
    std::copy(next, next + n, offsets);
    const int64_t n_next = std::min(SUB, key_end - k0 - n);
    if (n_next > 0) key_offsets(a, it.kv_head, k0 + n, n_next, next);
    for (int64_t j = 0; j < n_next; ++j) {  // the next range's keys and values, while this one computes
      for (int64_t b = 0; b < D + 4; b += 64) {
        __builtin_prefetch(a.k_cache + next[j] + b);
        __builtin_prefetch(a.v_cache + next[j] + b);
      }
    }
    for (int64_t j0 = 0; j0 < n16; j0 += 16) {
      const int8_t* key[16];
      for (int64_t jj = 0; jj < 16; ++jj) {
        key[jj] = j0 + jj < n ? a.k_cache + offsets[j0 + jj] : zeros;
        if (j0 + jj < n) std::memcpy(head_scale + j0 + jj, key[jj] + D, sizeof(float));
        else head_scale[j0 + jj] = 0.f;
      }
      __m512i acc[16];
      for (int64_t jj = 0; jj < 16; ++jj) {
        __m512i s = _mm512_setzero_si512();
        for (int z = 0; z < NZ; ++z) s = _mm512_dpbusd_epi32(s, ones, _mm512_loadu_si512(key[jj] + 64 * z));
        acc[jj] = s;
      }
      const __m512i offset = _mm512_mullo_epi32(isum16(acc), bias);  // 16512 sum(k) per key
      const __m512 kscale = _mm512_load_ps(head_scale + j0);
      for (int64_t r = 0; r < R; ++r) {
        __m512i qa[NZ], qb[NZ];
        for (int z = 0; z < NZ; ++z) {
          qa[z] = _mm512_loadu_si512(q1 + r * D + 64 * z);
          qb[z] = _mm512_loadu_si512(q2 + r * D + 64 * z);
        }
        for (int64_t jj = 0; jj < 16; ++jj) {
          __m512i s = _mm512_setzero_si512();
          for (int z = 0; z < NZ; ++z) s = _mm512_dpbusd_epi32(s, qa[z], _mm512_loadu_si512(key[jj] + 64 * z));
          s = _mm512_slli_epi32(s, 7);
          for (int z = 0; z < NZ; ++z) s = _mm512_dpbusd_epi32(s, qb[z], _mm512_loadu_si512(key[jj] + 64 * z));
          acc[jj] = s;
        }
        const __m512 dots = _mm512_cvtepi32_ps(_mm512_sub_epi32(isum16(acc), offset));
        _mm512_storeu_ps(scores + r * SUB + j0, _mm512_mul_ps(_mm512_mul_ps(dots, kscale), _mm512_set1_ps(q_scale[r])));
      }
    }
    for (int64_t r = 0; r < R; ++r)
      softmax_step16<true>(scores + r * SUB, n16, visible(it, r / a.group, a.past, k0, n), st, r, D);
    for (int64_t j = 0; j < n; ++j) std::memcpy(head_scale + j, a.v_cache + offsets[j] + D, sizeof(float));
    std::fill(head_scale + n, head_scale + n16, 0.f);
    for (int64_t r = 0; r < R; ++r)
      for (int64_t j0 = 0; j0 < n16; j0 += 16)
        store16(scores + r * SUB + j0, mul16(load16(scores + r * SUB + j0), load16(head_scale + j0)));
#if defined(__AVX512VBMI__)
    if (R > RB) {  // several passes over the values: in integers, interleaved 4 keys at a time into buf
      // (padding keys are 0); for RB query vectors or fewer, the float path below reads each value once
      // and measured faster (decode, 3 query heads per kv head: 122 against 136 us at 6,000 keys)
      const int64_t n4 = (n + 3) / 4 * 4;
      int8_t* interleaved = reinterpret_cast<int8_t*>(buf);
      for (int64_t g = 0; g < n4; g += 4) {
        const int8_t* row[4];
        for (int i = 0; i < 4; ++i) row[i] = g + i < n ? a.v_cache + offsets[g + i] : zeros;
        for (int z = 0; z < NZ; ++z)
          interleave4(_mm512_loadu_si512(row[0] + 64 * z), _mm512_loadu_si512(row[1] + 64 * z),
                      _mm512_loadu_si512(row[2] + 64 * z), _mm512_loadu_si512(row[3] + 64 * z),
                      interleaved + ((g / 4) * NV + 4 * z) * 64);
      }
      for (int64_t r = 0; r < R; ++r) accumulate_interleaved<NZ>(st.acc + r * D, scores + r * SUB, interleaved, n4);
      continue;
    }
#endif
    if (R > RB) {  // several passes over the values: converted once, into buf
      for (int64_t j = 0; j < n; ++j) head_to_float<NV>(a.v_cache + offsets[j], buf + j * D);
      accumulate_rows<NV>(st.acc, scores, buf, n, R);
      continue;
    }
    const auto value = [&](int64_t j) { return a.v_cache + offsets[j]; };
    switch (R) {  // one pass, each value read from the cache once
      case 4: accumulate_values<NV, 4>(st.acc, scores, n, value); break;
      case 3: accumulate_values<NV, 3>(st.acc, scores, n, value); break;
      case 2: accumulate_values<NV, 2>(st.acc, scores, n, value); break;
      default: accumulate_values<NV, 1>(st.acc, scores, n, value); break;
    }
  }
}
#endif

template <typename T, typename C>
void run_item(const Item& it, const ItemArgs<T, C>& a, Partial st, float* qf, float* buf, float* scores) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  if constexpr (std::is_same_v<C, int8_t>) {
    if (a.head_dim == 64) return run_item_vnni<T, 1>(it, a, st, qf, buf, scores);
    if (a.head_dim == 128) return run_item_vnni<T, 2>(it, a, st, qf, buf, scores);
  }
#endif
  switch (a.head_dim) {
    case 64: return run_item_simd<T, C, 4>(it, a, st, qf, buf, scores);
    case 128: return run_item_simd<T, C, 8>(it, a, st, qf, buf, scores);
    case 96: return run_item_simd<T, C, 6>(it, a, st, qf, buf, scores);
    case 80: return run_item_simd<T, C, 5>(it, a, st, qf, buf, scores);
    case 256: return run_item_simd<T, C, 16>(it, a, st, qf, buf, scores);
    default: return run_item_scalar<T, C>(it, a, st, qf, buf, scores);
  }
}

}  // namespace

// out [T, H, D], q [T, H, D] (last dim contiguous), k_cache / v_cache [slots, KV, D] contiguous,
// block_tables int32 [B, W], seq_lens int32 [B], query_starts int32 [B + 1].
void paged_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_starts,
                     int64_t block_size, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "paged_attention: q must be [T, H, D] with contiguous heads");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == q.sizes() && out.scalar_type() == q.scalar_type(),
              "paged_attention: out must be contiguous, shaped and typed like q");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes(),
              "paged_attention: k_cache and v_cache must be contiguous and of one shape");
  const CacheStrides strides = cache_strides(k_cache, block_size, "paged_attention");
  const bool int8_cache = k_cache.scalar_type() == at::kChar;
  TORCH_CHECK((k_cache.scalar_type() == q.scalar_type() || int8_cache) &&
                  v_cache.scalar_type() == k_cache.scalar_type(),
              "paged_attention: the cache must hold q's dtype or int8");
  TORCH_CHECK(k_cache.size(-1) == q.size(2) + (int8_cache ? 4 : 0) && q.size(1) % k_cache.size(1) == 0,
              "paged_attention: the cache's head width is not head_dim (+ 4 for an int8 cache) or the query heads "
              "are not a multiple of the kv heads");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  query_starts.scalar_type() == at::kInt && block_tables.is_contiguous(),
              "paged_attention: block_tables, seq_lens and query_starts must be int32 (block_tables contiguous)");
  TORCH_CHECK(query_starts.size(0) == seq_lens.size(0) + 1 && block_tables.size(0) >= seq_lens.size(0),
              "paged_attention: one row of block_tables and seq_lens per sequence, query_starts one longer");
  const int64_t num_seqs = seq_lens.size(0), heads = q.size(1), D = q.size(2);
  const int64_t kv_heads = k_cache.size(1), group = heads / kv_heads, width = block_tables.size(1);
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* starts = query_starts.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();

  // the work items; split ranges only where rows and heads alone leave threads idle
  std::vector<Item> items;
  int64_t base_items = 0;
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int64_t n = starts[b + 1] - starts[b];
    TORCH_CHECK(n >= 0 && lens[b] >= n && (lens[b] + block_size - 1) / block_size <= width,
                message("paged_attention: sequence ", b, " has ", n, " queries, ", lens[b],
                        " tokens and a block table of ", width, " blocks"));
    base_items += kv_heads * ((n + TILE - 1) / TILE);
  }
  const int64_t threads = at::get_num_threads();
  const int64_t want = 4 * threads;
  int64_t num_partials = 0;
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int64_t n = starts[b + 1] - starts[b], past = lens[b] - n;
    for (int64_t h = 0; h < kv_heads; ++h) {
      for (int64_t row0 = 0; row0 < n; row0 += TILE) {
        const int64_t rows = std::min(TILE, n - row0), keys = past + row0 + rows;
        int64_t splits = 1;
        if (base_items < want) splits = std::max<int64_t>(1, std::min(want / base_items, keys / MIN_SPLIT));
        const int64_t per = (keys + splits - 1) / splits;
        for (int64_t s = 0; s < splits; ++s) {
          const int64_t k0 = s * per, k1 = std::min(keys, k0 + per);
          if (k0 >= k1) break;
          items.push_back({b, h, row0, rows, k0, k1, splits > 1 ? num_partials++ : -1});
        }
      }
    }
  }
  const int64_t R_max = TILE * group;
  std::vector<float> split_buf(num_partials * R_max * (D + 2));

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention", [&] {
    auto run = [&](auto cache_element) {
      using C = decltype(cache_element);
      const scalar_t* qp = q.data_ptr<scalar_t>();
      const C* kc = static_cast<const C*>(k_cache.data_ptr());
      const C* vc = static_cast<const C*>(v_cache.data_ptr());
      scalar_t* op = out.data_ptr<scalar_t>();

      // small steps (short contexts) run on one thread: waking the others costs more than they save
      int64_t work = 0;
      for (const Item& it : items) work += (it.key1 - it.key0) * it.rows * group;
      const int64_t grain = work < 4096 ? int64_t(items.size()) : 1;
      at::parallel_for(0, int64_t(items.size()), grain, [&](int64_t begin, int64_t end) {
        // buf: SUB keys or values as float32, or (run_item_vnni) the quantized queries and their scales
        const int64_t buf_size = SUB * D + (2 * R_max * D + 4 * R_max) / 4 + 16;
        std::vector<float> scratch(R_max * D * 2 + buf_size + R_max * SUB + 2 * R_max);
        float* qf = scratch.data();
        float* own_acc = qf + R_max * D;
        float* buf = own_acc + R_max * D;
        float* scores = buf + buf_size;
        float* own_max = scores + R_max * SUB;
        float* own_sum = own_max + R_max;
        for (int64_t i = begin; i < end; ++i) {
          const Item& it = items[i];
          const int64_t n = starts[it.seq + 1] - starts[it.seq];
          Partial st{own_max, own_sum, own_acc};
          if (it.partial >= 0) {
            float* base = split_buf.data() + it.partial * R_max * (D + 2);
            st = Partial{base, base + R_max, base + 2 * R_max};
          }
          const ItemArgs<scalar_t, C> args{qp + starts[it.seq] * q.stride(0), q.stride(0), q.stride(1), kc, vc,
                                           strides, tables + it.seq * width, block_size,
                                           lens[it.seq] - n, group, D, float(scale)};
          run_item(it, args, st, qf, buf, scores);
          if (it.partial >= 0) continue;
          for (int64_t r = 0; r < it.rows * group; ++r) {
            const float inv = st.sum[r] > 0.f ? 1.f / st.sum[r] : 0.f;
            scalar_t* dst = op + ((starts[it.seq] + it.row0 + r / group) * heads + it.kv_head * group + r % group) * D;
            for (int64_t d = 0; d < D; ++d) dst[d] = scalar_t(st.acc[r * D + d] * inv);
          }
        }
      });
      if (num_partials == 0) return;
      // merge the split ranges of each (sequence, kv head, tile): items of one tile are consecutive
      std::vector<std::pair<int64_t, int64_t>> groups;  // [first item, end item)
      for (int64_t i = 0; i < int64_t(items.size());) {
        int64_t j = i + 1;
        while (j < int64_t(items.size()) && items[j].seq == items[i].seq && items[j].kv_head == items[i].kv_head &&
               items[j].row0 == items[i].row0)
          ++j;
        if (items[i].partial >= 0) groups.emplace_back(i, j);
        i = j;
      }
      at::parallel_for(0, int64_t(groups.size()), 1, [&](int64_t begin, int64_t end) {
        std::vector<float> acc(D);
        for (int64_t g = begin; g < end; ++g) {
          const Item& first = items[groups[g].first];
          for (int64_t r = 0; r < first.rows * group; ++r) {
            float m = -std::numeric_limits<float>::infinity();
            for (int64_t i = groups[g].first; i < groups[g].second; ++i)
              m = std::max(m, split_buf[items[i].partial * R_max * (D + 2) + r]);
            float total = 0.f;
            std::fill(acc.begin(), acc.end(), 0.f);
            for (int64_t i = groups[g].first; i < groups[g].second; ++i) {
              const float* base = split_buf.data() + items[i].partial * R_max * (D + 2);
              if (base[r] == -std::numeric_limits<float>::infinity()) continue;
              const float w = std::exp(base[r] - m);
              total += base[R_max + r] * w;
              axpy(acc.data(), w, base + 2 * R_max + r * D, D);
            }
            const float inv = total > 0.f ? 1.f / total : 0.f;
            scalar_t* dst =
                op + ((starts[first.seq] + first.row0 + r / group) * heads + first.kv_head * group + r % group) * D;
            for (int64_t d = 0; d < D; ++d) dst[d] = scalar_t(acc[d] * inv);
          }
        }
      });
    };
    if (int8_cache) run(int8_t{});
    else run(scalar_t{});
  });
}

}  // namespace ferrum_cpu
