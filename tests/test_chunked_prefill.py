"""Chunked prefill: a long prompt is prefilled a chunk a step between the running requests' decode
steps; what it commits is exactly what one piece commits (fp32, token for token)."""

import pytest
import torch
from dspark.engine.engine import Engine
from dspark.engine.sampling import SamplingParams
from dspark.errors import DSparkError
from dspark.target.load import make_target

from tests.tiny import hf_greedy, tiny_draft, tiny_target


@pytest.fixture(scope="module")
def target():
    return tiny_target()


def _long(n: int, seed: int = 0) -> list[int]:
    return torch.randint(4, 96, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("runtime", ["hf", "native"])
@pytest.mark.parametrize("with_draft", [False, True])
def test_a_prompt_prefilled_in_chunks_decodes_as_one_piece_does(target, runtime, with_draft):
    draft = tiny_draft(target) if with_draft else None
    prompts = [_long(61), _long(5, 1), _long(40, 2)]
    want = [hf_greedy(target, p, 24) for p in prompts]
    for chunk in (7, 16, 512):
        engine = Engine(make_target(target, runtime), draft, prefill_chunk=chunk, max_batch=4)
        solo = [engine.generate(p, SamplingParams(max_new_tokens=24)).output_ids for p in prompts]
        assert solo == want
        batched = engine.generate_many(prompts, SamplingParams(max_new_tokens=24))
        assert [r.output_ids for r in batched] == want
    if with_draft:  # the chunks' taps reach the draft context in order: as a clean prefill fills it
        from dspark.engine.drafting import flush_context

        engine = Engine(make_target(target, runtime), draft, prefill_chunk=7)
        req = engine.add_request(prompts[0], SamplingParams(max_new_tokens=24))
        while not engine.running:
            engine.step()
        flush_context(draft, engine.batch)
        committed = req.prompt_ids + req.output_ids[:-1]  # the joining step also decoded once
        _, taps = engine.target.forward(engine.target.new_state(1), torch.tensor([committed]))
        ctx = draft.new_context_cache(1, "cpu")
        draft.extend_context(ctx, taps, torch.tensor([len(committed)]))
        tol = 1e-5 if ctx.layers[0].k.dtype == torch.float32 else 2e-2
        assert int(engine.batch.ctx.lengths[0]) == len(committed)
        for mine, ref in zip(engine.batch.ctx.valid(), ctx.valid()):
            assert torch.allclose(mine.k.float(), ref.k.float(), atol=tol)
            assert torch.allclose(mine.v.float(), ref.v.float(), atol=tol)


def test_a_short_request_does_not_wait_for_a_long_prefill(target):
    """One chunk a step: a short request admitted beside a long prompt finishes while the long
    prompt is still prefilling, and the decoding requests step at every engine step."""
    engine = Engine(make_target(target, "hf"), None, prefill_chunk=8)
    long = engine.add_request(_long(200), SamplingParams(max_new_tokens=4))
    short = engine.add_request([5, 6, 7], SamplingParams(max_new_tokens=4))
    steps = 0
    while not short.finished:
        engine.step()
        steps += 1
        assert steps < 10
    assert not long.finished and engine.prefilling and engine.prefilling[0].done < 200
    engine.run_until_done()
    assert long.output_ids == hf_greedy(target, long.prompt_ids, 4) and short.output_ids == hf_greedy(
        target, [5, 6, 7], 4
    )
    assert long.t_first_token is not None and short.t_first_token < long.t_first_token


def test_a_prefilling_request_can_be_aborted_and_the_chunk_must_be_positive(target):
    engine = Engine(make_target(target, "hf"), None, prefill_chunk=8)
    req = engine.add_request(_long(100), SamplingParams(max_new_tokens=4))
    engine.step()
    assert engine.prefilling
    engine.abort(req)
    assert not engine.prefilling and not engine.has_work() and req.finish_reason == "abort"
    with pytest.raises(DSparkError, match="prefill chunk"):
        Engine(make_target(target, "hf"), None, prefill_chunk=0)


def test_the_flag_sets_the_chunk():
    import argparse

    from dspark.cli.engine_flags import add_engine_flags, engine_config

    p = argparse.ArgumentParser()
    add_engine_flags(p)
    assert engine_config(p.parse_args(["--prefill-chunk", "64"])).prefill_chunk == 64
