// The AVX-512 build's int4 (Q4_1) and Q8_0 matmuls on 8-bit activations (kernels.py builds it with
// -mavx512vnni -DDSPARK_ACT8=1 when a process asks for int8 activations; otherwise this file is empty
// and q4_avx512.cpp's bf16 tile runs).
//
// Why: at 2-8 rows the bf16 tile is bound by its dot products, one vdpbf16ps (32 multiply-adds) per
// 16 columns x 2 inputs and row. AVX512-VNNI's vpdpbusd does 64 (unsigned bytes x signed bytes ->
// int32) per instruction, so each row of a verify costs about half the instructions, and the
// weights need less unpacking: a nibble is already the unsigned operand (a mask and a shift per 64
// bytes, shared by every row), and a Q8_0 byte offset by 128 at packing time is one as it is loaded.
// The activations follow the AVX2 build's `act8` rule (llama.cpp's against these formats): per row
// and group of 32 inputs s = max|x| / 127, xq = round(x * 127 / max|x|), and a group's sum of q * xq
// is an exact integer (docs/history/benchmarks.md "8-bit activations ..."). At one row the matmuls
// stream their weights and the arithmetic is not what bounds them, which is why the bf16 tile stays
// the default where plain decoding matters (kernels.q4_activations).
//
// Layouts (packing.pack_q4 / pack_q8 ask the build):
//   int4: the AVX2 build's octets (q4_avx512.cpp's header): 64 bytes a column block and octet o of
//     a group; column c's dword holds inputs (0, 4, 1, 5) of the octet in its low nibbles and
//     (2, 6, 3, 7) in its high ones, so one mask gives 16 columns x 4 inputs;
//   Q8_0: P8 [N/16, K/32, 16, 32] read as 8 steps of 64 bytes; step 2o + e holds, in column c's
//     dword, q + 128 (as a byte) of inputs 8o + (0, 4, 1, 5) + 2e: the order of the rows' bytes.
// Rows are quantised once a call with each 8 inputs in the order (0, 4, 1, 5, 2, 6, 3, 7), so a step
// of either format meets one dword of a row. A Q8_0 group's sum of (q + 128) xq less 128 x the sum
// of xq is the sum of q xq, exactly (|sum| < 2^31).
//
// Batch invariance: a row's bytes, scales and integer sums depend on that row alone (integer sums
// are exact, so their order does not matter), and its floating-point steps, a group's
// acc = fma(float(sum), d * s, acc) then acc = fma(lo, s x sum of xq, acc), are the same whatever M
// is and whichever rows share the call (the AVX2 build's, in its order).
#include "q4.h"

#if DSPARK_ACT8
#if !(defined(__AVX512VNNI__) && defined(__AVX512BW__))
#error "q4_avx512_vnni.cpp needs AVX512-VNNI (kernels.py adds -mavx512vnni to the int8 build)"
#endif

#include <cstring>
#include <limits>

namespace q4 {
namespace {

// q4.h's Act8 (xq with each 8 inputs in the order (0, 4, 1, 5, 2, 6, 3, 7)) and n128 [G] = 128 x the
// group's sum of xq (the Q8_0 offset's term, an integer)
struct Act8N : Act8 {
  std::vector<int32_t> n128;
  Act8N(int64_t M, int64_t K) : Act8(M, K), n128(M * (K / 32)) {}
};

Act8N act8(const uint16_t* x, int64_t M, int64_t K) {
  const int64_t G = K / 32;
  Act8N a(M, K);
  // rows split in two halves between threads from 8 K values, as the AVX2 build's
  at::parallel_for(0, M, M * K >= 8192 ? (M + 1) / 2 : M, [&](int64_t m0, int64_t m1) {
    const __m128i order = _mm_setr_epi8(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15);
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t g = 0; g < G; ++g) {
        const uint16_t* p = x + m * K + g * 32;
        __m512 v[2];
        __mmask16 bad = 0;
        for (int i = 0; i < 2; ++i) {
          const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16 * i));
          v[i] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
          bad |= _mm512_cmp_ps_mask(v[i], v[i], _CMP_UNORD_Q);
        }
        const float mx = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1])));
        float s = mx / 127.f, inv = mx > 0.f ? 127.f / mx : 0.f;
        if (bad || !(mx <= std::numeric_limits<float>::max())) s = std::numeric_limits<float>::quiet_NaN(), inv = 0.f;
        const __m512 iv = _mm512_set1_ps(inv);
        __m512i n[2];
        for (int i = 0; i < 2; ++i) n[i] = _mm512_cvtps_epi32(_mm512_mul_ps(v[i], iv));  // round to nearest even
        const int32_t total = _mm512_reduce_add_epi32(_mm512_add_epi32(n[0], n[1]));
        a.sum[m * G + g] = s * static_cast<float>(total);
        a.n128[m * G + g] = 128 * total;
        a.s[m * G + g] = s;
        for (int i = 0; i < 2; ++i)  // |xq| <= 127: the narrowing is exact
          _mm_storeu_si128(reinterpret_cast<__m128i*>(a.q.data() + m * K + g * 32 + 16 * i),
                           _mm_shuffle_epi8(_mm512_cvtepi32_epi8(n[i]), order));
      }
  });
  return a;
}

// rows (`Act8N`, xq [M, K], s / sum / n128 [M, G]) against column blocks cb..cb+NB (16 columns each)
// of an int4 (Q4: P, D, L) or Q8_0 (P, D) weight. Per group, 4 octets of 2 steps: one vpdpbusd a
// step and row. Up to 3 rows the steps alternate between two sums a row, so that the latency of
// one chain does not bound them; from 4 rows the rows interleave and one sum a row leaves
// registers for 8 rows. Both are exact integer sums: the same values whatever the split.
template <int M, int NB, bool Q4>
inline void tile(const Act8N& a, int64_t m0, int64_t K, const uint8_t* p, const Scales& D, const Scales& L, uint16_t* y,
                 int64_t N, int64_t cb) {
  constexpr int CH = M <= 3 ? 2 : 1;
  const int64_t G = K / 32;
  const int8_t* xq = a.q.data() + m0 * K;
  const float* sx = a.s.data() + m0 * G;
  const float* xsum = a.sum.data() + m0 * G;
  const int32_t* n128 = a.n128.data() + m0 * G;
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 acc[NB][M];
  fill(acc, _mm512_setzero_ps());
  for (int64_t g = 0; g < G; ++g) {
    __m512i t[CH][NB][M];
#pragma GCC unroll 2
    for (int c = 0; c < CH; ++c) fill(t[c], _mm512_setzero_si512());
#pragma GCC unroll 4
    for (int o = 0; o < 4; ++o) {
#pragma GCC unroll 8
      for (int j = 0; j < NB; ++j) {
        const int64_t block = (cb + j) * G + g;
        __m512i w[2];
        if constexpr (Q4) {
          const uint8_t* b = p + (block * 4 + o) * 64;
          prefetch_ahead(b);
          const __m512i v = _mm512_loadu_si512(b);
          w[0] = _mm512_and_si512(v, low);
          // with two sums a row the high nibbles stay in place (16 q, still a byte) and their sum is
          // shifted back once a group and row instead of once a step: exact, a multiple of 16
          w[1] = CH == 2 ? _mm512_andnot_si512(low, v) : _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        } else {
          const uint8_t* b = p + (block * 8 + 2 * o) * 64;
          prefetch_ahead(b);
          prefetch_ahead(b + 64);
          w[0] = _mm512_loadu_si512(b);
          w[1] = _mm512_loadu_si512(b + 64);
        }
#pragma GCC unroll 2
        for (int e = 0; e < 2; ++e)
#pragma GCC unroll 8
          for (int m = 0; m < M; ++m) {
            // the row's dword broadcast inside the instruction ({1to16}: one fused load)
            const int8_t* xp = xq + m * K + g * 32 + 8 * o + 4 * e;
            asm("vpdpbusd %2%{1to16%}, %1, %0"
                : "+v"(t[CH == 2 ? e : 0][j][m])
                : "v"(w[e]), "m"(*reinterpret_cast<const uint32_t*>(xp)));
          }
      }
    }
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) {
      const int64_t at = ((cb + j) * G + g) * 16;
      const __m512 d = D.load16(at);
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) {
        __m512i sum = t[0][j][m];
        if constexpr (CH == 2) sum = _mm512_add_epi32(sum, Q4 ? _mm512_srai_epi32(t[1][j][m], 4) : t[1][j][m]);
        if constexpr (!Q4) sum = _mm512_sub_epi32(sum, _mm512_set1_epi32(n128[m * G + g]));
        acc[j][m] =
            _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(d, _mm512_set1_ps(sx[m * G + g])), acc[j][m]);
      }
      if constexpr (Q4) {
        const __m512 lo = L.load16(at);
#pragma GCC unroll 8
        for (int m = 0; m < M; ++m) acc[j][m] = _mm512_fmadd_ps(lo, _mm512_set1_ps(xsum[m * G + g]), acc[j][m]);
      }
    }
  }
#pragma GCC unroll 8
  for (int j = 0; j < NB; ++j)
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + m * N + (cb + j) * 16),
                          (__m256i)_mm512_cvtneps_pbh(acc[j][m]));
}

// y [..., N] bf16 = x (bf16 [..., K], M rows, quantised once to 8 bits) against an int4 (Q4: P, D,
// L) or Q8_0 (P, D) weight
template <bool Q4>
torch::Tensor matmul_a8(const torch::Tensor& x, int64_t M, int64_t K, int64_t N, const uint8_t* p, const Scales& D,
                        const Scales& L = Scales()) {
  const auto xc = x.contiguous();
  const Act8N a = act8(reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>()), M, K);
  auto y = torch::empty(out_shape(xc, N), xc.options());
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  // column blocks a tile for 1 / 2 / 3 / 4 rows, as the bf16 tile's (q4_avx512.cpp `matmul`)
  row_tiles<16, 1, 2>(M, N, [&](auto rows, auto nb, int64_t m0, int64_t cb) {
    tile<decltype(rows)::value, decltype(nb)::value, Q4>(a, m0, K, p, D, L, yp + m0 * N, N, cb);
  });
  return y;
}

}  // namespace
}  // namespace q4

using namespace q4;  // the exported functions below use the tiles above

torch::Tensor q4_mm(torch::Tensor x, torch::Tensor P, torch::Tensor D, torch::Tensor L) {
  return q4_mm_a8(x, P, D, L, matmul_a8<true>);
}

torch::Tensor q8_mm(torch::Tensor x, torch::Tensor P, torch::Tensor D) { return q8_mm_a8(x, P, D, matmul_a8<false>); }
#endif  // DSPARK_ACT8
