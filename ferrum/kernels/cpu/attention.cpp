// Attention over the paged KV cache on the CPU, reading the cache blocks in place.
//
// A step's queries are packed by sequence (query_starts); sequence b has seq_lens[b] tokens in the
// cache after this step's write, its queries are its last tokens, and query i of n sits at position
// seq_lens[b] - n + i and sees the keys at positions 0 .. that position (causal), or with a sliding window
// of w tokens only the last w of them (itself and the w - 1 before it). Key position p of
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
// The cache holds the activations' dtype, bfloat16 or float16 under float32 activations (half the bytes a
// long context reads), or int8 (kv_cache_dtype int8), written by rope_write: each kv
// head's values of a slot as int8 with a float32 scale, in rows or in tiles (common.h), about half the
// bytes of a bfloat16 cache. Tiles with head_dim 64 or 128 are read as integers (run_item_tiled: with
// vpdpbusd on AVX512-VNNI, with vpmaddwd over the bytes split into 16-bit lanes on AVX2); otherwise each head
// is converted to float32 with its scale as it is read.
//
// Given the step's own keys and values (k, v: [T, KV, D], the rows rope_write read them from), a
// sequence with nothing cached before this step (a prompt prefilled from its first token) reads its
// keys and values from there, as computed: with an int8 cache a prompt is scored as with a float cache.
// Every other query reads the cache, its own step's keys included, so that a decode step, a chunk after
// cached tokens and a speculative verify step all read every key the same way (quantized), whatever the
// steps the tokens came in.

#include <atomic>

#include "common.h"
#include "simd.h"

namespace ferrum_cpu {
namespace {

constexpr int64_t TILE = 16;       // query rows of one work item
constexpr int64_t SUB = 64;        // keys scored at a time (a multiple of 16)
constexpr int64_t MIN_SPLIT = 256; // fewest keys a split range holds

struct Item {
  int64_t seq, kv_head, row0, rows, key0, key1, partial;  // partial: index into the split buffer, or -1
  bool own;  // a fresh prompt's keys, read from k and v
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
  int64_t window;  // a query sees itself and the window - 1 keys before it; 0: every key before it
  float scale;
  bool tiled;  // an int8 cache in tiles (common.h)
  bool seven_bit;  // AVX2's tiles: 7-bit queries and value weights (the sequence's rows are generated tokens)
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

// Key (Key) or value `offset`'s head as a row: where it lies, or for an int8 cache in tiles its
// values and scale gathered into `row` (D + 4 bytes), the keys' 128 taken off.
template <bool Key, typename T, typename C>
inline const C* cached_row(const ItemArgs<T, C>& a, int64_t offset, C* row) {
  const C* cache = Key ? a.k_cache : a.v_cache;
  if constexpr (std::is_same_v<C, int8_t>) {
    if (a.tiled) {
      const int64_t D = a.head_dim, t = offset % (a.block_size * (D + 4));
      const int8_t* tile = cache + offset - t;
      for (int64_t d = 0; d < D; ++d)
        row[d] = Key ? static_cast<int8_t>(int(static_cast<uint8_t>(tile[key_byte(t, d, D)])) - 128)
                     : tile[value_byte(t, d, D)];
      std::memcpy(row + D, tile + a.block_size * D + 4 * t, 4);
      return row;
    }
  }
  return cache + offset;
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

// The keys of a range [k0, k0 + n) one query row sees: [lo, hi) within the range, empty where lo >= hi.
struct Seen {
  int64_t lo, hi;
};

// The keys of this range the tile's row r (0-based within the item) sees: those up to its position, and
// with a window only the last `window` of them.
template <typename T, typename C>
inline Seen seen(const Item& it, const ItemArgs<T, C>& a, int64_t r_row, int64_t k0, int64_t n) {
  const int64_t position = a.past + it.row0 + r_row;
  const int64_t hi = std::max<int64_t>(0, std::min(n, position - k0 + 1));
  const int64_t lo = a.window > 0 ? std::clamp<int64_t>(position - a.window + 1 - k0, 0, n) : 0;
  return {lo, hi};
}

// Folds row r's new scores s[0..n) (those in `vis` visible) into its running softmax; s becomes the weights.
inline void softmax_step(float* s, int64_t n, Seen vis, Partial st, int64_t r, int64_t D) {
  if (vis.lo >= vis.hi) {
    std::fill(s, s + n, 0.f);
    return;
  }
  float m = st.max[r];
  for (int64_t j = vis.lo; j < vis.hi; ++j) m = std::max(m, s[j]);
  const float correction = std::exp(st.max[r] - m);
  for (int64_t j = vis.lo; j < vis.hi; ++j) s[j] = std::exp(s[j] - m);
  std::fill(s, s + vis.lo, 0.f);
  std::fill(s + vis.hi, s + n, 0.f);
  float total = 0.f;
  for (int64_t j = vis.lo; j < vis.hi; ++j) total += s[j];
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
inline void softmax_step16(float* s, int64_t n16, Seen vis, Partial st, int64_t r, int64_t D) {
  if (vis.lo >= vis.hi) {
    std::fill(s, s + n16, 0.f);
    return;
  }
  const int64_t from16 = vis.lo / 16 * 16, vis16 = (vis.hi + 15) / 16 * 16;
  std::fill(s + from16, s + vis.lo, -std::numeric_limits<float>::infinity());
  std::fill(s + vis.hi, s + vis16, -std::numeric_limits<float>::infinity());
  F16 top = splat(st.max[r]);
  for (int64_t j = from16; j < vis16; j += 16) top = max16(top, load16(s + j));
  const float m = hmax16(top);
  const F16 shift = splat(-m);
  for (int64_t j = from16; j < vis16; j += 16) store16(s + j, exp16(add16(load16(s + j), shift)));
  std::fill(s, s + vis.lo, 0.f);  // exactly: exp16 of -inf is tiny, not 0
  std::fill(s + vis.hi, s + n16, 0.f);
  float sum = 0.f;
  if constexpr (VectorSum) {
    F16 total = zero16();
    for (int64_t j = from16; j < vis16; j += 16) total = add16(total, load16(s + j));
    sum = hsum16(total);
  } else {
    for (int64_t j = vis.lo; j < vis.hi; ++j) sum += s[j];
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
  std::vector<C> row(D + 4);
  const int64_t key_end = std::min(it.key1, a.past + it.row0 + it.rows);
  for (int64_t k0 = it.key0; k0 < key_end; k0 += SUB) {
    const int64_t n = std::min(SUB, key_end - k0);
    int64_t offsets[SUB];
    key_offsets(a, it.kv_head, k0, n, offsets);
    for (int64_t j = 0; j < n; ++j) {
      head_to_float(cached_row<true>(a, offsets[j], row.data()), kf, D);
      for (int64_t r = 0; r < R; ++r) scores[r * SUB + j] = dot(qf + r * D, kf, D);
    }
    for (int64_t r = 0; r < R; ++r)
      softmax_step(scores + r * SUB, n, seen(it, a, r / a.group, k0, n), st, r, D);
    for (int64_t j = 0; j < n; ++j) {
      head_to_float(cached_row<false>(a, offsets[j], row.data()), kf, D);
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
  alignas(64) C row[D + 4];            // an int8 cache's head gathered from its tile
  int64_t offsets[SUB], next[SUB];
  key_offsets(a, it.kv_head, it.key0, std::min(SUB, key_end - it.key0), next);
  constexpr int64_t head_bytes = D * sizeof(C) + (std::is_same_v<C, int8_t> ? 4 : 0);
  for (int64_t k0 = it.key0; k0 < key_end; k0 += SUB) {
    const int64_t n = std::min(SUB, key_end - k0), n16 = (n + 15) / 16 * 16;
    std::copy(next, next + n, offsets);
    const int64_t n_next = std::min(SUB, key_end - k0 - n);
    if (n_next > 0) key_offsets(a, it.kv_head, k0 + n, n_next, next);
    // the next range's keys (then values) are prefetched one head for each head converted, so that the
    // misses in flight stay few: all of a range's at once stalled the loads behind them (AVX2 EPYC)
    const auto prefetch_next = [&](const C* cache, int64_t j) {
      if (j >= n_next) return;
      const char* p = reinterpret_cast<const char*>(cache + next[j]);
      for (int64_t b = 0; b < head_bytes; b += 64) __builtin_prefetch(p + b);
    };
    for (int64_t j = 0; j < n; ++j) {
      prefetch_next(a.k_cache, j);
      head_scale[j] = head_to_float<NV>(cached_row<true>(a, offsets[j], row), buf + j * D);
    }
    for (int64_t j = n; j < n_next; ++j) prefetch_next(a.k_cache, j);
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
      softmax_step16<std::is_same_v<C, int8_t>>(scores + r * SUB, n16, seen(it, a, r / a.group, k0, n), st, r, D);
    for (int64_t j = 0; j < n; ++j) {
      prefetch_next(a.v_cache, j);
      head_scale[j] = head_to_float<NV>(cached_row<false>(a, offsets[j], row), buf + j * D);
    }
    for (int64_t j = n; j < n_next; ++j) prefetch_next(a.v_cache, j);
    if constexpr (scaled) {
      for (int64_t r = 0; r < R; ++r)
        for (int64_t j0 = 0; j0 < n16; j0 += 16)
          store16(scores + r * SUB + j0, mul16(load16(scores + r * SUB + j0), load16(head_scale + j0)));
    }
    accumulate_rows<NV>(st.acc, scores, buf, n, R);
  }
}

// A work item's int8 cache in tiles (common.h), range by range: where each 16-key group's keys and values
// lie, and their scales. Ranges start at multiples of 16, as blocks do: each group lies in one tile.
template <typename T>
struct TileRange {
  const ItemArgs<T, int8_t>& a;
  int64_t kv_head, D;
  alignas(64) float k_scale[SUB], v_scale[SUB];
  const int8_t* keys[SUB / KEY_TILE];
  const int8_t* values[SUB / KEY_TILE];

  const int8_t* group_at(int64_t p, const int8_t* cache) const {
    const int64_t tile = int64_t(a.table[p / a.block_size]) * a.strides.block + kv_head * a.strides.head;
    return cache + tile + (p % a.block_size) * D;
  }
  const int8_t* scale_at(const int8_t* group, int64_t p) const {  // a tile's scales lie after its values
    return group - (p % a.block_size) * D + a.block_size * D + 4 * (p % a.block_size);
  }
  // the n keys from k0 (n16: n rounded up to 16); the scales past n are 0: the last group's keys past the
  // range are garbage, of weight 0
  void load(int64_t k0, int64_t n, int64_t n16) {
    for (int64_t g = 0; g < n16 / KEY_TILE; ++g) {
      const int64_t p = k0 + g * KEY_TILE;
      keys[g] = group_at(p, a.k_cache);
      values[g] = group_at(p, a.v_cache);
      std::memcpy(k_scale + g * KEY_TILE, scale_at(keys[g], p), 4 * KEY_TILE);
      std::memcpy(v_scale + g * KEY_TILE, scale_at(values[g], p), 4 * KEY_TILE);
    }
    std::fill(k_scale + n, k_scale + n16, 0.f);
    std::fill(v_scale + n, v_scale + n16, 0.f);
  }
};

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// An int8 cache in tiles (common.h) on AVX512-VNNI, head_dim = 64 * NZ: keys and values are used as
// integers where they lie, 16 keys or 4 values per vpdpbusd, with no conversion and no horizontal sums.
// Each query vector is quantized in two signed parts, q = s1 * q1 + s2 * q2 with s1 = max|q| / 127 and
// s2 = s1 / 128 (|q2| <= 64, so the error is at most s1 / 256); against the tiles' keys plus 128,
// 128 sum((k + 128) q1) + sum((k + 128) q2) = 128 sum(k q1) + sum(k q2) + 128 (128 sum(q1) + sum(q2)),
// whose last term is the query's own. A range's weights times the values' scales are quantized per
// query vector in two unsigned parts, w = s1 u1 + s2 u2 with s1 = max w / 255 and s2 = s1 / 256 (an
// error of at most s1 / 512 per weight), and the values summed in int32 (at most SUB * 255 * 127).

// acc[r] += sum_j weights[r][j] * value_j for RQ query vectors over the range's n16 keys, whose values
// lie in 16-key tile groups `values[n16 / 16]` (value_byte's layout); weights past the range's keys are 0.
template <int NZ, int RQ>
inline void accumulate_tiled(float* acc, const float* weights, const int8_t* const* values, int64_t n16) {
  constexpr int NV = 4 * NZ;
  constexpr int64_t D = 64 * NZ;
  alignas(64) uint8_t u1[RQ][SUB], u2[RQ][SUB];
  float s1[RQ], s2[RQ];
  const __m512 most = _mm512_set1_ps(255.f), none = _mm512_setzero_ps();
  for (int r = 0; r < RQ; ++r) {
    const float* w_r = weights + r * SUB;
    __m512 top = _mm512_setzero_ps();
    for (int64_t j = 0; j < n16; j += 16) top = _mm512_max_ps(top, _mm512_loadu_ps(w_r + j));
    const float w_max = _mm512_reduce_max_ps(top);
    s1[r] = w_max > 0.f ? w_max / 255.f : 0.f;
    s2[r] = s1[r] / 256.f;
    const __m512 inv1 = _mm512_set1_ps(w_max > 0.f ? 255.f / w_max : 0.f);
    const __m512 inv2 = _mm512_set1_ps(w_max > 0.f ? 1.f / s2[r] : 0.f), step1 = _mm512_set1_ps(s1[r]);
    for (int64_t j = 0; j < n16; j += 16) {
      const __m512 w = _mm512_loadu_ps(w_r + j);
      const __m512 a1 = _mm512_min_ps(most, _mm512_roundscale_ps(_mm512_mul_ps(w, inv1), _MM_FROUND_TO_NEG_INF));
      const __m512 rest = _mm512_max_ps(none, _mm512_fnmadd_ps(a1, step1, w));
      const __m512 a2 = _mm512_min_ps(most, _mm512_roundscale_ps(_mm512_mul_ps(rest, inv2),
                                                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      _mm_store_si128(reinterpret_cast<__m128i*>(u1[r] + j), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(a1)));
      _mm_store_si128(reinterpret_cast<__m128i*>(u2[r] + j), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(a2)));
    }
  }
  __m512i sum1[RQ][NV], sum2[RQ][NV];
  for (int r = 0; r < RQ; ++r)
    for (int v = 0; v < NV; ++v) sum1[r][v] = sum2[r][v] = _mm512_setzero_si512();
  for (int64_t g = 0; g < n16 / VALUE_TILE; ++g) {
    const int8_t* vals = values[g / (KEY_TILE / VALUE_TILE)] + (g % (KEY_TILE / VALUE_TILE)) * VALUE_TILE * D;
    __m512i x[NV];
    for (int v = 0; v < NV; ++v) x[v] = _mm512_loadu_si512(vals + 64 * v);
    for (int r = 0; r < RQ; ++r) {
      int32_t w1, w2;
      std::memcpy(&w1, u1[r] + VALUE_TILE * g, 4);
      std::memcpy(&w2, u2[r] + VALUE_TILE * g, 4);
      const __m512i b1 = _mm512_set1_epi32(w1), b2 = _mm512_set1_epi32(w2);
      for (int v = 0; v < NV; ++v) {
        sum1[r][v] = _mm512_dpbusd_epi32(sum1[r][v], b1, x[v]);
        sum2[r][v] = _mm512_dpbusd_epi32(sum2[r][v], b2, x[v]);
      }
    }
  }
  for (int r = 0; r < RQ; ++r) {
    const __m512 f1 = _mm512_set1_ps(s1[r]), f2 = _mm512_set1_ps(s2[r]);
    for (int v = 0; v < NV; ++v) {
      const __m512 add =
          _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum1[r][v]), f1, _mm512_mul_ps(_mm512_cvtepi32_ps(sum2[r][v]), f2));
      _mm512_storeu_ps(acc + r * D + 16 * v, _mm512_add_ps(_mm512_loadu_ps(acc + r * D + 16 * v), add));
    }
  }
}

template <typename T, int NZ, bool = false>  // (the 7-bit rows are AVX2's: here every row takes both parts)
void run_item_tiled(const Item& it, const ItemArgs<T, int8_t>& a, Partial st, float* qf, float* buf, float* scores) {
  constexpr int64_t D = 64 * NZ, DG = D / 4;  // DG: groups of 4 dimensions, one vpdpbusd each
  const int64_t R = it.rows * a.group;
  init_item(it, a, st, qf);
  // buf: the quantized queries, [R, D] bytes of each part, then R scales s2 and R offsets
  int8_t* q1 = reinterpret_cast<int8_t*>(buf);
  int8_t* q2 = q1 + R * D;
  float* q_scale = reinterpret_cast<float*>(q2 + R * D);
  int32_t* q_offset = reinterpret_cast<int32_t*>(q_scale + R);
  const __m512 sign_off = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
  for (int64_t r = 0; r < R; ++r) {
    const float* x = qf + r * D;
    __m512 top = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 16) top = _mm512_max_ps(top, _mm512_and_ps(_mm512_loadu_ps(x + d), sign_off));
    const float amax = _mm512_reduce_max_ps(top);
    const float s1 = amax > 0.f ? amax / 127.f : 1.f, s2 = s1 / 128.f;
    const __m512 inv1 = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f), inv2 = _mm512_set1_ps(1.f / s2);
    const __m512 step1 = _mm512_set1_ps(s1), lo = _mm512_set1_ps(-64.f), hi = _mm512_set1_ps(64.f);
    __m512i sum1 = _mm512_setzero_si512(), sum2 = _mm512_setzero_si512();
    for (int64_t d = 0; d < D; d += 16) {
      const __m512 v = _mm512_loadu_ps(x + d);
      const __m512 a1 = _mm512_roundscale_ps(_mm512_mul_ps(v, inv1), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      const __m512 rest = _mm512_fnmadd_ps(a1, step1, v);
      const __m512 a2 = _mm512_min_ps(hi, _mm512_max_ps(lo, _mm512_roundscale_ps(
          _mm512_mul_ps(rest, inv2), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)));
      const __m512i i1 = _mm512_cvtps_epi32(a1), i2 = _mm512_cvtps_epi32(a2);
      sum1 = _mm512_add_epi32(sum1, i1);
      sum2 = _mm512_add_epi32(sum2, i2);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q1 + r * D + d), _mm512_cvtepi32_epi8(i1));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q2 + r * D + d), _mm512_cvtepi32_epi8(i2));
    }
    q_scale[r] = s2;
    q_offset[r] = 128 * (128 * _mm512_reduce_add_epi32(sum1) + _mm512_reduce_add_epi32(sum2));
  }
  const int64_t key_end = std::min(it.key1, a.past + it.row0 + it.rows);
  TileRange<T> tiles{a, it.kv_head, D, {}, {}, {}, {}};
  for (int64_t k0 = it.key0; k0 < key_end; k0 += SUB) {
    const int64_t n = std::min(SUB, key_end - k0), n16 = (n + 15) / 16 * 16;
    tiles.load(k0, n, n16);
    for (int64_t g = 0; g < n16 / KEY_TILE; ++g) {
      const __m512 kscale = _mm512_load_ps(tiles.k_scale + g * KEY_TILE);
      // the next range's group g on its way from memory: its cache lines spread over this group's query
      // rows, a few between each row's products (the whole next range at once, 128 lines, stalled the
      // products while the line fill buffers drained: 4-5% slower from memory at 6,000 keys)
      const int64_t p_next = k0 + SUB + g * KEY_TILE;
      const int8_t* kp = p_next < key_end ? tiles.group_at(p_next, a.k_cache) : nullptr;
      const int8_t* vp = p_next < key_end ? tiles.group_at(p_next, a.v_cache) : nullptr;
      if (kp != nullptr) {
        __builtin_prefetch(tiles.scale_at(kp, p_next));
        __builtin_prefetch(tiles.scale_at(vp, p_next));
      }
      for (int64_t r = 0; r < R; ++r) {
        for (int64_t b = r * 64; kp != nullptr && b < KEY_TILE * D; b += 64 * R) {
          __builtin_prefetch(kp + b);
          __builtin_prefetch(vp + b);
        }
        const int8_t* qa = q1 + r * D;
        const int8_t* qb = q2 + r * D;
        __m512i a0 = _mm512_setzero_si512(), a1 = a0, b0 = a0, b1 = a0;  // two chains per part
        for (int64_t dg = 0; dg < DG; dg += 2) {
          const __m512i k_even = _mm512_loadu_si512(tiles.keys[g] + 64 * dg);
          const __m512i k_odd = _mm512_loadu_si512(tiles.keys[g] + 64 * (dg + 1));
          int32_t w[4];
          std::memcpy(w, qa + 4 * dg, 8);
          std::memcpy(w + 2, qb + 4 * dg, 8);
          a0 = _mm512_dpbusd_epi32(a0, k_even, _mm512_set1_epi32(w[0]));
          a1 = _mm512_dpbusd_epi32(a1, k_odd, _mm512_set1_epi32(w[1]));
          b0 = _mm512_dpbusd_epi32(b0, k_even, _mm512_set1_epi32(w[2]));
          b1 = _mm512_dpbusd_epi32(b1, k_odd, _mm512_set1_epi32(w[3]));
        }
        const __m512i total = _mm512_add_epi32(_mm512_slli_epi32(_mm512_add_epi32(a0, a1), 7), _mm512_add_epi32(b0, b1));
        const __m512 dots = _mm512_cvtepi32_ps(_mm512_sub_epi32(total, _mm512_set1_epi32(q_offset[r])));
        _mm512_storeu_ps(scores + r * SUB + g * KEY_TILE, _mm512_mul_ps(_mm512_mul_ps(dots, kscale), _mm512_set1_ps(q_scale[r])));
      }
    }
    for (int64_t r = 0; r < R; ++r) {
      softmax_step16<true>(scores + r * SUB, n16, seen(it, a, r / a.group, k0, n), st, r, D);
      for (int64_t j0 = 0; j0 < n16; j0 += 16)
        store16(scores + r * SUB + j0, mul16(load16(scores + r * SUB + j0), load16(tiles.v_scale + j0)));
    }
    constexpr int RQ = NZ == 1 ? 2 : 1;  // query vectors whose int32 sums (2 * 4 * NZ vectors each) stay in registers
    int64_t r = 0;
    for (; r + RQ <= R; r += RQ) accumulate_tiled<NZ, RQ>(st.acc + r * D, scores + r * SUB, tiles.values, n16);
    for (; r < R; ++r) accumulate_tiled<NZ, 1>(st.acc + r * D, scores + r * SUB, tiles.values, n16);
  }
}
#define FERRUM_TILED_ITEMS 1
#elif defined(__AVX2__)
// An int8 cache in tiles (common.h) on AVX2 without VNNI, head_dim = 64 * NZ: keys and values are split
// into 16-bit integers where they lie and multiplied by int16 queries and weights with vpmaddwd (each int32
// lane the exact sum of two products), with no conversion to float32 and no gathering of bytes. (vpmaddubsw
// on the bytes themselves would saturate: 255 * 127 * 2 > 32767.) Each query vector is quantized to int16,
// q = s qi with s = max|q| / 32767 (an error of at most s / 2), and scored against the tiles' keys plus
// 128: sum((k + 128) qi) - 128 sum(qi). A range's weights times the values' scales are quantized per query
// vector likewise (w >= 0: wi = w / s rounded, s = max w / 32767). A key's D products (k + 128 <= 255) and a
// range's SUB weighted values of one dimension (|v| <= 127) stay below 2^31 in int32 for D up to 128.
//
// A 32-byte row of a tile holds 8 keys' 4 dimensions (keys) or 8 dimensions' 4 tokens (values), each
// int32 lane one key or one dimension. Its even bytes and odd bytes (a mask and a shift; the signed values
// by shifts) are each 16 lanes of int16, two of the lane's four bytes; one vpmaddwd of each against the
// query's (or the weights') matching pair, added, is the lane's four products summed. So the sums come
// out one lane a key or a dimension, in order, with no vphaddd + vpermd to pair them up (on Zen 3 those
// issue 0.5 and 0.77 a cycle: 12% of the kernel's time), and each step reads a cache line whole. Against
// widening each 16-byte half with vpmovzx/sx and pairing after (scripts/cpu_kernel_ab.py, Zen 3, blocks in
// order, 16 passes): 0.93-0.97x the time at 2,048 and 6,000 keys, warm and from memory, 1 and 2 threads;
// blocks scattered 1.00x; the outputs bit for bit the same.
//
// Q7 (the rows of sequences whose every row this step is a generated token: decodes, speculative verifies):
// queries and value weights in 7 bits, so that the cache's bytes go to vpmaddubsw as they lie (each int16
// lane the exact sum of two products: at most 2 x 255 x 63 for a key plus 128 and a query, 2 x 127 x 127
// for a value and a weight), widened by one vpmaddwd against ones into int32 lanes of four products: 3
// operations a row vector and query vector against 5. q = s qi with s = max|q| / 63; w = s wi with s =
// max w / 127. Prompt rows keep 16 bits: a prompt read from the prefix cache must score as the same prompt
// prefilled from its first token (which reads its keys as computed), and at 7 bits the demo model's near-tie
// first answer token flipped between the two (benchmarks/cpu-kernels.md). Measured (scripts/cpu_kernel_ab.py,
// Zen 3): 0.816x the 16-bit kernel's time at 6,000 keys warm, 0.874x from memory, 2 threads; the decode
// path's perplexity on the demo model 1.0018x the unquantized model's (16 bits: 1.0002x).
constexpr float QUERY_MAX7 = 63.f;  // a 7-bit query's largest magnitude: (k + 128) q pairs within int16

inline __m256i two_int16(int16_t a, int16_t b) {  // (a, b) in every int32 lane
  return _mm256_set1_epi32(int32_t(uint32_t(uint16_t(a)) | (uint32_t(uint16_t(b)) << 16)));
}

// The int32 sums of 16 keys (a tile group: `keys`, key_byte's layout, plus 128) times RB int16 query
// vectors, given as each 4 dimensions' even and odd pairs (qp: 2 vectors a dimension group, 2 DG vectors a
// query vector; Q7: 7-bit queries, each 4 dimensions' bytes in one vector): out[r][0] keys 0-7, out[r][1] keys 8-15. Meanwhile the DG cache lines of two other tile
// groups are prefetched, a line of each between each dimension group's products (nullptr: none).
template <int NZ, int RB, bool Q7>
inline void score_group(const int8_t* keys, const __m256i* qp, __m256i out[][2], const int8_t* ahead,
                        const int8_t* ahead2) {
  constexpr int64_t DG = 16 * NZ;
  const __m256i low = _mm256_set1_epi16(0x00FF), ones = _mm256_set1_epi16(1);
  for (int r = 0; r < RB; ++r) out[r][0] = out[r][1] = _mm256_setzero_si256();
  for (int64_t dg = 0; dg < DG; ++dg) {
    if (ahead != nullptr) __builtin_prefetch(ahead + 64 * dg);
    if (ahead2 != nullptr) __builtin_prefetch(ahead2 + 64 * dg);
    const __m256i* rows = reinterpret_cast<const __m256i*>(keys + 64 * dg);  // dimensions 4dg..4dg+3
    const __m256i x0 = _mm256_loadu_si256(rows), x1 = _mm256_loadu_si256(rows + 1);  // keys 0-7, 8-15
    if constexpr (Q7) {  // qp: each 4 dimensions' 4 bytes repeated across a vector, DG vectors a query vector
      for (int r = 0; r < RB; ++r) {
        const __m256i q = _mm256_load_si256(qp + r * DG + dg);
        out[r][0] = _mm256_add_epi32(out[r][0], _mm256_madd_epi16(_mm256_maddubs_epi16(x0, q), ones));
        out[r][1] = _mm256_add_epi32(out[r][1], _mm256_madd_epi16(_mm256_maddubs_epi16(x1, q), ones));
      }
    } else {
      const __m256i e0 = _mm256_and_si256(x0, low), o0 = _mm256_srli_epi16(x0, 8);
      const __m256i e1 = _mm256_and_si256(x1, low), o1 = _mm256_srli_epi16(x1, 8);
      for (int r = 0; r < RB; ++r) {
        const __m256i qe = _mm256_load_si256(qp + 2 * (r * DG + dg)), qo = _mm256_load_si256(qp + 2 * (r * DG + dg) + 1);
        out[r][0] = _mm256_add_epi32(out[r][0], _mm256_add_epi32(_mm256_madd_epi16(e0, qe), _mm256_madd_epi16(o0, qo)));
        out[r][1] = _mm256_add_epi32(out[r][1], _mm256_add_epi32(_mm256_madd_epi16(e1, qe), _mm256_madd_epi16(o1, qo)));
      }
    }
  }
}

// acc[r] += sum_j weights[r][j] * value_j for RB query vectors over the range's n16 keys, whose values
// lie in 16-key tile groups `values[n16 / 16]` (value_byte's layout); weights past the range's keys are 0.
template <int NZ, int RB, bool Q7>
inline void accumulate_tiled(float* acc, const float* weights, const int8_t* const* values, int64_t n16) {
  constexpr int64_t D = 64 * NZ;
  constexpr float W_MAX = Q7 ? 127.f : 32767.f;  // Q7: each 4 tokens' weights as 4 bytes, one int32
  // each 4 tokens' weights as (w0, w2, w1, w3), each pair one int32 that the value loop broadcasts from here
  // (against broadcasting every pair into a vector in memory first, then loading those: the same bits, the
  // value loop 9.7 cycles an iteration instead of 11.6 by llvm-mca for Zen 3; the kernel 0.94-0.97x the
  // time at 512 and 6,000 keys, warm and cold, 1 and 2 threads, `scripts/cpu_kernel_ab.py`, 24 passes)
  alignas(32) int16_t wq[RB][SUB];  // Q7: bytes, the first SUB of each row
  float step[RB];
  for (int r = 0; r < RB; ++r) {
    const float* w_r = weights + r * SUB;
    __m256 top = _mm256_setzero_ps();
    for (int64_t j = 0; j < n16; j += 8) top = _mm256_max_ps(top, _mm256_loadu_ps(w_r + j));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, top);
    const float w_max = *std::max_element(lanes, lanes + 8);
    step[r] = w_max > 0.f ? w_max / W_MAX : 0.f;
    const __m256 inv = _mm256_set1_ps(w_max > 0.f ? W_MAX / w_max : 0.f);
    // (one vpshufb here, where building each pair from two int16 took several scalar ops: the same bits,
    // 0.88-0.97x the kernel's time at 512-6,000 keys on Zen 3, `scripts/cpu_kernel_ab.py`, 12 passes)
    const __m256i pairs = _mm256_setr_epi8(0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15,
                                           0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t j = 0; j < n16; j += 16) {
      const __m256i lo = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(w_r + j), inv));
      const __m256i hi = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(w_r + j + 8), inv));
      if constexpr (Q7) {  // int32 -> int16 (lanes a0-3 b0-3 | a4-7 b4-7) -> bytes, the dwords put in order
        const __m256i bytes = _mm256_packus_epi16(_mm256_packs_epi32(lo, hi), _mm256_setzero_si256());
        _mm_store_si128(reinterpret_cast<__m128i*>(reinterpret_cast<uint8_t*>(wq[r]) + j),
                        _mm256_castsi256_si128(_mm256_permutevar8x32_epi32(bytes, order)));
      } else {
        const __m256i ordered = _mm256_permute4x64_epi64(_mm256_packs_epi32(lo, hi), 0xD8);
        _mm256_store_si256(reinterpret_cast<__m256i*>(wq[r] + j), _mm256_shuffle_epi8(ordered, pairs));
      }
    }
  }
  const int8_t* groups[SUB / VALUE_TILE];  // each 4 tokens' values
  for (int64_t g = 0; g < n16 / VALUE_TILE; ++g)
    groups[g] = values[g / (KEY_TILE / VALUE_TILE)] + (g % (KEY_TILE / VALUE_TILE)) * VALUE_TILE * D;
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t d0 = 0; d0 < D; d0 += 16) {  // 16 dimensions at a time: 2 vectors of sums a query vector
    __m256i sum[RB][2];
    for (int r = 0; r < RB; ++r) sum[r][0] = sum[r][1] = _mm256_setzero_si256();
    for (int64_t g = 0; g < n16 / VALUE_TILE; ++g) {
      const __m256i* rows = reinterpret_cast<const __m256i*>(groups[g] + 4 * d0);  // 4 tokens of dimensions d0..d0+15
      const __m256i x0 = _mm256_loadu_si256(rows), x1 = _mm256_loadu_si256(rows + 1);
      if constexpr (Q7) {
        for (int r = 0; r < RB; ++r) {
          int32_t four;  // tokens 0-3's weights, one a byte
          std::memcpy(&four, reinterpret_cast<const uint8_t*>(wq[r]) + VALUE_TILE * g, 4);
          const __m256i w = _mm256_set1_epi32(four);
          sum[r][0] = _mm256_add_epi32(sum[r][0], _mm256_madd_epi16(_mm256_maddubs_epi16(w, x0), ones));
          sum[r][1] = _mm256_add_epi32(sum[r][1], _mm256_madd_epi16(_mm256_maddubs_epi16(w, x1), ones));
        }
        continue;
      }
      const __m256i e0 = _mm256_srai_epi16(_mm256_slli_epi16(x0, 8), 8), o0 = _mm256_srai_epi16(x0, 8);
      const __m256i e1 = _mm256_srai_epi16(_mm256_slli_epi16(x1, 8), 8), o1 = _mm256_srai_epi16(x1, 8);
      for (int r = 0; r < RB; ++r) {
        int32_t even, odd;  // tokens 0 and 2, 1 and 3
        std::memcpy(&even, wq[r] + VALUE_TILE * g, 4);
        std::memcpy(&odd, wq[r] + VALUE_TILE * g + 2, 4);
        const __m256i we = _mm256_set1_epi32(even), wo = _mm256_set1_epi32(odd);
        sum[r][0] = _mm256_add_epi32(sum[r][0], _mm256_add_epi32(_mm256_madd_epi16(e0, we), _mm256_madd_epi16(o0, wo)));
        sum[r][1] = _mm256_add_epi32(sum[r][1], _mm256_add_epi32(_mm256_madd_epi16(e1, we), _mm256_madd_epi16(o1, wo)));
      }
    }
    for (int r = 0; r < RB; ++r)
      for (int h = 0; h < 2; ++h) {
        float* a = acc + r * D + d0 + 8 * h;
        _mm256_storeu_ps(a, _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[r][h]), _mm256_set1_ps(step[r]), _mm256_loadu_ps(a)));
      }
  }
}

// score_group for RB query vectors from row r into scores (SUB apart), times the keys' and queries' scales
template <int NZ, int RB, bool Q7>
inline void score_rows(const int8_t* keys, const __m256i* qp, const float* q_scale, const int32_t* q_offset,
                       const float* k_scale, float* scores, int64_t r, const int8_t* ahead, const int8_t* ahead2) {
  constexpr int64_t DG = 16 * NZ;
  __m256i dots[RB][2];
  score_group<NZ, RB, Q7>(keys, qp + (Q7 ? 1 : 2) * r * DG, dots, ahead, ahead2);
  for (int i = 0; i < RB; ++i)
    for (int h = 0; h < 2; ++h) {
      const __m256 d = _mm256_cvtepi32_ps(_mm256_sub_epi32(dots[i][h], _mm256_set1_epi32(q_offset[r + i])));
      _mm256_storeu_ps(scores + (r + i) * SUB + 8 * h,
                       _mm256_mul_ps(_mm256_mul_ps(d, _mm256_loadu_ps(k_scale + 8 * h)), _mm256_set1_ps(q_scale[r + i])));
    }
}

template <typename T, int NZ, bool Q7>
void run_item_tiled(const Item& it, const ItemArgs<T, int8_t>& a, Partial st, float* qf, float* buf, float* scores) {
  constexpr int64_t D = 64 * NZ;
  const int64_t R = it.rows * a.group;
  init_item(it, a, st, qf);
  // buf (32-byte aligned): the quantized queries, each 4 dimensions' even and odd pairs repeated across a
  // vector [R, D / 4, 2], then R scales and R offsets
  __m256i* qp = reinterpret_cast<__m256i*>((reinterpret_cast<uintptr_t>(buf) + 31) / 32 * 32);
  float* q_scale = reinterpret_cast<float*>(qp + R * (D / 2));
  int32_t* q_offset = reinterpret_cast<int32_t*>(q_scale + R);
  for (int64_t r = 0; r < R; ++r) {
    const float* x = qf + r * D;
    float amax = 0.f;
    for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(x[d]));
    constexpr float Q_MAX = Q7 ? QUERY_MAX7 : 32767.f;
    const float inv = amax > 0.f ? Q_MAX / amax : 0.f;
    int32_t total = 0;
    int16_t q16[D];
    for (int64_t d = 0; d < D; ++d) {
      const int32_t v = int32_t(std::nearbyint(x[d] * inv));
      q16[d] = int16_t(v);
      total += v;
    }
    for (int64_t dg = 0; dg < D / 4; ++dg) {
      if constexpr (Q7) {
        const int8_t q7[4] = {int8_t(q16[4 * dg]), int8_t(q16[4 * dg + 1]), int8_t(q16[4 * dg + 2]), int8_t(q16[4 * dg + 3])};
        int32_t four;
        std::memcpy(&four, q7, 4);
        _mm256_store_si256(qp + r * (D / 4) + dg, _mm256_set1_epi32(four));
      } else {
        _mm256_store_si256(qp + r * (D / 2) + 2 * dg, two_int16(q16[4 * dg], q16[4 * dg + 2]));
        _mm256_store_si256(qp + r * (D / 2) + 2 * dg + 1, two_int16(q16[4 * dg + 1], q16[4 * dg + 3]));
      }
    }
    q_scale[r] = amax > 0.f ? amax / Q_MAX : 0.f;
    q_offset[r] = 128 * total;
  }
  const int64_t key_end = std::min(it.key1, a.past + it.row0 + it.rows);
  TileRange<T> tiles{a, it.kv_head, D, {}, {}, {}, {}};
  for (int64_t k0 = it.key0; k0 < key_end; k0 += SUB) {
    const int64_t n = std::min(SUB, key_end - k0), n16 = (n + 15) / 16 * 16;
    tiles.load(k0, n, n16);
    for (int64_t g = 0; g < n16 / KEY_TILE; ++g) {
      // Prefetched while this group's keys are scored: this range's values of the group (read next, after
      // the softmax), and the next range's keys of the group with both its scale lines. A range's keys
      // are one run of memory when its blocks are in order, which the hardware prefetcher follows; its
      // values are read one line of every four at a time (each 16 dimensions of every 4 tokens), which it
      // does not. Measured against prefetching the next range's keys and values, all of a group's lines
      // at once (scripts/cpu_kernel_ab.py, Zen 3, 6,000 keys from memory, when the values were read 32
      // bytes of every 256): 0.73-0.84x the time on one thread and 0.78x on two with blocks in order,
      // 0.74x and 0.83x scattered; benchmarks/cpu-kernels.md.
      const int64_t p_next = k0 + SUB + g * KEY_TILE;
      const int8_t* next_keys = nullptr;
      if (p_next < key_end) {
        next_keys = tiles.group_at(p_next, a.k_cache);
        __builtin_prefetch(tiles.scale_at(next_keys, p_next));
        __builtin_prefetch(tiles.scale_at(tiles.group_at(p_next, a.v_cache), p_next));
      }
      float* s_g = scores + g * KEY_TILE;
      const float* ks = tiles.k_scale + g * KEY_TILE;
      int64_t r = 0;  // the first call of the group prefetches
      for (; r + 3 <= R; r += 3)
        score_rows<NZ, 3, Q7>(tiles.keys[g], qp, q_scale, q_offset, ks, s_g, r, r == 0 ? tiles.values[g] : nullptr,
                          r == 0 ? next_keys : nullptr);
      for (; r < R; ++r)
        score_rows<NZ, 1, Q7>(tiles.keys[g], qp, q_scale, q_offset, ks, s_g, r, r == 0 ? tiles.values[g] : nullptr,
                          r == 0 ? next_keys : nullptr);
    }
    for (int64_t r = 0; r < R; ++r) {
      softmax_step16<true>(scores + r * SUB, n16, seen(it, a, r / a.group, k0, n), st, r, D);
      for (int64_t j0 = 0; j0 < n16; j0 += 16)
        store16(scores + r * SUB + j0, mul16(load16(scores + r * SUB + j0), load16(tiles.v_scale + j0)));
    }
    int64_t r = 0;
    for (; r + 3 <= R; r += 3) accumulate_tiled<NZ, 3, Q7>(st.acc + r * D, scores + r * SUB, tiles.values, n16);
    for (; r < R; ++r) accumulate_tiled<NZ, 1, Q7>(st.acc + r * D, scores + r * SUB, tiles.values, n16);
  }
}
#define FERRUM_TILED_ITEMS 1
#define FERRUM_TILED_Q7 1
#endif

template <typename T, typename C>
void run_item(const Item& it, const ItemArgs<T, C>& a, Partial st, float* qf, float* buf, float* scores) {
#if defined(FERRUM_TILED_ITEMS)
  if constexpr (std::is_same_v<C, int8_t>) {
#if defined(FERRUM_TILED_Q7)
    if (a.tiled && a.seven_bit && a.head_dim == 64) return run_item_tiled<T, 1, true>(it, a, st, qf, buf, scores);
    if (a.tiled && a.seven_bit && a.head_dim == 128) return run_item_tiled<T, 2, true>(it, a, st, qf, buf, scores);
#endif
    if (a.tiled && a.head_dim == 64) return run_item_tiled<T, 1, false>(it, a, st, qf, buf, scores);
    if (a.tiled && a.head_dim == 128) return run_item_tiled<T, 2, false>(it, a, st, qf, buf, scores);
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
// block_tables int32 [B, W], seq_lens int32 [B], query_starts int32 [B + 1]; window: the sliding window
// (0: none), whose keys alone are read (a table's blocks before its first query's window are never read);
// generated: bool [B], the sequences whose rows this step are all generated tokens (AVX2's int8 tiles read
// them with 7-bit queries and value weights; None: none).
void paged_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_starts,
                     int64_t block_size, double scale, int64_t window, const c10::optional<at::Tensor>& k,
                     const c10::optional<at::Tensor>& v, const c10::optional<at::Tensor>& generated) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "paged_attention: q must be [T, H, D] with contiguous heads");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == q.sizes() && out.scalar_type() == q.scalar_type(),
              "paged_attention: out must be contiguous, shaped and typed like q");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes() && k_cache.strides() == v_cache.strides(),
              "paged_attention: k_cache and v_cache must be of one shape and layout");
  const CacheStrides strides = cache_strides(k_cache, block_size, "paged_attention");
  const bool tiled = int8_tiled(k_cache, block_size);
  const bool int8_cache = k_cache.scalar_type() == at::kChar;
  const bool cache16 = q.scalar_type() == at::kFloat &&
                          (k_cache.scalar_type() == at::kBFloat16 || k_cache.scalar_type() == at::kHalf);
  TORCH_CHECK((k_cache.scalar_type() == q.scalar_type() || int8_cache || cache16) &&
                  v_cache.scalar_type() == k_cache.scalar_type(),
              "paged_attention: the cache must hold q's dtype, int8, or (for float32 q) bfloat16 or float16");
  TORCH_CHECK(k_cache.size(-1) == q.size(2) + (int8_cache ? 4 : 0) && q.size(1) % k_cache.size(1) == 0,
              "paged_attention: the cache's head width is not head_dim (+ 4 for an int8 cache) or the query heads "
              "are not a multiple of the kv heads");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  query_starts.scalar_type() == at::kInt && block_tables.is_contiguous(),
              "paged_attention: block_tables, seq_lens and query_starts must be int32 (block_tables contiguous)");
  TORCH_CHECK(query_starts.size(0) == seq_lens.size(0) + 1 && block_tables.size(0) >= seq_lens.size(0),
              "paged_attention: one row of block_tables and seq_lens per sequence, query_starts one longer");
  TORCH_CHECK(window >= 0, "paged_attention: window must be 0 (none) or positive");
  const int64_t num_seqs = seq_lens.size(0), heads = q.size(1), D = q.size(2);
  const int64_t kv_heads = k_cache.size(1), group = heads / kv_heads, width = block_tables.size(1);
  const bool own = k.has_value();
  TORCH_CHECK(own == v.has_value(), "paged_attention: give the step's k and v both or neither");
  if (own) {
    for (const at::Tensor* t : {&*k, &*v})
      TORCH_CHECK(t->dim() == 3 && t->size(0) == q.size(0) && t->size(1) == kv_heads && t->size(2) == D &&
                      t->stride(2) == 1 && t->stride(1) == D && t->scalar_type() == q.scalar_type(),
                  "paged_attention: k and v must be [T, KV, D] like q's rows, heads contiguous, in q's dtype");
    TORCH_CHECK(k->stride(0) == v->stride(0), "paged_attention: k and v must share their row stride");
  }
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* starts = query_starts.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  if (generated.has_value())
    TORCH_CHECK(generated->scalar_type() == at::kBool && generated->dim() == 1 && generated->size(0) == num_seqs &&
                    generated->is_contiguous(),
                "paged_attention: generated must be bool [sequences], contiguous");
  const bool* generated_seqs = generated.has_value() ? generated->data_ptr<bool>() : nullptr;

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
  int64_t num_partials = 0, most_rows = 0;
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int64_t n = starts[b + 1] - starts[b], past = lens[b] - n;
    most_rows = std::max(most_rows, n);
    for (int64_t h = 0; h < kv_heads; ++h) {
      for (int64_t row0 = 0; row0 < n; row0 += TILE) {
        const int64_t rows = std::min(TILE, n - row0), keys = past + row0 + rows;
        // the first key the tile's first row sees, down to its block's first (the blocks before it may
        // have been given back; an int8 cache's 16-key groups start at multiples of 16, as blocks do)
        const int64_t first =
            window > 0 ? std::max<int64_t>(0, past + row0 - window + 1) / block_size * block_size : 0;
        if (own && past == 0) {  // one item: a tile's keys are at most its prompt's first rows
          items.push_back({b, h, row0, rows, first, keys, -1, true});
          continue;
        }
        int64_t splits = 1;
        if (base_items < want) splits = std::max<int64_t>(1, std::min(want / base_items, (keys - first) / MIN_SPLIT));
        // ranges start at multiples of SUB from `first`, so that however a sequence's keys are split (which
        // its batch decides) the same SUB keys share a range: an int8 cache quantizes a range's weights together
        const int64_t per = ((keys - first + splits - 1) / splits + SUB - 1) / SUB * SUB;
        for (int64_t s = 0; s < splits; ++s) {
          const int64_t k0 = first + s * per, k1 = std::min(keys, k0 + per);
          if (k0 >= k1) break;
          items.push_back({b, h, row0, rows, k0, k1, splits > 1 ? num_partials++ : -1, false});
        }
      }
    }
  }
  // an own item's "block table": key j of a fresh prompt (block_size 1) is its row j
  std::vector<int32_t> own_rows(own ? most_rows : 0);
  for (int64_t j = 0; j < int64_t(own_rows.size()); ++j) own_rows[j] = int32_t(j);
  const int64_t R_max = TILE * group;
  std::vector<float> split_buf(num_partials * R_max * (D + 2));

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention", [&] {
    auto run = [&](auto cache_element) {
      using C = decltype(cache_element);
      const scalar_t* qp = q.data_ptr<scalar_t>();
      const C* kc = static_cast<const C*>(k_cache.data_ptr());
      const C* vc = static_cast<const C*>(v_cache.data_ptr());
      scalar_t* op = out.data_ptr<scalar_t>();

      // small steps (short contexts) run on one thread: waking the others costs more than they save.
      // Otherwise each thread takes the next item until none is left, so that a thread slowed by a
      // neighbour (a VM's shared core) leaves its items to the others.
      int64_t work = 0;
      for (const Item& it : items) work += (it.key1 - it.key0) * it.rows * group;
      const int64_t num_items = int64_t(items.size());
      const int64_t lanes = work < 4096 ? 1 : std::min(threads, num_items);
      std::atomic<int64_t> next_item{0};
      at::parallel_for(0, lanes, 1, [&](int64_t, int64_t) {
        // buf: SUB keys or values as float32, or (run_item_tiled) the quantized queries, their scales and offsets
        // (AVX2: each 4 dimensions of a query as two 32-byte vectors, 4 * R_max * D floats, aligned to 32 bytes)
        const int64_t buf_size = SUB * D + 4 * R_max * D + 2 * R_max + 16;
        std::vector<float> scratch(R_max * D * 2 + buf_size + R_max * SUB + 2 * R_max);
        float* qf = scratch.data();
        float* own_acc = qf + R_max * D;
        float* buf = own_acc + R_max * D;
        float* scores = buf + buf_size;
        float* own_max = scores + R_max * SUB;
        float* own_sum = own_max + R_max;
        for (int64_t i; (i = next_item.fetch_add(1, std::memory_order_relaxed)) < num_items;) {
          const Item& it = items[i];
          const int64_t n = starts[it.seq + 1] - starts[it.seq];
          Partial st{own_max, own_sum, own_acc};
          if (it.partial >= 0) {
            float* base = split_buf.data() + it.partial * R_max * (D + 2);
            st = Partial{base, base + R_max, base + 2 * R_max};
          }
          const scalar_t* q_rows = qp + starts[it.seq] * q.stride(0);
          if (it.own) {  // a fresh prompt's keys and values where rope_write read them
            const int64_t row = starts[it.seq] * k->stride(0);
            const ItemArgs<scalar_t, scalar_t> args{q_rows, q.stride(0), q.stride(1), k->data_ptr<scalar_t>() + row,
                                                    v->data_ptr<scalar_t>() + row, CacheStrides{k->stride(0), 0, D},
                                                    own_rows.data(), 1, 0, group, D, window, float(scale), false,
                                                    false};
            run_item(it, args, st, qf, buf, scores);
          } else {
            const ItemArgs<scalar_t, C> args{q_rows, q.stride(0), q.stride(1), kc, vc, strides,
                                             tables + it.seq * width, block_size, lens[it.seq] - n, group, D,
                                             window, float(scale), tiled, generated_seqs != nullptr &&
                                             generated_seqs[it.seq] != 0};
            run_item(it, args, st, qf, buf, scores);
          }
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
      // a decode's few merges (a tile's rows x its ranges x D) on this thread: a second wake-up of the
      // others would cost more
      int64_t merge_work = 0;
      for (const auto& [first, end] : groups) merge_work += (end - first) * items[first].rows * group * D;
      const int64_t merge_grain = merge_work < 65536 ? std::max<int64_t>(1, int64_t(groups.size())) : 1;
      at::parallel_for(0, int64_t(groups.size()), merge_grain, [&](int64_t begin, int64_t end) {
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
    else if constexpr (std::is_same_v<scalar_t, float>) {  // float32 activations over a 16-bit cache
      if (k_cache.scalar_type() == at::kBFloat16) run(c10::BFloat16{});
      else if (k_cache.scalar_type() == at::kHalf) run(c10::Half{});
      else run(scalar_t{});
    } else run(scalar_t{});
  });
}

}  // namespace ferrum_cpu
