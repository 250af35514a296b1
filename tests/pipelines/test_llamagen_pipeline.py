"""LlamaGenPipeline with dummy components, in the habits of diffusers' PipelineTesterMixin."""

from __future__ import annotations

import inspect

import numpy as np
import PIL.Image
import pytest
import torch
from diffusers import VQModel

from vispec.decoding import AcceptanceConfig, DecodingConfig
from vispec.models.llamagen_gpt import LlamaGenGPT
from vispec.models.llamagen_vq import llamagen_vq_config
from vispec.pipelines import LlamaGenPipeline

from helpers import tiny_gpt


def get_dummy_components(model_type: str = "c2i") -> dict:
    if model_type == "c2i":
        transformer = tiny_gpt(vocab_size=64, block_size=16, num_classes=5, std=0.3, seed=1)
    else:
        torch.manual_seed(1)
        transformer = LlamaGenGPT(vocab_size=64, dim=32, n_layer=1, n_head=2, model_type="t2i", caption_dim=8,
                                  cls_token_num=3, block_size=16).eval()
    torch.manual_seed(2)
    vq_kwargs = llamagen_vq_config("VQ-4", codebook_size=64, codebook_embed_dim=8, z_channels=32, base_channels=32)
    vq_kwargs.update(layers_per_block=1, block_out_channels=(32, 32, 32))
    vqvae = VQModel(**vq_kwargs).eval()
    return {"transformer": transformer, "vqvae": vqvae,
            "decoding_config": DecodingConfig(strategy="mc-sjd", window=4, guidance_scale=2.0, top_k=40)}


def get_dummy_inputs(seed: int = 0, count: int = 2) -> dict:
    return {"class_labels": list(range(count)), "generator": [torch.Generator().manual_seed(seed + i) for i in range(count)],
            "output_type": "latent"}


@pytest.fixture
def pipe():
    pipeline = LlamaGenPipeline(**get_dummy_components())
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


def test_signature_has_the_usual_arguments():
    params = inspect.signature(LlamaGenPipeline.__call__).parameters
    for name in ("class_labels", "guidance_scale", "temperature", "top_k", "top_p", "decoding", "num_images_per_prompt",
                 "generator", "output_type", "return_dict", "callback_on_step_end", "callback_on_step_end_tensor_inputs"):
        assert name in params


@pytest.mark.parametrize("output_type", ["pil", "np", "pt", "latent"])
def test_output_types(pipe, output_type):
    out = pipe(**{**get_dummy_inputs(), "output_type": output_type})
    images = out.images
    if output_type == "pil":
        assert len(images) == 2 and isinstance(images[0], PIL.Image.Image) and images[0].size == (16, 16)
    elif output_type == "np":
        assert isinstance(images, np.ndarray) and images.shape == (2, 16, 16, 3) and images.min() >= 0 and images.max() <= 1
    elif output_type == "pt":
        assert isinstance(images, torch.Tensor) and images.shape == (2, 3, 16, 16) and float(images.min()) >= 0
    else:
        assert images.shape == (2, 4, 4) and images.dtype == torch.long
    assert len(out.stats) == 2 and out.stats[0]["method"] == "mc-sjd-maximal:window=4" and out.stats[0]["tokens"] == 16


def test_return_dict_false_and_decoding_override(pipe):
    """``return_dict=False`` returns ``(images,)`` as diffusers' image pipelines; statistics are in ``last_stats``."""
    (images,) = pipe(**get_dummy_inputs(), return_dict=False, decoding="ar")
    assert images.shape == (2, 4, 4) and all(s["nfe"] == 16 and s["method"] == "ar" for s in pipe.last_stats)
    pipe(**get_dummy_inputs(), return_dict=False, decoding=DecodingConfig(strategy="sjd", init="vertical", window=3))
    assert pipe.last_stats[0]["method"] == "sjd-vertical:window=3"


def test_save_load_round_trip(pipe, tmp_path):
    pipe.save_pretrained(tmp_path)
    loaded = LlamaGenPipeline.from_pretrained(tmp_path)
    loaded.set_progress_bar_config(disable=True)
    assert loaded.decoding_config == pipe.decoding_config and isinstance(loaded.decoding_config, DecodingConfig)
    assert torch.equal(loaded(**get_dummy_inputs()).images, pipe(**get_dummy_inputs()).images)
    a = pipe(**{**get_dummy_inputs(), "output_type": "pt"}).images
    b = loaded(**{**get_dummy_inputs(), "output_type": "pt"}).images
    torch.testing.assert_close(a, b)


def test_batch_matches_single_with_per_image_generators(pipe):
    batch = pipe(class_labels=[0, 3, 4], generator=[torch.Generator().manual_seed(s) for s in (7, 8, 9)], output_type="latent")
    for i, (label, seed) in enumerate(zip((0, 3, 4), (7, 8, 9))):
        single = pipe(class_labels=label, generator=[torch.Generator().manual_seed(seed)], output_type="latent")
        assert torch.equal(single.images[0], batch.images[i])
        assert single.stats[0]["nfe"] == batch.stats[i]["nfe"]


def test_num_images_per_prompt_and_single_generator(pipe):
    out = pipe(class_labels=[1, 2], num_images_per_prompt=3, generator=torch.Generator().manual_seed(0), output_type="latent")
    again = pipe(class_labels=[1, 2], num_images_per_prompt=3, generator=torch.Generator().manual_seed(0), output_type="latent")
    assert out.images.shape == (6, 4, 4) and torch.equal(out.images, again.images)


def test_callback_on_step_end_sees_committed_tokens(pipe):
    calls = []

    def callback(p, step, timestep, kwargs):
        assert p is pipe and set(kwargs) == {"tokens", "num_committed"}
        calls.append((step, kwargs["num_committed"].clone(), kwargs["tokens"].clone()))
        return kwargs  # unchanged: accepted

    out = pipe(**get_dummy_inputs(), callback_on_step_end=callback, callback_on_step_end_tensor_inputs=["tokens", "num_committed"])
    assert calls and calls[-1][1].tolist() == [16, 16]
    assert torch.equal(calls[-1][2], out.images.flatten(1))
    assert [c[0] for c in calls] == list(range(1, len(calls) + 1))
    with pytest.raises(ValueError, match="callback_on_step_end_tensor_inputs"):
        pipe(**get_dummy_inputs(), callback_on_step_end=callback, callback_on_step_end_tensor_inputs=["latents"])



@pytest.mark.parametrize("decoding", ["ar", "mc-sjd", "sjd"])
def test_callback_token_edits_are_applied(pipe, decoding):
    """Committed tokens returned by the callback are kept and decoding continues from them (the exactness of
    what follows is tested in test_exactness.py); undecided ones cannot be set, guidance cannot change."""
    seen = {}

    def rewrite(p, step, timestep, kwargs):
        if step == 3:
            tokens = kwargs["tokens"]
            seen["committed"] = tokens >= 0
            tokens[tokens >= 0] = 5
        return kwargs

    out = pipe(**get_dummy_inputs(), decoding=decoding, callback_on_step_end=rewrite)
    grid = out.images.flatten(1)
    assert bool((grid[seen["committed"]] == 5).all()) and bool((grid[~seen["committed"]] >= 0).all())
    reference = pipe(**get_dummy_inputs(), decoding=decoding).images.flatten(1)
    assert not torch.equal(grid, reference)

    def ahead(p, step, timestep, kwargs):
        kwargs["tokens"][kwargs["tokens"] < 0] = 1
        return kwargs

    with pytest.raises(ValueError, match="may change committed tokens only"):
        pipe(**get_dummy_inputs(), decoding=decoding, callback_on_step_end=ahead)

    def out_of_vocab(p, step, timestep, kwargs):
        kwargs["tokens"][kwargs["tokens"] >= 0] = 10**6
        return kwargs

    with pytest.raises(ValueError, match=r"image token ids in \[0, "):
        pipe(**get_dummy_inputs(), decoding=decoding, callback_on_step_end=out_of_vocab)

    def guidance(p, step, timestep, kwargs):
        p._guidance_scale = 7.0
        return kwargs

    with pytest.raises(ValueError, match="cannot change guidance_scale"):
        pipe(**get_dummy_inputs(), decoding=decoding, callback_on_step_end=guidance)


def test_progress_bar_counts_tokens(pipe, capsys):
    pipe.set_progress_bar_config(disable=False)
    pipe(**get_dummy_inputs())
    assert "32/32" in capsys.readouterr().err


def test_caption_model_and_dtype_move():
    pipeline = LlamaGenPipeline(**get_dummy_components("t2i"))
    pipeline.set_progress_bar_config(disable=True)
    captions = torch.randn(2, 3, 8)
    out = pipeline(prompt_embeds=captions, prompt_mask=torch.tensor([[0, 1, 1], [1, 1, 1]]), output_type="pt",
                   generator=[torch.Generator().manual_seed(i) for i in range(2)])
    assert out.images.shape == (2, 3, 16, 16)
    with pytest.raises(ValueError, match="prompt_embeds"):
        pipeline(class_labels=[0])
    pipeline.to(dtype=torch.bfloat16)
    assert pipeline.transformer.dtype == torch.bfloat16
    assert pipeline(prompt_embeds=captions, output_type="pt").images.shape == (2, 3, 16, 16)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(class_labels=[5]), "class_labels"),
        (dict(class_labels=[-1, 0]), "class_labels"),
        (dict(class_labels="cat"), "class_labels"),
        (dict(class_labels=[0], output_type="jpeg"), "output_type"),
        (dict(class_labels=[0], num_images_per_prompt=0), "num_images_per_prompt"),
        (dict(class_labels=[0, 1], generator=[torch.Generator()]), "generator"),
        (dict(class_labels=[0], decoding="fastest"), "decoding"),
        (dict(class_labels=[0], top_k=65), "top_k"),
        (dict(class_labels=[0], temperature=-1.0), "temperature"),
    ],
)
def test_bad_inputs_name_the_argument(pipe, kwargs, match):
    with pytest.raises(ValueError, match=match):
        pipe(**kwargs)


def test_unknown_model_name_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown model"):
        LlamaGenPipeline.from_pretrained("someone/llamagen-xl")


def test_relaxed_acceptance_and_draft_model_decoding_through_the_pipeline(tmp_path):
    components = get_dummy_components()
    drafter = tiny_gpt(vocab_size=64, block_size=16, num_classes=5, std=0.3, seed=3, dim=16, n_layer=1)
    pipe = LlamaGenPipeline(**components, drafter=drafter)
    pipe.set_progress_bar_config(disable=True)
    out = pipe(**get_dummy_inputs(), decoding="mc-sjd+lantern:k=8,delta=0.2")
    assert out.stats[0]["method"] == "mc-sjd-maximal:window=4+lantern:k=8,delta=0.2" and "tv_mean" in out.stats[0]
    assert pipe.lantern_neighbors["raw"].shape == (64, 63)  # computed once per tokenizer, cached
    same = pipe(**get_dummy_inputs(), decoding="mc-sjd", acceptance=AcceptanceConfig(rule="lantern", lantern_k=8, lantern_delta=0.2))
    assert torch.equal(same.images, out.images)
    gsd = pipe(**get_dummy_inputs(), decoding="sjd", acceptance="gsd")
    assert gsd.stats[0]["method"].startswith("sjd-horizontal:window=4+gsd")
    sd = pipe(**get_dummy_inputs(), decoding="sd:window=3")
    assert sd.stats[0]["method"] == "sd:window=3" and sd.stats[0]["drafter_nfe"] > 0
    # the neighbour table and the drafter are saved with the pipeline
    pipe.save_pretrained(tmp_path)
    loaded = LlamaGenPipeline.from_pretrained(tmp_path)
    loaded.set_progress_bar_config(disable=True)
    assert torch.equal(loaded.lantern_neighbors["raw"], pipe.lantern_neighbors["raw"])
    assert torch.equal(loaded(**get_dummy_inputs(), decoding="sd:window=3").images, sd.images)
    with pytest.raises(ValueError, match="not both"):
        pipe(**get_dummy_inputs(), decoding="sjd+gsd", acceptance="lantern")
    with pytest.raises(ValueError, match="drafter"):
        LlamaGenPipeline(**components)(**get_dummy_inputs(), decoding="sd")
    with pytest.raises(ValueError, match="'lantern': k=64 exceeds"):
        pipe(**get_dummy_inputs(), acceptance="lantern:k=64")
