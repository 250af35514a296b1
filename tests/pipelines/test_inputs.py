"""Bad input to both pipelines: a clear ``ValueError`` / ``TypeError`` naming the argument, raised before any
model call (counted by a hook on the embedding layers); and what users bring from DiT and diffusers'
``LLaDA2Pipeline`` (nested class labels, LLaDA2's argument names and scheduler, no tokenizer)."""

from __future__ import annotations

import copy

import pytest
import torch

from helpers import image_inputs, image_pipe, text_pipe
from vispec.dllm import ThresholdScheduler


@pytest.fixture(scope="module")
def ipipe():
    return image_pipe(drafter=False)


@pytest.fixture(scope="module")
def tpipe():
    return text_pipe()


class Work:
    """Counts embedding-layer calls: any decoding work goes through them."""

    def __init__(self, *layers: torch.nn.Module):
        self.calls = 0
        self.handles = [layer.register_forward_pre_hook(self._count) for layer in layers]

    def _count(self, module, args):
        self.calls += 1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()


def image_work(pipe):
    return Work(pipe.transformer.tok_embeddings, pipe.transformer.cls_embedding.embedding_table)


def text_work(pipe):
    return Work(pipe.model.model.transformer.wte)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(generator=0), TypeError, "generator must be a torch.Generator or a list of them .* torch.Generator\\(\\).manual_seed"),
    (dict(generator=[0, 1]), TypeError, "generator must be a torch.Generator or a list"),
    (dict(temperature=float("inf")), ValueError, "temperature must be a finite number"),
    (dict(guidance_scale=float("nan")), ValueError, "guidance_scale must be a finite number"),
    (dict(class_labels=torch.tensor([1, 2], device="meta")), ValueError, "class_labels are on the meta device"),
    (dict(class_labels=[True, False]), ValueError, "class_labels must be an int"),
    (dict(class_labels=[1.0, 2.0]), ValueError, "class_labels must be an int"),
    (dict(class_labels=[[1], [9]]), ValueError, "class_labels must lie in \\[0, 5\\)"),
    (dict(callback_on_step_end="print"), TypeError, "callback_on_step_end must be callable"),
    (dict(max_batch_size="4"), ValueError, "max_batch_size must be an integer >= 1"),
    (dict(callback_on_step_end_tensor_inputs="tokens"), TypeError, "callback_on_step_end_tensor_inputs must be a list"),
])
def test_image_bad_inputs_fail_before_any_work(ipipe, kwargs, error, match):
    inputs = {**image_inputs(), "generator": None, **kwargs}
    with image_work(ipipe) as work, pytest.raises(error, match=match):
        ipipe(**inputs)
    assert work.calls == 0


def test_nested_class_labels_as_dit(ipipe):
    flat = ipipe(class_labels=[1, 2], generator=[torch.Generator().manual_seed(i) for i in range(2)], output_type="latent")
    for labels in ([[1], [2]], torch.tensor([[1], [2]]), (1, 2)):
        nested = ipipe(class_labels=labels, generator=[torch.Generator().manual_seed(i) for i in range(2)], output_type="latent")
        assert torch.equal(nested.images, flat.images)


def test_nan_from_the_vq_decoder_is_an_error():
    pipe = image_pipe(drafter=False)
    with torch.no_grad():
        pipe.vqvae.post_quant_conv.weight.fill_(float("nan"))
    assert pipe(**image_inputs()).images.shape == (2, 4, 4)  # tokens do not touch the VQ decoder
    with pytest.raises(ValueError, match="VQ decoder \\(vqvae\\) returned NaN or inf pixels"):
        pipe(**image_inputs(output_type="pt"))


PAD, BOS = 0, 2  # the word tokenizer's ids


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(input_ids=torch.tensor([[2.0, 7.0, 8.0]])), TypeError, "input_ids must hold integer token ids"),
    (dict(input_ids=[["a", "b"]]), TypeError, "input_ids must be a tensor"),
    (dict(input_ids=torch.tensor([[2, 7, 8]]), attention_mask=torch.zeros(1, 3, dtype=torch.long)), ValueError,
     "attention_mask rows \\[0\\] are all padding"),
    (dict(input_ids=torch.tensor([[2, 7, 8]]), attention_mask=torch.tensor([[0.5, 1, 1]])), ValueError,
     "attention_mask must hold 0 \\(padding\\) and 1"),
    (dict(input_ids=torch.tensor([[2, 7, 100000]])), ValueError, "input_ids must lie in \\[0, 3\\d\\) \\(the model's vocabulary\\)"),
    (dict(input_ids=torch.tensor([[-1, 7, 8]])), ValueError, "input_ids must lie in"),
    (dict(input_ids=torch.tensor([[2, 7, PAD, 8]])), ValueError, "pad id 0 after a row's first real token .* pass attention_mask"),
    (dict(input_ids=torch.tensor([[PAD, PAD]])), ValueError, "all padding"),
    (dict(input_ids=torch.tensor([[2, 7]], device="meta")), ValueError, "input_ids is on the meta device"),
    (dict(prompt="sort", attention_mask=torch.ones(1, 2)), ValueError, "attention_mask goes with input_ids"),
    (dict(prompt="sort", temperature=float("inf")), ValueError, "temperature must be a finite number"),
    (dict(prompt="sort", guidance_scale=float("nan")), ValueError, "guidance_scale must be a finite number >= 1"),
    (dict(prompt="sort", generator=0), TypeError, "generator must be a torch.Generator"),
    (dict(messages={"role": "user", "content": "sort"}), TypeError, "messages must be one conversation.*got a dict"),
    (dict(messages=["sort", "the list"]), TypeError, "messages must be one conversation.*plain strings go in prompt="),
    (dict(messages=[{"role": "user"}]), TypeError, "messages must be one conversation"),
    (dict(prompt="sort", steps=0), ValueError, "steps must be an integer >= 1"),
    (dict(prompt="sort", num_inference_steps=0), ValueError, "num_inference_steps must be an integer >= 1 \\(steps per block\\)"),
    (dict(prompt="sort", steps=8, num_inference_steps=4), ValueError, "not both"),
    (dict(prompt="sort", strategy="threshold", num_inference_steps=4), ValueError, "apply to fixed-step strategies"),
    (dict(prompt="sort", top_k=5), ValueError, "top_k \\(LLaDA2's candidate filtering\\) has no equivalent"),
    (dict(prompt="sort", top_p=0.9), ValueError, "top_p \\(LLaDA2's candidate filtering\\) has no equivalent"),
    (dict(prompt="sort", minimal_topk=2), ValueError, "minimal_topk=2 has no equivalent .*strategy='llada'"),
    (dict(prompt="sort", early_stop_eos=True, eos_early_stop=False), ValueError, "disagree"),
    (dict(prompt="sort", mask_token_id=10**6), ValueError, "mask_token_id must be an integer in"),
])
def test_text_bad_inputs_fail_before_any_work(tpipe, kwargs, error, match):
    with text_work(tpipe) as work, pytest.raises(error, match=match):
        tpipe(**kwargs)
    assert work.calls == 0


def test_block_refinement_scheduler_is_mapped_or_refused_by_name(tpipe):
    """diffusers' BlockRefinementScheduler becomes vispec's editing policy (its config carried over); on a
    bidirectional model (LLaDA) that policy has no equivalent and the error says what to use, before any work."""
    diffusers = pytest.importorskip("diffusers")
    from vispec.dllm import TokenEditingScheduler

    scheduler = diffusers.BlockRefinementScheduler(block_length=16, num_inference_steps=8, threshold=0.9,
                                                   editing_threshold=0.4, minimal_topk=2)
    pipe = type(tpipe)(model=tpipe.model, tokenizer=tpipe.tokenizer, scheduler=scheduler)
    assert isinstance(pipe.scheduler, TokenEditingScheduler)
    assert dict(block_length=16, num_inference_steps=8, threshold=0.9, editing_threshold=0.4,
                minimal_topk=2).items() <= dict(pipe.scheduler.config).items()
    for call in (dict(), dict(strategy=diffusers.BlockRefinementScheduler()), dict(strategy="editing")):
        with text_work(tpipe) as work, pytest.raises(ValueError, match="needs a block-causal model .* strategy='threshold'"):
            (pipe if not call else tpipe)(prompt="sort", **call)
        assert work.calls == 0
    with pytest.raises(ValueError, match="editing_threshold, max_post_steps apply to the editing strategy"):
        tpipe(prompt="sort", editing_threshold=0.5, max_post_steps=2)


def test_nan_logits_are_an_error_not_an_empty_text():
    pipe = text_pipe(ThresholdScheduler(0.9))
    broken = copy.deepcopy(pipe.model)
    with torch.no_grad():
        broken.model.transformer.ln_f.weight.fill_(float("nan"))
    pipe.model = broken
    for cache in ("none", "dual"):
        with pytest.raises(ValueError, match="logits contain NaN"):
            pipe(prompt="sort the list", cache=cache)


def test_padded_ids_without_a_mask_are_inferred(tpipe):
    ids, mask = tpipe.prepare_input_ids(prompt=["sort", "what is one plus two"])
    assert (mask == 0).any()  # the first row is left-padded
    explicit = tpipe(input_ids=ids, attention_mask=mask, output_type="seq")
    inferred = tpipe(input_ids=ids, output_type="seq")
    assert torch.equal(inferred.sequences, explicit.sequences)
    assert torch.equal(tpipe.prepare_input_ids(input_ids=ids)[1], mask)


def test_llada2_names_are_accepted(tpipe):
    base = tpipe(prompt="sort the list", output_type="seq", steps=8)
    # num_inference_steps is per block (LLaDA2): 4 per block over 2 blocks is steps=8
    assert torch.equal(tpipe(prompt="sort the list", output_type="seq", num_inference_steps=4).sequences, base.sequences)
    assert tpipe.num_timesteps == 8
    assert torch.equal(tpipe(prompt="sort the list", output_type="seq", eos_early_stop=True, minimal_topk=1,
                             mask_token_id=tpipe.mask_token_id, eos_token_id=tpipe.tokenizer.eos_token_id).sequences,
                       base.sequences)
    off = tpipe(prompt="sort the list", output_type="seq", eos_early_stop=False)
    assert torch.equal(off.sequences, tpipe(prompt="sort the list", output_type="seq", early_stop_eos=False).sequences)


def test_no_tokenizer_with_input_ids(tpipe):
    ids, mask = tpipe.prepare_input_ids(prompt=["sort", "what is one plus two"])
    bare = type(tpipe)(model=tpipe.model, tokenizer=None, scheduler=tpipe.scheduler, default_gen_length=8,
                       default_block_length=4)
    bare.set_progress_bar_config(disable=True)
    out = bare(input_ids=ids, attention_mask=mask)  # output_type defaults to "seq" without a tokenizer
    assert out.texts is None and torch.equal(out.sequences, tpipe(input_ids=ids, attention_mask=mask).sequences)
    assert torch.equal(bare(input_ids=ids).sequences, out.sequences)  # the pad id comes from the model config
    with pytest.raises(ValueError, match="output_type='text' needs a tokenizer"):
        bare(input_ids=ids, output_type="text")
    with pytest.raises(ValueError, match="need a tokenizer; this pipeline has none: pass input_ids"):
        bare(prompt="sort")


# ---- the unified-token pipeline (issue 28: items 2-6 and 6b) -----------------------------------------

@pytest.fixture(scope="module")
def upipe():
    from unified_helpers import tiny_unified_pipeline

    return tiny_unified_pipeline()


def unified_variant(pipe, **changes):
    """``pipe``'s components and settings with ``changes`` (settings, or ``vqvae=None``)."""
    from vispec.pipelines import UnifiedImagePipeline

    modules = {name: getattr(pipe, name) for name in ("transformer", "tokenizer", "decoding_config", "vqvae")}
    settings = {k: v for k, v in pipe.config.items() if not k.startswith("_") and k not in modules}
    new = UnifiedImagePipeline(**{**modules, **settings, **changes})
    new.set_progress_bar_config(disable=True)
    return new


def unified_work(pipe):
    return Work(pipe.transformer.model.embed_tokens)


LONG_PROMPT = " ".join(["cat"] * 300)  # the tiny transformer's context is 256 positions


@pytest.mark.parametrize("changes, kwargs, match", [
    # 2: past the resolution tokens (ids text+3 .. text+11: n <= 8, sizes <= 64), then past the context
    ({}, dict(height=72), "height=72 needs the resolution token .*height must be at most 64"),
    ({}, dict(width=160), "width=160 needs the resolution token .*width must be at most 64"),
    ({}, dict(height=64, width=64), "height=64 and width=64 give 272 image tokens .*context of 256 positions "
                                    "\\(max_position_embeddings\\); the largest square image that fits is 56x56"),
    # 3: a prompt past the context
    ({}, dict(prompt=LONG_PROMPT), "prompt is 30\\d tokens long .*context of 256 .*shorten it to at most \\d+ tokens"),
    ({"cfg_mode": "negative"}, dict(negative_prompt=LONG_PROMPT), "negative_prompt is 30\\d tokens long"),
    # 4: pixels without a pixel decoder
    ({"vqvae": None}, dict(output_type="pil"), "output_type='pil' needs an image decoder.*output_type='latent'"),
    ({"vqvae": None}, dict(output_type="np"), "output_type='np' needs an image decoder"),
    # 5: negative_prompt is named as itself
    ({"cfg_mode": "negative"}, dict(negative_prompt=[]), "negative_prompt must be a string or a non-empty list"),
    ({"cfg_mode": "negative"}, dict(negative_prompt=5), "negative_prompt must be a string or a non-empty list"),
    ({"cfg_mode": "negative"}, dict(negative_prompt=["a", 5]), "negative_prompt must be a string"),
    ({"cfg_mode": "negative"}, dict(prompt=["a", "b"], negative_prompt=["x", "y", "z"]), "negative_prompt has 3 prompts for 2"),
    ({}, dict(prompt=[]), "^prompt must be a string or a non-empty list"),
    # found by the fuzzing: top_k past the decoder vocabulary (16 codes and end of row) was refused mid-decode
    ({}, dict(top_k=18), "top_k=18 is larger than the vocabulary \\(17 tokens\\)"),
    # 6: config ids past the vocabulary, named by their model_index.json field
    ({"resolution_token_base": 10_000}, {}, "resolution_token_base \\(model_index.json\\) gives id 10000, outside the "
                                           "transformer's vocabulary of \\d+ ids"),
    ({"image_start_id": 10_000}, {}, "image_start_id \\(model_index.json\\) gives id 10000, outside"),
    ({"image_end_ids": [3, 9999]}, {}, "image_end_ids \\(model_index.json\\) gives ids 3..9999, outside"),
    ({"eol_id": -1}, {}, "eol_id \\(model_index.json\\) gives id -1, outside"),
    ({"num_codes": 4096}, {}, "code_offset \\(model_index.json\\) gives code ids .*num_codes 4096.*outside"),
])
def test_unified_bad_inputs_fail_before_any_work(upipe, changes, kwargs, match):
    pipe = unified_variant(upipe, **changes) if changes else upipe
    with unified_work(pipe) as work, pytest.raises(ValueError, match=match):
        pipe(**{"prompt": "a red cat", "output_type": "latent", **kwargs})
    assert work.calls == 0


def test_unified_resolution_token_base_inside_the_codes(upipe):
    code0 = upipe.config.code_offset
    pipe = unified_variant(upipe, resolution_token_base=code0 + 2)
    with unified_work(pipe) as work, pytest.raises(ValueError, match=f"resolution_token_base {code0 + 2} .* is an id of "
                                                                      "code_offset"):
        pipe("a red cat", output_type="latent")
    assert work.calls == 0


def test_unified_largest_sizes_still_run(upipe):
    """The limits are tight: the largest square image that fits the context, and a prompt of the longest
    allowed length, decode."""
    gen = [torch.Generator().manual_seed(0)]
    assert upipe("a red cat", height=56, width=56, decoding="mc-sjd:window=16", generator=gen,
                 output_type="latent").images.shape == (1, 14, 14)
    image = 3 + 4 * 5  # prefix and the default 16x16 image's 4 rows of 4 codes and an end of row
    longest = upipe.transformer.config.max_position_embeddings - image
    words = len(upipe.encode_prompt("a", 16, 16)[0]) - 1  # the template's tokens besides the word
    prompt = " ".join(["cat"] * (longest - words))
    assert len(upipe.encode_prompt(prompt, 16, 16)[0]) == longest
    assert upipe(prompt, decoding="ar", generator=gen, output_type="latent").images.shape == (1, 4, 4)


def test_unified_negative_prompt_runs(upipe):
    pipe = unified_variant(upipe, cfg_mode="negative")
    gen = lambda: [torch.Generator().manual_seed(i) for i in range(2)]  # noqa: E731
    out = pipe(["a red cat", "blue sky"], negative_prompt="grass", generator=gen(), output_type="latent")
    same = pipe(["a red cat", "blue sky"], negative_prompt=["grass", "grass"], generator=gen(), output_type="latent")
    assert out.images.shape == (2, 4, 4) and torch.equal(out.images, same.images)


@pytest.mark.parametrize("count", [10**5, 10**7])
def test_unified_num_images_per_prompt_is_bounded_by_memory(upipe, monkeypatch, count):
    import vispec.pipelines.unified as unified

    monkeypatch.setattr(unified, "available_memory", lambda device: 8 * 2**20)  # 8 MiB free, on any machine
    with unified_work(upipe) as work, pytest.raises(ValueError, match=f"num_images_per_prompt: {count} images "
                                                                       f"\\({count} decoded at a time\\) need at least"):
        upipe("a red cat", num_images_per_prompt=count, output_type="latent")
    with pytest.raises(ValueError, match="1 decoded at a time"):  # the outputs alone do not fit either
        upipe("a red cat", num_images_per_prompt=count, max_batch_size=1, output_type="latent")
    assert work.calls == 0
    out = upipe("a red cat", num_images_per_prompt=2, generator=[torch.Generator().manual_seed(i) for i in range(2)],
                output_type="latent")
    assert out.images.shape == (2, 4, 4)
