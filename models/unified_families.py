"""Backbones and layouts of the unified-token families for :class:`vispec.models.unified.UnifiedTokenModel`:
transformers' Chameleon (and Chameleon forks such as Lumina-mGPT 2.0), Emu3 and Janus.

Each family has a ``*_backbone(model, layout)`` (how to embed, run the layers and compute image logits) and a
``*_layout(...)`` that reads the image's token ids from the model's own vocabulary mapping, so that vispec's
decoders generate exactly the tokens transformers' own image path allows (facts cited per function; files are
under ``transformers/models/<family>/``, transformers 5.x).

Prompt and guidance conventions (how to call :meth:`UnifiedTokenModel.condition`):

* Emu3 (``processing_emu3.py`` with ``return_for_image_generation=True``): ``BOS text <|image start|> H*W
  <|image token|>``; guidance takes a negative prompt (``cfg_mode="negative"``). transformers' model card tokenizes
  the negative prompt *without* the image prefix (then ``condition(prompts, negatives, add_prefix=False)`` with
  prompts that end with the prefix); the original BAAI demo gives both the prefix (``add_prefix=True`` on bare
  prompts).
* Janus (``processing_janus.py`` with ``generation_mode="image"``): the chat prompt followed by
  ``<begin_of_image>``; guidance replaces every prompt token but BOS and ``<begin_of_image>`` by pad
  (``cfg_mode="pad"``, ``bos_id`` / ``pad_id`` from :func:`janus_special_ids`).
* Chameleon forks (Lumina-mGPT): the image prefix is image start and resolution tokens, guidance starts at image
  start (``cfg_mode="image_start"``).
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional, Sequence

from torch import nn

from vispec.models.offload import materialized
from vispec.models.unified import Backbone, ImageLayout, lm_head_backbone


def _config(model_or_config: Any) -> Any:
    return model_or_config.config if isinstance(model_or_config, nn.Module) else model_or_config


def _lookup(vocab: Mapping[str, int], name: str, family: str) -> int:
    if name not in vocab:
        raise ValueError(f"the {family} vocabulary_map has no {name!r} token")
    return int(vocab[name])


def contiguous_code_ids(code_to_id: Mapping[int, int], family: str) -> tuple[int, int]:
    """``(code_offset, num_codes)`` of an image-code -> vocabulary-id map whose codes are ``0..N-1`` at the
    contiguous ids ``offset + code`` (what :class:`ImageLayout` needs); raises a ValueError otherwise."""
    if not code_to_id:
        raise ValueError(f"the {family} vocabulary_map holds no image tokens")
    num_codes = len(code_to_id)
    offset = code_to_id.get(0)
    if sorted(code_to_id) != list(range(num_codes)) or offset is None or any(
            code_to_id[c] != offset + c for c in range(num_codes)):
        raise ValueError(f"the {family} image tokens are not contiguous (code c at id offset + c for codes "
                         f"0..{num_codes - 1}): vispec's ImageLayout cannot map them")
    return int(offset), num_codes


# ---- Chameleon -------------------------------------------------------------------------------------------

def chameleon_backbone(model: nn.Module, layout: ImageLayout) -> Backbone:
    """transformers' ``ChameleonForConditionalGeneration`` (and Lumina-mGPT 2.0, a Chameleon fork). Its
    ``forward`` sets the logits of ``vocabulary_mapping.image_tokens`` to ``finfo.min`` ("Disallow image tokens",
    ``modeling_chameleon.py``: text generation only), so the backbone runs ``model.model`` and takes the LM
    head's rows of the codes and the end-of-row token itself."""
    return lm_head_backbone(model, model.model, model.model.embed_tokens, model.lm_head, model.config, layout)


def chameleon_code_ids(model_or_config: Any) -> tuple[int, int]:
    """``(code_offset, num_codes)`` from ``config.vocabulary_map``: image code ``c`` is the token named
    ``IMGIMG`` + the digits of ``c`` written as letters ``A``-``J`` + one closing character
    (``ChameleonImageVocabularyMapping.bpe2img``, ``modeling_chameleon.py``)."""
    from transformers.models.chameleon.modeling_chameleon import ChameleonImageVocabularyMapping

    vocab = _config(model_or_config).vocabulary_map or {}
    mapping = ChameleonImageVocabularyMapping(vocab)
    return contiguous_code_ids(mapping.img2bpe if mapping.image_tokens else {}, "Chameleon")


def chameleon_layout(model_or_config: Any, rows: int, cols: int, *, eol_id: Optional[int],
                     boi_id: Optional[int] = None, size_ids: Sequence[int] = (),
                     suffix: Optional[Sequence[int]] = None) -> ImageLayout:
    """The layout of a ``rows x cols`` image of a Chameleon-family model, its codes read from the vocabulary map
    (:func:`chameleon_code_ids`). ``boi_id`` defaults to the vocabulary's ``<racm3:break>`` and ``suffix`` to
    ``(<eoss>,)``: the image start / end tokens ``ChameleonProcessor`` uses when the tokenizer names no
    ``boi_token`` / ``eoi_token`` (``processing_chameleon.py``). Chameleon itself has no end-of-row or resolution
    tokens; a fork gives them (Lumina-mGPT: ``eol_id`` 8803, ``size_ids`` ``8804 + rows, 8804 + cols``)."""
    vocab = _config(model_or_config).vocabulary_map or {}
    offset, num_codes = chameleon_code_ids(model_or_config)
    boi = _lookup(vocab, "<racm3:break>", "Chameleon") if boi_id is None else boi_id
    end = (_lookup(vocab, "<eoss>", "Chameleon"),) if suffix is None else tuple(suffix)
    return ImageLayout(rows=rows, cols=cols, num_codes=num_codes, code_offset=offset, eol_id=eol_id,
                       prefix=(boi, *size_ids), suffix=end)


# ---- Emu3 ------------------------------------------------------------------------------------------------

EMU3_EOL, EMU3_EOF = "<|extra_200|>", "<|extra_201|>"
EMU3_BOI, EMU3_EOI, EMU3_WRAPPER = "<|image start|>", "<|image end|>", "<|image token|>"


def emu3_backbone(model: nn.Module, layout: ImageLayout) -> Backbone:
    """transformers' ``Emu3ForConditionalGeneration``: ``model.model.text_model`` (an ``Emu3TextModel``) and
    ``model.lm_head`` (its ``forward`` masks nothing); visual tokens are ordinary vocabulary ids
    (``model.vocabulary_mapping.image_tokens``; build the layout with :func:`emu3_layout`)."""
    text = model.model.text_model
    return lm_head_backbone(model, text, text.embed_tokens, model.lm_head, model.config.text_config, layout)


def emu3_layout(model_or_config: Any, height_tokens: int, width_tokens: int, *,
                size_ids: Optional[Sequence[int]] = None) -> ImageLayout:
    """The layout of an Emu3 image of ``height_tokens x width_tokens`` codes, read from ``config.vocabulary_map``.

    * codes: the tokens named ``<|visual tokenNNNNNN|>``, code ``int(NNNNNN)`` (``Emu3ImageVocabularyMapping.img2bpe``,
      ``modeling_emu3.py``); they must be contiguous (:func:`contiguous_code_ids`);
    * end of row: ``<|extra_200|>`` (``Emu3ImageVocabularyMapping.eol_token_id``), after every row
      (``convert_img2bpe``; the model card's ``prefix_allowed_tokens_fn`` forces it every ``width + 1`` tokens);
    * prefix: ``<|image start|>``, the text ``f"{H}*{W}"``, ``<|image token|>`` (``Emu3Processor.__call__`` with
      ``return_for_image_generation=True``). ``size_ids`` are that text's token ids; by default every character
      is looked up on its own, as Emu3's tokenizer splits digits (``"90*90"`` -> ``9``, ``0``, ``*``, ``9``, ``0``);
    * suffix: ``<|extra_201|>`` (end of frame), ``<|image end|>`` and the text config's EOS, the tokens the
      model card's prefix function forces after the last row.
    """
    config = _config(model_or_config)
    vocab = config.vocabulary_map or {}
    from transformers.models.emu3.modeling_emu3 import Emu3ImageVocabularyMapping

    mapping = Emu3ImageVocabularyMapping(vocab)
    offset, num_codes = contiguous_code_ids(mapping.img2bpe if mapping.image_tokens_str else {}, "Emu3")
    if size_ids is None:
        size_ids = [_lookup(vocab, ch, "Emu3") for ch in f"{height_tokens}*{width_tokens}"]
    prefix = (_lookup(vocab, EMU3_BOI, "Emu3"), *(int(i) for i in size_ids), _lookup(vocab, EMU3_WRAPPER, "Emu3"))
    eos = config.text_config.eos_token_id
    suffix = (_lookup(vocab, EMU3_EOF, "Emu3"), _lookup(vocab, EMU3_EOI, "Emu3"))
    suffix += (eos,) if isinstance(eos, int) else ()
    return ImageLayout(rows=height_tokens, cols=width_tokens, num_codes=num_codes, code_offset=offset,
                       eol_id=_lookup(vocab, EMU3_EOL, "Emu3"), prefix=prefix, suffix=suffix)


# ---- Janus -----------------------------------------------------------------------------------------------

def janus_backbone(model: nn.Module, layout: ImageLayout) -> Backbone:
    """transformers' ``JanusForConditionalGeneration`` in image mode (``generate(generation_mode="image")``,
    ``modeling_janus.py``): prompt tokens through the language model's input embeddings, image tokens through
    ``prepare_embeddings_for_image_generation`` (``generation_embeddings`` then ``generation_aligner``), image
    logits from ``model.model.generation_head`` on the language model's ``last_hidden_state`` (codes only: no
    end-of-row token, code ids start at 0)."""
    if layout.eol_id is not None:
        raise ValueError("Janus images have no end-of-row token: eol_id must be None")
    inner = model.model
    if layout.num_codes != inner.generation_embeddings.num_embeddings:
        raise ValueError(f"num_codes must be {inner.generation_embeddings.num_embeddings} (Janus' generation "
                         f"embeddings), got {layout.num_codes}")
    if layout.code_offset != 0:
        raise ValueError(f"Janus codes are the generation head's outputs: code_offset must be 0, "
                         f"got {layout.code_offset}")
    language = inner.language_model
    return Backbone(language, language.get_input_embeddings(), model.prepare_embeddings_for_image_generation,
                    inner.generation_head, model.config.text_config, model,
                    lambda: materialized(inner.generation_embeddings))  # with values under sequential offload too


def janus_special_ids(model: nn.Module) -> dict[str, int]:
    """``bos_id``, ``pad_id`` and ``boi_id`` as ``JanusForConditionalGeneration.generate`` reads them: from
    ``model.generation_config`` (``bos_token_id``, ``pad_token_id``, ``generation_kwargs["boi_token_id"]``)."""
    gen = model.generation_config
    ids = {"bos_id": gen.bos_token_id, "pad_id": gen.pad_token_id,
           "boi_id": (gen.generation_kwargs or {}).get("boi_token_id")}
    missing = [k for k, v in ids.items() if not isinstance(v, int)]
    if missing:
        raise ValueError(f"the Janus generation_config lacks {missing} (bos_token_id, pad_token_id, "
                         "generation_kwargs['boi_token_id'])")
    return ids


def janus_layout(model_or_config: Any, boi_id: Optional[int] = None) -> ImageLayout:
    """The layout of a Janus image: ``vision_config.num_image_tokens`` codes (what ``generate`` decodes) on a
    square grid, ``vq_config.num_embeddings`` codes, no end-of-row token and no suffix. ``prefix`` is
    ``<begin_of_image>`` (``boi_id``; from :func:`janus_special_ids` when a model is given): ``JanusProcessor``
    with ``generation_mode="image"`` already ends the prompt with it, so pass such prompts with
    ``condition(..., add_prefix=False)``; the prefix still names the token ``cfg_mode="pad"`` keeps."""
    config = _config(model_or_config)
    if boi_id is None:
        if not isinstance(model_or_config, nn.Module):
            raise ValueError("janus_layout needs boi_id (or the model, whose generation_config names it)")
        boi_id = janus_special_ids(model_or_config)["boi_id"]
    tokens = config.vision_config.num_image_tokens
    side = math.isqrt(tokens)
    if side * side != tokens:
        raise ValueError(f"Janus num_image_tokens={tokens} is not a square grid")
    return ImageLayout(rows=side, cols=side, num_codes=config.vq_config.num_embeddings, prefix=(boi_id,))
