// Sampling on the CPU: a row of logits shaped into the distribution a request samples from
// (temperature, top-k, top-p: dspark.engine.sampling.probs' rule), a token drawn from it by a uniform,
// and speculative sampling's acceptance of a proposal. In torch a top-p row sorts the whole
// vocabulary (~3 ms for SmolLM2's 49 152 entries on one core) and torch.multinomial costs ~1 ms,
// each more than a target step; here a row costs one pass of exponentials and a sort of the few
// entries that can hold top_p of the mass.
#include "dspark.h"
#include "vec.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>

namespace sampling {

// x [V] logits (fp32, overwritten) -> p [V]: softmax(x / temperature) with every entry below the
// top_k-th largest dropped (top_k 0: none), then (top_p < 1) every entry whose mass strictly before
// it, in descending order (ties: the lower index first), reaches top_p dropped and the rest
// renormalised. Logits with a NaN or no finite maximum (a broken forward) put all of p on the first
// largest (the first NaN), as torch.argmax chooses.
void shape(float* x, int64_t V, float temperature, int64_t top_k, float top_p, float* p) {
  const float inf = std::numeric_limits<float>::infinity();
  float m = -inf;
  bool nan = false;
  for (int64_t i = 0; i < V; ++i) {
    x[i] = x[i] / temperature;
    nan = nan || std::isnan(x[i]);
    m = x[i] > m ? x[i] : m;
  }
  if (nan || !std::isfinite(m)) {
    const int64_t pick = markov::argmax_rows(torch::from_blob(x, {V}, torch::kFloat)).item<int64_t>();
    std::fill(p, p + V, 0.f);
    p[pick] = 1.f;
    return;
  }
  if (top_k > 0 && top_k < V) {
    std::vector<float> c(x, x + V);
    std::nth_element(c.begin(), c.begin() + (top_k - 1), c.end(), std::greater<float>());
    const float kth = c[top_k - 1];
    for (int64_t i = 0; i < V; ++i)
      if (x[i] < kth) x[i] = -inf;
  }
  {  // p = exp(x - m), x - m <= 0 (vec.h's exp)
    using namespace attn;
    const attn::V mv = set1(m);
    int64_t i = 0;
    for (; i + W <= V; i += W) {
      const attn::V e = exp_neg(sub(load_w(x + i), mv));
      std::memcpy(p + i, &e, sizeof(e));
    }
    for (; i < V; ++i) p[i] = std::exp(x[i] - m);
  }
  double total = 0;
  for (int64_t i = 0; i < V; ++i) {
    if (x[i] == -inf) p[i] = 0.f;  // exp_neg stops at exp(-87): a dropped entry gets none
    total += p[i];
  }
  for (int64_t i = 0; i < V; ++i) p[i] = static_cast<float>(p[i] / total);
  if (top_p < 1.f) {
    // candidates: the entries of at least t, t lowered until they hold top_p; every other entry is
    // smaller than each of them, so it sorts after them and is dropped
    float t = 0.f;
    for (int64_t i = 0; i < V; ++i) t = std::max(t, p[i]);
    std::vector<int64_t> cand;
    for (t /= 16.f;; t /= 16.f) {
      cand.clear();
      double mass = 0;
      for (int64_t i = 0; i < V; ++i)
        if (p[i] >= t) {
          cand.push_back(i);
          mass += p[i];
        }
      if (mass >= top_p || t == 0.f) break;
    }
    std::stable_sort(cand.begin(), cand.end(), [&](int64_t a, int64_t b) { return p[a] > p[b]; });
    std::vector<char> keep(V, 0);
    double before = 0;
    for (const int64_t i : cand) {
      if (before >= top_p) break;
      keep[i] = 1;
      before += p[i];
    }
    for (int64_t i = 0; i < V; ++i) p[i] = keep[i] ? static_cast<float>(p[i] / before) : 0.f;
  }
}

// The entry of p [V] (sums to 1) that the uniform u in [0, 1) draws: the first whose cumulative
// probability exceeds u (u at the top of the sum's rounding: the last entry with mass). sampling.draw
// is the same rule in torch.
int64_t draw(const float* p, int64_t V, float u) {
  double cum = 0;
  int64_t last = 0;
  for (int64_t i = 0; i < V; ++i) {
    if (p[i] <= 0.f) continue;
    cum += p[i];
    last = i;
    if (cum > u) return i;
  }
  return last;
}

int64_t sample_slot(float* x, int64_t V, float temperature, int64_t top_k, float top_p, float u, float* q) {
  shape(x, V, temperature, top_k, top_p, q);
  return draw(q, V, u);
}

}  // namespace sampling

// One request's speculative sampling over the target's logits [n + 1, V] (fp32 or bf16) of
// [anchor, drafts[:n]], shaped by (temperature, top_k, top_p), against the distributions q [n, V]
// fp32 its drafts were drawn from, by the uniforms u [n + 1] fp32: draft i is accepted while
// u[i] < p_i(d_i) / q_i(d_i); at the first rejection the token is drawn by u[n] from
// norm(max(p_i - q_i, 0)) (p_i where that has no mass), after n acceptances from p_n. With n = 0:
// plain sampling from p_0. -> [accepted, token] int64 (sampling.rejection_accept is the same in torch).
torch::Tensor sample_accept(torch::Tensor logits, double temperature, int64_t top_k, double top_p, torch::Tensor q,
                            torch::Tensor drafts, torch::Tensor u) {
  const auto dt = logits.scalar_type();
  TORCH_CHECK(logits.dim() == 2 && (dt == torch::kFloat || dt == torch::kBFloat16) && logits.device().is_cpu(),
              "sample_accept: logits must be a [n + 1, V] fp32 or bf16 CPU tensor");
  const int64_t n = logits.size(0) - 1, V = logits.size(1);
  TORCH_CHECK(n >= 0 && V > 0, "sample_accept: no logits");
  TORCH_CHECK(temperature > 0 && top_k >= 0 && top_p > 0 && top_p <= 1,
              "sample_accept: temperature > 0, top_k >= 0 and 0 < top_p <= 1, got ", temperature, ", ", top_k, ", ",
              top_p);
  TORCH_CHECK(drafts.dim() == 1 && drafts.size(0) == n && drafts.scalar_type() == torch::kLong,
              "sample_accept: drafts must be [n] int64");
  TORCH_CHECK(n == 0 || (q.dim() == 2 && q.size(0) == n && q.size(1) == V && q.scalar_type() == torch::kFloat),
              "sample_accept: q must be [n, V] fp32");
  TORCH_CHECK(u.dim() == 1 && u.size(0) == n + 1 && u.scalar_type() == torch::kFloat,
              "sample_accept: u must be [n + 1] fp32");
  const auto lc = logits.to(torch::kFloat).contiguous();
  const auto qc = n ? q.contiguous() : q;
  const auto dc = drafts.contiguous(), uc = u.contiguous();
  const float* lp = lc.data_ptr<float>();
  const int64_t* dp = dc.data_ptr<int64_t>();
  const float* up = uc.data_ptr<float>();
  std::vector<float> x(V), p(V);
  auto shaped = [&](int64_t row) {
    std::memcpy(x.data(), lp + row * V, V * sizeof(float));
    sampling::shape(x.data(), V, static_cast<float>(temperature), top_k, static_cast<float>(top_p), p.data());
  };
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(dp[i] >= 0 && dp[i] < V, "sample_accept: draft ", dp[i], " outside the vocabulary of ", V);
    shaped(i);
    const float* qi = qc.data_ptr<float>() + i * V;
    const float ratio = p[dp[i]] / std::max(qi[dp[i]], 1e-30f);
    if (up[i] < ratio) continue;
    double mass = 0;
    for (int64_t v = 0; v < V; ++v) {
      x[v] = std::max(p[v] - qi[v], 0.f);
      mass += x[v];
    }
    if (mass > 0)
      for (int64_t v = 0; v < V; ++v) x[v] = static_cast<float>(x[v] / mass);
    const float* dist = mass > 0 ? x.data() : p.data();
    return torch::tensor({i, sampling::draw(dist, V, up[n])}, torch::kLong);
  }
  shaped(n);
  return torch::tensor({n, sampling::draw(p.data(), V, up[n])}, torch::kLong);
}
