"""The diffusers pipeline contract (the checks of diffusers' ``PipelineTesterMixin``, written for vispec) for
the three pipelines (``LlamaGenPipeline``, ``UnifiedImagePipeline``, ``MaskedDiffusionLMPipeline``), on tiny random
components.

Covered here: the ``__call__`` signature, ``components``, save / load (local, optional components, variants, the
generic ``DiffusionPipeline`` loader in a fresh process, ``from_pipe``), dict vs tuple outputs, batch vs single
identity (prompts of different lengths, one generator or one per sample), ``num_images_per_prompt``,
``encode_prompt`` in isolation, callback inputs, ``PipelineCallback``, CFG callbacks, ``interrupt``,
``guidance_scale`` / ``num_timesteps``, ``to(dtype)``. Both offloads: ``tests/pipelines/test_offload.py``; bad inputs:
``tests/pipelines/test_inputs.py``.

diffusers' own mixin (``tests/pipelines/test_pipelines_common.py`` in the diffusers repository, not in the wheel),
run unchanged on the three pipelines, passes every check that applies; each check it fails, fails for a reason
below. What cannot apply to an AR model (or to these pipelines), and why:

* ``num_inference_steps`` (image pipelines: ``test_pipeline_call_signature``, ``test_num_inference_steps``):
  an AR decoder takes as many forwards as the image needs; ``num_timesteps`` is AR's count, an upper bound
  for the speculative decoders. The mixin's ``test_inference_batch_single_identical`` copies
  ``num_inference_steps`` from the dummy inputs into the batched ones (a ``KeyError`` without it); with nothing
  to copy (``additional_params_copy_to_batched_inputs=[]``, as diffusers' tests of pipelines without steps
  pass) it passes for all three. The text pipeline takes LLaDA2's per-block ``num_inference_steps``.
* ``latents`` (all three: ``test_pipeline_call_signature``, ``test_latents_input``, ``prepare_latents``): decoding
  starts from the condition alone; there is no initial noise to pass in. The text pipeline has
  ``num_sequences_per_prompt`` for ``num_images_per_prompt`` (diffusers' ``LLaDA2Pipeline`` has neither).
* Prompt embeddings (``UnifiedImagePipeline``: ``prompt_embeds``, ``negative_prompt_embeds`` and
  ``cross_attention_kwargs`` of the mixin's text-to-image parameters; ``test_encode_prompt_works_in_isolation``):
  a unified-token model has no separate text encoder. The transformer reads the prompt's token ids through
  its own embedding table, in one sequence with the image, so there are no embeddings to compute apart and
  pass in, and no cross attention. ``encode_prompt`` is tokenization in the model's template and works with
  the tokenizer alone (``test_encode_prompt_works_in_isolation`` here); the mixin's version also builds the
  pipeline with every other ``__init__`` argument set to ``None``, the image layout included.
* The image layout as ``__init__`` arguments (``UnifiedImagePipeline``, ``test_components_function``): the ids of
  image start / end, end of row, codes and resolution tokens and the prompt template are the pipeline's
  config (saved in ``model_index.json``), given to ``__init__`` next to the components as diffusers pipelines
  give their flags. The mixin drops only ``str`` / ``int`` / ``float`` arguments before comparing with
  ``pipe.components``, so the list (``image_end_ids``, ``prompt_suffix_ids``) and ``None`` settings count as
  components there. ``pipe.components`` holds exactly the modules (``test_components_are_the_modules`` here).
* Optional components set to ``None`` (``test_save_load_optional_components``): without ``vqvae`` a Chameleon
  transformer cannot turn codes into pixels, so the mixin's ``output_type="np"`` is refused (before decoding);
  with ``"latent"`` the check holds. Without a tokenizer the text pipeline cannot encode ``prompt``; with
  ``input_ids`` (as ``LLaDA2Pipeline``, whose tokenizer is optional too) the check holds. Both here.
* Sequential offload (``test_sequential_cpu_offload_forward_pass``, ``..._twice``): the outputs equal those
  without offload, but the mixin's further check that every offloaded component's ``.device`` is ``meta`` does
  not hold for vispec's own models (``LlamaGenGPT``, ``LLaDAModelLM``): their ``device`` reports where they
  compute (accelerate's execution device) while the weights are parked on ``meta``, because the decoders place
  their inputs with it every step. transformers' and diffusers' models (the unified transformer, ``vqvae``)
  report ``meta``.
* Long prompts: the mixin batches a 900-character prompt. The tiny text model's context is 64 tokens, so the
  pipeline refuses that prompt before decoding (``test_inference_batch_consistent``); with a longer context
  it passes.
* Callbacks on ``latents`` (``test_callback_inputs`` asks for ``["latents"]`` and zeroes them at the last step):
  there are none, so the name is refused as diffusers refuses names outside ``_callback_tensor_inputs`` (and
  the text pipeline's outputs are ``"seq"`` / ``"text"``, as ``LLaDA2Pipeline``'s, not the mixin's ``"latent"``);
  returned committed ``tokens`` (image pipelines) or ``sequences`` (text) are applied instead
  (``tests/pipelines/test_llamagen_pipeline.py``, ``test_unified_pipeline.py``; exactness after an edit in
  ``tests/exactness/test_exactness.py``). CFG callbacks that change the guidance scale (``test_callback_cfg``):
  the image decoders fix the target distribution at the start (exactness is certified against it, and a
  speculative step is not one token position, so a per-step scale would depend on which drafts were
  accepted), so both image pipelines refuse them with an error. The text pipeline applies both, as
  ``LLaDA2Pipeline`` applies a block.
* Attention slicing, xFormers, VAE tiling / slicing, ``float16``, ``to("cuda")``, group offloading, device maps
  and ``enable_model_cpu_offload()`` without a device (``test_cpu_offload_forward_pass_twice``): no such
  processors, and no GPU in CI (the mixin skips them on the CPU).
* ``PipelineFromPipeTesterMixin``: ``from_pipe`` to and from a StableDiffusion pipeline downloaded from the Hub;
  these pipelines share no component with it. ``from_pipe`` itself is tested here.
"""

from __future__ import annotations

import inspect
import json
import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from diffusers.callbacks import PipelineCallback

from vispec.dllm import LLaDAScheduler, ThresholdScheduler
from vispec.pipelines import LlamaGenPipeline, MaskedDiffusionLMPipeline, UnifiedImagePipeline

from helpers import gens, image_inputs, image_pipe, text_pipe
from unified_helpers import tiny_unified_pipeline

PROMPTS = ["a red cat on the grass", "blue sky", "very long " * 20]  # different lengths, as the mixin's batch


@pytest.fixture(scope="module")
def ipipe():
    return image_pipe()


@pytest.fixture(scope="module")
def tpipe():
    return text_pipe()


@pytest.fixture(scope="module")
def upipe():
    return tiny_unified_pipeline()


def unified_inputs(count: int = 2, seed: int = 0, **overrides) -> dict:
    """The unified pipeline's call on the first ``count`` of :data:`PROMPTS`, one generator each, code grids out."""
    return {"prompt": PROMPTS[:count], "generator": gens(count, seed), "output_type": "latent", **overrides}


def settings(pipe: UnifiedImagePipeline) -> dict:
    """The unified pipeline's ``__init__`` arguments that are config, not components (the image layout)."""
    return {k: v for k, v in pipe.config.items() if not k.startswith("_") and k not in pipe.components}


# ---------------------------------------------------------------------- signature
def test_call_signatures_have_the_required_optional_params():
    """PipelineTesterMixin's required_optional_params, minus those an AR model has not (module docstring)."""
    common = ("generator", "output_type", "return_dict", "callback_on_step_end", "callback_on_step_end_tensor_inputs")
    for pipe_cls in (LlamaGenPipeline, UnifiedImagePipeline):
        image = inspect.signature(pipe_cls.__call__).parameters
        optional = {name for name, p in image.items() if p.default is not inspect.Parameter.empty}
        assert set(common + ("num_images_per_prompt", "guidance_scale")) <= optional
        assert "num_inference_steps" not in image and "latents" not in image
    unified = inspect.signature(UnifiedImagePipeline.__call__).parameters
    assert {"prompt", "negative_prompt", "height", "width"} <= set(unified)  # the text-to-image set, less embeddings
    text = inspect.signature(MaskedDiffusionLMPipeline.__call__).parameters
    assert all(name in text for name in common + ("num_inference_steps", "guidance_scale", "num_sequences_per_prompt"))
    for pipe_cls in (LlamaGenPipeline, UnifiedImagePipeline, MaskedDiffusionLMPipeline):
        assert set(pipe_cls._callback_tensor_inputs) and all(isinstance(n, str) for n in pipe_cls._callback_tensor_inputs)
        for prop in ("guidance_scale", "num_timesteps", "interrupt"):
            assert isinstance(getattr(pipe_cls, prop), property)


def test_components_are_the_modules(ipipe, upipe, tpipe):
    """diffusers' test_components_function: ``components`` holds the modules ``__init__`` takes, and nothing else
    (the unified pipeline's layout is config); a pipeline built again from them (and the config) decodes the same."""
    assert set(ipipe.components) == {"transformer", "vqvae", "decoding_config", "drafter", "gad_drafter", "text_encoder",
                                     "tokenizer"}
    assert set(upipe.components) == {"transformer", "tokenizer", "vqvae", "decoding_config"}
    assert set(tpipe.components) == {"model", "tokenizer", "scheduler", "filter"}
    again = UnifiedImagePipeline(**upipe.components, **settings(upipe))
    again.set_progress_bar_config(disable=True)
    assert settings(again) == settings(upipe)
    assert torch.equal(again(**unified_inputs()).images, upipe(**unified_inputs()).images)
    image = LlamaGenPipeline(**ipipe.components)
    image.set_progress_bar_config(disable=True)
    assert torch.equal(image(**image_inputs()).images, ipipe(**image_inputs()).images)


# ---------------------------------------------------------------------- outputs
def test_dict_and_tuple_outputs_are_equivalent(ipipe, upipe, tpipe):
    timeless = lambda stats: [{k: v for k, v in row.items() if k != "latency_s"} for row in stats]  # noqa: E731
    for pipe, inputs in ((ipipe, image_inputs), (upipe, unified_inputs)):
        out = pipe(**inputs(output_type="np"))
        (images,) = pipe(**inputs(output_type="np"), return_dict=False)
        assert np.array_equal(images, out.images) and timeless(pipe.last_stats) == timeless(out.stats)
    text = tpipe(prompt=["sort the list", "reverse"])
    sequences, texts = tpipe(prompt=["sort the list", "reverse"], return_dict=False)
    assert torch.equal(sequences, text.sequences) and texts == text.texts and len(tpipe.last_stats) == 2


def test_batch_matches_single_and_num_per_prompt(ipipe, tpipe):
    batch = ipipe(class_labels=[[4], [1]], generator=gens(2, 7), output_type="latent")  # nested, as DiT accepts
    for i, label in enumerate((4, 1)):
        single = ipipe(class_labels=label, generator=gens(2, 7)[i:i + 1], output_type="latent")
        assert torch.equal(single.images[0], batch.images[i])
    per = ipipe(class_labels=[4, 1], num_images_per_prompt=2, generator=[gens(2, 7)[i] for i in (0, 0, 1, 1)],
                output_type="latent")
    assert per.images.shape == (4, 4, 4) and torch.equal(per.images[0], per.images[1])
    assert torch.equal(per.images[::2], batch.images)
    text = tpipe(prompt=["sort the list", "reverse"], temperature=0.7, generator=gens(4), num_sequences_per_prompt=2,
                 output_type="seq")
    assert text.sequences.shape == (4, 8)
    with pytest.raises(ValueError, match="generator list has 2 entries, expected one per sample \\(4\\)"):
        ipipe(class_labels=[4, 1], num_images_per_prompt=2, generator=gens(2))


def test_prompt_batches_match_single_prompts(upipe, tpipe):
    """diffusers' test_inference_batch_single_identical on the prompt pipelines: prompts of different lengths (left
    padded together) and one generator per sample give what each prompt gives alone, with one generator."""
    batch = upipe(**unified_inputs(count=3))
    assert batch.images.shape == (3, 4, 4)
    for i, prompt in enumerate(PROMPTS):
        single = upipe(prompt, generator=gens(3)[i], output_type="latent")
        assert torch.equal(single.images[0], batch.images[i])
    per = upipe(PROMPTS[:2], num_images_per_prompt=2, generator=[gens(2)[i] for i in (0, 0, 1, 1)], output_type="latent")
    assert per.images.shape == (4, 4, 4) and torch.equal(per.images[::2], batch.images[:2])
    with pytest.raises(ValueError, match="generator list has 2 entries, expected one per sample \\(4\\)"):
        upipe(PROMPTS[:2], num_images_per_prompt=2, generator=gens(2))
    prompts = ["sort the list", "reverse", "what is one plus two"]
    text = tpipe(prompt=prompts, temperature=0.7, generator=gens(3), output_type="seq").sequences
    for i, prompt in enumerate(prompts):
        assert torch.equal(tpipe(prompt=prompt, temperature=0.7, generator=gens(3)[i], output_type="seq").sequences[0], text[i])


def test_guidance_changes_the_output(ipipe, upipe):
    """diffusers' test_cfg: guidance is wired to the model (and 1 turns it off)."""
    for pipe, inputs in ((ipipe, image_inputs), (upipe, unified_inputs)):
        off = pipe(**inputs(guidance_scale=1.0))
        assert pipe.guidance_scale == 1.0
        on = pipe(**inputs(guidance_scale=4.0))
        assert pipe.guidance_scale == 4.0 and not torch.equal(off.images, on.images)


def test_to_dtype(tmp_path):
    pipe = image_pipe()
    pipe.to(torch.bfloat16)
    assert {c.dtype for c in pipe.components.values() if isinstance(c, torch.nn.Module)} == {torch.bfloat16}
    assert pipe(**image_inputs(output_type="pt")).images.dtype == torch.float32  # post-processed in float32
    text = text_pipe()
    text.to(dtype=torch.bfloat16)
    assert text.model.dtype == torch.bfloat16 and text(prompt="sort the list", output_type="seq").sequences.shape == (1, 8)
    unified = tiny_unified_pipeline()
    unified.to(dtype=torch.bfloat16)
    assert {c.dtype for c in unified.components.values() if isinstance(c, torch.nn.Module)} == {torch.bfloat16}
    pixels = unified(**unified_inputs(count=1, output_type="pt")).images
    assert pixels.dtype == torch.float32 and pixels.shape == (1, 3, 16, 16)


# ---------------------------------------------------------------------- save / load
def test_save_load_local_with_and_without_optional_components(ipipe, tpipe, tmp_path):
    ipipe.acceptance_rule("lantern:k=8")  # a neighbour table to save
    ipipe.save_pretrained(tmp_path / "img")
    loaded = LlamaGenPipeline.from_pretrained(tmp_path / "img")
    loaded.set_progress_bar_config(disable=True)
    assert loaded.drafter is not None and torch.equal(loaded.lantern_neighbors["raw"], ipipe.lantern_neighbors["raw"])
    for spec in ("mc-sjd", "sd:window=3"):
        assert torch.equal(loaded(**image_inputs(decoding=spec)).images, ipipe(**image_inputs(decoding=spec)).images)
    index = json.loads((tmp_path / "img" / "model_index.json").read_text())
    assert index["_class_name"] == ["pipeline_llamagen", "LlamaGenPipeline"]  # diffusers' custom-pipeline format

    without = image_pipe(drafter=False)
    without.save_pretrained(tmp_path / "bare")
    assert json.loads((tmp_path / "bare" / "model_index.json").read_text())["drafter"] == [None, None]
    bare = LlamaGenPipeline.from_pretrained(tmp_path / "bare")
    assert bare.drafter is None
    given = LlamaGenPipeline.from_pretrained(tmp_path / "bare", drafter=ipipe.drafter)  # passed in, as diffusers allows
    assert given.drafter is ipipe.drafter

    tpipe.save_pretrained(tmp_path / "txt")
    text = MaskedDiffusionLMPipeline.from_pretrained(tmp_path / "txt")
    text.set_progress_bar_config(disable=True)
    assert torch.equal(text(prompt="sort the list").sequences, tpipe(prompt="sort the list").sequences)
    no_tokenizer = MaskedDiffusionLMPipeline(model=tpipe.model, tokenizer=None, scheduler=LLaDAScheduler(),
                                             default_gen_length=8, default_block_length=4)
    no_tokenizer.save_pretrained(tmp_path / "txt-bare")
    bare_text = MaskedDiffusionLMPipeline.from_pretrained(tmp_path / "txt-bare")
    bare_text.set_progress_bar_config(disable=True)
    assert bare_text.tokenizer is None
    ids, mask = tpipe.prepare_input_ids(prompt=["sort the list", "reverse"])  # the tokenizer's work, done beforehand
    want = tpipe(input_ids=ids, attention_mask=mask, output_type="seq").sequences
    assert torch.equal(bare_text(input_ids=ids, attention_mask=mask, output_type="seq").sequences, want)


def test_unified_save_load_with_and_without_vqvae(upipe, tmp_path):
    """The unified pipeline saved and loaded (its layout config too); without its optional ``vqvae`` it saves
    ``[None, None]``, loads with ``vqvae=None`` and decodes the same codes; pixels then need a decoder and are
    refused before decoding (module docstring)."""
    upipe.save_pretrained(tmp_path / "t2i")
    loaded = UnifiedImagePipeline.from_pretrained(tmp_path / "t2i")
    loaded.set_progress_bar_config(disable=True)
    assert settings(loaded) == settings(upipe)
    assert np.array_equal(loaded(**unified_inputs(output_type="np")).images, upipe(**unified_inputs(output_type="np")).images)

    without = UnifiedImagePipeline(**{**upipe.components, "vqvae": None}, **settings(upipe))
    without.save_pretrained(tmp_path / "bare")
    assert json.loads((tmp_path / "bare" / "model_index.json").read_text())["vqvae"] == [None, None]
    bare = UnifiedImagePipeline.from_pretrained(tmp_path / "bare")
    bare.set_progress_bar_config(disable=True)
    assert bare.vqvae is None
    assert torch.equal(bare(**unified_inputs()).images, upipe(**unified_inputs()).images)
    calls = []
    for module in bare.transformer.modules():
        module.register_forward_pre_hook(lambda *args: calls.append(1))
    with pytest.raises(ValueError, match="output_type='np' needs an image decoder"):
        bare(**unified_inputs(output_type="np"))
    assert not calls  # refused before decoding
    given = UnifiedImagePipeline.from_pretrained(tmp_path / "bare", vqvae=upipe.vqvae)  # passed in, as diffusers allows
    assert given.vqvae is upipe.vqvae


def test_save_load_variant(tmp_path):
    pipe = image_pipe()
    pipe.save_pretrained(tmp_path, variant="v2")
    assert (tmp_path / "transformer" / "diffusion_pytorch_model.v2.safetensors").is_file()
    loaded = LlamaGenPipeline.from_pretrained(tmp_path, variant="v2")
    loaded.set_progress_bar_config(disable=True)
    assert torch.equal(loaded(**image_inputs()).images, pipe(**image_inputs()).images)
    with pytest.raises(ValueError, match="variant"):
        LlamaGenPipeline.from_pretrained(tmp_path, variant="v3")
    unified = tiny_unified_pipeline()
    unified.save_pretrained(tmp_path / "t2i", variant="v2")
    assert any(".v2." in f.name for f in (tmp_path / "t2i" / "transformer").iterdir())
    loaded = UnifiedImagePipeline.from_pretrained(tmp_path / "t2i", variant="v2")
    loaded.set_progress_bar_config(disable=True)
    assert torch.equal(loaded(**unified_inputs()).images, unified(**unified_inputs()).images)
    with pytest.raises(ValueError, match="variant"):
        UnifiedImagePipeline.from_pretrained(tmp_path / "t2i", variant="v3")


def test_from_pipe_keeps_every_component(ipipe, upipe, tpipe):
    unified = UnifiedImagePipeline.from_pipe(upipe)
    assert all(getattr(unified, name) is component for name, component in upipe.components.items())
    assert settings(unified) == settings(upipe)
    new_default = UnifiedImagePipeline.from_pipe(upipe, default_height=8)  # a config value replaced, as diffusers allows
    assert new_default.config.default_height == 8 and new_default.transformer is upipe.transformer
    ipipe.acceptance_rule("lantern:k=8")
    image = LlamaGenPipeline.from_pipe(ipipe)
    assert image.transformer is ipipe.transformer and image.drafter is ipipe.drafter and image.vqvae is ipipe.vqvae
    assert image.lantern_neighbors["raw"] is ipipe.lantern_neighbors["raw"]
    text = MaskedDiffusionLMPipeline.from_pipe(tpipe)  # the model's annotation is Any: diffusers alone dropped it
    assert text.model is tpipe.model and text.tokenizer is tpipe.tokenizer and text.config.default_gen_length == 8
    other = MaskedDiffusionLMPipeline.from_pipe(tpipe, scheduler=ThresholdScheduler(0.5))
    assert isinstance(other.scheduler, ThresholdScheduler) and other.model is tpipe.model


@pytest.mark.slow
def test_generic_loader_in_a_fresh_process(ipipe, upipe, tpipe, tmp_path):
    """``DiffusionPipeline.from_pretrained(folder, trust_remote_code=True)``, in a process that never imported
    vispec, resolves the pipeline class and every component (drafter, LANTERN table, tokenizer, scheduler)."""
    ipipe.acceptance_rule("lantern:k=8")
    ipipe.save_pretrained(tmp_path / "img")
    tpipe.save_pretrained(tmp_path / "txt")
    upipe.save_pretrained(tmp_path / "t2i")
    want_image = ipipe(**image_inputs(decoding="sd:window=3")).images
    want_text = tpipe(prompt="sort the list").sequences
    want_unified = upipe("a red cat", generator=gens(1)[0], output_type="latent").images
    torch.save({"image": want_image, "text": want_text, "unified": want_unified}, tmp_path / "want.pt")
    script = textwrap.dedent(f"""
        import sys, torch
        from diffusers import DiffusionPipeline
        want = torch.load({str(tmp_path / 'want.pt')!r})
        try:
            DiffusionPipeline.from_pretrained({str(tmp_path / 'img')!r})
            raise SystemExit("loaded custom code without trust_remote_code")
        except ValueError as err:
            assert "trust_remote_code=True" in str(err), err
        assert "vispec" not in sys.modules
        pipe = DiffusionPipeline.from_pretrained({str(tmp_path / 'img')!r}, trust_remote_code=True)
        pipe.set_progress_bar_config(disable=True)
        assert type(pipe).__name__ == "LlamaGenPipeline" and pipe.drafter is not None
        assert pipe.lantern_neighbors["raw"].shape == (64, 63)
        gens = [torch.Generator().manual_seed(i) for i in range(2)]
        out = pipe(class_labels=[0, 1], generator=gens, output_type="latent", decoding="sd:window=3")
        assert torch.equal(out.images, want["image"])
        text = DiffusionPipeline.from_pretrained({str(tmp_path / 'txt')!r}, trust_remote_code=True)
        text.set_progress_bar_config(disable=True)
        assert type(text).__name__ == "MaskedDiffusionLMPipeline"
        assert torch.equal(text(prompt="sort the list").sequences, want["text"])
        unified = DiffusionPipeline.from_pretrained({str(tmp_path / 't2i')!r}, trust_remote_code=True)
        unified.set_progress_bar_config(disable=True)
        assert type(unified).__name__ == "UnifiedImagePipeline" and unified.config.prompt_template == "draw {{prompt}}"
        out = unified("a red cat", generator=torch.Generator().manual_seed(0), output_type="latent")
        assert torch.equal(out.images, want["unified"])
    """)
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules")}
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]


def test_loading_the_wrong_kind_or_an_incomplete_folder(ipipe, tmp_path):
    ipipe.save_pretrained(tmp_path / "img")
    with pytest.raises(ValueError, match="holds a LlamaGenPipeline .*not a MaskedDiffusionLMPipeline.*"
                                         "LlamaGenPipeline.from_pretrained"):
        MaskedDiffusionLMPipeline.from_pretrained(tmp_path / "img")
    shutil.rmtree(tmp_path / "img" / "vqvae")
    with pytest.raises(ValueError, match="lacks the subfolder vqvae/"):
        LlamaGenPipeline.from_pretrained(tmp_path / "img")


def test_loading_a_unified_folder_as_another_kind(upipe, tmp_path):
    upipe.save_pretrained(tmp_path / "t2i")
    with pytest.raises(ValueError, match="holds a UnifiedImagePipeline .*not a LlamaGenPipeline.*"
                                         "UnifiedImagePipeline.from_pretrained"):
        LlamaGenPipeline.from_pretrained(tmp_path / "t2i")
    shutil.rmtree(tmp_path / "t2i" / "transformer")
    with pytest.raises(ValueError, match="lacks the subfolder transformer/"):
        UnifiedImagePipeline.from_pretrained(tmp_path / "t2i")


def test_encode_prompt_works_in_isolation(upipe):
    """diffusers' test_encode_prompt_works_in_isolation, in the form that applies (module docstring): the unified
    pipeline's ``encode_prompt`` (tokenization in the model's template) needs the tokenizer alone."""
    alone = UnifiedImagePipeline(transformer=None, tokenizer=upipe.tokenizer, decoding_config=upipe.decoding_config,
                                 **settings(upipe))
    ids = alone.encode_prompt(PROMPTS, height=16, width=16)
    assert ids == upipe.encode_prompt(PROMPTS, height=16, width=16)
    assert ids == upipe.tokenizer([f"draw {p}" for p in PROMPTS])["input_ids"]  # the template "draw {prompt}"


# ---------------------------------------------------------------------- callbacks
class CountSteps(PipelineCallback):
    """A diffusers PipelineCallback: requests its own tensor inputs and returns them unchanged."""

    tensor_inputs = ["num_committed"]

    def callback_fn(self, pipeline, step_index, timestep, callback_kwargs):
        self.calls = getattr(self, "calls", 0) + 1
        assert set(callback_kwargs) == {"num_committed"}
        return callback_kwargs


def test_callback_inputs_and_pipeline_callbacks(ipipe, upipe, tpipe):
    """diffusers' test_callback_inputs: only the requested names, all from ``_callback_tensor_inputs``; a name
    outside them (the mixin's ``"latents"``) is refused before decoding, as diffusers refuses it."""
    seen = []

    def check(pipe, step, timestep, kwargs):
        assert set(kwargs) <= set(pipe._callback_tensor_inputs)
        seen.append((type(pipe).__name__, sorted(kwargs)))
        return kwargs

    for pipe, inputs in ((ipipe, image_inputs(count=1)), (upipe, unified_inputs(count=1)), (tpipe, {"prompt": "sort"})):
        pipe(**inputs, callback_on_step_end=check, callback_on_step_end_tensor_inputs=pipe._callback_tensor_inputs)
        pipe(**inputs, callback_on_step_end=check, callback_on_step_end_tensor_inputs=pipe._callback_tensor_inputs[:1])
        with pytest.raises(ValueError, match="callback_on_step_end_tensor_inputs \\['latents'\\] are not among"):
            pipe(**inputs, callback_on_step_end=check, callback_on_step_end_tensor_inputs=["latents"])
    assert {(name, tuple(kwargs)) for name, kwargs in seen} == {
        ("LlamaGenPipeline", ("num_committed", "tokens")), ("LlamaGenPipeline", ("tokens",)),
        ("UnifiedImagePipeline", ("num_committed", "tokens")), ("UnifiedImagePipeline", ("tokens",)),
        ("MaskedDiffusionLMPipeline", ("sequences", "transfer_index")), ("MaskedDiffusionLMPipeline", ("sequences",))}
    for pipe, inputs, steps in ((ipipe, image_inputs(), 15), (upipe, unified_inputs(), 19)):
        counter = CountSteps()
        out = pipe(**inputs, callback_on_step_end=counter)
        assert 0 < counter.calls <= pipe.num_timesteps == steps and counter.calls == max(s["nfe"] for s in out.stats) - 1
        with pytest.raises(ValueError, match="returned \\['latents'\\], which are not among"):
            pipe(**inputs, callback_on_step_end=lambda p, i, t, kw: {"latents": torch.zeros(1)})
    with pytest.raises(TypeError, match="must return a dict or None"):
        tpipe(prompt="sort", callback_on_step_end=lambda p, i, t, kw: [])


def test_text_callback_edits_are_applied(tpipe):
    """As LLaDA2Pipeline applies a returned block: a returned ``sequences`` replaces the canvas."""
    forced = tpipe.tokenizer.convert_tokens_to_ids("seven")

    def force(pipe, step, timestep, kwargs):
        sequences = kwargs["sequences"]
        if step == 0:
            sequences[:, 5] = forced  # commit a token of the second block
        return {"sequences": sequences}

    out = tpipe(prompt="sort the list", output_type="seq", early_stop_eos=False, callback_on_step_end=force)
    assert int(out.sequences[0, 5]) == forced
    assert out.stats[0]["nfe"] == 7  # one masked position less to decode (LLaDA's quota, one per step)

    def remask(pipe, step, timestep, kwargs):
        kwargs["sequences"][:] = pipe.mask_token_id
        return kwargs

    with pytest.raises(ValueError, match="not re-mask"):
        tpipe(prompt="sort the list", callback_on_step_end=remask)


def test_cfg_callbacks(ipipe, upipe, tpipe, monkeypatch):
    """diffusers' test_callback_cfg: the text pipeline applies a guidance scale changed by a callback; the image
    decoders fix the target at the start and refuse it (module docstring)."""
    from vispec.dllm.caches import NoCache

    used = []
    guide = NoCache.guide
    monkeypatch.setattr(NoCache, "guide", lambda self, logits: used.append(self.guidance.scale) or guide(self, logits))

    def increase(pipe, step, timestep, kwargs):
        pipe._guidance_scale += 1.0
        return kwargs

    tpipe(prompt="sort the list", guidance_scale=1.5, output_type="seq", callback_on_step_end=increase)
    assert tpipe.guidance_scale == 1.5 + tpipe.num_timesteps == 1.5 + 8
    assert used == [1.5 + step for step in range(8)]  # each forward mixes with the scale the last callback set
    with pytest.raises(ValueError, match="only when decoding started with guidance"):
        tpipe(prompt="sort the list", callback_on_step_end=increase)
    for pipe, inputs in ((ipipe, image_inputs()), (upipe, unified_inputs())):
        with pytest.raises(ValueError, match=f"{type(pipe).__name__} cannot change guidance_scale during decoding"):
            pipe(**inputs, callback_on_step_end=increase)


def test_interrupt_returns_what_is_done(ipipe, upipe, tpipe):
    def stop_after(n):
        def callback(pipe, step, timestep, kwargs):
            if step + 1 >= n:
                pipe._interrupt = True
            return kwargs
        return callback

    full = ipipe(**image_inputs(decoding="ar"))
    cut = ipipe(**image_inputs(decoding="ar"), callback_on_step_end=stop_after(5))
    # AR's step s commits token s (token 0 comes from the prefill): stopped after step 4, 5 tokens are done
    assert ipipe.interrupt and all(s == {"method": "ar", "interrupted": True, "tokens": 5, "steps": 4} for s in cut.stats)
    flat = cut.images.flatten(1)
    assert torch.equal(flat[:, :5], full.images.flatten(1)[:, :5]) and (flat[:, 5:] == -1).all()
    pixels = ipipe(**image_inputs(decoding="ar", output_type="pt"), callback_on_step_end=stop_after(5)).images
    assert pixels.shape == (2, 3, 16, 16) and torch.isfinite(pixels).all()
    assert not ipipe(**image_inputs(decoding="ar")).stats[0].get("interrupted")  # reset per call

    full = upipe(**unified_inputs(decoding="ar"))
    cut = upipe(**unified_inputs(decoding="ar"), callback_on_step_end=stop_after(5))
    # 5 tokens are the first row: 4 codes and its end-of-row token; the code grid keeps -1 where undecided
    assert upipe.interrupt and all(s == {"method": "ar", "interrupted": True, "tokens": 5, "steps": 4} for s in cut.stats)
    assert torch.equal(cut.images[:, 0], full.images[:, 0]) and (cut.images[:, 1:] == -1).all()
    pixels = upipe(**unified_inputs(decoding="ar", output_type="pt"), callback_on_step_end=stop_after(5)).images
    assert pixels.shape == (2, 3, 16, 16) and torch.isfinite(pixels).all()
    assert not upipe(**unified_inputs(decoding="ar")).stats[0].get("interrupted")

    whole = tpipe(prompt="sort the list", output_type="seq", early_stop_eos=False)
    part = tpipe(prompt="sort the list", output_type="seq", early_stop_eos=False, callback_on_step_end=stop_after(3))
    assert part.stats[0]["interrupted"] and part.stats[0]["nfe"] == 3
    mask_id = tpipe.mask_token_id
    done = part.sequences != mask_id
    assert int(done.sum()) == 3 and torch.equal(part.sequences[done], whole.sequences[done])
