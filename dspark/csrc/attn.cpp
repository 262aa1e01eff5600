// Attention of a few new queries over the KV cache, bf16 (docs/BENCHMARKS.md, "Session 10").
// torch's flash-attention kernel costs 45-90 us a layer for 1-8 queries over ~200 cached keys,
// mostly set-up; this does the arithmetic directly. Each query row (batch row, position, head)
// is computed on its own, over its keys 0..pos in a fixed order, so its result does not depend
// on which other rows or positions share the call: a verify of 8 positions gives each position
// exactly what a 1-token step would (lossless greedy verification in bf16).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cmath>
#include <vector>

namespace {

inline __m512 bf16x16(const at::BFloat16* p) {  // 16 bf16 -> fp32 (exact)
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// exp(x) for x <= 0: 2^n e^r with |r| <= ln2/2, degree-6 polynomial (~1 ulp of fp32)
inline __m512 exp_neg(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

}  // namespace

// q [B, S, Hq, D] bf16 (any strides), k / v [B, Hkv, C, D] bf16 (last dim contiguous), pos [B, S]
// int64: query (b, s) sees keys 0..pos[b, s]. -> o [B, S, Hq * D] bf16 (the layout o_proj reads)
torch::Tensor attn_bf16(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor pos, double scale) {
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
  const int64_t G = Hq / Hkv, ks0 = k.stride(0), ks1 = k.stride(1), vs0 = v.stride(0), vs1 = v.stride(1);
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, B * S * Hq, 1, [&](int64_t r0, int64_t r1) {
    std::vector<float> score;
    std::vector<__m512> qv(D / 16), acc(D / 16);
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t b = r / (S * Hq), s = (r / Hq) % S, hq = r % Hq, h = hq / G, n = pp[b * S + s] + 1;
      const at::BFloat16* qr = qp + r * D;
      for (int64_t c = 0; c < D / 16; ++c) qv[c] = _mm512_mul_ps(bf16x16(qr + 16 * c), _mm512_set1_ps(sc));
      score.resize(((n + 15) / 16) * 16);
      const at::BFloat16* kb = kp + b * ks0 + h * ks1;
      float m = -INFINITY;
      for (int64_t j = 0; j < n; ++j) {
        __m512 a = _mm512_mul_ps(qv[0], bf16x16(kb + j * D));
        for (int64_t c = 1; c < D / 16; ++c) a = _mm512_fmadd_ps(qv[c], bf16x16(kb + j * D + 16 * c), a);
        score[j] = _mm512_reduce_add_ps(a);
        m = std::max(m, score[j]);
      }
      // softmax weights, 16 keys a vector (the last vector masked): the same chunks for the same n
      __m512 lsum = _mm512_setzero_ps();
      const __m512 mv = _mm512_set1_ps(m);
      for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 live = n - j >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (n - j)) - 1);
        const __m512 e = exp_neg(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, score.data() + j), mv));
        const __m512 em = _mm512_maskz_mov_ps(live, e);
        _mm512_storeu_ps(score.data() + j, em);
        lsum = _mm512_add_ps(lsum, em);
      }
      const float inv = 1.0f / _mm512_reduce_add_ps(lsum);
      const at::BFloat16* vb = vp + b * vs0 + h * vs1;
      for (int64_t c = 0; c < D / 16; ++c) acc[c] = _mm512_setzero_ps();
      for (int64_t j = 0; j < n; ++j) {
        const __m512 pj = _mm512_set1_ps(score[j]);
        for (int64_t c = 0; c < D / 16; ++c) acc[c] = _mm512_fmadd_ps(pj, bf16x16(vb + j * D + 16 * c), acc[c]);
      }
      at::BFloat16* orow = op + ((b * S + s) * Hq + hq) * D;
      for (int64_t c = 0; c < D / 16; ++c)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(orow + 16 * c),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[c], _mm512_set1_ps(inv))));
    }
  });
  return o;
}
