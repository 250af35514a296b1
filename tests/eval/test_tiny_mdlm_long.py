"""tiny-mdlm-long: the embedded long-canvas masked diffusion LM, and the trainer options that made it
(``init_from`` fine-tuning, the canvas length mix, block-wise greedy evaluation)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from vispec.eval.bench.text_tasks import split_items
from vispec.eval.train.mdlm import MDLMTrainConfig, decode_low_confidence, encode_items, train_mdlm
from vispec.eval.train.tokenizer import decode_answer, eot_token_id
from vispec.pipelines import MaskedDiffusionLMPipeline
from vispec.pipelines.embedded import resolve_model_path


def test_embedded_tiny_mdlm_long_decodes_at_gen_length_256():
    pipe = MaskedDiffusionLMPipeline.from_pretrained("vispec/tiny-mdlm-long")
    assert pipe.config.default_gen_length == 256 and pipe.config.default_block_length == 32
    assert os.path.isfile(os.path.join(resolve_model_path("tiny-mdlm-long"), "README.md"))
    out = pipe(prompt="reverse the letters : k d m a")  # the saved defaults: gen length 256, block 32
    assert out.sequences.shape == (1, 256) and isinstance(out.texts[0], str) and out.texts[0]
    assert not (out.sequences == pipe.model.config.mask_token_id).any()
    assert out.stats[0]["nfe"] < 256  # threshold decoding commits the EOS padding several tokens at a time


@pytest.fixture(scope="module")
def tiny_mdlm():
    return MaskedDiffusionLMPipeline.from_pretrained("vispec/tiny-mdlm")


@pytest.mark.slow
def test_blocks_and_stop_ids_keep_the_decoded_text(tiny_mdlm):
    model, tok = tiny_mdlm.model, tiny_mdlm.tokenizer
    items = split_items("arithmetic", "test", 3)
    ids, mask = encode_items(tok, items, 32, with_answers=False)
    full = decode_low_confidence(model, ids, mask, 32)
    stopped = decode_low_confidence(model, ids, mask, 32, stop_ids=(tok.eos_token_id, eot_token_id(tok)))
    assert [decode_answer(tok, r.tolist()) for r in full] == [decode_answer(tok, r.tolist()) for r in stopped]
    assert not (full == model.config.mask_token_id).any()
    blocks = decode_low_confidence(model, ids, mask, 32, block_length=8)
    assert not (blocks == model.config.mask_token_id).any()
    with pytest.raises(ValueError, match="block_length"):
        decode_low_confidence(model, ids, mask, 32, block_length=5)


@pytest.mark.slow
def test_init_from_and_length_mix(tmp_path, tiny_mdlm):
    cfg = MDLMTrainConfig(out=str(tmp_path / "run"), init_from="vispec/tiny-mdlm", d_model=32, steps=3, batch_size=2,
                          warmup=1, log_every=1, eval_every=2, eval_n=1, eval_all_tasks=True, long_answer_length=64,
                          long_every=2, long_batch_size=1, final_eval_n=1, eval_answer_length=64, eval_block_length=32, threads=0)
    metrics = train_mdlm(cfg)
    assert metrics["parameters"] == sum(p.numel() for p in tiny_mdlm.model.parameters())  # the loaded model, not d_model=32
    assert tiny_mdlm.tokenizer.get_vocab() == json.load(open(tmp_path / "run" / "tokenizer" / "tokenizer.json"))["model"]["vocab"]
    rows = [json.loads(line) for line in open(tmp_path / "run" / "train_log.jsonl")]
    assert [r["answer_length"] for r in rows if "loss" in r] == [32, 64, 32]
    assert {r["eval"]["task"] for r in rows if "eval" in r} == {"arithmetic", "sort", "reverse"}
    assert {k: (v["gen_length"], v["block_length"]) for k, v in metrics["eval"].items()} == {
        "arithmetic": (64, 32), "sort": (64, 32), "reverse": (64, 32)}
    with torch.no_grad():  # fine-tuned from the embedded weights: a few steps move them only a little
        from vispec.models.llada import LLaDAModelLM

        trained = LLaDAModelLM.from_pretrained(str(tmp_path / "run" / "transformer"))
        a, b = (torch.cat([p.flatten() for p in m.parameters()]) for m in (trained, tiny_mdlm.model))
        assert (a - b.float()).norm() < 0.1 * b.float().norm()


@pytest.mark.parametrize("kwargs, words", [
    ({"long_every": 2}, "long_every"),
    ({"long_answer_length": 64}, "long_answer_length"),
    ({"eval_block_length": 5}, "eval_block_length"),
    ({"long_batch_size": -1}, "long_batch_size"),
    ({"init_from": "/nonexistent/folder"}, "init_from"),
])
def test_bad_training_options(tmp_path, kwargs, words):
    with pytest.raises(ValueError, match=words):
        train_mdlm(MDLMTrainConfig(out=str(tmp_path / "bad"), steps=1, batch_size=1, final_eval_n=0, threads=0, **kwargs))


@pytest.mark.slow
def test_assembled_card_and_record_follow_every_fine_tuning_stage(tmp_path):
    """A model fine-tuned in stages (each from the previous run's folder) is assembled with every stage on its card,
    every stage's record and every stage's loss log."""
    from vispec.eval.train.assemble import MDLMAssembleConfig, assemble_mdlm

    common = dict(steps=2, batch_size=2, warmup=1, log_every=1, eval_every=0, final_eval_n=1, threads=0)
    train_mdlm(MDLMTrainConfig(out=str(tmp_path / "one"), init_from="vispec/tiny-mdlm", lr=1e-4, **common))
    train_mdlm(MDLMTrainConfig(out=str(tmp_path / "two"), init_from=str(tmp_path / "one"), lr=5e-5,
                               task_weights=(0.5, 0.25, 0.25), **common))
    assemble_mdlm(MDLMAssembleConfig(trained=str(tmp_path / "two"), out=str(tmp_path / "pipe"), block_length=8))
    card = (tmp_path / "pipe" / "README.md").read_text()
    assert "Stage 1 of 2: fine-tuned from vispec/tiny-mdlm" in card and "at lr 0.0001" in card
    assert f"Stage 2 of 2: fine-tuned from {tmp_path / 'one'}" in card and "'arithmetic': 0.5" in card
    record = json.loads(card.split("```json", 1)[1].split("```", 1)[0])
    assert [s["config"]["lr"] for s in record["stages"]] == [1e-4, 5e-5]
    assert all((tmp_path / "pipe" / "logs" / f"stage-{k}.jsonl").is_file() for k in (1, 2))
