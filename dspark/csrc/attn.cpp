// Attention of a few new queries over the KV cache, bf16 (docs/history/benchmarks.md, "the rest of a forward in the
// same extension"). For 1-8 queries over a few hundred cached keys torch's flash-attention kernel spends its
// time on set-up; this does the arithmetic directly. Each query row (batch row, position, head) is computed on its own,
// over its keys 0..pos in a fixed order, so its result does not depend on which other rows or positions share the call:
// a verify of 8 positions gives each position exactly what a 1-token step would (lossless greedy verification in bf16).
// Built for AVX-512 (16 lanes) or AVX2 + FMA (8 lanes); the algorithm is the same, except that
// with AVX512-BF16 the q.k products of heads of 32k values are bf16 dot products (the two builds'
// bits differ; each is batch invariant).
#include "dspark.h"
#include "vec.h"
#include <ATen/Parallel.h>
#include <cmath>
#include <cstring>
#include <vector>

namespace attn {

// G query heads of one position that share a KV head, over keys 0..n-1: each key's row is
// loaded once for all G, and W keys' dot products are summed across lanes together. Every
// query's arithmetic is its own and fixed (its dot products in one order, the same tree per key,
// softmax and values in key order), so its result does not depend on which other queries,
// heads or positions share the call. GT / DWT: G and D / W fixed at compile time (registers), 0:
// read from g / dw (the same operations, in memory).
template <int GT, int DWT>
void attend(int64_t g_, int64_t dw_, const at::BFloat16* q, int64_t qstride, const at::BFloat16* kb,
            const at::BFloat16* vb, int64_t n, float sc, at::BFloat16* o, std::vector<float>& buf,
            std::vector<V>& vbuf) {
  // where the ISA has a bf16 dot product (vec.h BF16_DOT), heads of a multiple of 2W values (fixed at
  // compile time): q.k by it, pairs of values a lane, and the score scaled after the sum: no
  // widening of the keys, half the instructions a key (docs/history/benchmarks.md, "... the bf16
  // dot product in attention ...")
  constexpr bool BDOT = BF16_DOT && DWT > 0 && DWT % 2 == 0;
  const int64_t G = GT ? GT : g_, DW = DWT ? DWT : dw_, D = DW * W, np = (n + W - 1) / W * W;
  buf.resize(G * np + G);
  float* inv = buf.data() + G * np;  // [G] 1 / sum of each query's softmax weights
  constexpr bool fixed = GT > 0 && DWT > 0;
  V qv_f[fixed ? GT * DWT : 1], acc_f[fixed ? GT * DWT : 1], part_f[fixed ? GT * W : 1];
  if (!fixed) vbuf.resize(2 * G * DW + G * W);
  V* qv = fixed ? qv_f : vbuf.data();                   // [G][DW] queries, scaled
  V* acc = fixed ? acc_f : vbuf.data() + G * DW;        // [G][DW] sums of p * v
  V* part = fixed ? part_f : vbuf.data() + 2 * G * DW;  // [G][W] one chunk's dot products, before the lane sums
  constexpr int DB = BDOT ? DWT / 2 : 1;                // 2W bf16 values a register
  Pairs qb[BDOT ? GT * DB : 1];
  if constexpr (BDOT)
    for (int64_t g = 0; g < G; ++g)
      for (int c = 0; c < DB; ++c) qb[g * DB + c] = load_pairs(q + g * qstride + 2 * W * c);
  else
    for (int64_t g = 0; g < G; ++g)
      for (int64_t c = 0; c < DW; ++c) qv[g * DW + c] = mul(load_bf16(q + g * qstride + W * c), set1(sc));
  for (int64_t j0 = 0; j0 < n; j0 += W) {
    const int64_t live = std::min<int64_t>(W, n - j0);
    for (int64_t k = 0; k < W; ++k) {
      if (k >= live) {
        for (int64_t g = 0; g < G; ++g) part[g * W + k] = zero();
        continue;
      }
      const at::BFloat16* kr = kb + (j0 + k) * D;
      if constexpr (BDOT) {
        Pairs kv2[DB];
        for (int c = 0; c < DB; ++c) kv2[c] = load_pairs(kr + 2 * W * c);
        for (int64_t g = 0; g < G; ++g) {
          V a = dot_pairs(zero(), qb[g * DB], kv2[0]);
          for (int c = 1; c < DB; ++c) a = dot_pairs(a, qb[g * DB + c], kv2[c]);
          part[g * W + k] = a;
        }
        continue;
      }
      V kv[DWT ? DWT : 32];
      for (int64_t c = 0; c < DW; ++c) kv[c] = load_bf16(kr + W * c);
      for (int64_t g = 0; g < G; ++g) {
        V a = mul(qv[g * DW], kv[0]);
        for (int64_t c = 1; c < DW; ++c) a = fma(qv[g * DW + c], kv[c], a);
        part[g * W + k] = a;
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      V sv = sum_lanes(part + g * W);
      if constexpr (BDOT) sv = mul(sv, set1(sc));
      std::memcpy(buf.data() + g * np + j0, &sv, sizeof(sv));
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    float* score = buf.data() + g * np;
    // the largest score by vectors of W keys (the last one's padding lanes -inf): one scalar max
    // after the other was a chain of n dependent operations (docs/history/benchmarks.md,
    // "... two kernel layouts ..."); a maximum is exact in any order (same bits)
    V mx = set1(-INFINITY);
    for (int64_t j = 0; j < n; j += W) {
      const int live = static_cast<int>(std::min<int64_t>(W, n - j));
      mx = vmax(mx, live == W ? load_n(score + j, W) : where_first(load_n(score + j, live), live));
    }
    const float m = hmax(mx);
    // softmax weights, W keys a vector (the last one padded with zeros): the same chunks for the same n
    V lsum = zero();
    const V mv = set1(m);
    for (int64_t j = 0; j < n; j += W) {
      const int live = static_cast<int>(std::min<int64_t>(W, n - j));
      // the scores' buffer holds whole vectors (np): the padding lanes are written as zeros
      const V e = keep_n(exp_neg(sub(load_n(score + j, live), mv)), live);
      std::memcpy(score + j, &e, sizeof(e));
      lsum = add(lsum, e);
    }
    inv[g] = 1.0f / sum(lsum);
  }
  for (int64_t i = 0; i < G * DW; ++i) acc[i] = zero();
  for (int64_t j = 0; j < n; ++j) {
    V vv[DWT ? DWT : 32];
    for (int64_t c = 0; c < DW; ++c) vv[c] = load_bf16(vb + j * D + W * c);
    for (int64_t g = 0; g < G; ++g) {
      const V pj = set1(buf[g * np + j]);
      for (int64_t c = 0; c < DW; ++c) acc[g * DW + c] = fma(pj, vv[c], acc[g * DW + c]);
    }
  }
  for (int64_t g = 0; g < G; ++g)
    for (int64_t c = 0; c < DW; ++c) store_bf16(o + g * D + W * c, mul(acc[g * DW + c], set1(inv[g])));
}

}  // namespace attn

// q [B, S, Hq, D] bf16 (any strides), k / v [B, Hkv, C, D] bf16 (last dim contiguous), pos [B, S]
// int64: query (b, s) sees keys 0..pos[b, s]. -> o [B, S, Hq * D] bf16 (the layout o_proj reads)
torch::Tensor attn_bf16(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor pos, double scale) {
  using namespace attn;
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && q.scalar_type() == torch::kBFloat16 &&
                  k.scalar_type() == torch::kBFloat16 && v.scalar_type() == torch::kBFloat16,
              "attn_bf16: q, k, v must be 4-D bf16");
  const int64_t B = q.size(0), S = q.size(1), Hq = q.size(2), D = q.size(3), Hkv = k.size(1), C = k.size(2);
  TORCH_CHECK(D % 16 == 0 && k.size(3) == D && v.sizes() == k.sizes() && k.size(0) == B && Hq % Hkv == 0,
              "attn_bf16: head sizes must agree and be a multiple of 16");
  TORCH_CHECK(D / W <= 32, "attn_bf16: heads of up to ", 32 * W, " values");
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1 && k.stride(2) == D && v.stride(2) == D,
              "attn_bf16: cache rows must be contiguous");
  TORCH_CHECK(pos.dim() == 2 && pos.size(0) == B && pos.size(1) == S && pos.scalar_type() == torch::kLong,
              "attn_bf16: pos must be [B, S] int64");
  auto qc = q.contiguous();
  auto pc = pos.contiguous();
  const int64_t* pp = pc.data_ptr<int64_t>();
  for (int64_t i = 0; i < B * S; ++i)
    TORCH_CHECK(pp[i] >= 0 && pp[i] < C, "attn_bf16: position ", pp[i], " outside the cache of ", C);
  auto o = torch::empty({B, S, Hq * D}, q.options());
  const at::BFloat16* qp = qc.data_ptr<at::BFloat16>();
  const at::BFloat16* kp = k.data_ptr<at::BFloat16>();
  const at::BFloat16* vp = v.data_ptr<at::BFloat16>();
  at::BFloat16* op = o.data_ptr<at::BFloat16>();
  const int64_t G = Hq / Hkv, ks0 = k.stride(0), ks1 = k.stride(1), vs0 = v.stride(0), vs1 = v.stride(1), DW = D / W;
  const float sc = static_cast<float>(scale);
  // one task per (batch row, position, KV head): its G query heads together
  at::parallel_for(0, B * S * Hkv, 1, [&](int64_t r0, int64_t r1) {
    std::vector<float> buf;
    std::vector<V> vbuf;
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t b = r / (S * Hkv), s = (r / Hkv) % S, h = r % Hkv, n = pp[b * S + s] + 1;
      const at::BFloat16* qr = qp + ((b * S + s) * Hq + h * G) * D;
      const at::BFloat16* kb = kp + b * ks0 + h * ks1;
      const at::BFloat16* vb = vp + b * vs0 + h * vs1;
      at::BFloat16* orow = op + ((b * S + s) * Hq + h * G) * D;
      // up to 4 query heads at a time, with their count and head size known to the compiler
      // (registers) for heads of 64 and 128 values; other sizes the same way at run time
      for (int64_t g0 = 0; g0 < G; g0 += 4) {
        const int64_t gs = std::min<int64_t>(4, G - g0);
        const at::BFloat16* qs = qr + g0 * D;
        at::BFloat16* os = orow + g0 * D;
        if (DW == 64 / W) {
          if (gs == 1)
            attend<1, 64 / W>(gs, DW, qs, D, kb, vb, n, sc, os, buf, vbuf);
          else if (gs == 2)
            attend<2, 64 / W>(gs, DW, qs, D, kb, vb, n, sc, os, buf, vbuf);
          else if (gs == 3)
            attend<3, 64 / W>(gs, DW, qs, D, kb, vb, n, sc, os, buf, vbuf);
          else
            attend<4, 64 / W>(gs, DW, qs, D, kb, vb, n, sc, os, buf, vbuf);
        } else if (DW == 128 / W) {
          if (gs == 1)
            attend<1, 128 / W>(gs, DW, qs, D, kb, vb, n, sc, os, buf, vbuf);
          else if (gs == 2)
            attend<2, 128 / W>(gs, DW, qs, D, kb, vb, n, sc, os, buf, vbuf);
          else if (gs == 3)
            attend<3, 128 / W>(gs, DW, qs, D, kb, vb, n, sc, os, buf, vbuf);
          else
            attend<4, 128 / W>(gs, DW, qs, D, kb, vb, n, sc, os, buf, vbuf);
        } else {
          attend<0, 0>(gs, DW, qs, D, kb, vb, n, sc, os, buf, vbuf);
        }
      }
    }
  });
  return o;
}

// silu(g) * u over the output of the fused gate/up projection gu [..., 2I] (gate | up), bf16, as
// torch's `F.silu(g) * u` rounds: silu in fp32, rounded to bf16, times u, rounded to bf16. One call
// instead of ~12 small ops a layer (chunk, split, narrows, silu, mul, their outputs). The sigmoid
// reads exp only at -|g| (exp_neg, ~1 ulp of fp32: torch's Sleef exp may round the other way
// once in ~10^5 values; below g = -87, where silu is under 1e-35, it gives 0, torch until -88.7).
// Elementwise: a row's result does not depend on the batch.
torch::Tensor silu_mul_bf16(torch::Tensor gu) {
  using namespace attn;
  TORCH_CHECK(gu.dim() >= 1 && gu.scalar_type() == torch::kBFloat16 && gu.device().is_cpu(),
              "silu_mul_bf16: gu must be a bf16 CPU tensor [..., 2I]");
  const int64_t I2 = gu.size(-1), I = I2 / 2;
  TORCH_CHECK(I2 % (2 * W) == 0 && I > 0, "silu_mul_bf16: the gate/up width must be a positive multiple of ", 2 * W,
              ", got ", I2);
  auto gc = gu.contiguous();
  auto sizes = gc.sizes().vec();
  sizes.back() = I;
  auto out = torch::empty(sizes, gc.options());
  const int64_t R = gc.numel() / I2;
  const at::BFloat16* gp = gc.data_ptr<at::BFloat16>();
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  // rows split between threads in blocks of 4 (a decode step's row runs inline; as the norms)
  at::parallel_for(0, R, 4, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t i = 0; i < I; i += W) {
        const V g = load_bf16(gp + r * I2 + i), u = load_bf16(gp + r * I2 + I + i);
        const V na = neg_abs(g);
        const V e = where_neg(add(na, set1(87.0f)), zero(), exp_neg(na));    // exp(-|g|), 0 below exp_neg's floor
        const V sig = div(where_neg(g, e, set1(1.0f)), add(set1(1.0f), e));  // sigmoid(g)
        alignas(64) at::BFloat16 s[W];
        store_bf16(s, mul(g, sig));  // silu(g) rounded to bf16, as torch's bf16 silu returns it
        store_bf16(op + r * I + i, mul(load_bf16(s), u));
      }
    }
  });
  return out;
}
