// int4 quantization on load, on the CPU: each group's scale and low end fitted from the weight alone,
// then its values rounded against the stored scale and zero. The algorithm is
// ferrum.weights.quantization.arith._fit_int4's (its docstring says why each step is there), computed a
// group at a time in float32, in one pass over the weight: torch's version makes a dozen float32
// temporaries of the weight's size per start and round, and took 6.5 s of the demo model's 7 s load
// on 2 cores. Sums run in a different order than torch's, so a value that falls within a rounding of
// a tie between two levels may land on the other one.
//
//   in:  weight [N, K] (float32, bfloat16 or float16), K a multiple of `group`
//   out: qweight uint8 [N, K/2] (input 2j in byte j's low nibble, 2j + 1 in its high one, values 0..15),
//        scale and zero [N, K/group] in `params`: w = (q - 8) * scale + zero (symmetric: zero 0)

#include "common.h"

namespace ferrum_cpu {
namespace {

constexpr float TINY = 1e-10f;
constexpr float STARTS[] = {15.f, 16.f, 17.f};  // a group's range over 15 + r steps (arith._INT4_STARTS)
constexpr int ROUNDS = 3;                        // arith._INT4_ROUNDS

constexpr int64_t LANES = 16;  // groups fitted side by side, a lane each (no sums across a vector)

inline float level(float v) { return std::min(std::max(std::nearbyint(v), 0.f), 15.f); }

// The fit of LANES groups at once. x [g][LANES]: input i of each group; imp, weighted: scratch of the
// same shape. Out: each group's scale and lo.
void fit_groups(const float* x, float* imp, float* weighted, int64_t g, bool symmetric, float* scale_out,
                float* lo_out) {
  alignas(64) float sum[LANES], squares[LANES], lo0[LANES], hi0[LANES], mean[LANES], span[LANES], total[LANES];
  alignas(64) float scale[LANES], lo[LANES], inv[LANES], offset[LANES], q_sum[LANES], q_mean[LANES];
  alignas(64) float spread[LANES], cross[LANES], best_err[LANES];
#pragma omp simd
  for (int64_t l = 0; l < LANES; ++l) {
    sum[l] = squares[l] = total[l] = 0.f;
    lo0[l] = hi0[l] = x[l];
  }
  for (int64_t i = 0; i < g; ++i)
#pragma omp simd
    for (int64_t l = 0; l < LANES; ++l) {
      const float v = x[i * LANES + l];
      sum[l] += v;
      squares[l] += v * v;
      lo0[l] = std::min(lo0[l], v);
      hi0[l] = std::max(hi0[l], v);
    }
  const float count = float(g);
  alignas(64) float rms[LANES];
#pragma omp simd
  for (int64_t l = 0; l < LANES; ++l) {
    mean[l] = sum[l] / count;
    rms[l] = std::sqrt(squares[l] / count);
    span[l] = symmetric ? std::max(lo0[l] / -8.f, hi0[l] / 7.f) * 15.f : hi0[l] - lo0[l];
  }
  for (int64_t i = 0; i < g; ++i)
#pragma omp simd
    for (int64_t l = 0; l < LANES; ++l) {  // total: the weighted squared error of scale 0
      const float v = x[i * LANES + l], centred = symmetric ? v : v - mean[l];
      imp[i * LANES + l] = rms[l] + std::fabs(v);
      weighted[i * LANES + l] = imp[i * LANES + l] * centred;
      total[l] += weighted[i * LANES + l] * centred;
    }
  bool have = false;
  for (const float steps : STARTS) {
#pragma omp simd
    for (int64_t l = 0; l < LANES; ++l) {
      scale[l] = std::max(span[l] / steps, TINY);
      lo[l] = symmetric ? -8.f * scale[l] : (hi0[l] + lo0[l]) / 2.f - 7.5f * scale[l];
    }
    for (int round = 0; round < ROUNDS; ++round) {
#pragma omp simd
      for (int64_t l = 0; l < LANES; ++l) {
        inv[l] = 1.f / scale[l];
        offset[l] = -lo[l] / scale[l];
        q_sum[l] = spread[l] = cross[l] = 0.f;
      }
      if (!symmetric) {
        for (int64_t i = 0; i < g; ++i)
#pragma omp simd
          for (int64_t l = 0; l < LANES; ++l) q_sum[l] += level(offset[l] + x[i * LANES + l] * inv[l]);
      }
#pragma omp simd
      for (int64_t l = 0; l < LANES; ++l) q_mean[l] = symmetric ? 8.f : q_sum[l] / count;
      for (int64_t i = 0; i < g; ++i)
#pragma omp simd
        for (int64_t l = 0; l < LANES; ++l) {
          const float dev = level(offset[l] + x[i * LANES + l] * inv[l]) - q_mean[l];
          spread[l] += dev * imp[i * LANES + l] * dev;
          cross[l] += dev * weighted[i * LANES + l];
        }
#pragma omp simd
      for (int64_t l = 0; l < LANES; ++l) {
        if (cross[l] > 0.f) scale[l] = cross[l] / std::max(spread[l], TINY);
        lo[l] = symmetric ? -8.f * scale[l] : mean[l] - scale[l] * q_mean[l];
        const float err = std::max(total[l] - std::max(cross[l], 0.f) * scale[l], 0.f);
        if (!have || err < best_err[l]) {  // the first (start, round) of least error
          scale_out[l] = scale[l];
          lo_out[l] = lo[l];
          best_err[l] = err;
        }
      }
      have = true;
    }
  }
  if (!symmetric) {  // the mean error of the final rounding to 0
    alignas(64) float residual[LANES] = {};
    for (int64_t i = 0; i < g; ++i)
#pragma omp simd
      for (int64_t l = 0; l < LANES; ++l) {
        const float v = x[i * LANES + l];
        residual[l] += v - (lo_out[l] + level((v - lo_out[l]) / scale_out[l]) * scale_out[l]);
      }
#pragma omp simd
    for (int64_t l = 0; l < LANES; ++l) lo_out[l] += residual[l] / count;
  }
}

// a scale as `params` stores it: at least the dtype's smallest normal, never rounded to 0
template <typename P>
inline float stored_scale(float v) {
  return std::max(rounded<P>(v), static_cast<float>(std::numeric_limits<P>::min()));
}

// w: `total` groups of g inputs, one after another (a row's groups, then the next row's)
template <typename T, typename P>
void fit_all(const T* w, uint8_t* packed, P* scales, P* zeros, int64_t total, int64_t g, bool symmetric) {
  const int64_t chunks = (total + LANES - 1) / LANES;
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    std::vector<float> scratch(3 * g * LANES);
    float *x = scratch.data(), *imp = x + g * LANES, *weighted = imp + g * LANES;
    alignas(64) float scale[LANES], lo[LANES];
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t first = c * LANES, n = std::min(LANES, total - first);
      for (int64_t l = 0; l < LANES; ++l) {  // a last chunk's missing lanes repeat its last group
        const T* src = w + (first + std::min(l, n - 1)) * g;
        for (int64_t i = 0; i < g; ++i) x[i * LANES + l] = to_float(src[i]);
      }
      fit_groups(x, imp, weighted, g, symmetric, scale, lo);
      for (int64_t l = 0; l < n; ++l) {
        const float s = stored_scale<P>(scale[l]);
        const float zero = symmetric ? 0.f : rounded<P>(lo[l] + 8.f * scale[l]);
        scales[first + l] = P(s);
        zeros[first + l] = P(zero);
        uint8_t* dst = packed + (first + l) * g / 2;
#pragma omp simd
        for (int64_t i = 0; i < g; i += 2) {
          const float a = std::min(std::max(std::nearbyint((x[i * LANES + l] - zero) / s) + 8.f, 0.f), 15.f);
          const float b = std::min(std::max(std::nearbyint((x[(i + 1) * LANES + l] - zero) / s) + 8.f, 0.f), 15.f);
          dst[i / 2] = uint8_t(a) | uint8_t(uint8_t(b) << 4);
        }
      }
    }
  });
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> int4_fit(const at::Tensor& weight, int64_t group, bool symmetric,
                                                        at::ScalarType params) {
  TORCH_CHECK(weight.dim() == 2 && weight.is_floating_point(), "int4_fit: the weight must be a floating [N, K] tensor");
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(group >= 2 && group % 2 == 0 && K % group == 0,
              message("int4_fit: K (", K, ") must be a multiple of the group (", group, "), an even number"));
  TORCH_CHECK(params == at::kFloat || params == at::kBFloat16 || params == at::kHalf,
              "int4_fit: params must be float32, bfloat16 or float16");
  const at::Tensor w = weight.contiguous();
  at::Tensor packed = at::empty({N, K / 2}, w.options().dtype(at::kByte));
  at::Tensor scale = at::empty({N, K / group}, w.options().dtype(params));
  at::Tensor zero = at::empty({N, K / group}, w.options().dtype(params));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, w.scalar_type(), "int4_fit", [&] {
    using T = scalar_t;
    const T* src = w.data_ptr<T>();
    uint8_t* dst = packed.data_ptr<uint8_t>();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, params, "int4_fit_params", [&] {
      fit_all<T, scalar_t>(src, dst, scale.data_ptr<scalar_t>(), zero.data_ptr<scalar_t>(), N * (K / group), group,
                           symmetric);
    });
  });
  return {packed, scale, zero};
}

}  // namespace ferrum_cpu
