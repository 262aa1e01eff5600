// AVX2 + FMA (no bf16 dot product): the same packed layouts, walked 8 columns (half a block of 16)
// at a time. int4 and Q8_0 weights take 8-bit activations and integer sums (`tile_a8`,
// docs/history/benchmarks.md "8-bit activations ..."), unless built with DSPARK_ACT8=0 (kernels.py, for
// --activations bf16): then, as bf16 weights (a draft's) always, every row adds w * x in
// fp32 in input order, one FMA a weight and row (`tile8`). A row's operations do not depend on M
// or on which rows share the call (batch invariance).
#include "q4.h"

#if !(defined(__AVX2__) && defined(__FMA__))
#error "q4_avx2.cpp is the AVX2 build's matmul file (kernels.py compiles it with -mavx2 -mfma)"
#endif
#ifndef DSPARK_ACT8
#define DSPARK_ACT8 1
#endif
namespace q4 {
namespace {

// acc[m] += lo x xsum[m, g] for each row: a Q4_1 group's minimum term (xsum [M, G])
template <int M>
inline void add_minimum(__m256 (&acc)[M], __m256 lo, const float* xsum, int64_t G, int64_t g) {
#pragma GCC unroll 8
  for (int m = 0; m < M; ++m) acc[m] = _mm256_fmadd_ps(lo, _mm256_set1_ps(xsum[m * G + g]), acc[m]);
}

// the sums of a tile -> y (bf16 [M, N]), half blocks hb..hb+NB
template <int M, int NB>
inline void store8(const __m256 (&acc)[NB][M], uint16_t* y, int64_t N, int64_t hb) {
#pragma GCC unroll 4
  for (int j = 0; j < NB; ++j)
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(y + m * N + (hb + j) * 8), to_bf16x8(acc[j][m]));
}

// rows x[0..M) (fp32) against NB half blocks hb..hb+NB (8 columns each). Per group of 32 inputs,
// STEPS steps of IN inputs: unpack(block, half, step, w) gives the fp32 weights (SCALED: the
// integer q) of inputs IN * step + 0..IN-1 of the 8 columns, block = column block * G + group.
// SCALED: D, L [N/16, G, 16] the group scales and minimums (L.p null: none), xsum [M, G].
template <int M, int NB, int IN, int STEPS, bool SCALED, typename Unpack>
inline void tile8(const float* x, int64_t K, const Unpack& unpack, const Scales& D, const Scales& L, const float* xsum,
                  uint16_t* y, int64_t N, int64_t hb) {
  const int64_t G = K / 32;
  __m256 acc[NB][M];
  fill(acc, _mm256_setzero_ps());
  for (int64_t g = 0; g < G; ++g) {
    __m256 t[NB][M];  // SCALED: the group's sums of q * x (else acc itself takes w * x)
    if constexpr (SCALED) fill(t, _mm256_setzero_ps());
    auto& s = [&]() -> auto& {
      if constexpr (SCALED)
        return t;
      else
        return acc;
    }();
#pragma GCC unroll 16
    for (int r = 0; r < STEPS; ++r) {
#pragma GCC unroll 4
      for (int j = 0; j < NB; ++j) {
        __m256 w[IN];
        unpack(((hb + j) >> 1) * G + g, static_cast<int>((hb + j) & 1), r, w);
#pragma GCC unroll 4
        for (int i = 0; i < IN; ++i)
#pragma GCC unroll 8
          for (int m = 0; m < M; ++m)
            s[j][m] = _mm256_fmadd_ps(w[i], _mm256_broadcast_ss(x + m * K + g * 32 + IN * r + i), s[j][m]);
      }
    }
    if constexpr (SCALED) {
#pragma GCC unroll 4
      for (int j = 0; j < NB; ++j) {
        const int64_t at = (((hb + j) >> 1) * G + g) * 16 + 8 * ((hb + j) & 1);
        const __m256 d = D.load8(at);
#pragma GCC unroll 8
        for (int m = 0; m < M; ++m) acc[j][m] = _mm256_fmadd_ps(t[j][m], d, acc[j][m]);
        if (L.p != nullptr) add_minimum(acc[j], L.load8(at), xsum, G, g);
      }
      // past 4 sums both they and the group's sums do not fit in 16 registers: the sums stay in
      // L1, read and written once a group (left to the compiler, it spilled inside the group)
      if constexpr (M * NB > 4) asm volatile("" : : "r"(&acc[0][0]) : "memory");
    }
  }
  store8(acc, y, N, hb);
}

// y [..., N] bf16 = x (bf16 [..., K], M rows, widened once to fp32) against the packed weight
template <int IN, int STEPS, bool SCALED, typename Unpack>
torch::Tensor matmul8(const torch::Tensor& x, int64_t M, int64_t K, int64_t N, const Unpack& unpack,
                      const Scales& D = Scales(), const Scales& L = Scales()) {
  const auto xc = x.contiguous();
  const auto xf = xc.to(torch::kFloat);
  const float* xp = xf.data_ptr<float>();
  const int64_t G = K / 32;
  const std::vector<float> xsum = L.p != nullptr
                                      ? group_sums(reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>()), M, K)
                                      : std::vector<float>();
  auto y = torch::empty(out_shape(x, N), x.options());
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  // registers: rows x blocks sums (and group sums) + IN weights + a broadcast <= 16
  row_tiles<8, 4, 4>(M, N, [&](auto rows, auto nb, int64_t m0, int64_t hb) {
    tile8<decltype(rows)::value, decltype(nb)::value, IN, STEPS, SCALED>(
        xp + m0 * K, K, unpack, D, L, L.p != nullptr ? xsum.data() + m0 * G : nullptr, yp + m0 * N, N, hb);
  });
  return y;
}

// int4 and Q8_0 weights on this build take 8-bit activations (docs/history/benchmarks.md "8-bit activations ..."):
// each row's group of 32 inputs becomes s * xq with s = max|x| / 127 and xq = round(x * 127 /
// max|x|) in -127..127 (the rule llama.cpp uses against this file's Q4_1 and Q8_0 weights), so a
// group's sum of q * x is an exact integer sum, four products a byte instruction (vpmaddubsw)
// instead of one FMA each with its own broadcast, so fewer instructions per row whatever the row count
// (docs/history/benchmarks.md, "8-bit activations for the AVX2 build's int4 and Q8_0 matmuls"). A row's bytes, scales
// and sums depend on that row alone (batch invariance). Stored per row: xq [K] with each 8 inputs in the order (0, 4,
// 1, 5, 2, 6, 3, 7), that of a column's dword in a step's weight bytes (`tile_a8`); s [G]; NaN or infinity in a group
// makes its s NaN, so the result is NaN, never a finite number made of a clamped value; sum [G] s x the sum of the
// group's xq (the Q4_1 minimum's term).
Act8 act8(const uint16_t* x, int64_t M, int64_t K) {
  const int64_t G = K / 32;
  Act8 a(M, K);
  // rows split in two halves between threads from 8 K values (below that the split's overhead
  // outweighs the work: 8 rows of 576 were slower split)
  at::parallel_for(0, M, M * K >= 8192 ? (M + 1) / 2 : M, [&](int64_t m0, int64_t m1) {
    const __m256i absmask = _mm256_set1_epi32(0x7FFFFFFF);
    const __m256i dwords = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // packs' lane order -> input order
    const __m256i order = _mm256_setr_epi8(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15, 0, 4, 1, 5, 2, 6, 3, 7,
                                           8, 12, 9, 13, 10, 14, 11, 15);
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t g = 0; g < G; ++g) {
        const uint16_t* p = x + m * K + g * 32;
        __m256 v[4];
        __m256 amax = _mm256_setzero_ps();
        int bad = 0;
        for (int i = 0; i < 4; ++i) {
          v[i] = bf16x8_to_f32(p + 8 * i);
          bad |= _mm256_movemask_ps(_mm256_cmp_ps(v[i], v[i], _CMP_UNORD_Q));
          amax = _mm256_max_ps(amax, _mm256_and_ps(v[i], _mm256_castsi256_ps(absmask)));
        }
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        const float mx = _mm_cvtss_f32(_mm_max_ss(h, _mm_shuffle_ps(h, h, 1)));
        float s = mx / 127.f, inv = mx > 0.f ? 127.f / mx : 0.f;
        if (bad || !(mx <= std::numeric_limits<float>::max())) s = std::numeric_limits<float>::quiet_NaN(), inv = 0.f;
        const __m256 iv = _mm256_set1_ps(inv);
        __m256i n[4];
        for (int i = 0; i < 4; ++i) n[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], iv));  // round to nearest even
        // the minimum's term takes the quantised values' sum, s x (sum of xq, exact), so that the
        // row meets w = q d + lo as a whole: w . (s xq). With x's own sum, d q (0..15 d, not
        // centred) met the rounding alone and the model's logits strayed much further (KL)
        const __m256i t = _mm256_add_epi32(_mm256_add_epi32(n[0], n[1]), _mm256_add_epi32(n[2], n[3]));
        __m128i u = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
        u = _mm_add_epi32(u, _mm_shuffle_epi32(u, 0x4E));
        u = _mm_add_epi32(u, _mm_shuffle_epi32(u, 0xB1));
        a.sum[m * G + g] = s * static_cast<float>(_mm_cvtsi128_si32(u));
        const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(n[0], n[1]), _mm256_packs_epi32(n[2], n[3]));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(a.q.data() + m * K + g * 32),
                            _mm256_shuffle_epi8(_mm256_permutevar8x32_epi32(b, dwords), order));
        a.s[m * G + g] = s;
      }
  });
  return a;
}

// rows (8-bit, `Act8`) against NB half blocks hb..hb+NB (8 columns each) of an int4 (Q4) or Q8_0
// weight; step 2o + e takes inputs (0, 4, 1, 5) + 2e of octet o, in that order in each column's
// dword, as in the rows' bytes (`act8`):
// - int4: half of octet o, 32 bytes: the low nibble of each byte (e = 0) or the high one (e = 1)
//   is that order already (the octet layout), one mask; vpmaddubsw (unsigned q x signed x) gives
//   two 16-bit sums of pairs a column (|sum| <= 2 x 15 x 127), added in 16 bits over the group's
//   8 steps (<= 30 480: no overflow), widened once a group;
// - Q8_0: pairs 4o + e and 4o + 2 + e (16 bytes each, byte 2c + i = q[c, k + i]) interleaved by
//   byte; signed x signed takes |q| against x with q's sign (pairs <= 2 x 128 x 127, in 16 bits),
//   widened to 32 bits every step.
// A group's integer sum t then adds t x (d x s) (+ lo x s x the sum of its xq, int4: `act8`).
template <int M, int NB, bool Q4>
inline void tile_a8(const int8_t* xq, const float* sx, const float* xsum, int64_t K, const uint8_t* p, const Scales& D,
                    const Scales& L, uint16_t* y, int64_t N, int64_t hb) {
  const int64_t G = K / 32;
  __m256 acc[NB][M];
  fill(acc, _mm256_setzero_ps());
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  for (int64_t g = 0; g < G; ++g) {
    __m256i t[NB][M];
    fill(t, _mm256_setzero_si256());
#pragma GCC unroll 8
    for (int r = 0; r < 8; ++r) {
#pragma GCC unroll 4
      for (int j = 0; j < NB; ++j) {
        const int64_t block = ((hb + j) >> 1) * G + g;
        const int half = static_cast<int>((hb + j) & 1);
        __m256i w, sign;
        if constexpr (Q4) {
          const uint8_t* b = p + (block * 4 + (r >> 1)) * 64;
          if (half == 0 && !(r & 1)) prefetch_ahead(b);  // a 64-byte line: both halves, 2 steps
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 32 * half));
          w = _mm256_and_si256((r & 1) ? _mm256_srli_epi16(v, 4) : v, low);
        } else {
          const uint8_t* b = p + (block * 16 + 4 * (r >> 1) + (r & 1)) * 32;
          if (half == 0 && !(r & 1)) prefetch_ahead(b), prefetch_ahead(b + 64);  // an octet's two 64-byte lines
          const __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 16 * half));
          const __m128i o = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 64 + 16 * half));
          sign = _mm256_set_m128i(_mm_unpackhi_epi8(e, o), _mm_unpacklo_epi8(e, o));
          w = _mm256_abs_epi8(sign);
        }
#pragma GCC unroll 8
        for (int m = 0; m < M; ++m) {
          int32_t xv;
          std::memcpy(&xv, xq + m * K + g * 32 + 4 * r, 4);
          if constexpr (Q4) {
            t[j][m] = _mm256_add_epi16(t[j][m], _mm256_maddubs_epi16(w, _mm256_set1_epi32(xv)));
          } else {
            const __m256i pairs = _mm256_maddubs_epi16(w, _mm256_sign_epi8(_mm256_set1_epi32(xv), sign));
            t[j][m] = _mm256_add_epi32(t[j][m], _mm256_madd_epi16(pairs, ones));
          }
          // each sum added as it comes, in its register: integer adds may be reassociated, and
          // GCC then spilled every product to the stack to add them later (slower at 4-8 rows)
          asm("" : "+x"(t[j][m]));
        }
      }
    }
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) {
      const int64_t at = (((hb + j) >> 1) * G + g) * 16 + 8 * ((hb + j) & 1);
      const __m256 d = D.load8(at);
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) {
        const __m256i sum = Q4 ? _mm256_madd_epi16(t[j][m], ones) : t[j][m];
        acc[j][m] =
            _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(d, _mm256_set1_ps(sx[m * G + g])), acc[j][m]);
      }
      if constexpr (Q4) add_minimum(acc[j], L.load8(at), xsum, G, g);
    }
    // sums in L1 for the 5-8 row tiles, as tile8's; the 1-4 row tiles keep theirs in registers
    if constexpr (NB == 1 && M > 4) asm volatile("" : : "r"(&acc[0][0]) : "memory");
  }
  store8(acc, y, N, hb);
}

// y [..., N] bf16 = x (bf16 [..., K], M rows, quantised once to 8 bits) against an int4 (Q4: P, D,
// L) or Q8_0 (P, D) weight
template <bool Q4>
torch::Tensor matmul_a8(const torch::Tensor& x, int64_t M, int64_t K, int64_t N, const uint8_t* p, const Scales& D,
                        const Scales& L = Scales()) {
  const int64_t G = K / 32;
  const auto xc = x.contiguous();
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  const Act8 a = act8(xp, M, K);
  auto y = torch::empty(out_shape(xc, N), xc.options());
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  // half blocks a tile for 1 / 2 / 3 / 4 rows: the widths that kept both threads' vector units
  // busiest on a verify of that many rows (at 1 row 4 blocks were slower: their sums spill)
  row_tiles<8, 2, 4, 3, 2>(M, N, [&](auto rows, auto nb, int64_t m0, int64_t hb) {
    tile_a8<decltype(rows)::value, decltype(nb)::value, Q4>(a.q.data() + m0 * K, a.s.data() + m0 * G,
                                                            a.sum.data() + m0 * G, K, p, D, L, yp + m0 * N, N, hb);
  });
  return y;
}

}  // namespace
}  // namespace q4

using namespace q4;  // the exported functions below use the tiles above

#if DSPARK_ACT8
torch::Tensor q4_mm(torch::Tensor x, torch::Tensor P, torch::Tensor D, torch::Tensor L) {
  return q4_mm_a8(x, P, D, L, matmul_a8<true>);
}

torch::Tensor q8_mm(torch::Tensor x, torch::Tensor P, torch::Tensor D) { return q8_mm_a8(x, P, D, matmul_a8<false>); }
#else  // bf16 activations (--activations bf16: closer to the model, slower here)
torch::Tensor q4_mm(torch::Tensor x, torch::Tensor P, torch::Tensor D, torch::Tensor L) {
  const auto shape = packed_shape("q4_mm", x, P, torch::kByte, 8, {D, L});
  const uint8_t* p = P.data_ptr<uint8_t>();
  // step r of a block, 8 columns: half of octet r / 2, 32 bytes; column c's dword holds input
  // 8o + 2j + i in bits 16i + 4j (the octet layout), so input 4r + n sits at bit `at[n]`
  auto unpack = [p](int64_t block, int half, int r, __m256* w) {
    const uint8_t* b = p + (block * 4 + (r >> 1)) * 64;
    if (half == 0 && !(r & 1)) prefetch_ahead(b);  // a 64-byte line: both halves, 2 steps
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 32 * half));
    const __m256i m4 = _mm256_set1_epi32(0x0F);
    constexpr int at[2][4] = {{0, 16, 4, 20}, {8, 24, 12, 28}};
    for (int n = 0; n < 4; ++n) w[n] = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, at[r & 1][n]), m4));
  };
  return matmul8<4, 8, true>(x, shape[0], shape[1], shape[2], unpack, Scales(D), Scales(L));
}

torch::Tensor q8_mm(torch::Tensor x, torch::Tensor P, torch::Tensor D) {
  const auto shape = packed_shape("q8_mm", x, P, torch::kChar, 16, {D});
  const int8_t* p = P.data_ptr<int8_t>();
  // pair r of a block, 8 columns: 16 bytes; 16-bit word c = q[c, 2r] | q[c, 2r + 1] << 8 (signed bytes)
  auto unpack = [p](int64_t block, int half, int r, __m256* w) {
    if (half == 0 && !(r & 1)) prefetch_ahead(p + (block * 16 + r) * 32);  // a 64-byte line: both halves, 2 pairs
    const __m256i a =
        _mm256_cvtepi16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + (block * 16 + r) * 32 + 16 * half)));
    w[0] = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(a, 24), 24));
    w[1] = _mm256_cvtepi32_ps(_mm256_srai_epi32(a, 8));
  };
  return matmul8<2, 16, true>(x, shape[0], shape[1], shape[2], unpack, Scales(D));
}
#endif

torch::Tensor bf16_mm(torch::Tensor x, torch::Tensor P, torch::Tensor D) {
  const auto shape = packed_shape("bf16_mm", x, P, torch::kBFloat16, 16, {D});
  const uint16_t* p = reinterpret_cast<const uint16_t*>(P.data_ptr<at::BFloat16>());
  // pair r of a block, 8 columns: 32 bytes; 32-bit word c = w[c, 2r] | w[c, 2r + 1] << 16 (D: ones, unread)
  auto unpack = [p](int64_t block, int half, int r, __m256* w) {
    if (half == 0) prefetch_ahead(p + (block * 16 + r) * 32);  // a 64-byte line: both halves of a pair
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + (block * 16 + r) * 32 + 16 * half));
    w[0] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    w[1] = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
  };
  return matmul8<2, 16, false>(x, shape[0], shape[1], shape[2], unpack);
}
