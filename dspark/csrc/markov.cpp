// The vanilla Markov head's greedy walk over a drafted block in one call (docs/history/benchmarks.md,
// "a cheaper draft phase"). In torch each slot is several small ops (W1 lookup, the rank-r matmul over the
// draft vocabulary, the add, the argmax, the d2t map), which dominated a many-slot draft phase on a 2-core
// CPU. Rounding as in the torch path, in the draft's dtype (bf16 or
// fp32): the bias W2 z is accumulated in fp32 and rounded to that dtype, added to the base logit
// in fp32 and rounded again; the first largest logit wins, as torch's argmax. Only the fp32
// summation order of the rank-r product differs from the matmul library's. Also here, with the
// same choice rule: `argmax_last`, greedy verification's argmax over the target's logits.
#include "dspark.h"
#include "vec.h"
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <cmath>
#include <algorithm>
#include <cstring>
#include <functional>
#include <limits>
#include <type_traits>
#include <vector>

namespace markov {

constexpr int64_t CHUNK = 512;  // vocabulary entries per parallel task

inline float round_as(float x, c10::BFloat16) { return static_cast<float>(c10::BFloat16(x)); }
// torch's argmax order: NaN above everything (the first NaN wins), otherwise the first largest
inline bool beats(float x, float best) { return std::isnan(x) ? !std::isnan(best) : x > best; }
inline float round_as(float x, float) { return x; }

constexpr int64_t BLOCK = 64;  // vocabulary entries at a time, each accumulating over k in order

// The Markov bias of entries v .. min(v + BLOCK, v1): acc[j] = sum_k z[k] * w2t[k][v + j], fp32, k in order.
template <typename T>
inline void bias_block(const float* z, const T* w2t, int64_t r, int64_t V, int64_t v, int64_t v1, float* acc) {
  constexpr int64_t L = BLOCK;
  if (v + L <= v1) {
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      // L / W independent registers (one alone waits on its add's latency every k); bf16 widened
      // exactly (vec.h); multiply then add, as the generic loop rounds
      using namespace attn;
      attn::V a[L / W];
      for (auto& x : a) x = zero();
      for (int64_t k = 0; k < r; ++k) {
        const attn::V zk = set1(z[k]);
        for (int q = 0; q < L / W; ++q) a[q] = add(a[q], mul(zk, load_bf16(w2t + k * V + v + W * q)));
      }
      for (int q = 0; q < L / W; ++q) std::memcpy(acc + W * q, &a[q], sizeof(a[q]));
    } else {  // a fixed trip count the compiler vectorises (ISO C++: no fused multiply-add)
      for (int64_t k = 0; k < r; ++k) {
        const float zk = z[k];
        const T* w = w2t + k * V + v;
        for (int64_t j = 0; j < L; ++j) acc[j] = acc[j] + zk * static_cast<float>(w[j]);
      }
    }
  } else {
    for (int64_t k = 0; k < r; ++k)
      for (int64_t j = 0; v + j < v1; ++j) acc[j] = acc[j] + z[k] * static_cast<float>(w2t[k * V + v + j]);
  }
}

// a slot's logit of entry v: T(base[v] + T(bias)), T the dtype (the torch path's two roundings)
template <typename T>
inline float logit_of(const T* base, int64_t v, float bias) {
  return round_as(static_cast<float>(base[v]) + round_as(bias, T{}), T{});
}

// The first largest of T(base[v] + T(sum_k z[k] * w2t[k][v])) over v in [v0, v1), T the dtype.
template <typename T>
void best_in(const T* base, const float* z, const T* w2t, int64_t r, int64_t V, int64_t v0, int64_t v1, float& best,
             int64_t& arg) {
  for (int64_t v = v0; v < v1; v += BLOCK) {
    float acc[BLOCK] = {0};
    bias_block(z, w2t, r, V, v, v1, acc);
    for (int64_t j = 0; j < BLOCK && v + j < v1; ++j) {
      const float logit = logit_of(base, v + j, acc[j]);
      if (beats(logit, best)) {
        best = logit;
        arg = v + j;
      }
    }
  }
}

// Every entry's logit T(base[v] + T(W2 z)[v]) of one slot into out [V] (fp32): the values best_in compares
template <typename T>
void slot_logits(const T* base, const float* z, const T* w2t, int64_t r, int64_t V, float* out) {
  const int64_t chunks = (V + CHUNK - 1) / CHUNK;
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t end = std::min(V, (c + 1) * CHUNK);
      for (int64_t v = c * CHUNK; v < end; v += BLOCK) {
        float acc[BLOCK] = {0};
        bias_block(z, w2t, r, V, v, end, acc);
        for (int64_t j = 0; j < BLOCK && v + j < end; ++j) out[v + j] = logit_of(base, v + j, acc[j]);
      }
    }
  });
}

template void slot_logits<c10::BFloat16>(const c10::BFloat16*, const float*, const c10::BFloat16*, int64_t, int64_t,
                                         float*);

// The draft-vocabulary entry whose logit T(base[v] + T(W2 z)[v]) is the first largest: chunks over
// the threads, joined in vocabulary order (a tie keeps the first, as torch's argmax)
template <typename T>
int64_t best_of(const T* base, const float* z, const T* w2t, int64_t r, int64_t V) {
  const int64_t chunks = (V + CHUNK - 1) / CHUNK;
  std::vector<float> best(chunks);
  std::vector<int64_t> arg(chunks);
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      best[c] = -std::numeric_limits<float>::infinity();
      arg[c] = c * CHUNK;  // all -inf: the first, as torch's argmax
      best_in(base, z, w2t, r, V, c * CHUNK, std::min(V, (c + 1) * CHUNK), best[c], arg[c]);
    }
  });
  int64_t pick = arg[0];
  float top = best[0];
  for (int64_t c = 1; c < chunks; ++c)
    if (beats(best[c], top)) {
      top = best[c];
      pick = arg[c];
    }
  return pick;
}

template int64_t best_of<c10::BFloat16>(const c10::BFloat16*, const float*, const c10::BFloat16*, int64_t, int64_t);

template <typename T>
void walk(const T* bp, const T* w1p, const T* wp, const int64_t* dp, const int64_t* ap, int64_t* op, int64_t B,
          int64_t g, int64_t V, int64_t r, int64_t Vt) {
  std::vector<float> z(r);
  for (int64_t b = 0; b < B; ++b) {
    int64_t prev = ap[b];
    for (int64_t k = 0; k < g; ++k) {
      TORCH_CHECK(prev >= 0 && prev < Vt, "markov_walk: token id ", prev, " outside W1's ", Vt, " rows");
      for (int64_t i = 0; i < r; ++i) z[i] = static_cast<float>(w1p[prev * r + i]);
      const int64_t pick = best_of(bp + (b * g + k) * V, z.data(), wp, r, V);
      prev = dp ? pick + dp[pick] : pick;
      op[b * g + k] = prev;
    }
  }
}

template void walk<float>(const float*, const float*, const float*, const int64_t*, const int64_t*, int64_t*, int64_t,
                          int64_t, int64_t, int64_t, int64_t);
template void walk<c10::BFloat16>(const c10::BFloat16*, const c10::BFloat16*, const c10::BFloat16*, const int64_t*,
                                  const int64_t*, int64_t*, int64_t, int64_t, int64_t, int64_t, int64_t);

}  // namespace markov

// base [B, g, Vd] (the draft head's logits of the g sampled slots), w1 [V, r] (W1, indexed by target
// ids), w2t [r, Vd] (W2 transposed: 2 MB in bf16 for SmolLM2's draft; split over the threads it stays
// in their L2 caches from one slot to the next), all bf16 or all fp32; d2t [Vd] int64 (draft -> target
// offset; empty: the vocabularies are the same), anchors [B] int64 -> tokens [B, g] int64 target ids:
// slot k's previous token is the anchor for k = 0, else slot k-1's choice.
torch::Tensor markov_walk(torch::Tensor base, torch::Tensor w1, torch::Tensor w2t, torch::Tensor d2t,
                          torch::Tensor anchors) {
  const auto dt = base.scalar_type();
  TORCH_CHECK(base.dim() == 3 && (dt == torch::kBFloat16 || dt == torch::kFloat) && base.device().is_cpu(),
              "markov_walk: base must be a [B, g, Vd] bf16 or fp32 CPU tensor");
  TORCH_CHECK(w1.dim() == 2 && w1.scalar_type() == dt, "markov_walk: w1 must be [V, r] in base's dtype");
  TORCH_CHECK(w2t.dim() == 2 && w2t.scalar_type() == dt && w2t.size(0) == w1.size(1) && w2t.size(1) == base.size(2),
              "markov_walk: w2t must be [r, Vd] in base's dtype, matching w1's rank and base's vocabulary");
  TORCH_CHECK(d2t.numel() == 0 || (d2t.numel() == base.size(2) && d2t.scalar_type() == torch::kLong),
              "markov_walk: d2t must be empty or [Vd] int64");
  TORCH_CHECK(anchors.dim() == 1 && anchors.size(0) == base.size(0) && anchors.scalar_type() == torch::kLong,
              "markov_walk: anchors must be [B] int64");
  auto bc = base.contiguous(), w1c = w1.contiguous(), wt = w2t.contiguous(), dc = d2t.contiguous();
  auto ac = anchors.contiguous();
  auto out = torch::empty({bc.size(0), bc.size(1)}, anchors.options());
  const int64_t* dp = dc.numel() ? dc.data_ptr<int64_t>() : nullptr;
  if (dt == torch::kBFloat16)
    markov::walk(reinterpret_cast<const c10::BFloat16*>(bc.data_ptr<at::BFloat16>()),
                 reinterpret_cast<const c10::BFloat16*>(w1c.data_ptr<at::BFloat16>()),
                 reinterpret_cast<const c10::BFloat16*>(wt.data_ptr<at::BFloat16>()), dp, ac.data_ptr<int64_t>(),
                 out.data_ptr<int64_t>(), bc.size(0), bc.size(1), bc.size(2), w1c.size(1), w1c.size(0));
  else
    markov::walk(bc.data_ptr<float>(), w1c.data_ptr<float>(), wt.data_ptr<float>(), dp, ac.data_ptr<int64_t>(),
                 out.data_ptr<int64_t>(), bc.size(0), bc.size(1), bc.size(2), w1c.size(1), w1c.size(0));
  return out;
}

namespace markov {

// torch.argmax's choice over x[0..V) (the first NaN, else the first largest), in two vector passes
// (AVX-512 or AVX2): the maximum and whether any NaN is there, then the first entry equal to it.
// torch's CPU argmax compares one element at a time, over the whole vocabulary for every verified row
// of every step. T: fp32, or bf16 (widened exactly: the
// same choice as over the fp32 copy, which a greedy plain step then need not make).
inline float widen(float v) { return v; }
inline float widen(c10::BFloat16 v) { return static_cast<float>(v); }

template <typename T>
inline int64_t first_max(const T* x, int64_t V) {
  using namespace attn;
  int64_t i = 0;
  float best = -std::numeric_limits<float>::infinity();
  bool nan = false;
  if (V >= W) {
    attn::V m = set1(best), nans = zero();
    for (; i + W <= V; i += W) {
      const attn::V v = load_w(x + i);
      nans = keep_nan(nans, v);
      m = vmax(m, v);
    }
    nan = any_nan(nans);
    best = hmax(m);
  }
  for (; i < V; ++i) {
    const float v = widen(x[i]);
    nan = nan || std::isnan(v);
    best = v > best ? v : best;
  }
  if (nan) {  // rare (a broken forward): the first NaN, as torch
    for (int64_t j = 0; j < V; ++j)
      if (std::isnan(widen(x[j]))) return j;
  }
  int64_t j = 0;
  for (; j + W <= V; j += W) {
    const int lane = first_equal(load_w(x + j), best);
    if (lane >= 0) return j + lane;
  }
  for (; j < V; ++j)
    if (widen(x[j]) == best) return j;
  return 0;  // every entry -inf: the first, as torch
}

torch::Tensor argmax_rows(const torch::Tensor& x) {
  const int64_t V = x.size(-1), R = x.numel() / V;
  auto out = torch::empty(x.sizes().slice(0, x.dim() - 1), x.options().dtype(torch::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  auto rows = [&](const auto* xp) {
    for (int64_t r = 0; r < R; ++r) op[r] = first_max(xp + r * V, V);
  };
  if (x.scalar_type() == torch::kBFloat16)
    rows(x.data_ptr<c10::BFloat16>());
  else
    rows(x.data_ptr<float>());
  return out;
}

}  // namespace markov

// x [..., V] fp32 or bf16 -> [...] int64: torch.argmax(x, -1) (of the fp32 copy, for bf16)
torch::Tensor argmax_last(torch::Tensor x) {
  TORCH_CHECK(x.dim() >= 1 && (x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kBFloat16) &&
                  x.device().is_cpu() && x.size(-1) > 0,
              "argmax_last: x must be an fp32 or bf16 CPU tensor with a non-empty last dimension");
  return markov::argmax_rows(x.contiguous());
}
