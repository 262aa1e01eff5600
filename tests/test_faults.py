"""Issue 36, item 2: a fault inside one request's step ends that request alone.

Each test injects a fault that belongs to one request of a batch of four (a NaN in its row of
the target's states, a call that raises whenever that request is in the step, an error in its
output handling, a failing prefill), then checks that the request ended with "error" and a
reason, that every other request produced exactly what it produces decoded alone (fp32:
greedy token for token, seeded sampling too, since a failed step is replayed with the same
randomness), that the engine holds nothing afterwards, and that it serves a new request.
"""

from __future__ import annotations

import pytest
import torch
from dspark.engine.sampling import SamplingParams
from dspark.errors import DSparkError, NonFiniteError

from tests.tiny import engine_for, q4_exact, tiny_draft, tiny_target

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16], [20, 21]]
PARAMS = [
    SamplingParams(max_new_tokens=24),
    SamplingParams(max_new_tokens=24),
    SamplingParams(max_new_tokens=24, temperature=1.0, seed=7),
    SamplingParams(max_new_tokens=24),
]
VICTIM = 1


@pytest.fixture(scope="module")
def weights():
    torch.set_num_threads(1)
    model = tiny_target()
    return model, tiny_draft(model, gamma=3)


@pytest.fixture(scope="module")
def alone(weights):
    """Each request decoded alone: what it must produce in any batch, faults elsewhere or not."""
    eng = engine_for(*weights)
    return [eng.generate(p, sp).output_ids for p, sp in zip(PROMPTS, PARAMS)]


def run_batch(eng, on_tokens=None):
    reqs = [
        eng.add_request(p, sp, on_tokens if i == VICTIM else None) for i, (p, sp) in enumerate(zip(PROMPTS, PARAMS))
    ]
    eng.run_until_done()
    return reqs


def check_confined(eng, reqs, alone, reason: str):
    victim = reqs[VICTIM]
    assert victim.finish_reason == "error" and reason in victim.error
    for i, r in enumerate(reqs):
        if i != VICTIM:
            assert r.finish_reason == "length" and r.output_ids == alone[i], f"request {i} changed"
    assert eng.running == [] and eng.waiting == [] and eng.batch is None  # nothing held
    again = eng.generate(PROMPTS[0], PARAMS[0])
    assert again.output_ids == alone[0]


def test_a_nan_in_one_requests_row_ends_that_request_alone(weights, alone):
    model, draft = weights
    eng = engine_for(model, draft)
    seen = []

    def poison(_module, _inputs, out):
        # the 3rd decode step of all four: the victim's row of the final norm becomes NaN
        if out.shape[0] == len(PROMPTS) and len(eng.running) == len(PROMPTS):
            seen.append(1)
            if len(seen) == 3:
                out = out.clone()
                out[eng.running.index(reqs_box[0][VICTIM])] = float("nan")
        return out

    reqs_box = []
    handle = model.model.norm.register_forward_hook(poison)
    try:
        reqs = [eng.add_request(p, sp) for p, sp in zip(PROMPTS, PARAMS)]
        reqs_box.append(reqs)
        eng.run_until_done()
    finally:
        handle.remove()
    assert len(seen) >= 3
    assert 0 < len(reqs[VICTIM].output_ids) < PARAMS[VICTIM].max_new_tokens  # it failed mid-generation
    check_confined(eng, reqs, alone, "non-finite values (NaN/inf)")


def test_a_call_that_fails_whenever_one_request_is_in_the_step_ends_that_request_alone(weights, alone):
    model, draft = weights
    eng = engine_for(model, draft)
    real, steps = eng.policy.should_draft, []

    def should_draft(batch):
        steps.append(1)
        if len(steps) > 3 and any(p is PARAMS[VICTIM] for p in batch.params):
            raise RuntimeError("simulated kernel failure")
        return real(batch)

    eng.policy.should_draft = should_draft
    try:
        reqs = run_batch(eng)
    finally:
        del eng.policy.should_draft
    assert 0 < len(reqs[VICTIM].output_ids) < PARAMS[VICTIM].max_new_tokens
    # an exception that is not dspark's own: the reason is a fixed phrase, the log has the rest
    check_confined(eng, reqs, alone, "internal error in the decode step")
    assert "simulated" not in reqs[VICTIM].error


def test_an_error_in_one_requests_output_handling_ends_that_request_alone(weights, alone):
    """The server's per-token work (detokenizing, marks) runs in the request's callback."""
    eng = engine_for(*weights)
    calls = []

    def on_tokens(_req, _new):
        calls.append(1)
        if len(calls) == 4:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "simulated tokenizer failure")

    reqs = run_batch(eng, on_tokens)
    check_confined(eng, reqs, alone, "internal error in the output")


def test_a_failing_prefill_ends_that_request_alone(weights, alone):
    model, draft = weights
    eng = engine_for(model, draft)
    real = eng._prefill

    def prefill(req):
        if req.prompt_ids == PROMPTS[VICTIM]:
            raise RuntimeError("simulated failure at admission")
        return real(req)

    eng._prefill = prefill
    reqs = run_batch(eng)
    del eng._prefill
    assert reqs[VICTIM].output_ids == []
    check_confined(eng, reqs, alone, "internal error in the prefill")


def test_generate_raises_naming_why_a_request_failed(weights):
    model, draft = weights
    eng = engine_for(model, draft)
    handle = model.model.norm.register_forward_hook(lambda _m, _i, out: out * float("nan"))
    try:
        with pytest.raises(DSparkError, match=r"generation failed: the target computed non-finite"):
            eng.generate(PROMPTS[0], PARAMS[0])
    finally:
        handle.remove()
    assert eng.running == [] and eng.batch is None
    assert eng.generate(PROMPTS[0], PARAMS[0]).finish_reason == "length"


@pytest.mark.parametrize("runtime", ["torch", "kernels"])
def test_the_native_target_names_the_rows_whose_states_are_not_finite(runtime):
    """A NaN or an infinity reaching some rows' final states (here through a token's embedding)
    raises NonFiniteError naming those rows, on torch's layers (fp32) and on the compiled layer
    stack (bf16, which scans its own final states), for a plain step and a verify block alike."""
    from dspark import kernels
    from dspark.target.native import NativeTarget

    torch.set_num_threads(1)
    if runtime == "kernels":
        if kernels.extension() is None:
            pytest.skip(f"dspark's kernels do not run here ({kernels.why_unavailable()})")
        model = q4_exact(tiny_target())
        target = NativeTarget(model, (), act_dtype=torch.bfloat16)
        assert target._stack is not None
    else:
        target = NativeTarget(tiny_target(), ())
        assert target._stack is None
    state = target.new_state(3)
    target.forward(state, torch.tensor([[5, 6, 7], [8, 9, 10], [1, 2, 3]]))
    target.commit(state, torch.tensor([3, 3, 3]))
    best, _ = target.forward_argmax(state, torch.tensor([[12], [13], [14]]))  # all finite: no error
    target.commit(state, torch.tensor([0, 0, 0]))
    target.embed[11] = float("nan")
    target.embed[13] = float("inf")
    for tokens, rows in (([[12], [11], [14]], [1]), ([[13, 12], [12, 12], [12, 11]], [0, 2])):
        with pytest.raises(NonFiniteError) as e:
            target.forward_argmax(state, torch.tensor(tokens))
        assert e.value.rows == rows, tokens
        target.commit(state, torch.zeros(3, dtype=torch.long))


def test_through_the_server_a_failing_request_gets_its_error_and_the_others_their_answers():
    """A tokenizer error in one request's streamed text: its client gets a 500 naming the request,
    the three decoding beside it get exactly their answers, and nothing stays held."""
    from concurrent.futures import ThreadPoolExecutor

    import openai
    from dspark.serve.app import create_app

    from tests.test_serve import MODEL, LiveServer, expect, tiny_engine
    from tests.test_serve import PROMPTS as TEXTS

    engine = tiny_engine(max_batch=4)
    srv = LiveServer(create_app(engine, model_name=MODEL))
    worker = srv.app.state.worker
    real = worker._on_tokens

    def on_tokens(r, new):
        job = worker._jobs.get(r.id)
        if job is not None and job.max_tokens == 23 and len(r.output_ids) > 3:  # the victim: its unique length
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "simulated tokenizer failure")
        real(r, new)

    worker._on_tokens = on_tokens
    ref = tiny_engine()
    try:
        c = srv.client()

        def ask(i):
            try:
                r = c.completions.create(
                    model=MODEL, prompt=TEXTS[i], max_tokens=23 if i == VICTIM else 16, temperature=0
                )
                return r.choices[0].text
            except openai.InternalServerError as e:
                return e

        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(ask, range(4)))
        assert isinstance(got[VICTIM], openai.InternalServerError)
        assert "generation failed: internal error in the output (request cmpl-" in str(got[VICTIM])
        for i in range(4):
            if i != VICTIM:
                assert got[i] == expect(ref, TEXTS[i])[0]
        # a prompt too long for the context: refused before admission, holding nothing either
        with pytest.raises(openai.BadRequestError):
            c.completions.create(model=MODEL, prompt="word " * 600, max_tokens=4)
        assert engine.running == [] and engine.waiting == [] and engine.batch is None
        assert worker._in_flight == 0 and worker._jobs == {}
        assert srv.http.get("/health").status_code == 200
        assert (
            c.completions.create(model=MODEL, prompt=TEXTS[0], max_tokens=16, temperature=0).choices[0].text
            == expect(ref, TEXTS[0])[0]
        )
    finally:
        srv.close()
