// RoPE and the K/V cache write in one call, bf16 (docs/history/benchmarks.md, "RoPE and the cache write"): in torch
// they are ~20 small ops a layer (slices, a split, a negation, a concatenation, products, sums,
// transposes, two cache copies), each a call of its own. Same rounding steps as torch's bf16 ops (each
// product and the sum rounded to bf16), so the bits are torch's. Rows are independent.
#include "dspark.h"
#include "simd.h"
#include <c10/util/BFloat16.h>
#include <algorithm>
#include <cstring>

namespace rope {

using namespace simd;
using bf16 = c10::BFloat16;  // its float conversion rounds to nearest even, as torch's casts do

inline float rb(float f) { return static_cast<float>(bf16(f)); }  // rounded to bf16, back to fp32

// out[i] = x[i] * cos[i] + rotate_half(x)[i] * sin[i], rotate_half(x) = (-x2, x1), D = 2 * half.
// 8 lanes at a time where half is a multiple of 8 (csrc/simd.h's F8: the
// same products, roundings and sum; one value at a time was a visible share of a step on the AVX2
// build), else one value at a time
inline void rotate(const bf16* x, const bf16* c, const bf16* s, bf16* out, int64_t D) {
  const int64_t h = D / 2;
  if (h % 8 == 0) {
    for (int64_t i = 0; i < D; i += 8) {
      const F8 r = i < h ? neg8(load_bf16(x + i + h)) : load_bf16(x + i - h);
      const F8 a = round_bf16(mul8(load_bf16(x + i), load_bf16(c + i)));
      const F8 b = round_bf16(mul8(r, load_bf16(s + i)));
      store_bf16(out + i, add8(a, b));
    }
    return;
  }
  for (int64_t i = 0; i < D; ++i) {
    const float r = i < h ? -static_cast<float>(x[i + h]) : static_cast<float>(x[i - h]);
    out[i] = bf16(rb(x[i] * c[i]) + rb(r * s[i]));
  }
}

}  // namespace rope

// qk [B, S, Hq + Hkv, D] and v [B, S, Hkv, D] bf16 (last dim contiguous), cos / sin [P, D] bf16
// tables, kc / vc [B, Hkv, C, D] caches, pos [B, S] int64. Rotates queries and keys at their
// positions, writes keys and values at cache[b, :, pos[b, s]] -> rotated queries [B, S, Hq, D].
// v empty: qk is the whole q/k/v projection [B, S, Hq + 2 Hkv, D], values in its last Hkv heads
// (no slices to make in Python; Hkv from the cache).
torch::Tensor rope_cache_bf16(torch::Tensor qk, torch::Tensor v, torch::Tensor cos, torch::Tensor sin, torch::Tensor kc,
                              torch::Tensor vc, torch::Tensor pos) {
  using namespace rope;
  for (const auto* t : {&qk, &v, &cos, &sin, &kc, &vc})
    TORCH_CHECK(t->scalar_type() == torch::kBFloat16 && t->stride(-1) == 1,
                "rope_cache_bf16: bf16 tensors with a contiguous last dim");
  const bool packed = v.numel() == 0;
  TORCH_CHECK(qk.dim() == 4 && kc.dim() == 4 && (packed || v.dim() == 4),
              "rope_cache_bf16: qk, v and the caches must be 4-D");
  const int64_t B = qk.size(0), S = qk.size(1), D = qk.size(3), Hkv = packed ? kc.size(1) : v.size(2),
                Hq = qk.size(2) - (packed ? 2 : 1) * Hkv, C = kc.size(2);
  const torch::Tensor& vt = packed ? qk : v;
  const int64_t v0 = packed ? Hq + Hkv : 0;  // the first value head in vt
  TORCH_CHECK(D % 2 == 0 && Hq >= 0 && vt.size(3) == D && cos.size(1) == D && sin.sizes() == cos.sizes() &&
                  kc.sizes() == vc.sizes() && kc.size(0) == B && kc.size(1) == Hkv && kc.size(3) == D,
              "rope_cache_bf16: shapes disagree");
  TORCH_CHECK(pos.dim() == 2 && pos.size(0) == B && pos.size(1) == S && pos.scalar_type() == torch::kLong,
              "rope_cache_bf16: pos must be [B, S] int64");
  auto pc = pos.contiguous();
  const int64_t* pp = pc.data_ptr<int64_t>();
  for (int64_t i = 0; i < B * S; ++i)
    TORCH_CHECK(pp[i] >= 0 && pp[i] < C, "rope_cache_bf16: position ", pp[i], " outside the cache of ", C);
  auto q = torch::empty({B, S, Hq, D}, qk.options());
  const bf16 *qkp = qk.data_ptr<at::BFloat16>(), *vp = vt.data_ptr<at::BFloat16>(), *cp = cos.data_ptr<at::BFloat16>(),
             *sp = sin.data_ptr<at::BFloat16>();
  bf16 *qo = q.data_ptr<at::BFloat16>(), *kp = kc.data_ptr<at::BFloat16>(), *vcp = vc.data_ptr<at::BFloat16>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t s = 0; s < S; ++s) {
      const int64_t p = pp[b * S + s];
      const int64_t pt = std::min<int64_t>(p, cos.size(0) - 1);  // padding may run past the table: never read
      const bf16 *c = cp + pt * cos.stride(0), *sn = sp + pt * sin.stride(0);
      for (int64_t h = 0; h < Hq; ++h)
        rotate(qkp + b * qk.stride(0) + s * qk.stride(1) + h * qk.stride(2), c, sn, qo + ((b * S + s) * Hq + h) * D, D);
      for (int64_t h = 0; h < Hkv; ++h) {
        const int64_t dst = b * kc.stride(0) + h * kc.stride(1) + p * kc.stride(2);
        rotate(qkp + b * qk.stride(0) + s * qk.stride(1) + (Hq + h) * qk.stride(2), c, sn, kp + dst, D);
        std::memcpy(vcp + b * vc.stride(0) + h * vc.stride(1) + p * vc.stride(2),
                    vp + b * vt.stride(0) + s * vt.stride(1) + (v0 + h) * vt.stride(2), D * sizeof(bf16));
      }
    }
  return q;
}
