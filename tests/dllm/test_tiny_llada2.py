"""The embedded tiny-llada2 (a trained LLaDA2-layout block-diffusion MoE): it loads by name into vispec's pipeline,
decodes the embedded tasks at its saved defaults (LLaDA2's own rule), gives diffusers' ``LLaDA2Pipeline`` tokens over
the same components, and vispec's threshold rule with the exact prefix cache gives the uncached run's tokens."""

from __future__ import annotations

import os

import pytest
import torch
from diffusers import BlockRefinementScheduler, LLaDA2Pipeline

from vispec.dllm import TokenEditingScheduler
from vispec.eval.bench.text_tasks import get_task, split_items
from vispec.pipelines.embedded import resolve_model_path


@pytest.fixture(scope="module")
def pipe(tiny_llada2):
    return tiny_llada2


def test_tiny_llada2_loads_with_its_defaults(pipe):
    assert type(pipe.model).__name__ == "LLaDA2MoeModelLM" and isinstance(pipe.scheduler, TokenEditingScheduler)
    c = pipe.model.config
    assert (pipe.config.default_gen_length, pipe.config.default_block_length, c.block_length) == (32, 32, 32)
    assert c.num_experts > c.num_experts_per_tok >= 2 and c.first_k_dense_replace < c.num_hidden_layers
    folder = resolve_model_path("tiny-llada2")
    assert os.path.isfile(os.path.join(folder, "README.md")) and os.path.isfile(os.path.join(folder, "logs", "model.jsonl"))


def test_tiny_llada2_decodes_as_diffusers_llada2_pipeline(pipe):
    """Eight arithmetic problems in one batch at the saved defaults (prefix cache): most are solved (the model scores
    ~73% strict-match), and the first two rows' tokens are diffusers' LLaDA2Pipeline's at its call defaults (gen length
    32) run on each problem alone."""
    task = get_task("arithmetic")
    items = split_items(task, "test", 8)
    out = pipe(prompt=[item.prompt for item in items], cache="prefix")
    assert sum(task.score(text, item)["strict_match"] for text, item in zip(out.texts, items)) >= 4
    reference = LLaDA2Pipeline(model=pipe.model, scheduler=BlockRefinementScheduler(), tokenizer=pipe.tokenizer)
    reference.set_progress_bar_config(disable=True)
    mask, eos = pipe.tokenizer.mask_token_id, pipe.tokenizer.eos_token_id
    for row, item in zip(out.sequences[:2], items):
        theirs = reference(prompt=item.prompt, gen_length=32, output_type="seq").sequences[0]
        assert torch.equal(row, torch.where(theirs == mask, eos, theirs))  # vispec's early stop writes EOS there


def test_threshold_with_the_prefix_cache_matches_the_uncached_run(pipe):
    items = split_items("arithmetic", "test", 3)
    prompts = [item.prompt for item in items]
    runs = {cache: pipe(prompt=prompts, strategy="threshold", threshold=0.5, cache=cache) for cache in ("none", "prefix")}
    assert torch.equal(runs["none"].sequences, runs["prefix"].sequences)
    assert [s["nfe"] for s in runs["none"].stats] == [s["nfe"] for s in runs["prefix"].stats]
