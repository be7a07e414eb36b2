// Products of activation rows with int4 or int8 weights on the CPU, as integer dot products.
//
// Each row of x is quantized to int8 twice over, in blocks of 32 inputs: x = s1 q1 + s2 q2 + e with
// s1 = max |x| / 127, q2 the rounding error's own int8 at s2 = s1 / 254, so |e| <= max |x| / 64516
// (one int8 alone left max |x| / 254, which flipped the demo model's near-ties: a cached prompt prefix
// then changed its greedy answer). The two parts are two rows of activations (a float scale per block;
// the exact float sum per weight group on the first, and their integer sums per block), so the
// kernels below see 2T rows for T and the part rows' products are added. The weights are repacked once
// (ferrum.models.layers.quantized_linear.CpuKernelsMethod) so that 8 output rows sit side by side:
// one 32-byte load holds 4 consecutive inputs of each of 8 rows, and one vpdpbusd (AVX512-VNNI or
// AVX-VNNI; maddubs + madd on plain AVX2) adds their products with the same 4 inputs of x, broadcast,
// into 8 lanes: one per row. Nothing is summed across lanes.
//
//   int4: packed uint8 [N/8, K/32, 4, 32]: for block b and c in 0..3, byte 4 * row + j holds input
//         32 b + 4 c + j of the row in its low nibble and input 32 b + 4 (c + 4) + j in its high one;
//         scale and offset [N/8, K/g, 8] (float32 or float16): w = q * scale + offset, or with
//         `zero_point`, w = (q - 8) * scale + offset (whichever form the stored values are exact in).
//   int8: packed uint8 [N/8, K/32, 8, 32]: byte 4 * row + j of chunk c is input 32 b + 4 c + j plus
//         128; scale float32 [N/8, 8] (a row's) or [N/8, K/g, 8] (a group's): w = (byte - 128) * scale.

#include "common.h"
#include "simd.h"


#if defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AVX2__) && !(defined(__AVX512VNNI__) && defined(__AVX512VL__)) && !defined(__AVXVNNI__)
#define FERRUM_INT16_SUMS 1  // no vpdpbusd: int4 products summed in int16 before one widening a block
#endif

namespace ferrum_cpu {
namespace {

constexpr int64_t QBLOCK = 32;
constexpr int64_t LANES = 8;     // output rows side by side
// activation rows (parts: two per row of x) a weight block is unpacked once for: with AVX-512's 32 vector
// registers 10, so that a speculative verify step at batch 1 and k 4 (5 rows) reads the weights once
#if defined(__AVX512VL__)
constexpr int64_t MAX_ROWS = 10;
#else
constexpr int64_t MAX_ROWS = 8;
#endif
constexpr int64_t PARTS = 2;     // int8 parts per row of x
// plain AVX2's int4 products of ROWS_FROM rows of x or more take int4_groups_rows, ROWS_CHUNK rows at a time.
// From int4_dense_rows() rows a dense product (the weight dequantized for the call, then torch's matmul)
// is faster: 256 with int4_groups_rows (Zen 3: the demo model's projections, 2 threads, 0.79x the dense
// product's time at 192 rows, 1.20x at 384; benchmarks/cpu-kernels.md), 32 elsewhere.
constexpr int64_t ROWS_FROM = 2, ROWS_CHUNK = 32;
// How far ahead of the block being multiplied its weights are prefetched. A thread's row groups lie one
// after another, so its weights are one stream; left to the hardware prefetchers, the GEMV streamed a
// model's weights (66 MB, more than the cache holds) at 10-12 GB/s on 2 cores of an AMX Xeon whose plain
// reads reach 27 GB/s: the multiply-adds and the loads did not overlap. 4 KiB ahead: 15-19 GB/s (2 KiB
// 13 GB/s, 8 KiB 14-16 GB/s).
constexpr int64_t PREFETCH_BYTES = 4096;

struct QuantizedX {
  int64_t rows, K;
  std::vector<int8_t> q;         // [rows, K]
  std::vector<float> scale;      // [rows, K / 32]
  std::vector<int32_t> q_sum;    // [rows, K / 32]: sum of the block's int8 values
  std::vector<float> group_sum;  // [rows, K / group]: exact float sums of x
};

#if defined(__AVX2__)
// One block's two int8 parts (q1, q2) and their integer sums, 8 lanes at a time: the roundings of the
// scalar loop in quantize_x (a product, then the nearest integer, ties to even, as cvtps2dq does in the
// default rounding mode), so the same bytes.
inline void quantize_block(const float* v, float s1, float inv1, float inv2, int8_t* q1, int8_t* q2, int32_t& sum1,
                           int32_t& sum2) {
  __m256i i1[4], i2[4];
  __m256i t1 = _mm256_setzero_si256(), t2 = _mm256_setzero_si256();
  const __m256i top = _mm256_set1_epi32(127), bottom = _mm256_set1_epi32(-127);
  for (int j = 0; j < 4; ++j) {
    const __m256 x = _mm256_loadu_ps(v + 8 * j);
    const __m256 r1 = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(inv1)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    i1[j] = _mm256_cvtps_epi32(r1);
    const __m256 rest = _mm256_sub_ps(x, _mm256_mul_ps(r1, _mm256_set1_ps(s1)));
    i2[j] = _mm256_min_epi32(_mm256_max_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(rest, _mm256_set1_ps(inv2))), bottom), top);
    t1 = _mm256_add_epi32(t1, i1[j]);
    t2 = _mm256_add_epi32(t2, i2[j]);
  }
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // packs interleave the 128-bit lanes
  const auto bytes = [&](const __m256i* i) {
    return _mm256_permutevar8x32_epi32(
        _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3])), order);
  };
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q1), bytes(i1));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q2), bytes(i2));
  const auto total = [](__m256i t) {
    const __m128i h = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
    const __m128i q = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4E));
    return _mm_cvtsi128_si32(_mm_add_epi32(q, _mm_shuffle_epi32(q, 0xB1)));
  };
  sum1 = total(t1);
  sum2 = total(t2);
}
#endif

// rows of x [rows, K] as 2 rows of int8 parts each: part 0 of row t is row 2t, part 1 row 2t + 1. Rows
// are shared among the threads where there are enough of them (a prefill's; a decode row stays on one).
template <typename T>
QuantizedX quantize_x(const T* x, int64_t rows, int64_t K, int64_t group) {
  const int64_t blocks = K / QBLOCK, groups = group ? K / group : 1, per_group = group ? group / QBLOCK : blocks;
  const int64_t parts = PARTS * rows;
  QuantizedX out{parts, K, std::vector<int8_t>(parts * K), std::vector<float>(parts * blocks),
                 std::vector<int32_t>(parts * blocks), std::vector<float>(parts * groups, 0.f)};
  at::parallel_for(0, rows, std::max<int64_t>(1, 8192 / K), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t hi = PARTS * t, lo = hi + 1;
      for (int64_t b = 0; b < blocks; ++b) {
        alignas(32) float v[QBLOCK];
        float amax = 0.f, total = 0.f;
        for (int64_t i = 0; i < QBLOCK; ++i) {
          v[i] = to_float(x[t * K + b * QBLOCK + i]);
          amax = std::max(amax, std::fabs(v[i]));
          total += v[i];
        }
        const float s1 = amax / 127.f, s2 = s1 / 254.f;
        const float inv1 = amax > 0.f ? 127.f / amax : 0.f, inv2 = amax > 0.f ? 254.f * 127.f / amax : 0.f;
        int8_t* q1 = out.q.data() + hi * K + b * QBLOCK;
        int8_t* q2 = out.q.data() + lo * K + b * QBLOCK;
        int32_t sum1 = 0, sum2 = 0;
#if defined(__AVX2__)
        quantize_block(v, s1, inv1, inv2, q1, q2, sum1, sum2);
#else
        for (int64_t i = 0; i < QBLOCK; ++i) {
          const float r1 = std::nearbyint(v[i] * inv1);
          q1[i] = static_cast<int8_t>(r1);
          const float rest = v[i] - r1 * s1;
          q2[i] = static_cast<int8_t>(std::clamp(std::nearbyint(rest * inv2), -127.f, 127.f));
          sum1 += q1[i];
          sum2 += q2[i];
        }
#endif
        out.scale[hi * blocks + b] = s1;
        out.scale[lo * blocks + b] = s2;
        out.q_sum[hi * blocks + b] = sum1;
        out.q_sum[lo * blocks + b] = sum2;
        out.group_sum[hi * groups + b / per_group] += total;  // the part rows' sums stay 0: counted once
      }
    }
  });
  return out;
}

#if defined(__AVX2__)
inline __m256i dot_u8s8(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u, s);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

// int8 weights are stored offset by 128 (unsigned bytes). With VNNI one vpdpbusd multiplies them by x's
// signed bytes and the offset comes off through x's sums (-128 * sum(x)). Without it, maddubs would
// saturate (255 * 127 * 2 > 32767): the weight's signed value takes x's sign and meets |x| instead, so
// that each pair stays within 2 * 127 * 127, and nothing comes off.
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
constexpr int32_t INT8_OFFSET = 128;
inline __m256i dot_int8(__m256i acc, __m256i offset_weights, __m256i x) { return dot_u8s8(acc, offset_weights, x); }
#else
constexpr int32_t INT8_OFFSET = 0;
inline __m256i dot_int8(__m256i acc, __m256i offset_weights, __m256i x) {
  const __m256i w = _mm256_xor_si256(offset_weights, _mm256_set1_epi8(char(0x80)));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(x), _mm256_sign_epi8(w, x)),
                                                 _mm256_set1_epi16(1)));
}
#endif

inline __m256i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::Half* p) {
#if defined(__F16C__)
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  float f[8];
  for (int i = 0; i < 8; ++i) f[i] = static_cast<float>(p[i]);
  return _mm256_loadu_ps(f);
#endif
}
#endif

template <typename P>
inline float param(const P* p, int64_t i) {
  return static_cast<float>(p[i]);
}

// row groups [g0, g1) of y [R, N] (float32) for R activation rows
template <typename P, int R>
void int4_groups(const QuantizedX& xq, const uint8_t* packed, const P* scale, const P* minimum, bool zero_point,
                 int64_t group, float* y, int64_t N, int64_t g0, int64_t g1) {
  const int64_t K = xq.K, blocks = K / QBLOCK, groups = K / group, per_group = group / QBLOCK;
  for (int64_t rg = g0; rg < g1; ++rg) {
    const uint8_t* wp = packed + rg * blocks * 4 * 32;
    const P* sp = scale + rg * groups * LANES;
    const P* mp = minimum + rg * groups * LANES;
#if defined(__AVX2__)
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (int64_t g = 0; g < groups; ++g) {
      const __m256 s = load8(sp + g * LANES);
      __m256 m = load8(mp + g * LANES);
      if (zero_point) m = _mm256_fnmadd_ps(_mm256_set1_ps(8.f), s, m);
      for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(xq.group_sum[r * groups + g]), acc[r]);
      for (int64_t b = g * per_group; b < (g + 1) * per_group; ++b) {
        __builtin_prefetch(wp + b * 4 * 32 + PREFETCH_BYTES);
        __builtin_prefetch(wp + b * 4 * 32 + PREFETCH_BYTES + 64);
        __m256i dot[R];
#if defined(FERRUM_INT16_SUMS)
        // plain AVX2: a row's 8 vpmaddubsw of the block summed in int16 (each lane pair at most
        // 2 * 15 * 127 = 3,810, 8 of them within 32,767), widened by one vpmaddwd: the same integers as
        // widening each, with 7 vpmaddwd and vpaddd fewer a part row and block (Zen 3, the demo model's 120
        // projections at 1 row: 0.905x the time, scripts/cpu_kernel_ab.py --gemv-rows 1, 12 passes)
        __m256i p[R][4];
        for (int c = 0; c < 4; ++c) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + (b * 4 + c) * 32));
          const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
          for (int r = 0; r < R; ++r) {
            const int8_t* a = xq.q.data() + r * K + b * QBLOCK;
            p[r][c] = _mm256_add_epi16(_mm256_maddubs_epi16(lo, broadcast4(a + 4 * c)),
                                       _mm256_maddubs_epi16(hi, broadcast4(a + 4 * (c + 4))));
          }
        }
        for (int r = 0; r < R; ++r)
          dot[r] = _mm256_madd_epi16(_mm256_add_epi16(_mm256_add_epi16(p[r][0], p[r][1]),
                                                      _mm256_add_epi16(p[r][2], p[r][3])),
                                     _mm256_set1_epi16(1));
#else
        for (int r = 0; r < R; ++r) dot[r] = _mm256_setzero_si256();
        for (int c = 0; c < 4; ++c) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + (b * 4 + c) * 32));
          const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
          for (int r = 0; r < R; ++r) {
            const int8_t* a = xq.q.data() + r * K + b * QBLOCK;
            dot[r] = dot_u8s8(dot[r], lo, broadcast4(a + 4 * c));
            dot[r] = dot_u8s8(dot[r], hi, broadcast4(a + 4 * (c + 4)));
          }
        }
#endif
        for (int r = 0; r < R; ++r)
          acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r]),
                                   _mm256_mul_ps(s, _mm256_set1_ps(xq.scale[r * blocks + b])), acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + r * N + rg * LANES, acc[r]);
#else
    for (int64_t lane = 0; lane < LANES; ++lane) {
      for (int r = 0; r < R; ++r) {
        const int8_t* a = xq.q.data() + r * K;
        float total = 0.f;
        for (int64_t b = 0; b < blocks; ++b) {
          const int64_t g = b / per_group;
          if (b % per_group == 0) {
            const float m = param(mp, g * LANES + lane) - (zero_point ? 8.f * param(sp, g * LANES + lane) : 0.f);
            total += m * xq.group_sum[r * groups + g];
          }
          int32_t dot = 0;
          for (int64_t c = 0; c < 4; ++c)
            for (int64_t j = 0; j < 4; ++j) {
              const uint8_t byte = wp[(b * 4 + c) * 32 + lane * 4 + j];
              dot += (byte & 0xF) * a[b * QBLOCK + 4 * c + j] + (byte >> 4) * a[b * QBLOCK + 4 * (c + 4) + j];
            }
          total += param(sp, g * LANES + lane) * xq.scale[r * blocks + b] * float(dot);
        }
        y[r * N + rg * LANES + lane] = total;
      }
    }
#endif
  }
}

#if defined(__AVX2__) && !(defined(__AVX512VNNI__) && defined(__AVX512VL__)) && !defined(__AVXVNNI__)
// Plain AVX2 (no VNNI), any number of part rows R (even: two per row of x): each weight block is unpacked
// once into its 8 nibble vectors, then every row takes it, two at a time. A row's 8 vpmaddubsw of a
// block are summed in int16, as a tree (each lane pair is at most 2 * 15 * 127 = 3,810, so 8 of them stay
// within 32,767), and widened by one vpmaddwd, as int4_groups does on plain AVX2. The int32 block sums are
// the same integers, and each row's float work is int4_groups' (the same fmas in the same order), so
// every row's output is the same bits as there. The rows' accumulators live in memory (R x 8 floats),
// so R is not bound by the 16 vector registers and a block's weights are read once for all of a
// prefill chunk's rows.
template <typename P>
void int4_groups_rows(const QuantizedX& xq, const uint8_t* packed, const P* scale, const P* minimum, bool zero_point,
                      int64_t group, float* y, int64_t N, int64_t g0, int64_t g1) {
  const int64_t K = xq.K, blocks = K / QBLOCK, groups = K / group, per_group = group / QBLOCK, R = xq.rows;
  std::vector<__m256> acc(R);
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  for (int64_t rg = g0; rg < g1; ++rg) {
    const uint8_t* wp = packed + rg * blocks * 4 * 32;
    const P* sp = scale + rg * groups * LANES;
    const P* mp = minimum + rg * groups * LANES;
    for (int64_t r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t g = b / per_group;
      const bool first = b % per_group == 0;  // the group's minimum meets x's sums before its first block
      const __m256 s = load8(sp + g * LANES);
      __m256 m = load8(mp + g * LANES);
      if (zero_point) m = _mm256_fnmadd_ps(_mm256_set1_ps(8.f), s, m);
      __builtin_prefetch(wp + b * 4 * 32 + PREFETCH_BYTES);
      __builtin_prefetch(wp + b * 4 * 32 + PREFETCH_BYTES + 64);
      __m256i lo[4], hi[4];
      for (int c = 0; c < 4; ++c) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + (b * 4 + c) * 32));
        lo[c] = _mm256_and_si256(v, low);
        hi[c] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
      }
      const int8_t* a = xq.q.data() + b * QBLOCK;
      for (int64_t r = 0; r < R; r += 2) {
        __m256i d[2];
        for (int i = 0; i < 2; ++i) {
          const int8_t* ai = a + (r + i) * K;
          __m256i p[4];
          for (int c = 0; c < 4; ++c)
            p[c] = _mm256_add_epi16(_mm256_maddubs_epi16(lo[c], broadcast4(ai + 4 * c)),
                                    _mm256_maddubs_epi16(hi[c], broadcast4(ai + 4 * (c + 4))));
          d[i] = _mm256_add_epi16(_mm256_add_epi16(p[0], p[1]), _mm256_add_epi16(p[2], p[3]));
        }
        for (int i = 0; i < 2; ++i) {
          __m256 sum = acc[r + i];
          if (first) sum = _mm256_fmadd_ps(m, _mm256_set1_ps(xq.group_sum[(r + i) * groups + g]), sum);
          acc[r + i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(d[i], ones)),
                                       _mm256_mul_ps(s, _mm256_set1_ps(xq.scale[(r + i) * blocks + b])), sum);
        }
      }
    }
    for (int64_t r = 0; r < R; ++r) _mm256_storeu_ps(y + r * N + rg * LANES, acc[r]);
  }
}
#define FERRUM_INT4_ROWS 1
#endif

template <int R>
void int8_groups(const QuantizedX& xq, const uint8_t* packed, const float* scale, int64_t group, float* y, int64_t N,
                 int64_t g0, int64_t g1) {
  const int64_t K = xq.K, blocks = K / QBLOCK, groups = group ? K / group : 1;
  const int64_t per_group = group ? group / QBLOCK : blocks;
  for (int64_t rg = g0; rg < g1; ++rg) {
    const uint8_t* wp = packed + rg * blocks * 8 * 32;
    const float* sp = scale + rg * groups * LANES;
#if defined(__AVX2__)
    __m256 total[R];
    for (int r = 0; r < R; ++r) total[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      __m256 acc[R];
      for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
      for (int64_t b = g * per_group; b < (g + 1) * per_group; ++b) {
        __m256i dot[R];
        for (int r = 0; r < R; ++r) dot[r] = _mm256_set1_epi32(-INT8_OFFSET * xq.q_sum[r * blocks + b]);
        for (int64_t line = 0; line < 8 * 32; line += 64) __builtin_prefetch(wp + b * 8 * 32 + PREFETCH_BYTES + line);
        for (int c = 0; c < 8; ++c) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + (b * 8 + c) * 32));
          for (int r = 0; r < R; ++r) dot[r] = dot_int8(dot[r], v, broadcast4(xq.q.data() + r * K + b * QBLOCK + 4 * c));
        }
        for (int r = 0; r < R; ++r)
          acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r]), _mm256_set1_ps(xq.scale[r * blocks + b]), acc[r]);
      }
      const __m256 s = load8(sp + g * LANES);
      for (int r = 0; r < R; ++r) total[r] = _mm256_fmadd_ps(acc[r], s, total[r]);
    }
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + r * N + rg * LANES, total[r]);
#else
    for (int64_t lane = 0; lane < LANES; ++lane) {
      for (int r = 0; r < R; ++r) {
        const int8_t* a = xq.q.data() + r * K;
        float total = 0.f;
        for (int64_t b = 0; b < blocks; ++b) {
          int32_t dot = 0;
          for (int64_t c = 0; c < 8; ++c)
            for (int64_t j = 0; j < 4; ++j)
              dot += (int32_t(wp[(b * 8 + c) * 32 + lane * 4 + j]) - 128) * a[b * QBLOCK + 4 * c + j];
          total += sp[(b / per_group) * LANES + lane] * xq.scale[r * blocks + b] * float(dot);
        }
        y[r * N + rg * LANES + lane] = total;
      }
    }
#endif
  }
}

template <typename Fn>
void over_row_groups(int64_t row_groups, int64_t K, Fn fn) {
  const int64_t grain = std::max<int64_t>(1, (1 << 14) / std::max<int64_t>(K, 1));
  at::parallel_for(0, row_groups, grain, fn);
}

// y [T, N] in x's dtype, computed `chunk` rows of x at a time: fn(xq, parts_out) fills the
// float rows of their parts, whose pairs are then added and rounded into y
template <typename Fn>
at::Tensor by_row_chunks(const at::Tensor& x_in, int64_t K, int64_t N, int64_t group, int64_t chunk, Fn fn) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == K, message("x must be [T, ", K, "]"));
  const at::Tensor x = x_in.contiguous();
  at::Tensor y = at::empty({x.size(0), N}, x.options());
  std::vector<float> scratch(PARTS * std::min(chunk, x.size(0)) * N);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "quant_gemv", [&] {
    for (int64_t t0 = 0; t0 < x.size(0); t0 += chunk) {
      const int64_t rows = std::min(chunk, x.size(0) - t0);
      const QuantizedX xq = quantize_x(x.data_ptr<scalar_t>() + t0 * K, rows, K, group);
      fn(xq, scratch.data());
      scalar_t* out = y.data_ptr<scalar_t>() + t0 * N;
      for (int64_t t = 0; t < rows; ++t) {
        const float* hi = scratch.data() + PARTS * t * N;
        const float* lo = hi + N;
        for (int64_t n = 0; n < N; ++n) out[t * N + n] = scalar_t(hi[n] + lo[n]);
      }
    }
  });
  return y;
}

#define FERRUM_BY_ROWS(rows, CALL) \
  switch (rows) {                  \
    case 1: CALL(1); break;        \
    case 2: CALL(2); break;        \
    case 3: CALL(3); break;        \
    case 4: CALL(4); break;        \
    case 5: CALL(5); break;        \
    case 6: CALL(6); break;        \
    case 7: CALL(7); break;        \
    case 8: CALL(8); break;        \
    case 9: CALL(9); break;        \
    default: CALL(10); break;      \
  }

}  // namespace

// x [T, K] -> x @ W^T [T, N] in x's dtype; N = 8 * packed.size(0)
at::Tensor int4_gemv(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale, const at::Tensor& minimum,
                     bool zero_point, int64_t group) {
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == 4 && packed.size(3) == 32 && packed.scalar_type() == at::kByte &&
                  packed.is_contiguous(),
              "int4_gemv: packed must be uint8 [N/8, K/32, 4, 32]");
  const int64_t row_groups = packed.size(0), K = packed.size(1) * QBLOCK, N = row_groups * LANES;
  TORCH_CHECK(group % QBLOCK == 0 && group > 0 && K % group == 0, message("int4_gemv: group ", group, " must be a multiple of 32 dividing ", K));
  TORCH_CHECK(scale.is_contiguous() && minimum.is_contiguous() && scale.scalar_type() == minimum.scalar_type() &&
                  (scale.scalar_type() == at::kFloat || scale.scalar_type() == at::kHalf) &&
                  scale.numel() == N * (K / group) && minimum.numel() == N * (K / group),
              "int4_gemv: scale and offset must be contiguous float32 or float16 [N/8, K/g, 8]");
#if defined(FERRUM_INT4_ROWS)
  const bool many = x.size(0) >= ROWS_FROM;
#else
  constexpr bool many = false;
#endif
  return by_row_chunks(x, K, N, group, many ? ROWS_CHUNK : MAX_ROWS / PARTS, [&](const QuantizedX& xq, float* out) {
    const uint8_t* w = packed.data_ptr<uint8_t>();
    over_row_groups(row_groups, K, [&](int64_t g0, int64_t g1) {
#if defined(FERRUM_INT4_ROWS)
      if (many) {
        if (scale.scalar_type() == at::kFloat)
          int4_groups_rows<float>(xq, w, scale.data_ptr<float>(), minimum.data_ptr<float>(), zero_point, group, out, N, g0, g1);
        else
          int4_groups_rows<c10::Half>(xq, w, scale.data_ptr<c10::Half>(), minimum.data_ptr<c10::Half>(), zero_point, group,
                                      out, N, g0, g1);
        return;
      }
#endif
      if (scale.scalar_type() == at::kFloat) {
        const float* s = scale.data_ptr<float>();
        const float* m = minimum.data_ptr<float>();
#define FERRUM_CALL(R) int4_groups<float, R>(xq, w, s, m, zero_point, group, out, N, g0, g1)
        FERRUM_BY_ROWS(xq.rows, FERRUM_CALL)
#undef FERRUM_CALL
      } else {
        const c10::Half* s = scale.data_ptr<c10::Half>();
        const c10::Half* m = minimum.data_ptr<c10::Half>();
#define FERRUM_CALL(R) int4_groups<c10::Half, R>(xq, w, s, m, zero_point, group, out, N, g0, g1)
        FERRUM_BY_ROWS(xq.rows, FERRUM_CALL)
#undef FERRUM_CALL
      }
    });
  });
}

int64_t int4_dense_rows() {
#if defined(FERRUM_INT4_ROWS)
  return 256;
#else
  return 32;
#endif
}

at::Tensor int8_gemv(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale, int64_t group) {
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == 8 && packed.size(3) == 32 && packed.scalar_type() == at::kByte &&
                  packed.is_contiguous(),
              "int8_gemv: packed must be uint8 [N/8, K/32, 8, 32]");
  const int64_t row_groups = packed.size(0), K = packed.size(1) * QBLOCK, N = row_groups * LANES;
  TORCH_CHECK(group == 0 || (group % QBLOCK == 0 && K % group == 0), message("int8_gemv: group ", group, " must be 0 or a multiple of 32 dividing ", K));
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() &&
                  scale.numel() == (group ? N * (K / group) : N),
              "int8_gemv: scale must be float32 [N/8, 8] or [N/8, K/g, 8]");
  return by_row_chunks(x, K, N, group, MAX_ROWS / PARTS, [&](const QuantizedX& xq, float* out) {
    const uint8_t* w = packed.data_ptr<uint8_t>();
    const float* s = scale.data_ptr<float>();
    over_row_groups(row_groups, K, [&](int64_t g0, int64_t g1) {
#define FERRUM_CALL(R) int8_groups<R>(xq, w, s, group, out, N, g0, g1)
      FERRUM_BY_ROWS(xq.rows, FERRUM_CALL)
#undef FERRUM_CALL
    });
  });
}

}  // namespace ferrum_cpu

namespace ferrum_cpu {

// The weight the repacked storage stands for, [N, K] in `dtype` (float32 or bfloat16): for products of
// many rows (prefill), which then take one dense matrix product.
// out[0..32) = (low, then high) * s + o, in the output's dtype (rounded as a scalar conversion would)
template <typename T>
inline void scaled_block(T* out, const float* low, const float* high, float s, float o) {
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>) {
    const F16 scale16 = splat(s), offset16 = splat(o);
    store16(out, add16(mul16(load16(low), scale16), offset16));  // q * s + o, rounded twice as before
    store16(out + 16, add16(mul16(load16(high), scale16), offset16));
  } else {
    for (int64_t i = 0; i < 16; ++i) {
      out[i] = T(low[i] * s + o);
      out[16 + i] = T(high[i] * s + o);
    }
  }
}

at::Tensor int4_dequantize(const at::Tensor& packed, const at::Tensor& scale, const at::Tensor& offset, bool zero_point,
                           int64_t group, at::ScalarType dtype) {
  const int64_t row_groups = packed.size(0), blocks = packed.size(1), K = blocks * QBLOCK, N = row_groups * LANES;
  const int64_t groups = K / group, per_group = group / QBLOCK;
  const at::Tensor s32 = scale.to(at::kFloat).contiguous(), o32 = offset.to(at::kFloat).contiguous();
  at::Tensor out = at::empty({N, K}, packed.options().dtype(dtype));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "int4_dequantize", [&] {
    const uint8_t* w = packed.data_ptr<uint8_t>();
    const float* sp = s32.data_ptr<float>();
    const float* op = o32.data_ptr<float>();
    scalar_t* dst = out.data_ptr<scalar_t>();
    // row by row, a block's 32 outputs at a time (16 bytes: its low nibbles are inputs 0-15, the high 16-31)
    at::parallel_for(0, row_groups, 1, [&](int64_t g0, int64_t g1) {
      alignas(64) float low[16], high[16];
      for (int64_t rg = g0; rg < g1; ++rg)
        for (int64_t lane = 0; lane < LANES; ++lane) {
          const int64_t row = rg * LANES + lane;
          for (int64_t b = 0; b < blocks; ++b) {
            const int64_t g = b / per_group;
            const float s = sp[(rg * groups + g) * LANES + lane];
            const float o = op[(rg * groups + g) * LANES + lane] - (zero_point ? 8.f * s : 0.f);
            for (int64_t c = 0; c < 4; ++c) {
              const uint8_t* bytes = w + ((rg * blocks + b) * 4 + c) * 32 + lane * 4;
              for (int64_t j = 0; j < 4; ++j) {
                low[4 * c + j] = float(bytes[j] & 0xF);
                high[4 * c + j] = float(bytes[j] >> 4);
              }
            }
            scaled_block(dst + row * K + b * QBLOCK, low, high, s, o);
          }
        }
    });
  });
  return out;
}

at::Tensor int8_dequantize(const at::Tensor& packed, const at::Tensor& scale, int64_t group, at::ScalarType dtype) {
  const int64_t row_groups = packed.size(0), blocks = packed.size(1), K = blocks * QBLOCK, N = row_groups * LANES;
  const int64_t groups = group ? K / group : 1, per_group = group ? group / QBLOCK : blocks;
  at::Tensor out = at::empty({N, K}, packed.options().dtype(dtype));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "int8_dequantize", [&] {
    const uint8_t* w = packed.data_ptr<uint8_t>();
    const float* sp = scale.data_ptr<float>();
    scalar_t* dst = out.data_ptr<scalar_t>();
    at::parallel_for(0, row_groups, 1, [&](int64_t g0, int64_t g1) {
      for (int64_t rg = g0; rg < g1; ++rg)
        for (int64_t b = 0; b < blocks; ++b)
          for (int64_t c = 0; c < 8; ++c)
            for (int64_t lane = 0; lane < LANES; ++lane) {
              const float s = sp[(rg * groups + b / per_group) * LANES + lane];
              const uint8_t* bytes = w + ((rg * blocks + b) * 8 + c) * 32 + lane * 4;
              scalar_t* row = dst + (rg * LANES + lane) * K + b * QBLOCK + 4 * c;
              for (int64_t j = 0; j < 4; ++j) row[j] = scalar_t(float(int32_t(bytes[j]) - 128) * s);
            }
    });
  });
  return out;
}

}  // namespace ferrum_cpu
