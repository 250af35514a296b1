"""MaskedDiffusionLMPipeline: output types, round trip, batch vs single, generators, callbacks, progress, bad input."""

from __future__ import annotations

import pytest
import torch

from vispec.dllm import LLaDAScheduler, ThresholdScheduler
from vispec.eval.train.tokenizer import train_word_tokenizer
from vispec.pipelines import MaskedDiffusionLMPipeline

from helpers import TEXT_WORDS, tiny_text_pipeline

WORDS = TEXT_WORDS


@pytest.fixture(scope="module")
def pipe():
    return tiny_text_pipeline()


def test_output_types_and_stats(pipe):
    out = pipe(prompt=["what is one plus two", "sort the list"])
    assert out.sequences.shape == (2, 8) and len(out.texts) == 2 and all(isinstance(t, str) for t in out.texts)
    assert [s["nfe"] for s in out.stats] == [8, 8] and out.stats[0]["scheduler"] == "LLaDAScheduler"
    assert set(out.stats[0]) == {"method", "scheduler", "cache", "nfe", "tokens", "tokens_per_forward", "latency_s"}
    assert out.stats[0]["method"] == "llada" and out.stats[0]["cache"] == "none"
    seq = pipe(prompt="what is one plus two", output_type="seq")
    assert seq.texts is None and torch.equal(seq.sequences[0], out.sequences[0])
    sequences, texts = pipe(prompt="sort the list", return_dict=False)  # as LLaDA2Pipeline; stats in last_stats
    assert torch.equal(sequences[0], out.sequences[1]) and texts[0] == out.texts[1] and len(pipe.last_stats) == 1


def test_batch_equals_single_with_generators(pipe):
    prompts = ["what is one plus two", "sort the list a b c d", "reverse"]
    gens = lambda: [torch.Generator().manual_seed(i) for i in range(3)]
    for strategy, cache in (("llada", "none"), ("threshold", "dual"), ("entropy", "prefix")):
        batch = pipe(prompt=prompts, temperature=0.7, strategy=strategy, cache=cache, generator=gens(), gen_length=12)
        for i, p in enumerate(prompts):
            single = pipe(prompt=p, temperature=0.7, strategy=strategy, cache=cache, generator=[gens()[i]], gen_length=12)
            assert torch.equal(batch.sequences[i], single.sequences[0]) and batch.texts[i] == single.texts[0]
    first = pipe(prompt="reverse", temperature=0.7, generator=torch.Generator().manual_seed(5), num_sequences_per_prompt=2)
    again = pipe(prompt="reverse", temperature=0.7, generator=torch.Generator().manual_seed(5), num_sequences_per_prompt=2)
    assert torch.equal(first.sequences, again.sequences)


def test_chat_template_and_input_ids(pipe):
    text_ids, _ = pipe.prepare_input_ids(prompt="sort the list")
    assert text_ids[0, 0] == pipe.tokenizer.bos_token_id  # the template starts with BOS
    out_ids = pipe(input_ids=text_ids, output_type="seq")
    out_text = pipe(prompt="sort the list", output_type="seq")
    assert torch.equal(out_ids.sequences, out_text.sequences)
    msgs = pipe(messages=[{"role": "user", "content": "sort the list"}], output_type="seq")
    assert torch.equal(msgs.sequences, out_text.sequences)
    raw, _ = pipe.prepare_input_ids(prompt="sort the list", use_chat_template=False)
    assert raw.shape[1] < text_ids.shape[1]


def test_left_padding(pipe):
    ids, mask = pipe.prepare_input_ids(prompt=["sort", "what is one plus two"])
    assert mask[0, 0] == 0 and mask[0, -1] == 1 and ids[0, 0] == pipe.tokenizer.pad_token_id and mask[1].all()


def test_callbacks_and_progress(pipe):
    seen = []

    def callback(p, step, timestep, kwargs):
        assert set(kwargs) == {"sequences", "transfer_index"}
        masked = int((kwargs["sequences"] == p.mask_token_id).sum())
        assert masked == 8 - sum(n for _, n in seen) - int(kwargs["transfer_index"].sum())  # mask id where undecided
        kwargs["sequences"].fill_(0)  # copies: cannot change decoding
        seen.append((step, int(kwargs["transfer_index"].sum())))
        return {}

    ref = pipe(prompt="sort the list", output_type="seq")
    out = pipe(prompt="sort the list", output_type="seq", callback_on_step_end=callback,
               callback_on_step_end_tensor_inputs=["sequences", "transfer_index"])
    assert torch.equal(out.sequences, ref.sequences)
    assert [s for s, _ in seen] == list(range(8)) and sum(n for _, n in seen) == 8
    pipe.set_progress_bar_config(disable=False)
    try:
        pipe(prompt="sort", output_type="seq")
    finally:
        pipe.set_progress_bar_config(disable=True)


def test_guidance_scale_one_is_off_and_maps_llada_cfg(pipe):
    """guidance_scale = 1 (the default) runs no unconditional branch; LLaDA's cfg_scale w is guidance_scale w + 1."""
    from vispec.dllm import LLaDAScheduler as Sched, decode

    ids, mask = pipe.prepare_input_ids(prompt=["sort the list", "reverse"])
    calls = []
    hook = pipe.model.register_forward_hook(lambda module, args, output: calls.append(args[0].shape[0]))
    try:
        off = pipe(input_ids=ids, attention_mask=mask, output_type="seq")
        assert set(calls) == {2}  # two rows per forward: no unconditional half
        calls.clear()
        guided = pipe(input_ids=ids, attention_mask=mask, output_type="seq", guidance_scale=1.5)
        assert set(calls) == {4}
    finally:
        hook.remove()
    assert torch.equal(off.sequences, pipe(input_ids=ids, attention_mask=mask, output_type="seq", guidance_scale=1.0).sequences)
    direct = decode(pipe.model, ids, mask, scheduler=Sched(), gen_length=8, block_length=4, steps=8, guidance_scale=1.5,
                    early_stop_eos=True, mask_token_id=pipe.mask_token_id, eos_token_id=pipe.tokenizer.eos_token_id)
    assert torch.equal(guided.sequences, direct.tokens)


def test_scheduler_swap_and_threshold(pipe):
    out = pipe(prompt="sort the list", strategy=ThresholdScheduler(threshold=1e-9), output_type="seq")
    assert out.stats[0]["nfe"] == 2  # two blocks, each committed in one step
    assert pipe(prompt="sort the list", strategy="threshold", threshold=1e-9, output_type="seq").stats[0]["nfe"] == 2
    # a scheduler built with its default threshold takes the override too (diffusers' from_config would drop it)
    assert pipe(prompt="sort the list", strategy=ThresholdScheduler(), threshold=1e-9, output_type="seq").stats[0]["nfe"] == 2


def test_save_load_round_trip(pipe, tmp_path):
    pipe.save_pretrained(tmp_path)
    loaded = MaskedDiffusionLMPipeline.from_pretrained(tmp_path)
    loaded.set_progress_bar_config(disable=True)
    assert loaded.config.default_gen_length == 8 and isinstance(loaded.scheduler, LLaDAScheduler)
    a = pipe(prompt="what is one plus two", output_type="seq")
    b = loaded(prompt="what is one plus two", output_type="seq")
    assert torch.equal(a.sequences, b.sequences)


@pytest.mark.parametrize("kwargs,words", [
    (dict(prompt="sort", output_type="html"), "output_type must be one of"),
    (dict(prompt="sort", cache="paged"), "cache must be one of"),
    (dict(prompt="sort", gen_length=10, block_length=4), "multiple of block_length"),
    (dict(prompt="sort", gen_length=8, block_length=4, steps=3), "divisible by the number of blocks"),
    (dict(prompt="sort " * 70), "exceeds the model's context"),
    (dict(prompt="sort", strategy="threshold", threshold=1.5), "threshold must be a finite number in \\(0, 1\\]"),
    (dict(prompt="sort", strategy="threshold", threshold=0.0), "threshold must be a finite number in \\(0, 1\\]"),
    (dict(prompt="sort", guidance_scale=0.0), "guidance_scale must be a finite number >= 1 \\(1 disables guidance; LLaDA's cfg_scale w"),
    (dict(prompt="sort", num_sequences_per_prompt=0), "num_sequences_per_prompt must be an integer >= 1"),
    (dict(prompt="sort", strategy="llada", threshold=0.5), "threshold applies to the threshold, contiguous and learn2pd strategies, not .llada."),
    (dict(prompt="sort", strategy="fastest"), "strategy must be one of"),
    (dict(), "pass prompt, messages or input_ids"),
    (dict(prompt=3), "prompt must be a string"),
    (dict(prompt="sort", generator=[torch.Generator()] * 2), "generator list has 2 entries"),
])
def test_bad_input(pipe, kwargs, words):
    with pytest.raises(ValueError, match=words):
        pipe(**kwargs)


def test_tokenizer_without_mask_token(pipe):
    """The mask id comes from the tokenizer, else from the model's config; with neither, a clear error."""
    tokenizer = train_word_tokenizer(["a b"])
    tokenizer.mask_token = None
    fallback = MaskedDiffusionLMPipeline(model=pipe.model, tokenizer=tokenizer, scheduler=LLaDAScheduler())
    assert fallback.mask_token_id == pipe.model.config.mask_token_id
    bad = MaskedDiffusionLMPipeline(model=torch.nn.Linear(1, 1), tokenizer=tokenizer, scheduler=LLaDAScheduler())
    with pytest.raises(ValueError, match="no mask token"):
        bad(prompt="a")


def test_tokenizer_whose_pad_is_the_mask(pipe):
    tokenizer = train_word_tokenizer(["a b"])
    tokenizer.pad_token = tokenizer.mask_token
    bad = MaskedDiffusionLMPipeline(model=pipe.model, tokenizer=tokenizer, scheduler=LLaDAScheduler())
    with pytest.raises(ValueError, match="pad_token_id equals its mask_token_id"):
        bad(prompt="a")
