"""UnifiedImagePipeline on a tiny random Chameleon-style model: outputs, layout, batch independence, save / load,
callbacks, bad input and the CLI."""

from __future__ import annotations

import pytest
import torch

from vispec.cli import main
from vispec.pipelines import UnifiedImagePipeline

from unified_helpers import NUM_CODES, tiny_unified_pipeline


@pytest.fixture(scope="module")
def pipe():
    return tiny_unified_pipeline()


def gens(count: int, seed: int = 0):
    return [torch.Generator().manual_seed(seed + i) for i in range(count)]


@pytest.mark.parametrize("decoding", ["ar", "sjd", "mc-sjd", "mc-sjd+lantern:k=2,delta=0.2", "sjd+gsd"])
def test_generates_code_grids_and_pixels(pipe, decoding):
    out = pipe(["a red cat", "blue sky"], decoding=decoding, generator=gens(2), output_type="latent")
    assert out.images.shape == (2, 4, 4) and bool((out.images >= 0).all() and (out.images < NUM_CODES).all())
    assert [s["tokens"] for s in out.stats] == [20, 20]  # 4 rows of 4 codes and an end-of-row token
    pixels = pipe("a red cat", decoding=decoding, generator=gens(1), output_type="pt").images
    assert pixels.shape == (1, 3, 16, 16) and float(pixels.min()) >= 0 and float(pixels.max()) <= 1


def test_sizes_and_batch_independence(pipe):
    wide = pipe("a dog", height=8, width=24, generator=gens(1), output_type="latent").images
    assert wide.shape == (1, 2, 6)
    batch = pipe(["a red cat", "blue sky", "the sea"], generator=gens(3), output_type="latent").images
    single = pipe("blue sky", generator=[gens(3)[1]], output_type="latent").images
    assert torch.equal(batch[1], single[0])
    streamed = pipe(["a red cat", "blue sky", "the sea"], generator=gens(3), output_type="latent", max_batch_size=2).images
    assert torch.equal(streamed, batch)
    per_prompt = pipe("a red cat", num_images_per_prompt=2, generator=gens(2), output_type="latent").images
    assert per_prompt.shape == (2, 4, 4) and torch.equal(per_prompt[0], batch[0])


def test_save_load_and_generic_loader(pipe, tmp_path):
    from diffusers import DiffusionPipeline

    reference = pipe("a red cat", generator=gens(1), output_type="latent").images
    pipe.save_pretrained(tmp_path / "saved")
    loaded = UnifiedImagePipeline.from_pretrained(tmp_path / "saved")
    loaded.set_progress_bar_config(disable=True)
    assert torch.equal(loaded("a red cat", generator=gens(1), output_type="latent").images, reference)
    generic = DiffusionPipeline.from_pretrained(tmp_path / "saved", trust_remote_code=True)
    generic.set_progress_bar_config(disable=True)
    assert type(generic).__name__ == "UnifiedImagePipeline"
    assert torch.equal(generic("a red cat", generator=gens(1), output_type="latent").images, reference)


def test_callback_edits_keep_the_layout(pipe):
    def rewrite(p, step, timestep, kwargs):
        tokens = kwargs["tokens"]
        if step == 2:
            tokens[:, 0] = 3
        return kwargs

    out = pipe("a red cat", generator=gens(1), output_type="latent", callback_on_step_end=rewrite)
    assert int(out.images[0, 0, 0]) == 3

    def break_row(p, step, timestep, kwargs):
        tokens = kwargs["tokens"]
        tokens[tokens == NUM_CODES] = 0
        return kwargs

    with pytest.raises(ValueError, match="keep the end-of-row token"):
        pipe("a red cat", decoding="ar", generator=gens(1), output_type="latent", callback_on_step_end=break_row)


@pytest.mark.parametrize("kwargs, match", [
    ({"height": 10}, "height must be a multiple of 8"),
    ({"width": 0}, "width must be an integer >= 8"),
    ({"negative_prompt": "blurry"}, "negative_prompt needs a model whose guidance takes one"),
    ({"prompt": 3}, "prompt must be a string or a non-empty list of strings"),
    ({"decoding": "sd"}, "UnifiedImagePipeline has none"),
    ({"output_type": "jpg"}, "output_type must be one of"),
])
def test_bad_input_is_named(pipe, kwargs, match):
    call = {"prompt": "a cat", **kwargs}
    with pytest.raises(ValueError, match=match):
        pipe(**call)


def test_cli_generates_from_a_text_to_image_folder(pipe, tmp_path, capsys):
    folder = tmp_path / "t2i"
    pipe.save_pretrained(folder)
    out = tmp_path / "cat.png"
    assert main(["generate", "image", "--model", str(folder), "--prompt", "a red cat", "--decoding", "mc-sjd",
                 "--out", str(out), "--quiet"]) == 0
    assert out.is_file() and "NFE" in capsys.readouterr().out
    assert main(["generate", "image", "--model", str(folder), "--class", "1", "--out", str(out), "--quiet"]) == 2
    assert "is a text-to-image pipeline: pass --prompt" in capsys.readouterr().err


def test_a_prompt_without_tokens_is_named():
    """Issue 47 item 11: tiny-t2i's template is the prompt alone, so ``prompt=""`` has no tokens ("prompt_ids has an
    empty prompt" came from inside the model before)."""
    from vispec.pipelines import UnifiedImagePipeline

    t2i = UnifiedImagePipeline.from_pretrained("vispec/tiny-t2i")
    with pytest.raises(ValueError, match="prompt='' gives no tokens in this model's prompt template"):
        t2i("", output_type="latent")
    with pytest.raises(ValueError, match="prompt='' gives no tokens"):
        t2i(["a red square", ""], output_type="latent")
