"""``vispec train MODEL``: the embedded models' trainers and assemblers, flags from their config dataclasses.

The flags come from :mod:`vispec.eval.train.configs` and are checked there (``validate``) without torch; the trainer's
module (torch, diffusers, transformers, the models) is imported only once the checks pass and the command runs."""

from __future__ import annotations

import argparse
import importlib
import json

from vispec.cli.args import add_config_args, config_flag, config_from_args
from vispec.cli.paths import check_output_folder

CONFIGS = "vispec.eval.train.configs"  # every trainer's config class, torch-free

TRAINERS = {
    # name: (trainer module, config class (in CONFIGS, re-exported by the trainer module), train function, help)
    "vq": ("vispec.eval.train.vq", "VQTrainConfig", "train_vq", "a VQ tokenizer: tiny-c2i's (--data photos) or tiny-t2i's (--data scenes)"),
    "evaluator": ("vispec.eval.train.evaluator", "EvaluatorTrainConfig", "train_evaluator", "the tiny-c2i crop classifier (accuracy, FID features)"),
    "gpt": ("vispec.eval.train.gpt", "GPTTrainConfig", "train_gpt", "the tiny-c2i LlamaGen GPT (needs a trained VQ)"),
    "assemble": ("vispec.eval.train.assemble", "AssembleConfig", "assemble", "write the trained parts as the embedded tiny-c2i pipeline"),
    "drafter": ("vispec.eval.train.drafter", "DrafterTrainConfig", "train_drafter", "the tiny-c2i-drafter GPT, distilled from tiny-c2i's samples"),
    "gad-drafter": ("vispec.eval.train.gad", "GADDrafterTrainConfig", "train_gad_drafter", "the tiny-c2i GAD block drafter (causal over masked inputs by default; --attention bidirectional), distilled from tiny-c2i's samples"),
    "assemble-gad-drafter": ("vispec.eval.train.gad", "GADDrafterAssembleConfig", "assemble_gad_drafter", "add a trained GAD drafter to a pipeline folder (gad_drafter/ and model_index.json)"),
    "assemble-drafter": ("vispec.eval.train.assemble", "DrafterAssembleConfig", "assemble_drafter", "add a trained drafter (and LANTERN's neighbour table) to a pipeline folder"),
    "t2i": ("vispec.eval.train.t2i", "T2ITrainConfig", "train_t2i", "the tiny-t2i unified-token text-to-image decoder (needs a scene VQ)"),
    "clip": ("vispec.eval.train.clip", "CLIPTrainConfig", "train_clip", "the tiny-t2i CLIP (contrastive, attribute-swap hard negatives) for CLIPScore and retrieval"),
    "assemble-t2i": ("vispec.eval.train.assemble", "T2IAssembleConfig", "assemble_t2i", "write the trained parts as the embedded tiny-t2i pipeline"),
    "edit": ("vispec.eval.train.edit", "EditTrainConfig", "train_edit", "the tiny-edit instruction image editor (dual-panel), fine-tuned from tiny-t2i on scene pairs"),
    "assemble-edit": ("vispec.eval.train.assemble", "EditAssembleConfig", "assemble_edit", "write the trained editor as the embedded tiny-edit pipeline"),
    "mdlm": ("vispec.eval.train.mdlm", "MDLMTrainConfig", "train_mdlm", "a masked diffusion LM: tiny-mdlm (task suite, tokenizer, SFT), or tiny-mdlm-long fine-tuned from it (--init-from)"),
    "assemble-mdlm": ("vispec.eval.train.assemble", "MDLMAssembleConfig", "assemble_mdlm", "write a trained mdlm as an embedded pipeline (tiny-mdlm, tiny-mdlm-long)"),
    "llada2": ("vispec.eval.train.llada2", "LLaDA2TrainConfig", "train_llada2", "tiny-llada2: tiny-mdlm upcycled to the LLaDA2 MoE layout, fine-tuned with the block-diffusion objective"),
    "assemble-llada2": ("vispec.eval.train.llada2", "LLaDA2AssembleConfig", "assemble_llada2", "write a trained llada2 as the embedded tiny-llada2 pipeline"),
    "filter": ("vispec.eval.train.filter", "FilterTrainConfig", "train_filter", "a Learn2PD filter for a masked diffusion LM (its own decodes as data), saved in a copy of its pipeline folder"),
}


def _run(config_cls: type, module: str, func_name: str, args: argparse.Namespace) -> int:
    """Check every flag (the config's ``validate``, errors naming the flag) and ``--out``, then import the trainer's
    module and train."""
    config = config_from_args(config_cls, args)
    config.validate(lambda field: config_flag(config_cls, field))  # before hours of training, and before torch
    check_output_folder(getattr(args, "out", None), "--out")
    train = getattr(importlib.import_module(module), func_name)
    print(json.dumps(train(config), indent=2))
    return 0


def add_train(sub: argparse._SubParsersAction) -> None:
    train = sub.add_parser("train", help="train the embedded models (needs vispec[train])")
    trainers = train.add_subparsers(dest="subcommand", metavar="MODEL")
    for name, (module, config_name, func_name, help_text) in TRAINERS.items():
        # the trainer's flags are built only when its name is on the command line (its module only when it runs)
        trainers.add_parser(name, help=help_text, build=lambda parser, module=module, config_name=config_name,
                            func_name=func_name: _add_trainer(parser, module, config_name, func_name))


def _add_trainer(parser: argparse.ArgumentParser, module: str, config_name: str, func_name: str) -> None:
    """The flags of one trainer (from its config dataclass in :data:`CONFIGS`) and the command that checks them and
    runs ``module.func_name``."""
    config_cls = getattr(importlib.import_module(CONFIGS), config_name)
    add_config_args(parser, config_cls)
    parser.set_defaults(func=lambda args: _run(config_cls, module, func_name, args))
