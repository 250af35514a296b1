"""Image-to-image requests in ``UnifiedImagePipeline`` (``pipe(prompt, image=source)``): Lumina-mGPT 2.0's
dual-panel layout and input-guided aggressive decoding (IAD, ``decoding="iad"``), on a tiny random pipeline.
Exactness against enumerated joints: tests/exactness/test_iad_exactness.py."""

from __future__ import annotations

import math

import numpy as np
import PIL.Image
import pytest
import torch

from vispec.decoding import DecodingConfig, decode

from unified_helpers import NUM_CODES, tiny_unified_pipeline


@pytest.fixture(scope="module")
def pipe():
    return tiny_unified_pipeline()


@pytest.fixture(scope="module")
def source(pipe):
    """A 16 x 16 source picture (what the pipeline itself draws), as a tensor in [0, 1]."""
    return pipe("a red cat", decoding="ar", output_type="pt", generator=torch.Generator().manual_seed(5)).images


def gens(count: int, seed: int = 0):
    return [torch.Generator().manual_seed(seed + i) for i in range(count)]


@torch.no_grad()
def reference_greedy_edit(pipe, prompt: str, source_tokens: torch.Tensor) -> torch.Tensor:
    """Greedy decoding (no guidance) by full forwards over the whole dual-panel sequence: the prompt in the
    pipeline's template, image start, resolution tokens of twice the height and the width, the source panel,
    then the decoded rows (end of row forced at row ends, masked elsewhere)."""
    cfg = pipe.config
    layout = pipe.layout(16, 16, source_panel=True)
    head = pipe.encode_prompt(prompt, 32, 16)[0] + [cfg.image_start_id, cfg.resolution_token_base + 32 // 8,
                                                    cfg.resolution_token_base + 16 // 8]
    sequence = head + layout.model_ids(source_tokens).tolist()
    ids = layout.model_ids(torch.arange(layout.vocab_size))
    tokens = []
    for position in range(layout.num_tokens):
        hidden = pipe.transformer.model(input_ids=torch.tensor([sequence])).last_hidden_state[0, -1]
        logits = pipe.transformer.lm_head(hidden)[ids]
        if position % layout.row_length == layout.row_length - 1:
            token = layout.num_codes
        else:
            logits[layout.num_codes:] = float("-inf")
            token = int(logits.argmax())
        tokens.append(token)
        sequence.append(int(layout.model_ids(torch.tensor(token))))
    return torch.tensor(tokens)


def test_dual_panel_layout_matches_a_full_forward_reference(pipe, source):
    layout = pipe.layout(16, 16, source_panel=True)
    pixels = pipe.image_processor.preprocess(source)
    source_tokens = pipe.source_tokens(pixels, layout)[0]
    expected = reference_greedy_edit(pipe, "a red cat", source_tokens)
    for decoding in ("ar", "iad", "mc-sjd:init=source"):
        out = pipe("a red cat", image=source, decoding=decoding, guidance_scale=1.0, top_k=1, output_type="latent",
                   generator=gens(1))
        assert torch.equal(out.images[0], layout.codes(expected[None])[0]), decoding


def test_iad_accepts_every_draft_of_a_perfect_source(pipe, source):
    """Greedy with a source equal to what the model writes: every copied draft is accepted, so a pass commits a
    whole window (the first token comes from the prefill)."""
    layout = pipe.layout(16, 16, source_panel=True)
    model = pipe.unified_model(layout)
    panel = pipe.source_tokens(pipe.image_processor.preprocess(source), layout)
    condition = model.condition([pipe.encode_prompt("a red cat", 32, 16)[0]], source=panel)
    sampling = DecodingConfig(top_k=1, guidance_scale=1.0).sampling()
    greedy = decode(model, condition, num_tokens=layout.num_tokens, sampling=sampling, decoding="ar").tokens
    window = 4
    out = decode(model, condition, num_tokens=layout.num_tokens, sampling=sampling, decoding=f"iad:window={window}",
                 source=greedy)
    assert torch.equal(out.tokens, greedy)
    assert int(out.stats.nfe[0]) == 1 + math.ceil((layout.num_tokens - 1) / window)
    holes = greedy.clone()
    holes[:, 1::2] = -1  # no source token at odd positions: horizontal fallback there, still exact
    assert torch.equal(decode(model, condition, num_tokens=layout.num_tokens, sampling=sampling, decoding="iad",
                              source=holes).tokens, greedy)


def test_outputs_stats_and_batch_independence(pipe, source):
    second = torch.flip(source, dims=[3])
    batch = pipe(["a red cat", "blue sky"], image=torch.cat([source, second]), decoding="iad", output_type="latent",
                 generator=gens(2))
    assert batch.images.shape == (2, 4, 4) and bool((batch.images >= 0).all() and (batch.images < NUM_CODES).all())
    assert all(0.0 <= s["source_kept"] <= 1.0 and s["method"].startswith("iad") for s in batch.stats)
    single = pipe("blue sky", image=second, decoding="iad", output_type="latent", generator=[gens(2)[1]])
    assert torch.equal(single.images[0], batch.images[1])
    shared = pipe(["a red cat", "blue sky"], image=source, num_images_per_prompt=2, decoding="mc-sjd:init=source",
                  output_type="latent", generator=gens(4))
    assert shared.images.shape == (4, 4, 4)
    as_pil = PIL.Image.fromarray((source[0].permute(1, 2, 0).numpy() * 255).round().astype(np.uint8))
    pixels = pipe("a red cat", image=as_pil, decoding="iad", output_type="pt", generator=gens(1)).images
    assert pixels.shape == (1, 3, 16, 16)


@pytest.mark.parametrize("kwargs,match", [
    ({"decoding": "iad"}, "give image="),
    ({"decoding": "mc-sjd:init=source"}, "give image="),
    ({"image": "picture.png"}, "image must be a PIL image"),
    ({"image": torch.full((1, 3, 16, 16), 2.0)}, r"must lie in \[0, 1\]"),
    ({"image": torch.zeros(3, 0, 0)}, r"image is empty: an array or tensor of shape \(3, 0, 0\)"),  # issue 47 item 10
    ({"image": np.zeros((0, 0, 3))}, r"image is empty: an array or tensor of shape \(0, 0, 3\)"),
    ({"image": torch.full((1, 3, 16, 16), float("nan"))}, "image has 768 NaN or infinite values"),  # item 7
    ({"image": torch.rand(1, 1, 16, 16)}, "3 channels"),
    ({"height": 32}, "height=32 differs from the source image's height 16"),
    ({"image": torch.rand(3, 3, 16, 16)}, "3 images for 1 prompts"),
])
def test_bad_input_is_named(pipe, source, kwargs, match):
    kwargs = {"image": source, **kwargs} if "image" in kwargs or kwargs.get("height") else kwargs
    with pytest.raises(ValueError, match=match):
        pipe("a red cat", output_type="latent", **kwargs)


def test_image_needs_a_vqvae(pipe, source):
    bare = type(pipe)(**{**pipe.components, "vqvae": None}, **{k: v for k, v in pipe.config.items() if not k.startswith("_")
                                                                and k not in pipe.components})
    with pytest.raises(ValueError, match="needs the pipeline's vqvae"):
        bare("a red cat", image=source, output_type="latent")


def test_condition_keeps_the_panel_in_the_unconditional_branch(pipe):
    layout = pipe.layout(16, 16, source_panel=True)
    model = pipe.unified_model(layout)
    panel = layout.tokens_of_codes(torch.arange(16).view(1, 4, 4) % NUM_CODES)
    condition = model.condition([[5, 6]], source=panel)
    ids = layout.model_ids(panel[0])
    assert torch.equal(condition.prompts[0][-ids.numel():], ids)
    assert torch.equal(condition.unconditional[0], torch.cat([torch.tensor(layout.prefix), ids]))
    broken = panel.clone()
    broken[0, 4] = 3  # a code where the end-of-row token belongs
    with pytest.raises(ValueError, match="every row must end with the end-of-row token"):
        model.condition([[5, 6]], source=broken)
