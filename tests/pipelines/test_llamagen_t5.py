"""LlamaGenPipeline with a T5 text encoder (issue 47 item 30): ``pipe(prompt=...)`` on a caption (t2i) model, checked
against LlamaGen's own t2i conditioning on the same weights (tests/llamagen_t5_reference.py), saved and loaded,
refused in the user's words, and written by ``vispec convert llamagen --text-encoder``. Tiny, random, offline."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from diffusers import VQModel
from transformers import T5EncoderModel

from vispec.decoding import DecodingConfig
from vispec.models.llamagen_gpt import LlamaGenCondition, LlamaGenGPT
from vispec.models.llamagen_vq import llamagen_vq_config
from vispec.pipelines import LlamaGenPipeline

from llamagen_t5_reference import CAPTION_DIM, official_conditioning, t5_encoder, t5_tokenizer, write_t5_folder

PROMPTS = ["a photo of a cat", "  A Red dog sitting on the grass ", "cat " * 150]  # the last is cut to 120 tokens


def components(text: bool = True) -> dict:
    torch.manual_seed(1)
    transformer = LlamaGenGPT(vocab_size=64, dim=32, n_layer=1, n_head=2, model_type="t2i", caption_dim=CAPTION_DIM,
                              cls_token_num=120, block_size=16).eval()
    torch.manual_seed(2)
    vq_kwargs = llamagen_vq_config("VQ-4", codebook_size=64, codebook_embed_dim=8, z_channels=32, base_channels=32)
    vq_kwargs.update(layers_per_block=1, block_out_channels=(32, 32, 32))
    parts = {"transformer": transformer, "vqvae": VQModel(**vq_kwargs).eval(),
             "decoding_config": DecodingConfig(strategy="mc-sjd", window=4, guidance_scale=3.0, top_k=40)}
    if text:
        parts.update(text_encoder=t5_encoder(), tokenizer=t5_tokenizer())
    return parts


def make_pipe(**kwargs) -> LlamaGenPipeline:
    pipe = LlamaGenPipeline(**components(**kwargs))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def seeds(n: int) -> list:
    return [torch.Generator().manual_seed(10 + i) for i in range(n)]


# ---------------------------------------------------------------------- conditioning
def test_prompt_conditioning_is_llamagens():
    pipe = make_pipe()
    want, want_mask = official_conditioning(pipe.text_encoder, pipe.tokenizer, PROMPTS)
    assert want_mask.sum(1).tolist() == [6, 8, 120]  # EOS counted; the long caption fills all 120
    assert want_mask[0, :114].sum() == 0 and want_mask[0, 114:].all()  # left padding
    embeds, mask = pipe.encode_prompt(PROMPTS, clean_caption=False)
    assert mask.dtype == torch.bool and torch.equal(mask, want_mask.bool()) and torch.equal(embeds, want)
    condition = pipe.condition(None, None, None, 2, prompt=PROMPTS, clean_caption=False)  # what decoding gets
    assert isinstance(condition, LlamaGenCondition) and condition.class_labels is None
    assert torch.equal(condition.caption_embeds, want.repeat_interleave(2, 0))
    assert torch.equal(condition.caption_mask, want_mask.bool().repeat_interleave(2, 0))
    # the tokenizer is case-sensitive: upper case would read <unk> without LlamaGen's lower-casing
    assert pipe.tokenizer.unk_token_id in pipe.tokenizer("A")["input_ids"]


def test_null_caption_is_the_learnt_uncond_embedding_under_the_prompts_mask():
    """Guidance's unconditional rows, as LlamaGen's generate builds them: the projected uncond_embedding (its first
    120 rows), attended under the prompt's own mask."""
    pipe = make_pipe()
    condition = pipe.condition(None, None, None, 1, prompt=PROMPTS[:2], clean_caption=False)
    gpt = pipe.transformer
    rows, key_mask = gpt._condition_rows(condition, guidance=True)  # what the decoders' prefill embeds
    null = gpt.cls_embedding.cap_proj(gpt.cls_embedding.uncond_embedding[:120])
    assert torch.equal(rows[:2], gpt.cls_embedding.cap_proj(condition.caption_embeds))
    assert torch.allclose(rows[2:], null.expand(2, -1, -1), atol=1e-6)
    assert torch.equal(key_mask, condition.caption_mask.repeat(2, 1))


def test_caption_cleaning():
    """clean_caption=True is LlamaGen's cleaning (diffusers' copy of DeepFloyd IF's) where beautifulsoup4 and ftfy
    are installed; without them a warning says so and captions are lower-cased and stripped (as clean_caption=False)."""
    from diffusers.utils import is_bs4_available, is_ftfy_available

    pipe = make_pipe()
    caption = ["  A Photo of a CAT  "]
    plain = pipe.encode_prompt(caption, clean_caption=False)[0]
    assert torch.equal(plain, pipe.encode_prompt(["a photo of a cat"], clean_caption=False)[0])
    if is_bs4_available() and is_ftfy_available():
        assert torch.equal(pipe.encode_prompt(caption)[0], plain)
    else:
        with pytest.warns(UserWarning, match="beautifulsoup4 and ftfy"):
            assert torch.equal(pipe.encode_prompt(caption)[0], plain)


# ---------------------------------------------------------------------- the call
def test_prompt_path_gives_the_tokens_of_the_equivalent_prompt_embeds():
    pipe = make_pipe()
    embeds, mask = official_conditioning(pipe.text_encoder, pipe.tokenizer, PROMPTS[:2])
    for decoding in ("ar", "mc-sjd"):
        want = pipe(prompt_embeds=embeds, prompt_mask=mask, num_images_per_prompt=2, decoding=decoding,
                    generator=seeds(4), output_type="latent").images
        got = pipe(prompt=PROMPTS[:2], num_images_per_prompt=2, decoding=decoding, generator=seeds(4),
                   output_type="latent", clean_caption=False).images
        assert torch.equal(got, want)
    # a caption passed first is the prompt: pipe("a photo of a cat")
    one = pipe(prompt_embeds=embeds[:1], prompt_mask=mask[:1], generator=seeds(1), output_type="latent").images
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the cleaning's libraries may be absent (test_caption_cleaning)
        assert torch.equal(pipe("a photo of a cat", generator=seeds(1), output_type="latent").images, one)
        assert pipe(prompt="a photo of a cat", output_type="pt").images.shape == (1, 3, 16, 16)


def test_save_load_round_trip_and_components_passed_in(tmp_path):
    pipe = make_pipe()
    inputs = dict(prompt=PROMPTS[:2], generator=seeds(2), output_type="latent", clean_caption=False)
    want = pipe(**inputs).images
    pipe.save_pretrained(tmp_path / "t2i")
    index = json.loads((tmp_path / "t2i" / "model_index.json").read_text())
    assert index["text_encoder"] == ["transformers", "T5EncoderModel"] and index["tokenizer"][0] == "transformers"
    assert (tmp_path / "t2i" / "text_encoder" / "config.json").is_file() and (tmp_path / "t2i" / "tokenizer").is_dir()
    loaded = LlamaGenPipeline.from_pretrained(tmp_path / "t2i")
    loaded.set_progress_bar_config(disable=True)
    assert isinstance(loaded.text_encoder, T5EncoderModel)
    for key, value in pipe.text_encoder.state_dict().items():
        assert torch.equal(loaded.text_encoder.state_dict()[key], value), key
    assert loaded.tokenizer(PROMPTS)["input_ids"] == pipe.tokenizer(PROMPTS)["input_ids"]
    assert torch.equal(loaded(**{**inputs, "generator": seeds(2)}).images, want)

    # a folder without them loads (prompt_embeds only) and takes them as keyword components
    LlamaGenPipeline(**components(text=False)).save_pretrained(tmp_path / "bare")
    assert json.loads((tmp_path / "bare" / "model_index.json").read_text())["text_encoder"] == [None, None]
    bare = LlamaGenPipeline.from_pretrained(tmp_path / "bare")
    assert bare.text_encoder is None and bare.tokenizer is None
    given = LlamaGenPipeline.from_pretrained(tmp_path / "bare", text_encoder=pipe.text_encoder, tokenizer=pipe.tokenizer)
    given.set_progress_bar_config(disable=True)
    assert given.text_encoder is pipe.text_encoder
    assert torch.equal(given(**{**inputs, "generator": seeds(2)}).images, want)


def test_model_offload_runs_the_text_encoder_first():
    """``model_cpu_offload_seq`` is text_encoder -> transformer -> vqvae; the tokens do not change."""
    pytest.importorskip("accelerate")
    pipe = make_pipe()
    inputs = dict(prompt=PROMPTS[:2], output_type="latent", clean_caption=False)
    want = pipe(**inputs, generator=seeds(2)).images
    pipe.enable_model_cpu_offload(device="cpu")
    assert hasattr(pipe.text_encoder, "_hf_hook")
    assert torch.equal(pipe(**inputs, generator=seeds(2)).images, want)


# ---------------------------------------------------------------------- errors, before any work
def test_errors_in_the_users_words():
    bare = LlamaGenPipeline(**components(text=False))
    with pytest.raises(ValueError, match=r"prompt needs a text encoder.*no text_encoder and no tokenizer.*prompt_embeds"):
        bare(prompt="a photo of a cat")
    with pytest.raises(ValueError, match=r"prompt needs a text encoder.*prompt_embeds"):
        bare("a photo of a cat")
    with pytest.raises(ValueError, match=r"pass prompt_embeds.*or load a text_encoder and tokenizer to pass prompt"):
        bare()

    pipe = make_pipe()
    embeds, mask = pipe.encode_prompt(["a cat"], clean_caption=False)
    calls = []
    pipe.text_encoder.register_forward_hook(lambda *args: calls.append(1))
    with pytest.raises(ValueError, match="not both: got prompt and prompt_embeds"):
        pipe(prompt="a cat", prompt_embeds=embeds)
    with pytest.raises(ValueError, match="not both: got prompt and prompt_mask"):
        pipe(prompt="a cat", prompt_mask=mask)
    with pytest.raises(ValueError, match="not class_labels"):
        pipe(class_labels=[1], prompt="a cat")
    with pytest.raises(ValueError, match="prompt must be a string or a non-empty list of strings"):
        pipe(prompt=[])
    with pytest.raises(ValueError, match="generator list has 1 entries, expected one per sample"):
        pipe(prompt=["a cat", "a dog"], generator=seeds(1))
    assert not calls  # refused before the text encoder ran
    pipe.encode_prompt("a cat", clean_caption=False)
    assert calls  # (the hook counts)

    wide = t5_encoder(d_model=24)
    with pytest.raises(ValueError, match=r"hidden size \(24\).*caption_dim \(16\)"):
        LlamaGenPipeline(**{**components(text=False), "text_encoder": wide, "tokenizer": t5_tokenizer()})
    pipe.text_encoder = wide  # swapped after construction: refused at the call
    with pytest.raises(ValueError, match=r"hidden size \(24\).*caption_dim \(16\)"):
        pipe(prompt="a cat")

    c2i = {**components(text=False), "transformer": LlamaGenGPT(vocab_size=64, dim=32, n_layer=1, n_head=2,
                                                                block_size=16, num_classes=5).eval()}
    with pytest.raises(ValueError, match="text_encoder feeds caption models"):
        LlamaGenPipeline(**c2i, text_encoder=t5_encoder(), tokenizer=t5_tokenizer())
    with pytest.raises(ValueError, match="class-conditional model: pass class_labels, not prompt"):
        LlamaGenPipeline(**c2i)(prompt="a cat")


def test_saved_mismatched_encoder_is_refused_on_load(tmp_path):
    pipe = make_pipe()
    pipe.save_pretrained(tmp_path / "t2i")
    with pytest.raises(ValueError, match=r"hidden size \(24\).*caption_dim \(16\)"):
        LlamaGenPipeline.from_pretrained(tmp_path / "t2i", text_encoder=t5_encoder(d_model=24))


# ---------------------------------------------------------------------- vispec convert llamagen --text-encoder
def test_convert_writes_the_text_encoder_and_tokenizer(tmp_path, capsys):
    """The tiny official-layout t2i GPT (caption_dim 16, cls_token_num 4) with a T5 folder: the folder loads and
    takes prompts; a c2i GPT, a T5 of another width and a lone --tokenizer are refused by their flags."""
    from vispec.cli import main

    data = "tests/data/llamagen"
    t5_folder = tmp_path / "flan-t5"
    write_t5_folder(t5_folder)
    out = tmp_path / "llamagen-t2i"
    argv = ["convert", "llamagen", "--gpt", f"{data}/t2i_tiny_raw.pt", "--vq", f"{data}/vq16_tiny.pt", "--n-head", "4",
            "--image-size", "64", "--cls-token-num", "4"]
    assert main([*argv, "--out", str(out), "--text-encoder", str(t5_folder)]) == 0
    assert "T5 encoder" in capsys.readouterr().out
    pipe = LlamaGenPipeline.from_pretrained(out)
    pipe.set_progress_bar_config(disable=True)
    assert isinstance(pipe.text_encoder, T5EncoderModel) and pipe.decoding_config.guidance_scale == 7.5
    want, want_mask = official_conditioning(pipe.text_encoder, pipe.tokenizer, ["a photo of a cat"], max_length=4)
    embeds, mask = pipe.encode_prompt("a photo of a cat", clean_caption=False)
    assert torch.equal(embeds, want) and torch.equal(mask, want_mask.bool())  # 6 tokens cut to 4: no padding
    images = pipe(prompt="a photo of a cat", generator=seeds(1), output_type="pt", clean_caption=False).images
    assert images.shape == (1, 3, 64, 64)

    wide = tmp_path / "wide-t5"
    write_t5_folder(wide, d_model=24)
    assert main([*argv, "--out", str(tmp_path / "x"), "--text-encoder", str(wide)]) == 2
    assert "--text-encoder hidden size (d_model) is 24" in capsys.readouterr().err
    assert main(["convert", "llamagen", "--gpt", f"{data}/c2i_tiny.pt", "--vq", f"{data}/vq16_tiny.pt", "--n-head", "4",
                 "--trust-pickle", "--out", str(tmp_path / "y"), "--text-encoder", str(t5_folder)]) == 2
    assert "--text-encoder is for caption-conditioned (t2i) checkpoints" in capsys.readouterr().err
    assert main([*argv, "--out", str(tmp_path / "z"), "--tokenizer", str(t5_folder)]) == 2
    assert "--tokenizer goes with --text-encoder" in capsys.readouterr().err


def test_generate_image_takes_prompt_on_a_llamagen_t2i_folder(tmp_path, capsys):
    """``vispec generate image --prompt`` on a LlamaGen t2i folder: the T5 encodes the prompt as the pipeline's
    ``prompt=`` does; --class and the unified-token flags are refused naming the flag, before the model loads."""
    from vispec.cli import main

    make_pipe().save_pretrained(tmp_path / "t2i")
    out = tmp_path / "cat.png"
    assert main(["generate", "image", "--model", str(tmp_path / "t2i"), "--prompt", "a photo of a cat",
                 "--out", str(out), "--quiet"]) == 0
    assert out.is_file()
    for flags, words in ((["--class", "1"], "pass --prompt (not --class)"), (["--height", "64"], "--height applies to")):
        capsys.readouterr()
        assert main(["generate", "image", "--model", str(tmp_path / "t2i"), "--prompt", "a cat", *flags,
                     "--out", str(out)]) == 2
        assert words in capsys.readouterr().err
