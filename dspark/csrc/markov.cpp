// The vanilla Markov head's greedy walk over a drafted block in one call (docs/BENCHMARKS.md,
// "Session 11"). In torch each slot is ~8 small ops (W1 lookup, the rank-r matmul over the draft
// vocabulary, the add, the argmax, the d2t map): ~0.25-0.4 ms a slot on a 2-core CPU, 1.6-2.7 ms
// of a ~5 ms draft phase for 7 slots. Rounding as in the torch path (bf16 weights and
// activations): the bias W2 z is accumulated in fp32 and rounded to bf16, added to the bf16 base
// logit in fp32 and rounded again; the first largest logit wins, as torch's argmax. Only the fp32
// summation order of the rank-r product differs from oneDNN's.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <immintrin.h>
#include <limits>
#include <vector>

namespace markov {

constexpr int64_t CHUNK = 512;  // vocabulary entries per parallel task

// The first largest of bf16(base[v] + bf16(sum_k z[k] * w2t[k][v])) over v in [v0, v1).
void best_in(const c10::BFloat16* base, const float* z, const c10::BFloat16* w2t, int64_t r, int64_t V,
             int64_t v0, int64_t v1, float& best, int64_t& arg) {
  constexpr int64_t L = 64;  // vocabulary entries at a time, each accumulating over k in order
  for (int64_t v = v0; v < v1; v += L) {
    float acc[L] = {0};
    if (v + L <= v1) {
#ifdef __AVX512F__
      // four independent registers of 16 (one alone waits on its add's latency every k); bf16 is
      // widened to fp32 by a 16-bit shift; multiply then add, as the scalar path rounds
      __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
      for (int64_t k = 0; k < r; ++k) {
        const __m512 zk = _mm512_set1_ps(z[k]);
        for (int q = 0; q < 4; ++q) {
          const __m256i w16 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w2t + k * V + v + 16 * q));
          const __m512 w = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(w16), 16));
          a[q] = _mm512_add_ps(a[q], _mm512_mul_ps(zk, w));
        }
      }
      for (int q = 0; q < 4; ++q) _mm512_storeu_ps(acc + 16 * q, a[q]);
#else
      for (int64_t k = 0; k < r; ++k) {
        const float zk = z[k];
        const c10::BFloat16* w = w2t + k * V + v;
        for (int64_t j = 0; j < L; ++j) acc[j] = acc[j] + zk * static_cast<float>(w[j]);
      }
#endif
    } else {
      for (int64_t k = 0; k < r; ++k)
        for (int64_t j = 0; v + j < v1; ++j) acc[j] = acc[j] + z[k] * static_cast<float>(w2t[k * V + v + j]);
    }
    for (int64_t j = 0; j < L && v + j < v1; ++j) {
      const float bias = static_cast<float>(c10::BFloat16(acc[j]));
      const float logit = static_cast<float>(c10::BFloat16(static_cast<float>(base[v + j]) + bias));
      if (logit > best) {
        best = logit;
        arg = v + j;
      }
    }
  }
}

}  // namespace markov

// base [B, g, Vd] bf16 (the draft head's logits of the g sampled slots), w1 [V, r] bf16 (W1, indexed
// by target ids), w2t [r, Vd] bf16 (W2 transposed: 2 MB for SmolLM2's draft, split over the threads
// it stays in their L2 caches from one slot to the next), d2t [Vd] int64 (draft -> target offset; empty:
// the vocabularies are the same), anchors [B] int64 -> tokens [B, g] int64 target ids: slot k's
// previous token is the anchor for k = 0, else slot k-1's choice.
torch::Tensor markov_walk_bf16(torch::Tensor base, torch::Tensor w1, torch::Tensor w2t, torch::Tensor d2t,
                               torch::Tensor anchors) {
  TORCH_CHECK(base.dim() == 3 && base.scalar_type() == torch::kBFloat16 && base.device().is_cpu(),
              "markov_walk_bf16: base must be a [B, g, Vd] bf16 CPU tensor");
  TORCH_CHECK(w1.dim() == 2 && w1.scalar_type() == torch::kBFloat16, "markov_walk_bf16: w1 must be [V, r] bf16");
  TORCH_CHECK(w2t.dim() == 2 && w2t.scalar_type() == torch::kBFloat16 && w2t.size(0) == w1.size(1) &&
                  w2t.size(1) == base.size(2),
              "markov_walk_bf16: w2t must be [r, Vd] bf16 matching w1's rank and base's vocabulary");
  TORCH_CHECK(d2t.numel() == 0 || (d2t.numel() == base.size(2) && d2t.scalar_type() == torch::kLong),
              "markov_walk_bf16: d2t must be empty or [Vd] int64");
  TORCH_CHECK(anchors.dim() == 1 && anchors.size(0) == base.size(0) && anchors.scalar_type() == torch::kLong,
              "markov_walk_bf16: anchors must be [B] int64");
  auto bc = base.contiguous(), w1c = w1.contiguous(), wt = w2t.contiguous(), dc = d2t.contiguous();
  auto ac = anchors.contiguous();
  const int64_t B = bc.size(0), g = bc.size(1), V = bc.size(2), r = w1c.size(1), Vt = w1c.size(0);
  auto out = torch::empty({B, g}, anchors.options());
  const auto* bp = bc.data_ptr<at::BFloat16>();
  const auto* w1p = w1c.data_ptr<at::BFloat16>();
  const auto* wp = wt.data_ptr<at::BFloat16>();
  const int64_t* dp = dc.numel() ? dc.data_ptr<int64_t>() : nullptr;
  int64_t* op = out.data_ptr<int64_t>();
  const int64_t chunks = (V + markov::CHUNK - 1) / markov::CHUNK;
  std::vector<float> z(r), best(chunks);
  std::vector<int64_t> arg(chunks);
  for (int64_t b = 0; b < B; ++b) {
    int64_t prev = ac.data_ptr<int64_t>()[b];
    for (int64_t k = 0; k < g; ++k) {
      TORCH_CHECK(prev >= 0 && prev < Vt, "markov_walk_bf16: token id ", prev, " outside W1's ", Vt, " rows");
      for (int64_t i = 0; i < r; ++i) z[i] = static_cast<float>(w1p[prev * r + i]);
      const c10::BFloat16* row = bp + (b * g + k) * V;
      at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
        for (int64_t c = c0; c < c1; ++c) {
          best[c] = -std::numeric_limits<float>::infinity();
          arg[c] = -1;
          markov::best_in(row, z.data(), wp, r, V, c * markov::CHUNK, std::min(V, (c + 1) * markov::CHUNK),
                          best[c], arg[c]);
        }
      });
      int64_t pick = -1;
      float top = -std::numeric_limits<float>::infinity();
      for (int64_t c = 0; c < chunks; ++c)  // chunks in vocabulary order: a tie keeps the first
        if (arg[c] >= 0 && (pick < 0 || best[c] > top)) {
          top = best[c];
          pick = arg[c];
        }
      TORCH_CHECK(pick >= 0, "markov_walk_bf16: slot ", k, " has no finite logit (NaN weights?)");
      prev = dp ? pick + dp[pick] : pick;
      op[b * g + k] = prev;
    }
  }
  return out;
}
