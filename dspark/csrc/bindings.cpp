// The extension's Python module: every function dspark.kernels calls, from dspark.h.
#include <torch/extension.h>

#include "dspark.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
#define DSPARK_DEF(f) m.def(#f, torch::wrap_pybind_function(f), #f)
  DSPARK_DEF(q4_mm);
  DSPARK_DEF(q8_mm);
  DSPARK_DEF(bf16_mm);
  DSPARK_DEF(rms_bf16);
  DSPARK_DEF(add_rms_bf16);
  DSPARK_DEF(attn_bf16);
  DSPARK_DEF(attn_prefill_bf16);
  DSPARK_DEF(attn_prefill_kind);
  DSPARK_DEF(amx_off);
  DSPARK_DEF(rope_cache_bf16);
  DSPARK_DEF(markov_walk);
  DSPARK_DEF(argmax_last);
  DSPARK_DEF(silu_mul_bf16);
  DSPARK_DEF(layers_register);
  DSPARK_DEF(layers_release);
  DSPARK_DEF(layers_set_dense);
  DSPARK_DEF(layers_forward);
  DSPARK_DEF(draft_register);
  DSPARK_DEF(draft_release);
  DSPARK_DEF(draft_forward);
  DSPARK_DEF(sample_accept);
#undef DSPARK_DEF
}
