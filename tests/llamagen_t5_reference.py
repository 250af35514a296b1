"""LlamaGen's text-to-image conditioning, written out for tests: a tiny T5 encoder and tokenizer built offline, and
the caption features LlamaGen's own sampling builds from them (FoundationVision/LlamaGen at commit ce98ec4,
``autoregressive/sample/sample_t2i.py`` and ``language/t5.py``). Used by the pipeline, conversion and docs tests.

The reference, step by step as the official code does it: captions lower-cased and stripped
(``T5Embedder.text_preprocessing`` without cleaning), tokenized with EOS, padded and truncated to 120 tokens
(``t5_feature_max_len``), the T5 encoder's ``last_hidden_state`` under the attention mask; then the left padding:
the mask flipped, each caption's valid features moved after its padding features, and the features multiplied by
the flipped mask (``c_indices``, ``c_emb_masks``). For guidance the null caption is the GPT's ``uncond_embedding``
under the same mask (``generate``: ``cond_null = zeros_like(cond) + uncond_embedding``, the mask on both halves)."""

from __future__ import annotations

import string

import torch
from transformers import T5Config, T5EncoderModel, T5Tokenizer

CAPTION_DIM = 16
WORDS = ["a", "photo", "of", "cat", "dog", "red", "blue", "on", "the", "grass", "sitting"]


def t5_tokenizer() -> T5Tokenizer:
    """T5's layout (<pad> 0, </s> 1, <unk> 2, SentencePiece pieces), words and single letters, no download."""
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    vocab += [(f"\u2581{w}", -3.0) for w in WORDS] + [(c, -5.0) for c in string.ascii_lowercase]
    return T5Tokenizer(vocab=vocab, extra_ids=0)


def t5_encoder(d_model: int = CAPTION_DIM, seed: int = 0) -> T5EncoderModel:
    """A random 2-layer T5 encoder with FLAN-T5's gated-GELU feed-forward."""
    torch.manual_seed(seed)
    config = T5Config(vocab_size=4 + len(WORDS) + 26, d_model=d_model, d_kv=4, d_ff=32, num_layers=2, num_heads=2,
                      feed_forward_proj="gated-gelu", dropout_rate=0.0)
    return T5EncoderModel(config).eval()


def write_t5_folder(folder, d_model: int = CAPTION_DIM) -> None:
    """A T5 folder as ``--text-encoder`` takes it (model and tokenizer files together, as google/flan-t5-xl)."""
    t5_encoder(d_model).save_pretrained(folder)
    t5_tokenizer().save_pretrained(folder)


@torch.no_grad()
def official_conditioning(t5, tokenizer, prompts, max_length=120):
    """LlamaGen's ``c_indices`` and ``c_emb_masks`` for ``prompts`` (module docstring), without caption cleaning."""
    texts = [p.lower().strip() for p in prompts]
    tokens = tokenizer(texts, max_length=max_length, padding="max_length", truncation=True, return_attention_mask=True,
                       add_special_tokens=True, return_tensors="pt")
    caption_embs = t5(input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"])["last_hidden_state"]
    emb_masks = tokens["attention_mask"]
    new_emb_masks = torch.flip(emb_masks, dims=[-1])
    shifted = []
    for caption_emb, emb_mask in zip(caption_embs, emb_masks):
        valid = int(emb_mask.sum().item())
        shifted.append(torch.cat([caption_emb[valid:], caption_emb[:valid]]))
    return torch.stack(shifted) * new_emb_masks[:, :, None], new_emb_masks
