// Attention over a prompt: many queries of one row over its keys, bf16, for a prefill (NativeTarget's
// logits "last" / "final"). attn.cpp computes each query on its own, so that a verify of a few positions
// gets exactly a 1-token step's bits; that costs a lane-sum tree per key and reloads every key for every
// query, which is most of a long prompt's prefill. Here the keys of a (batch row, KV head) are packed once
// as bf16 pairs (keys in lanes for q.k, value dimensions in lanes for p.v), and RB query rows share each
// packed register: q.k and p.v are both vdpbf16ps with a broadcast pair, nothing summed across lanes.
// The probabilities are rounded to bf16 for the p.v products (as torch's flash attention does for bf16
// inputs); a query's result still depends on its own keys only (not on which rows share the call), but it
// is not attn_bf16's bits: a prefill chunk is never compared bit for bit with a decode step.
// Where the CPU and the OS allow AMX-BF16 (amx.h), both products run on tiles instead (16 query rows x
// 16 keys, and 16 rows x 16 value dimensions, 32 bf16 products a tile row), with the same bf16 inputs.
// Needs AVX512-BF16 and heads of 64 or 128 values; elsewhere attn_bf16 runs.
#include <ATen/Parallel.h>

#include <algorithm>
#include <optional>
#include <string>
#include <cstring>
#include <vector>

#include "amx.h"
#include "dspark.h"
#include "vec.h"

#if defined(__AVX512BF16__)
namespace attn_prefill {

using attn::V;

constexpr int KB = 16;  // keys a block: the lanes of a q.k result
constexpr int RB = 8;   // query rows sharing each packed key register (q.k)
constexpr int QB = 16;  // positions a task: with G heads a task holds QB * G query rows

inline __m512bh bcast_pair(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return (__m512bh)_mm512_set1_epi32(v);
}

// k [n, D] bf16 rows -> kt [nb][D/2][16] pairs (nb blocks of 16 keys, nb * 16 >= n): block kb, pair p, lane j = (k[16
// kb + j][2p], k[.][2p + 1]); v [n, D] -> vp [nb * 8][D] pairs: key pair jp, lane d = (v[2 jp][d], v[2 jp + 1][d]).
// Keys >= n are zeros (finite: a zero probability times them adds nothing).
void pack(const uint16_t* k, const uint16_t* v, int64_t n, int64_t nb, int64_t D, uint32_t* kt, uint32_t* vp) {
  const int64_t P = D / 2;
  for (int64_t kb = 0; kb < nb; ++kb)
    for (int64_t j = 0; j < KB; ++j) {
      const int64_t key = kb * KB + j;
      uint32_t* dst = kt + kb * P * KB + j;
      if (key < n) {
        const uint32_t* row = reinterpret_cast<const uint32_t*>(k + key * D);
        for (int64_t p = 0; p < P; ++p) dst[p * KB] = row[p];
      } else {
        for (int64_t p = 0; p < P; ++p) dst[p * KB] = 0;
      }
    }
  for (int64_t jp = 0; jp < nb * KB / 2; ++jp) {
    const int64_t a = 2 * jp, b = a + 1;
    for (int64_t d = 0; d < D; ++d) {
      const uint32_t lo = a < n ? v[a * D + d] : 0, hi = b < n ? v[b * D + d] : 0;
      vp[jp * D + d] = lo | (hi << 16);
    }
  }
}

// one key block's scores (unscaled) for RN query rows (RN fixed: the accumulators stay in registers)
template <int P, int RN>
inline void score_block(const at::BFloat16* q, int64_t qs, const uint32_t* blk, float* out, int64_t np) {
  V acc[RN];
  for (int r = 0; r < RN; ++r) acc[r] = _mm512_setzero_ps();
  for (int p = 0; p < P; ++p) {
    const __m512bh kv = (__m512bh)_mm512_loadu_si512(blk + p * KB);
    for (int r = 0; r < RN; ++r) acc[r] = _mm512_dpbf16_ps(acc[r], bcast_pair(q + r * qs + 2 * p), kv);
  }
  for (int r = 0; r < RN; ++r) _mm512_storeu_ps(out + r * np, acc[r]);
}

// scores [rows][np] (unscaled) of `rows` query rows q (row i at q + i * qs) over key blocks 0..nb-1
template <int P>
void scores(const at::BFloat16* q, int64_t qs, int64_t rows, const uint32_t* kt, int64_t nb, float* out, int64_t np) {
  using Block = void (*)(const at::BFloat16*, int64_t, const uint32_t*, float*, int64_t);
  static constexpr Block by_rows[RB + 1] = {nullptr,           score_block<P, 1>, score_block<P, 2>,
                                            score_block<P, 3>, score_block<P, 4>, score_block<P, 5>,
                                            score_block<P, 6>, score_block<P, 7>, score_block<P, 8>};
  for (int64_t r0 = 0; r0 < rows; r0 += RB) {
    const Block f = by_rows[std::min<int64_t>(RB, rows - r0)];
    for (int64_t kb = 0; kb < nb; ++kb) f(q + r0 * qs, qs, kt + kb * P * KB, out + r0 * np + kb * KB, np);
  }
}

// softmax weights of one row's first n scores (times sc > 0), rounded to bf16 (zeros up to np) -> 1 / their
// fp32 sum
inline float weights(const float* s, float sc, int64_t n, int64_t np, uint16_t* p) {
  V mx = _mm512_set1_ps(-INFINITY);
  for (int64_t j = 0; j < n; j += KB) {
    const __mmask16 live = static_cast<__mmask16>(n - j >= KB ? 0xFFFF : (1u << (n - j)) - 1);
    mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), live, s + j));
  }
  const V scv = _mm512_set1_ps(sc), m = _mm512_mul_ps(_mm512_set1_ps(_mm512_reduce_max_ps(mx)), scv);
  V sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < np; j += KB) {
    const int64_t left = std::max<int64_t>(0, std::min<int64_t>(KB, n - j));
    const __mmask16 live = static_cast<__mmask16>(left >= KB ? 0xFFFF : (1u << left) - 1);
    const V e =
        _mm512_maskz_mov_ps(live, attn::exp_neg<5>(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(live, s + j), scv, m)));
    sum = _mm512_add_ps(sum, e);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + j), attn::to_bf16_bits(e));
  }
  return 1.0f / _mm512_reduce_add_ps(sum);
}

// RN rows' outputs (row i: weights p + i * ps, bf16 key pairs 0..upto-1; output o + i * os) = p times vp,
// scaled by inv; the RN rows share each packed value register (RN, DW fixed: registers)
template <int DW, int RN>
inline void value_rows(const uint16_t* p, int64_t ps, int64_t upto, const uint32_t* vp, const float* inv,
                       at::BFloat16* o, int64_t os) {
  constexpr int D = DW * 16;
  V acc[RN][DW];
  for (int r = 0; r < RN; ++r)
    for (int c = 0; c < DW; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t jp = 0; jp < upto; ++jp) {
    __m512bh vv[DW];
    for (int c = 0; c < DW; ++c) vv[c] = (__m512bh)_mm512_loadu_si512(vp + jp * D + 16 * c);
    for (int r = 0; r < RN; ++r) {
      const __m512bh pb = bcast_pair(p + r * ps + 2 * jp);
      for (int c = 0; c < DW; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], pb, vv[c]);
    }
  }
  for (int r = 0; r < RN; ++r)
    for (int c = 0; c < DW; ++c)
      attn::store_bf16(o + r * os + 16 * c, _mm512_mul_ps(acc[r][c], _mm512_set1_ps(inv[r])));
}

// every row's output (row i over its first n[i] keys): R rows at a time, each group as far as its
// longest row's key pairs
template <int DW, int R>
void values(const uint16_t* p, int64_t ps, int64_t rows, const int64_t* n, const uint32_t* vp, const float* inv,
            at::BFloat16* o, int64_t os) {
  for (int64_t r0 = 0; r0 < rows; r0 += R) {
    const int64_t rn = std::min<int64_t>(R, rows - r0);
    int64_t upto = 0;
    for (int r = 0; r < rn; ++r) upto = std::max(upto, (n[r0 + r] + 1) / 2);
    const uint16_t* pr = p + r0 * ps;
    if (rn == R) {
      value_rows<DW, R>(pr, ps, upto, vp, inv + r0, o + r0 * os, os);
    } else {
      for (int64_t r = 0; r < rn; ++r)
        value_rows<DW, 1>(pr + r * ps, ps, upto, vp, inv + r0 + r, o + (r0 + r) * os, os);
    }
  }
}

#if defined(DSPARK_AMX)
// scores [rows16][np] (unscaled) of rows16 (a multiple of 16) query rows q [rows16][D] over key blocks
// 0..nb-1 on tiles: C (tiles 0-3, four key blocks) += A (tile 4: 16 rows x 32 values of q) x B (tiles
// 5-7: kt's 16 pairs x 16 keys)
template <int DC>
void scores_amx(const at::BFloat16* q, int64_t rows16, const uint32_t* kt, int64_t nb, float* out, int64_t np) {
  constexpr int P = DC * 16;
  const int64_t qstride = DC * 64, ostride = np * 4;
  for (int64_t r0 = 0; r0 < rows16; r0 += 16) {
    for (int64_t kb = 0; kb < nb; kb += 4) {
      const int64_t m = std::min<int64_t>(4, nb - kb);
      const uint32_t* b0 = kt + kb * P * KB;
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int c = 0; c < DC; ++c) {
        _tile_loadd(4, q + r0 * DC * 32 + 32 * c, qstride);
        const uint32_t* bc = b0 + c * 16 * KB;
        _tile_loadd(5, bc, 64);
        _tile_dpbf16ps(0, 4, 5);
        if (m > 1) {
          _tile_loadd(6, bc + P * KB, 64);
          _tile_dpbf16ps(1, 4, 6);
        }
        if (m > 2) {
          _tile_loadd(7, bc + 2 * P * KB, 64);
          _tile_dpbf16ps(2, 4, 7);
        }
        if (m > 3) {
          _tile_loadd(5, bc + 3 * P * KB, 64);
          _tile_dpbf16ps(3, 4, 5);
        }
      }
      float* o = out + r0 * np + kb * KB;
      _tile_stored(0, o, ostride);
      if (m > 1) _tile_stored(1, o + KB, ostride);
      if (m > 2) _tile_stored(2, o + 2 * KB, ostride);
      if (m > 3) _tile_stored(3, o + 3 * KB, ostride);
    }
  }
}

// heads of 64: the row tile's query in tiles 4 and 5 (its two halves) for all its keys, two key blocks at a
// time into C tiles C0, C1 (the next pair goes to the other two, so its products need not wait for these
// stores), the keys through tiles 6 and 7
// (a macro: GCC's tile intrinsics paste their tile numbers into the instruction text)
#define DSPARK_TWO_BLOCKS64(C0, C1, b, o, ostride) \
  do {                                             \
    const uint32_t* b_ = (b);                      \
    float* o_ = (o);                               \
    _tile_zero(C0);                                \
    _tile_zero(C1);                                \
    _tile_loadd(6, b_, 64);                        \
    _tile_dpbf16ps(C0, 4, 6);                      \
    _tile_loadd(7, b_ + 16 * KB, 64);              \
    _tile_dpbf16ps(C0, 5, 7);                      \
    _tile_loadd(6, b_ + 32 * KB, 64);              \
    _tile_dpbf16ps(C1, 4, 6);                      \
    _tile_loadd(7, b_ + 48 * KB, 64);              \
    _tile_dpbf16ps(C1, 5, 7);                      \
    _tile_stored(C0, o_, ostride);                 \
    _tile_stored(C1, o_ + KB, ostride);            \
  } while (0)

// scores_amx for heads of 64 (nb even: keys are packed in blocks of 32)
void scores_amx64(const at::BFloat16* q, int64_t rows16, const uint32_t* kt, int64_t nb, float* out, int64_t np) {
  const int64_t ostride = np * 4;
  for (int64_t r0 = 0; r0 < rows16; r0 += 16) {
    _tile_loadd(4, q + r0 * 64, 128);
    _tile_loadd(5, q + r0 * 64 + 32, 128);
    float* o = out + r0 * np;
    for (int64_t kb = 0; kb < nb; kb += 4) {
      DSPARK_TWO_BLOCKS64(0, 1, kt + kb * 32 * KB, o + kb * KB, ostride);
      if (kb + 2 < nb) DSPARK_TWO_BLOCKS64(2, 3, kt + (kb + 2) * 32 * KB, o + (kb + 2) * KB, ostride);
    }
  }
}

// out [rows16][D] fp32 = p [rows16][np] (bf16 weights) x values, rows 16 at a time as far as their longest
// row's key pairs (upto[tile], in pairs): C (tiles 0-3, four chunks of 16 value dimensions) += A (tile 4:
// 16 rows x 32 keys of p) x B (tiles 5-7: vp's 16 key pairs x 16 dimensions)
template <int DCH>
void values_amx(const uint16_t* p, int64_t np, int64_t rows16, const int64_t* upto, const uint32_t* vp, float* out) {
  constexpr int D = DCH * 16;
  for (int64_t r0 = 0; r0 < rows16; r0 += 16) {
    const int64_t n32 = (2 * upto[r0 / 16] + 31) / 32;
    for (int c0 = 0; c0 < DCH; c0 += 4) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t t = 0; t < n32; ++t) {
        _tile_loadd(4, p + r0 * np + 32 * t, np * 2);
        const uint32_t* b = vp + 16 * t * D + 16 * c0;
        _tile_loadd(5, b, D * 4);
        _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(6, b + 16, D * 4);
        _tile_dpbf16ps(1, 4, 6);
        _tile_loadd(7, b + 32, D * 4);
        _tile_dpbf16ps(2, 4, 7);
        _tile_loadd(5, b + 48, D * 4);
        _tile_dpbf16ps(3, 4, 5);
      }
      float* o = out + r0 * D + 16 * c0;
      _tile_stored(0, o, D * 4);
      _tile_stored(1, o + 16, D * 4);
      _tile_stored(2, o + 32, D * 4);
      _tile_stored(3, o + 48, D * 4);
    }
  }
}
#endif

}  // namespace attn_prefill
#endif

// q [B, S, Hq, D] bf16, k / v [B, Hkv, C, D] bf16 (rows contiguous), pos [B, S] int64: query (b, s) sees keys
// 0..pos[b, s] -> o [B, S, Hq * D] bf16, as attn_bf16 (whose bits it does not promise: see the header)
torch::Tensor attn_prefill_bf16(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor pos, double scale) {
#if defined(__AVX512BF16__)
  using namespace attn_prefill;
  const int64_t D = q.dim() == 4 ? q.size(3) : 0;
  if (!(D == 64 || D == 128)) return attn_bf16(q, k, v, pos, scale);
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && q.scalar_type() == torch::kBFloat16 &&
                  k.scalar_type() == torch::kBFloat16 && v.scalar_type() == torch::kBFloat16,
              "attn_prefill_bf16: q, k, v must be 4-D bf16");
  const int64_t B = q.size(0), S = q.size(1), Hq = q.size(2), Hkv = k.size(1), C = k.size(2);
  TORCH_CHECK(k.size(3) == D && v.sizes() == k.sizes() && k.size(0) == B && Hq % Hkv == 0,
              "attn_prefill_bf16: head sizes must agree");
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1 && k.stride(2) == D && v.stride(2) == D,
              "attn_prefill_bf16: cache rows must be contiguous");
  TORCH_CHECK(pos.dim() == 2 && pos.size(0) == B && pos.size(1) == S && pos.scalar_type() == torch::kLong,
              "attn_prefill_bf16: pos must be [B, S] int64");
  const bool tiles = amx::state().ok;
  auto qc = q.contiguous();
  auto pc = pos.contiguous();
  const int64_t* pp = pc.data_ptr<int64_t>();
  std::vector<int64_t> nmax(B, 0);  // keys a batch row's queries read at most
  for (int64_t b = 0; b < B; ++b)
    for (int64_t s = 0; s < S; ++s) {
      const int64_t x = pp[b * S + s];
      TORCH_CHECK(x >= 0 && x < C, "attn_prefill_bf16: position ", x, " outside the cache of ", C);
      nmax[b] = std::max(nmax[b], x + 1);
    }
  const int64_t G = Hq / Hkv, P = D / 2;
  // keys packed in blocks of 32 (the tiles' p.v reads 32 keys a row), zeros past a row's last key
  int64_t npmax = 0;
  for (int64_t b = 0; b < B; ++b) npmax = std::max(npmax, (nmax[b] + 31) / 32 * 32);
  // packed keys and values of every (batch row, KV head): [B * Hkv][npmax * D / 2] 32-bit pairs each
  std::vector<uint32_t> kt(B * Hkv * npmax * P), vp(B * Hkv * npmax / 2 * D);
  const auto* kp = reinterpret_cast<const uint16_t*>(k.data_ptr<at::BFloat16>());
  const auto* vpt = reinterpret_cast<const uint16_t*>(v.data_ptr<at::BFloat16>());
  at::parallel_for(0, B * Hkv, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / Hkv, h = t % Hkv;
      pack(kp + b * k.stride(0) + h * k.stride(1), vpt + b * v.stride(0) + h * v.stride(1), nmax[b], npmax / KB, D,
           kt.data() + t * npmax * P, vp.data() + t * npmax / 2 * D);
    }
  });
  auto o = torch::empty({B, S, Hq * D}, q.options());
  const at::BFloat16* qp = qc.data_ptr<at::BFloat16>();
  at::BFloat16* op = o.data_ptr<at::BFloat16>();
  const int64_t nq = (S + QB - 1) / QB, tasks = B * Hkv * nq;
  const float sc = static_cast<float>(scale);
  // task i -> query block: the first and last blocks alternate, so that each thread's contiguous share of
  // the tasks holds as many early (few keys) as late (many keys) blocks under a causal mask
  at::parallel_for(0, tasks, 1, [&](int64_t i0, int64_t i1) {
#if defined(DSPARK_AMX)
    std::optional<amx::Tiles> tile_cfg;
    if (tiles) tile_cfg.emplace();
#endif
    std::vector<float> sbuf, obuf;
    std::vector<uint16_t> pbuf;
    std::vector<int64_t> nrow, upto;
    std::vector<float> inv;
    std::vector<at::BFloat16> qrows, orows;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t bh = i / nq, j = i % nq, qb = j % 2 == 0 ? j / 2 : nq - 1 - j / 2;
      const int64_t b = bh / Hkv, h = bh % Hkv, s0 = qb * QB, sn = std::min<int64_t>(QB, S - s0), rows = sn * G;
      const int64_t rows16 = (rows + 15) / 16 * 16;  // the tiles' row count (zero rows past `rows`)
      int64_t n_hi = 0;
      for (int64_t s = s0; s < s0 + sn; ++s) n_hi = std::max(n_hi, pp[b * S + s] + 1);
      const int64_t np = (n_hi + 31) / 32 * 32, nb = (tiles ? np : n_hi + KB - 1) / KB;
      // the task's query rows (position-major, then head) gathered contiguous: rows x D
      qrows.resize(rows16 * D);  // the rows past `rows` zero: the tiles read them
      std::memset(qrows.data() + rows * D, 0, (rows16 - rows) * D * sizeof(at::BFloat16));
      nrow.resize(rows);
      for (int64_t s = 0; s < sn; ++s)
        for (int64_t g = 0; g < G; ++g) {
          std::memcpy(qrows.data() + (s * G + g) * D, qp + ((b * S + s0 + s) * Hq + h * G + g) * D,
                      D * sizeof(at::BFloat16));
          nrow[s * G + g] = pp[b * S + s0 + s] + 1;
        }
      sbuf.resize(rows16 * np);
      pbuf.resize(rows16 * np);  // each row's weights written up to np by `weights`; the padding rows zero
      std::memset(pbuf.data() + rows * np, 0, (rows16 - rows) * np * sizeof(uint16_t));
      inv.resize(rows);
      orows.resize(rows * D);
      const uint32_t* ktb = kt.data() + bh * npmax * P;
      const uint32_t* vpb = vp.data() + bh * npmax / 2 * D;
#if defined(DSPARK_AMX)
      if (tiles) {
        if (D == 64)
          scores_amx64(qrows.data(), rows16, ktb, nb, sbuf.data(), np);
        else
          scores_amx<4>(qrows.data(), rows16, ktb, nb, sbuf.data(), np);
      } else
#endif
      {
        if (D == 64)
          scores<32>(qrows.data(), D, rows, ktb, nb, sbuf.data(), np);
        else
          scores<64>(qrows.data(), D, rows, ktb, nb, sbuf.data(), np);
      }
      for (int64_t r = 0; r < rows; ++r) inv[r] = weights(sbuf.data() + r * np, sc, nrow[r], np, pbuf.data() + r * np);
#if defined(DSPARK_AMX)
      if (tiles) {
        upto.assign(rows16 / 16, 0);
        for (int64_t r = 0; r < rows; ++r) upto[r / 16] = std::max(upto[r / 16], (nrow[r] + 1) / 2);
        obuf.resize(rows16 * D);
        if (D == 64)
          values_amx<4>(pbuf.data(), np, rows16, upto.data(), vpb, obuf.data());
        else
          values_amx<8>(pbuf.data(), np, rows16, upto.data(), vpb, obuf.data());
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t d = 0; d < D; d += 16)
            attn::store_bf16(orows.data() + r * D + d,
                             _mm512_mul_ps(_mm512_loadu_ps(obuf.data() + r * D + d), _mm512_set1_ps(inv[r])));
      } else
#endif
      {
        if (D == 64)
          values<4, 4>(pbuf.data(), np, rows, nrow.data(), vpb, inv.data(), orows.data(), D);
        else
          values<8, 2>(pbuf.data(), np, rows, nrow.data(), vpb, inv.data(), orows.data(), D);
      }
      // row (position s, head g) -> o[b, s0 + s, h * G + g]: a position's G heads are contiguous
      for (int64_t s = 0; s < sn; ++s)
        std::memcpy(op + ((b * S + s0 + s) * Hq + h * G) * D, orows.data() + s * G * D, G * D * sizeof(at::BFloat16));
    }
  });
  return o;
#else
  return attn_bf16(q, k, v, pos, scale);
#endif
}

// no AMX tiles in this process (dspark's kernels choice "avx512"): called before any kernel runs, since
// the tiles' state is settled at their first use
void amx_off() { amx::allowed() = false; }

// which attention a prefill runs here: 'amx-bf16', 'avx512-bf16', or 'per query' (attn_bf16) and why
std::string attn_prefill_kind() {
#if defined(__AVX512BF16__)
  return amx::state().ok ? "amx-bf16" : "avx512-bf16 (" + amx::state().why + ")";
#else
  return "per query (this build has no AVX512-BF16)";
#endif
}
