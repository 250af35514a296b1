"""Runs one case of tests/pinned_grid.py through vispec's API and records tokens, NFE and statistics."""

from __future__ import annotations

import functools

import torch

from pinned_grid import SAMPLINGS, record


@functools.lru_cache(maxsize=None)
def _c2i_pipe():
    from vispec.pipelines import LlamaGenPipeline

    pipe = LlamaGenPipeline.from_pretrained("vispec/tiny-c2i")
    pipe.set_progress_bar_config(disable=True)
    return pipe


@functools.lru_cache(maxsize=None)
def _tiny_gpt():
    from helpers import tiny_gpt

    model = tiny_gpt(vocab_size=16, block_size=16, num_classes=3, class_dropout_prob=0.1, seed=0)
    drafter = tiny_gpt(vocab_size=16, block_size=16, num_classes=3, class_dropout_prob=0.1, dim=16, n_layer=1, seed=1)
    codebook = torch.randn(16, 8, generator=torch.Generator().manual_seed(7))
    return model, drafter, codebook


@functools.lru_cache(maxsize=None)
def _mdlm_pipe():
    import vispec.models.llada  # noqa: F401 (diffusers resolves the model class by module)
    from vispec.pipelines import MaskedDiffusionLMPipeline

    pipe = MaskedDiffusionLMPipeline.from_pretrained("vispec/tiny-mdlm")
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _gens(seeds):
    return [torch.Generator().manual_seed(s) for s in seeds]


def run_case(case: dict, results: dict) -> None:
    if case["model"] == "tiny-mdlm":
        return _run_text(case, results)
    from vispec.decoding import DecodingConfig, decode
    from vispec.decoding.rules import build_rule
    from vispec.models.llamagen_gpt import LlamaGenCondition
    from vispec.sampling import SamplingConfig

    sampling = SamplingConfig(**SAMPLINGS[case["sampling"]])
    decoding = DecodingConfig.parse(case["decoding"])
    condition = LlamaGenCondition(class_labels=torch.tensor(case["labels"]))
    if case["model"] == "tiny-c2i":
        pipe = _c2i_pipe()
        model, drafter = pipe.transformer, pipe.drafter
        rule = pipe.acceptance_rule(case["acceptance"])
    else:
        model, drafter, codebook = _tiny_gpt()
        rule = build_rule(case["acceptance"], codebook=codebook, embeddings=model.tok_embeddings.weight)
    out = decode(model, condition, num_tokens=model.num_image_tokens, sampling=sampling, decoding=decoding,
                 generator=_gens(case["seeds"]), acceptance=rule, drafter=drafter)
    extra = {"accepted": out.stats.accepted_drafts.tolist(), "method": out.method}
    if out.stats.tv_mean is not None:
        extra["tv_mean"] = out.stats.tv_mean.tolist()
    record(results, case, out.tokens, out.stats.nfe.tolist(), extra)


def _run_text(case: dict, results: dict) -> None:
    from vispec.dllm import decode, make_scheduler

    pipe = _mdlm_pipe()
    ids, mask = pipe.prepare_input_ids(prompt=case["prompts"])
    scheduler = make_scheduler(case["strategy"], **case["settings"])
    out = decode(pipe.model, ids, mask, scheduler=scheduler, gen_length=32, block_length=8,
                 steps=32 if scheduler.fixed_steps else None, temperature=case["temperature"],
                 guidance_scale=case["llada_cfg"] + 1, cache=case["cache"], early_stop_eos=True,
                 eos_token_id=pipe.tokenizer.eos_token_id, generator=_gens(case["seeds"]))
    record(results, case, out.tokens, out.stats.nfe.tolist(), {"counted": out.stats.tokens.tolist()})
