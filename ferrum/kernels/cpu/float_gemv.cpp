// x [T, K] (float32, bfloat16 or float16) times int8 weights [N, K] with a float32 scale per group of
// `group` inputs (w = q * scale), in float32 throughout: the activations are not quantized, so the
// only error is the weights' own. For the LM head, whose logits are wanted in float32 and whose
// near-ties an int8-rounded input can flip. Each weight row is read once for up to 4 rows of x.

#include "common.h"
#include "simd.h"

namespace ferrum_cpu {
namespace {

constexpr int64_t PREFETCH_ROWS = 4;

template <int R>
void rows_times_weight(const float* x, const int8_t* w, const float* scale, float* y, int64_t N, int64_t K,
                       int64_t group, int64_t n0, int64_t n1) {
  const int64_t groups = K / group, steps = group / 16;
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* row = w + n * K;
    // the rows PREFETCH_ROWS ahead: one stream, whose loads the multiply-adds would not overlap otherwise
    for (int64_t line = 0; line < K; line += 64) __builtin_prefetch(row + PREFETCH_ROWS * K + line);
    F16 acc[R];
    for (int t = 0; t < R; ++t) acc[t] = zero16();
    for (int64_t g = 0; g < groups; ++g) {
      F16 part[R];
      for (int t = 0; t < R; ++t) part[t] = zero16();
      for (int64_t s = 0; s < steps; ++s) {
        const int64_t k = g * group + 16 * s;
        const F16 wv = load16(row + k);
        for (int t = 0; t < R; ++t) part[t] = fma16(wv, load16(x + t * K + k), part[t]);
      }
      const F16 sc = splat(scale[n * groups + g]);
      for (int t = 0; t < R; ++t) acc[t] = fma16(part[t], sc, acc[t]);
    }
    for (int t = 0; t < R; ++t) y[t * N + n] = hsum16(acc[t]);
  }
}

}  // namespace

at::Tensor int8_float_gemv(const at::Tensor& x_in, const at::Tensor& weight, const at::Tensor& scale, int64_t group) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kChar && weight.is_contiguous(),
              "int8_float_gemv: weight must be contiguous int8 [N, K]");
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(group > 0 && group % 16 == 0 && K % group == 0, message("int8_float_gemv: group ", group, " must be a multiple of 16 dividing ", K));
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == N * (K / group),
              "int8_float_gemv: scale must be contiguous float32 [N, K / group]");
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == K, message("int8_float_gemv: x must be [T, ", K, "]"));
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  const int64_t T = x.size(0);
  at::Tensor y = at::empty({T, N}, x.options());
  const int8_t* w = weight.data_ptr<int8_t>();
  const float* s = scale.data_ptr<float>();
  for (int64_t t0 = 0; t0 < T; t0 += 4) {
    const int64_t rows = std::min<int64_t>(4, T - t0);
    const float* xt = x.data_ptr<float>() + t0 * K;
    float* yt = y.data_ptr<float>() + t0 * N;
    at::parallel_for(0, N, 256, [&](int64_t n0, int64_t n1) {
      switch (rows) {
        case 1: rows_times_weight<1>(xt, w, s, yt, N, K, group, n0, n1); break;
        case 2: rows_times_weight<2>(xt, w, s, yt, N, K, group, n0, n1); break;
        case 3: rows_times_weight<3>(xt, w, s, yt, N, K, group, n0, n1); break;
        default: rows_times_weight<4>(xt, w, s, yt, N, K, group, n0, n1); break;
      }
    });
  }
  return y;
}

}  // namespace ferrum_cpu
