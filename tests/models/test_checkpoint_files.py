"""Checkpoint files and configs are untrusted input (issue 13, item 9): every way they can be wrong is one
clear ``ValueError`` that says what the file is, and a config that does not fit its weights fails before
any model is built at the config's size."""

from __future__ import annotations

import json
import os
import pickle
import shutil

import pytest
import torch
from safetensors.torch import save_file

from vispec.cli import main
from vispec.models.checkpoints import CheckedFromPretrained, check_pipeline_folder, read_checkpoint, safetensors_header
from vispec.pipelines.embedded import resolve_model_path

DATA = "tests/data/llamagen"
HUGE = 20_000_000  # a vocabulary of 20M rows: ~20 GB per table at tiny-c2i's width, if anything allocated it


def _no_torch_advice(message: str) -> None:
    """torch's advice to re-run with weights_only=False must not reach our users (it runs the pickle)."""
    assert "weights_only" not in message and "file an issue" not in message


def test_plain_pickle_is_named_and_loads_only_when_trusted(tmp_path):
    path = tmp_path / "weights.pkl"
    with open(path, "wb") as handle:
        pickle.dump({"w": torch.ones(2)}, handle)
    with pytest.raises(ValueError) as info:
        read_checkpoint(path)
    message = str(info.value)
    assert "plain Python pickle" in message and "--trust-pickle" in message and "corrupted" not in message
    _no_torch_advice(message)
    state_dict, args = read_checkpoint(path, trust_pickle=True)  # the caller vouched for it: it is read
    assert torch.equal(state_dict["w"], torch.ones(2)) and args == {}


@pytest.mark.parametrize("content,words", [
    (os.urandom(4000).replace(b"\x80", b"\x00").replace(b"PK", b"pk"), "starts with neither the zip header"),
    (b"hello world\n", "starts with neither the zip header"),
    (b"", "is not a readable torch checkpoint: the file is empty"),
    (b"PK\x03\x04" + os.urandom(400), "not a readable torch checkpoint (corrupted or truncated?)"),
    ("truncated", "not a readable torch checkpoint (corrupted or truncated?)"),
])
def test_unreadable_torch_files_say_what_they_are(tmp_path, content, words):
    if content == "truncated":
        torch.save({"w": torch.zeros(100)}, tmp_path / "good.pt")
        content = (tmp_path / "good.pt").read_bytes()[:300]
    path = tmp_path / "gpt.pt"
    path.write_bytes(content)
    with pytest.raises(ValueError) as info:
        read_checkpoint(path)
    assert words in str(info.value) and str(path) in str(info.value)
    _no_torch_advice(str(info.value))


def test_corrupt_safetensors_is_a_clear_error(tmp_path, capsys):
    good = tmp_path / "good.safetensors"
    save_file({"w": torch.zeros(64, 64)}, str(good))
    for name, content in (("truncated", good.read_bytes()[:-100]), ("random", os.urandom(3000)), ("empty", b"")):
        path = tmp_path / f"{name}.safetensors"
        path.write_bytes(content)
        for read in (read_checkpoint, safetensors_header):
            with pytest.raises(ValueError, match=r"is not a readable safetensors file \(corrupted or truncated\?\)"):
                read(path)
    args = ["convert", "llamagen", "--gpt", str(tmp_path / "truncated.safetensors"), "--vq", f"{DATA}/vq16_tiny.pt",
            "--out", str(tmp_path / "pipe")]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "corrupted or truncated" in err[0] and "SafetensorError" not in err[0]


def test_convert_reads_integer_settings_from_safetensors_metadata(tmp_path, capsys):
    """safetensors metadata holds strings: ``num_classes`` "10" used to crash with ``can only concatenate str``."""
    state_dict, args = read_checkpoint(f"{DATA}/c2i_tiny.pt", trust_pickle=True)
    gpt = tmp_path / "gpt.safetensors"
    metadata = {"num_classes": str(args["num_classes"]), "image_size": str(args["image_size"]), "gpt_model": "GPT-tiny"}
    save_file({k: v.contiguous() for k, v in state_dict.items()}, str(gpt), metadata=metadata)
    out = tmp_path / "pipe"
    assert main(["convert", "llamagen", "--gpt", str(gpt), "--vq", f"{DATA}/vq16_tiny.pt", "--out", str(out), "--n-head", "4"]) == 0
    assert json.loads((out / "transformer" / "config.json").read_text())["num_classes"] == 10
    save_file({k: v.contiguous() for k, v in state_dict.items()}, str(gpt), metadata={**metadata, "num_classes": "ten"})
    assert main(["convert", "llamagen", "--gpt", str(gpt), "--vq", f"{DATA}/vq16_tiny.pt", "--out", str(out), "--n-head", "4"]) == 2
    assert "num_classes setting (training args or safetensors metadata) must be an integer, got 'ten'" in capsys.readouterr().err


def _pipeline_copy(tmp_path, name: str):
    """The embedded pipeline's model folders (no evaluator, logs or LANTERN table) in ``tmp_path / name``."""
    source = resolve_model_path(name)
    target = tmp_path / name
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("evaluator", "logs", "*.safetensors.lock"))
    return target


def _edit_config(path, **changes) -> None:
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


@pytest.fixture
def no_loader(monkeypatch):
    """diffusers' own loader refuses to run: the checks must fail before anything is built at the config's size."""
    from diffusers.models.modeling_utils import ModelMixin

    def refuse(cls, *args, **kwargs):
        raise AssertionError(f"{cls.__name__} was loaded before its config was checked")

    monkeypatch.setattr(ModelMixin, "from_pretrained", classmethod(refuse))


def test_huge_vocabulary_in_a_config_fails_before_allocating(tmp_path, no_loader, capsys):
    from vispec.models.llamagen_gpt import LlamaGenGPT
    from vispec.pipelines import LlamaGenPipeline

    folder = _pipeline_copy(tmp_path, "tiny-c2i")
    _edit_config(folder / "transformer" / "config.json", vocab_size=HUGE)
    expected = rf"does not match the model .*config.json describes: shape mismatches .*checkpoint \(1024, 256\) vs model \({HUGE}, 256\)"
    with pytest.raises(ValueError, match=expected):
        LlamaGenGPT.from_pretrained(folder / "transformer")
    with pytest.raises(ValueError, match=expected):
        LlamaGenGPT.from_pretrained(folder, subfolder="transformer")
    with pytest.raises(ValueError, match=expected):
        LlamaGenPipeline.from_pretrained(folder)
    assert main(["generate", "image", "--model", str(folder), "--class", "1", "--out", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "tok_embeddings.weight: checkpoint (1024, 256)" in err[0]


def test_bin_weights_are_shape_checked_before_allocating(tmp_path, no_loader):
    """A folder with diffusers' ``.bin`` weights instead of safetensors: shapes are read with the weights-only
    unpickler onto the meta device and compared with the config before anything is built at its size."""
    from safetensors.torch import load_file

    from vispec.models.llamagen_gpt import LlamaGenGPT

    folder = _pipeline_copy(tmp_path, "tiny-c2i")
    weights = folder / "transformer" / "diffusion_pytorch_model.safetensors"
    torch.save(load_file(weights), folder / "transformer" / "diffusion_pytorch_model.bin")
    weights.unlink()
    _edit_config(folder / "transformer" / "config.json", vocab_size=HUGE)
    with pytest.raises(ValueError, match=rf"diffusion_pytorch_model.bin.*tok_embeddings.weight: checkpoint \(1024, 256\) vs model \({HUGE}, 256\)"):
        LlamaGenGPT.from_pretrained(folder / "transformer")
    (folder / "transformer" / "diffusion_pytorch_model.bin").write_bytes(b"PK\x03\x04 truncated")
    with pytest.raises(ValueError, match=r"diffusion_pytorch_model.bin is not a readable torch weights file"):
        LlamaGenGPT.from_pretrained(folder / "transformer")


@pytest.mark.parametrize("key", ["block_size", "cls_token_num"])
def test_huge_sequence_sizes_in_a_config_are_refused_before_allocating(tmp_path, no_loader, key):
    """block_size and cls_token_num size the RoPE table, which no weight shape reveals: they are bounded."""
    from vispec.models.llamagen_gpt import LlamaGenGPT

    folder = _pipeline_copy(tmp_path, "tiny-c2i")
    _edit_config(folder / "transformer" / "config.json", **{key: 4 * 10**12})
    with pytest.raises(ValueError, match=rf"does not describe a valid LlamaGenGPT: {key} must be an integer"):
        LlamaGenGPT.from_pretrained(folder / "transformer")


def test_diffusers_vq_and_missing_components_are_checked_with_the_folder(tmp_path, no_loader):
    folder = _pipeline_copy(tmp_path, "tiny-c2i")
    _edit_config(folder / "vqvae" / "config.json", num_vq_embeddings=HUGE)  # diffusers' VQModel: checked by the folder check
    with pytest.raises(ValueError, match=rf"vqvae.*shape mismatches.*quantize.embedding.weight: checkpoint \(1024, 8\) vs model \({HUGE}, 8\)"):
        check_pipeline_folder(folder, "LlamaGenPipeline")
    shutil.rmtree(folder / "vqvae")
    with pytest.raises(ValueError, match=r"lacks the subfolder vqvae/ that model_index.json names"):
        check_pipeline_folder(folder)
    (folder / "model_index.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"model_index.json is not a readable JSON file"):
        check_pipeline_folder(folder)


def test_text_model_config_is_checked_and_official_folders_are_checked_before_loading(tmp_path, no_loader, monkeypatch):
    from vispec.models import llada_checkpoint
    from vispec.models.llada import LLaDAModelLM
    from vispec.pipelines import MaskedDiffusionLMPipeline

    folder = _pipeline_copy(tmp_path, "tiny-mdlm")
    _edit_config(folder / "model" / "config.json", vocab_size=HUGE, embedding_size=HUGE)
    with pytest.raises(ValueError, match=rf"shape mismatches .*model \({HUGE}, "):
        MaskedDiffusionLMPipeline.from_pretrained(folder)

    # an official LLaDA folder (config.json + model.safetensors): headers are compared before a tensor is read
    official = tmp_path / "official"
    official.mkdir()
    shutil.copy(folder / "model" / "diffusion_pytorch_model.safetensors", official / "model.safetensors")
    config = json.loads((folder / "model" / "config.json").read_text())
    config = {k: config[k] for k in ("d_model", "n_heads", "n_kv_heads", "n_layers", "mlp_hidden_size", "max_sequence_length",
                                     "mask_token_id", "eos_token_id", "pad_token_id", "vocab_size", "embedding_size")}
    (official / "config.json").write_text(json.dumps(config))

    def refuse(folder):
        raise AssertionError("tensors were read before the shapes were checked")

    monkeypatch.setattr(llada_checkpoint, "read_sharded_safetensors", refuse)
    with pytest.raises(ValueError, match=rf"official does not match the model configuration: shape mismatches .*model \({HUGE}, "):
        llada_checkpoint.load_llada(official)
    assert issubclass(LLaDAModelLM, CheckedFromPretrained)
