"""DiffusionGemma through vispec (vispec.models.diffusion_gemma, vispec.dllm.gemma_rule): token equality with
transformers' generate() and diffusers' DiffusionGemmaPipeline on a tiny random config, every policy on it, the
limits it refuses."""

from __future__ import annotations

import contextlib
import json
import logging
import re
import warnings

import pytest
import torch

from vispec.dllm import (AdaptiveBlocks, DiffusionGemmaRule, ParallelDecodeFilter, ProphetRule, SCHEDULERS,
                         SharedGenerator, ThresholdScheduler, decode, make_scheduler)
from vispec.models.diffusion_gemma import DiffusionGemmaLM
from vispec.pipelines import MaskedDiffusionLMPipeline

transformers = pytest.importorskip("transformers")
from diffusers import BlockRefinementScheduler, DiffusionGemmaPipeline  # noqa: E402
from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion  # noqa: E402

CANVAS, VOCAB = 8, 128
# two prompts of different lengths (left-padded), a third for the stop-rule cases
IDS = torch.tensor([[5, 6, 7, 8, 9, 11], [0, 0, 0, 9, 10, 12], [3, 4, 5, 6, 7, 8]])
MASK = torch.tensor([[1] * 6, [0, 0, 0, 1, 1, 1], [1] * 6])


def tiny_diffusion_gemma(sharpen: float = 1.0) -> DiffusionGemmaForBlockDiffusion:
    """A random DiffusionGemma: 2 layers (sliding + full attention, window 8 < the sequences), hidden 32, 4 experts,
    vocabulary 128, canvas 8. ``sharpen`` scales the tied embeddings (wider logits: canvases that converge)."""
    torch.manual_seed(0)
    text = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, head_dim=16, global_head_dim=16, num_global_key_value_heads=1, sliding_window=8,
                max_position_embeddings=256, layer_types=["sliding_attention", "full_attention"], num_experts=4,
                top_k_experts=2, moe_intermediate_size=32)
    vision = dict(model_type="gemma4_vision", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=2, head_dim=8, position_embedding_size=64, patch_size=4)
    model = DiffusionGemmaForBlockDiffusion(DiffusionGemmaConfig(text_config=text, vision_config=vision,
                                                                 canvas_length=CANVAS)).eval()
    with torch.no_grad():
        model.model.decoder.embed_tokens.weight.mul_(sharpen)
    return model


@pytest.fixture(scope="module")
def model():
    return tiny_diffusion_gemma()


@pytest.fixture(scope="module")
def sharp():
    """Logit entropies of 2-3 nats: with a loose confidence threshold rows stop at different steps."""
    return tiny_diffusion_gemma(sharpen=20.0)


class PromptTable:
    """A processor double for DiffusionGemmaPipeline: any prompt list gives the fixed, left-padded ids."""

    eos_token_id = None

    def __init__(self, ids, mask):
        self.ids, self.mask = ids, mask

    def apply_chat_template(self, messages, **kwargs):
        return {"input_ids": self.ids, "attention_mask": self.mask}

    def batch_decode(self, sequences, skip_special_tokens=True):
        return [str(row.tolist()) for row in sequences]


def no_library_warnings():
    """transformers' / diffusers' deprecation warnings become errors (torch's own jit notice excepted)."""
    context = warnings.catch_warnings()
    context.__enter__()
    warnings.simplefilter("error")
    warnings.filterwarnings("ignore", message=".*torch.jit.script_method")
    return context


@contextlib.contextmanager
def library_notices():
    """Warnings become errors (as :func:`no_library_warnings`), and the WARNING-or-worse records transformers' and
    diffusers' loggers emit inside the block are collected in the yielded list."""
    records: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(f"{record.name}: {record.getMessage()}")

    handler = Collect(level=logging.WARNING)
    loggers = [logging.getLogger(name) for name in ("transformers", "diffusers")]
    for logger in loggers:
        logger.addHandler(handler)
    context = no_library_warnings()
    try:
        yield records
    finally:
        context.__exit__(None, None, None)
        for logger in loggers:
            logger.removeHandler(handler)


def test_pipeline_saves_and_loads_diffusion_gemma(model, tmp_path):
    """MaskedDiffusionLMPipeline.save_pretrained writes the adapter in transformers' own layout (model/ loads with
    DiffusionGemmaForBlockDiffusion.from_pretrained) and names vispec's class in model_index.json; from_pretrained
    gives back a DiffusionGemmaLM over DiffusionGemmaForBlockDiffusion with equal weights, whose greedy decode (same
    seed, batch 2 with padding, the saved threshold scheduler) gives the same tokens. Neither library warns."""
    pipe = MaskedDiffusionLMPipeline(model=DiffusionGemmaLM(model), tokenizer=None, scheduler=ThresholdScheduler(),
                                     default_gen_length=2 * CANVAS, default_block_length=CANVAS)
    with library_notices() as notices:
        pipe.save_pretrained(tmp_path)
        loaded = MaskedDiffusionLMPipeline.from_pretrained(tmp_path, dtype=torch.float32)
        loaded.to(torch.float32)  # a dtype cast: no float32-modules notice
    assert notices == []
    index = json.loads((tmp_path / "model_index.json").read_text())
    assert index["model"] == ["vispec.models.diffusion_gemma", "DiffusionGemmaLM"]
    assert type(DiffusionGemmaForBlockDiffusion.from_pretrained(tmp_path / "model")) is DiffusionGemmaForBlockDiffusion
    assert type(loaded.model) is DiffusionGemmaLM and not loaded.model.training
    assert type(loaded.model.diffusion_gemma) is DiffusionGemmaForBlockDiffusion
    saved, back = model.state_dict(), loaded.model.diffusion_gemma.state_dict()
    assert saved.keys() == back.keys() and all(torch.equal(saved[key], back[key]) for key in saved)
    assert loaded.config.default_block_length == CANVAS and isinstance(loaded.scheduler, ThresholdScheduler)
    outputs = []
    for pipeline in (pipe, loaded):
        pipeline.set_progress_bar_config(disable=True)
        outputs.append(pipeline(input_ids=IDS[:2], attention_mask=MASK[:2], output_type="seq", cache="prefix",
                                generator=torch.Generator().manual_seed(9)))
    assert torch.equal(outputs[0].sequences, outputs[1].sequences)
    assert [row["nfe"] for row in outputs[0].stats] == [row["nfe"] for row in outputs[1].stats]


def test_diffusion_gemma_folder_checks(model, tmp_path):
    """DiffusionGemmaLM.from_pretrained reads transformers' folders and refuses, by name and before building the
    model, a folder of another model type and a config its weights do not fit; saving refuses pickle files."""
    lm = DiffusionGemmaLM(model)
    lm.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    with pytest.raises(ValueError, match="safe_serialization"):
        lm.save_pretrained(tmp_path / "other", safe_serialization=False)
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "gemma3"}))
    with pytest.raises(ValueError, match="model of type 'gemma3', not a DiffusionGemma"):
        DiffusionGemmaLM.from_pretrained(tmp_path)
    wider = {**config, "text_config": {**config["text_config"], "vocab_size": 2 * VOCAB}}
    (tmp_path / "config.json").write_text(json.dumps(wider))
    with pytest.raises(ValueError, match="shape mismatches"):
        DiffusionGemmaLM.from_pretrained(tmp_path)


def test_a_folder_without_config_or_its_moe_sizes_is_refused_by_name(model, tmp_path, monkeypatch):
    """Issue 47 item 16: a pipeline folder whose model/ has no config.json, or a config.json without the text_config
    keys transformers has no default for (num_experts, top_k_experts, moe_intermediate_size), failed inside torch's
    Linear ("empty(): argument 'size' ... NoneType"). Both are refused naming the folder or file and what is missing,
    before transformers builds anything."""
    pipe = MaskedDiffusionLMPipeline(model=DiffusionGemmaLM(model), tokenizer=None, scheduler=ThresholdScheduler(),
                                     default_gen_length=2 * CANVAS, default_block_length=CANVAS)
    pipe.save_pretrained(tmp_path)
    config_path = tmp_path / "model" / "config.json"
    config = json.loads(config_path.read_text())

    def no_build(*args, **kwargs):
        raise AssertionError("transformers was asked to build the model")

    monkeypatch.setattr(DiffusionGemmaForBlockDiffusion, "from_pretrained", no_build)
    config_path.unlink()
    for load in (lambda: MaskedDiffusionLMPipeline.from_pretrained(tmp_path),
                 lambda: DiffusionGemmaLM.from_pretrained(tmp_path / "model")):
        with pytest.raises(ValueError, match=f"^{re.escape(str(tmp_path / 'model'))} has no config.json: a DiffusionGemma "
                                             "folder holds"):
            load()
    text = config["text_config"]
    for broken, words in (({"model_type": "diffusion_gemma"}, "has no text_config object"),
                          ({**config, "text_config": {k: v for k, v in text.items() if k != "num_experts"}},
                           "text_config lacks num_experts (transformers has no default for it"),
                          ({**config, "text_config": {k: v for k, v in text.items()
                                                    if k not in ("num_experts", "top_k_experts", "moe_intermediate_size")}},
                           "text_config lacks num_experts, top_k_experts, moe_intermediate_size"),
                          ({**config, "text_config": {**text, "top_k_experts": "2"}},
                           "text_config.top_k_experts must be an integer >= 1, got '2'")):
        config_path.write_text(json.dumps(broken))
        with pytest.raises(ValueError, match=f"^{re.escape(str(config_path))}(: | ){re.escape(words)}"):
            MaskedDiffusionLMPipeline.from_pretrained(tmp_path)


def test_gemma_rule_equals_transformers_generate(model):
    """At the model's defaults (48 steps, entropy bound 0.1, t 0.8 -> 0.4, stable & confident stop), batch 2 with a
    padded prompt, two canvases: vispec's tokens and tokens-per-forward are generate()'s."""
    ids, mask = IDS[:2], MASK[:2]
    torch.manual_seed(3)
    reference = model.generate(ids, attention_mask=mask, max_new_tokens=2 * CANVAS)
    context = no_library_warnings()
    torch.manual_seed(3)  # SharedGenerator() draws from torch's global generator, as generate() does
    out = decode(DiffusionGemmaLM(model), ids, mask, gen_length=2 * CANVAS, block_length=CANVAS, cache="prefix",
                 scheduler=DiffusionGemmaRule(), generator=SharedGenerator())
    context.__exit__(None, None, None)
    assert torch.equal(out.tokens, reference.sequences[:, ids.shape[1]:])
    assert torch.allclose(2 * CANVAS / out.stats.nfe.double(), reference.tokens_per_forward.double())


def test_gemma_rule_stop_equals_transformers_generate(sharp):
    """Rows that stop (stable-and-confident rule) at different steps leave the forward while the others go on: tokens
    and tokens-per-forward stay generate()'s (its finished rows keep being computed and drawn for), here with the
    encoder rerun before every forward (cache='none')."""
    torch.manual_seed(5)
    reference = sharp.generate(IDS, attention_mask=MASK, max_new_tokens=2 * CANVAS, stability_threshold=0,
                               confidence_threshold=1.0)
    assert (reference.tokens_per_forward > 1 / 6).all()  # every row stopped early somewhere
    torch.manual_seed(5)
    out = decode(DiffusionGemmaLM(sharp), IDS, MASK, gen_length=2 * CANVAS, block_length=CANVAS, cache="none",
                 scheduler=DiffusionGemmaRule(stability_threshold=0, confidence_threshold=1.0),
                 generator=SharedGenerator())
    assert torch.equal(out.tokens, reference.sequences[:, IDS.shape[1]:])
    assert torch.allclose(2 * CANVAS / out.stats.nfe.double(), reference.tokens_per_forward.double())


@pytest.mark.parametrize("sharpen, settings", [(1.0, {}), (20.0, {"confidence_threshold": 2.0})])
def test_block_refinement_equals_diffusers_pipeline(sharpen, settings):
    """diffusers' DiffusionGemmaPipeline with its BlockRefinementScheduler at their defaults (greedy, threshold 0.95,
    48 steps), batch 3 with padding, two canvases, and with a stop rule that fires: vispec's sampler='block_refinement'
    gives its tokens for the same generator."""
    model = tiny_diffusion_gemma(sharpen)
    lm = DiffusionGemmaLM(model)
    pipe = DiffusionGemmaPipeline(model=lm, scheduler=BlockRefinementScheduler(), processor=PromptTable(IDS, MASK))
    pipe.set_progress_bar_config(disable=True)
    context = no_library_warnings()
    stop = {"stability_threshold": settings.get("stability_threshold", 1),
            "confidence_threshold": settings.get("confidence_threshold", 0.005)}
    reference = pipe(prompt=["a", "b", "c"], gen_length=2 * CANVAS, generator=torch.Generator().manual_seed(4),
                     output_type="seq", **stop)
    out = decode(lm, IDS, MASK, gen_length=2 * CANVAS, block_length=CANVAS, cache="prefix",
                 scheduler=DiffusionGemmaRule(sampler="block_refinement", **settings),
                 generator=SharedGenerator(torch.Generator().manual_seed(4)))
    context.__exit__(None, None, None)
    assert torch.equal(out.tokens, reference.sequences)
    if settings:
        assert (out.stats.nfe < 96).any()  # the stop rule fired


def test_pipeline_runs_diffusion_gemma_as_transformers(model):
    """vispec's text pipeline takes the adapter: the 'gemma' strategy's default budget is its own (48 per canvas), and
    with a SharedGenerator its tokens are generate()'s (up to and including the first EOS, after which generate pads
    and the pipeline fills EOS)."""
    pipe = MaskedDiffusionLMPipeline(model=DiffusionGemmaLM(model), tokenizer=None, scheduler=ThresholdScheduler(),
                                     default_gen_length=2 * CANVAS, default_block_length=CANVAS)
    pipe.set_progress_bar_config(disable=True)
    torch.manual_seed(7)
    reference = model.generate(IDS, attention_mask=MASK, max_new_tokens=2 * CANVAS, eos_token_id=1, pad_token_id=0)
    torch.manual_seed(7)
    out = pipe(input_ids=IDS, attention_mask=MASK, strategy="gemma", cache="prefix", generator=SharedGenerator())
    expected = reference.sequences[:, IDS.shape[1]:]
    for row, ref in zip(out.sequences, expected):
        cut = int((ref == 1).nonzero()[0]) + 1 if (ref == 1).any() else ref.numel()
        assert torch.equal(row[:cut], ref[:cut])
        assert (row[cut:] == 1).all()
    assert out.stats[0]["method"] == "gemma" and out.stats[0]["nfe"] % 48 == 0


def policy(name: str):
    """Every registered policy, with a short budget where it has one."""
    if name == "gemma":
        return DiffusionGemmaRule(max_denoising_steps=4)
    if name == "learn2pd":
        return make_scheduler(name, filter=ParallelDecodeFilter(block_length=CANVAS, hidden_size=8))
    return make_scheduler(name)


@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_every_policy_runs_on_diffusion_gemma(model, name):
    """Each vispec policy decodes the adapter to completion (per-row noise, batch 2, two canvases); the LLaDA2 editing
    policy, which needs a block-causal model, is refused by name."""
    lm = DiffusionGemmaLM(model)
    steps = {"steps": 2 * 4} if SCHEDULERS[name].fixed_steps and name != "gemma" else {}
    if name == "editing":
        with pytest.raises(ValueError, match="block-causal"):
            decode(lm, IDS[:2], MASK[:2], gen_length=2 * CANVAS, block_length=CANVAS, scheduler=policy(name), **steps)
        return
    out = decode(lm, IDS[:2], MASK[:2], gen_length=2 * CANVAS, block_length=CANVAS, scheduler=policy(name),
                 generator=[torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)], **steps)
    assert out.tokens.shape == (2, 2 * CANVAS)
    assert ((out.tokens >= 0) & (out.tokens < VOCAB)).all()  # complete: no virtual mask id left
    assert (out.stats.nfe >= 2).all()


@pytest.mark.parametrize("options", [{"cache": "dual", "eotp": True}, {"cache": "none", "early_commit": ProphetRule()},
                                     {"cache": "prefix", "temperature": 0.7, "early_stop_eos": True}])
def test_rules_and_caches_keep_rows_batch_invariant(model, options):
    """With per-row generators a row decodes the same alone and in the batch, under end-of-text prediction, Prophet's
    early commit, sampling and every cache (threshold policy), and under the gemma rule."""
    lm = DiffusionGemmaLM(model)
    for scheduler in (ThresholdScheduler(threshold=0.5), DiffusionGemmaRule(max_denoising_steps=6)):
        if isinstance(scheduler, DiffusionGemmaRule) and options.get("temperature"):
            continue
        gens = lambda: [torch.Generator().manual_seed(11), torch.Generator().manual_seed(12)]  # noqa: E731
        both = decode(lm, IDS[[0, 2]], None, gen_length=2 * CANVAS, block_length=CANVAS, scheduler=scheduler,
                      generator=gens(), **options)
        alone = decode(lm, IDS[2:], None, gen_length=2 * CANVAS, block_length=CANVAS, scheduler=scheduler,
                       generator=gens()[1:], **options)
        assert torch.equal(both.tokens[1:], alone.tokens)
        assert torch.equal(both.stats.nfe[1:], alone.stats.nfe)


@pytest.mark.parametrize("settings, scheduler, message", [
    ({"block_length": 4}, None, "canvas_length"),
    ({"guidance_scale": 2.0}, None, "guidance_scale"),
    ({"cache": "dkv"}, None, "dkv"),
    ({"adaptive_block": AdaptiveBlocks(delimiter_ids=(3,))}, None, "adaptive_block"),
    ({"speculative": 2}, None, "speculative"),
    ({"temperature": 0.5}, DiffusionGemmaRule(), "annealed temperature"),
    ({"generator": SharedGenerator(), "temperature": 0.5}, ThresholdScheduler(), "counter-based"),
])
def test_refused_settings(model, settings, scheduler, message):
    """What the adapter and the rule cannot run is refused by name, before any forward."""
    lm = DiffusionGemmaLM(model)
    settings = {"gen_length": 2 * CANVAS, "block_length": CANVAS, **settings}
    with pytest.raises(ValueError, match=message):
        decode(lm, IDS[:2], MASK[:2], scheduler=scheduler or ThresholdScheduler(), **settings)
    with pytest.raises(ValueError, match="must lie in"):
        decode(lm, torch.tensor([[5, VOCAB]]), None, gen_length=CANVAS, block_length=CANVAS,
               scheduler=ThresholdScheduler())
    with pytest.raises(ValueError, match="DiffusionGemmaForBlockDiffusion"):
        DiffusionGemmaLM(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="sampler"):
        DiffusionGemmaRule(sampler="ddim")


def test_early_stop_ends_a_finished_canvas_at_its_eos(model):
    """``early_stop_eos``: the canvas that commits EOS keeps nothing after it (DiffusionGemma's ``generate`` pads there;
    vispec writes EOS, as it does for masked models), and the row spends no forward on later canvases."""
    lm = DiffusionGemmaLM(model)

    def run(**options):
        return decode(lm, IDS[:1], None, gen_length=2 * CANVAS, block_length=CANVAS,
                      scheduler=DiffusionGemmaRule(max_denoising_steps=4), generator=[torch.Generator().manual_seed(3)],
                      **options)

    free = run()
    eos = int(free.tokens[0, 2])
    first = int((free.tokens[0] == eos).nonzero()[0])  # its first occurrence, in the first canvas
    stopped = run(eos_token_id=eos, early_stop_eos=True)
    assert torch.equal(stopped.tokens[0, : first + 1], free.tokens[0, : first + 1])
    assert (stopped.tokens[0, first:] == eos).all() and not (free.tokens[0, first:] == eos).all()
    assert stopped.stats.nfe[0] < free.stats.nfe[0]
