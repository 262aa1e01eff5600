// A decoder's layer stack in one call (docs/history/benchmarks.md, "... the layer loop in one call ..."): the same
// kernels, in the same order, as the Python loop of dspark/reference/kernel_loop.py (`layers`), whose
// Python-level calls and views a layer were a visible share of a SmolLM2 step. Bit for bit
// the Python loop's result (tested). The embedding lookup, the positions and, for a greedy plain
// step, the head and its argmax run in the same call ("a greedy plain step in one call"): after a step has streamed
// its weights through the caches, each small torch op it calls from Python runs cold.
//
// The weights are handed over once (`layers_register`) and kept here under a handle, since
// passing ~600 tensors through pybind on every call would cost what it saves.
#include "dspark.h"
#include <cmath>
#include <cstring>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace layers {

struct Layer {
  torch::Tensor ln1, qkn, ln2;  // qkn: Qwen3's q/k norm weights [Hq + Hkv, D] (empty: none)
  Lin qkv, o, gu, down;
  // the same four matrices as dense bf16 [N, K] for a long prefill (layers_set_dense; undefined: none)
  torch::Tensor dqkv, dout, dgu, ddown;
};

struct Stack {
  std::vector<Layer> layers;
  Lin head;  // the LM head where dspark's tile holds it (P empty: none; logits are then Python's)
};

std::mutex mu;
std::unordered_map<int64_t, Stack> stacks;
int64_t next_id = 1;

// a prefill's rows through the dense bf16 copy where there is one (torch's matmul: oneDNN's AMX tiles on
// CPUs that have them), else the packed tile
torch::Tensor lin_rows(const Lin& l, const torch::Tensor& dense, const torch::Tensor& x, bool many) {
  if (!many || !dense.defined()) return lin(l, x);
  auto y = at::linear(x, dense);
  return l.b.numel() ? y + l.b : y;
}

torch::Tensor lin(const Lin& l, const torch::Tensor& x) {
  const auto t = l.P.scalar_type();
  torch::Tensor y = t == torch::kByte   ? q4_mm(x, l.P, l.D, l.L)
                    : t == torch::kChar ? q8_mm(x, l.P, l.D)
                                        : bf16_mm(x, l.P, l.D);
  return l.b.numel() ? y + l.b : y;
}

}  // namespace layers

// t: per layer ln1, qk_norm, ln2, then P, D, L, bias of wqkv, wo, w13, w2 (19 tensors; an empty
// tensor where there is none), then the head's P, D, L, bias (4 more; P empty: no head here) ->
// a handle for layers_forward
int64_t layers_register(std::vector<torch::Tensor> t) {
  using namespace layers;
  constexpr size_t PER = 19;
  TORCH_CHECK(t.size() > 4 && (t.size() - 4) % PER == 0, "layers_register: ", PER,
              " tensors a layer and 4 for the head, got ", t.size());
  auto l = [&](size_t j) {
    const auto fmt = t[j].scalar_type();
    TORCH_CHECK(fmt == torch::kByte || fmt == torch::kChar || fmt == torch::kBFloat16,
                "layers_register: a weight dspark's tile does not hold");
    return Lin{t[j], t[j + 1], t[j + 2], t[j + 3]};
  };
  Stack stack;
  const size_t n = t.size() - 4;
  for (size_t i = 0; i < n; i += PER)
    stack.layers.push_back(Layer{t[i], t[i + 1], t[i + 2], l(i + 3), l(i + 7), l(i + 11), l(i + 15)});
  if (t[n].numel()) stack.head = l(n);
  std::lock_guard<std::mutex> g(mu);
  stacks[next_id] = std::move(stack);
  return next_id++;
}

// t: the dense bf16 [N, K] of each layer's wqkv, wo, w13, w2 (4 a layer), for layers_forward's prefills of
// PREFILL_MM_ROWS+ rows
void layers_set_dense(int64_t id, std::vector<torch::Tensor> t) {
  using namespace layers;
  std::lock_guard<std::mutex> g(mu);
  auto it = stacks.find(id);
  TORCH_CHECK(it != stacks.end(), "layers_set_dense: no layer stack ", id);
  auto& lys = it->second.layers;
  TORCH_CHECK(t.size() == 4 * lys.size(), "layers_set_dense: 4 matrices a layer, got ", t.size());
  for (size_t i = 0; i < lys.size(); ++i) {
    for (size_t j = 0; j < 4; ++j)
      TORCH_CHECK(
          t[4 * i + j].dim() == 2 && t[4 * i + j].scalar_type() == torch::kBFloat16 && t[4 * i + j].is_contiguous(),
          "layers_set_dense: contiguous 2-D bf16 matrices");
    lys[i].dqkv = t[4 * i];
    lys[i].dout = t[4 * i + 1];
    lys[i].dgu = t[4 * i + 2];
    lys[i].ddown = t[4 * i + 3];
  }
}

void layers_release(int64_t id) {
  std::lock_guard<std::mutex> g(layers::mu);
  layers::stacks.erase(id);
}

// tokens [B, S] embedded (embed [V, H]) and run through every layer at positions lengths[b] + s;
// kv [L, 2, B, Hkv, C, D] (the cache the new keys and values are written to), cos / sin the RoPE
// tables, final_w the final norm's weight. tap_width: 0, or the taps' width n*H: a new [B, S, n*H]
// receives layer i's output in columns tap_cols[i] (-1: none; allocated here, since a tensor made
// from Python right after a step runs cold). argmax: also the head and each position's argmax
// (the registered head; torch's choice over its bf16 logits). -> (the embeddings, the last layer's
// output, its final norm, the taps (empty: none)[, the argmax [B, S] int64]). prefill: the call runs a
// prompt (no verification compares its bits with a decode step's): attention of 16+ positions a row runs
// attn_prefill_bf16, not attn_bf16, and a call of PREFILL_MM_ROWS+ rows the layers' dense bf16 matrices
// where layers_set_dense gave them.
// the batch rows of h [B, S, H] bf16 holding a NaN or infinity (an exponent of all ones), as an int64
// tensor, empty where every value is finite: the check every forward makes on its final states, here
// where they are still in the caches; torch's isfinite and all right after a forward cost more than a
// 1-token step's whole bookkeeping
torch::Tensor nonfinite_rows(const torch::Tensor& h) {
  const int64_t B = h.size(0), n = h.numel() / std::max<int64_t>(B, 1);
  const auto hc = h.contiguous();
  const auto* p = reinterpret_cast<const uint16_t*>(hc.data_ptr<at::BFloat16>());
  std::vector<int64_t> bad;
  for (int64_t b = 0; b < B; ++b) {
    uint16_t any = 0;
    for (int64_t i = 0; i < n; ++i) any |= static_cast<uint16_t>((p[b * n + i] & 0x7F80) == 0x7F80);
    if (any) bad.push_back(b);
  }
  return torch::tensor(bad, torch::kLong);
}

std::vector<torch::Tensor> layers_forward(int64_t id, torch::Tensor tokens, torch::Tensor embed, torch::Tensor kv,
                                          torch::Tensor cos, torch::Tensor sin, torch::Tensor lengths,
                                          torch::Tensor final_w, double eps, int64_t hq, int64_t hkv, int64_t tap_width,
                                          std::vector<int64_t> tap_cols, bool argmax, bool prefill) {
  using namespace layers;
  const Stack* stack;
  {
    std::lock_guard<std::mutex> g(mu);
    auto it = stacks.find(id);
    TORCH_CHECK(it != stacks.end(), "layers_forward: no layer stack ", id);
    stack = &it->second;
  }
  const auto& lys = stack->layers;
  TORCH_CHECK(tokens.dim() == 2 && tokens.scalar_type() == torch::kLong && lengths.scalar_type() == torch::kLong &&
                  lengths.numel() == tokens.size(0) && embed.dim() == 2 && embed.scalar_type() == torch::kBFloat16,
              "layers_forward: tokens [B, S] and lengths [B] int64, embed [V, H] bf16");
  const int64_t L = static_cast<int64_t>(lys.size()), B = tokens.size(0), S = tokens.size(1), D = kv.size(5);
  const int64_t V = embed.size(0), H = embed.size(1);
  TORCH_CHECK(kv.dim() == 6 && kv.size(0) == L && tap_cols.size() == static_cast<size_t>(L), "layers_forward: ", L,
              " layers");
  TORCH_CHECK(!argmax || stack->head.P.numel(), "layers_forward: no head registered for argmax");
  // F.embedding and lengths[:, None] + arange(S), without two more ops from Python
  const auto tk = tokens.contiguous();
  const auto em = embed.contiguous();
  const int64_t* tp = tk.data_ptr<int64_t>();
  auto x = torch::empty({B, S, H}, em.options());
  auto* xp = x.data_ptr<at::BFloat16>();
  const auto* ep = em.data_ptr<at::BFloat16>();
  for (int64_t i = 0; i < B * S; ++i) {
    TORCH_CHECK(tp[i] >= 0 && tp[i] < V, "token id ", tp[i], " is outside the vocabulary of ", V);
    std::memcpy(xp + i * H, ep + tp[i] * H, H * sizeof(at::BFloat16));
  }
  const auto lc = lengths.contiguous();
  const int64_t* lp = lc.data_ptr<int64_t>();
  auto pos = torch::empty({B, S}, tk.options());
  int64_t* pp = pos.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t j = 0; j < S; ++j) pp[b * S + j] = lp[b] + j;
  const auto embedded = x;
  const double scale = std::pow(static_cast<double>(D), -0.5);  // Python's D ** -0.5
  const auto none = torch::empty({0}, x.options());
  TORCH_CHECK(tap_width >= 0, "layers_forward: tap width ", tap_width);
  for (const int64_t c : tap_cols)
    TORCH_CHECK(c < 0 || c + H <= tap_width, "layers_forward: tap column ", c, " outside the taps' width ", tap_width);
  const auto taps = tap_width ? torch::empty({B, S, tap_width}, x.options()) : none;
  torch::Tensor h = rms_bf16(x, lys[0].ln1, eps);
  // a long prefill's matmuls on the dense copies where they are set (the packed tiles otherwise)
  const bool dense = prefill && B * S >= PREFILL_MM_ROWS;
  for (int64_t li = 0; li < L; ++li) {
    const Layer& ly = lys[li];
    const auto lkv = kv.select(0, li);
    const auto kc = lkv.select(0, 0), vc = lkv.select(0, 1);
    auto qkv = lin_rows(ly.qkv, ly.dqkv, h, dense).view({B, S, hq + 2 * hkv, D});
    torch::Tensor q;
    if (ly.qkn.numel()) {  // Qwen3: q_norm on the query heads, k_norm on the key heads
      q = rope_cache_bf16(rms_bf16(qkv.narrow(2, 0, hq + hkv), ly.qkn, eps), qkv.narrow(2, hq + hkv, hkv), cos, sin, kc,
                          vc, pos);
    } else {  // the kernel reads the value heads from qkv
      q = rope_cache_bf16(qkv, none, cos, sin, kc, vc, pos);
    }
    auto o = prefill && S >= PREFILL_ROWS ? attn_prefill_bf16(q, kc, vc, pos, scale) : attn_bf16(q, kc, vc, pos, scale);
    auto xh = add_rms_bf16(x, lin_rows(ly.o, ly.dout, o, dense), ly.ln2, eps, none, 0);
    const auto& next = li + 1 < L ? lys[li + 1].ln1 : final_w;
    const bool tap = tap_cols[li] >= 0;
    xh = add_rms_bf16(xh[0], lin_rows(ly.down, ly.ddown, silu_mul_bf16(lin_rows(ly.gu, ly.dgu, xh[1], dense)), dense),
                      next, eps, tap ? taps : none, tap ? tap_cols[li] : 0);
    x = xh[0];
    h = xh[1];
  }
  auto ids = argmax ? markov::argmax_rows(lin(stack->head, h)) : none;
  return {embedded, x, h, taps, ids, nonfinite_rows(h)};
}
