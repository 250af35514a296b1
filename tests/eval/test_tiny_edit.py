"""tiny-edit (:mod:`vispec.eval.train.edit`): its vocabulary is initialised from tiny-t2i by token meaning, its
training sequences follow the dual-panel layout (and ``UnifiedTokenModel.condition(source=...)`` builds the same
prompts), its config names bad flags, and the embedded folder loads by name."""

from __future__ import annotations

import json
import os

import pytest
import torch

pytest.importorskip("skimage", reason="the scene pairs need the train extra (scikit-image)")

from vispec.eval.bench.scene_edits import EDIT_WORDS, INSTRUCTION_WORDS  # noqa: E402
from vispec.eval.train.configs import EditAssembleConfig, EditTrainConfig  # noqa: E402
from vispec.eval.train.edit import (batch_pairs, edit_layout, edit_tokenizer, edit_vocabulary, image_rows,  # noqa: E402
                                    init_from_t2i, load_t2i, panel_prefix, panel_tokens, token_mapping)


@pytest.fixture(scope="module")
def t2i():
    return load_t2i("tiny-t2i")


@pytest.fixture(scope="module")
def new(t2i):
    """tiny-edit's tokenizer and vocabulary over the embedded tiny-t2i's codes."""
    _, _, old_vocab, _ = t2i
    tokenizer = edit_tokenizer()
    return tokenizer, edit_vocabulary(tokenizer, old_vocab["vocab_size"] - old_vocab["code_offset"])


@pytest.fixture(scope="module")
def downsample(t2i):
    """The embedded tiny-t2i VQ's pixels per code (its pipeline config's ``downsample``)."""
    with open(os.path.join(t2i[3], "model_index.json")) as handle:
        return json.load(handle)["downsample"]


def test_tokenizer_holds_every_instruction_word(t2i, new):
    _, _, old_vocab, _ = t2i
    tokenizer, vocab = new
    ids = tokenizer(" ".join(INSTRUCTION_WORDS))["input_ids"]
    assert tokenizer.unk_token_id not in ids and len(ids) == len(INSTRUCTION_WORDS)
    codes = old_vocab["vocab_size"] - old_vocab["code_offset"]  # tiny-t2i's VQ codes, kept by tiny-edit
    assert vocab["image_start"] == len(tokenizer) and vocab["vocab_size"] == vocab["code_offset"] + codes


def test_mapping_pairs_tokens_by_meaning(t2i, new):
    _, old_tokenizer, old_vocab, _ = t2i
    tokenizer, vocab = new
    mapping = token_mapping(old_tokenizer, old_vocab, tokenizer, vocab)
    old_words, new_words = old_tokenizer.get_vocab(), tokenizer.get_vocab()
    for word, i in new_words.items():
        if word in old_words:
            assert mapping[i] == old_words[word], word
        else:
            assert i not in mapping and word in EDIT_WORDS, word
    for key in ("image_start", "image_end", "end_of_row"):
        assert mapping[vocab[key]] == old_vocab[key]
    assert mapping[vocab["resolution_base"] + 8] == old_vocab["resolution_base"] + 8
    last = vocab["vocab_size"] - vocab["code_offset"] - 1
    assert mapping[vocab["code_offset"] + last] == old_vocab["code_offset"] + last
    assert len(mapping) == old_vocab["vocab_size"]  # every tiny-t2i token has its place
    with pytest.raises(ValueError, match="codes"):
        token_mapping(old_tokenizer, old_vocab, tokenizer, edit_vocabulary(tokenizer, 256))


def test_init_copies_rows_by_meaning_and_every_other_weight(t2i, new):
    model_t2i, old_tokenizer, old_vocab, _ = t2i
    tokenizer, vocab = new
    model, mapping = init_from_t2i(model_t2i, old_tokenizer, old_vocab, tokenizer, vocab)
    assert model.config.max_position_embeddings == 1024 and model.config.vocab_size == vocab["vocab_size"]
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        got, ref = model.get_parameter(name), model_t2i.get_parameter(name)
        for i, j in mapping.items():
            assert torch.equal(got[i], ref[j]), (name, i, j)
        fresh = [i for i in range(vocab["vocab_size"]) if i not in mapping]
        assert fresh and all(not any(torch.equal(got[i], r) for r in ref) for i in fresh)
    ref_state = model_t2i.state_dict()
    for key, value in model.state_dict().items():
        if key not in ("model.embed_tokens.weight", "lm_head.weight"):
            assert torch.equal(value, ref_state[key]), key


@pytest.mark.parametrize("side", [16, 8])  # downsample-4 and downsample-8 VQs
def test_sequences_follow_the_dual_panel_layout(new, side):
    tokenizer, vocab = new
    gen = torch.Generator().manual_seed(0)
    source, target = torch.randint(512, (2, side, side), generator=gen), torch.randint(512, (2, side, side), generator=gen)
    tokens = panel_tokens(64 // side)
    instructions = [tokenizer("make the red square blue")["input_ids"], tokenizer("add a red circle")["input_ids"]]
    batch = batch_pairs(instructions, source, target, vocab, tokenizer.pad_token_id, torch.tensor([False, True]))
    prefix = panel_prefix(vocab)
    assert prefix == [vocab["image_start"], vocab["resolution_base"] + 8, vocab["resolution_base"] + 4]
    source_ids, _ = image_rows(source, vocab)
    target_ids, targets = image_rows(target, vocab)
    assert source_ids.shape[1] == tokens == side * (side + 1) and int((source_ids == vocab["end_of_row"]).sum()) == 2 * side
    first = instructions[0] + prefix + source_ids[0].tolist() + target_ids[0].tolist()[:-1]
    assert batch["input_ids"][0].tolist() == first
    dropped = batch["input_ids"][1][batch["attention_mask"][1].bool()].tolist()
    assert dropped == prefix + source_ids[1].tolist() + target_ids[1].tolist()[:-1]  # no instruction
    assert int(batch["position_ids"][1][batch["attention_mask"][1].bool()][0]) == 0
    assert torch.equal(batch["targets"], targets) and targets.shape == (2, tokens)
    # the logits at `first` predict the first target token: it sits right after the source panel
    assert int(batch["first"]) == batch["input_ids"].shape[1] - tokens


def test_the_decoders_condition_is_the_training_layout(t2i, new, downsample):
    """``UnifiedTokenModel.condition(source=...)`` (the pipeline side) builds the prompts training saw."""
    from vispec.models.unified import UnifiedTokenModel
    from vispec.models.unified_families import chameleon_backbone

    model_t2i, old_tokenizer, old_vocab, _ = t2i
    tokenizer, vocab = new
    model, _ = init_from_t2i(model_t2i, old_tokenizer, old_vocab, tokenizer, vocab)
    layout = edit_layout(vocab, downsample)
    wrapped = UnifiedTokenModel(chameleon_backbone(model, layout), layout, cfg_mode="image_start")
    assert (layout.rows, layout.cols) == (64 // downsample, 64 // downsample)
    source = torch.randint(512, (1, layout.rows, layout.cols), generator=torch.Generator().manual_seed(1))
    ids, tokens = image_rows(source, vocab)
    instruction = tokenizer("remove the blue square")["input_ids"]
    condition = wrapped.condition([instruction], source=tokens)
    assert condition.prompts[0].tolist() == instruction + panel_prefix(vocab) + ids[0].tolist()
    assert condition.unconditional[0].tolist() == panel_prefix(vocab) + ids[0].tolist()


@pytest.mark.parametrize("kwargs, flag", [({"num_pairs": 0}, "num_pairs"), ({"instruction_dropout": 1.0}, "instruction_dropout"),
                                          ({"max_minutes": -1.0}, "max_minutes"), ({"init_from": "no-such-model"}, "init_from")])
def test_config_names_bad_fields(kwargs, flag):
    with pytest.raises(ValueError, match=flag):
        EditTrainConfig(**kwargs).validate()


def test_assemble_config_needs_a_trained_folder(tmp_path):
    with pytest.raises(ValueError, match="edit"):
        EditAssembleConfig(edit=str(tmp_path / "missing"), out=str(tmp_path / "out")).validate()


def test_embedded_folder_loads_by_name():
    from vispec.pipelines import EMBEDDED_MODELS, UnifiedImagePipeline, resolve_model_path

    assert "vispec/tiny-edit" in EMBEDDED_MODELS
    folder = resolve_model_path("vispec/tiny-edit")
    pipe = UnifiedImagePipeline.from_pretrained("vispec/tiny-edit")
    with open(os.path.join(folder, "model_index.json")) as handle:
        index = json.load(handle)
    with open(os.path.join(folder, "README.md")) as handle:
        record = handle.read()
    vocab = edit_vocabulary(pipe.tokenizer, 512)
    assert index["image_start_id"] == vocab["image_start"] and index["code_offset"] == vocab["code_offset"]
    assert index["eol_id"] == vocab["end_of_row"] and index["resolution_token_base"] == vocab["resolution_base"]
    assert index["image_end_ids"] == [vocab["image_end"]] and index["cfg_mode"] == "image_start"
    assert (index["default_height"], index["default_width"], index["prompt_template"]) == (64, 64, "{prompt}")
    assert pipe.transformer.config.max_position_embeddings == 1024
    assert pipe.transformer.config.vocab_size == vocab["vocab_size"]
    assert pipe.tokenizer.unk_token_id not in pipe.tokenizer(" ".join(INSTRUCTION_WORDS))["input_ids"]
    assert os.path.isfile(os.path.join(folder, "logs", "transformer.jsonl")) and "tiny-t2i" in record


@pytest.mark.slow
def test_demo_edit_section_writes_grid_and_scores(tmp_path, monkeypatch):
    from vispec.eval import demo

    monkeypatch.setattr(demo, "DEMO_EDIT_PAIRS", 2)
    monkeypatch.setattr(demo, "DEMO_EDIT_METHODS", ("ar", "iad"))
    report = demo.run_edit_demo(str(tmp_path))
    assert os.path.isfile(tmp_path / "edit_grid.png") and len(report["instructions"]) == 2
    assert report["header"][-3:] == ["checks", "strict", "kept"]
    for row in report["methods"].values():
        assert 0.0 <= row["checks"] <= 1.0 and 0.0 <= row["accuracy"] <= 1.0 and 0.0 <= row["source_kept"] <= 1.0
    assert report["methods"]["ar"]["step_compression"] == 1.0 and report["methods"]["iad"]["step_compression"] > 1.0
