"""Untrusted configs of unified-token models (issue 28, item 8): a transformer ``config.json`` that disagrees with
its safetensors weights (a 20M-code VQ, a 500k vocabulary, 100,000 layers) is one ``ValueError`` naming the config
field, its value and the weights', raised from the files' headers before any model is built or memory allocated:
when a tiny-t2i-style pipeline folder is loaded (Python and ``vispec generate image``: one line, exit 2) and when
``vispec convert lumina-mgpt`` reads a source checkpoint."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from transformers import ChameleonForConditionalGeneration

from vispec.cli import main
from vispec.models.checkpoints import (
    TooManyParameters,
    check_model_folder,
    check_pipeline_folder,
    parameter_limit,
    tensor_budget,
)
from vispec.pipelines.embedded import resolve_model_path

from lumina_reference import CODE0, lumina_tokenizer, official_config, official_weights, write_folder
from movqgan_reference import TINY, randomized


def _t2i_copy(tmp_path):
    """tiny-t2i's pipeline folder in ``tmp_path``: configs copied (they get edited), weight files linked."""
    def link_weights(src: str, dst: str) -> None:
        os.symlink(src, dst) if src.endswith(".safetensors") else shutil.copy2(src, dst)

    target = tmp_path / "tiny-t2i"
    shutil.copytree(resolve_model_path("tiny-t2i"), target, ignore=shutil.ignore_patterns("clip", "logs", "*.lock"),
                    copy_function=link_weights)
    return target


def _edit(path, field: str, value) -> None:
    """Set the dotted ``field`` of the JSON file ``path`` (written anew: never through a link)."""
    config = json.loads(path.read_text())
    *parents, name = field.split(".")
    node = config
    for parent in parents:
        node = node[parent]
    node[name] = value
    path.unlink()
    path.write_text(json.dumps(config))


@pytest.fixture
def no_build(monkeypatch):
    """Building a Chameleon (on any device) fails the test: the checks must come first."""
    def refuse(self, *args, **kwargs):
        raise AssertionError("ChameleonForConditionalGeneration was built before its config was checked")

    monkeypatch.setattr(ChameleonForConditionalGeneration, "__init__", refuse)


# (field, value, what the weights hold, the evidence named)
T2I_CASES = [
    ("vq_config.num_embeddings", 20_000_000, 16, r"model\.vqmodel\.quantize\.embedding\.weight has shape \(16, 8\)"),
    ("vocab_size", 500_000, 556, r"model\.embed_tokens\.weight has shape \(556, 256\)"),
    ("num_hidden_layers", 100_000, 6, r"model\.layers\.0 to model\.layers\.5"),
]


@pytest.mark.parametrize("field, value, held, evidence", T2I_CASES)
def test_unified_folder_config_is_checked_against_the_weights_before_building(tmp_path, no_build, capsys, field, value,
                                                                             held, evidence):
    from vispec.pipelines import UnifiedImagePipeline

    folder = _t2i_copy(tmp_path)
    _edit(folder / "transformer" / "config.json", field, value)
    expected = rf"transformer/config\.json does not match the weights in .*model\.safetensors: {field} is {value} but the weights hold {held} \({evidence}\)"
    with pytest.raises(ValueError, match=expected):
        UnifiedImagePipeline.from_pretrained(folder)
    with pytest.raises(ValueError, match=expected):
        check_pipeline_folder(folder, "UnifiedImagePipeline")
    assert main(["generate", "image", "--model", str(folder), "--prompt", "a red circle", "--out",
                 str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{field} is {value} but the weights hold {held}" in err[0], err


def test_every_contradicted_field_is_named_at_once(tmp_path, no_build):
    folder = _t2i_copy(tmp_path)
    _edit(folder / "transformer" / "config.json", "vocab_size", 500_000)
    _edit(folder / "transformer" / "config.json", "vq_config.num_res_blocks", 100_000)
    with pytest.raises(ValueError, match=r"vocab_size is 500000 but the weights hold 556 .*; vq_config\.num_res_blocks "
                                         r"is 100000 but the weights hold 1 \(model\.vqmodel\.encoder\.down\.0\.block\.0\)"):
        check_pipeline_folder(folder)


def test_fields_no_weight_reveals_directly_are_caught_on_the_meta_device(tmp_path):
    """A count no header names (VQ levels) stops the meta build at a budget; a head count shows as shape mismatches;
    a value transformers refuses is named in one line."""
    folder = _t2i_copy(tmp_path)
    config = folder / "transformer" / "config.json"
    original = config.read_text()
    _edit(config, "vq_config.channel_multiplier", [1] * 100_000)
    with pytest.raises(ValueError, match=r"describes a ChameleonForConditionalGeneration of more than \d+ parameter "
                                         r"tensors, but .*model\.safetensors holds 136: a count in the config"):
        check_pipeline_folder(folder)
    config.unlink()
    config.write_text(original)
    _edit(config, "num_key_value_heads", 1)
    with pytest.raises(ValueError, match=r"shape mismatches .*self_attn\.k_proj\.weight: checkpoint \(256, 256\) vs model \(64, 256\)"):
        check_pipeline_folder(folder)
    _edit(config, "num_key_value_heads", "four")
    with pytest.raises(ValueError, match=r"config\.json does not describe a valid ChameleonForConditionalGeneration: "
                                         r"Validation error for field 'num_key_value_heads': TypeError"):
        check_pipeline_folder(folder)


def test_an_intact_unified_folder_passes(tmp_path):
    folder = _t2i_copy(tmp_path)
    assert check_pipeline_folder(folder, "UnifiedImagePipeline")["family"] == "chameleon"


TEXT = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _tiny_emu3():
    from transformers import Emu3Config, Emu3ForConditionalGeneration

    vq = dict(codebook_size=16, embed_dim=4, latent_channels=4, base_channels=32, channel_multiplier=[1, 1],
              num_res_blocks=1, attn_resolutions=[], hidden_size=32, num_attention_heads=1, temporal_downsample_factor=2)
    return Emu3ForConditionalGeneration(Emu3Config(text_config=TEXT, vq_config=vq, vocabulary_map={"<|extra_200|>": 5}))


def _tiny_janus():
    from transformers import JanusConfig, JanusForConditionalGeneration

    vision = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, image_size=32, patch_size=16,
                  projection_dim=32, num_image_tokens=4, intermediate_size=64)
    vq = dict(embed_dim=8, num_embeddings=16, latent_channels=8, base_channels=32, channel_multiplier=[1, 1],
              num_res_blocks=1, num_patches=2, projection_dim=32, image_token_embed_dim=32, num_hidden_layers=1)
    return JanusForConditionalGeneration(JanusConfig(text_config=dict(TEXT, head_dim=8), vision_config=vision, vq_config=vq))


@pytest.mark.parametrize("build, codes, layers_key", [
    (_tiny_emu3, "codebook_size", r"text_model\.model\.layers\.0 to text_model\.model\.layers\.1"),  # Emu3's saved names
    (_tiny_janus, "num_embeddings", r"model\.language_model\.layers\.0 to model\.language_model\.layers\.1"),
])
def test_emu3_and_janus_folders_are_checked_too(tmp_path, build, codes, layers_key):
    torch.manual_seed(0)
    model = build()
    model.save_pretrained(tmp_path)
    check_model_folder(type(model), tmp_path)  # as saved: no complaint
    config = json.loads((tmp_path / "config.json").read_text())
    config["text_config"]["num_hidden_layers"] = 100_000
    config["vq_config"][codes] = 20_000_000
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=rf"text_config\.num_hidden_layers is 100000 but the weights hold 2 \({layers_key}\); "
                                         rf"vq_config\.{codes} is 20000000 but the weights hold 16"):
        check_model_folder(type(model), tmp_path)


def test_diffusers_models_get_the_parameter_budget_too(tmp_path):
    """LlamaGen's GPT (a diffusers model, checked by shapes) with 100,000 layers stops at the budget on the meta device."""
    from vispec.models.llamagen_gpt import LlamaGenGPT

    folder = tmp_path / "transformer"
    shutil.copytree(resolve_model_path("tiny-c2i") + "/transformer", folder, copy_function=os.symlink)
    _edit(folder / "config.json", "n_layer", 100_000)
    with pytest.raises(ValueError, match=r"describes a LlamaGenGPT of more than \d+ parameter tensors, but "
                                         r".*diffusion_pytorch_model\.safetensors holds \d+"):
        LlamaGenGPT.from_pretrained(folder)


def test_parameter_limit_stops_at_the_first_parameter_past_it():
    with pytest.raises(TooManyParameters):
        with parameter_limit(5):
            torch.nn.Sequential(*(torch.nn.Linear(2, 2, device="meta") for _ in range(1000)))
    with parameter_limit(4):  # the hook was removed: a new limit counts from zero
        torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    torch.nn.Sequential(*(torch.nn.Linear(2, 2, device="meta") for _ in range(10)))  # no limit outside the block
    assert tensor_budget(10) > 10


# ------------------------------------------------------------------------------------------ convert lumina-mgpt
@pytest.fixture
def lumina_source(tmp_path):
    """A tiny official Lumina-mGPT folder (with tokenizer) and a tiny MoVQGAN file."""
    config = official_config(mp=1)
    checkpoint = write_folder(tmp_path / "Lumina-mGPT-2.0", config, official_weights(config, seed=3))
    lumina_tokenizer().save_pretrained(checkpoint)
    movq = tmp_path / "movqgan_tiny.ckpt"
    torch.save(randomized(TINY).state_dict(), movq)
    return checkpoint, movq


def _convert(checkpoint, movq, out) -> int:
    return main(["convert", "lumina-mgpt", "--checkpoint", str(checkpoint), "--movqgan", str(movq), "--out", str(out),
                 "--image-token-offset", str(CODE0), "--size", "64"])


@pytest.mark.parametrize("field, value, expected", [
    ("num_hidden_layers", 100_000, r"num_hidden_layers is 100000 but the weights hold 2 \(model\.layers\.0 to model\.layers\.1\)"),
    ("vocab_size", 500_000, r"vocab_size is 500000 but the weights hold 96 \(model\.embed_tokens\.weight has shape \(96, 64\)\)"),
])
def test_convert_lumina_checks_the_source_config_before_reading_or_building(tmp_path, lumina_source, monkeypatch, capsys,
                                                                            field, value, expected):
    from vispec.models import lumina_checkpoint

    checkpoint, movq = lumina_source
    _edit(checkpoint / "config.json", field, value)

    def refuse(folder):
        raise AssertionError("tensors were read before the config was checked")

    monkeypatch.setattr(lumina_checkpoint, "read_sharded_safetensors", refuse)
    with pytest.raises(ValueError, match=expected):
        lumina_checkpoint.load_lumina_chameleon(checkpoint)
    monkeypatch.setattr(ChameleonForConditionalGeneration, "__init__", refuse)
    assert _convert(checkpoint, movq, tmp_path / "out") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("vispec: error:"), err
    assert not (tmp_path / "out").exists()


def test_lumina_config_values_of_the_wrong_type_are_named(tmp_path, lumina_source):
    from vispec.models.lumina_checkpoint import load_lumina_chameleon

    checkpoint, _ = lumina_source
    _edit(checkpoint / "config.json", "vocab_size", "many")
    with pytest.raises(ValueError, match=r"config\.json vocab_size must be an integer >= 1, got 'many'"):
        load_lumina_chameleon(checkpoint)
    _edit(checkpoint / "config.json", "vocab_size", 96)
    _edit(checkpoint / "config.json", "hidden_act", 5)
    with pytest.raises(ValueError, match=r"config\.json is not a valid Chameleon config: Validation error for field 'hidden_act'"):
        load_lumina_chameleon(checkpoint)


def test_convert_lumina_bounds_the_unused_vq_encoder(tmp_path, lumina_source):
    """Lumina-mGPT's folders drop Chameleon's VQ encoder, which vispec builds from vq_config: with no weights to
    check it against, it may not outgrow the whole checkpoint; with its weights present, they are compared."""
    from vispec.models.lumina_checkpoint import load_lumina_chameleon

    checkpoint, _ = lumina_source
    _edit(checkpoint / "config.json", "vq_config.latent_channels", 20_000_000)
    with pytest.raises(ValueError, match=r"config\.json vq_config describes a VQ encoder of \d+ parameters, more than "
                                         r"the whole checkpoint in .* holds \(\d+\)"):
        load_lumina_chameleon(checkpoint)
    config = official_config(mp=1)
    config["vq_config"] = dict(config["vq_config"], num_embeddings=20_000_000)
    with_vq = write_folder(tmp_path / "with_vq", config, official_weights(config, with_vqmodel=True))
    with pytest.raises(ValueError, match=r"vq_config\.num_embeddings is 20000000 but the weights hold 16"):
        load_lumina_chameleon(with_vq)
