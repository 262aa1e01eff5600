"""End-to-end check of a draft through the real engine: greedy decoding of held-out prompts with
and without speculation, same target, same run. Reports the acceptance statistics of
docs/DESIGN.md §8, the speedup, and how many outputs equal plain decoding token for token.
"""

from __future__ import annotations

import time

from tqdm.auto import tqdm

from dspark.engine.engine import Engine
from dspark.engine.sampling import SamplingParams
from dspark.train.data import encode_prompt
from dspark.train.prompts import Prompt


def engine_eval(
    engine: Engine,
    prompts: list[Prompt],
    *,
    max_new_tokens: int = 128,
    chat_template: bool = True,
    progress: bool = True,
) -> dict:
    """engine: the speculative engine (dspark.api.build_engine); its plain twin decodes the same prompts."""
    params = SamplingParams(max_new_tokens=max_new_tokens)
    plain_engine = engine.derive(speculative=False)
    same, t_spec, t_plain, n_spec, n_plain = 0, 0.0, 0.0, 0, 0
    for p in tqdm(prompts, desc="engine check", unit="prompt", disable=not progress):
        ids = encode_prompt(engine.tokenizer, p.text, chat_template)
        t = time.perf_counter()
        a = engine.generate(ids, params)
        t_spec += time.perf_counter() - t
        t = time.perf_counter()
        b = plain_engine.generate(ids, params)
        t_plain += time.perf_counter() - t
        same += a.output_ids == b.output_ids
        n_spec, n_plain = n_spec + len(a.output_ids), n_plain + len(b.output_ids)
    m = engine.metrics
    return {
        "prompts": len(prompts),
        "mean_accept_length": m.mean_accept_length,
        "conditional_accept": [round(x, 4) for x in m.conditional],
        "marginal_accept": [round(x, 4) for x in m.marginal],
        "verify_steps": m.steps,
        "outputs_equal_plain": same,
        "spec_tok_s": n_spec / t_spec if t_spec else 0.0,
        "plain_tok_s": n_plain / t_plain if t_plain else 0.0,
        "speedup": (n_spec / t_spec) / (n_plain / t_plain) if t_spec and t_plain and n_plain else 0.0,
        "seconds_draft": m.t_draft,
        "seconds_verify": m.t_verify,
        "seconds_other": m.t_other,
    }
