"""The tiny-t2i training chain, a few steps each: scene VQ, the unified-token decoder, the assembled pipeline (with
its CLIP and logs) loading and generating at both trained sizes."""

from __future__ import annotations

import json
import os

import pytest
import torch

pytest.importorskip("skimage", reason="the scene trainers need the train extra (scikit-image)")

from vispec.eval.train.assemble import T2IAssembleConfig, assemble_t2i  # noqa: E402
from vispec.eval.train.clip import CLIPTrainConfig, train_clip  # noqa: E402
from vispec.eval.train.t2i import T2ITrainConfig, batch_sequences, caption_tokenizer, t2i_vocabulary, train_t2i  # noqa: E402
from vispec.eval.train.vq import VQTrainConfig, train_vq  # noqa: E402
from vispec.pipelines import UnifiedImagePipeline  # noqa: E402


@pytest.fixture(scope="module")
def assembled(tmp_path_factory):
    root = tmp_path_factory.mktemp("t2i")
    train_vq(VQTrainConfig(out=str(root / "vq"), data="scenes", steps=2, batch_size=2, codebook_size=32, eval_images=4,
                           log_every=1, restart_every=2))
    metrics = train_t2i(T2ITrainConfig(vq=str(root / "vq"), out=str(root / "t2i"), num_sequences=8, steps=2, batch_size=2,
                                       hidden_size=32, layers=1, heads=2, log_every=1))
    train_clip(CLIPTrainConfig(out=str(root / "clip"), steps=2, batch_size=4, hidden_size=32, vision_layers=1, text_layers=1,
                               heads=2, projection_dim=16, eval_candidates=8, log_every=1))
    assemble_t2i(T2IAssembleConfig(vq=str(root / "vq"), t2i=str(root / "t2i"), clip=str(root / "clip"), out=str(root / "pipe")))
    return root, metrics


def test_vocabulary_is_text_then_layout_then_codes():
    tokenizer = caption_tokenizer()
    vocab = t2i_vocabulary(tokenizer, num_codes=32)
    assert vocab["image_start"] == len(tokenizer) and vocab["code_offset"] == vocab["resolution_base"] + 9
    assert vocab["vocab_size"] == vocab["code_offset"] + 32


def test_sequences_are_left_padded_captions_then_prefix_then_rows():
    tokenizer = caption_tokenizer()
    vocab = t2i_vocabulary(tokenizer, num_codes=32)
    captions = [tokenizer("two red circles")["input_ids"], tokenizer("a red circle left of a blue square")["input_ids"]]
    codes = torch.randint(32, (2, 16, 24))
    batch = batch_sequences(captions, codes, (64, 96), vocab, tokenizer.pad_token_id, torch.tensor([False, True]))
    first = int(batch["first"])
    prefix = [vocab["image_start"], vocab["resolution_base"] + 4, vocab["resolution_base"] + 6]
    for row in range(2):
        assert batch["input_ids"][row, first - 2 : first + 1].tolist() == prefix
    assert batch["attention_mask"][1, : first - 2].sum() == 0  # the dropped caption is all padding
    assert batch["position_ids"][0, first - 2 - len(captions[0])] == 0  # a prompt starts at position 0
    targets = batch["targets"].view(2, 16, 25)
    assert (targets[:, :, -1] == 32).all() and torch.equal(targets[:, :, :-1], codes)  # end of row after each row


def test_the_chain_assembles_a_pipeline_that_generates_both_sizes(assembled):
    root, metrics = assembled
    assert metrics["vocabulary"]["vocab_size"] == metrics["vocabulary"]["code_offset"] + 32
    folder = root / "pipe"
    assert {"clip", "logs", "README.md", "model_index.json"} <= set(os.listdir(folder))
    assert sorted(os.listdir(folder / "logs")) == ["transformer.jsonl", "vqvae.jsonl"]
    with open(folder / "logs" / "transformer.jsonl") as handle:
        assert [json.loads(line)["step"] for line in handle][:2] == [0, 1]
    pipe = UnifiedImagePipeline.from_pretrained(str(folder))
    pipe.set_progress_bar_config(disable=True)
    for height, width in ((64, 64), (64, 96)):
        out = pipe("two red circles", height=height, width=width, decoding="mc-sjd", output_type="pt",
                   generator=torch.Generator().manual_seed(0))
        assert out.images.shape == (1, 3, height, width)


def test_training_continues_from_an_assembled_pipeline(assembled, tmp_path):
    """``init_from``: the decoder starts from the pipeline's weights (the same VQ and layout); another architecture
    or another VQ is refused, naming the flag."""
    root, _ = assembled
    common = dict(vq=str(root / "vq"), num_sequences=8, batch_size=2, hidden_size=32, layers=1, heads=2, log_every=1,
                  init_from=str(root / "pipe"), warmup=1)
    start = UnifiedImagePipeline.from_pretrained(str(root / "pipe")).transformer.state_dict()
    train_t2i(T2ITrainConfig(out=str(tmp_path / "next"), steps=1, lr=1e-12, **common))
    from transformers import ChameleonForConditionalGeneration

    continued = ChameleonForConditionalGeneration.from_pretrained(str(tmp_path / "next")).state_dict()
    key = "model.layers.0.mlp.down_proj.weight"
    assert torch.allclose(continued[key], start[key], atol=1e-6)  # a 1e-12 step from the pipeline's weights
    with open(tmp_path / "next" / "train_config.json") as handle:  # the card keeps every stage and its loss log
        metrics = json.load(handle)["metrics"]
    first = metrics["init_from_record"]
    assert first["config"]["out"] == str(root / "t2i") and first["config"]["init_from"] == ""
    assert metrics["total_train_minutes"] == round(first["metrics"]["train_minutes"] + metrics["train_minutes"], 1)
    assemble_t2i(T2IAssembleConfig(vq=str(root / "vq"), t2i=str(tmp_path / "next"), clip="", out=str(tmp_path / "pipe2")))
    assert sorted(os.listdir(tmp_path / "pipe2" / "logs")) == ["transformer-init.jsonl", "transformer.jsonl", "vqvae.jsonl"]
    with open(tmp_path / "pipe2" / "logs" / "transformer-init.jsonl") as handle:
        assert [json.loads(line)["step"] for line in handle][:2] == [0, 1]  # stage one's log
    with pytest.raises(ValueError, match="layers 2 differs from the 1 of init_from"):
        train_t2i(T2ITrainConfig(out=str(tmp_path / "bad"), steps=1, **{**common, "layers": 2}))
    train_vq(VQTrainConfig(out=str(tmp_path / "vq16"), data="scenes", steps=1, batch_size=2, codebook_size=16, eval_images=2))
    with pytest.raises(ValueError, match="init_from .* decodes 32 codes, vq .* has 16"):
        train_t2i(T2ITrainConfig(out=str(tmp_path / "bad"), steps=1, **{**common, "vq": str(tmp_path / "vq16")}))
    with pytest.raises(ValueError, match="init_from .* is a LlamaGenPipeline, not a UnifiedImagePipeline"):
        T2ITrainConfig(out=str(tmp_path / "bad"), **{**common, "init_from": "tiny-c2i"}).validate()


def test_bf16_autocast_trains_like_float32_and_is_refused_where_it_would_be_slower(assembled, tmp_path, monkeypatch):
    """``bf16``: the same first step's loss as float32 up to bfloat16 rounding, float32 weights saved; a CPU without
    native bfloat16 products refuses it before any work, naming the field."""
    root, _ = assembled
    common = dict(vq=str(root / "vq"), num_sequences=8, steps=1, batch_size=2, hidden_size=32, layers=1, heads=2,
                  log_every=1)
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        first = {}
        for bf16 in (False, True):
            train_t2i(T2ITrainConfig(out=str(tmp_path / f"bf16-{bf16}"), bf16=bf16, **common))
            with open(tmp_path / f"bf16-{bf16}" / "train_log.jsonl") as handle:
                first[bf16] = json.loads(handle.readline())["loss"]
        assert first[True] == pytest.approx(first[False], rel=0.02)
        from transformers import ChameleonForConditionalGeneration

        saved = ChameleonForConditionalGeneration.from_pretrained(str(tmp_path / "bf16-True"))
        assert {p.dtype for p in saved.parameters()} == {torch.float32}
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    with pytest.raises(ValueError, match="bf16: this CPU has no native bfloat16"):
        T2ITrainConfig(out=str(tmp_path / "slow"), bf16=True, **common).validate()
    from vispec.eval.train.configs import EditTrainConfig

    with pytest.raises(ValueError, match="bf16: this CPU has no native bfloat16"):  # tiny-edit's trainer too
        EditTrainConfig(out=str(tmp_path / "slow-edit"), bf16=True).validate()
