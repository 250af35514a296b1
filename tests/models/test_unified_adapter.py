"""The unified-token adapter (vispec.models.unified) on tiny random transformers models: its cache against full
forwards, greedy decoders against a reference loop, the layout's forced end-of-row tokens."""

from __future__ import annotations

import pytest
import torch

from vispec.decoding import decode
from vispec.models.unified import ImageLayout, UnifiedCondition
from vispec.sampling import SamplingConfig

from unified_helpers import BOI, CODE0, EOL, NUM_CODES, PROMPTS, reference_greedy, tiny_layout, tiny_unified

GREEDY = SamplingConfig(temperature=0.0, guidance_scale=3.0)


@pytest.fixture(scope="module")
def model():
    return tiny_unified()


def test_layout_counts_ids_and_grids():
    layout = tiny_layout(rows=3, cols=4)
    assert layout.num_tokens == 15 and layout.vocab_size == NUM_CODES + 1 and layout.row_length == 5
    tokens = torch.arange(15).remainder(5).where(torch.arange(15) % 5 != 4, NUM_CODES)[None]
    assert layout.model_ids(tokens)[0, :5].tolist() == [CODE0, CODE0 + 1, CODE0 + 2, CODE0 + 3, EOL]
    assert layout.codes(tokens).shape == (1, 3, 4) and bool((layout.codes(tokens) < NUM_CODES).all())
    assert layout.sequence(tokens)[0, :3].tolist() == [BOI, 43 + 3, 43 + 4]
    with pytest.raises(ValueError, match="rows must be an integer"):
        ImageLayout(rows=0, cols=4, num_codes=16)
    with pytest.raises(ValueError, match="prefix must be a tuple"):
        ImageLayout(rows=1, cols=4, num_codes=16, prefix=[1])


def test_windows_and_rollback_match_full_forwards(model):
    """Prompts of different lengths, windows of different widths, per-sample rollback: every window's logits
    equal a full forward of the same sequence."""
    condition = model.condition(PROMPTS)
    state, first = model.prefill(condition, guidance=False, max_new_tokens=15, window=4)
    ids = model.layout.model_ids(torch.arange(model.layout.vocab_size))

    def full(seq):
        with torch.no_grad():
            return model.model.lm_head(model.model.model(input_ids=torch.tensor([seq])).last_hidden_state[0])[:, ids]

    seqs = [list(p.tolist()) for p in condition.prompts]
    for b, seq in enumerate(seqs):
        assert torch.allclose(first.cond[b, 0], full(seq)[-1], atol=1e-5)
    generator = torch.Generator().manual_seed(0)
    for width, keep in ((3, [3, 1, 2]), (4, [2, 4, 0]), (2, [1, 2, 2])):
        window = torch.randint(0, NUM_CODES, (3, width), generator=generator)
        out = model.forward_window(state, window)
        for b in range(3):
            expected = full(seqs[b] + model.layout.model_ids(window[b]).tolist())[-width:]
            assert torch.allclose(out.cond[b], expected, atol=1e-5)
            seqs[b] += model.layout.model_ids(window[b, : keep[b]]).tolist()
        model.rollback(state, torch.tensor(keep))


@pytest.mark.parametrize("method", ["ar", "sjd", "mc-sjd", "sjd-vertical"])
def test_greedy_decoders_equal_the_reference(model, method):
    reference = reference_greedy(model, PROMPTS, guidance=3.0)
    out = decode(model, model.condition(PROMPTS), num_tokens=model.num_image_tokens, sampling=GREEDY, decoding=method,
                 generator=torch.Generator().manual_seed(0))
    assert torch.equal(out.tokens, reference)
    assert bool((out.tokens[:, 4::5] == NUM_CODES).all())  # end of row at every row's end, nowhere else
    assert bool((model.layout.codes(out.tokens) < NUM_CODES).all())


def test_sampled_decoders_respect_the_layout_and_batch_independence(model):
    sampling = SamplingConfig(temperature=1.0, top_k=8, guidance_scale=2.0)
    gens = lambda: [torch.Generator().manual_seed(10 + i) for i in range(3)]  # noqa: E731
    full = decode(model, model.condition(PROMPTS), num_tokens=15, sampling=sampling, decoding="mc-sjd", generator=gens())
    assert bool((full.tokens[:, 4::5] == NUM_CODES).all()) and bool((model.layout.codes(full.tokens) < NUM_CODES).all())
    single = decode(model, model.condition(PROMPTS[1:2]), num_tokens=15, sampling=sampling, decoding="mc-sjd",
                    generator=[gens()[1]])
    assert torch.equal(single.tokens[0], full.tokens[1])
    streamed = decode(model, model.condition(PROMPTS), num_tokens=15, sampling=sampling, decoding="mc-sjd",
                      generator=gens(), max_batch_size=2)
    assert torch.equal(streamed.tokens, full.tokens)


def test_conditions_are_checked(model):
    with pytest.raises(ValueError, match="prompt_ids must hold one list of non-negative token ids"):
        model.condition([[1, -2]])
    with pytest.raises(ValueError, match="negative_prompt_ids need cfg_mode 'negative'"):
        model.condition([[4]], negative_prompt_ids=[[5]])
    with pytest.raises(ValueError, match="guidance needs unconditional prompts"):
        model.prefill(UnifiedCondition([torch.tensor([4, 5])]), guidance=True, max_new_tokens=3)
    with pytest.raises(ValueError, match="condition must be a UnifiedCondition"):
        model.prefill([[4]], guidance=False, max_new_tokens=3)
    with pytest.raises(ValueError, match="compile=True is not supported for UnifiedTokenModel"):
        decode(model, model.condition(PROMPTS), num_tokens=15, decoding="ar", compile=True)


def test_cache_keyword_follows_the_forward_signature(model):
    """``cache=`` where ``forward`` has that parameter (transformers >= 5.24, the installed Chameleon included),
    ``past_key_values=`` otherwise (transformers 5.23, custom bodies)."""
    from torch import nn

    from vispec.models.unified import cache_keyword

    class Current(nn.Module):
        def forward(self, inputs_embeds=None, cache=None, **kwargs):
            return inputs_embeds

    class Previous(nn.Module):
        def forward(self, inputs_embeds=None, past_key_values=None, **kwargs):
            return inputs_embeds

    assert cache_keyword(Current()) == "cache" and cache_keyword(Previous()) == "past_key_values"
    import transformers
    from packaging.version import Version

    if Version(transformers.__version__) >= Version("5.24"):
        assert model.backbone.cache_keyword == "cache"
