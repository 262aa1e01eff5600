// W-lane fp32 vectors (AVX-512: 16, AVX2: 8, the generic build: an array of 8 with the AVX2 branch's
// operations and orders) with bf16 loads and stores and a fixed exp: what the
// attention kernels (attn.cpp, attn_prefill.cpp), the gated MLP's activation and the argmax over a
// vocabulary (markov.cpp) share.
#pragma once
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <cmath>
#include <cstdint>
#include <cstring>

#include <c10/util/BFloat16.h>

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
inline V keep_n(V x, int n) { return _mm512_maskz_mov_ps(static_cast<__mmask16>((1u << n) - 1), x); }  // lanes >= n: 0
inline V where_first(V x, int n) {
  return _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), static_cast<__mmask16>((1u << n) - 1), x);
}  // lanes >= n: -inf
inline float hmax(V a) { return _mm512_reduce_max_ps(a); }
inline V round_int(V x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline V neg_abs(V x) {
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(x), _mm512_set1_epi32(INT32_MIN)));
}
inline V div(V a, V b) { return _mm512_div_ps(a, b); }
inline V where_neg(V x, V a, V b) {  // x < 0 ? a : b
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, zero(), _CMP_LT_OQ), b, a);
}
inline V pow2(V p, V n) { return _mm512_scalef_ps(p, n); }  // p * 2^n
inline __m256i to_bf16_bits(V x) {  // round to nearest even, as torch's float -> bfloat16 (finite x)
  const __m512i u = _mm512_castps_si512(x);
  const __m512i r = _mm512_add_epi32(
      u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}
inline void store_bf16(at::BFloat16* p, V x) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16_bits(x)); }
inline V load_w(const float* p) { return _mm512_loadu_ps(p); }  // W values of either dtype, widened exactly
inline V load_w(const at::BFloat16* p) { return load_bf16(p); }
inline V keep_nan(V acc, V x) {
  return _mm512_mask_mov_ps(acc, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), x);
}  // x's NaN lanes
inline bool any_nan(V a) { return _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q) != 0; }
inline int first_equal(V a, float b) {  // the first lane equal to b, -1 if none
  const __mmask16 eq = _mm512_cmp_ps_mask(a, _mm512_set1_ps(b), _CMP_EQ_OQ);
  return eq ? __builtin_ctz(static_cast<unsigned>(eq)) : -1;
}
#elif defined(__AVX2__) && defined(__FMA__)
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
inline __m256i first_n(int n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline V load_n(const float* p, int n) {  // the first n of 8 (zeros after): a full vector is one load
  return n == 8 ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, first_n(n));
}
inline V keep_n(V x, int n) { return _mm256_and_ps(x, _mm256_castsi256_ps(first_n(n))); }  // lanes >= n: 0
inline V where_first(V x, int n) {
  return _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), x, _mm256_castsi256_ps(first_n(n)));
}  // lanes >= n: -inf
inline float hmax(V a) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
inline V round_int(V x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline V neg_abs(V x) { return _mm256_or_ps(x, _mm256_set1_ps(-0.0f)); }
inline V div(V a, V b) { return _mm256_div_ps(a, b); }
inline V where_neg(V x, V a, V b) {  // x < 0 ? a : b
  return _mm256_blendv_ps(b, a, _mm256_cmp_ps(x, zero(), _CMP_LT_OQ));
}
inline V pow2(V p, V n) {  // n in [-126, 0] here
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
inline void store_bf16(at::BFloat16* p, V x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i r = _mm256_srli_epi32(
      _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF),
                                           _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1)))),
      16);
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}
inline V load_w(const float* p) { return _mm256_loadu_ps(p); }  // W values of either dtype, widened exactly
inline V load_w(const at::BFloat16* p) { return load_bf16(p); }
inline V keep_nan(V acc, V x) { return _mm256_blendv_ps(acc, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q)); }  // x's NaN lanes
inline bool any_nan(V a) { return _mm256_movemask_ps(_mm256_cmp_ps(a, a, _CMP_UNORD_Q)) != 0; }
inline int first_equal(V a, float b) {  // the first lane equal to b, -1 if none
  const int eq = _mm256_movemask_ps(_mm256_cmp_ps(a, _mm256_set1_ps(b), _CMP_EQ_OQ));
  return eq ? __builtin_ctz(static_cast<unsigned>(eq)) : -1;
}
#else
// anywhere else: 8 lanes as an array, each operation the AVX2 branch's lane by lane and every
// reduction in its order, so a kernel computes the same bits as on the AVX2 build
constexpr int W = 8;
struct V {
  float v[8];
};
inline V zero() { return V{}; }
inline V set1(float f) {
  V r;
  for (float& x : r.v) x = f;
  return r;
}
template <typename F>
inline V lanes(V a, V b, F f) {
  for (int i = 0; i < 8; ++i) a.v[i] = f(a.v[i], b.v[i]);
  return a;
}
inline V add(V a, V b) {
  return lanes(a, b, [](float x, float y) { return x + y; });
}
inline V sub(V a, V b) {
  return lanes(a, b, [](float x, float y) { return x - y; });
}
inline V mul(V a, V b) {
  return lanes(a, b, [](float x, float y) { return x * y; });
}
inline V div(V a, V b) {
  return lanes(a, b, [](float x, float y) { return x / y; });
}
inline float max1(float x, float y) { return x > y ? x : y; }  // maxps: y where either is NaN
inline V vmax(V a, V b) { return lanes(a, b, max1); }
inline V fma(V a, V b, V c) {
  for (int i = 0; i < 8; ++i) c.v[i] = std::fma(a.v[i], b.v[i], c.v[i]);
  return c;
}
inline float sum(V a) {  // the AVX2 branch's order: halves, then pairs, then the last two
  return ((a.v[0] + a.v[4]) + (a.v[2] + a.v[6])) + ((a.v[1] + a.v[5]) + (a.v[3] + a.v[7]));
}
inline float hmax(V a) {
  return max1(max1(max1(a.v[0], a.v[4]), max1(a.v[2], a.v[6])), max1(max1(a.v[1], a.v[5]), max1(a.v[3], a.v[7])));
}
inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline V load_bf16(const at::BFloat16* p) {
  V r;
  for (int i = 0; i < 8; ++i) r.v[i] = bits_float(static_cast<uint32_t>(p[i].x) << 16);
  return r;
}
inline V load_n(const float* p, int n) {  // the first n of 8 (zeros after)
  V r{};
  for (int i = 0; i < n; ++i) r.v[i] = p[i];
  return r;
}
inline V keep_n(V x, int n) {  // lanes >= n: 0
  for (int i = n; i < 8; ++i) x.v[i] = 0.f;
  return x;
}
inline V where_first(V x, int n) {  // lanes >= n: -inf
  for (int i = n; i < 8; ++i) x.v[i] = -INFINITY;
  return x;
}
inline V round_int(V x) {
  for (float& f : x.v) f = std::nearbyint(f);
  return x;
}
inline V neg_abs(V x) {
  for (float& f : x.v) f = bits_float(float_bits(f) | 0x80000000u);
  return x;
}
inline V where_neg(V x, V a, V b) {  // x < 0 ? a : b
  for (int i = 0; i < 8; ++i) a.v[i] = x.v[i] < 0.f ? a.v[i] : b.v[i];
  return a;
}
inline V pow2(V p, V n) {  // n in [-126, 0] here
  for (int i = 0; i < 8; ++i)
    p.v[i] *= bits_float(static_cast<uint32_t>(static_cast<int32_t>(std::nearbyint(n.v[i])) + 127) << 23);
  return p;
}
inline void store_bf16(at::BFloat16* p, V x) {  // round to nearest even (finite x), as the AVX2 branch
  for (int i = 0; i < 8; ++i) {
    const uint32_t u = float_bits(x.v[i]);
    p[i].x = static_cast<uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
  }
}
inline V load_w(const float* p) { return load_n(p, 8); }  // W values of either dtype, widened exactly
inline V load_w(const at::BFloat16* p) { return load_bf16(p); }
inline V keep_nan(V acc, V x) {  // x's NaN lanes
  for (int i = 0; i < 8; ++i)
    if (std::isnan(x.v[i])) acc.v[i] = x.v[i];
  return acc;
}
inline bool any_nan(V a) {
  for (float f : a.v)
    if (std::isnan(f)) return true;
  return false;
}
inline int first_equal(V a, float b) {  // the first lane equal to b, -1 if none
  for (int i = 0; i < 8; ++i)
    if (a.v[i] == b) return i;
  return -1;
}
#endif

// the bf16 dot product where the ISA has one (AVX512-BF16's vdpbf16ps): Pairs holds 2W bf16 values,
// dot_pairs(acc, a, b) adds to lane i a[2i] b[2i] + a[2i+1] b[2i+1]; elsewhere BF16_DOT is false and
// no kernel calls them
#if defined(__AVX512BF16__)
constexpr bool BF16_DOT = true;
using Pairs = __m512bh;
inline Pairs load_pairs(const at::BFloat16* p) { return (__m512bh)_mm512_loadu_si512(p); }
inline V dot_pairs(V acc, Pairs a, Pairs b) { return _mm512_dpbf16_ps(acc, a, b); }
#else
constexpr bool BF16_DOT = false;
struct Pairs {};
inline Pairs load_pairs(const at::BFloat16*) { return {}; }
inline V dot_pairs(V acc, Pairs, Pairs) { return acc; }
#endif

#if defined(__AVX2__) && defined(__FMA__)
// lane k of the result = the sum of the 8 lanes of h[k], k < 8, by one fixed tree: a key's score
// reads its own vector only, whichever keys share the chunk
inline __m256 sum8(const __m256* h) {
  const __m256 s01 = _mm256_hadd_ps(h[0], h[1]), s23 = _mm256_hadd_ps(h[2], h[3]);
  const __m256 s45 = _mm256_hadd_ps(h[4], h[5]), s67 = _mm256_hadd_ps(h[6], h[7]);
  const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
  return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}
#endif

// lane k = the sum of the W lanes of a[k]
#if defined(__AVX512F__)
inline V sum_lanes(const V* a) {
  __m256 h[16];
  for (int k = 0; k < 16; ++k)
    h[k] = _mm256_add_ps(_mm512_castps512_ps256(a[k]),
                         _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a[k]), 1)));
  const __m256 lo = sum8(h), hi = sum8(h + 8);
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(lo)), _mm256_castps_pd(hi), 1));
}
#elif defined(__AVX2__) && defined(__FMA__)
inline V sum_lanes(const V* a) { return sum8(a); }
#else
inline V sum_lanes(const V* a) {  // sum8's tree, lane by lane
  V r;
  for (int k = 0; k < 8; ++k) {
    const float* h = a[k].v;
    r.v[k] = ((h[0] + h[1]) + (h[2] + h[3])) + ((h[4] + h[5]) + (h[6] + h[7]));
  }
  return r;
}
#endif

// exp(x) for x <= 0: 2^n e^r with |r| <= ln2/2, a Taylor polynomial of degree DEG (6: ~1 ulp of fp32;
// 5: ~1e-6 relative, enough for values rounded to bf16 after it)
template <int DEG = 6>
inline V exp_neg(V x) {
  static_assert(DEG >= 1 && DEG <= 6, "exp_neg: degree 1..6");
  constexpr float inv_fact[7] = {1.0f, 1.0f, 0.5f, 1.0f / 6, 1.0f / 24, 1.0f / 120, 1.0f / 720};
  x = vmax(x, set1(-87.0f));
  const V n = round_int(mul(x, set1(1.44269504088896341f)));
  V r = sub(x, mul(n, set1(0.693145751953125f)));
  r = sub(r, mul(n, set1(1.428606765330187e-06f)));
  V p = set1(inv_fact[DEG]);
  for (int k = DEG - 1; k >= 0; --k) p = fma(p, r, set1(inv_fact[k]));
  return pow2(p, n);
}

}  // namespace attn
