// A DSpark draft's decoding work in one call: the context update of newly committed positions,
// the block [anchor, MASK, ...] through the draft's layers, the head over the draft vocabulary, the
// greedy Markov walk and the confidences. In Python the same work is ~60-80 calls and views, and a
// drafting step pays each one right after a target step has pushed the interpreter's working set
// out of the CPU's caches (tens of microseconds apiece, about half the phase on a 2-core CPU).
// The same kernels in the same order as dspark/model/fast.py's Python loop, so the same bits for
// the same weights (tested); model/draft.py's module forward stays the reference both are held to.
//
// Weights are handed over once (`draft_register`) and kept here under a handle, as the target's
// layer stack is (csrc/layers.cpp). Each matrix arrives packed in dspark's Q8_0 or bf16 layout.
#include "dspark.h"
#include <cmath>
#include <cstring>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace draft {

struct Layer {
  torch::Tensor ln1, qkn, kn, ln2;  // qkn [Hq + Hkv, D] / kn [Hkv, D]: Qwen3's q/k norms (empty: none)
  layers::Lin qkv, kv, o, gu, down;
};

struct Draft {
  torch::Tensor embed, hidden_norm, norm, w1, w2t, d2t, conf_w, conf_b;  // w1 empty: no Markov head
  // the Markov head's kind and, gated / rnn, its projection: gate_proj [r, H + r] or joint_proj [3r, 2r + H]
  enum Kind { NONE = 0, VANILLA = 1, GATED = 2, RNN = 3 } kind = NONE;
  torch::Tensor proj_w, proj_b;
  // head: [Vd, H + r], the draft head and the vanilla Markov head's W2 side by side, so that a slot's
  // logits U h + W2 W1[x_prev] are one matmul over [h ; W1[x_prev]] (one pass over the weights a slot)
  layers::Lin fc, head;
  std::vector<Layer> layers;
  int64_t hq = 0, hkv = 0, D = 0;
  bool conf_markov = false;  // the confidence head also reads W1[previous token]
  double eps = 1e-6;
};

std::mutex mu;
std::unordered_map<int64_t, Draft> drafts;
int64_t next_id = 1;

const Draft& find(int64_t id) {
  std::lock_guard<std::mutex> g(mu);
  auto it = drafts.find(id);
  TORCH_CHECK(it != drafts.end(), "draft_forward: no draft ", id);
  return it->second;
}

// [B, n] positions lengths[b] + offset + j
torch::Tensor positions(const int64_t* lp, int64_t B, int64_t n, int64_t offset) {
  auto pos = torch::empty({B, n}, torch::dtype(torch::kLong));
  int64_t* pp = pos.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t j = 0; j < n; ++j) pp[b * n + j] = lp[b] + offset + j;
  return pos;
}

// The context update: taps [B, n, F] -> every layer's keys and values at positions lengths[b] + j
void extend(const Draft& d, const std::vector<torch::Tensor>& kv, const int64_t* lp, const torch::Tensor& taps,
            const torch::Tensor& cos, const torch::Tensor& sin) {
  const int64_t B = taps.size(0), n = taps.size(1);
  const auto pos = positions(lp, B, n, 0);
  const auto c = rms_bf16(layers::lin(d.fc, taps), d.hidden_norm, d.eps);
  for (size_t i = 0; i < d.layers.size(); ++i) {
    const Layer& ly = d.layers[i];
    const auto kvp = layers::lin(ly.kv, c).view({B, n, 2 * d.hkv, d.D});
    auto k = kvp.narrow(2, 0, d.hkv);
    if (ly.kn.numel()) k = rms_bf16(k, ly.kn, d.eps);
    rope_cache_bf16(k, kvp.narrow(2, d.hkv, d.hkv), cos, sin, kv[2 * i], kv[2 * i + 1], pos);  // no query heads
  }
}

// The block's post-norm states h [B, rows, H] of its first `rows` rows, over the context of
// `lengths` (the block's own keys and values written right after each row's context)
torch::Tensor block(const Draft& d, const std::vector<torch::Tensor>& kv, const int64_t* lp,
                    const torch::Tensor& anchors, int64_t mask, int64_t S, int64_t rows,
                    const std::vector<bool>& causal, const torch::Tensor& cos, const torch::Tensor& sin) {
  const int64_t B = anchors.size(0), H = d.embed.size(1), V = d.embed.size(0),
                L = static_cast<int64_t>(d.layers.size());
  TORCH_CHECK(mask >= 0 && mask < V, "draft_forward: mask token ", mask, " outside the vocabulary of ", V);
  auto x = torch::empty({B, S, H}, d.embed.options());
  auto* xp = x.data_ptr<at::BFloat16>();
  const auto* ep = d.embed.data_ptr<at::BFloat16>();
  const int64_t* ap = anchors.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(ap[b] >= 0 && ap[b] < V, "draft_forward: anchor ", ap[b], " outside the vocabulary of ", V);
    for (int64_t s = 0; s < S; ++s)
      std::memcpy(xp + (b * S + s) * H, ep + (s ? mask : ap[b]) * H, H * sizeof(at::BFloat16));
  }
  const auto pos = positions(lp, B, S, 0);
  auto last = torch::empty({B, S}, pos.options());  // a non-causal row sees its whole block
  int64_t* tp = last.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t s = 0; s < S; ++s) tp[b * S + s] = lp[b] + S - 1;
  const double scale = std::pow(static_cast<double>(d.D), -0.5);  // Python's D ** -0.5
  const auto none = torch::empty({0}, x.options());
  torch::Tensor h = rms_bf16(x, d.layers[0].ln1, d.eps);
  for (int64_t i = 0; i < L; ++i) {
    const Layer& ly = d.layers[i];
    const auto &kc = kv[2 * i], &vc = kv[2 * i + 1];
    const auto qkv = layers::lin(ly.qkv, h).view({B, S, d.hq + 2 * d.hkv, d.D});
    torch::Tensor q = ly.qkn.numel() ? rope_cache_bf16(rms_bf16(qkv.narrow(2, 0, d.hq + d.hkv), ly.qkn, d.eps),
                                                       qkv.narrow(2, d.hq + d.hkv, d.hkv), cos, sin, kc, vc, pos)
                                     : rope_cache_bf16(qkv, none, cos, sin, kc, vc, pos);
    torch::Tensor seen = causal[i] ? pos : last;
    if (i == L - 1 && rows < S) {
      // every row's keys and values are in the cache; past them the last layer works row by row,
      // so rows nobody reads are skipped (a depth-1 step needs one row of the MLP, not S)
      q = q.narrow(1, 0, rows);
      seen = seen.narrow(1, 0, rows).contiguous();
      x = x.narrow(1, 0, rows).contiguous();
    }
    const auto o = attn_bf16(q, kc, vc, seen, scale);
    auto xh = add_rms_bf16(x, layers::lin(ly.o, o), ly.ln2, d.eps, none, 0);
    const auto& next = i + 1 < L ? d.layers[i + 1].ln1 : d.norm;
    xh = add_rms_bf16(xh[0], layers::lin(ly.down, silu_mul_bf16(layers::lin(ly.gu, xh[1]))), next, d.eps, none, 0);
    x = xh[0];
    h = xh[1];
  }
  return h;
}

// [B, n, H] states and (r > 0) each row's previous token -> the head's input [B, n, K]: [h ; W1[prev] ; 0]
// (zeros in place of W1[prev] where prev is null: the draft head's logits alone; K: H + r rounded up to 32)
torch::Tensor head_input(const Draft& d, const torch::Tensor& h, const int64_t* prev) {
  const int64_t B = h.size(0), n = h.size(1), H = h.size(2), K = d.head.P.size(1) * 32;
  const int64_t r = d.w1.numel() ? d.w1.size(1) : 0;
  if (K == H) return h;
  auto x = torch::zeros({B, n, K}, h.options());
  auto* xp = x.data_ptr<at::BFloat16>();
  const auto* hp = h.data_ptr<at::BFloat16>();
  for (int64_t i = 0; i < B * n; ++i) {
    std::memcpy(xp + i * K, hp + i * H, H * sizeof(at::BFloat16));
    if (prev) std::memcpy(xp + i * K + H, d.w1.data_ptr<at::BFloat16>() + prev[i] * r, r * sizeof(at::BFloat16));
  }
  return x;
}

inline float rb(float f) { return static_cast<float>(c10::BFloat16(f)); }  // rounded to bf16, back to fp32

// The Markov head's input to W2 for one slot, z [r], in the module's bf16 steps (model/heads.py `_row`):
// vanilla W1[prev]; gated sigmoid(gate_proj([h ; W1[prev]])) * W1[prev]; rnn the recurrence over
// [state ; W1[prev] ; h] (state [r] updated), tanh of its output part. The projections' sums run in
// fp32 with the bias, rounded to bf16 as torch's bf16 Linear rounds its result.
void markov_input(const Draft& d, int64_t prev, const at::BFloat16* h, int64_t H, float* state, float* z) {
  const int64_t r = d.w1.size(1);
  const auto* e = d.w1.data_ptr<at::BFloat16>() + prev * r;
  if (d.kind == Draft::VANILLA) {
    for (int64_t i = 0; i < r; ++i) z[i] = static_cast<float>(e[i]);
    return;
  }
  const auto* w = d.proj_w.data_ptr<at::BFloat16>();
  const auto* bias = d.proj_b.numel() ? d.proj_b.data_ptr<at::BFloat16>() : nullptr;
  // the projection's input row, then out[j] = rb(sum_i in[i] w[j][i] + b[j])
  std::vector<float> in;
  if (d.kind == Draft::GATED) {
    for (int64_t i = 0; i < H; ++i) in.push_back(static_cast<float>(h[i]));
    for (int64_t i = 0; i < r; ++i) in.push_back(static_cast<float>(e[i]));
  } else {
    for (int64_t i = 0; i < r; ++i) in.push_back(state[i]);
    for (int64_t i = 0; i < r; ++i) in.push_back(static_cast<float>(e[i]));
    for (int64_t i = 0; i < H; ++i) in.push_back(static_cast<float>(h[i]));
  }
  const int64_t K = static_cast<int64_t>(in.size()), N = d.proj_w.size(0);
  std::vector<float> out(N);
  for (int64_t j = 0; j < N; ++j) {
    float acc = 0.f;
    const auto* wj = w + j * K;
    for (int64_t i = 0; i < K; ++i) acc += in[i] * static_cast<float>(wj[i]);
    out[j] = rb(acc + (bias ? static_cast<float>(bias[j]) : 0.f));
  }
  auto sigmoid = [](float x) { return rb(1.f / (1.f + std::exp(-x))); };
  if (d.kind == Draft::GATED) {
    for (int64_t i = 0; i < r; ++i) z[i] = rb(sigmoid(out[i]) * static_cast<float>(e[i]));
    return;
  }
  for (int64_t i = 0; i < r; ++i) {  // gate * state + (1 - gate) * tanh(cand), each op rounded
    const float gate = sigmoid(out[i]);
    state[i] = rb(rb(gate * state[i]) + rb(rb(1.f - gate) * rb(std::tanh(out[r + i]))));
    z[i] = rb(std::tanh(out[2 * r + i]));
  }
}

// The walk: slot k's token is the argmax of U h_k + W2 z_k, z_k the Markov head's input for the
// token before it (x_{-1} the anchor; `markov_input`), or for a sampled row (sp: temperature > 0) a
// draw from those logits (sampling::sample_slot in sample.cpp, by the row's uniforms up [B, g]; the
// distribution into qp [B, g, V], over the target's vocabulary), mapped to target ids through d2t -> [B, g] int64. One
// pass over the head for every slot: the first slot's input carries z_0 (known before the walk), the others' zeros, so
// the first row's logits are complete and the others are U h_k, to which the walk adds W2 z_k slot by slot
// (csrc/markov.cpp, over W2 transposed: a rank-r product, not another head pass). h0: the block's row 0 where it
// precedes the drafted rows (a bonus-anchor layout), whose step an rnn head's recurrence runs through first, as in
// training.
torch::Tensor walk_block(const Draft& d, const torch::Tensor& hs, const at::BFloat16* h0, const int64_t* ap,
                         const float* sp, const float* up, float* qp) {
  const int64_t B = hs.size(0), g = hs.size(1), V = d.embed.size(0), K = d.head.P.size(1) * 32;
  const int64_t r = d.w1.numel() ? d.w1.size(1) : 0, H = hs.size(2);
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(ap[b] >= 0 && ap[b] < V, "draft_forward: anchor ", ap[b], " outside the vocabulary of ", V);
  const auto* hp = hs.data_ptr<at::BFloat16>();
  std::vector<float> states(B * r, 0.f), z(r);
  auto x = head_input(d, hs, nullptr);
  auto* xp = x.data_ptr<at::BFloat16>();
  for (int64_t b = 0; b < B && r; ++b) {
    float* st = states.data() + b * r;
    if (d.kind == Draft::RNN && h0) markov_input(d, ap[b], h0 + b * H, H, st, z.data());
    markov_input(d, ap[b], hp + b * g * H, H, st, z.data());
    for (int64_t i = 0; i < r; ++i) xp[b * g * K + H + i] = at::BFloat16(z[i]);  // bf16 values: exact
  }
  const auto logits = layers::lin(d.head, x);  // [B, g, Vd]
  const int64_t Vd = logits.size(2);
  const int64_t* dp = d.d2t.numel() ? d.d2t.data_ptr<int64_t>() : nullptr;
  auto to_target = [&](int64_t i) { return dp ? i + dp[i] : i; };
  auto first = markov::argmax_rows(logits.narrow(1, 0, 1).contiguous());  // [B, 1]
  int64_t* fp = first.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) fp[b] = to_target(fp[b]);
  bool any_sampled = false;
  for (int64_t b = 0; sp && b < B; ++b) any_sampled = any_sampled || sp[3 * b] > 0.f;
  const auto rest = g > 1 ? logits.narrow(1, 1, g - 1).contiguous() : torch::Tensor();
  const auto* w2t = reinterpret_cast<const c10::BFloat16*>(r ? d.w2t.data_ptr<at::BFloat16>() : nullptr);
  if (!any_sampled && d.kind != Draft::GATED && d.kind != Draft::RNN) {  // every row greedy, in one call
    if (g == 1) return first;
    auto more = torch::empty({B, g - 1}, first.options());
    int64_t* mp = more.data_ptr<int64_t>();
    if (r) {
      const auto* w1 = reinterpret_cast<const c10::BFloat16*>(d.w1.data_ptr<at::BFloat16>());
      markov::walk(reinterpret_cast<const c10::BFloat16*>(rest.data_ptr<at::BFloat16>()), w1, w2t, dp, fp, mp, B, g - 1,
                   Vd, r, V);
    } else {  // no Markov head: each slot's own argmax
      const auto ids = markov::argmax_rows(rest);
      const int64_t* ip = ids.data_ptr<int64_t>();
      for (int64_t i = 0; i < B * (g - 1); ++i) mp[i] = to_target(ip[i]);
    }
    return torch::cat({first, more}, 1);
  }
  auto tokens = torch::empty({B, g}, first.options());
  int64_t* tp = tokens.data_ptr<int64_t>();
  std::vector<float> row(Vd), dist(Vd);
  const auto* lp = logits.data_ptr<at::BFloat16>();
  for (int64_t b = 0; b < B; ++b) {
    const bool sampled = sp && sp[3 * b] > 0.f;
    float* st = states.data() + b * r;
    int64_t prev = ap[b];
    for (int64_t k = 0; k < g; ++k) {
      const auto* base =
          k ? reinterpret_cast<const c10::BFloat16*>(rest.data_ptr<at::BFloat16>()) + (b * (g - 1) + k - 1) * Vd
            : nullptr;
      if (k && r) {
        TORCH_CHECK(prev >= 0 && prev < V, "draft_forward: token id ", prev, " outside W1's ", V, " rows");
        markov_input(d, prev, hp + (b * g + k) * H, H, st, z.data());
      }
      int64_t pick;
      if (sampled) {
        if (k == 0 || !r) {
          for (int64_t v = 0; v < Vd; ++v) row[v] = static_cast<float>(lp[(b * g + k) * Vd + v]);
        } else {
          markov::slot_logits(base, z.data(), w2t, r, Vd, row.data());
        }
        const float* prm = sp + 3 * b;
        pick = sampling::sample_slot(row.data(), Vd, prm[0], static_cast<int64_t>(prm[1]), prm[2], up[b * g + k],
                                     dist.data());
        float* qrow = qp + (b * g + k) * V;  // the distribution over the target's vocabulary
        for (int64_t v = 0; v < Vd; ++v)
          if (dist[v] > 0.f) qrow[to_target(v)] = dist[v];
      } else if (k == 0) {  // the first slot's argmax, already taken over every row
        tp[b * g] = prev = fp[b];
        continue;
      } else if (r) {
        pick = markov::best_of(base, z.data(), w2t, r, Vd);
      } else {  // no Markov head: the slot's own argmax
        pick = markov::argmax_rows(rest.select(0, b).select(0, k - 1).contiguous()).item<int64_t>();
      }
      prev = to_target(pick);
      tp[b * g + k] = prev;
    }
  }
  return tokens;
}

// Confidence logits [B, g] of the walked slots: proj([h_k ; W1[x_{k-1}]]) + b, fp32 sums of the
// bf16 values rounded to bf16 (the module's bf16 Linear)
torch::Tensor confidences(const Draft& d, const torch::Tensor& h, const torch::Tensor& tokens, const int64_t* ap) {
  const int64_t B = h.size(0), g = h.size(1), H = h.size(2), r = d.w1.numel() ? d.w1.size(1) : 0;
  auto out = torch::empty({B, g}, h.options());
  const auto hc = h.contiguous();
  const auto* hp = hc.data_ptr<at::BFloat16>();
  const auto* wp = d.conf_w.data_ptr<at::BFloat16>();
  const float bias = static_cast<float>(d.conf_b.data_ptr<at::BFloat16>()[0]);
  const int64_t* tp = tokens.data_ptr<int64_t>();
  auto* op = out.data_ptr<at::BFloat16>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t k = 0; k < g; ++k) {
      float acc = 0.f;
      const auto* hr = hp + (b * g + k) * H;
      for (int64_t j = 0; j < H; ++j) acc += static_cast<float>(hr[j]) * static_cast<float>(wp[j]);
      if (d.conf_markov) {
        const int64_t prev = k ? tp[b * g + k - 1] : ap[b];
        const auto* er = d.w1.data_ptr<at::BFloat16>() + prev * r;
        for (int64_t j = 0; j < r; ++j) acc += static_cast<float>(er[j]) * static_cast<float>(wp[H + j]);
      }
      op[b * g + k] = at::BFloat16(acc + bias);
    }
  return out;
}

}  // namespace draft

// t: embed [V, H], hidden_norm, norm, w1 [V, r] and W2 transposed [r, Vd] (empty: no Markov head),
// d2t [Vd] int64, confidence weight [1, H (+ r)] and bias [1] (empty: none), then P, D, L, bias of fc
// and of the head [Vd, H + r] (8; r = 0 without w1), the gated / rnn head's projection weight and
// bias (empty: vanilla or none), then per layer ln1, qk_norm, k_norm, ln2 and P, D, L, bias of qkv,
// kv, o, gate/up, down (24 a layer). markov_kind: 0 none, 1 vanilla, 2 gated, 3 rnn.
// -> a handle for draft_forward
int64_t draft_register(std::vector<torch::Tensor> t, int64_t num_layers, int64_t hq, int64_t hkv, int64_t head_dim,
                       bool conf_markov, double eps, int64_t markov_kind) {
  using namespace draft;
  constexpr size_t FIXED = 18, PER = 24;
  TORCH_CHECK(
      t.size() > FIXED && (t.size() - FIXED) % PER == 0 && static_cast<int64_t>((t.size() - FIXED) / PER) == num_layers,
      "draft_register: ", FIXED, " tensors and ", PER, " a layer, got ", t.size(), " for ", num_layers, " layers");
  auto lin = [&](size_t j) {
    const auto fmt = t[j].scalar_type();
    TORCH_CHECK(fmt == torch::kChar || fmt == torch::kBFloat16 || fmt == torch::kByte,
                "draft_register: a weight dspark's tile does not hold");
    return layers::Lin{t[j], t[j + 1], t[j + 2], t[j + 3]};
  };
  for (size_t j : {size_t(0), size_t(1), size_t(2)})
    TORCH_CHECK(t[j].scalar_type() == torch::kBFloat16 && t[j].is_contiguous(),
                "draft_register: embed and norms must be contiguous bf16");
  Draft d;
  d.embed = t[0];
  d.hidden_norm = t[1];
  d.norm = t[2];
  d.w1 = t[3].contiguous();
  d.w2t = t[4].contiguous();
  d.d2t = t[5].contiguous();
  d.conf_w = t[6].contiguous();
  d.conf_b = t[7].contiguous();
  d.fc = lin(8);
  d.head = lin(12);
  d.proj_w = t[16].contiguous();
  d.proj_b = t[17].contiguous();
  TORCH_CHECK(markov_kind >= Draft::NONE && markov_kind <= Draft::RNN, "draft_register: Markov head kind ",
              markov_kind);
  d.kind = static_cast<Draft::Kind>(markov_kind);
  TORCH_CHECK((d.kind == Draft::NONE) == (d.w1.numel() == 0), "draft_register: W1 goes with a Markov head");
  if (d.kind == Draft::GATED || d.kind == Draft::RNN) {  // gate_proj [r, H + r]; joint_proj [3r, 2r + H]
    const int64_t r = d.w1.size(1), H = d.embed.size(1), n = d.kind == Draft::GATED ? 1 : 3;
    TORCH_CHECK(d.proj_w.dim() == 2 && d.proj_w.size(0) == n * r && d.proj_w.size(1) == H + (n == 1 ? r : 2 * r) &&
                    (d.proj_b.numel() == 0 || d.proj_b.numel() == n * r),
                "draft_register: the Markov head's projection must be [", n * r, ", ", H + (n == 1 ? r : 2 * r),
                "], got ", d.proj_w.sizes());
  }
  for (size_t i = FIXED; i < t.size(); i += PER)
    d.layers.push_back(
        Layer{t[i], t[i + 1], t[i + 2], t[i + 3], lin(i + 4), lin(i + 8), lin(i + 12), lin(i + 16), lin(i + 20)});
  d.hq = hq;
  d.hkv = hkv;
  d.D = head_dim;
  d.conf_markov = conf_markov;
  d.eps = eps;
  TORCH_CHECK(!conf_markov || d.w1.numel(), "draft_register: a confidence head that reads W1 needs the Markov head");
  const int64_t K = d.head.P.dim() >= 2 ? d.head.P.size(1) * 32 : 0,
                need = d.embed.size(1) + (d.w1.numel() ? d.w1.size(1) : 0);
  TORCH_CHECK(K >= need && K < need + 32, "draft_register: the head takes [h ; W1[prev]] (", need,
              " inputs, rounded up to 32), not ", K);
  std::lock_guard<std::mutex> g(mu);
  drafts[next_id] = std::move(d);
  return next_id++;
}

void draft_release(int64_t id) {
  std::lock_guard<std::mutex> g(draft::mu);
  draft::drafts.erase(id);
}

// kv: every layer's key and value caches [B, Hkv, C, D] bf16 (k0, v0, k1, ...), with room for the
// taps and the block after each row's lengths[b] committed entries; taps [B, n, F] bf16 (n = 0:
// no context update) of which the first counts[b] are committed; anchors [B] int64 (empty: the
// context update alone). The block of S rows ([anchor, mask, ...]) runs at positions new
// lengths + s (causal: a flag a layer, as the caller reads the draft), the head reads rows
// row0 .. row0 + depth - 1. walk: the Markov walk and the confidences run here too, greedy, or
// sampled for the rows whose sampling [B, 3] (temperature, top_k, top_p; empty: every row greedy)
// has a temperature > 0, by their uniforms [B, depth]. -> (new lengths [B]) for a context update
// alone; else with walk (lengths, target ids [B, depth], confidence logits [B, depth] bf16 or empty,
// the sampled rows' distributions over the target's vocabulary [B, depth, V] fp32, zeros in the
// greedy rows (empty: none sampled)), without it
// (lengths, h [B, row0 + depth, H], head logits [B, depth, Vd] bf16) for a walk in Python
std::vector<torch::Tensor> draft_forward(int64_t id, std::vector<torch::Tensor> kv, torch::Tensor lengths,
                                         torch::Tensor taps, torch::Tensor counts, torch::Tensor anchors,
                                         torch::Tensor cos, torch::Tensor sin, std::vector<bool> causal, int64_t mask,
                                         int64_t S, int64_t row0, int64_t depth, bool walk, torch::Tensor sampling,
                                         torch::Tensor uniforms) {
  using namespace draft;
  const Draft& d = find(id);
  TORCH_CHECK(kv.size() == 2 * d.layers.size(), "draft_forward: ", 2 * d.layers.size(), " caches, got ", kv.size());
  TORCH_CHECK(lengths.dim() == 1 && lengths.scalar_type() == torch::kLong, "draft_forward: lengths must be [B] int64");
  const int64_t B = lengths.size(0);
  for (const auto& c : kv)
    TORCH_CHECK(c.scalar_type() == torch::kBFloat16 && c.is_contiguous() && c.dim() == 4 && c.size(0) == B &&
                    c.size(1) == d.hkv && c.size(3) == d.D,
                "draft_forward: caches must be contiguous bf16 [B, Hkv, C, D]");
  auto len = lengths.contiguous().clone();
  int64_t* lp = len.data_ptr<int64_t>();
  const int64_t C = kv[0].size(2);
  const int64_t n = taps.numel() ? taps.size(1) : 0;
  if (n) {
    TORCH_CHECK(taps.dim() == 3 && taps.size(0) == B && taps.scalar_type() == torch::kBFloat16,
                "draft_forward: taps must be [B, n, F] bf16");
    TORCH_CHECK(counts.numel() == B && counts.scalar_type() == torch::kLong, "draft_forward: counts must be [B] int64");
    for (int64_t b = 0; b < B; ++b)
      TORCH_CHECK(lp[b] + n <= C, "draft_forward: the context cache has no room for ", n, " entries");
    extend(d, kv, lp, taps.contiguous(), cos, sin);
    const auto cc = counts.contiguous();
    const int64_t* cp = cc.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b) {
      TORCH_CHECK(cp[b] >= 0 && cp[b] <= n, "draft_forward: count ", cp[b], " outside 0..", n);
      lp[b] += cp[b];
    }
  }
  if (!anchors.numel()) return {len};
  TORCH_CHECK(anchors.dim() == 1 && anchors.size(0) == B && anchors.scalar_type() == torch::kLong,
              "draft_forward: anchors must be [B] int64");
  TORCH_CHECK(S >= 1 && row0 >= 0 && depth >= 1 && row0 + depth <= S, "draft_forward: rows ", row0, "..", row0 + depth,
              " of a block of ", S);
  TORCH_CHECK(causal.size() == d.layers.size(), "draft_forward: ", d.layers.size(), " attention flags, got ",
              causal.size());
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(lp[b] + S <= C, "draft_forward: the context cache has no room for the block");
  const auto ac = anchors.contiguous();
  const auto h = block(d, kv, lp, ac, mask, S, row0 + depth, causal, cos, sin);
  const auto hs = h.narrow(1, row0, depth).contiguous();
  if (!walk) return {len, h, layers::lin(d.head, head_input(d, hs, nullptr)).contiguous()};  // [B, depth, Vd]
  const int64_t Vd = d.head.P.size(0) * 16;
  TORCH_CHECK(d.d2t.numel() == 0 || d.d2t.numel() == Vd, "draft_forward: d2t of ", d.d2t.numel(), " entries for ", Vd,
              " draft tokens");
  const float *sp = nullptr, *up = nullptr;
  torch::Tensor q = torch::empty({0}, torch::dtype(torch::kFloat));
  if (sampling.numel()) {
    TORCH_CHECK(sampling.dim() == 2 && sampling.size(0) == B && sampling.size(1) == 3 &&
                    sampling.scalar_type() == torch::kFloat && sampling.is_contiguous(),
                "draft_forward: sampling must be a contiguous fp32 [B, 3] (temperature, top_k, top_p)");
    TORCH_CHECK(uniforms.dim() == 2 && uniforms.size(0) == B && uniforms.size(1) == depth &&
                    uniforms.scalar_type() == torch::kFloat && uniforms.is_contiguous(),
                "draft_forward: uniforms must be a contiguous fp32 [B, depth]");
    sp = sampling.data_ptr<float>();
    up = uniforms.data_ptr<float>();
    for (int64_t b = 0; b < B; ++b)
      TORCH_CHECK(sp[3 * b] <= 0.f || (sp[3 * b + 1] >= 0.f && sp[3 * b + 2] > 0.f && sp[3 * b + 2] <= 1.f),
                  "draft_forward: row ", b, " samples with top_k ", sp[3 * b + 1], ", top_p ", sp[3 * b + 2]);
    q = torch::zeros({B, depth, d.embed.size(0)}, torch::dtype(torch::kFloat));
  }
  const auto h0 = row0 == 1 ? h.select(1, 0).contiguous() : torch::Tensor();
  const auto tokens = walk_block(d, hs, h0.defined() ? h0.data_ptr<at::BFloat16>() : nullptr, ac.data_ptr<int64_t>(),
                                 sp, up, q.numel() ? q.data_ptr<float>() : nullptr);
  const auto conf =
      d.conf_w.numel() ? confidences(d, hs, tokens, ac.data_ptr<int64_t>()) : torch::empty({0}, h.options());
  return {len, tokens, conf, q};
}
