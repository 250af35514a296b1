"""Loading official Dream checkpoint folders into :class:`LLaDAModelLM` without remote code.

Dream (Ye et al., "Dream 7B: Diffusion Large Language Models", arXiv 2508.15487; ``DreamLM/Dream``,
``Dream-org/Dream-v0-{Base,Instruct}-7B``; spec ``dllm.md`` §2) is a masked diffusion LM initialised from
Qwen2.5-7B. Its network is a Qwen2 decoder with the causal mask removed:

* blocks ``h = x + o_proj(Attn(RMSNorm(x)))``, ``y = h + down_proj(silu(gate_proj(z)) * up_proj(z))`` with
  ``z = RMSNorm(h)``; **biases on q_proj, k_proj and v_proj** (none elsewhere); grouped-query attention
  (28 query heads, 4 key/value heads for the 7B); half-split RoPE with base ``rope_theta``; untied LM head;
* **shifted logits**: the prediction for position ``j`` is read from position ``j - 1``'s output (the AR
  next-token head kept from Qwen), ``ℓ ← concat(ℓ[:, :1], ℓ[:, :-1])``; position 0 keeps its own.

That is exactly :class:`LLaDAModelLM` with ``include_qkv_bias=True`` and ``logits_shift=True`` (its full
forward, :meth:`~LLaDAModelLM.compute_kv_cache` and :meth:`~LLaDAModelLM.forward_span` all apply the
shift, the span recomputing the position before it), so Dream loads into it by renaming the tensors:

================================================================  ===============================================
Dream (``config.json`` / safetensors)                             :class:`LLaDAModelLM`
================================================================  ===============================================
``model.embed_tokens.weight``                                     ``model.transformer.wte.weight``
``model.layers.{i}.self_attn.{q,k,v}_proj.{weight,bias}``         ``model.transformer.blocks.{i}.{q,k,v}_proj.*``
``model.layers.{i}.self_attn.o_proj.weight``                      ``model.transformer.blocks.{i}.attn_out.weight``
``model.layers.{i}.mlp.gate_proj / up_proj / down_proj``          ``... .ff_proj / up_proj / ff_out``
``model.layers.{i}.input_layernorm / post_attention_layernorm``   ``... .attn_norm / ff_norm``
``model.norm.weight``, ``lm_head.weight``                         ``model.transformer.ln_f``, ``.ff_out``
``hidden_size``, ``intermediate_size``, ``num_hidden_layers``     ``d_model``, ``mlp_hidden_size``, ``n_layers``
``num_attention_heads``, ``num_key_value_heads``                  ``n_heads``, ``n_kv_heads``
``max_position_embeddings``, ``vocab_size``                       ``max_sequence_length``, ``vocab_size``
================================================================  ===============================================

Keys are checked strictly, in Dream's names: missing, unexpected and mis-shaped tensors are listed. Settings the
model does not implement raise ``ValueError`` naming the key: ``model_type`` other than ``Dream``,
``hidden_act`` other than ``silu``, ``rope_scaling`` (YaRN etc.), ``use_sliding_window``,
``tie_word_embeddings``, a ``head_dim`` other than ``hidden_size / num_attention_heads``. Keys the network does
not depend on (``auto_map``, ``architectures``, ``torch_dtype``, ``attention_dropout``, ``initializer_range``,
``max_window_layers``, ``use_cache``, ...) are ignored. Absent keys take ``DreamConfig``'s defaults
(``rms_norm_eps=1e-6``, ``rope_theta=10000``, ``mask_token_id=151666``, ``pad_token_id=151643``).

**Padding.** Dream batches with a 4-D mask ``A[b, i, j] = valid_i ∧ valid_j`` and positions
``cumsum(mask) - 1`` (1 at padded slots). :class:`LLaDAModelLM` hides padded *keys* from every query with the
same positions ``cumsum(mask) - 1`` (0 at padded slots): a real position attends to exactly the keys and
positions it has in Dream, so real tokens get the same logits. Only padded queries differ (Dream hides every
key from them; here they see the real keys): their outputs are never read, and their keys are hidden.

**Precision.** vispec applies RoPE in float32 and returns float32 logits; Dream (via Qwen2) rounds ``cos``/``sin``
to the weights' dtype and returns logits in it (bfloat16 for the official weights). In float32 the two
forwards agree to rounding; in bfloat16 they differ in the last bits.
"""

from __future__ import annotations

import os
import re
from typing import Any, Optional

import torch

from vispec.checks import check_number
from vispec.models.checkpoints import check_official_config, check_state_dict, diffusers_load_kwargs, read_json_object, safetensors_header
from vispec.models.llada import LLaDAModelLM
from vispec.models.llada_checkpoint import shard_files, read_sharded_safetensors

# The architecture keys of Dream-v0-{Base,Instruct}-7B (Qwen2.5-7B shapes; the folders' config.json also sets
# max_position_embeddings, which the loader reads from the file: Dream was trained with a 2048-token context)
DREAM_7B_CONFIG: dict[str, Any] = dict(
    model_type="Dream", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
    num_key_value_heads=4, vocab_size=152064, rope_theta=1000000.0, rms_norm_eps=1e-6,
    hidden_act="silu", tie_word_embeddings=False, rope_scaling=None, use_sliding_window=False, mask_token_id=151666,
    pad_token_id=151643, eos_token_id=151643, bos_token_id=151643,
)
# <|im_end|>, the Instruct model's end of turn, for the Qwen2.5 vocabulary (the config does not name it)
QWEN2_IM_END_ID = 151645
QWEN2_VOCAB_SIZE = 152064

# DreamConfig's defaults for keys a config.json may omit
_DEFAULTS = dict(rms_norm_eps=1e-6, rope_theta=10000.0, mask_token_id=151666, pad_token_id=151643,
                 max_position_embeddings=32768)
# settings the architecture depends on, with the only value implemented (absent = the implemented one)
_REQUIRED = {"hidden_act": "silu", "rope_scaling": None, "use_sliding_window": False, "tie_word_embeddings": False}
_SIZE_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")

# Dream tensor names -> LLaDAModelLM names (per layer: the part after "model.layers.{i}.")
_LAYER_NAMES = {
    "self_attn.q_proj.weight": "q_proj.weight", "self_attn.q_proj.bias": "q_proj.bias",
    "self_attn.k_proj.weight": "k_proj.weight", "self_attn.k_proj.bias": "k_proj.bias",
    "self_attn.v_proj.weight": "v_proj.weight", "self_attn.v_proj.bias": "v_proj.bias",
    "self_attn.o_proj.weight": "attn_out.weight",
    "mlp.gate_proj.weight": "ff_proj.weight", "mlp.up_proj.weight": "up_proj.weight", "mlp.down_proj.weight": "ff_out.weight",
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ff_norm.weight",
}
_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "model.transformer.wte.weight",
    "model.norm.weight": "model.transformer.ln_f.weight",
    "lm_head.weight": "model.transformer.ff_out.weight",
}
_DREAM_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_VISPEC_LAYER = re.compile(r"^model\.transformer\.blocks\.(\d+)\.(.+)$")


def dream_config_to_kwargs(config: dict[str, Any], overrides: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """:class:`LLaDAModelLM` keyword arguments (``include_qkv_bias=True``, ``logits_shift=True``) from an official
    Dream ``config.json`` dict (module docstring: the key map, the refused settings, the defaults).

    ``vocab_size`` is both the embedding width and the vocabulary (Dream's 152064 columns include unused ones;
    which ids the tokenizer uses is not in the config). ``eot_token_id`` is ``<|im_end|>`` (151645) for the
    Qwen2.5 vocabulary, else None. ``overrides`` (LLaDAModelLM argument names) win.
    """
    check_official_config(config, "Dream", "Dream", _REQUIRED, _SIZE_KEYS,
                          ("num_key_value_heads", "max_position_embeddings"), minimum=1)
    heads = config["num_attention_heads"]
    if config["hidden_size"] % heads:
        raise ValueError(f"config.json sets hidden_size={config['hidden_size']}, which num_attention_heads={heads} "
                         "does not divide")
    head_dim = config.get("head_dim")
    if head_dim is not None and head_dim != config["hidden_size"] // heads:
        raise ValueError(f"config.json sets head_dim={head_dim}; the Dream loader implements only "
                         f"head_dim = hidden_size / num_attention_heads = {config['hidden_size'] // heads}")
    get = lambda key: config[key] if config.get(key) is not None else _DEFAULTS[key]  # noqa: E731
    for key in ("rope_theta", "rms_norm_eps"):
        check_number(key, get(key), minimum=0, exclusive_minimum=True, hint=" (config.json)")
    vocab = config["vocab_size"]
    kwargs = dict(
        d_model=config["hidden_size"], n_heads=heads, n_kv_heads=config.get("num_key_value_heads") or heads,
        n_layers=config["num_hidden_layers"], mlp_hidden_size=config["intermediate_size"], vocab_size=vocab,
        embedding_size=vocab, max_sequence_length=get("max_position_embeddings"), rope_theta=float(get("rope_theta")),
        rms_norm_eps=float(get("rms_norm_eps")), mask_token_id=get("mask_token_id"), pad_token_id=get("pad_token_id"),
        eos_token_id=_single_id(config, "eos_token_id"), bos_token_id=_single_id(config, "bos_token_id"),
        eot_token_id=QWEN2_IM_END_ID if vocab == QWEN2_VOCAB_SIZE else None,
        logits_shift=True, include_qkv_bias=True,
    )
    kwargs.update(overrides or {})
    return kwargs


def _single_id(config: dict[str, Any], key: str) -> Optional[int]:
    """A token id of the config: an int, the first of a list (HF allows several EOS ids), or None."""
    value = config.get(key)
    if isinstance(value, list):
        value = value[0] if value else None
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise ValueError(f"config.json sets {key}={config.get(key)!r}; it must be a token id (an integer)")
    return value


def dream_to_vispec_name(name: str) -> Optional[str]:
    """The :class:`LLaDAModelLM` parameter name of a Dream tensor name, or None when it has none."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    match = _DREAM_LAYER.match(name)
    if match and match.group(2) in _LAYER_NAMES:
        return f"model.transformer.blocks.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"
    return None


def vispec_to_dream_name(name: str) -> str:
    """The Dream tensor name of an :class:`LLaDAModelLM` parameter name (the inverse of :func:`dream_to_vispec_name`)."""
    for dream, ours in _GLOBAL_NAMES.items():
        if ours == name:
            return dream
    match = _VISPEC_LAYER.match(name)
    if match:
        for dream, ours in _LAYER_NAMES.items():
            if ours == match.group(2):
                return f"model.layers.{match.group(1)}.{dream}"
    raise ValueError(f"{name!r} is not a parameter of a Dream-configured LLaDAModelLM")


class _DreamNamed:
    """``model``'s state dict under Dream's names, for :func:`check_state_dict` (which reads only ``state_dict()``)."""

    def __init__(self, model: LLaDAModelLM):
        self.model = model

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {vispec_to_dream_name(k): v for k, v in self.model.state_dict().items()}


def load_dream_checkpoint(path: str | os.PathLike, *, dtype: Optional[torch.dtype] = None, **overrides: Any) -> LLaDAModelLM:
    """An :class:`LLaDAModelLM` (eval mode, ``logits_shift=True``, q/k/v biases) from an official Dream folder.

    The folder holds ``config.json`` and ``model-0000X-of-0000Y.safetensors`` with ``model.safetensors.index.json``
    (whose ``weight_map`` must agree with the shards) or a single ``model.safetensors``; a vispec
    ``save_pretrained`` folder of a Dream model (``diffusion_pytorch_model.safetensors``) loads too. The shapes
    the files declare are checked against the configuration from their headers before anything is read
    (missing / unexpected / mis-shaped tensors listed under Dream's names). The model is built on the meta device
    and takes the loaded tensors, so memory holds one copy of the weights; they keep the checkpoint's dtype
    (bfloat16 for the official 7B) unless ``dtype`` is given. ``overrides`` set :class:`LLaDAModelLM` fields.
    """
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype must be a torch.dtype or None, got {dtype!r}")
    folder = os.fspath(path)
    config_path = os.path.join(folder, "config.json")
    if not os.path.isfile(config_path):
        raise ValueError(f"{folder} is not a Dream checkpoint folder: config.json is missing")
    if os.path.isfile(os.path.join(folder, "diffusion_pytorch_model.safetensors")):
        model = LLaDAModelLM.from_pretrained(folder, **overrides, **diffusers_load_kwargs())
        if not (model.config.logits_shift and model.config.include_qkv_bias):
            raise ValueError(f"{folder} holds a vispec LLaDAModelLM without logits_shift and q/k/v biases, not a Dream "
                             "model: load it with vispec.models.llada_checkpoint.load_llada")
    else:
        kwargs = dream_config_to_kwargs(read_json_object(config_path), overrides)
        with torch.device("meta"):
            model = LLaDAModelLM(**kwargs)
        shapes: dict[str, torch.Tensor] = {}  # from the headers: a config that does not fit fails before any load
        for shard in shard_files(folder):
            shapes.update(safetensors_header(shard)[0])
        check_state_dict(_DreamNamed(model), shapes, folder)  # type: ignore[arg-type]  (reads state_dict() only)
        tensors = read_sharded_safetensors(folder)
        state_dict = {dream_to_vispec_name(name): tensor for name, tensor in tensors.items()}
        model.load_state_dict(state_dict, strict=True, assign=True)
    if dtype is not None:
        model = torch.nn.Module.to(model, dtype=dtype)  # ModelMixin.to warns spuriously on dtype casts
    return model.eval()


def dream_state_dict(model: LLaDAModelLM) -> dict[str, torch.Tensor]:
    """``model``'s tensors under Dream's names (the inverse of the loader's renaming), e.g. to write an official
    layout folder or to run a reference implementation on the same weights."""
    if not (model.config.logits_shift and model.config.include_qkv_bias):
        raise ValueError("model must be a Dream-configured LLaDAModelLM (logits_shift=True, include_qkv_bias=True)")
    return {vispec_to_dream_name(k): v for k, v in model.state_dict().items()}


__all__ = ["DREAM_7B_CONFIG", "dream_config_to_kwargs", "dream_state_dict", "dream_to_vispec_name",
           "load_dream_checkpoint", "vispec_to_dream_name"]
