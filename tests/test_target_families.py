"""Issue 3: the target adapter works for the Llama, Qwen2/Qwen3 and GPT-2 families."""

import pytest
import torch
from dspark.engine.sampling import SamplingParams
from transformers import GPT2Config, GPT2LMHeadModel, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from tests.tiny import FAMILY_SIZES, engine_for, hf_greedy, tiny_draft

COMMON = dict(FAMILY_SIZES, tie_word_embeddings=False)


def _qwen2():
    return Qwen2ForCausalLM(Qwen2Config(**COMMON))


def _qwen3():
    return Qwen3ForCausalLM(Qwen3Config(head_dim=16, **COMMON))


def _gpt2():
    return GPT2LMHeadModel(GPT2Config(vocab_size=96, n_embd=64, n_layer=3, n_head=4, n_positions=512))


@pytest.mark.parametrize("make", [_qwen2, _qwen3, _gpt2], ids=["qwen2", "qwen3", "gpt2"])
def test_greedy_equals_transformers_for_each_family(make):
    torch.manual_seed(0)
    model = make().float().eval()
    draft = tiny_draft(model, gamma=4)
    engine = engine_for(model, draft)
    for prompt in ([5, 17, 33, 8], [40, 41, 42, 43, 44, 45, 46, 47, 48]):
        req = engine.generate(prompt, SamplingParams(max_new_tokens=48))
        assert req.output_ids == hf_greedy(model, prompt, 48)


def test_tapped_states_are_layer_outputs_not_the_final_norm():
    """Tap index L (= num_layers) is the last layer's raw output: HF's hidden_states[-1] is normed."""
    torch.manual_seed(0)
    model = _qwen3().float().eval()
    from dspark.target.hf import HFTarget

    target = HFTarget(model, (1, 3))
    ids = torch.tensor([[3, 9, 27, 81, 50]])
    state = target.new_state(1)
    _, taps = target.forward(state, ids)
    with torch.no_grad():
        hs = model(ids, output_hidden_states=True).hidden_states
    assert torch.allclose(taps[..., :64], hs[1], atol=1e-5)
    assert not torch.allclose(taps[..., 64:], hs[3], atol=1e-3)  # hs[3] went through the final norm
    assert torch.allclose(model.model.norm(taps[..., 64:]), hs[3], atol=1e-4)


def _llama():
    from tests.tiny import tiny_target

    return tiny_target(vocab=96)


@pytest.mark.parametrize("make", [_llama, _qwen2, _qwen3, _gpt2], ids=["llama", "qwen2", "qwen3", "gpt2"])
def test_training_features_are_the_same_on_both_runtimes(make):
    """Issue 12: training's features (taps and post-norm final states of right-padded batches) come
    from the native runtime where the architecture is supported, equal to the hooked HF model's;
    other families keep the HF path, and asking for native there is a clear error."""
    from dspark.train.dataset import Sequence
    from dspark.train.errors import TrainError
    from dspark.train.features import Extractor

    torch.manual_seed(0)
    model = make().eval()
    g = torch.Generator().manual_seed(3)
    seqs = [
        Sequence(str(i), torch.randint(4, 96, (n,), generator=g), torch.ones(n, dtype=torch.bool))
        for i, n in enumerate((17, 5, 30))
    ]
    taps = (0, 2, 3)
    hf = Extractor(model, taps, "hf")
    want = hf(seqs)
    hf.close()
    auto = Extractor(model, taps, "auto")
    if make is _gpt2:
        assert auto.runtime == "hf"
        with pytest.raises(TrainError, match="--feature-runtime native"):
            Extractor(model, taps, "native")
        return
    assert auto.runtime == "native"
    got = auto(seqs)
    for (t1, f1), (t2, f2), s in zip(got, want, seqs):
        assert t1.shape == t2.shape == (len(s.ids), 3 * 64) and f1.shape == f2.shape == (len(s.ids), 64)
        assert torch.allclose(t1, t2, atol=1e-4) and torch.allclose(f1, f2, atol=1e-4)
