"""The settings of every trainer and assembler (``vispec train MODEL``), without torch: the CLI builds a trainer's flags
from its dataclass here and checks them (``validate``) before the trainer's module, torch and the models are
imported. The trainer modules re-export their config (``from vispec.eval.train.vq import VQTrainConfig`` works).

Each ``validate(name=field_name)`` checks every field before any work, errors naming ``name(field)``
(:mod:`vispec.eval.train.checks`). The torch-free checks run first; the few that need the pipelines or the decoders
(an embedded model name, a decoding spec, an assembler's sampling defaults) run last and import them. A config that
defines a model also has ``footprint()``: its parameters and a rough activation and data size in plain arithmetic,
which ``validate`` compares with the machine's memory (:func:`~vispec.eval.train.checks.check_training_memory`).
The footprints are estimates: the tests hold them near the built models' parameter counts.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from vispec.checks import check_int, check_number
from vispec.eval.train.checks import (Footprint, Namer, check_bf16, check_choice, check_common, check_decoding_defaults,
                                      check_device_present, check_fields, check_folder, check_heads,
                                      check_output_folder, check_pipeline_name, check_threads, check_training_memory,
                                      field_name)

# LLAMAGEN_VQ_VARIANTS["VQ-4"] / ["VQ-8"] and llamagen_vq_config's norm_num_groups (vispec.models.llamagen_vq,
# which imports torch); a test asserts they agree
VQ4_CHANNEL_MULT = (1, 2, 4)
VQ8_CHANNEL_MULT = (1, 2, 2, 4)
VQ_LEVELS = {len(VQ4_CHANNEL_MULT): 4, len(VQ8_CHANNEL_MULT): 8}  # levels -> downsample factor
VQ_NORM_GROUPS = 32
# vispec.eval.bench.scenes.DEFAULT_SIZES (that module imports torch); a test asserts they agree
SCENE_SIZES: tuple[tuple[int, int], ...] = ((64, 64), (64, 96))
PHOTO_PIXELS = 64 * 64  # tiny-c2i's crops (CropSampler)
GPT_TOKENS = 256  # tiny-c2i's 16 x 16 image tokens (the GPT's block size)
SWAP_KINDS = ("colour", "count", "shape", "relation", "size")  # the CLIP's hard-negative kinds
FLOAT = 4  # bytes of an fp32 activation


def _llamagen_footprint(dim: int, n_layer: int, n_head: int, batch: int) -> tuple[int, int]:
    """``(parameters, activation bytes)`` of a LlamaGen GPT without its vocabulary-sized embeddings (the VQ's): per
    block the attention's ``4 dim^2``, the SwiGLU's ``3 dim hidden`` (hidden = 8 dim / 3 rounded up to 256) and two
    norms; activations: ``10 dim + 4 hidden`` floats per token and block, and the attention scores."""
    hidden = -(-(8 * dim // 3) // 256) * 256
    parameters = n_layer * (4 * dim * dim + 3 * dim * hidden + 2 * dim) + dim
    per_sequence = n_layer * (GPT_TOKENS * (10 * dim + 4 * hidden) + 2 * n_head * GPT_TOKENS**2)
    return parameters, FLOAT * batch * per_sequence


@dataclass
class VQTrainConfig:
    out: str = "out/tiny-c2i/vqvae"
    data: str = "photos"  # "photos" (tiny-c2i) or "scenes" (tiny-t2i)
    steps: int = 4000
    batch_size: int = 16
    lr: float = 3e-4
    codebook_size: int = 1024
    embed_dim: int = 8
    base_channels: int = 32
    channel_mult: tuple[int, ...] = (1, 1, 2)  # 64 -> 32 -> 16 (downsample 4); four levels: downsample 8
    z_channels: int = 32
    layers_per_block: int = 1
    beta: float = 0.25
    restart_every: int = 250
    eval_images: int = 512
    seed: int = 0
    log_every: int = 50

    def validate(self, name: Namer = field_name) -> None:
        """Every field, before any work (:mod:`vispec.eval.train.checks`), and the memory training needs
        (:meth:`footprint`)."""
        check_common(self, name)
        check_choice(self, "data", ("photos", "scenes"), name)
        check_fields(self, name, counts=("codebook_size", "embed_dim", "base_channels", "z_channels", "layers_per_block",
                                         "eval_images"),
                     non_negative=("restart_every",), non_negative_numbers=("beta",))
        mult = self.channel_mult
        if len(mult) not in VQ_LEVELS or any(isinstance(m, bool) or not isinstance(m, int) or m < 1 for m in mult):
            raise ValueError(f"{name('channel_mult')} must be 3 or 4 integers >= 1 (one per level: 3 give a downsample-4 "
                             f"VQ, 4 a downsample-8 one), got {','.join(map(str, mult)) or 'none'}")
        widths = [self.base_channels * m for m in mult]
        if any(w % VQ_NORM_GROUPS for w in widths):
            raise ValueError(f"{name('base_channels')} x {name('channel_mult')} gives channel widths {widths}; each must be "
                             f"a multiple of {VQ_NORM_GROUPS} (the VQ's group norm)")
        check_training_memory(self, self.footprint(), name)

    def footprint(self) -> Footprint:
        """The VQ's parameters (encoder, decoder, codebook) and the activations of a training batch and of the
        held-out evaluation, which runs all ``eval_images`` at once."""
        blocks = 2 * self.layers_per_block + 1  # resnets per level: the encoder's, and the decoder's one more
        widths = [self.base_channels * m for m in self.channel_mult]
        top, z = widths[-1], self.z_channels
        parameters = sum(blocks * 18 * c * c for c in widths)  # two 3x3 convolutions per resnet
        parameters += sum(2 * 9 * c * c for c in widths[:-1])  # down- and upsampling convolutions
        parameters += 2 * (2 * 18 + 4) * top * top + blocks * 4 * top * top  # mid blocks; the last level's attention
        parameters += 2 * 9 * z * top + 2 * z * self.embed_dim + self.codebook_size * self.embed_dim + 2 * 27 * widths[0]
        pixels = max(h * w for h, w in SCENE_SIZES) if self.data == "scenes" else PHOTO_PIXELS
        per_image = sum(blocks * 6 * c * pixels // 4**i for i, c in enumerate(widths))  # saved for the backward
        per_image += (blocks + 2) * 2 * (pixels // 4 ** (len(widths) - 1)) ** 2  # attention scores
        evaluation = self.eval_images * pixels * FLOAT * (12 + 3 * widths[0])
        return Footprint(parameters, FLOAT * self.batch_size * per_image + evaluation,
                         ("base_channels", "channel_mult", "layers_per_block", "z_channels", "codebook_size",
                          "embed_dim", "batch_size", "eval_images"))


@dataclass
class EvaluatorTrainConfig:
    out: str = "out/tiny-c2i/evaluator"
    steps: int = 1500
    batch_size: int = 32
    width: int = 16
    feature_dim: int = 128
    lr: float = 2e-3
    weight_decay: float = 0.05
    eval_images: int = 1400
    seed: int = 0
    log_every: int = 50

    def validate(self, name: Namer = field_name) -> None:
        """Every field, before any work (:mod:`vispec.eval.train.checks`), and the memory training needs."""
        check_common(self, name)
        check_fields(self, name, counts=("width", "feature_dim", "eval_images"))
        check_training_memory(self, self.footprint(), name)

    def footprint(self) -> Footprint:
        """The crop classifier's four conv stages (widths ``w, 2w, 4w, 4w``) and embedding (its class head left out),
        a batch's activations, and the held-out crops (uint8, all at once)."""
        w = self.width
        parameters = 9 * (3 * w + 63 * w * w) + 44 * w + (4 * w + 1) * self.feature_dim
        per_image = 6 * w * (PHOTO_PIXELS + 2 * PHOTO_PIXELS // 4 + 4 * PHOTO_PIXELS // 16 + 4 * PHOTO_PIXELS // 64)
        held_out = self.eval_images * (3 * PHOTO_PIXELS + 8)
        return Footprint(parameters, FLOAT * self.batch_size * per_image + held_out,
                         ("width", "feature_dim", "batch_size", "eval_images"))


@dataclass
class GPTTrainConfig:
    vq: str = "out/tiny-c2i/vqvae"
    out: str = "out/tiny-c2i/transformer"
    num_sequences: int = 25600
    steps: int = 1600
    batch_size: int = 32
    lr: float = 1e-3
    weight_decay: float = 0.05
    dim: int = 256
    n_layer: int = 4  # ~3.9M parameters: ~1.7 s per step of 32 x 256 tokens on 2 CPU cores (~45 min)
    n_head: int = 4
    class_dropout_prob: float = 0.1
    dropout: float = 0.0  # one pass over the data: regularisation only slows learning
    seed: int = 0
    log_every: int = 25

    def validate(self, name: Namer = field_name) -> None:
        """Every field, before any work (:mod:`vispec.eval.train.checks`), and the memory training needs; ``vq``
        must be a local VQ folder."""
        check_common(self, name)
        check_fields(self, name, counts=("num_sequences", "dim", "n_layer", "n_head"),
                     fractions=("class_dropout_prob", "dropout"))
        check_heads(self, "dim", "n_head", name, multiple=4)
        check_training_memory(self, self.footprint(), name)
        check_folder(self, "vq", name, holds="config.json", what="the VQ folder `vispec train vq` wrote")

    def footprint(self) -> Footprint:
        """The GPT's blocks (its code and class embeddings, sized by the VQ, left out), a batch's activations and the
        token dataset (``num_sequences`` x 256 int16 codes and a label)."""
        parameters, activations = _llamagen_footprint(self.dim, self.n_layer, self.n_head, self.batch_size)
        return Footprint(parameters, activations + self.num_sequences * (2 * GPT_TOKENS + 8),
                         ("dim", "n_layer", "n_head", "batch_size", "num_sequences"))


@dataclass
class DrafterTrainConfig:
    target: str = "tiny-c2i"  # embedded name or pipeline folder
    out: str = "out/tiny-c2i-drafter"
    num_sequences: int = 4096
    sample_batch: int = 256
    sample_decoding: str = "ar"  # at batch 256 on a CPU, AR is the fastest exact sampler
    steps: int = 2500
    batch_size: int = 16  # ~0.4 s per step on 2 CPU cores (the teacher forward dominates)
    lr: float = 2e-3
    weight_decay: float = 0.05
    dim: int = 128
    n_layer: int = 2
    n_head: int = 4
    class_dropout_prob: float = 0.1
    seed: int = 0
    log_every: int = 25

    def validate(self, name: Namer = field_name) -> None:
        """Every field, before any work (:mod:`vispec.eval.train.checks`), and the memory training needs; then
        ``sample_decoding`` must be a decoding spec and ``target`` an embedded model or a local pipeline folder
        (these two import the decoders and the pipelines)."""
        check_common(self, name)
        check_fields(self, name, counts=("num_sequences", "sample_batch", "dim", "n_layer", "n_head"),
                     fractions=("class_dropout_prob",))
        check_heads(self, "dim", "n_head", name, multiple=4)
        check_training_memory(self, self.footprint(), name)
        _check_sampled_target(self, name)

    def footprint(self) -> Footprint:
        """The drafter GPT's blocks (embeddings sized by the target's vocabulary left out), a batch's activations and
        the sampled sequences (int16 codes and a label each); the target itself is not counted."""
        parameters, activations = _llamagen_footprint(self.dim, self.n_layer, self.n_head, self.batch_size)
        return Footprint(parameters, activations + self.num_sequences * (2 * GPT_TOKENS + 8),
                         ("dim", "n_layer", "n_head", "batch_size", "num_sequences"))


def _check_sampled_target(cfg: "DrafterTrainConfig", name: Namer) -> None:
    """A drafter trainer's ``sample_decoding`` is a decoding spec and its ``target`` an embedded model or a local
    pipeline folder (these import the decoders and the pipelines: checked last)."""
    from vispec.decoding import DecodingConfig

    try:
        DecodingConfig.parse(cfg.sample_decoding)
    except ValueError as err:
        raise ValueError(f"{name('sample_decoding')}: {err}") from None
    check_pipeline_name(cfg, "target", name, expected="LlamaGenPipeline")


@dataclass
class GADDrafterTrainConfig:
    """``vispec train gad-drafter``: the masked block drafter of ``decoding="gad"`` (:mod:`vispec.eval.train.gad`)."""

    target: str = "tiny-c2i"  # embedded name or pipeline folder
    out: str = "out/tiny-c2i-gad-drafter"
    num_sequences: int = 2048
    sample_batch: int = 256
    sample_decoding: str = "ar"
    steps: int = 3000
    batch_size: int = 8  # sequences per step (one teacher forward each)
    blocks_per_sequence: int = 16  # drafter rows per sequence: random prefix lengths and block sizes
    max_block: int = 16
    context: int = 0  # committed tokens the drafter sees (0: all; a bidirectional drafter may see fewer, e.g. 48)
    attention: str = "causal"  # an AR drafter whose unknown inputs are masks (context 0), or "bidirectional"
    lr: float = 2e-3
    weight_decay: float = 0.05
    dim: int = 128
    n_layer: int = 2
    n_head: int = 4
    class_dropout_prob: float = 0.1
    warm_start: str = "drafter"  # the target pipeline's GPT to start from: "drafter", "transformer" (the target) or ""
    seed: int = 0
    log_every: int = 25

    def validate(self, name: Namer = field_name) -> None:
        """Every field before any work; then ``sample_decoding`` must be a decoding spec, ``target`` an embedded
        model or a local pipeline folder, and the GPT ``warm_start`` names there must have the drafter's shape
        (:func:`_check_warm_start`, from its ``config.json``: before minutes of sampling)."""
        check_common(self, name)
        if not isinstance(self.warm_start, str) or self.warm_start not in ("", "drafter", "transformer"):
            raise ValueError(f"{name('warm_start')} must be 'drafter' (the target pipeline's AR drafter), 'transformer' "
                             f"(the target itself) or '' (random init), got {self.warm_start!r}")
        if self.attention not in ("bidirectional", "causal"):
            raise ValueError(f"{name('attention')} must be 'bidirectional' or 'causal', got {self.attention!r}")
        if self.attention == "causal" and self.context != 0:
            raise ValueError(f"{name('attention')}='causal' reads the whole prefix: {name('context')} must be 0, got {self.context}")
        check_fields(self, name, counts=("num_sequences", "sample_batch", "blocks_per_sequence", "max_block", "dim",
                                         "n_layer", "n_head"),
                     non_negative=("context",), fractions=("class_dropout_prob",))
        if self.max_block >= GPT_TOKENS:
            raise ValueError(f"{name('max_block')} must be below {GPT_TOKENS} (the image's tokens), got {self.max_block}")
        if self.context >= GPT_TOKENS:
            raise ValueError(f"{name('context')} must be below {GPT_TOKENS} (0: the whole prefix), got {self.context}")
        check_heads(self, "dim", "n_head", name, multiple=4)
        check_training_memory(self, self.footprint(), name)
        _check_sampled_target(self, name)
        _check_warm_start(self, name)

    def footprint(self) -> Footprint:
        """The drafter's blocks (as a LlamaGen GPT's, vocabulary-sized tables left out), the rows' activations (at most a
        whole image each) and the sampled sequences."""
        parameters, activations = _llamagen_footprint(self.dim, self.n_layer, self.n_head,
                                                      self.batch_size * self.blocks_per_sequence)
        return Footprint(parameters, activations + self.num_sequences * (2 * GPT_TOKENS + 8),
                         ("dim", "n_layer", "n_head", "batch_size", "blocks_per_sequence", "num_sequences"))


def _llamagen_ffn(dim: int, multiple_of: int, multiplier) -> int:
    """LlamaGen's SwiGLU width (:func:`vispec.models.llamagen_gpt.ffn_hidden_dim`, which imports torch)."""
    hidden = int(2 * (4 * dim) / 3)
    if multiplier is not None:
        hidden = int(multiplier * hidden)
    return hidden if hidden % multiple_of == 0 else hidden + multiple_of - hidden % multiple_of


def _check_warm_start(cfg: "GADDrafterTrainConfig", name: Namer) -> None:
    """The GAD drafter's ``warm_start`` (a GPT of the ``target`` pipeline) exists and has the drafter's shape,
    parameter for parameter as :func:`vispec.eval.train.gad.warm_start_from_ar` loads it, read from the two
    ``config.json`` files: ``dim``, ``n_layer`` and ``n_head`` as the flags give them, a null-class row in both or in
    neither (``class_dropout_prob``), and the drafter's fixed layout (no grouped-query attention, LlamaGen's SwiGLU
    width at ``multiple_of=256``, the target's vocabulary and classes). Each error names the flag, its value and the
    value the warm start requires (or the warm start itself, for what no flag sets). Runs after
    :func:`_check_sampled_target` (``target`` is a LlamaGen pipeline)."""

    from vispec.pipelines.embedded import resolve_model_path

    if not cfg.warm_start:
        return
    folder = resolve_model_path(cfg.target)
    start, target = name("warm_start"), name("target")
    where = f"{start} {cfg.warm_start} (the {cfg.warm_start} of {target} {cfg.target!r})"
    off = f"{start} '' to start from random weights"

    def read(component: str) -> dict:
        from vispec.models.checkpoints import read_json_object

        path = os.path.join(folder, component, "config.json")
        if not os.path.isfile(path):
            raise ValueError(f"{start} {cfg.warm_start}: {target} {cfg.target!r} has no {component} (no {path}); "
                             f"train one with `vispec train drafter`, or pass {off}")
        try:
            return read_json_object(path)
        except ValueError as err:
            raise ValueError(f"{start} {cfg.warm_start}: {err}") from None

    source, own = read(cfg.warm_start), read("transformer")
    if source.get("model_type", "c2i") != "c2i":
        raise ValueError(f"{where} is a {source.get('model_type')!r} GPT, not a class-to-image one (c2i): pass {off}")
    for key in ("dim", "n_layer", "n_head"):
        required = source.get(key)
        if getattr(cfg, key) != required:
            raise ValueError(f"{name(key)} {getattr(cfg, key)} does not fit {where}, whose {key} is {required}: "
                             f"pass {name(key)} {required}, or {off}")
    source_null = float(source.get("class_dropout_prob", 0.1)) > 0
    if source_null != (cfg.class_dropout_prob > 0):
        flag = name("class_dropout_prob")
        required = f"a {flag} above 0" if source_null else f"{flag} 0"
        raise ValueError(f"{flag} {cfg.class_dropout_prob} does not fit {where}, whose class table "
                         f"{'has a' if source_null else 'has no'} null-class row (class_dropout_prob "
                         f"{source.get('class_dropout_prob')}): pass {required}, or {off}")
    kv_heads = source.get("n_kv_head") or cfg.n_head
    ffn = _llamagen_ffn(cfg.dim, int(source.get("multiple_of", 256)), source.get("ffn_dim_multiplier"))
    for what, theirs, ours in (("n_kv_head", kv_heads, cfg.n_head), ("SwiGLU width", ffn, _llamagen_ffn(cfg.dim, 256, None)),
                               ("vocab_size", source.get("vocab_size"), own.get("vocab_size")),
                               ("num_classes", source.get("num_classes"), own.get("num_classes"))):
        if theirs != ours:
            raise ValueError(f"{where} has {what} {theirs}, the GAD drafter needs {ours} (the target's transformer "
                             f"and the drafter's fixed layout): its weights cannot start the drafter; pass {off}")


@dataclass
class GADDrafterAssembleConfig:
    """``vispec train assemble-gad-drafter``: add a trained GAD drafter to a pipeline folder (``gad_drafter/``)."""

    drafter: str = "out/tiny-c2i-gad-drafter"
    pipeline: str = "models/pretrained/tiny-c2i"

    def validate(self, name: Namer = field_name) -> None:
        """Both folders exist and hold what they should, before anything is read."""
        check_folder(self, "drafter", name, holds="config.json", what="the folder `vispec train gad-drafter` wrote")
        check_folder(self, "pipeline", name, holds="model_index.json", what="a LlamaGenPipeline folder")


@dataclass
class T2ITrainConfig:
    vq: str = "out/tiny-t2i/vqvae"
    out: str = "out/tiny-t2i/transformer"
    num_sequences: int = 24000
    steps: int = 1500
    batch_size: int = 16
    lr: float = 1e-3
    weight_decay: float = 0.05
    hidden_size: int = 256
    layers: int = 4  # ~3.2M parameters besides the embeddings; ~1.5 s per step of 16 sequences on 2 CPU cores
    heads: int = 4
    caption_dropout: float = 0.1
    init_from: str = ""  # a tiny-t2i pipeline (embedded name or folder) to continue from, with its sizes and vocabulary
    warmup: int = 100  # steps of linear warm-up before the cosine decay
    seed: int = 0
    log_every: int = 25
    # matrix products under bfloat16 autocast (weights, gradients and AdamW state stay float32): on 2 cores with
    # AVX512-BF16, 1.05 s per step of 16 against ~1.6 s (both sizes); refused on CPUs without (check_bf16)
    bf16: bool = False

    def validate(self, name: Namer = field_name) -> None:
        """Every field, before any work (:mod:`vispec.eval.train.checks`), and the memory training needs; ``vq``
        must be a local VQ folder, ``init_from`` (when set) an embedded model or a local pipeline folder; ``bf16``
        only where the CPU multiplies bfloat16 natively (:func:`~vispec.eval.train.checks.check_bf16`)."""
        check_common(self, name)
        check_fields(self, name, counts=("hidden_size", "layers", "heads", "warmup"), fractions=("caption_dropout",))
        check_int(name("num_sequences"), self.num_sequences, minimum=len(SCENE_SIZES),
                  hint=f" (split between the {len(SCENE_SIZES)} scene sizes)")
        check_heads(self, "hidden_size", "heads", name)
        check_training_memory(self, self.footprint(), name)
        check_folder(self, "vq", name, holds="config.json", what="the scene VQ folder `vispec train vq --data scenes` wrote")
        if self.init_from:
            check_pipeline_name(self, "init_from", name, expected="UnifiedImagePipeline")
            self._check_continued(name)
        check_bf16(self, name)

    def _check_continued(self, name: Namer) -> None:
        """The ``init_from`` pipeline (its JSON files, read without torch) must have this config's architecture and
        as many codes as the ``vq`` folder: training continues it with its own layout."""
        import json

        from vispec.pipelines.embedded import resolve_model_path

        folder = resolve_model_path(self.init_from)
        try:
            with open(os.path.join(folder, "model_index.json")) as f:
                index = json.load(f)
            with open(os.path.join(folder, "transformer", "config.json")) as f:
                model = json.load(f)
            with open(os.path.join(self.vq, "config.json")) as f:
                codes = json.load(f).get("num_vq_embeddings")
        except (OSError, ValueError) as err:
            raise ValueError(f"{name('init_from')} {self.init_from!r}: cannot read its configuration ({err})") from None
        for key, theirs in (("hidden_size", "hidden_size"), ("layers", "num_hidden_layers"), ("heads", "num_attention_heads")):
            if getattr(self, key) != model.get(theirs):
                raise ValueError(f"{name(key)} {getattr(self, key)} differs from the {model.get(theirs)} of "
                                 f"{name('init_from')} {self.init_from!r} (continued training keeps its architecture)")
        if index.get("num_codes") != codes:
            raise ValueError(f"{name('init_from')} {self.init_from!r} decodes {index.get('num_codes')} codes, {name('vq')} "
                             f"{self.vq!r} has {codes}: continue with the VQ the model was trained on")

    def footprint(self) -> Footprint:
        """The Chameleon decoder's blocks (``intermediate = 11 hidden / 4``; the embeddings, sized by the VQ, left
        out), a batch's activations with eager attention at the longest scene (caption, layout and rows), and the
        scene dataset (int16 codes and the caption ids of each); sized for a downsample-4 VQ (the shipped
        model's), which bounds a downsample-8 one."""
        hidden, intermediate = self.hidden_size, self.hidden_size * 11 // 4
        parameters = self.layers * (4 * hidden * hidden + 3 * hidden * intermediate + 6 * hidden) + hidden
        codes = max((h // 4) * (w // 4) for h, w in SCENE_SIZES)
        tokens = 16 + max((h // 4) * (w // 4 + 1) for h, w in SCENE_SIZES)  # caption and layout, then the rows
        per_sequence = self.layers * (tokens * (10 * hidden + 4 * intermediate) + 3 * self.heads * tokens**2)
        data = self.num_sequences * (2 * codes + 150)
        return Footprint(parameters, FLOAT * self.batch_size * per_sequence + data,
                         ("hidden_size", "layers", "heads", "batch_size", "num_sequences"))


@dataclass
class CLIPTrainConfig:
    out: str = "out/tiny-t2i/clip"
    steps: int = 1500  # ~0.5 s per step on one thread: 12-15 minutes (module docstring, "Speed")
    batch_size: int = 64
    lr: float = 1e-3
    weight_decay: float = 0.1
    warmup: int = 100
    hidden_size: int = 128
    vision_layers: int = 4
    text_layers: int = 2
    heads: int = 4
    projection_dim: int = 128
    image_size: int = 64
    patch_size: int = 8
    text_length: int = 12
    hard_negatives: tuple[str, ...] = ("colour", "count", "shape", "relation")
    negatives_train_only: bool = True
    eval_candidates: int = 500
    seed: int = 0
    log_every: int = 25
    threads: int = 1  # > 0: torch.set_num_threads(threads); 0 leaves it as is

    def validate(self, name: Namer = field_name) -> None:
        """Every field, before any work (:mod:`vispec.eval.train.checks`), and the memory training needs; ``threads``
        at most :data:`~vispec.eval.train.checks.MAX_THREADS`."""
        check_common(self, name)
        check_fields(self, name, counts=("hidden_size", "vision_layers", "text_layers", "heads", "projection_dim",
                                         "image_size", "patch_size"),
                     non_negative=("warmup",))
        check_threads(self, name)
        check_int(name("eval_candidates"), self.eval_candidates, minimum=2)
        # the longest caption: 10 words, BOS and EOS
        check_int(name("text_length"), self.text_length, minimum=12, hint=" (the longest caption with BOS and EOS)")
        if self.image_size % self.patch_size:
            raise ValueError(f"{name('image_size')} ({self.image_size}) must be a multiple of {name('patch_size')} "
                             f"({self.patch_size})")
        if self.hidden_size % self.heads:
            raise ValueError(f"{name('hidden_size')} ({self.hidden_size}) must be a multiple of {name('heads')} "
                             f"({self.heads})")
        bad = [k for k in self.hard_negatives if k not in SWAP_KINDS]
        if bad:
            raise ValueError(f"{name('hard_negatives')} must be kinds among {SWAP_KINDS}, got {bad}")
        check_training_memory(self, self.footprint(), name)

    def footprint(self) -> Footprint:
        """The CLIP's towers (``12 h^2 + 13 h`` per layer, patch and position embeddings, projections; the word
        embeddings left out), a batch's activations (each image with its caption and hard negatives), and the
        held-out evaluation (``eval_candidates`` scenes and their score matrices)."""
        h = self.hidden_size
        patches = (self.image_size // self.patch_size) ** 2 + 1
        layer = 12 * h * h + 13 * h
        parameters = (3 * self.patch_size**2 * h + (patches + 5) * h + self.vision_layers * layer
                      + (self.text_length + 2) * h + self.text_layers * layer + 2 * h * self.projection_dim + 1)
        texts = self.batch_size * (1 + len(self.hard_negatives))
        per_image = self.vision_layers * (16 * h * patches + 2 * self.heads * patches**2)
        per_text = self.text_layers * (16 * h * self.text_length + 2 * self.heads * self.text_length**2)
        activations = FLOAT * (self.batch_size * per_image + texts * per_text + 3 * self.batch_size * texts)
        n = self.eval_candidates
        evaluation = n * n * (1 + FLOAT) + n * 3 * PHOTO_PIXELS * FLOAT
        return Footprint(parameters, activations + evaluation,
                         ("hidden_size", "vision_layers", "text_layers", "heads", "projection_dim", "image_size",
                          "patch_size", "text_length", "batch_size", "hard_negatives", "eval_candidates"))


def check_masking_and_tasks(config: "MDLMTrainConfig | LLaDA2TrainConfig", name: Namer) -> None:
    """The text trainers' shared settings: ``mask_eps`` in (0, 1), distinct known ``tasks`` and one non-negative
    ``task_weights`` entry per task, not all 0 (each error names the flag through ``name``)."""
    from vispec.eval.bench.text_tasks import TASKS  # torch-free

    check_number(name("mask_eps"), config.mask_eps, minimum=0, maximum=1, exclusive_minimum=True)
    if config.mask_eps == 1:
        raise ValueError(f"{name('mask_eps')} must be in (0, 1) (1 would mask every token always), got {config.mask_eps}")
    if not config.tasks or any(t not in TASKS for t in config.tasks) or len(set(config.tasks)) != len(config.tasks):
        raise ValueError(f"{name('tasks')} must name distinct tasks among {', '.join(TASKS)}, got "
                         f"{','.join(config.tasks) or 'none'}")
    if len(config.task_weights) != len(config.tasks):
        raise ValueError(f"{name('task_weights')} must give one weight per task of {name('tasks')} "
                         f"({len(config.tasks)}: {','.join(config.tasks)}), got {len(config.task_weights)}")
    for weight in config.task_weights:
        check_number(name("task_weights"), weight, minimum=0, hint=" (each)")
    if not sum(config.task_weights) > 0:
        raise ValueError(f"{name('task_weights')} must not all be 0, got {config.task_weights}")


@dataclass
class MDLMTrainConfig:
    """Defaults sized for under an hour on the 2-core CPU: 3.5M parameters, 0.33 s per step of 32 sequences of
    <= 71 tokens with 2 threads (0.61 s with one), 8000 steps ~ 45 min, plus a few minutes of evaluation.
    Arithmetic (the task with an accuracy target) gets most of the batch."""

    out: str = "out/tiny-mdlm"
    tasks: tuple[str, ...] = ("arithmetic", "sort", "reverse")
    task_weights: tuple[float, ...] = (0.8, 0.1, 0.1)
    task_options: dict = field(default_factory=dict)  # per task name, e.g. {"arithmetic": {"operand_max": 5}}
    answer_length: int = 32  # the generation canvas: answer, <|eot_id|>, EOS padding
    steps: int = 8000
    batch_size: int = 32
    lr: float = 2e-3
    weight_decay: float = 0.1
    warmup: int = 200
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 0  # 0: n_heads (no grouped-query attention)
    mlp_hidden_size: int = 768
    rope_theta: float = 10000.0
    mask_eps: float = 1e-3
    stratified_t: bool = True
    seed: int = 0
    log_every: int = 25
    eval_every: int = 2000  # greedy accuracy on eval_n test items of tasks[0] every this many steps (0: never)
    eval_n: int = 100
    final_eval_n: int = 500  # per task, after training (0: skip)
    tokenizer_corpus: int = 2000  # train items per task for the tokenizer
    max_minutes: float = 0.0  # > 0: stop early once this much training time has passed (pilots)
    threads: int = 2  # > 0: torch.set_num_threads(threads); 0 leaves it as is
    # fine-tuning: a trained folder (transformer/, tokenizer/), a pipeline folder (model/, tokenizer/) or an embedded
    # model name ("vispec/tiny-mdlm"); its model and tokenizer replace the fresh ones (d_model etc. are then ignored)
    init_from: str = ""
    # canvas length mix: every long_every-th step trains at long_answer_length instead of answer_length (0: never)
    long_answer_length: int = 0
    long_every: int = 0
    long_batch_size: int = 0  # sequences in a long-canvas step (0: batch_size); fewer keeps those steps cheap
    eval_all_tasks: bool = False  # progress evaluations (eval_every) on every task instead of tasks[0]
    eval_answer_length: int = 0  # final evaluation canvas (0: answer_length)
    eval_block_length: int = 0  # final evaluation semi-autoregressive block (0: the whole canvas as one block)
    eval_batch_size: int = 64

    def validate(self, name: Namer = field_name) -> None:
        """Every field, before any work (:mod:`vispec.eval.train.checks`), and the memory training needs
        (:meth:`footprint`); ``threads`` at most :data:`~vispec.eval.train.checks.MAX_THREADS`. Last, ``init_from``
        must name a local trained or pipeline folder or an embedded model (nothing is downloaded; a name or a
        pipeline folder imports the pipelines)."""
        check_common(self, name)
        check_fields(self, name, counts=("answer_length", "warmup", "d_model", "n_layers", "n_heads", "mlp_hidden_size",
                                         "eval_n", "tokenizer_corpus", "eval_batch_size"),
                     non_negative=("n_kv_heads", "eval_every", "final_eval_n", "long_answer_length",
                                   "long_every", "long_batch_size", "eval_answer_length", "eval_block_length"),
                     positive=("rope_theta",), non_negative_numbers=("max_minutes",))
        check_threads(self, name)
        check_masking_and_tasks(self, name)
        check_heads(self, "d_model", "n_heads", name)
        if self.n_kv_heads and self.n_heads % self.n_kv_heads:
            raise ValueError(f"{name('n_heads')} ({self.n_heads}) must be a multiple of {name('n_kv_heads')} "
                             f"({self.n_kv_heads})")
        if bool(self.long_every) != bool(self.long_answer_length):
            raise ValueError(f"{name('long_every')} and {name('long_answer_length')} must both be > 0 (a length mix) or "
                             f"both 0, got {self.long_every} and {self.long_answer_length}")
        canvas = self.eval_answer_length or self.answer_length
        if self.eval_block_length and canvas % self.eval_block_length:
            raise ValueError(f"{name('eval_block_length')} ({self.eval_block_length}) must divide the evaluation canvas "
                             f"({canvas})")
        check_training_memory(self, self.footprint(), name)
        if self.init_from:
            try:
                resolve_init_folders(self.init_from)
            except ValueError as err:
                raise ValueError(f"{name('init_from')}: {str(err).removeprefix('init_from: ')}") from None

    def footprint(self) -> Footprint:
        """LLaDA's blocks (separate q/k/v, SwiGLU, no biases; the embeddings and head, sized by the task tokenizer,
        left out), the activations of the larger of a step and a long-canvas step (answer canvas only, the prompt left
        out) and of an evaluation batch (no gradients: one block at a time), and the task items held (tokenizer
        corpus, evaluation items), ~100 bytes each. With ``init_from`` the model is the folder's (``d_model`` and the
        other sizes are ignored): only the items are counted."""
        items = len(self.tasks) * (self.tokenizer_corpus + self.final_eval_n) + (self.eval_n if self.eval_every else 0)
        if self.init_from:
            return Footprint(0, 100 * items, ("tokenizer_corpus", "eval_n", "final_eval_n"))
        d, layers, heads, mlp = self.d_model, self.n_layers, self.n_heads, self.mlp_hidden_size
        kv = (self.n_kv_heads or heads) * (d // heads)
        parameters = layers * (2 * d * d + 2 * d * kv + 3 * d * mlp + 2 * d) + d

        def per_sequence(tokens: int) -> int:
            return layers * (tokens * (10 * d + 4 * mlp) + 2 * heads * tokens**2)

        steps = [self.batch_size * per_sequence(self.answer_length)]
        if self.long_every:
            steps.append((self.long_batch_size or self.batch_size) * per_sequence(self.long_answer_length))
        canvas = self.eval_answer_length or self.answer_length
        evaluation = self.eval_batch_size * (canvas * (4 * d + 2 * mlp) + heads * canvas**2)
        return Footprint(parameters, FLOAT * (max(steps) + evaluation) + 100 * items,
                         ("d_model", "n_layers", "n_heads", "n_kv_heads", "mlp_hidden_size", "answer_length",
                          "batch_size", "long_answer_length", "long_batch_size", "eval_answer_length",
                          "eval_batch_size", "tokenizer_corpus", "eval_n", "final_eval_n"))


@dataclass
class LLaDA2TrainConfig:
    """tiny-llada2 (:mod:`vispec.eval.train.llada2`): tiny-mdlm upcycled to the LLaDA2 layout (MoE from layer
    ``first_k_dense_replace`` on) and fine-tuned with the block-diffusion objective on its task mix. Defaults sized
    for under an hour on the shared 2-core CPU with one thread: 4.35M parameters, 0.7-0.9 s per step of 16 rows on a
    busy machine, 2500 steps ~30-36 min, plus a few minutes of evaluation."""

    out: str = "out/tiny-llada2"
    init_from: str = "tiny-mdlm"  # a dense LLaDA (upcycled) or a LLaDA2 folder (continued): name or folder
    tasks: tuple[str, ...] = ("arithmetic", "sort", "reverse")
    task_weights: tuple[float, ...] = (0.8, 0.1, 0.1)
    task_options: dict = field(default_factory=dict)  # per task name, e.g. {"arithmetic": {"operand_max": 5}}
    answer_length: int = 32  # the generation canvas: answer, <|eot_id|>, EOS padding
    block_length: int = 32  # LLaDA2's block (the model's config.block_length)
    num_experts: int = 4
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 128  # one routed expert's width; the shared expert holds the rest of the dense MLP
    first_k_dense_replace: int = 1
    routed_scaling_factor: float = 2.5
    steps: int = 2500
    batch_size: int = 16
    lr: float = 5e-4
    weight_decay: float = 0.1
    warmup: int = 100
    mask_eps: float = 1e-3
    stratified_t: bool = True
    # T2T: corruption rate of the unmasked positions of the noised block, all of which are then trained to their clean
    # tokens (what token editing reads); 0: M2T only
    edit_noise: float = 0.05
    balance_rate: float = 1e-3  # expert_bias step of the loss-free router balancing (0: off)
    seed: int = 0
    log_every: int = 25
    checkpoint_every: int = 500  # save out/transformer every this many steps (0: only at the end)
    eval_every: int = 1000  # accuracy on eval_n test items of tasks[0] every this many steps (0: never)
    eval_n: int = 64
    eval_threshold: float = 0.9  # the threshold rule of the progress and final evaluations
    initial_eval_n: int = 128  # per task, before training (the upcycled model; 0: skip)
    final_eval_n: int = 128  # per task, after training (0: skip)
    eval_batch_size: int = 64
    max_minutes: float = 0.0  # > 0: stop early once this much training time has passed
    threads: int = 1  # > 0: torch.set_num_threads(threads); 0 leaves it as is
    device: str = "cpu"  # where the model trains ("cuda" on a GPU machine: the same recipe, faster)

    def validate(self, name: Namer = field_name) -> None:
        """Every field, before any work (:mod:`vispec.eval.train.checks`); ``init_from`` last (a name imports the
        pipelines; nothing is downloaded)."""
        check_common(self, name)
        check_fields(self, name, counts=("answer_length", "block_length", "num_experts", "moe_intermediate_size",
                                         "eval_n", "eval_batch_size"),
                     non_negative=("first_k_dense_replace", "warmup", "checkpoint_every", "eval_every",
                                   "initial_eval_n", "final_eval_n"),
                     positive=("routed_scaling_factor",), non_negative_numbers=("max_minutes", "balance_rate"),
                     fractions=("edit_noise",))
        check_threads(self, name)
        if not isinstance(self.device, str) or re.fullmatch(r"cpu|cuda(:\d+)?", self.device) is None:
            raise ValueError(f"{name('device')} must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        check_device_present(self.device, name("device"))
        if self.answer_length % self.block_length:
            raise ValueError(f"{name('answer_length')} ({self.answer_length}) must be a multiple of "
                             f"{name('block_length')} ({self.block_length}): the answer is decoded in whole blocks")
        check_int(name("num_experts"), self.num_experts, minimum=2,
                  hint=f" ({name('num_experts_per_tok')} >= 2 experts are mixed per token)")
        check_int(name("num_experts_per_tok"), self.num_experts_per_tok, minimum=2, maximum=self.num_experts,
                  hint=f" (at most {name('num_experts')}; LLaDA2's router normalises k > 1 weights only)")
        check_masking_and_tasks(self, name)
        check_number(name("eval_threshold"), self.eval_threshold, minimum=0, maximum=1, exclusive_minimum=True)
        if not self.init_from:
            raise ValueError(f"{name('init_from')} must name a dense LLaDA to upcycle (e.g. tiny-mdlm) or a LLaDA2 "
                             "folder to continue")
        try:
            model_path, _ = resolve_init_folders(self.init_from)
        except ValueError as err:
            raise ValueError(f"{name('init_from')}: {str(err).removeprefix('init_from: ')}") from None
        self._check_upcycling(model_path, name)

    def _check_upcycling(self, model_path: str, name: Namer) -> None:
        """A dense LLaDA to upcycle (its ``config.json``, read without torch) must have the layers and MLP width the
        MoE settings split: ``first_k_dense_replace <= n_layers``, ``moe_intermediate_size`` dividing the MLP width at
        least twice."""
        import json

        try:
            with open(os.path.join(model_path, "config.json")) as f:
                dense = json.load(f)
        except (OSError, ValueError) as err:
            raise ValueError(f"{name('init_from')}: cannot read {model_path}/config.json ({err})") from None
        if dense.get("_class_name") == "LLaDA2MoeModelLM":  # continued: it keeps its layout, so the fields must match
            for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "first_k_dense_replace",
                        "routed_scaling_factor", "block_length"):
                if key in dense and getattr(self, key) != dense[key] and getattr(self, key) != _default(self, key):
                    raise ValueError(f"{name(key)} {getattr(self, key)} differs from the {dense[key]} of "
                                     f"{name('init_from')} {self.init_from!r}: a LLaDA2 folder is continued with its "
                                     f"own layout (leave {name(key)} out, or upcycle a dense LLaDA)")
            check_training_memory(self, self.footprint(dense), name)
            return
        if dense.get("_class_name") != "LLaDAModelLM":
            return  # anything else is refused by the trainer
        check_training_memory(self, self.footprint(dense), name)
        layers, width = dense.get("n_layers", 0), dense.get("mlp_hidden_size", 0)
        if self.first_k_dense_replace > layers:
            raise ValueError(f"{name('first_k_dense_replace')} must be at most the dense model's {layers} layers, got "
                             f"{self.first_k_dense_replace}")
        if width % self.moe_intermediate_size or width // self.moe_intermediate_size < 2:
            raise ValueError(f"{name('moe_intermediate_size')} must divide the dense model's MLP width ({width}) at "
                             f"least twice (a shared part and one routed expert), got {self.moe_intermediate_size}")


    def footprint(self, model: dict) -> Footprint:
        """The upcycled (or continued) model's parameters from its ``config.json`` ``model`` (dense LLaDA or LLaDA2
        keys), and a step's activations: ``batch_size`` rows of the prompt (at most 128 tokens) and the answer, each
        layer's ~34 floats per token and the float32 logits with their gradient."""
        width = model.get("d_model", model.get("hidden_size", 0))
        layers = model.get("n_layers", model.get("num_hidden_layers", 0))
        vocab = model.get("embedding_size", model.get("vocab_size", 0)) or 0
        mlp = model.get("mlp_hidden_size", model.get("intermediate_size", 0))
        routed = self.num_experts * self.moe_intermediate_size
        parameters = 2 * vocab * width + layers * (4 * width * width + 3 * width * (mlp + routed))
        tokens = self.batch_size * (128 + self.answer_length)
        return Footprint(parameters, FLOAT * tokens * (34 * layers * width + 2 * vocab),
                         ("batch_size", "answer_length", "num_experts", "moe_intermediate_size"))


def _default(cfg: object, key: str):
    """The dataclass default of ``cfg``'s field ``key``."""
    import dataclasses

    return next(f.default for f in dataclasses.fields(cfg) if f.name == key)


@dataclass
class LLaDA2AssembleConfig:
    trained: str = "out/tiny-llada2"  # the folder `vispec train llada2 --out` wrote
    out: str = "models/pretrained/tiny-llada2"
    gen_length: int = 0  # 0: the training answer length
    script: str = "samples/train_tiny_llada2.sh"  # the reproduction script named on the model card
    bench: str = ""  # a samples/bench_text_llada2.py result (JSON) summarised on the card, when given

    def validate(self, name: Namer = field_name) -> None:
        """Every field, before anything is read (:mod:`vispec.eval.train.checks`)."""
        check_output_folder(self, "out", name)
        check_fields(self, name, non_negative=("gen_length",))
        check_folder(self, "trained", name, holds="train_config.json", what="the folder `vispec train llada2` wrote")
        if self.bench and not os.path.isfile(self.bench):
            raise ValueError(f"{name('bench')} must be a JSON file written by samples/bench_text_llada2.py or empty, "
                             f"got {self.bench!r}")


def resolve_init_folders(init_from: str) -> tuple[str, str]:
    """``(model folder, tokenizer folder)`` of ``init_from``: a trained folder (``transformer/``, ``tokenizer/``), a
    pipeline folder (``model/``, ``tokenizer/``) or an embedded model name such as ``"vispec/tiny-mdlm"`` (the last
    two are resolved by :mod:`vispec.pipelines`, imported here)."""
    if os.path.isdir(os.path.join(init_from, "transformer")):
        folder, model_dir = init_from, "transformer"
    else:
        from vispec.pipelines.embedded import resolve_model_path

        try:
            folder = resolve_model_path(init_from)
        except ValueError as err:
            raise ValueError(f"init_from: {err}") from err
        model_dir = "model"
    paths = os.path.join(folder, model_dir), os.path.join(folder, "tokenizer")
    for path in paths:
        if not os.path.isdir(path):
            raise ValueError(f"init_from={init_from!r}: missing {path}")
    return paths


@dataclass
class FilterTrainConfig:
    """Defaults: 32 prompts per task (about 10 minutes on 2 CPU cores for tiny-mdlm-long, most of it the
    256-step reference decodes), a 32 → 32 → 32 filter and 3000 full-batch epochs (seconds)."""

    model: str = "tiny-mdlm-long"  # embedded name or pipeline folder
    out: str = "out/filter"  # the pipeline folder written, with the filter component
    tasks: tuple[str, ...] = ("arithmetic", "sort", "reverse")
    prompts_per_task: int = 32
    gen_length: int = 0  # 0: the pipeline's default
    block_length: int = 0  # 0: the pipeline's default
    batch_size: int = 32
    hidden_size: int = 32
    epochs: int = 3000
    lr: float = 3e-3
    weight_decay: float = 0.01
    threshold: float = 0.96  # τ the record's metrics are reported at (Learn2PD's default)
    seed: int = 0
    threads: int = 2

    def validate(self, name: Namer = field_name) -> None:
        """Every field, before any work (:mod:`vispec.eval.train.checks`), and the memory training needs;
        ``threads`` at most :data:`~vispec.eval.train.checks.MAX_THREADS`. Last, ``model`` must be an embedded model
        or a local pipeline folder (this imports the pipelines)."""
        from vispec.eval.bench.text_tasks import TASKS

        check_common(self, name)
        for key in ("prompts_per_task", "batch_size", "hidden_size", "epochs"):
            check_int(name(key), getattr(self, key), minimum=1)
        check_threads(self, name, minimum=1)
        for key in ("gen_length", "block_length"):
            check_int(name(key), getattr(self, key), minimum=0, hint=" (0 = the pipeline's default)")
        check_number(name("threshold"), self.threshold, minimum=0, maximum=1, exclusive_minimum=True)
        if not self.tasks:
            raise ValueError(f"{name('tasks')} must name at least one task")
        unknown = [t for t in self.tasks if t not in TASKS]
        if unknown:
            raise ValueError(f"{name('tasks')} must name tasks among {', '.join(TASKS)}, got {','.join(self.tasks)}")
        if self.gen_length and self.block_length and self.gen_length % self.block_length:
            raise ValueError(f"{name('gen_length')} ({self.gen_length}) must be a multiple of {name('block_length')} "
                             f"({self.block_length})")
        check_training_memory(self, self.footprint(), name)
        check_pipeline_name(self, "model", name)

    def footprint(self) -> Footprint:
        """The filter MLP (``block -> hidden -> block``; a block of 1 where the pipeline's default applies) and its
        full-batch training rows (at least one per prompt and block), the prompts and the decoding canvases of a
        batch (ids only: the base model is not counted)."""
        block = self.block_length or 1
        parameters = 2 * block * self.hidden_size + self.hidden_size + block
        prompts = len(self.tasks) * self.prompts_per_task
        rows = prompts * max(1, self.gen_length // self.block_length) if self.block_length else prompts
        canvases = min(self.batch_size, prompts) * self.gen_length * 8 * 3
        return Footprint(parameters, FLOAT * 3 * rows * (self.hidden_size + 2 * block) + 100 * prompts + canvases,
                         ("hidden_size", "block_length", "gen_length", "prompts_per_task", "tasks"))


# ---- assemblers (no model of their own) ------------------------------------------------------------------------

def check_output(cfg, name: Namer = field_name) -> None:
    """``cfg.out``: a folder that can be made and written (:func:`~vispec.eval.train.checks.check_output_folder`)."""
    check_output_folder(cfg, "out", name)


@dataclass
class AssembleConfig:
    vq: str = "out/tiny-c2i/vqvae"
    gpt: str = "out/tiny-c2i/transformer"
    evaluator: str = "out/tiny-c2i/evaluator"
    out: str = "models/pretrained/tiny-c2i"
    guidance_scale: float = 3.0
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    window: int = 16
    init: str = "horizontal"

    def validate(self, name: Namer = field_name) -> None:
        """Every field, before anything is read (:mod:`vispec.eval.train.checks`); the sampling defaults last
        (they import the decoders)."""
        check_output(self, name)
        for field_, what in (("vq", "`vispec train vq`"), ("gpt", "`vispec train gpt`"), ("evaluator", "`vispec train evaluator`")):
            check_folder(self, field_, name, holds="config.json", what=f"the folder {what} wrote")
        check_decoding_defaults(self, name)


@dataclass
class DrafterAssembleConfig:
    drafter: str = "out/tiny-c2i-drafter"
    pipeline: str = "models/pretrained/tiny-c2i"
    lantern_k: int = 1000  # neighbour table stored with the pipeline (LANTERN's default k)

    def validate(self, name: Namer = field_name) -> None:
        """Every field, before anything is read (:mod:`vispec.eval.train.checks`)."""
        check_fields(self, name, counts=("lantern_k",))
        check_folder(self, "drafter", name, holds="config.json", what="the folder `vispec train drafter` wrote")
        check_folder(self, "pipeline", name, holds="model_index.json", what="a LlamaGenPipeline folder")


@dataclass
class MDLMAssembleConfig:
    trained: str = "out/tiny-mdlm"  # the folder `vispec train mdlm --out` wrote
    out: str = "models/pretrained/tiny-mdlm"
    gen_length: int = 0  # 0: the training answer length
    block_length: int = 8
    threshold: float = 0.9  # the default scheduler: Fast-dLLM's threshold rule
    script: str = "samples/train_tiny_mdlm.sh"  # the reproduction script named on the model card
    # > 0: the context (prompt + canvas) the saved model config allows; RoPE has no table, so this is only the
    # limit decoding checks. 0 keeps the trained model's (tiny-mdlm: 256)
    max_sequence_length: int = 0

    def validate(self, name: Namer = field_name) -> None:
        """Every field, before anything is read (:mod:`vispec.eval.train.checks`)."""
        check_output(self, name)
        check_fields(self, name, counts=("block_length",), non_negative=("gen_length", "max_sequence_length"))
        check_number(name("threshold"), self.threshold, minimum=0, maximum=1, exclusive_minimum=True)
        if self.gen_length and self.gen_length % self.block_length:
            raise ValueError(f"{name('gen_length')} ({self.gen_length}) must be a multiple of {name('block_length')} "
                             f"({self.block_length})")
        check_folder(self, "trained", name, holds="train_config.json", what="the folder `vispec train mdlm` wrote")


@dataclass
class T2IAssembleConfig:
    vq: str = "out/tiny-t2i/vqvae"
    t2i: str = "out/tiny-t2i/transformer"
    clip: str = ""  # the trained tiny-clip folder, stored as clip/ when given
    out: str = "models/pretrained/tiny-t2i"
    guidance_scale: float = 3.0
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    window: int = 16

    def validate(self, name: Namer = field_name) -> None:
        """Every field, before anything is read (:mod:`vispec.eval.train.checks`); ``clip`` may be empty (none); the
        sampling defaults last (they import the decoders)."""
        check_output(self, name)
        check_folder(self, "vq", name, holds="config.json", what="the folder `vispec train vq --data scenes` wrote")
        check_folder(self, "t2i", name, holds="train_config.json", what="the folder `vispec train t2i` wrote")
        if self.clip:
            check_folder(self, "clip", name, what="the folder `vispec train clip` wrote (or empty: no CLIP)")
        check_decoding_defaults(self, name)



@dataclass
class EditTrainConfig:
    """``vispec train edit``: tiny-edit, fine-tuned from tiny-t2i on scene-edit pairs (:mod:`vispec.eval.train.edit`)."""

    init_from: str = "tiny-t2i"  # embedded name or tiny-t2i pipeline folder (transformer, tokenizer, vqvae reused)
    out: str = "out/tiny-edit/transformer"
    num_pairs: int = 6000
    eval_pairs: int = 128  # held-out (test-split) pairs for the teacher-forced metrics
    steps: int = 600
    max_minutes: float = 0.0  # wall-clock cap of the optimisation (0: none); the schedule follows the nearer end
    warmup: int = 20
    batch_size: int = 12
    lr: float = 1e-3
    weight_decay: float = 0.05
    instruction_dropout: float = 0.1
    seed: int = 0
    log_every: int = 10
    bf16: bool = False  # matrix products under bfloat16 autocast, as tiny-t2i's trainer (check_bf16)

    def validate(self, name: Namer = field_name) -> None:
        """Every field before any work; then ``init_from`` must be an embedded model or a local pipeline folder;
        ``bf16`` only on a CPU with native bfloat16 products."""
        check_common(self, name)
        check_fields(self, name, counts=("num_pairs", "eval_pairs", "warmup"), fractions=("instruction_dropout",),
                     non_negative_numbers=("max_minutes",))
        check_pipeline_name(self, "init_from", name)
        check_bf16(self, name)


@dataclass
class EditAssembleConfig:
    """``vispec train assemble-edit``: write tiny-edit as a ``UnifiedImagePipeline`` folder."""

    edit: str = "out/tiny-edit/transformer"
    init_from: str = "tiny-t2i"  # the pipeline whose vqvae (and clip) tiny-edit reuses
    evaluation: str = ""  # a JSON file of measured numbers to put in the model card (optional)
    out: str = "models/pretrained/tiny-edit"
    guidance_scale: float = 3.0
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    window: int = 16

    def validate(self, name: Namer = field_name) -> None:
        """Every field before anything is read; the sampling defaults last (they import the decoders)."""
        check_output(self, name)
        check_folder(self, "edit", name, holds="train_config.json", what="the folder `vispec train edit` wrote")
        if self.evaluation and not os.path.isfile(self.evaluation):
            raise ValueError(f"{name('evaluation')} must be a JSON file or empty, got {self.evaluation!r}")
        check_pipeline_name(self, "init_from", name)
        check_decoding_defaults(self, name)


CONFIGS = (VQTrainConfig, EvaluatorTrainConfig, GPTTrainConfig, AssembleConfig, DrafterTrainConfig,
           DrafterAssembleConfig, T2ITrainConfig, CLIPTrainConfig, T2IAssembleConfig, MDLMTrainConfig,
           MDLMAssembleConfig, FilterTrainConfig, EditTrainConfig, EditAssembleConfig, LLaDA2TrainConfig,
           LLaDA2AssembleConfig)
