"""Writing trained parts as pipeline folders (package data under ``models/pretrained/``).

``tiny-c2i`` (:func:`assemble`; a diffusers pipeline folder plus the evaluator and a model card)::

    models/pretrained/tiny-c2i/
        model_index.json, transformer/, vqvae/, decoding_config/   <- LlamaGenPipeline.from_pretrained
        evaluator/                                                 <- CropClassifier (accuracy, FID features)
        drafter/, lantern neighbour table                          <- added by assemble_drafter
        README.md                                                  <- training settings and metrics

``tiny-mdlm`` and ``tiny-mdlm-long`` (:func:`assemble_mdlm`; the folder name is the card's title)::

    models/pretrained/tiny-mdlm/
        model_index.json, model/, tokenizer/, scheduler/   <- MaskedDiffusionLMPipeline.from_pretrained
        README.md                                          <- tasks, sizes, training settings and metrics
        logs/model.jsonl                                   <- the loss log

Both go through :func:`write_pipeline_folder`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from typing import Any, Callable

from diffusers import VQModel

from vispec.decoding import DecodingConfig
from vispec.eval.bench.data import CLASS_NAMES
from vispec.eval.bench.evaluator import CropClassifier
# their home: torch-free, for the CLI (re-exported here)
from vispec.eval.train.configs import (AssembleConfig, DrafterAssembleConfig, EditAssembleConfig, MDLMAssembleConfig,
                                      T2IAssembleConfig)
from vispec.models.checkpoints import diffusers_load_kwargs
from vispec.models.llamagen_gpt import LlamaGenGPT


def read_record(folder: str, required: bool = False) -> dict:
    """A trainer's ``train_config.json`` (config and metrics); ``{}`` when absent unless ``required``."""
    path = os.path.join(folder, "train_config.json")
    if not required and not os.path.exists(path):
        return {}
    with open(path) as handle:
        return json.load(handle)


def read_card_record(folder: str) -> dict:
    """The record :func:`write_pipeline_folder` wrote into ``folder``'s README (its last JSON block); ``{}`` when the
    folder has no README or no block."""
    readme = os.path.join(folder, "README.md")
    if not os.path.isfile(readme):
        return {}
    with open(readme) as handle:
        blocks = re.findall(r"```json\n(.*?)\n```", handle.read(), flags=re.S)
    return json.loads(blocks[-1]) if blocks else {}


def write_pipeline_folder(pipe, out: str, card: list[str], record: dict, *, record_title: str,
                          extras: dict[str, Callable[[str], None]] | None = None) -> dict:
    """Replace ``out`` by ``pipe.save_pretrained(out)``; ``extras[relative path](path)`` writes each further file or
    folder; ``README.md`` is the model ``card`` followed by ``record`` as a JSON block under ``## record_title``."""
    if os.path.isdir(out):
        shutil.rmtree(out)
    pipe.save_pretrained(out)
    for relative, write in (extras or {}).items():
        path = os.path.join(out, relative)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write(path)
    lines = [*card, "", f"## {record_title}", "```json", json.dumps(record, indent=2), "```"]
    with open(os.path.join(out, "README.md"), "w") as handle:
        handle.write("\n".join(lines) + "\n")
    return {"out": out, "files": sorted(os.listdir(out))}


def assemble(cfg: AssembleConfig) -> dict:
    from vispec.pipelines import LlamaGenPipeline

    cfg.validate()

    transformer = LlamaGenGPT.from_pretrained(cfg.gpt, **diffusers_load_kwargs()).eval()
    vqvae = VQModel.from_pretrained(cfg.vq, **diffusers_load_kwargs()).eval()
    evaluator = CropClassifier.from_pretrained(cfg.evaluator, **diffusers_load_kwargs()).eval()
    if vqvae.config.num_vq_embeddings != transformer.config.vocab_size:
        raise ValueError(f"VQ codebook ({vqvae.config.num_vq_embeddings}) != GPT vocabulary ({transformer.config.vocab_size})")
    decoding = DecodingConfig(strategy="mc-sjd", window=cfg.window, init=cfg.init, guidance_scale=cfg.guidance_scale,
                              temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p)
    pipe = LlamaGenPipeline(transformer=transformer, vqvae=vqvae, decoding_config=decoding)
    info = {name: read_record(folder) for name, folder in (("vqvae", cfg.vq), ("transformer", cfg.gpt), ("evaluator", cfg.evaluator))}
    card = [
        "# tiny-c2i: vispec's embedded class-conditional LlamaGen model",
        "",
        f"64x64 crops of {len(CLASS_NAMES)} natural photos bundled with scikit-image; class = source photo:",
        ", ".join(f"{i} {n}" for i, n in enumerate(CLASS_NAMES)) + ".",
        "",
        f"- VQ tokenizer: LlamaGen VQ family at downsample 4 (16x16 tokens), cosine codebook of {vqvae.config.num_vq_embeddings} codes.",
        f"- GPT: LlamaGen architecture, {sum(p.numel() for p in transformer.parameters()) / 1e6:.2f}M parameters, "
        f"class dropout {transformer.config.class_dropout_prob}.",
        f"- Default sampling: CFG {cfg.guidance_scale}, temperature {cfg.temperature}, top-k {cfg.top_k}, top-p {cfg.top_p}; "
        f"decoding mc-sjd (window {cfg.window}).",
        "- Reproduce with samples/train_tiny_c2i.sh (seeded).",
    ]
    return write_pipeline_folder(pipe, cfg.out, card, info, record_title="Training records",
                                 extras={"evaluator": evaluator.save_pretrained})


def assemble_drafter(cfg: DrafterAssembleConfig) -> dict:
    """Add a trained drafter to a pipeline folder (``drafter/`` component) and store the LANTERN
    neighbour table of its tokenizer, so ``decoding="sd"`` and ``acceptance="lantern"`` work offline."""
    from vispec.pipelines.llamagen import LlamaGenPipeline

    cfg.validate()

    pipe = LlamaGenPipeline.from_pretrained(cfg.pipeline)
    drafter = LlamaGenGPT.from_pretrained(cfg.drafter).eval()
    if drafter.config.vocab_size != pipe.transformer.config.vocab_size:
        raise ValueError(f"drafter vocabulary {drafter.config.vocab_size} differs from the pipeline's {pipe.transformer.config.vocab_size}")
    pipe.register_modules(drafter=drafter)
    pipe.acceptance_rule(f"lantern:k={cfg.lantern_k}")  # computes and caches the raw-codebook table
    pipe.save_pretrained(cfg.pipeline)
    return {"drafter_parameters": sum(p.numel() for p in drafter.parameters()),
            "neighbors": list(pipe.lantern_neighbors["raw"].shape)}


def assemble_mdlm(cfg: MDLMAssembleConfig) -> dict:
    from vispec.dllm import ThresholdScheduler
    from vispec.eval.train.tokenizer import load_text_tokenizer
    from vispec.models.llada import LLaDAModelLM
    from vispec.pipelines import MaskedDiffusionLMPipeline

    cfg.validate()
    record = read_record(cfg.trained, required=True)
    gen_length = cfg.gen_length or record["config"]["answer_length"]
    if gen_length % cfg.block_length:
        raise ValueError(f"gen_length ({gen_length}) must be a multiple of block_length ({cfg.block_length})")
    model = LLaDAModelLM.from_pretrained(os.path.join(cfg.trained, "transformer"), **diffusers_load_kwargs()).eval()
    if cfg.max_sequence_length:
        if cfg.max_sequence_length <= gen_length:
            raise ValueError(f"max_sequence_length ({cfg.max_sequence_length}) must exceed gen_length ({gen_length}): "
                             "the prompt goes in the context too")
        model.register_to_config(max_sequence_length=cfg.max_sequence_length)
    tokenizer = load_text_tokenizer(os.path.join(cfg.trained, "tokenizer"))
    pipe = MaskedDiffusionLMPipeline(model=model, tokenizer=tokenizer, scheduler=ThresholdScheduler(threshold=cfg.threshold),
                                     default_gen_length=gen_length, default_block_length=cfg.block_length)
    c = model.config
    config = record["config"]
    name = os.path.basename(os.path.normpath(cfg.out))
    card = [
        f"# {name}: vispec's embedded masked diffusion LM",
        "",
        "A LLaDA-architecture mask predictor (bidirectional Llama blocks, RMSNorm, SwiGLU, RoPE, untied head) trained",
        "with LLaDA's SFT objective on vispec's synthetic task suite (vispec.eval.bench.text_tasks): arithmetic word problems",
        "with worked solutions ending in `#### <answer>` (GSM8K format), sorting digits with repeats (tokens depend",
        "strongly on each other) and reversing letters (nearly independent tokens).",
        "",
        f"- Model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, d_model {c.d_model}, {c.n_layers} layers, "
        f"{c.n_heads} heads, MLP {c.mlp_hidden_size}, vocabulary {c.vocab_size} (word-level tokenizer, numbers as single tokens).",
        f"- Defaults: gen length {gen_length}, block length {cfg.block_length}, scheduler threshold {cfg.threshold} "
        "(pass strategy='llada' for the one-token-per-step baseline).",
        f"- Reproduce with {cfg.script} (seeded).",
    ]
    stages = training_stages(cfg.trained, record)
    for k, (folder, stage) in enumerate(stages, start=1):
        c_k, metrics = stage["config"], stage.get("metrics", {})
        if not c_k.get("init_from"):
            continue
        label = f"Stage {k} of {len(stages)}: " if len(stages) > 1 else ""
        card.insert(-1, f"- {label}fine-tuned from {c_k['init_from']} (same tokenizer), "
                        f"{metrics.get('steps_done', c_k['steps'])} steps at lr {c_k['lr']}, task weights "
                        f"{dict(zip(c_k['tasks'], c_k['task_weights']))}, answer canvas {c_k['answer_length']}"
                        + (f" and {c_k['long_answer_length']} on one step in {c_k['long_every']}" if c_k.get("long_every") else "")
                        + ".")
    final = record.get("metrics", {}).get("eval", {})
    if final:
        scores = ", ".join(f"{task} {next(v for k, v in r.items() if k in ('strict_match', 'exact_match')):.3f}"
                           for task, r in final.items())
        first = next(iter(final.values()))
        card.insert(-1, f"- Greedy one-token-per-step decoding, gen length {first.get('gen_length', config['answer_length'])}, "
                        f"block {first.get('block_length', config['answer_length'])}, {first['n']} test items per task "
                        f"(strict-match / exact-match): {scores}.")
    extras = {"logs/model.jsonl": lambda path: shutil.copy(os.path.join(cfg.trained, "train_log.jsonl"), path)}
    if len(stages) > 1:  # every stage's loss log, and every stage's record
        for k, (folder, _) in enumerate(stages, start=1):
            extras[f"logs/stage-{k}.jsonl"] = lambda path, f=folder: shutil.copy(os.path.join(f, "train_log.jsonl"), path)
        record = {"stages": [stage for _, stage in stages]}
    return write_pipeline_folder(pipe, cfg.out, card, record, record_title="Training record", extras=extras)


def training_stages(trained: str, record: dict) -> list[tuple[str, dict]]:
    """``[(folder, record)]`` from the first training run to ``trained``, following ``init_from`` back through
    local training folders (those with a ``train_config.json``); a run that started from an embedded model or
    from scratch is the first."""
    stages = [(trained, record)]
    seen = {os.path.abspath(trained)}
    while True:
        parent = stages[0][1]["config"].get("init_from", "")
        if not parent or not os.path.isfile(os.path.join(parent, "train_config.json")):
            return stages
        if os.path.abspath(parent) in seen:
            raise ValueError(f"init_from forms a cycle at {parent}")
        seen.add(os.path.abspath(parent))
        stages.insert(0, (parent, read_record(parent, required=True)))


def scene_pipeline(transformer: Any, tokenizer: Any, vqvae: Any, vocab: dict, cfg: Any, what: str,
                   size: tuple[int, int], image_to_image: bool = False) -> Any:
    """A ``UnifiedImagePipeline`` over a scene model's vocabulary (tiny-t2i's layout: image start / end, end of row,
    resolution tokens, codes), with ``cfg``'s decoding defaults; ``what`` names the model in the error raised when
    its vocabulary and the VQ disagree on the number of codes."""
    from vispec.eval.train.t2i import RESOLUTION_UNIT
    from vispec.models.llamagen_vq import downsample_factor
    from vispec.pipelines import UnifiedImagePipeline

    num_codes = vqvae.config.num_vq_embeddings
    if vocab["vocab_size"] - vocab["code_offset"] != num_codes:
        raise ValueError(f"the {what} was trained for {vocab['vocab_size'] - vocab['code_offset']} codes, the VQ has {num_codes}")
    decoding = DecodingConfig(strategy="mc-sjd", window=cfg.window, guidance_scale=cfg.guidance_scale,
                              temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p)
    return UnifiedImagePipeline(
        transformer=transformer, tokenizer=tokenizer, vqvae=vqvae, decoding_config=decoding, family="chameleon",
        num_codes=num_codes, code_offset=vocab["code_offset"], eol_id=vocab["end_of_row"],
        image_start_id=vocab["image_start"], image_end_ids=[vocab["image_end"]], resolution_token_base=vocab["resolution_base"],
        resolution_unit=RESOLUTION_UNIT, downsample=downsample_factor(vqvae), prompt_template="{prompt}", cfg_mode="image_start",
        default_height=size[0], default_width=size[1], image_to_image=image_to_image)


def assemble_t2i(cfg: T2IAssembleConfig) -> dict:
    """Write tiny-t2i (a ``UnifiedImagePipeline``: the Chameleon decoder, its caption tokenizer, the scene VQ) with
    its model card; the layout ids come from the trainer's record (:func:`vispec.eval.train.t2i.t2i_vocabulary`)."""
    from transformers import ChameleonForConditionalGeneration, PreTrainedTokenizerFast

    from vispec.eval.train.t2i import RESOLUTION_UNIT

    cfg.validate()
    record = read_record(cfg.t2i, required=True)
    vocab = record["metrics"]["vocabulary"]
    transformer = ChameleonForConditionalGeneration.from_pretrained(cfg.t2i).eval()
    tokenizer = PreTrainedTokenizerFast.from_pretrained(os.path.join(cfg.t2i, "tokenizer"))
    vqvae = VQModel.from_pretrained(cfg.vq, **diffusers_load_kwargs()).eval()
    pipe = scene_pipeline(transformer, tokenizer, vqvae, vocab, cfg, "decoder", (64, 64))
    num_codes = pipe.config.num_codes
    info = {name: read_record(folder) for name, folder in (("vqvae", cfg.vq), ("transformer", cfg.t2i), ("clip", cfg.clip))
            if folder}
    c = transformer.config
    card = [
        "# tiny-t2i: vispec's embedded text-to-image model (unified tokens)",
        "",
        "Captioned scenes (vispec.eval.bench.scenes): one to three shapes in six colours and two sizes on plain grey",
        "backgrounds (one flat level per scene), captions such as 'two red circles' or 'a blue square left of a yellow",
        "triangle'; held-out compositions are never trained on. Sizes 64x64 and 64x96 (height x width).",
        "",
        f"- VQ tokenizer: LlamaGen VQ family at downsample {pipe.config.downsample}, {num_codes} codes, trained on the scenes.",
        f"- Decoder: transformers' Chameleon architecture, {c.num_hidden_layers} layers, hidden {c.hidden_size}; one vocabulary of "
        f"caption words, image start / end, end of row, resolution tokens (n = pixels / {RESOLUTION_UNIT}) and the codes;",
        "  caption dropout for classifier-free guidance from image start.",
        f"- Default sampling: CFG {cfg.guidance_scale}, temperature {cfg.temperature}, top-k {cfg.top_k}; decoding mc-sjd "
        f"(window {cfg.window}).",
        "- Reproduce with samples/train_tiny_t2i.sh (seeded).",
    ]
    extras = {}
    for name, log in (("vqvae", os.path.join(cfg.vq, "train_log.jsonl")),  # the loss logs
                      ("transformer", os.path.join(cfg.t2i, "train_log.jsonl")),
                      ("transformer-init", os.path.join(cfg.t2i, "init_from_log.jsonl"))):  # a continued run's parent
        if os.path.isfile(log):
            extras[f"logs/{name}.jsonl"] = lambda path, log=log: shutil.copy(log, path)
    for relative in ("train_config.json", "train_log.jsonl"):  # the VQ keeps its record, for a decoder retrained on it
        source = os.path.join(cfg.vq, relative)
        if os.path.isfile(source):
            extras[f"vqvae/{relative}"] = lambda path, source=source: shutil.copy(source, path)
    if cfg.clip:
        extras["clip"] = lambda path: shutil.copytree(cfg.clip, path)
    return write_pipeline_folder(pipe, cfg.out, card, info, record_title="Training records", extras=extras)


def assemble_edit(cfg: EditAssembleConfig) -> dict:
    """Write tiny-edit (a ``UnifiedImagePipeline`` like tiny-t2i's: the fine-tuned Chameleon editor, its instruction
    tokenizer, tiny-t2i's scene VQ and CLIP) with its model card; the layout ids come from the trainer's record
    (:func:`vispec.eval.train.edit.edit_vocabulary`), the measured numbers from ``cfg.evaluation`` when given."""
    from transformers import ChameleonForConditionalGeneration, PreTrainedTokenizerFast

    from vispec.eval.train.edit import PANEL, panel_tokens
    from vispec.eval.train.t2i import RESOLUTION_UNIT
    from vispec.pipelines.embedded import resolve_model_path

    cfg.validate()
    record = read_record(cfg.edit, required=True)
    vocab = record["metrics"]["vocabulary"]
    base = resolve_model_path(cfg.init_from)
    transformer = ChameleonForConditionalGeneration.from_pretrained(cfg.edit).eval()
    tokenizer = PreTrainedTokenizerFast.from_pretrained(os.path.join(cfg.edit, "tokenizer"))
    vqvae = VQModel.from_pretrained(os.path.join(base, "vqvae"), **diffusers_load_kwargs()).eval()
    pipe = scene_pipeline(transformer, tokenizer, vqvae, vocab, cfg, "editor", PANEL, image_to_image=True)
    num_codes, side = pipe.config.num_codes, pipe.config.downsample
    evaluation = {}
    if cfg.evaluation:
        with open(cfg.evaluation) as handle:
            evaluation = json.load(handle)
    c, config, metrics = transformer.config, record["config"], record["metrics"]
    card = [
        "# tiny-edit: vispec's embedded instruction image editor (unified tokens, dual panel)",
        "",
        "Edits a 64x64 scene (vispec.eval.bench.scenes) by an instruction that changes exactly one attribute",
        "(vispec.eval.bench.scene_edits): 'make the red square blue', 'move the red circle to the left', 'move the red",
        "square below the blue circle', 'make the red circle large', 'add a red circle', 'remove one red circle',",
        "'add a blue square left of the red circle', 'remove the blue square'. Pairs share background and untouched",
        "objects; held-out pairs have target compositions never trained on.",
        "",
        "- Sequence: Lumina-mGPT 2.0's dual-panel image-to-image layout: instruction words, `[image_start, "
        f"res(2H), res(W)]` (the header declares twice the height), the SOURCE panel rows ({panel_tokens(side)} tokens: "
        f"{PANEL[0] // side} rows of",
        f"  {PANEL[1] // side} codes and end of row), then the TARGET panel rows, then image_end. Guidance starts at image start: the",
        "  unconditional branch keeps the source panel and drops the instruction (instruction dropout "
        f"{config['instruction_dropout']} in training).",
        f"- Decoder: transformers' Chameleon, {c.num_hidden_layers} layers, hidden {c.hidden_size}, max positions "
        f"{c.max_position_embeddings}; vocabulary: a word-level tokenizer of the caption and edit words, then image start / end,",
        f"  end of row, resolution tokens (n = pixels / {RESOLUTION_UNIT}) and {num_codes} codes. Initialised from tiny-t2i "
        f"({metrics['mapped_rows']} embedding / head rows copied by token meaning, {metrics['new_rows']} new words random),",
        f"  then fine-tuned {metrics.get('steps_done', config['steps'])} steps (batch {config['batch_size']}, lr {config['lr']}, "
        f"{metrics['train_minutes']} min on a shared CPU) on {config['num_pairs']} train pairs; loss on the target rows only;",
        f"  final training loss {metrics['final_loss']:.3f}.",
        "- VQ tokenizer and CLIP: tiny-t2i's, unchanged. Its encoder has global attention and group norms, so encoding",
        "  the edited picture alone changes many codes away from the object (flat regions sit near ties between codes);",
        "  the training targets therefore keep the source's code wherever the pixels of a code cell and its neighbours",
        "  did not change (vispec.eval.bench.scene_edits.aligned_target_codes): the model learns to copy what it does",
        "  not edit, which is what IAD's drafts (the source's codes) rely on.",
        f"- Default sampling: CFG {cfg.guidance_scale}, temperature {cfg.temperature}, top-k {cfg.top_k}; decoding mc-sjd "
        f"(window {cfg.window}).",
        "- Reproduce with samples/train_tiny_edit.sh (seeded).",
    ]
    held = metrics.get("held_out", {})
    if held:
        card += ["", "## Measured (held-out test pairs)", "",
                 f"- Teacher-forced, {held['pairs']} pairs: next-token accuracy {held['token_accuracy']:.3f} on the target "
                 f"panel (before fine-tuning {metrics['held_out_before']['token_accuracy']:.3f}), loss {held['loss']:.3f}; "
                 f"target codes equal to the source's at the same place: {held['target_equals_source']:.3f}; accuracy on "
                 f"the codes that differ from the source: {held['accuracy_on_changed_codes']:.3f}."]
    for key, value in evaluation.items():
        if key.startswith("ar_guidance_") or key.startswith("baseline") or key.startswith("ceiling"):
            card.append(f"- {key} ({evaluation['settings']['pairs']} pairs, scene checks vs the target caption): overall "
                        f"{value['accuracy']['overall']:.3f}, strict (edit visible) {value['strict_overall']:.3f}, "
                        f"generated codes equal to the source's {value['codes_equal_source']:.3f}.")
    if evaluation:
        card.append("- Full evaluation: logs/evaluation.json (vispec.eval.train.edit.evaluate_edit).")
    extras = {"logs/transformer.jsonl": lambda path: shutil.copy(os.path.join(cfg.edit, "train_log.jsonl"), path)}
    if cfg.evaluation:
        extras["logs/evaluation.json"] = lambda path: shutil.copy(cfg.evaluation, path)
    if os.path.isdir(os.path.join(base, "clip")):
        extras["clip"] = lambda path: shutil.copytree(os.path.join(base, "clip"), path)
    info = {"transformer": record, "init_from": cfg.init_from}
    return write_pipeline_folder(pipe, cfg.out, card, info, record_title="Training record", extras=extras)
