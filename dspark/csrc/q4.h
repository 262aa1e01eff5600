// What the two builds of the matmuls (q4_avx512.cpp, q4_avx2.cpp) share: the packed layout's
// checks, the group scales, prefetching ahead, and how rows and columns are split into tiles.
// The packed layout itself is described in q4_avx512.cpp's header.
#pragma once
#include "dspark.h"
#include "simd.h"

#include <array>
#include <initializer_list>
#include <type_traits>
#include <vector>

namespace q4 {

#if defined(DSPARK_SIMD_AVX2)
using simd::bf16x8_to_f32;
using simd::to_bf16x8;
using simd::widen_bf16x8;
#endif

template <int V>
using Int = std::integral_constant<int, V>;
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
inline std::array<int64_t, 3> packed_shape(const char* name, const torch::Tensor& x, const torch::Tensor& P,
                                           at::ScalarType dtype, int64_t steps,
                                           std::initializer_list<torch::Tensor> groups) {
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
// one (GGUF stores them so; packing.pack_q4 / pack_q8 check): the same fp32 values with a sixth
// fewer bytes to stream for an int4 weight at one row. p null: none.
struct Scales {
  const void* p = nullptr;
  bool half = false;
  Scales() = default;
  explicit Scales(const torch::Tensor& t) : p(t.data_ptr()), half(t.scalar_type() == torch::kHalf) {}
  // value i widened to fp32 (exact): the generic build's one at a time
  float at(int64_t i) const {
    return half ? static_cast<float>(c10::Half(static_cast<const uint16_t*>(p)[i], c10::Half::from_bits()))
                : static_cast<const float*>(p)[i];
  }
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
// turn: several rows cost one row's streaming time plus all their arithmetic; asked ahead, the two overlap. L1 (T0)
// hurt at every row count, as did distances of a few KB. A tile's column blocks are consecutive in memory, so AHEAD
// is ~a tile on.
constexpr int64_t AHEAD = 16384;
inline void prefetch_ahead(const void* p) { __builtin_prefetch(static_cast<const char*>(p) + AHEAD, 0, 2); }

#if defined(DSPARK_SIMD_AVX2)
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
inline std::vector<float> group_sums(const uint16_t* x, int64_t M, int64_t K) {
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

#endif

// a build's 8-bit activations (each 8-bit build's `act8`): per row xq [K] in the order its tile reads
// them, s [G] per group of 32 (NaN where the group holds NaN or infinity: its results are then NaN,
// never a finite number made of a clamped value), sum [G] = s x the group's sum of xq (the Q4_1
// minimum's term)
struct Act8 {
  std::vector<int8_t> q;
  std::vector<float> s, sum;
  Act8(int64_t M, int64_t K) : q(M * K), s(M * (K / 32)), sum(M * (K / 32)) {}
};

// a build's 8-bit matmul: x (bf16, M rows of K) against a packed int4 (D, L) or Q8_0 (D) weight of N
// outputs -> y bf16 (q4_avx2.cpp, q4_avx512_vnni.cpp, q4_generic.cpp: `matmul_a8<Q4>`)
using Matmul8 = torch::Tensor (*)(const torch::Tensor& x, int64_t M, int64_t K, int64_t N, const uint8_t* p,
                                  const Scales& D, const Scales& L);

// q4_mm / q8_mm of such a build: the packed weight's checks, then its matmul
inline torch::Tensor q4_mm_a8(const torch::Tensor& x, const torch::Tensor& P, const torch::Tensor& D,
                              const torch::Tensor& L, Matmul8 mm) {
  const auto shape = packed_shape("q4_mm", x, P, torch::kByte, 8, {D, L});
  return mm(x, shape[0], shape[1], shape[2], P.data_ptr<uint8_t>(), Scales(D), Scales(L));
}
inline torch::Tensor q8_mm_a8(const torch::Tensor& x, const torch::Tensor& P, const torch::Tensor& D, Matmul8 mm) {
  const auto shape = packed_shape("q8_mm", x, P, torch::kChar, 16, {D});
  return mm(x, shape[0], shape[1], shape[2], reinterpret_cast<const uint8_t*>(P.data_ptr<int8_t>()), Scales(D),
            Scales());
}

// x's shape with the last dimension N: the matmul's result
inline std::vector<int64_t> out_shape(const torch::Tensor& x, int64_t N) {
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  return sizes;
}

// up to this many rows run chunk by chunk of columns (`row_chunks`): measured on a 9-15-row verify
// (Intel Xeon with AMX); from 16 rows the two orders took the same time, and a longer prompt's rows
// stay tile after tile, each tile's rows held in L1 while the weights stream
constexpr int64_t CHUNK_ROWS_MAX = 15;

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

// 8 + R rows (9-15) over column chunks of NBR blocks: each chunk runs the 8-row tile, then the R
// rows left (NBR blocks a tile), so a chunk's weights come from memory once, for its first tile,
// and the other reads them from the caches; tile after tile over all the columns streamed the
// whole weight once per tile.
template <int UNIT, int R, int NBR, typename Tile>
void row_chunks(int64_t N, const Tile& tile) {
  const int64_t blocks = N / UNIT, chunks = blocks / NBR;
  auto run = [&](int64_t cb, auto nb) {
    for (int j = 0; j < decltype(nb)::value; ++j) tile(Int<8>{}, Int<1>{}, 0, cb + j);
    tile(Int<R>{}, nb, 8, cb);
  };
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) run(c * NBR, Int<NBR>{});
  });
  for (int64_t cb = chunks * NBR; cb < blocks; ++cb) run(cb, Int<1>{});
}

// rows in tiles of 8, then the rest (1-7) in one tile: each tile streams the whole weight, so a
// verify of 3 or 7 rows reads it once, not two or three times (taken 4 + 2 + 1, a 7-row verify streamed
// the weights three times from a cold cache); more than 8 rows run chunk by chunk of columns (`row_chunks`). Fewer
// rows take more column blocks a tile, so that the vector units have independent sums to
// interleave (NB1 blocks for a single row); a row's own operations are the same whatever the
// tile. NB2, NB3, NB4: blocks a tile for two, three and four rows.
template <int UNIT, int NB1, int NB2, int NB3 = 2, int NB4 = 2, typename Tile>
void row_tiles(int64_t M, int64_t N, const Tile& tile) {
  if (M > 8 && M <= CHUNK_ROWS_MAX) {
    switch (M - 8) {
      case 7: return row_chunks<UNIT, 7, 1>(N, tile);
      case 6: return row_chunks<UNIT, 6, 1>(N, tile);
      case 5: return row_chunks<UNIT, 5, 1>(N, tile);
      case 4: return row_chunks<UNIT, 4, NB4>(N, tile);
      case 3: return row_chunks<UNIT, 3, NB3>(N, tile);
      case 2: return row_chunks<UNIT, 2, NB2>(N, tile);
      default: return row_chunks<UNIT, 1, NB1>(N, tile);
    }
  }
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

}  // namespace q4
