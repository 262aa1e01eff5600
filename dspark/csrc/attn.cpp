// Attention of a few new queries over the KV cache, bf16 (docs/BENCHMARKS.md, "Session 10").
// torch's flash-attention kernel costs 45-90 us a layer for 1-8 queries over ~200 cached keys,
// mostly set-up; this does the arithmetic directly. Each query row (batch row, position, head)
// is computed on its own, over its keys 0..pos in a fixed order, so its result does not depend
// on which other rows or positions share the call: a verify of 8 positions gives each position
// exactly what a 1-token step would (lossless greedy verification in bf16).
// Built for AVX-512 (16 lanes) or AVX2 + FMA (8 lanes); the algorithm is the same.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cmath>
#include <cstring>
#include <vector>

namespace attn {

#if defined(__AVX512F__)
constexpr int W = 16;
using V = __m512;
inline V zero() { return _mm512_setzero_ps(); }
inline V set1(float f) { return _mm512_set1_ps(f); }
inline V add(V a, V b) { return _mm512_add_ps(a, b); }
inline V sub(V a, V b) { return _mm512_sub_ps(a, b); }
inline V mul(V a, V b) { return _mm512_mul_ps(a, b); }
inline V vmax(V a, V b) { return _mm512_max_ps(a, b); }
inline V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
inline float sum(V a) { return _mm512_reduce_add_ps(a); }
inline V load_bf16(const at::BFloat16* p) {  // W bf16 -> fp32 (exact)
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline V load_n(const float* p, int n) { return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1), p); }
inline V round_int(V x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline V neg_abs(V x) { return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(x), _mm512_set1_epi32(INT32_MIN))); }
inline V div(V a, V b) { return _mm512_div_ps(a, b); }
inline V where_neg(V x, V a, V b) { return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, zero(), _CMP_LT_OQ), b, a); }  // x < 0 ? a : b
inline V pow2(V p, V n) { return _mm512_scalef_ps(p, n); }  // p * 2^n
inline __m256i to_bf16_bits(V x) {  // round to nearest even, as torch's float -> bfloat16 (finite x)
  const __m512i u = _mm512_castps_si512(x);
  const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}
inline void store_bf16(at::BFloat16* p, V x) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16_bits(x)); }
#else
constexpr int W = 8;
using V = __m256;
inline V zero() { return _mm256_setzero_ps(); }
inline V set1(float f) { return _mm256_set1_ps(f); }
inline V add(V a, V b) { return _mm256_add_ps(a, b); }
inline V sub(V a, V b) { return _mm256_sub_ps(a, b); }
inline V mul(V a, V b) { return _mm256_mul_ps(a, b); }
inline V vmax(V a, V b) { return _mm256_max_ps(a, b); }
inline V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
inline float sum(V a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline V load_bf16(const at::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline V load_n(const float* p, int n) {
  alignas(32) float buf[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int i = 0; i < n; ++i) buf[i] = p[i];
  return _mm256_load_ps(buf);
}
inline V round_int(V x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline V neg_abs(V x) { return _mm256_or_ps(x, _mm256_set1_ps(-0.0f)); }
inline V div(V a, V b) { return _mm256_div_ps(a, b); }
inline V where_neg(V x, V a, V b) { return _mm256_blendv_ps(b, a, _mm256_cmp_ps(x, zero(), _CMP_LT_OQ)); }  // x < 0 ? a : b
inline V pow2(V p, V n) {  // n in [-126, 0] here
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
inline void store_bf16(at::BFloat16* p, V x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF),
                    _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1)))), 16);
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}
#endif

// exp(x) for x <= 0: 2^n e^r with |r| <= ln2/2, degree-6 polynomial (~1 ulp of fp32)
inline V exp_neg(V x) {
  x = vmax(x, set1(-87.0f));
  const V n = round_int(mul(x, set1(1.44269504088896341f)));
  V r = sub(x, mul(n, set1(0.693145751953125f)));
  r = sub(r, mul(n, set1(1.428606765330187e-06f)));
  V p = set1(1.0f / 720);
  p = fma(p, r, set1(1.0f / 120));
  p = fma(p, r, set1(1.0f / 24));
  p = fma(p, r, set1(1.0f / 6));
  p = fma(p, r, set1(0.5f));
  p = fma(p, r, set1(1.0f));
  p = fma(p, r, set1(1.0f));
  return pow2(p, n);
}

}  // namespace attn

// q [B, S, Hq, D] bf16 (any strides), k / v [B, Hkv, C, D] bf16 (last dim contiguous), pos [B, S]
// int64: query (b, s) sees keys 0..pos[b, s]. -> o [B, S, Hq * D] bf16 (the layout o_proj reads)
torch::Tensor attn_bf16(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor pos, double scale) {
  using namespace attn;
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && q.scalar_type() == torch::kBFloat16 &&
              k.scalar_type() == torch::kBFloat16 && v.scalar_type() == torch::kBFloat16, "attn_bf16: q, k, v must be 4-D bf16");
  const int64_t B = q.size(0), S = q.size(1), Hq = q.size(2), D = q.size(3), Hkv = k.size(1), C = k.size(2);
  TORCH_CHECK(D % 16 == 0 && k.size(3) == D && v.sizes() == k.sizes() && k.size(0) == B && Hq % Hkv == 0,
              "attn_bf16: head sizes must agree and be a multiple of 16");
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1 && k.stride(2) == D && v.stride(2) == D, "attn_bf16: cache rows must be contiguous");
  TORCH_CHECK(pos.dim() == 2 && pos.size(0) == B && pos.size(1) == S && pos.scalar_type() == torch::kLong, "attn_bf16: pos must be [B, S] int64");
  auto qc = q.contiguous();
  auto pc = pos.contiguous();
  const int64_t* pp = pc.data_ptr<int64_t>();
  for (int64_t i = 0; i < B * S; ++i) TORCH_CHECK(pp[i] >= 0 && pp[i] < C, "attn_bf16: position ", pp[i], " outside the cache of ", C);
  auto o = torch::empty({B, S, Hq * D}, q.options());
  const at::BFloat16* qp = qc.data_ptr<at::BFloat16>();
  const at::BFloat16* kp = k.data_ptr<at::BFloat16>();
  const at::BFloat16* vp = v.data_ptr<at::BFloat16>();
  at::BFloat16* op = o.data_ptr<at::BFloat16>();
  const int64_t G = Hq / Hkv, ks0 = k.stride(0), ks1 = k.stride(1), vs0 = v.stride(0), vs1 = v.stride(1), DW = D / W;
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, B * S * Hq, 1, [&](int64_t r0, int64_t r1) {
    std::vector<float> score;
    std::vector<V> qv(DW), acc(DW);
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t b = r / (S * Hq), s = (r / Hq) % S, hq = r % Hq, h = hq / G, n = pp[b * S + s] + 1;
      const at::BFloat16* qr = qp + r * D;
      for (int64_t c = 0; c < DW; ++c) qv[c] = mul(load_bf16(qr + W * c), set1(sc));
      score.resize(((n + W - 1) / W) * W);
      const at::BFloat16* kb = kp + b * ks0 + h * ks1;
      float m = -INFINITY;
      for (int64_t j = 0; j < n; ++j) {
        V a = mul(qv[0], load_bf16(kb + j * D));
        for (int64_t c = 1; c < DW; ++c) a = fma(qv[c], load_bf16(kb + j * D + W * c), a);
        score[j] = sum(a);
        m = std::max(m, score[j]);
      }
      // softmax weights, W keys a vector (the last one padded with zeros): the same chunks for the same n
      V lsum = zero();
      const V mv = set1(m);
      for (int64_t j = 0; j < n; j += W) {
        const int live = static_cast<int>(std::min<int64_t>(W, n - j));
        V e = exp_neg(sub(load_n(score.data() + j, live), mv));
        alignas(64) float tmp[W];
        std::memcpy(tmp, &e, sizeof(e));
        for (int i = live; i < W; ++i) tmp[i] = 0.0f;
        for (int i = 0; i < live; ++i) score[j + i] = tmp[i];
        lsum = add(lsum, load_n(tmp, W));
      }
      const float inv = 1.0f / sum(lsum);
      const at::BFloat16* vb = vp + b * vs0 + h * vs1;
      for (int64_t c = 0; c < DW; ++c) acc[c] = zero();
      for (int64_t j = 0; j < n; ++j) {
        const V pj = set1(score[j]);
        for (int64_t c = 0; c < DW; ++c) acc[c] = fma(pj, load_bf16(vb + j * D + W * c), acc[c]);
      }
      at::BFloat16* orow = op + ((b * S + s) * Hq + hq) * D;
      for (int64_t c = 0; c < DW; ++c) store_bf16(orow + W * c, mul(acc[c], set1(inv)));
    }
  });
  return o;
}


// silu(g) * u over the output of the fused gate/up projection gu [..., 2I] (gate | up), bf16, as
// torch's `F.silu(g) * u` rounds: silu in fp32, rounded to bf16, times u, rounded to bf16. One call
// instead of ~12 small ops a layer (chunk, split, narrows, silu, mul, their outputs). The sigmoid
// reads exp only at -|g| (exp_neg, ~1 ulp of fp32: torch's Sleef exp may round the other way
// once in ~10^5 values; below g = -87, where silu is under 1e-35, it gives 0, torch until -88.7).
// Elementwise: a row's result does not depend on the batch.
torch::Tensor silu_mul_bf16(torch::Tensor gu) {
  using namespace attn;
  TORCH_CHECK(gu.dim() >= 1 && gu.scalar_type() == torch::kBFloat16 && gu.device().is_cpu(), "silu_mul_bf16: gu must be a bf16 CPU tensor [..., 2I]");
  const int64_t I2 = gu.size(-1), I = I2 / 2;
  TORCH_CHECK(I2 % (2 * W) == 0 && I > 0, "silu_mul_bf16: the gate/up width must be a positive multiple of ", 2 * W, ", got ", I2);
  auto gc = gu.contiguous();
  auto sizes = gc.sizes().vec();
  sizes.back() = I;
  auto out = torch::empty(sizes, gc.options());
  const int64_t R = gc.numel() / I2;
  const at::BFloat16* gp = gc.data_ptr<at::BFloat16>();
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  // rows split between threads in blocks of 16 (a decode step's few rows run inline)
  at::parallel_for(0, R, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t i = 0; i < I; i += W) {
        const V g = load_bf16(gp + r * I2 + i), u = load_bf16(gp + r * I2 + I + i);
        const V na = neg_abs(g);
        const V e = where_neg(add(na, set1(87.0f)), zero(), exp_neg(na));  // exp(-|g|), 0 below exp_neg's floor
        const V sig = div(where_neg(g, e, set1(1.0f)), add(set1(1.0f), e));  // sigmoid(g)
        alignas(64) at::BFloat16 s[W];
        store_bf16(s, mul(g, sig));  // silu(g) rounded to bf16, as torch's bf16 silu returns it
        store_bf16(op + r * I + i, mul(load_bf16(s), u));
      }
    }
  });
  return out;
}
