"""tiny-llada2's trainer (:mod:`vispec.eval.train.llada2`): sparse upcycling of a dense LLaDA into the LLaDA2 MoE
layout preserves its function whatever the router picks, the block-diffusion batch is block-causal from each row's
first token, the loss of a block never sees a later block, and the trainer runs end to end (2 steps) on a tiny
dense model, writing a folder the assembler turns into a pipeline."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from vispec.eval.train.llada2 import (LLaDA2AssembleConfig, LLaDA2TrainConfig, assemble_llada2, block_causal_batch,
                                      block_diffusion_loss, train_llada2, upcycle_llada)
from vispec.eval.train.tokenizer import load_text_tokenizer
from vispec.models.llada import LLaDAModelLM
from vispec.pipelines import MaskedDiffusionLMPipeline
from vispec.pipelines.embedded import resolve_model_path


def tiny_dense(vocab: int = 111, mask: int = 5, eos: int = 3, pad: int = 0) -> LLaDAModelLM:
    torch.manual_seed(0)
    return LLaDAModelLM(d_model=32, n_heads=4, n_layers=2, mlp_hidden_size=64, vocab_size=vocab, embedding_size=vocab,
                        max_sequence_length=128, mask_token_id=mask, eos_token_id=eos, eot_token_id=4,
                        pad_token_id=pad, bos_token_id=2, init_std=0.2).eval()


def test_upcycled_model_computes_the_dense_function_whatever_the_router_picks():
    dense = tiny_dense()
    moe = upcycle_llada(dense, block_length=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                        first_k_dense_replace=1)
    c = moe.config
    assert (c.num_experts, c.num_shared_experts, c.moe_intermediate_size, c.first_k_dense_replace) == (4, 3, 16, 1)
    with torch.no_grad():  # any routing: random router weights and expert bias
        moe.model.layers[1].mlp.gate.weight.normal_(0, 1.0)
        moe.model.layers[1].mlp.gate.expert_bias.normal_(0, 1.0)
    ids = torch.randint(6, 111, (3, 20), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # a left-padded row
    bidirectional = mask.bool()[:, None, None, :] | torch.eye(20, dtype=torch.bool)
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        want = dense(ids, mask).logits
        got = moe(ids, attention_mask=bidirectional, position_ids=positions).logits
    real = mask.bool()
    assert torch.allclose(got[real], want[real], atol=1e-5, rtol=1e-5)
    # under its own (block-causal) attention the first block equals the dense model run on that block alone
    with torch.no_grad():
        block = moe(ids[1:, :8]).logits
        alone = dense(ids[1:, :8]).logits
    assert torch.allclose(block, alone, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kwargs, match", [(dict(moe_intermediate_size=48), "moe_intermediate_size must divide"),
                                           (dict(num_experts_per_tok=1), "num_experts_per_tok must lie in"),
                                           (dict(first_k_dense_replace=3), "first_k_dense_replace must lie in")])
def test_upcycling_refuses_what_would_not_preserve_the_function(kwargs, match):
    with pytest.raises(ValueError, match=match):
        upcycle_llada(tiny_dense(), **{"moe_intermediate_size": 16, **kwargs})


def test_block_causal_batch_counts_blocks_from_each_rows_first_token():
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]])
    block, positions, allowed = block_causal_batch(mask, 3)
    assert block.tolist() == [[-1, -1, 0, 0, 0, 1, 1], [0, 0, 0, 1, 1, 1, 2]]
    assert positions[0].tolist() == [0, 0, 0, 1, 2, 3, 4]
    a = allowed[:, 0]
    assert a[0, 5].tolist() == [False, False, True, True, True, True, True]  # sees block 0 and its own, no padding
    assert a[0, 2].tolist() == [False, False, True, True, True, False, False]  # block 0 never sees block 1
    assert a[0, 0].tolist() == [True] + [False] * 6  # a padded query sees itself only


def test_a_blocks_loss_never_sees_a_later_block():
    """The loss of the noised block is the same whatever the tokens after it (block-causal attention); the rows whose
    chosen block is the last one change when their own block's tokens change."""
    torch.manual_seed(0)
    moe = upcycle_llada(tiny_dense(), block_length=8, moe_intermediate_size=16)
    ids = torch.randint(6, 111, (8, 24), generator=torch.Generator().manual_seed(2))  # prompt 8, canvas 16: 2 blocks
    mask = torch.ones_like(ids)

    def loss(x):  # seed 5: rows 1, 5, 6 noise block 1, the others block 2
        return block_diffusion_loss(moe, x, mask, 16, torch.Generator().manual_seed(5), per_row=True)

    base = loss(ids)
    later = ids.clone()
    later[:, 16:] = torch.randint(6, 111, (8, 8), generator=torch.Generator().manual_seed(4))
    changed = loss(later)
    kept = torch.isclose(base, changed, atol=1e-6)
    assert kept.tolist() == [False, True, False, False, False, True, True, False]  # rows trained on block 1 keep theirs


@pytest.fixture
def dense_folder(tmp_path):
    """A trained-folder layout (``transformer/``, ``tokenizer/``) holding a tiny dense LLaDA with tiny-mdlm's
    tokenizer (its task vocabulary)."""
    tokenizer = os.path.join(resolve_model_path("tiny-mdlm"), "tokenizer")
    ids = load_text_tokenizer(tokenizer)
    tiny_dense(len(ids), ids.mask_token_id, ids.eos_token_id, ids.pad_token_id).save_pretrained(
        tmp_path / "dense" / "transformer")
    shutil.copytree(tokenizer, tmp_path / "dense" / "tokenizer")
    return str(tmp_path / "dense")


def test_trainer_runs_two_steps_and_assembles(tmp_path, dense_folder):
    cfg = LLaDA2TrainConfig(out=str(tmp_path / "run"), init_from=dense_folder, tasks=("arithmetic",), task_weights=(1.0,),
                            block_length=16, moe_intermediate_size=16, steps=2, batch_size=2, warmup=1, log_every=1,
                            checkpoint_every=1, eval_every=1, eval_n=2, eval_batch_size=2, initial_eval_n=1,
                            final_eval_n=1, threads=0)
    metrics = train_llada2(cfg)
    assert metrics["steps_done"] == 2 and set(metrics["eval"]) == {"arithmetic/llada2", "arithmetic/threshold"}
    assert set(metrics["initial_eval"]) == set(metrics["eval"]) and metrics["progress"][0]["step"] == 1
    rows = [json.loads(line) for line in open(tmp_path / "run" / "train_log.jsonl")]
    losses = [r for r in rows if "loss" in r]
    assert [r["step"] for r in losses] == [0, 1] and len(losses[0]["expert_load"]) == 1  # one MoE layer
    assert abs(sum(losses[0]["expert_load"][0]) - 1) < 1e-2
    record = json.load(open(tmp_path / "run" / "train_config.json"))
    assert record["config"]["init_from"] == dense_folder and record["metrics"]["parameters"] == metrics["parameters"]
    out = assemble_llada2(LLaDA2AssembleConfig(trained=str(tmp_path / "run"), out=str(tmp_path / "pipe")))
    assert {"model", "tokenizer", "scheduler", "README.md", "logs"} <= set(out["files"])
    pipe = MaskedDiffusionLMPipeline.from_pretrained(str(tmp_path / "pipe"))
    assert type(pipe.model).__name__ == "LLaDA2MoeModelLM" and pipe.config.default_block_length == 16
    assert pipe.model.config.block_length == 16 and pipe.config.default_gen_length == 32


@pytest.mark.parametrize("kwargs, match", [(dict(num_experts_per_tok=1), "num_experts_per_tok must be"),
                                           (dict(edit_noise=1.0), "edit_noise"),
                                           (dict(device="tpu"), "device must be 'cpu' or 'cuda"),
                                           (dict(init_from=""), "init_from must name a dense LLaDA"),
                                           (dict(init_from="no-such-model"), "init_from")])
def test_config_errors_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLaDA2TrainConfig(**kwargs).validate()
