// What dspark's CPU extension exports, and what its translation units call across files. Each
// .cpp of dspark/csrc is compiled on its own (dspark/kernels.py: the ISA's matmul file,
// q4_avx512.cpp or q4_avx2.cpp, with every ISA-generic file and bindings.cpp, which hands these
// functions to Python) and sees the others only through this header.
#pragma once
#include <ATen/Parallel.h>
#include <torch/types.h>  // tensors without Python: only bindings.cpp includes torch/extension.h

#include <cstdint>
#include <string>
#include <vector>

// matmuls y [..., N] = x [..., K] @ W.T on packed weights (q4_avx512.cpp / q4_avx2.cpp)
torch::Tensor q4_mm(torch::Tensor x, torch::Tensor P, torch::Tensor D, torch::Tensor L);
torch::Tensor q8_mm(torch::Tensor x, torch::Tensor P, torch::Tensor D);
torch::Tensor bf16_mm(torch::Tensor x, torch::Tensor P, torch::Tensor D);

// RMS norms, with the residual add and the taps (norm.cpp)
torch::Tensor rms_bf16(torch::Tensor x, torch::Tensor w, double eps);
std::vector<torch::Tensor> add_rms_bf16(torch::Tensor x, torch::Tensor r, torch::Tensor w, double eps,
                                        torch::Tensor taps, int64_t col);

// attention by position and the gated MLP's activation (attn.cpp), RoPE into the cache (rope.cpp)
torch::Tensor attn_bf16(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor pos, double scale);
// the same over a prompt's many queries, faster, not attn_bf16's bits (attn_prefill.cpp); a prefill runs it
// from this many positions a row (layers.cpp, dspark.reference.kernel_loop)
constexpr int64_t PREFILL_ROWS = 16;
void amx_off();                   // no AMX tiles in this process (before any kernel runs)
std::string attn_prefill_kind();  // 'amx-bf16' | 'avx512-bf16 (why not AMX)' | 'per query (why)'
torch::Tensor attn_prefill_bf16(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor pos, double scale);
torch::Tensor silu_mul_bf16(torch::Tensor gu);
torch::Tensor rope_cache_bf16(torch::Tensor qk, torch::Tensor v, torch::Tensor cos, torch::Tensor sin, torch::Tensor kc,
                              torch::Tensor vc, torch::Tensor pos);

// the Markov head's greedy walk and torch's argmax choice (markov.cpp)
torch::Tensor markov_walk(torch::Tensor base, torch::Tensor w1, torch::Tensor w2t, torch::Tensor d2t,
                          torch::Tensor anchors);
torch::Tensor argmax_last(torch::Tensor x);

// a target's layer stack in one call (layers.cpp)
int64_t layers_register(std::vector<torch::Tensor> t);
void layers_release(int64_t id);
// a prefill of this many rows (batch x positions) runs the layers' dense bf16 matrices where they are set
constexpr int64_t PREFILL_MM_ROWS = 64;
void layers_set_dense(int64_t id, std::vector<torch::Tensor> t);
std::vector<torch::Tensor> layers_forward(int64_t id, torch::Tensor tokens, torch::Tensor embed, torch::Tensor kv,
                                          torch::Tensor cos, torch::Tensor sin, torch::Tensor lengths,
                                          torch::Tensor final_w, double eps, int64_t hq, int64_t hkv, int64_t tap_width,
                                          std::vector<int64_t> tap_cols, bool argmax, bool prefill);

// one request's speculative sampling (or plain sampling: no drafts) over the target's logits (sample.cpp)
torch::Tensor sample_accept(torch::Tensor logits, double temperature, int64_t top_k, double top_p, torch::Tensor q,
                            torch::Tensor drafts, torch::Tensor u);

// a draft's phase in one call (draft.cpp)
int64_t draft_register(std::vector<torch::Tensor> t, int64_t num_layers, int64_t hq, int64_t hkv, int64_t head_dim,
                       bool conf_markov, double eps, int64_t markov_kind);
void draft_release(int64_t id);
std::vector<torch::Tensor> draft_forward(int64_t id, std::vector<torch::Tensor> kv, torch::Tensor lengths,
                                         torch::Tensor taps, torch::Tensor counts, torch::Tensor anchors,
                                         torch::Tensor cos, torch::Tensor sin, std::vector<bool> causal, int64_t mask,
                                         int64_t S, int64_t row0, int64_t depth, bool walk, torch::Tensor sampling,
                                         torch::Tensor uniforms);

namespace layers {
struct Lin {                 // y = x @ W.T (+ b): W packed for dspark's tile; P's dtype names the format
  torch::Tensor P, D, L, b;  // L: int4 minimums (empty for Q8_0 / bf16); b: bias (empty: none)
};
torch::Tensor lin(const Lin& l, const torch::Tensor& x);  // the matmul P's dtype names
}  // namespace layers

namespace markov {
// x [..., V] fp32 or bf16 (contiguous) -> [...] int64: torch.argmax(x, -1), row by row
torch::Tensor argmax_rows(const torch::Tensor& x);
// the greedy walk over B blocks of g slots (markov_walk's arguments as pointers); T: float or c10::BFloat16
template <typename T>
void walk(const T* bp, const T* w1p, const T* wp, const int64_t* dp, const int64_t* ap, int64_t* op, int64_t B,
          int64_t g, int64_t V, int64_t r, int64_t Vt);
// the first largest of one slot's logits T(base + T(W2 z)) (the greedy walk's choice for that slot)
template <typename T>
int64_t best_of(const T* base, const float* z, const T* w2t, int64_t r, int64_t V);
// one slot's logits T(base + T(W2 z)) of every entry into out [V] (the values the greedy walk compares)
template <typename T>
void slot_logits(const T* base, const float* z, const T* w2t, int64_t r, int64_t V, float* out);
}  // namespace markov

namespace sampling {  // sample.cpp
// one token drawn from logits x [V] (overwritten) by sampling.probs' rule and the uniform u; q [V]
// receives the distribution drawn from
int64_t sample_slot(float* x, int64_t V, float temperature, int64_t top_k, float top_p, float u, float* q);
}  // namespace sampling
