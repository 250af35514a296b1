"""Tiny random unified-token models (transformers' own classes) and a reference greedy decoder for the tests."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from vispec.models.unified import ImageLayout, UnifiedTokenModel
from vispec.models.unified_families import chameleon_backbone

# a Chameleon-style vocabulary of 64 ids: text 4..39, image start 40, image end 41, end of row 42,
# resolution tokens 43..47 (n rows or columns: 43 + n), codes 48..63
TINY_VOCAB = 64
BOI, EOI, EOL, RES0, CODE0, NUM_CODES = 40, 41, 42, 43, 48, 16


def tiny_chameleon(seed: int = 0, layers: int = 2):
    """A random ``ChameleonForConditionalGeneration`` with a 64-id vocabulary (no VQ model is used)."""
    from transformers import ChameleonConfig, ChameleonForConditionalGeneration

    torch.manual_seed(seed)
    config = ChameleonConfig(
        vocab_size=TINY_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, vocabulary_map={"<image>": 1}, image_token_id=1,
        vq_config={"embed_dim": 8, "num_embeddings": 16, "latent_channels": 8, "base_channels": 32,
                   "channel_multiplier": [1, 1], "resolution": 16, "in_channels": 3, "out_channels": 3,
                   "num_res_blocks": 1, "attn_resolutions": []},
    )
    model = ChameleonForConditionalGeneration(config).eval()
    with torch.no_grad():  # a sharper head than the init gives, so greedy decisions are not near-ties
        model.lm_head.weight.normal_(std=0.5)
    return model


def tiny_layout(rows: int = 3, cols: int = 4) -> ImageLayout:
    return ImageLayout(rows=rows, cols=cols, num_codes=NUM_CODES, code_offset=CODE0, eol_id=EOL,
                       prefix=(BOI, RES0 + rows, RES0 + cols), suffix=(EOI,))


def tiny_unified(seed: int = 0, rows: int = 3, cols: int = 4) -> UnifiedTokenModel:
    layout = tiny_layout(rows, cols)
    return UnifiedTokenModel(chameleon_backbone(tiny_chameleon(seed), layout), layout, cfg_mode="image_start")


PROMPTS = [[4, 9, 17, 30], [5, 6], [22, 23, 24, 25, 26, 27]]


@torch.no_grad()
def reference_greedy(model: UnifiedTokenModel, prompts: list[list[int]], guidance: float) -> Tensor:
    """Greedy decoding by full forwards of ``model.model`` over whole sequences (no cache), guidance on raw
    logits from image start, the end-of-row token forced at row ends and masked elsewhere."""
    layout = model.layout
    ids = layout.model_ids(torch.arange(layout.vocab_size))
    out = []
    for prompt in prompts:
        cond = list(prompt) + list(layout.prefix)
        uncond = list(layout.prefix)
        tokens: list[int] = []
        for position in range(layout.num_tokens):
            def logits(seq: list[int]) -> Tensor:
                hidden = model.model.model(input_ids=torch.tensor([seq])).last_hidden_state[0, -1]
                return model.model.lm_head(hidden)[ids]
            c = logits(cond)
            mixed = c if guidance == 1.0 else logits(uncond) + guidance * (c - logits(uncond))
            if position % layout.row_length == layout.row_length - 1:
                token = layout.num_codes
            else:
                mixed[layout.num_codes:] = float("-inf")
                token = int(mixed.argmax())
            tokens.append(token)
            model_id = int(layout.model_ids(torch.tensor(token)))
            cond.append(model_id)
            uncond.append(model_id)
        out.append(tokens)
    return torch.tensor(out)


def unified_condition(model: UnifiedTokenModel, prompts: Optional[list[list[int]]] = None):
    return model.condition(prompts or PROMPTS)


PIPE_WORDS = "a red cat blue dog on the grass sky over sea".split()


def tiny_unified_pipeline(seed: int = 0):
    """A ``UnifiedImagePipeline`` over a tiny random Chameleon whose vocabulary is a word tokenizer's, then image
    start / end, end of row, resolution tokens (n = size / 8) and 16 codes, with a tiny random MoVQ-style
    diffusers ``VQModel`` (downsampling 4): a 16 x 16 image is 4 rows of 4 codes."""
    from diffusers import VQModel
    from transformers import ChameleonConfig, ChameleonForConditionalGeneration

    from vispec.decoding import DecodingConfig
    from vispec.eval.train.tokenizer import train_word_tokenizer
    from vispec.pipelines import UnifiedImagePipeline

    tokenizer = train_word_tokenizer([" ".join(PIPE_WORDS)])
    text = len(tokenizer)
    boi, eoi, eol, res0, code0 = text, text + 1, text + 2, text + 3, text + 12
    torch.manual_seed(seed)
    config = ChameleonConfig(
        vocab_size=code0 + NUM_CODES, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, vocabulary_map={"<image>": 1}, image_token_id=1,
        bos_token_id=tokenizer.bos_token_id, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        vq_config={"embed_dim": 8, "num_embeddings": 16, "latent_channels": 8, "base_channels": 32,
                   "channel_multiplier": [1, 1], "resolution": 16, "in_channels": 3, "out_channels": 3,
                   "num_res_blocks": 1, "attn_resolutions": []},
    )
    transformer = ChameleonForConditionalGeneration(config).eval()
    with torch.no_grad():
        transformer.lm_head.weight.normal_(std=0.5)
    torch.manual_seed(seed + 1)
    vqvae = VQModel(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 3,
                    up_block_types=("UpDecoderBlock2D",) * 3, block_out_channels=(32, 32, 32), layers_per_block=1,
                    latent_channels=4, num_vq_embeddings=NUM_CODES, vq_embed_dim=4, norm_num_groups=8,
                    norm_type="spatial").eval()
    pipe = UnifiedImagePipeline(
        transformer=transformer, tokenizer=tokenizer, vqvae=vqvae,
        decoding_config=DecodingConfig(strategy="mc-sjd", window=4, guidance_scale=3.0, top_k=8),
        family="chameleon", num_codes=NUM_CODES, code_offset=code0, eol_id=eol, image_start_id=boi, image_end_ids=[eoi],
        resolution_token_base=res0, resolution_unit=8, downsample=4, prompt_template="draw {prompt}",
        cfg_mode="image_start", default_height=16, default_width=16)
    pipe.set_progress_bar_config(disable=True)
    return pipe
