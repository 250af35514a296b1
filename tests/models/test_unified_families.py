"""The unified-token families (vispec.models.unified_families) on tiny random transformers models: each layout
read from the model's own vocabulary mapping, vispec's greedy AR / SJD / MC-SJD equal to transformers' own image
path token for token (Emu3 and Janus: ``model.generate``; Chameleon, whose ``forward`` masks image tokens: a greedy
loop over ``model.model`` and ``model.lm_head``), and sampled decoding that keeps the layout and per-sample
independence.

There are no tokenizer files offline, so prompts are token ids built by hand in the processors' formats:

* Emu3 (``Emu3Processor.__call__`` with ``return_for_image_generation=True`` then ``prepare_inputs_layout``):
  ``BOS text <|image start|> H*W <|image token|>``, ``H*W`` one token per character as Emu3's tokenizer splits
  digits (a real prompt: ``[151849, 64, 41189, 151852, 24, 15, 9, 24, 15, 151851]`` for "a puppy", 90*90);
  the model card's negative prompt is ``BOS text`` (no image prefix), the BAAI demo's has the prefix too.
* Janus (``JanusProcessor.__call__`` with ``generation_mode="image"``): ``BOS text <begin_of_image>``, padded on
  the left (the processor's ``padding_side``).
"""

from __future__ import annotations

import functools

import pytest
import torch

from vispec.decoding import decode
from vispec.models.unified import ImageLayout, UnifiedTokenModel
from vispec.models.unified_families import (
    chameleon_backbone, chameleon_layout, contiguous_code_ids, emu3_backbone, emu3_layout, janus_backbone, janus_layout,
    janus_special_ids)
from vispec.sampling import SamplingConfig

from unified_helpers import reference_greedy

GREEDY = SamplingConfig(temperature=0.0, guidance_scale=3.0)
SAMPLED = SamplingConfig(temperature=1.0, top_k=8, guidance_scale=2.0)
METHODS = ["ar", "sjd", "mc-sjd"]
TEXTS = [[14, 20, 33], [15, 16, 17, 18, 19]]  # two prompts of different lengths (a left-padded batch)


def _gens(n: int) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(10 + i) for i in range(n)]


def _left_pad(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    longest = max(map(len, rows))
    ids = torch.tensor([[pad] * (longest - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (longest - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


# ---- Emu3 ------------------------------------------------------------------------------------------------
# a 64-id vocabulary laid out like the real one (text, then specials, then the visual tokens last):
# 0 pad <|endoftext|>, 3..12 digits, 13 "*", 14..39 text, 40 <|extra_200|> (end of row), 41 <|extra_201|> (end of
# frame), 42 <image>, 43 BOS <|extra_203|>, 44 EOS <|extra_204|>, 45 <|image token|>, 46 <|image start|>,
# 47 <|image end|>, 48..63 <|visual token000000|>..<|visual token000015|>
E_PAD, E_EOL, E_EOF, E_BOS, E_EOS, E_WRAP, E_BOI, E_EOI, E_CODE0, E_NUM_CODES = 0, 40, 41, 43, 44, 45, 46, 47, 48, 16
E_ROWS, E_COLS = 3, 4


def emu3_vocabulary(code_ids=None) -> dict[str, int]:
    code_ids = code_ids or [E_CODE0 + c for c in range(E_NUM_CODES)]
    return {"<|endoftext|>": E_PAD, **{str(d): 3 + d for d in range(10)}, "*": 13,
            **{f"w{i}": 14 + i for i in range(26)}, "<|extra_200|>": E_EOL, "<|extra_201|>": E_EOF, "<image>": 42,
            "<|extra_203|>": E_BOS, "<|extra_204|>": E_EOS, "<|image token|>": E_WRAP, "<|image start|>": E_BOI,
            "<|image end|>": E_EOI, **{f"<|visual token{c:06d}|>": i for c, i in enumerate(code_ids)}}


def emu3_config(vocabulary_map=None):
    from transformers import Emu3Config

    return Emu3Config(
        text_config=dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, pad_token_id=E_PAD,
                         bos_token_id=E_BOS, eos_token_id=E_EOS),
        vq_config=dict(codebook_size=E_NUM_CODES, embed_dim=4, latent_channels=4, base_channels=32,
                       channel_multiplier=[1, 1], num_res_blocks=1, attn_resolutions=[], hidden_size=32,
                       num_attention_heads=1, temporal_downsample_factor=1),
        vocabulary_map=vocabulary_map or emu3_vocabulary())


@functools.lru_cache(maxsize=None)
def tiny_emu3():
    from transformers import Emu3ForConditionalGeneration

    torch.manual_seed(0)
    model = Emu3ForConditionalGeneration(emu3_config()).eval()
    with torch.no_grad():  # a sharper head than the init gives, so greedy decisions are not near-ties
        model.lm_head.weight.normal_(std=0.5)
    layout = emu3_layout(model, E_ROWS, E_COLS)
    return model, UnifiedTokenModel(emu3_backbone(model, layout), layout, cfg_mode="negative")


def emu3_prompts(texts, with_prefix: bool) -> list[list[int]]:
    """``BOS text`` (+ the processor's image prefix)."""
    prefix = list(tiny_emu3()[1].layout.prefix) if with_prefix else []
    return [[E_BOS, *t, *prefix] for t in texts]


EMU3_NEGATIVE = [30, 31, 32]  # one negative prompt for the whole batch, as in the model card


@functools.lru_cache(maxsize=None)
def emu3_generate(negative_has_prefix: bool) -> torch.Tensor:
    """transformers' greedy image path (the model card's): left-padded prompts ending with the image prefix (generate
    derives their position ids from the attention mask), the card's ``prefix_allowed_tokens_fn``, one negative prompt
    per sample (all of one length: UnbatchedClassifierFreeGuidanceLogitsProcessor runs them without position ids);
    the generated ids ``[B, T]``."""
    model, unified = tiny_emu3()
    height, width, visual = E_ROWS, E_COLS, model.vocabulary_mapping.image_tokens

    def allowed(batch_id, input_ids):
        offset = input_ids.shape[0] - torch.nonzero(input_ids == E_WRAP, as_tuple=True)[0][0]
        if offset % (width + 1) == 0:
            return [E_EOL]
        for k, token in enumerate((E_EOF, E_EOI, E_EOS), start=1):
            if offset == (width + 1) * height + k:
                return [token]
        return [E_PAD] if offset > (width + 1) * height + 3 else visual

    ids, mask = _left_pad(emu3_prompts(TEXTS, with_prefix=True), E_PAD)
    negatives = torch.tensor(emu3_prompts([EMU3_NEGATIVE] * len(TEXTS), with_prefix=negative_has_prefix))
    out = model.generate(ids, attention_mask=mask, prefix_allowed_tokens_fn=allowed, negative_prompt_ids=negatives,
                         negative_prompt_attention_mask=torch.ones_like(negatives),
                         guidance_scale=GREEDY.guidance_scale, do_sample=False,
                         max_new_tokens=unified.layout.num_tokens + 3)
    return out[:, ids.shape[1]:]


def emu3_condition(negative_has_prefix: bool, texts=TEXTS):
    unified = tiny_emu3()[1]
    negatives = [EMU3_NEGATIVE] * len(texts)
    if negative_has_prefix:  # BAAI demo: both prompts get the image prefix
        return unified.condition(emu3_prompts(texts, False), emu3_prompts(negatives, False))
    # model card: the prompts already end with the prefix, the negative prompts have none
    return unified.condition(emu3_prompts(texts, True), emu3_prompts(negatives, False), add_prefix=False)


def test_emu3_layout_reads_the_vocabulary():
    layout = emu3_layout(emu3_config(), E_ROWS, E_COLS)
    assert (layout.code_offset, layout.num_codes, layout.eol_id) == (E_CODE0, E_NUM_CODES, E_EOL)
    assert layout.prefix == (E_BOI, 3 + 3, 13, 3 + 4, E_WRAP)  # <|image start|> "3" "*" "4" <|image token|>
    assert layout.suffix == (E_EOF, E_EOI, E_EOS)
    assert emu3_layout(emu3_config(), 3, 4, size_ids=[20, 21]).prefix == (E_BOI, 20, 21, E_WRAP)
    shuffled = emu3_vocabulary([E_CODE0 + (c * 5) % E_NUM_CODES for c in range(E_NUM_CODES)])
    with pytest.raises(ValueError, match="Emu3 image tokens are not contiguous"):
        emu3_layout(emu3_config(shuffled), 3, 4)
    no_eol = {k: v for k, v in emu3_vocabulary().items() if k != "<|extra_200|>"}
    with pytest.raises(ValueError, match="no '<\\|extra_200\\|>' token"):
        emu3_layout(emu3_config(no_eol), 3, 4)


@pytest.mark.parametrize("negative_has_prefix", [False, True], ids=["model-card", "baai-demo"])
@pytest.mark.parametrize("method", METHODS)
def test_emu3_greedy_equals_transformers_generate(method, negative_has_prefix):
    """Guidance differs (log-softmax in UnbatchedClassifierFreeGuidanceLogitsProcessor, raw logits in vispec) by a
    per-row constant only, so the greedy choice is the same; the forced end-of-row / end tokens agree too."""
    unified = tiny_emu3()[1]
    expected = emu3_generate(negative_has_prefix)
    out = decode(unified, emu3_condition(negative_has_prefix), num_tokens=unified.layout.num_tokens, sampling=GREEDY,
                 decoding=method, generator=torch.Generator().manual_seed(0))
    sequence = unified.layout.sequence(out.tokens)[:, len(unified.layout.prefix):]
    assert torch.equal(sequence, expected)  # the rows, then <|extra_201|> <|image end|> EOS
    assert not torch.equal(emu3_generate(False), emu3_generate(True))  # the negative prompt matters


# ---- Janus -----------------------------------------------------------------------------------------------
J_PAD, J_BOS, J_BOI, J_NUM_CODES, J_SIDE = 0, 1, 40, 16, 3


@functools.lru_cache(maxsize=None)
def tiny_janus():
    from transformers import JanusConfig, JanusForConditionalGeneration

    torch.manual_seed(0)
    config = JanusConfig(
        text_config=dict(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, pad_token_id=J_PAD,
                         bos_token_id=J_BOS, eos_token_id=2),
        vision_config=dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, image_size=32, patch_size=8,
                           projection_dim=32, num_image_tokens=J_SIDE * J_SIDE, mlp_ratio=2.0),
        vq_config=dict(embed_dim=8, num_embeddings=J_NUM_CODES, latent_channels=8, base_channels=32,
                       channel_multiplier=[1, 1], num_res_blocks=1, projection_dim=32, image_token_embed_dim=32),
        image_token_id=3)
    model = JanusForConditionalGeneration(config).eval()
    model.generation_config.generation_kwargs = {"boi_token_id": J_BOI}  # as Janus checkpoints' generation_config
    with torch.no_grad():  # sharper than the init, so greedy decisions are not near-ties
        model.model.generation_head.vision_head.weight.normal_(std=0.5)
        model.model.generation_embeddings.weight.normal_(std=1.0)
        model.model.language_model.embed_tokens.weight.normal_(std=1.0)
    layout = janus_layout(model)
    ids = janus_special_ids(model)
    return model, UnifiedTokenModel(janus_backbone(model, layout), layout, cfg_mode="pad", bos_id=ids["bos_id"],
                                    pad_id=ids["pad_id"])


def janus_prompts(texts=TEXTS) -> list[list[int]]:
    return [[J_BOS, *t, J_BOI] for t in texts]


def test_janus_layout_and_special_ids():
    model, unified = tiny_janus()
    assert janus_special_ids(model) == {"bos_id": J_BOS, "pad_id": J_PAD, "boi_id": J_BOI}
    layout = unified.layout
    assert (layout.rows, layout.cols, layout.num_codes, layout.eol_id, layout.prefix) == (J_SIDE, J_SIDE, J_NUM_CODES,
                                                                                          None, (J_BOI,))
    assert layout.num_tokens == model.config.vision_config.num_image_tokens
    assert janus_layout(model.config, boi_id=J_BOI) == layout
    # the unconditional prompt is transformers': every token but BOS and <begin_of_image> replaced by pad
    condition = unified.condition(janus_prompts(), add_prefix=False)
    assert [u.tolist() for u in condition.unconditional] == [[J_BOS, J_PAD, J_PAD, J_PAD, J_BOI],
                                                             [J_BOS] + [J_PAD] * 5 + [J_BOI]]
    with pytest.raises(ValueError, match="needs boi_id"):
        janus_layout(model.config)
    with pytest.raises(ValueError, match="no end-of-row token"):
        janus_backbone(model, ImageLayout(rows=3, cols=3, num_codes=J_NUM_CODES, eol_id=5))


@functools.lru_cache(maxsize=None)
def janus_generate() -> torch.Tensor:
    """transformers' greedy image path: left-padded prompts (their positions shift with the padding, as
    ``JanusForConditionalGeneration.generate`` builds no position ids; RoPE is invariant to the shift)."""
    model = tiny_janus()[0]
    ids, mask = _left_pad(janus_prompts(), J_PAD)
    return model.generate(ids, attention_mask=mask, generation_mode="image", do_sample=False,
                          guidance_scale=GREEDY.guidance_scale)


@pytest.mark.parametrize("method", METHODS)
def test_janus_greedy_equals_transformers_generate(method):
    unified = tiny_janus()[1]
    out = decode(unified, unified.condition(janus_prompts(), add_prefix=False), num_tokens=unified.layout.num_tokens,
                 sampling=GREEDY, decoding=method, generator=torch.Generator().manual_seed(0))
    assert torch.equal(out.tokens, janus_generate())
    bare = unified.condition([[J_BOS, *t] for t in TEXTS])  # the layout's prefix adds <begin_of_image>
    assert [p.tolist() for p in bare.prompts] == janus_prompts()


# ---- Chameleon -------------------------------------------------------------------------------------------
# 64 ids: text 4..39, <racm3:break> (image start) 40, <eoss> (image end) 41, end of row 42 and resolution tokens
# 43 + n (a Lumina-mGPT-style fork), codes at 48..63 named like Chameleon's image tokens
C_BOI, C_EOI, C_EOL, C_RES0, C_CODE0, C_NUM_CODES = 40, 41, 42, 43, 48, 16
C_ROWS, C_COLS = 3, 4
C_PROMPTS = [[4, 9, 17, 30], [5, 6], [22, 23, 24, 25, 26, 27]]


def imgimg_name(code: int) -> str:
    """Chameleon's image token name: ``IMGIMG``, the code's digits as letters ``A``-``J``, a closing ``Z``."""
    return "IMGIMG" + "".join(chr(ord("A") + int(d)) for d in str(code)) + "Z"


def chameleon_config(code_ids=None):
    from transformers import ChameleonConfig

    code_ids = code_ids or [C_CODE0 + c for c in range(C_NUM_CODES)]
    vocabulary = {"<image>": 1, "<racm3:break>": C_BOI, "<eoss>": C_EOI,
                  **{imgimg_name(c): i for c, i in reversed(list(enumerate(code_ids)))}}
    return ChameleonConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, vocabulary_map=vocabulary, image_token_id=1,
        vq_config={"embed_dim": 8, "num_embeddings": C_NUM_CODES, "latent_channels": 8, "base_channels": 32,
                   "channel_multiplier": [1, 1], "resolution": 16, "in_channels": 3, "out_channels": 3,
                   "num_res_blocks": 1, "attn_resolutions": []})


@functools.lru_cache(maxsize=None)
def tiny_chameleon():
    from transformers import ChameleonForConditionalGeneration

    torch.manual_seed(1)
    model = ChameleonForConditionalGeneration(chameleon_config()).eval()
    with torch.no_grad():
        model.lm_head.weight.normal_(std=0.5)
    layout = chameleon_layout(model, C_ROWS, C_COLS, eol_id=C_EOL, size_ids=(C_RES0 + C_ROWS, C_RES0 + C_COLS))
    return model, UnifiedTokenModel(chameleon_backbone(model, layout), layout, cfg_mode="image_start")


def test_chameleon_layout_reads_the_image_vocabulary():
    model, unified = tiny_chameleon()
    layout = unified.layout
    assert (layout.code_offset, layout.num_codes, layout.eol_id) == (C_CODE0, C_NUM_CODES, C_EOL)
    assert layout.prefix == (C_BOI, C_RES0 + C_ROWS, C_RES0 + C_COLS) and layout.suffix == (C_EOI,)
    assert model.model.vocabulary_mapping.image_tokens == list(range(C_CODE0, C_CODE0 + C_NUM_CODES))
    swapped = [C_CODE0 + c for c in range(C_NUM_CODES)]
    swapped[3], swapped[4] = swapped[4], swapped[3]
    with pytest.raises(ValueError, match="Chameleon image tokens are not contiguous"):
        chameleon_layout(chameleon_config(swapped), 2, 2, eol_id=C_EOL)
    with pytest.raises(ValueError, match="not contiguous"):
        contiguous_code_ids({0: 5, 2: 7}, "x")
    # why the backbone bypasses forward: transformers' logits rule image tokens out
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([[4, 5, C_BOI]])).logits[0, -1]
    assert bool((logits[C_CODE0:C_CODE0 + C_NUM_CODES] == torch.finfo(logits.dtype).min).all())


@pytest.mark.parametrize("method", METHODS)
def test_chameleon_greedy_equals_a_loop_over_the_lm_head(method):
    unified = tiny_chameleon()[1]
    expected = reference_greedy(unified, C_PROMPTS, guidance=GREEDY.guidance_scale)
    out = decode(unified, unified.condition(C_PROMPTS), num_tokens=unified.layout.num_tokens, sampling=GREEDY,
                 decoding=method, generator=torch.Generator().manual_seed(0))
    assert torch.equal(out.tokens, expected)


# ---- sampled decoding, every family ----------------------------------------------------------------------
def sampled_case(family: str):
    """``(model, prompts, condition(prompts))`` of a family's tiny model."""
    if family == "emu3":
        return tiny_emu3()[1], TEXTS, lambda texts: emu3_condition(False, texts)
    if family == "janus":
        unified = tiny_janus()[1]
        return unified, TEXTS, lambda texts: unified.condition(janus_prompts(texts), add_prefix=False)
    unified = tiny_chameleon()[1]
    return unified, C_PROMPTS, unified.condition


@pytest.mark.parametrize("family", ["chameleon", "emu3", "janus"])
@pytest.mark.parametrize("method", ["ar", "mc-sjd"])
def test_sampled_decoding_keeps_the_layout_and_batch_independence(family, method):
    unified, prompts, condition = sampled_case(family)
    layout = unified.layout
    out = decode(unified, condition(prompts), num_tokens=layout.num_tokens, sampling=SAMPLED, decoding=method,
                 generator=_gens(len(prompts)))
    tokens = out.tokens
    assert tokens.shape == (len(prompts), layout.num_tokens)
    if layout.eol_id is not None:  # end of row at every row's end and nowhere else
        ends = torch.arange(layout.num_tokens) % layout.row_length == layout.row_length - 1
        assert bool((tokens[:, ends] == layout.num_codes).all()) and bool((tokens[:, ~ends] < layout.num_codes).all())
    codes = layout.codes(tokens)
    assert bool(((codes >= 0) & (codes < layout.num_codes)).all())
    alone = decode(unified, condition(prompts[1:2]), num_tokens=layout.num_tokens, sampling=SAMPLED, decoding=method,
                   generator=[_gens(len(prompts))[1]])
    assert torch.equal(alone.tokens[0], tokens[1])


# ---- forward compatibility: the current cache argument, no deprecation warning ---------------------------
def _deprecations(caught) -> list[str]:
    return [f"{w.category.__name__}: {w.message} ({w.filename}:{w.lineno})" for w in caught
            if issubclass(w.category, (FutureWarning, DeprecationWarning))]


@pytest.mark.parametrize("family", ["chameleon", "emu3", "janus"])
def test_decoding_emits_no_deprecation_warning(family):
    """Chameleon, Emu3's text model and Janus' Llama take the cache as ``cache=`` when their ``forward`` has it
    (transformers >= 5.24, which deprecates ``past_key_values=`` for removal in 5.40): a sampled MC-SJD decode
    warns nothing. The power check: the old keyword still warns on such a version, so the filter sees it."""
    import warnings

    from vispec.models.unified import cache_keyword

    unified, prompts, condition = sampled_case(family)
    body = unified.backbone.body
    assert unified.backbone.cache_keyword == cache_keyword(body)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        decode(unified, condition(prompts), num_tokens=unified.layout.num_tokens, sampling=SAMPLED, decoding="mc-sjd",
               generator=_gens(len(prompts)))
    assert _deprecations(caught) == []
    if unified.backbone.cache_keyword == "cache":
        state, _ = unified.prefill(condition(prompts), guidance=False, max_new_tokens=2)
        embeds = unified.backbone.embed_image(torch.zeros(len(prompts), 1, dtype=torch.long))
        positions = state.lengths[:, None]
        state.cache.write_at = positions
        with warnings.catch_warnings(record=True) as caught, torch.no_grad():
            warnings.simplefilter("always")
            body(inputs_embeds=embeds, position_ids=positions, past_key_values=state.cache, use_cache=True,
                 attention_mask=torch.zeros(len(prompts), 1, 1, state.cache.capacity))
        assert any("past_key_values" in message for message in _deprecations(caught))
