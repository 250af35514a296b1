"""The diffusers pipeline contract (the checks of diffusers' ``PipelineTesterMixin``, written for vispec) for
both pipelines, on tiny random components.

Covered here: the ``__call__`` signature, save / load (local, optional components, variants, the generic
``DiffusionPipeline`` loader in a fresh process, ``from_pipe``), dict vs tuple outputs, batch vs single
identity, ``num_images_per_prompt``, callback inputs, ``PipelineCallback``, CFG callbacks, ``interrupt``,
``guidance_scale`` / ``num_timesteps``, ``to(dtype)``. Both offloads: ``tests/pipelines/test_offload.py``; bad inputs:
``tests/pipelines/test_inputs.py``.

What cannot apply to an AR image model, and why:

* ``num_inference_steps`` (``test_inference_batch_consistent`` with steps, ``test_num_inference_steps``):
  an AR decoder takes as many forwards as the image needs; ``num_timesteps`` is AR's count, an upper bound
  for the speculative decoders.
* ``latents`` (``test_latents_input``, ``prepare_latents``): decoding starts from the condition alone; there is
  no initial noise to pass in.
* Callbacks that rewrite ``latents`` (``test_callback_inputs`` returning modified tensors): there are none;
  returned committed ``tokens`` are applied instead (``tests/pipelines/test_llamagen_pipeline.py``; exactness after an
  edit in ``tests/exactness/test_exactness.py``). CFG callbacks that change the guidance scale (``test_callback_cfg``):
  the image decoders fix the target distribution at the start (exactness is certified against it), so the
  image pipeline refuses them with an error. The text pipeline applies both, as ``LLaDA2Pipeline`` applies a
  block.
* Attention slicing, xFormers, VAE tiling / slicing, ``float16`` and ``to("cuda")`` tests: no such processors,
  and no GPU in CI.
"""

from __future__ import annotations

import inspect
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from diffusers.callbacks import PipelineCallback

from vispec.dllm import LLaDAScheduler, ThresholdScheduler
from vispec.pipelines import LlamaGenPipeline, MaskedDiffusionLMPipeline

from helpers import gens, image_inputs, image_pipe, text_pipe


@pytest.fixture(scope="module")
def ipipe():
    return image_pipe()


@pytest.fixture(scope="module")
def tpipe():
    return text_pipe()


# ---------------------------------------------------------------------- signature
def test_call_signatures_have_the_required_optional_params():
    """PipelineTesterMixin's required_optional_params, minus those an AR model has not (module docstring)."""
    image = inspect.signature(LlamaGenPipeline.__call__).parameters
    text = inspect.signature(MaskedDiffusionLMPipeline.__call__).parameters
    common = ("generator", "output_type", "return_dict", "callback_on_step_end", "callback_on_step_end_tensor_inputs")
    assert all(name in image for name in common + ("num_images_per_prompt", "guidance_scale"))
    assert "num_inference_steps" not in image and "latents" not in image
    assert all(name in text for name in common + ("num_inference_steps", "guidance_scale", "num_sequences_per_prompt"))
    for pipe_cls in (LlamaGenPipeline, MaskedDiffusionLMPipeline):
        assert set(pipe_cls._callback_tensor_inputs) and all(isinstance(n, str) for n in pipe_cls._callback_tensor_inputs)
        for prop in ("guidance_scale", "num_timesteps", "interrupt"):
            assert isinstance(getattr(pipe_cls, prop), property)


# ---------------------------------------------------------------------- outputs
def test_dict_and_tuple_outputs_are_equivalent(ipipe, tpipe):
    out = ipipe(**image_inputs())
    (images,) = ipipe(**image_inputs(), return_dict=False)
    timeless = lambda stats: [{k: v for k, v in row.items() if k != "latency_s"} for row in stats]  # noqa: E731
    assert torch.equal(images, out.images) and timeless(ipipe.last_stats) == timeless(out.stats)
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


def test_guidance_changes_the_output(ipipe):
    """diffusers' test_cfg: guidance is wired to the model (and 1 turns it off)."""
    off = ipipe(**image_inputs(guidance_scale=1.0))
    assert ipipe.guidance_scale == 1.0
    on = ipipe(**image_inputs(guidance_scale=4.0))
    assert ipipe.guidance_scale == 4.0 and not torch.equal(off.images, on.images)


def test_to_dtype(tmp_path):
    pipe = image_pipe()
    pipe.to(torch.bfloat16)
    assert {c.dtype for c in pipe.components.values() if isinstance(c, torch.nn.Module)} == {torch.bfloat16}
    assert pipe(**image_inputs(output_type="pt")).images.dtype == torch.float32  # post-processed in float32
    text = text_pipe()
    text.to(dtype=torch.bfloat16)
    assert text.model.dtype == torch.bfloat16 and text(prompt="sort the list", output_type="seq").sequences.shape == (1, 8)


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
    assert MaskedDiffusionLMPipeline.from_pretrained(tmp_path / "txt-bare").tokenizer is None


def test_save_load_variant(tmp_path):
    pipe = image_pipe()
    pipe.save_pretrained(tmp_path, variant="v2")
    assert (tmp_path / "transformer" / "diffusion_pytorch_model.v2.safetensors").is_file()
    loaded = LlamaGenPipeline.from_pretrained(tmp_path, variant="v2")
    loaded.set_progress_bar_config(disable=True)
    assert torch.equal(loaded(**image_inputs()).images, pipe(**image_inputs()).images)
    with pytest.raises(ValueError, match="variant"):
        LlamaGenPipeline.from_pretrained(tmp_path, variant="v3")


def test_from_pipe_keeps_every_component(ipipe, tpipe):
    ipipe.acceptance_rule("lantern:k=8")
    image = LlamaGenPipeline.from_pipe(ipipe)
    assert image.transformer is ipipe.transformer and image.drafter is ipipe.drafter and image.vqvae is ipipe.vqvae
    assert image.lantern_neighbors["raw"] is ipipe.lantern_neighbors["raw"]
    text = MaskedDiffusionLMPipeline.from_pipe(tpipe)  # the model's annotation is Any: diffusers alone dropped it
    assert text.model is tpipe.model and text.tokenizer is tpipe.tokenizer and text.config.default_gen_length == 8
    other = MaskedDiffusionLMPipeline.from_pipe(tpipe, scheduler=ThresholdScheduler(0.5))
    assert isinstance(other.scheduler, ThresholdScheduler) and other.model is tpipe.model


@pytest.mark.slow
def test_generic_loader_in_a_fresh_process(ipipe, tpipe, tmp_path):
    """``DiffusionPipeline.from_pretrained(folder, trust_remote_code=True)``, in a process that never imported
    vispec, resolves the pipeline class and every component (drafter, LANTERN table, tokenizer, scheduler)."""
    ipipe.acceptance_rule("lantern:k=8")
    ipipe.save_pretrained(tmp_path / "img")
    tpipe.save_pretrained(tmp_path / "txt")
    want_image = ipipe(**image_inputs(decoding="sd:window=3")).images
    want_text = tpipe(prompt="sort the list").sequences
    torch.save({"image": want_image, "text": want_text}, tmp_path / "want.pt")
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


# ---------------------------------------------------------------------- callbacks
class CountSteps(PipelineCallback):
    """A diffusers PipelineCallback: requests its own tensor inputs and returns them unchanged."""

    tensor_inputs = ["num_committed"]

    def callback_fn(self, pipeline, step_index, timestep, callback_kwargs):
        self.calls = getattr(self, "calls", 0) + 1
        assert set(callback_kwargs) == {"num_committed"}
        return callback_kwargs


def test_callback_inputs_and_pipeline_callbacks(ipipe, tpipe):
    """diffusers' test_callback_inputs: only the requested names, all from ``_callback_tensor_inputs``."""
    seen = []

    def check(pipe, step, timestep, kwargs):
        assert set(kwargs) <= set(pipe._callback_tensor_inputs)
        seen.append(sorted(kwargs))
        return kwargs

    ipipe(**image_inputs(), callback_on_step_end=check, callback_on_step_end_tensor_inputs=ipipe._callback_tensor_inputs)
    tpipe(prompt="sort", callback_on_step_end=check, callback_on_step_end_tensor_inputs=tpipe._callback_tensor_inputs)
    assert ["num_committed", "tokens"] in seen and ["sequences", "transfer_index"] in seen
    counter = CountSteps()
    out = ipipe(**image_inputs(), callback_on_step_end=counter)
    assert 0 < counter.calls <= ipipe.num_timesteps == 15 and counter.calls == max(s["nfe"] for s in out.stats) - 1
    with pytest.raises(ValueError, match="returned \\['latents'\\], which are not among"):
        ipipe(**image_inputs(), callback_on_step_end=lambda p, i, t, kw: {"latents": torch.zeros(1)})
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


def test_cfg_callbacks(ipipe, tpipe, monkeypatch):
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
    with pytest.raises(ValueError, match="cannot change guidance_scale during decoding"):
        ipipe(**image_inputs(), callback_on_step_end=increase)


def test_interrupt_returns_what_is_done(ipipe, tpipe):
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

    whole = tpipe(prompt="sort the list", output_type="seq", early_stop_eos=False)
    part = tpipe(prompt="sort the list", output_type="seq", early_stop_eos=False, callback_on_step_end=stop_after(3))
    assert part.stats[0]["interrupted"] and part.stats[0]["nfe"] == 3
    mask_id = tpipe.mask_token_id
    done = part.sequences != mask_id
    assert int(done.sum()) == 3 and torch.equal(part.sequences[done], whole.sequences[done])
