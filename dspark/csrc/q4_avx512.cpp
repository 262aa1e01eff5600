// dspark's int4 weight-only matmul (and its Q8_0 and bf16 variants) for CPUs with AVX512-BF16
// (docs/history/benchmarks.md, "dspark's own int4 kernel"); an AVX2 + FMA build of the same scheme
// follows it ("a matmul tile for AVX2 CPUs").
//
// y [M, N] = x [M, K] @ W.T, W held as 4-bit groups of 32 inputs: w = q * d + lo (the GGUF Q4_1
// rule), bf16 activations, fp32 sums, bf16 result; the AVX2 build's int4 matmul quantises the
// activations to 8 bits per group of 32 (`act8`, "8-bit activations for the AVX2 build's ..."), as
// this build's int4 and Q8_0 matmuls do when built with DSPARK_ACT8=1 (q4_avx512_vnni.cpp, on
// AVX512-VNNI: the bf16 dot products below then serve bf16 weights only). Compiled on first use by
// dspark/kernels.py.
//
// Why not torch's _weight_int4pack_mm_for_cpu: it vectorises along K, so every weight is
// unpacked and scaled once per row, so a verify's rows cost nearly a step each. Here a vector holds 16 output
// columns x 2 inputs (one vdpbf16ps = 32 multiply-adds), each 4-bit weight is unpacked once per
// call whatever M is, and the group scale is applied once per group and row.
//
// Batch invariance, which lossless verification relies on: every y[m, n] is computed by the same
// operations in the same order whatever M is and whichever rows share the call (rows are taken
// 8 at a time, then the rest together, with the same per-row sequence; threads split columns,
// never a sum).
//
// Layout (made by packing.pack_q4, which asks the build for its own):
//   P  [N/16, K/32, 8, 32] uint8: column block, group, then
//      AVX512-BF16: step r (inputs k = 32g + 4r + 0..3); byte 2c = q[c, k0] | q[c, k2] << 4,
//      byte 2c+1 = q[c, k1] | q[c, k3] << 4 (a step's 32 bytes widen to the 16-bit lanes of two
//      bf16 pair vectors);
//      AVX2 ("octets"): octet o of 64 bytes (inputs k = 32g + 8o + 0..7); 16-bit word 2c + i
//      holds q[c, k + 2j + i] in its nibble j (0..3): one byte mask (after a 4-bit shift for odd
//      steps) gives a step's 4 bytes per column, with no widening (`tile_a8`, docs/history/benchmarks.md
//      "... two kernel layouts ..."); the AVX-512 build with 8-bit activations reads the octets too
//      (q4_avx512_vnni.cpp)
//   D, L [N/16, K/32, 16] fp32 or fp16 (`Scales`): d and lo of each column of the block
#include "q4.h"

#if !(defined(__AVX512BF16__) && defined(__AVX512BW__))
#error "q4_avx512.cpp is the AVX512-BF16 build's matmul file (kernels.py compiles it with -mavx512bf16 -mavx512bw)"
#endif

namespace q4 {
namespace {

// u16 lane holding a nibble (in its low 5 bits: vpermw ignores the rest) -> that value as bf16
inline __m512i nibble_to_bf16() {
  return _mm512_set_epi16(0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120, 0x4110, 0x4100, 0x40E0, 0x40C0, 0x40A0,
                          0x4080, 0x4040, 0x4000, 0x3F80, 0x0000, 0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120,
                          0x4110, 0x4100, 0x40E0, 0x40C0, 0x40A0, 0x4080, 0x4040, 0x4000, 0x3F80, 0x0000);
}

// The scheme both weight formats share: rows x[0..M) against column blocks cb..cb+NB (16 columns
// each). Per group of 32 inputs, 8 steps of 4 inputs: unpack(block, step, wa, wb) gives the bf16
// weights of inputs (4 step, 4 step + 1) and (4 step + 2, 4 step + 3) of the 16 columns of
// `block` = column block * G + group. Each group's sums are scaled by D, plus L x the group's sum
// of x where the format has a minimum (L null: none).
template <int M, int NB, typename Unpack>
inline void tile(const uint16_t* x, int64_t K, const Unpack& unpack, const Scales& D, const Scales& L,
                 const float* xsum, uint16_t* y, int64_t N, int64_t cb) {
  const int64_t G = K / 32;
  __m512 acc[NB][M];
  fill(acc, _mm512_setzero_ps());
  for (int64_t g = 0; g < G; ++g) {
    // the group's sum of q * x per column, in two halves added at its end: inputs (4 step, 4 step
    // + 1) in t, (4 step + 2, 4 step + 3) in u. One chain of 16 dependent dot products a group
    // left 1-2 rows waiting on their latency (docs/history/benchmarks.md "... two kernel layouts ...")
    __m512 t[NB][M], u[NB][M];
    fill(t, _mm512_setzero_ps());
    fill(u, _mm512_setzero_ps());
#pragma GCC unroll 8
    for (int r = 0; r < 8; ++r) {
#pragma GCC unroll 8
      for (int j = 0; j < NB; ++j) {
        __m512bh wa, wb;
        unpack((cb + j) * G + g, r, wa, wb);
#pragma GCC unroll 8
        for (int m = 0; m < M; ++m) {
          const uint16_t* xp = x + m * K + g * 32 + 4 * r;
          if constexpr (M >= 2) {
            // several rows: each x pair broadcast inside the instruction ({1to16}, one fused load),
            // the same arithmetic as below with fewer instructions to issue (faster at 8 rows)
            asm("vdpbf16ps %2%{1to16%}, %1, %0" : "+v"(t[j][m]) : "v"(wa), "m"(*reinterpret_cast<const uint32_t*>(xp)));
            asm("vdpbf16ps %2%{1to16%}, %1, %0"
                : "+v"(u[j][m])
                : "v"(wb), "m"(*reinterpret_cast<const uint32_t*>(xp + 2)));
          } else {
            uint32_t xa, xb;
            std::memcpy(&xa, xp, 4);
            std::memcpy(&xb, xp + 2, 4);
            t[j][m] = _mm512_dpbf16_ps(t[j][m], wa, (__m512bh)_mm512_set1_epi32(static_cast<int>(xa)));
            u[j][m] = _mm512_dpbf16_ps(u[j][m], wb, (__m512bh)_mm512_set1_epi32(static_cast<int>(xb)));
          }
        }
      }
    }
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) {
      const __m512 d = D.load16(((cb + j) * G + g) * 16);
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) acc[j][m] = _mm512_fmadd_ps(_mm512_add_ps(t[j][m], u[j][m]), d, acc[j][m]);
      if (L.p != nullptr) {
        const __m512 lo = L.load16(((cb + j) * G + g) * 16);
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

// y [..., N] bf16: the tile over every row tile and column block of xc (contiguous bf16 [..., K], M rows)
template <typename Unpack>
torch::Tensor matmul(const torch::Tensor& xc, int64_t M, int64_t K, int64_t N, const Unpack& unpack, const Scales& D,
                     const Scales& L, const float* xsum) {
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  auto y = torch::empty(out_shape(xc, N), xc.options());
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  const int64_t G = K / 32;
  // registers: 3 x rows x blocks accumulators <= 24 of 32. With the weights asked for ahead
  // (AHEAD), wide tiles stopped paying at 1-2 rows: one row takes 1 block a tile, two rows 2
  // (docs/history/benchmarks.md, "weights asked for ahead of the tile")
  row_tiles<16, 1, 2>(M, N, [&](auto rows, auto nb, int64_t m0, int64_t cb) {
    tile<decltype(rows)::value, decltype(nb)::value>(xp + m0 * K, K, unpack, D, L, xsum ? xsum + m0 * G : nullptr,
                                                     yp + m0 * N, N, cb);
  });
  return y;
}

}  // namespace
}  // namespace q4

using namespace q4;  // the exported functions below use the tiles above

#if !DSPARK_ACT8  // else q4_avx512_vnni.cpp's int4 and Q8_0 matmuls, on 8-bit activations
// Q8_0 (int8 q, one scale per column and 32 inputs, w = q * d): the same scheme, bytes instead
// of nibbles. P8 [N/16, K/32, 16, 32] int8: column block, group, input pair p (k = 32g + 2p + 0..1);
// byte 2c = q[c, k0], byte 2c+1 = q[c, k1]. D [N/16, K/32, 16] (Scales).
torch::Tensor q8_mm(torch::Tensor x, torch::Tensor P, torch::Tensor D) {
  const auto shape = packed_shape("q8_mm", x, P, torch::kChar, 16, {D});
  const int64_t M = shape[0], K = shape[1], N = shape[2];
  const int8_t* p = P.data_ptr<int8_t>();
  // step r of a block: pairs 2r and 2r + 1, 64 bytes, exact as bf16 (|q| <= 128)
  auto unpack = [p](int64_t block, int r, __m512bh& wa, __m512bh& wb) {
    const int8_t* b = p + (block * 16 + 2 * r) * 32;
    prefetch_ahead(b);  // a step reads one 64-byte line
    __m512 a[4];
    for (int i = 0; i < 4; ++i)
      a[i] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 16 * i))));
    wa = _mm512_cvtne2ps_pbh(a[1], a[0]);
    wb = _mm512_cvtne2ps_pbh(a[3], a[2]);
  };
  return matmul(x.contiguous(), M, K, N, unpack, Scales(D), Scales(), nullptr);
}
#endif

// bf16 weights: the same scheme with nothing to unpack, for the small row counts of a draft (oneDNN's
// packed bf16 matmul is made for many rows, and spent its time on set-up at a draft's few). P16
// [N/16, K/32, 16, 32] bf16: column block, group, input pair p (k = 32g + 2p + 0..1); element 2c =
// w[c, k0], 2c+1 = w[c, k1]. D [N/16, K/32, 16] fp32 ones (the scale step of the shared tile).
torch::Tensor bf16_mm(torch::Tensor x, torch::Tensor P, torch::Tensor D) {
  const auto shape = packed_shape("bf16_mm", x, P, torch::kBFloat16, 16, {D});
  const int64_t M = shape[0], K = shape[1], N = shape[2];
  const uint16_t* p = reinterpret_cast<const uint16_t*>(P.data_ptr<at::BFloat16>());
  auto unpack = [p](int64_t block, int r, __m512bh& wa, __m512bh& wb) {
    const uint16_t* b = p + (block * 16 + 2 * r) * 32;
    prefetch_ahead(b);  // a step reads two 64-byte lines
    prefetch_ahead(b + 32);
    wa = (__m512bh)_mm512_loadu_si512(b);
    wb = (__m512bh)_mm512_loadu_si512(b + 32);
  };
  return matmul(x.contiguous(), M, K, N, unpack, Scales(D), Scales(), nullptr);
}

#if !DSPARK_ACT8
torch::Tensor q4_mm(torch::Tensor x, torch::Tensor P, torch::Tensor D, torch::Tensor L) {
  const auto shape = packed_shape("q4_mm", x, P, torch::kByte, 8, {D, L});
  const int64_t M = shape[0], K = shape[1], N = shape[2];
  auto xc = x.contiguous();
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  const std::vector<float> xsum = group_sums(xp, M, K);
  const uint8_t* p = P.data_ptr<uint8_t>();
  // step r of a block: 32 bytes, the low nibbles inputs 4r, 4r + 1, the high ones 4r + 2, 4r + 3
  const __m512i table = nibble_to_bf16();
  auto unpack = [p, table](int64_t block, int r, __m512bh& wa, __m512bh& wb) {
    const uint8_t* b = p + (block * 8 + r) * 32;
    if (!(r & 1)) prefetch_ahead(b);  // two steps read one 64-byte line (r is unrolled: no branch)
    const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)));
    wa = (__m512bh)_mm512_permutexvar_epi16(v, table);
    wb = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(v, 4), table);
  };
  return matmul(xc, M, K, N, unpack, Scales(D), Scales(L), xsum.data());
}
#endif
