// 8 fp32 lanes with bf16 loads and stores rounded as torch's casts: what the norm, RoPE and matmul
// kernels share. F8 and its operations are AVX2 + FMA registers where the build has them (every x86
// build dspark makes: the AVX-512 one has them too) and an array of 8 floats anywhere else, with the
// same operations lane by lane in the same order, so both give the same bits. A kernel written
// against F8 holds no intrinsics of its own.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define DSPARK_SIMD_AVX2 1
#endif

namespace simd {

#if defined(DSPARK_SIMD_AVX2)
// 8 bf16 -> fp32 (exact) and back
inline __m256 widen_bf16x8(__m128i h) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)); }
inline __m256 bf16x8_to_f32(const void* p) { return widen_bf16x8(_mm_loadu_si128(static_cast<const __m128i*>(p))); }
inline __m128i to_bf16x8(__m256 a) {  // round to nearest even, NaN -> 0x7FC0: torch's float -> bfloat16
  const __m256i u = _mm256_castps_si256(a);
  __m256i r = _mm256_srli_epi32(
      _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF),
                                           _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1)))),
      16);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(a, a, _CMP_UNORD_Q)));
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

using F8 = __m256;
inline F8 zero8() { return _mm256_setzero_ps(); }
inline F8 set8(float f) { return _mm256_set1_ps(f); }
inline F8 add8(F8 a, F8 b) { return _mm256_add_ps(a, b); }
inline F8 mul8(F8 a, F8 b) { return _mm256_mul_ps(a, b); }
inline F8 fma8(F8 a, F8 b, F8 c) { return _mm256_fmadd_ps(a, b, c); }
inline F8 neg8(F8 a) { return _mm256_xor_ps(a, _mm256_set1_ps(-0.0f)); }
inline F8 load_bf16(const void* p) { return bf16x8_to_f32(p); }
inline void store_bf16(void* p, F8 a) { _mm_storeu_si128(static_cast<__m128i*>(p), to_bf16x8(a)); }
inline F8 round_bf16(F8 a) { return widen_bf16x8(to_bf16x8(a)); }  // rounded to bf16, back to fp32
inline void store8(float* p, F8 a) { _mm256_storeu_ps(p, a); }
#else
struct F8 {
  float v[8];
};
inline uint16_t bf16_bits(float f) {  // round to nearest even, NaN -> 0x7FC0: torch's float -> bfloat16
  if (std::isnan(f)) return 0x7FC0;
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}
inline float bf16_value(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline F8 zero8() { return F8{}; }
inline F8 set8(float f) {
  F8 r;
  for (float& x : r.v) x = f;
  return r;
}
inline F8 add8(F8 a, F8 b) {
  for (int i = 0; i < 8; ++i) a.v[i] += b.v[i];
  return a;
}
inline F8 mul8(F8 a, F8 b) {
  for (int i = 0; i < 8; ++i) a.v[i] *= b.v[i];
  return a;
}
inline F8 fma8(F8 a, F8 b, F8 c) {
  for (int i = 0; i < 8; ++i) c.v[i] = std::fma(a.v[i], b.v[i], c.v[i]);
  return c;
}
inline F8 neg8(F8 a) {
  for (float& x : a.v) x = -x;
  return a;
}
inline F8 load_bf16(const void* p) {
  uint16_t h[8];
  std::memcpy(h, p, sizeof(h));
  F8 r;
  for (int i = 0; i < 8; ++i) r.v[i] = bf16_value(h[i]);
  return r;
}
inline void store_bf16(void* p, F8 a) {
  uint16_t h[8];
  for (int i = 0; i < 8; ++i) h[i] = bf16_bits(a.v[i]);
  std::memcpy(p, h, sizeof(h));
}
inline F8 round_bf16(F8 a) {
  for (float& x : a.v) x = bf16_value(bf16_bits(x));
  return a;
}
inline void store8(float* p, F8 a) { std::memcpy(p, a.v, sizeof(a.v)); }
#endif

}  // namespace simd
