// dspark's int4 weight-only matmul (and its Q8_0 and bf16 variants) for CPUs with AVX512-BF16
// (docs/history/benchmarks.md, "dspark's own int4 kernel"); an AVX2 + FMA build of the same scheme
// follows it ("a matmul tile for AVX2 CPUs").
//
// y [M, N] = x [M, K] @ W.T, W held as 4-bit groups of 32 inputs: w = q * d + lo (the GGUF Q4_1
// rule), bf16 activations, fp32 sums, bf16 result; the AVX2 build's int4 matmul quantises the
// activations to 8 bits per group of 32 (`act8`, "8-bit activations for the AVX2 build's ..."). Compiled on first use
// by dspark/kernels.py.
//
// Why not torch's _weight_int4pack_mm_for_cpu: it vectorises along K, so every weight is
// unpacked and scaled once per row and 8 rows cost 3.4x one row. Here a vector holds 16 output
// columns x 2 inputs (one vdpbf16ps = 32 multiply-adds), each 4-bit weight is unpacked once per
// call whatever M is, and the group scale is applied once per group and row.
//
// Batch invariance, which lossless verification relies on: every y[m, n] is computed by the same
// operations in the same order whatever M is and whichever rows share the call (rows are taken
// 8 at a time, then the rest together, with the same per-row sequence; threads split columns,
// never a sum).
//
// Layout (made by kernels.pack_q4, which asks the build for its own):
//   P  [N/16, K/32, 8, 32] uint8: column block, group, then
//      AVX512-BF16: step r (inputs k = 32g + 4r + 0..3); byte 2c = q[c, k0] | q[c, k2] << 4,
//      byte 2c+1 = q[c, k1] | q[c, k3] << 4 (a step's 32 bytes widen to the 16-bit lanes of two
//      bf16 pair vectors);
//      AVX2 ("octets"): octet o of 64 bytes (inputs k = 32g + 8o + 0..7); 16-bit word 2c + i
//      holds q[c, k + 2j + i] in its nibble j (0..3): one byte mask (after a 4-bit shift for odd
//      steps) gives a step's 4 bytes per column, with no widening (`tile_a8`, docs/history/benchmarks.md
//      "... two kernel layouts ...")
//   D, L [N/16, K/32, 16] fp32 or fp16 (`Scales`): d and lo of each column of the block
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <array>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

template <int V>
using Int = std::integral_constant<int, V>;

// 8 bf16 -> fp32 (exact) and back (both builds have AVX2; q4's AVX2 tile and the norms use them)
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

// every accumulator of a tile [blocks][rows] set to v (the ISA's zero vector)
template <typename Vec, int NB, int M>
inline void fill(Vec (&acc)[NB][M], Vec v) {
#pragma GCC unroll 8
  for (int j = 0; j < NB; ++j)
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) acc[j][m] = v;
}

// x [..., K] bf16 (M rows: every dimension but the last) against a weight packed as [N/16, K/32,
// steps, 32] elements of `dtype`, with per-group tensors [N/16, K/32, 16] (scales, minimums; fp32, or
// fp16 where each value is one, all of one dtype):
// checked, -> (M, K, N). Taking x's own shape spares the caller two reshapes a matmul (~240 small
// ops a SmolLM2 forward).
std::array<int64_t, 3> packed_shape(const char* name, const torch::Tensor& x, const torch::Tensor& P,
                                    at::ScalarType dtype, int64_t steps, std::initializer_list<torch::Tensor> groups) {
  TORCH_CHECK(x.dim() >= 1 && x.scalar_type() == torch::kBFloat16 && x.device().is_cpu(), name,
              ": x must be a bf16 CPU tensor [..., K]");
  TORCH_CHECK(P.dim() == 4 && P.scalar_type() == dtype && P.size(2) == steps && P.size(3) == 32 && P.is_contiguous(),
              name, ": P must be a contiguous ", c10::toString(dtype), " [N/16, K/32, ", steps, ", 32] tensor");
  const int64_t K = x.size(-1), N = P.size(0) * 16;
  TORCH_CHECK(K == P.size(1) * 32 && K > 0, name, ": x has ", K, " inputs, the weight ", P.size(1) * 32);
  const int64_t M = x.numel() / K;
  for (const auto& s : groups)
    TORCH_CHECK((s.scalar_type() == torch::kFloat || s.scalar_type() == torch::kHalf) &&
                    s.scalar_type() == groups.begin()->scalar_type() && s.is_contiguous() &&
                    s.numel() == N / 16 * (K / 32) * 16,
                name, ": its scales must be contiguous fp32 or fp16 [N/16, K/32, 16] tensors of one dtype");
  return {M, K, N};
}

// a weight's per-group scales or minimums [N/16, K/32, 16]: fp32, or fp16 where every value is
// one (GGUF stores them so; kernels.pack_q4 / pack_q8 check): the same fp32 values with a sixth
// fewer bytes to stream for an int4 weight at one row. p null: none.
struct Scales {
  const void* p = nullptr;
  bool half = false;
  Scales() = default;
  explicit Scales(const torch::Tensor& t) : p(t.data_ptr()), half(t.scalar_type() == torch::kHalf) {}
#ifdef __F16C__
  // 8 values from index i, widened to fp32 (exact); both builds have F16C
  __m256 load8(int64_t i) const {
    return half
               ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + i)))
               : _mm256_loadu_ps(static_cast<const float*>(p) + i);
  }
#endif
#ifdef __AVX512F__
  __m512 load16(int64_t i) const {
    return half ? _mm512_cvtph_ps(
                      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(p) + i)))
                : _mm512_loadu_ps(static_cast<const float*>(p) + i);
  }
#endif
};

// Each unpack also asks for the weight bytes AHEAD bytes further on, into L2 (docs/history/benchmarks.md,
// "weights asked for ahead of the tile"). Left to the hardware's prefetcher, a tile waited on memory and computed in
// turn: 8 rows of a bf16 stack cost one row's streaming time plus their arithmetic (14.4 against 8.2 ms for SmolLM2's
// 120 layer matrices); asked ahead, 10.1 ms. L1 (T0) hurt at every row count, as did distances of 2-8 KB. A tile's
// column blocks are consecutive in memory, so AHEAD is ~a tile on.
constexpr int64_t AHEAD = 16384;
inline void prefetch_ahead(const void* p) { _mm_prefetch(static_cast<const char*>(p) + AHEAD, _MM_HINT_T1); }

// the sum of a group's 32 values (4 vectors of 8, fp32) by one fixed tree: the vectors added in
// pairs, then across the 8 lanes. The AVX-512 build's Q4_1 minimum's term (lo x the group's sum
// of x); summed one input after the other, the sums of 8 rows cost more than the rest of their group ("8-bit
// activations ...").
inline float sum32(const __m256 (&v)[4]) {
  const __m256 t = _mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3]));
  __m128 u = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
  u = _mm_add_ps(u, _mm_movehl_ps(u, u));
  return _mm_cvtss_f32(_mm_add_ss(u, _mm_shuffle_ps(u, u, 1)));
}

// per row and group of 32 inputs: the sum of x (bf16 [M, K]) in fp32 (`sum32`)
std::vector<float> group_sums(const uint16_t* x, int64_t M, int64_t K) {
  const int64_t G = K / 32;
  std::vector<float> s(M * G);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g) {
      const uint16_t* p = x + m * K + g * 32;
      const __m256 v[4] = {bf16x8_to_f32(p), bf16x8_to_f32(p + 8), bf16x8_to_f32(p + 16), bf16x8_to_f32(p + 24)};
      s[m * G + g] = sum32(v);
    }
  return s;
}

// x's shape with the last dimension N: the matmul's result
std::vector<int64_t> out_shape(const torch::Tensor& x, int64_t N) {
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  return sizes;
}

// rows m0..m0+M against all columns, in tiles of NB blocks of UNIT columns split between threads
// (never inside a sum), then the blocks left over one at a time; tile(Int<M>, Int<NB>, m0, block)
template <int UNIT, int M, int NB, typename Tile>
void columns(int64_t N, int64_t m0, const Tile& tile) {
  const int64_t blocks = N / UNIT, tiles = blocks / NB;
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) tile(Int<M>{}, Int<NB>{}, m0, t * NB);
  });
  for (int64_t cb = tiles * NB; cb < blocks; ++cb) tile(Int<M>{}, Int<1>{}, m0, cb);
}

// rows in tiles of 8, then the rest (1-7) in one tile: each tile streams the whole weight, so a
// verify of 3 or 7 rows reads it once, not two or three times (taken 4 + 2 + 1, 7 rows cost 2.5x
// one row on a cold cache). Fewer rows take more column blocks a tile, so that the vector units
// have independent sums to interleave (NB1 blocks for a single row); a row's own operations are
// the same whatever the tile. NB2, NB3, NB4: blocks a tile for two, three and four rows.
template <int UNIT, int NB1, int NB2, int NB3 = 2, int NB4 = 2, typename Tile>
void row_tiles(int64_t M, int64_t N, const Tile& tile) {
  int64_t m = 0;
  for (; m + 8 <= M; m += 8) columns<UNIT, 8, 1>(N, m, tile);
  switch (M - m) {
    case 7: columns<UNIT, 7, 1>(N, m, tile); break;
    case 6: columns<UNIT, 6, 1>(N, m, tile); break;
    case 5: columns<UNIT, 5, 1>(N, m, tile); break;
    case 4: columns<UNIT, 4, NB4>(N, m, tile); break;
    case 3: columns<UNIT, 3, NB3>(N, m, tile); break;
    case 2: columns<UNIT, 2, NB2>(N, m, tile); break;
    case 1: columns<UNIT, 1, NB1>(N, m, tile); break;
    default: break;
  }
}

}  // namespace

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
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
            // the same arithmetic as below with fewer instructions to issue (+25 % at 8 rows)
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
  // (AHEAD), wide tiles stopped paying at 1-2 rows: one row takes 1 block a tile (was 2; a 1-token
  // int4 forward -0.30 ms), two rows 2 (was 4; the Q8_0 head 1.57 -> 1.31 ms, the int4 layers
  // 3.35 -> 3.10 ms at 2 rows, cold) (docs/history/benchmarks.md, "weights asked for ahead of the tile")
  row_tiles<16, 1, 2>(M, N, [&](auto rows, auto nb, int64_t m0, int64_t cb) {
    tile<decltype(rows)::value, decltype(nb)::value>(xp + m0 * K, K, unpack, D, L, xsum ? xsum + m0 * G : nullptr,
                                                     yp + m0 * N, N, cb);
  });
  return y;
}

}  // namespace

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

// bf16 weights: the same scheme with nothing to unpack, for the small row counts of a draft (oneDNN's
// packed bf16 matmul spent 75-170 us at 7 rows on a 576-wide layer of SmolLM2's draft). P16
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
#elif defined(__AVX2__) && defined(__FMA__)
// AVX2 + FMA (no bf16 dot product): the same packed layouts, walked 8 columns (half a block of 16)
// at a time. int4 and Q8_0 weights take 8-bit activations and integer sums (`tile_a8`,
// docs/history/benchmarks.md "8-bit activations ..."), unless built with DSPARK_ACT8=0 (kernels.py, from
// DSPARK_INT8_ACTIVATIONS=0): then, as bf16 weights (a draft's) always, every row adds w * x in
// fp32 in input order, one FMA a weight and row (`tile8`). A row's operations do not depend on M
// or on which rows share the call (batch invariance).
#ifndef DSPARK_ACT8
#define DSPARK_ACT8 1
#endif
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
// instead of one FMA each with its own broadcast: the SmolLM2 layer stack ran 1.6x faster at 1 row
// and 1.7x at 8 than with bf16 activations. A row's bytes, scales and sums depend on that row
// alone (batch invariance). Stored per row: xq [K] with each 8 inputs in the order (0, 4, 1, 5,
// 2, 6, 3, 7), that of a column's dword in a step's weight bytes (`tile_a8`); s [G]; NaN or
// infinity in a group makes its s NaN, so the result is NaN, never a finite number made of a
// clamped value; sum [G] s x the sum of the group's xq (the Q4_1 minimum's term).
struct Act8 {
  std::vector<int8_t> q;
  std::vector<float> s, sum;
};

Act8 act8(const uint16_t* x, int64_t M, int64_t K) {
  const int64_t G = K / 32;
  Act8 a{std::vector<int8_t>(M * K), std::vector<float>(M * G), std::vector<float>(M * G)};
  // rows split in two halves between threads from 8 K values (8 rows of 1 536: 6.6 -> 5.4 us a
  // call; 8 rows of 576 were slower split)
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
        // centred) met the rounding alone and the model's logits strayed ~6x further (KL)
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
          // GCC then spilled every product to the stack to add them later (4-8 rows 7-8 % slower)
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

#if DSPARK_ACT8
torch::Tensor q4_mm(torch::Tensor x, torch::Tensor P, torch::Tensor D, torch::Tensor L) {
  const auto shape = packed_shape("q4_mm", x, P, torch::kByte, 8, {D, L});
  return matmul_a8<true>(x, shape[0], shape[1], shape[2], P.data_ptr<uint8_t>(), Scales(D), Scales(L));
}

torch::Tensor q8_mm(torch::Tensor x, torch::Tensor P, torch::Tensor D) {
  const auto shape = packed_shape("q8_mm", x, P, torch::kChar, 16, {D});
  return matmul_a8<false>(x, shape[0], shape[1], shape[2], reinterpret_cast<const uint8_t*>(P.data_ptr<int8_t>()),
                          Scales(D));
}
#else  // bf16 activations (DSPARK_INT8_ACTIVATIONS=0: closer to the model, slower here)
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
#else
// a build without AVX2 (dspark/kernels.py never makes one) has no matmul kernels
torch::Tensor q4_mm(torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor) {
  TORCH_CHECK(false, "q4_mm: this build of dspark's extension has no int4 kernel (it needs AVX2 or AVX512-BF16)");
  return {};
}
torch::Tensor q8_mm(torch::Tensor, torch::Tensor, torch::Tensor) {
  TORCH_CHECK(false, "q8_mm: this build of dspark's extension has no int8 kernel (it needs AVX2 or AVX512-BF16)");
  return {};
}
torch::Tensor bf16_mm(torch::Tensor, torch::Tensor, torch::Tensor) {
  TORCH_CHECK(false, "bf16_mm: this build of dspark's extension has no bf16 kernel (it needs AVX2 or AVX512-BF16)");
  return {};
}
#endif
