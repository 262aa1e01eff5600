// bf16 <-> fp32 in 8-lane AVX2 vectors: what the matmul, norm and RoPE kernels of both builds share
// (every CPU dspark builds for has AVX2, the AVX-512 one included).
#pragma once
#include <immintrin.h>

namespace simd {

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

}  // namespace simd
