// Fused RMSNorm for bf16 activations (docs/history/benchmarks.md, "the rest of a forward in the same extension"): torch
// runs each of a forward's norms as several passes (a cast, the fused norm's own reductions and copies, a cast back,
// the weight). Same rounding steps as the HF modules: normalise in fp32, round to bf16,
// multiply by the bf16 weight, round. Rows are independent, so a row's result does not depend on the batch.
#include "dspark.h"
#include "simd.h"
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <algorithm>
#include <cmath>

namespace {

using namespace simd;
using bf16 = c10::BFloat16;  // its float conversion rounds to nearest even, as torch's casts do

inline float rb(float f) { return static_cast<float>(bf16(f)); }  // rounded to bf16, back to fp32

// rows split between threads in blocks of at least VALUES values (4 rows of SmolLM2's 576): a
// decode step's one row, or a step's q/k norms over 64-value heads, run inline; a verify block's
// or a batch's 8 rows of 576 on both cores (on one, add + norm were a visible share of an 8-row
// SmolLM2 forward; docs/history/benchmarks.md, "weights asked for ahead of the tile ...": norms split rows)
constexpr int64_t VALUES = 4 * 576;
inline int64_t row_grain(int64_t H) { return std::max<int64_t>(1, VALUES / H); }

// w holds `heads` rows of H weights: row r of x is scaled by weight row (first + r) % heads (1:
// one weight for every row; Qwen3's q/k norms: one per head). 8 lanes at a time (simd.h's F8:
// the rounding of torch's casts), the rest of a row one by one with the same steps.
void norm_rows(const bf16* x, const bf16* w0, bf16* y, int64_t R, int64_t H, float eps, int64_t heads = 1,
               int64_t first = 0) {
  for (int64_t r = 0; r < R; ++r) {
    const bf16* xr = x + r * H;
    const bf16* w = w0 + ((first + r) % heads) * H;
    bf16* yr = y + r * H;
    // 16 partial sums in a fixed order, the same for every row
    F8 a0 = zero8(), a1 = zero8();
    int64_t i = 0;
    for (; i + 16 <= H; i += 16) {
      const F8 v0 = load_bf16(xr + i), v1 = load_bf16(xr + i + 8);
      a0 = fma8(v0, v0, a0);
      a1 = fma8(v1, v1, a1);
    }
    float ss[16];
    store8(ss, a0);
    store8(ss + 8, a1);
    for (; i < H; ++i) {
      const float v = xr[i];
      ss[0] = std::fma(v, v, ss[0]);
    }
    float s = 0.f;
    for (int j = 0; j < 16; ++j) s += ss[j];
    const float inv = 1.0f / std::sqrt(s / static_cast<float>(H) + eps);
    const F8 iv = set8(inv);
    int64_t k = 0;
    for (; k + 8 <= H; k += 8) {
      const F8 t = round_bf16(mul8(load_bf16(xr + k), iv));  // rounded to bf16 first, as torch
      store_bf16(yr + k, mul8(t, load_bf16(w + k)));
    }
    for (; k < H; ++k) yr[k] = bf16(rb(xr[k] * inv) * static_cast<float>(w[k]));
  }
}

// s = x + r rounded to bf16, n elements
void add_bf16(const bf16* x, const bf16* r, bf16* s, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) store_bf16(s + i, add8(load_bf16(x + i), load_bf16(r + i)));
  for (; i < n; ++i) s[i] = bf16(static_cast<float>(x[i]) + static_cast<float>(r[i]));
}

void check(const torch::Tensor& x, const torch::Tensor& w) {
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && w.scalar_type() == torch::kBFloat16 && x.device().is_cpu(),
              "rms_bf16: x and w must be bf16 CPU tensors");
  TORCH_CHECK((w.dim() == 1 && x.size(-1) == w.size(0)) ||
                  (w.dim() == 2 && x.dim() >= 2 && x.size(-2) == w.size(0) && x.size(-1) == w.size(1)),
              "rms_bf16: w must be [H] with x [..., H], or [heads, H] with x [..., heads, H]; got w ", w.sizes(),
              " and x ", x.sizes());
}

}  // namespace

// y = w * rms_norm(x) over the last dimension; w [H], or [heads, H] (a weight per head)
torch::Tensor rms_bf16(torch::Tensor x, torch::Tensor w, double eps) {
  check(x, w);
  auto xc = x.contiguous(), wc = w.contiguous();
  auto y = torch::empty_like(xc);
  const int64_t H = w.size(-1), R = xc.numel() / H, heads = w.dim() == 2 ? w.size(0) : 1;
  const bf16 *xp = xc.data_ptr<at::BFloat16>(), *wp = wc.data_ptr<at::BFloat16>();
  bf16* yp = y.data_ptr<at::BFloat16>();
  at::parallel_for(0, R, row_grain(H), [&](int64_t r0, int64_t r1) {
    norm_rows(xp + r0 * H, wp, yp + r0 * H, r1 - r0, H, static_cast<float>(eps), heads, r0);
  });
  return y;
}

// (s, w * rms_norm(s)) with s = x + r rounded to bf16 (torch's bf16 add): the residual add and
// the next norm in one call. taps: an empty tensor, or a contiguous [..., n*H] buffer with x's
// rows that also receives s in columns col..col+H (a hidden-state tap written where the draft
// reads it: no copy of the residual stream and no concatenation of the taps after the forward)
std::vector<torch::Tensor> add_rms_bf16(torch::Tensor x, torch::Tensor r, torch::Tensor w, double eps,
                                        torch::Tensor taps, int64_t col) {
  check(x, w);
  TORCH_CHECK(w.dim() == 1, "add_rms_bf16: one weight row for every row of x");
  TORCH_CHECK(r.sizes() == x.sizes() && r.scalar_type() == torch::kBFloat16, "add_rms_bf16: the residual must match x");
  auto xc = x.contiguous(), rc = r.contiguous(), wc = w.contiguous();
  auto s = torch::empty_like(xc), y = torch::empty_like(xc);
  const bf16 *xp = xc.data_ptr<at::BFloat16>(), *rp = rc.data_ptr<at::BFloat16>();
  bf16* sp = s.data_ptr<at::BFloat16>();
  const int64_t H = w.size(0), R = xc.numel() / H;
  bf16* tp = nullptr;
  int64_t F = 0;
  if (taps.numel() > 0) {
    TORCH_CHECK(taps.scalar_type() == torch::kBFloat16 && taps.is_contiguous() && taps.dim() == x.dim() &&
                    taps.sizes().slice(0, x.dim() - 1) == x.sizes().slice(0, x.dim() - 1),
                "add_rms_bf16: taps must be a contiguous bf16 buffer with x's rows, got ", taps.sizes(), " for x ",
                x.sizes());
    F = taps.size(-1);
    TORCH_CHECK(col >= 0 && col + H <= F, "add_rms_bf16: tap columns ", col, "..", col + H, " outside the buffer's ",
                F);
    tp = taps.data_ptr<at::BFloat16>() + col;
  }
  const bf16* wp = wc.data_ptr<at::BFloat16>();
  bf16* yp = y.data_ptr<at::BFloat16>();
  at::parallel_for(0, R, row_grain(H), [&](int64_t r0, int64_t r1) {
    add_bf16(xp + r0 * H, rp + r0 * H, sp + r0 * H, (r1 - r0) * H);
    if (tp != nullptr)
      for (int64_t i = r0; i < r1; ++i) std::copy(sp + i * H, sp + (i + 1) * H, tp + i * F);
    norm_rows(sp + r0 * H, wp, yp + r0 * H, r1 - r0, H, static_cast<float>(eps));
  });
  return {s, y};
}
