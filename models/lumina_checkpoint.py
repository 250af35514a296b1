"""Lumina-mGPT 2.0 checkpoints as transformers 5.x ``ChameleonForConditionalGeneration``, and its special tokens.

Facts from Alpha-VLLM/Lumina-mGPT-2.0 (commit ``f44a4d7``):

* **Model class.** ``lumina_mgpt/inference_solver.py`` loads the Hugging Face folder
  ``Alpha-VLLM/Lumina-mGPT-2.0`` with the repo's fork of transformers' Chameleon
  (``lumina_mgpt/model/chameleon/modeling_chameleon.py``; ``requirements.txt`` pins transformers 4.46.2); training (``finetune_solver.py``) uses
  ``ChameleonXLLMXForConditionalGeneration`` (``model/modeling_xllmx_chameleon.py``, same modules plus a
  z-loss) and deletes ``model.vqmodel`` (Chameleon's VQ image encoder, unused: images are tokenized by
  MoVQGAN, :mod:`vispec.models.movqgan`) before training; ``xllmx/util/ckpt.py`` saves with
  ``save_pretrained`` plus an ``args.json``, which the published folder also lists.
* **Weight names** are the transformers Chameleon names (``model.embed_tokens``, ``model.layers.{i}.self_attn.
  {q,k,v,o}_proj``, ``.self_attn.{q,k}_norm``, ``.mlp.{gate,up,down}_proj``, ``.input_layernorm``,
  ``.post_attention_layernorm``, ``model.norm``, ``lm_head``), and transformers 5.23 keeps them (no
  ``_checkpoint_conversion_mapping`` for Chameleon, still ``model.`` + ``lm_head``). The one difference is the
  **qk-norm layout**: the fork's ``ChameleonLayerNorm`` stores ``weight``/``bias`` of shape
  ``[model_parallel_size, head_dim]`` and ``repeat_interleave``s them ``num_heads // model_parallel_size``
  times at every forward (``num_key_value_heads // model_parallel_size`` for ``k_norm``); transformers 5.23
  stores ``[num_heads, head_dim]`` (``[num_key_value_heads, head_dim]``). :func:`convert_lumina_state_dict`
  expands them once; ``model.vqmodel.*`` keys, if a folder has them, are dropped.
* **Config.** ``config.json`` is a ``ChameleonXLLMXConfig`` (fork ``ChameleonConfig`` fields +
  ``z_loss_weight``). :func:`lumina_chameleon_config` maps it; the fields transformers 5.23 lacks are listed in
  :data:`LUMINA_ONLY_CONFIG_FIELDS`. Notably the fork masks the ``IMGIMG*`` ids of ``vocabulary_map`` in the
  logits only when ``mask_image_logits`` (default True; ``scripts/train.sh`` trains with
  ``--unmask_image_logits``), whereas transformers 5.23 always masks them: the converted config keeps those
  ``vocabulary_map`` entries exactly when the official one asks for masking.
* The forward is otherwise the same computation (RMSNorm, qk LayerNorm with eps 1e-5, half-split RoPE,
  SwiGLU, optional ``swin_norm`` ordering); the fork's residual ``dropout`` is inactive in eval mode. The fork
  returns float32 logits (``logits.float()`` after ``lm_head``), transformers 5.23 the model's dtype: cast
  when running in bfloat16 (the values are the same, the mask value is the dtype's minimum).

Not verified here (no hub access, only the folder's file listing): the released ``config.json`` values (its
5.86 MB size suggests a full ``vocabulary_map``) and whether the released shards contain ``model.vqmodel.*``;
the four shards (15.76 GB in bfloat16, about 7.9B parameters) are consistent with 32 layers of width
4096 / 11008 and a vocabulary of about 172k.
"""

from __future__ import annotations

import dataclasses
import os
import re
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from transformers import ChameleonConfig, ChameleonForConditionalGeneration

from vispec.checks import check_int

from vispec.models.checkpoints import (
    TRANSFORMERS_WEIGHT_FACTS,
    TooManyParameters,
    check_config_fields,
    check_state_dict,
    parameter_limit,
    read_json_object,
    safetensors_header,
    tensor_budget,
    too_many_parameters,
)
from vispec.models.llada_checkpoint import read_sharded_safetensors, shard_files

__all__ = [
    "LuminaSpecialTokens",
    "LUMINA_ONLY_CONFIG_FIELDS",
    "LUMINA_VQMODEL_PREFIX",
    "lumina_chameleon_config",
    "convert_lumina_state_dict",
    "load_lumina_chameleon",
]


# ----------------------------------------------------------------------------------------- tokens
@dataclass(frozen=True)
class LuminaSpecialTokens:
    """Lumina-mGPT 2.0's token layout and sampling defaults (``lumina_mgpt/`` of Alpha-VLLM/Lumina-mGPT-2.0).

    An image is ``[image_start, res(h), res(w), row_0, end_of_row, ..., row_{H-1}, end_of_row, image_end]`` with
    ``H = h / 8`` rows of ``W = w / 8`` image tokens (``data/item_processor.py`` ``process_image``).

    * ``image_start`` ``<racm3:break>`` = 151665 and ``image_end`` ``<eoss>`` = 151666: names in
      ``FlexARItemProcessor``, ids hard-coded in ``inference_solver.py`` (``151665 in _prompt``,
      ``eos_token_id=[151666]``, ``decode_ids``) and ``finetune_solver.py``;
    * ``end_of_row`` ``<reserved08799>`` (``FlexARItemProcessor.new_line_token``) = 151670: ``decode_ids`` drops
      151670 before decoding;
    * image token = MoVQGAN code + ``image_token_offset`` 155000 (``get_image_token``), so ids 155000..171383 for
      the 16384 codes (``MultiModalLogitsProcessor.image_token_list = range(155000, 171383 + 1)``);
    * resolution tokens ``<reserved{8800 + n:05d}>`` with ``n = size // patch_size`` (``patch_size`` 32), height
      first (``get_n_grids_token``). Their ids are **looked up by name** in the tokenizer
      (``token2id``) and decoded by parsing the name (``int(id2token(t)[-5:-1]) - 8800``); no id is hard-coded in
      the 2.0 code (``decode_image``'s ``- 8804`` is dead code from Lumina-mGPT 1's Chameleon vocabulary). So
      ``resolution_ids`` is empty unless built :meth:`from_vocab` (the tokenizer's ``get_vocab()`` or the
      config's ``vocabulary_map``);
    * ``separator`` ``<reserved08706>`` ends each conversation turn (``data/convertsation.py``); the t2i prompt is
      BOS + ``prompt_template`` text + separator (``xllmx/data/item_processor.py`` encodes with ``bos=True``);
      its id, like BOS's, comes from the tokenizer;
    * ``prompt_template`` from ``generate_examples/generate.py`` (width first; ``TRAIN.md`` writes ``{h}x{w}``);
    * ``cfg_scale`` 4.0, ``image_top_k`` 4096, ``temperature`` 1.0: ``README.md`` and ``scripts/sample.sh``
      (768 x 768); ``text_top_k`` 10 (``generate.py``). The unconditional CFG branch is the sequence from the
      image-start token on (``LLMImageStartTriggeredUnbatchedClassifierFreeGuidanceLogitsProcessor``); that
      processor overwrites its scale at every step with ``max(4.0, scale * (1 - n / (4 h_grids w_grids)))``
      (``n`` tokens since image start), so any scale other than 1.0 (no guidance) acts as at least 4.
    """

    image_start: int = 151665
    image_end: int = 151666
    end_of_row: int = 151670
    image_token_offset: int = 155000
    codebook_size: int = 16384
    patch_size: int = 32
    downsample: int = 8
    resolution_base: int = 8800
    separator: Optional[int] = None
    resolution_ids: Mapping[int, int] = field(default_factory=dict, hash=False)
    prompt_template: str = "Generate an image of {width}x{height} according to the following prompt:\n{prompt}"
    cfg_scale: float = 4.0
    image_top_k: int = 4096
    text_top_k: int = 10
    temperature: float = 1.0

    @classmethod
    def from_vocab(cls, vocab: Mapping[str, int], **overrides: Any) -> "LuminaSpecialTokens":
        """Ids read from a token -> id map (``tokenizer.get_vocab()`` or ``config.json``'s ``vocabulary_map``):
        the structural tokens by their official names (the vocabulary wins over the defaults) and every
        ``<reserved{8800 + n:05d}>`` resolution token present."""
        if not isinstance(vocab, Mapping):
            raise ValueError(f"vocab must map token strings to ids; got {type(vocab).__name__}")
        names = {"image_start": "<racm3:break>", "image_end": "<eoss>", "end_of_row": "<reserved08799>",
                 "separator": "<reserved08706>"}
        found: dict[str, Any] = {attr: int(vocab[name]) for attr, name in names.items() if name in vocab}
        base = overrides.get("resolution_base", cls.resolution_base)
        pattern = re.compile(r"<reserved(\d{5})>")
        resolution = {}
        for name, token_id in vocab.items():
            m = pattern.fullmatch(name) if isinstance(name, str) else None
            if m is not None and int(m.group(1)) > base:
                resolution[int(m.group(1)) - base] = int(token_id)
        return cls(**{**found, "resolution_ids": resolution, **overrides})

    @property
    def image_token_ids(self) -> range:
        """Ids of the image tokens: ``image_token_offset + code`` for every MoVQGAN code."""
        return range(self.image_token_offset, self.image_token_offset + self.codebook_size)

    def grid(self, height: int, width: int) -> tuple[int, int]:
        """``(rows, cols)`` of image tokens for an image of ``height x width`` pixels (multiples of ``patch_size``)."""
        for name, size in (("height", height), ("width", width)):
            if not isinstance(size, int) or size <= 0 or size % self.patch_size:
                raise ValueError(f"{name} must be a positive multiple of {self.patch_size} (Lumina-mGPT 2.0 crops "
                                 f"to whole {self.patch_size}-px patches); got {size!r}")
        return height // self.downsample, width // self.downsample

    def resolution_token_id(self, n_grids: int) -> int:
        """The id of ``<reserved{8800 + n_grids:05d}>`` (``n_grids`` = pixels / ``patch_size``)."""
        if n_grids not in self.resolution_ids:
            raise ValueError(
                f"the id of resolution token <reserved{self.resolution_base + n_grids:05d}> is unknown: the official "
                "code looks it up by name in the tokenizer, so build "
                "LuminaSpecialTokens.from_vocab(tokenizer.get_vocab()) "
                f"(known grid counts: {sorted(self.resolution_ids)[:8]}{'...' if len(self.resolution_ids) > 8 else ''})")
        return self.resolution_ids[n_grids]

    def grids_of(self, token_id: int) -> int:
        """The grid count a resolution token stands for (inverse of :meth:`resolution_token_id`)."""
        for n, known in self.resolution_ids.items():
            if known == token_id:
                return n
        raise ValueError(f"token id {token_id} is not a known resolution token")

    def image_prefix(self, height: int, width: int) -> list[int]:
        """``[image_start, res(height), res(width)]``: the forced tokens an image starts with."""
        self.grid(height, width)
        return [self.image_start, self.resolution_token_id(height // self.patch_size),
                self.resolution_token_id(width // self.patch_size)]

    def image_length(self, height: int, width: int) -> int:
        """Tokens of a whole image: prefix (3) + ``rows * (cols + 1)`` + ``image_end``."""
        rows, cols = self.grid(height, width)
        return 3 + rows * (cols + 1) + 1

    def prompt(self, prompt: str, height: int, width: int) -> str:
        """The t2i instruction text (before tokenization, BOS and the separator)."""
        self.grid(height, width)
        return self.prompt_template.format(width=width, height=height, prompt=prompt)

    def replace(self, **changes: Any) -> "LuminaSpecialTokens":
        """A copy with ``changes`` (``dataclasses.replace``)."""
        return dataclasses.replace(self, **changes)


# ----------------------------------------------------------------------------------------- config
# Defaults of the fork's ChameleonConfig / ChameleonXLLMXConfig (model/chameleon/configuration_chameleon.py),
# used for fields a config.json omits.
_FORK_DEFAULTS: dict[str, Any] = {
    "vocab_size": 65536, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 32, "hidden_act": "silu", "max_position_embeddings": 4096,
    "initializer_range": 0.02, "rms_norm_eps": 1e-5, "use_cache": True, "pad_token_id": None, "bos_token_id": 1,
    "eos_token_id": 2, "tie_word_embeddings": False, "attention_bias": False, "attention_dropout": 0.0,
    "model_parallel_size": 1, "swin_norm": False, "mlp_bias": False,
}
_ROPE_KEYS = ("rope_theta", "rope_scaling")
_SIZE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "max_position_embeddings", "model_parallel_size")
_VQ_FIELDS = ("embed_dim", "num_embeddings", "double_latent", "latent_channels", "resolution", "in_channels",
              "base_channels", "channel_multiplier", "num_res_blocks", "attn_resolutions", "dropout", "attn_type",
              "initializer_range")

#: Fields of Lumina-mGPT 2.0's ``config.json`` that transformers 5.23's ``ChameleonConfig`` does not have.
LUMINA_ONLY_CONFIG_FIELDS: dict[str, str] = {
    "mask_image_logits": "fork flag (default True) to mask the vocabulary_map IMGIMG* ids in the logits; "
                         "transformers 5.23 always masks them, so the converted vocabulary_map keeps those entries "
                         "only when it is True",
    "dropout": "residual dropout of the fork's decoder layers (train.sh: 0.05); inactive at inference",
    "z_loss_weight": "ChameleonXLLMXConfig training loss weight; unused at inference",
    "rope_scaling": "the fork's {'type', 'factor'} RoPE scaling; mapped to rope_parameters with rope_theta",
    "rope_theta": "mapped to rope_parameters['rope_theta']",
}


def _rope_parameters(official: Mapping[str, Any]) -> dict[str, Any]:
    theta = float(official.get("rope_theta", 10000.0))
    scaling = official.get("rope_scaling")
    if scaling is None:
        return {"rope_type": "default", "rope_theta": theta}
    kind = scaling.get("type", scaling.get("rope_type")) if isinstance(scaling, Mapping) else None
    if kind not in ("linear", "dynamic") or not isinstance(scaling.get("factor"), (int, float)):
        raise ValueError("config.json rope_scaling must be None or {'type': 'linear'|'dynamic', 'factor': float}; "
                         f"got {scaling!r}")
    return {"rope_type": kind, "factor": float(scaling["factor"]), "rope_theta": theta}


def lumina_chameleon_config(official_config: Mapping[str, Any]) -> ChameleonConfig:
    """A transformers 5.x ``ChameleonConfig`` from Lumina-mGPT 2.0's ``config.json`` (a dict).

    Chameleon fields carry over (the fork's defaults fill absent ones); ``rope_theta``/``rope_scaling`` become
    ``rope_parameters``; ``vq_config`` keeps the ``ChameleonVQVAEConfig`` fields; ``vocabulary_map`` loses its
    ``IMGIMG*`` entries unless ``mask_image_logits`` is set (see :data:`LUMINA_ONLY_CONFIG_FIELDS`). Generic
    ``PretrainedConfig`` fields (``architectures``, ``torch_dtype``, ...) are not carried.
    """
    if not isinstance(official_config, Mapping):
        raise ValueError(f"official_config must be the config.json dict; got {type(official_config).__name__}")
    model_type = official_config.get("model_type", "chameleon")
    if model_type != "chameleon":
        raise ValueError(f"config.json has model_type={model_type!r}; a Lumina-mGPT 2.0 config has 'chameleon'")
    fields = {key: official_config.get(key, default) for key, default in _FORK_DEFAULTS.items()}
    if fields["num_key_value_heads"] is None:
        fields["num_key_value_heads"] = fields["num_attention_heads"]
    for key in _SIZE_FIELDS:
        check_int(f"config.json {key}", fields[key], minimum=1)
    heads, kv_heads, mp = fields["num_attention_heads"], fields["num_key_value_heads"], fields["model_parallel_size"]
    if fields["hidden_size"] % heads or heads % kv_heads or kv_heads % mp:
        raise ValueError(f"config.json: hidden_size ({fields['hidden_size']}) must be a multiple of num_attention_heads "
                         f"({heads}), which must be a multiple of num_key_value_heads ({kv_heads}), a multiple of "
                         f"model_parallel_size ({mp})")
    vq = official_config.get("vq_config") or {}
    if not isinstance(vq, Mapping):
        raise ValueError(f"config.json vq_config must be an object; got {type(vq).__name__}")
    vocabulary = official_config.get("vocabulary_map") or {}
    if not isinstance(vocabulary, Mapping):
        raise ValueError(f"config.json vocabulary_map must be an object; got {type(vocabulary).__name__}")
    if not official_config.get("mask_image_logits", True):
        vocabulary = {k: v for k, v in vocabulary.items() if not str(k).startswith("IMGIMG")}
    try:
        return ChameleonConfig(**fields, rope_parameters=_rope_parameters(official_config),
                               vq_config={k: vq[k] for k in _VQ_FIELDS if k in vq}, vocabulary_map=dict(vocabulary))
    except ValueError:
        raise
    except Exception as err:  # noqa: BLE001 - transformers' strict config validation: one line naming the file
        reason = " ".join(line.strip() for line in str(err).splitlines() if line.strip())[:300]
        raise ValueError(f"config.json is not a valid Chameleon config: {reason or type(err).__name__}") from None


# ----------------------------------------------------------------------------------------- weights
#: Prefix of Chameleon's VQ image encoder (``ChameleonModel.vqmodel``): dropped from Lumina folders, and the only
#: keys a converted state dict lacks for ``ChameleonForConditionalGeneration`` (Lumina-mGPT 2.0 never uses it).
LUMINA_VQMODEL_PREFIX = "model.vqmodel."
_TOP_KEYS = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
_LAYER_KEY = re.compile(
    r"model\.layers\.(\d+)\.(?:self_attn\.(?:q_proj|k_proj|v_proj|o_proj)\.(?:weight|bias)"
    r"|self_attn\.(q_norm|k_norm)\.(?:weight|bias)|mlp\.(?:gate_proj|up_proj|down_proj)\.(?:weight|bias)"
    r"|(?:input_layernorm|post_attention_layernorm)\.weight)")


def _expand_qk_norm(key: str, value: torch.Tensor, norm: str, layer: str,
                    official: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """A fork qk-norm parameter ``[model_parallel_size, head_dim]`` as ``[heads, head_dim]`` (repeat_interleave)."""
    proj = f"model.layers.{layer}.self_attn.{norm[0]}_proj.weight"
    if value.ndim != 2:
        raise ValueError(f"{key}: expected shape [model_parallel_size, head_dim]; got {tuple(value.shape)}")
    if proj not in official:
        raise ValueError(f"{key}: cannot size it without {proj} (its head count comes from that projection)")
    groups, head_dim = value.shape
    rows = official[proj].shape[0]
    if rows % head_dim or (rows // head_dim) % groups:
        raise ValueError(f"{key}: {groups} group(s) of head_dim {head_dim} do not divide the {rows} rows of {proj}")
    return value.repeat_interleave(rows // head_dim // groups, dim=0)


def convert_lumina_state_dict(official: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Lumina-mGPT 2.0 weights (fork Chameleon names) -> transformers 5.23 ``ChameleonForConditionalGeneration``.

    Names are kept; ``self_attn.{q,k}_norm.{weight,bias}`` go from ``[model_parallel_size, head_dim]`` to
    ``[num_heads, head_dim]`` / ``[num_key_value_heads, head_dim]`` (head counts read off ``q_proj``/``k_proj``);
    ``model.vqmodel.*`` is dropped. Any other key raises ``ValueError`` (all unknown keys listed).
    """
    converted: dict[str, torch.Tensor] = {}
    unknown: list[str] = []
    for key, value in official.items():
        if key.startswith(LUMINA_VQMODEL_PREFIX):
            continue
        if key in _TOP_KEYS:
            converted[key] = value
        elif (m := _LAYER_KEY.fullmatch(key)) is not None:
            norm, layer = m.group(2), m.group(1)
            converted[key] = value if norm is None else _expand_qk_norm(key, value, norm, layer, official)
        else:
            unknown.append(key)
    if unknown:
        more = f" and {len(unknown) - 20} more" if len(unknown) > 20 else ""
        raise ValueError(f"cannot map {len(unknown)} Lumina-mGPT key(s) to transformers Chameleon names: "
                         f"{sorted(unknown)[:20]}{more}")
    return converted


def _read_config(folder: str) -> dict[str, Any]:
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"{folder} is not a Lumina-mGPT checkpoint folder: config.json is missing")
    return read_json_object(path)


def read_lumina_config(path: str | os.PathLike) -> ChameleonConfig:
    """The checked ``ChameleonConfig`` of a Lumina-mGPT 2.0 folder's ``config.json`` (:func:`lumina_chameleon_config`:
    each field's type and range, one ``ValueError`` naming the field); reads no weights. ``vispec convert`` calls it
    before anything else reads the folder (transformers' tokenizer loading parses ``config.json`` too, and would
    report a badly typed field in its own words)."""
    return lumina_chameleon_config(_read_config(os.fspath(path)))


def _checked_meta_model(folder: str, config: ChameleonConfig) -> ChameleonForConditionalGeneration:
    """The model ``config`` describes, built on the meta device once the weight files' headers allow it (no
    tensor is read, nothing allocated): first the config fields the weights reveal (each named with the config's
    value and the weights'), then at most :func:`tensor_budget` parameter tensors, then every converted key and
    shape (:func:`check_state_dict`), and a VQ encoder (built fresh from ``vq_config``, never loaded) no larger than
    the whole checkpoint."""
    config_path = os.path.join(folder, "config.json")
    shapes: dict[str, torch.Tensor] = {}
    for shard in shard_files(folder):
        shapes.update(safetensors_header(shard)[0])
    check_config_fields(config, shapes, TRANSFORMERS_WEIGHT_FACTS["chameleon"], config_path, folder)
    limit = tensor_budget(len(shapes))
    try:
        with torch.device("meta"), parameter_limit(limit):
            model = ChameleonForConditionalGeneration(config)
    except TooManyParameters:
        raise too_many_parameters(config_path, "ChameleonForConditionalGeneration", limit, folder, len(shapes)) from None
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    expected = {k: v for k, v in model.state_dict().items() if not k.startswith(LUMINA_VQMODEL_PREFIX) and k not in tied}
    layout = types.SimpleNamespace(state_dict=lambda: expected)  # check_state_dict reads only .state_dict()
    converted = convert_lumina_state_dict(shapes)  # meta tensors in, meta tensors out
    check_state_dict(layout, {k: v for k, v in converted.items() if k not in tied}, folder,
                     "the transformers Chameleon model its config.json describes")
    vq_size = sum(p.numel() for p in model.model.vqmodel.parameters())
    held = sum(t.numel() for t in shapes.values())
    if vq_size > held:
        raise ValueError(f"{config_path} vq_config describes a VQ encoder of {vq_size} parameters, more than the whole "
                         f"checkpoint in {folder} holds ({held}); Lumina-mGPT 2.0 never uses it (vispec builds it from "
                         "vq_config, unloaded): give vq_config the released values")
    return model


def load_lumina_chameleon(path: str | os.PathLike, *,
                          dtype: Optional[torch.dtype] = None) -> ChameleonForConditionalGeneration:
    """A transformers ``ChameleonForConditionalGeneration`` (eval mode) from a Lumina-mGPT 2.0 folder
    (``config.json`` + ``model.safetensors`` or shards with ``model.safetensors.index.json``).

    Before any tensor is read, the config is checked against the files' headers (:func:`_checked_meta_model`:
    a config asking for more layers, a larger vocabulary or codebook than the weights hold is one ``ValueError``
    naming the field and both values). The language model is built on the meta device and takes the converted
    tensors (one copy of the weights in memory, in the files' dtype unless ``dtype`` is given); keys are checked strictly, except that the unused
    Chameleon VQ encoder (:data:`LUMINA_VQMODEL_PREFIX`) is built fresh from ``vq_config`` (randomly initialised)
    and ``lm_head.weight`` may be absent when the config ties it to the embeddings.
    """
    from transformers.models.chameleon.modeling_chameleon import ChameleonRotaryEmbedding, ChameleonVQVAE

    folder = os.fspath(path)
    config = read_lumina_config(folder)
    model = _checked_meta_model(folder, config)
    state_dict = convert_lumina_state_dict(read_sharded_safetensors(folder))
    if dtype is not None:
        state_dict = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state_dict.items()}
    model.load_state_dict(state_dict, strict=False, assign=True)
    model.model.rotary_emb = ChameleonRotaryEmbedding(config=config)  # non-persistent buffers: rebuilt off meta
    model.model.vqmodel = ChameleonVQVAE._from_config(config.vq_config).to(model.model.embed_tokens.weight.dtype)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    on_meta = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type == "meta"]
    if on_meta:  # pragma: no cover - a transformers version with other meta-built tensors
        raise ValueError(f"{folder}: tensors left without values after loading: {on_meta[:10]}")
    return model.eval()
