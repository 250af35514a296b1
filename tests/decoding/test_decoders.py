"""Decoder behaviour: batch independence, ragged progress, statistics, processors, bad input."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from vispec.decoding import DecodingConfig, decode
from vispec.decoding.processors import AllowedTokenRange, PeriodicForcedToken
from vispec.models.llamagen_gpt import LlamaGenCondition
from vispec.sampling import SamplingConfig

from helpers import tiny_gpt

METHODS = ["ar", "sjd-random", "sjd-horizontal", "sjd-vertical", "mc-sjd-maximal", "mc-sjd-gumbel"]
SAMPLING = SamplingConfig(temperature=1.0, top_k=12, guidance_scale=2.5)


@pytest.fixture(scope="module")
def model():
    return tiny_gpt(vocab_size=16, block_size=16, num_classes=4, std=0.4, seed=5)


def _gens(seeds):
    return [torch.Generator().manual_seed(s) for s in seeds]


@pytest.mark.parametrize("method", METHODS)
def test_sample_output_independent_of_batch(model, method):
    labels = torch.tensor([0, 1, 2, 3, 1, 2])
    batch = decode(model, LlamaGenCondition(class_labels=labels), num_tokens=16, sampling=SAMPLING,
                   decoding=DecodingConfig.parse(method, window=5), generator=_gens(range(6)))
    for i in (0, 3, 5):
        alone = decode(model, LlamaGenCondition(class_labels=labels[i : i + 1]), num_tokens=16, sampling=SAMPLING,
                       decoding=DecodingConfig.parse(method, window=5), generator=_gens([i]))
        assert torch.equal(alone.tokens[0], batch.tokens[i])
        assert int(alone.stats.nfe[0]) == int(batch.stats.nfe[i])


def test_same_seed_same_output_and_samples_advance_at_their_own_pace(model):
    labels = torch.arange(4).repeat(4)
    runs = [
        decode(model, LlamaGenCondition(class_labels=labels), num_tokens=16, sampling=SAMPLING,
               decoding="mc-sjd", generator=torch.Generator().manual_seed(9))
        for _ in range(2)
    ]
    assert torch.equal(runs[0].tokens, runs[1].tokens)
    stats = runs[0].stats
    assert len(set(stats.nfe.tolist())) > 1, "samples should need different numbers of forward passes"
    assert bool((stats.tokens == 16).all()) and bool((stats.nfe <= 16).all())
    assert bool((stats.latency_s > 0).all())
    torch.testing.assert_close(stats.tokens_per_forward, 16 / stats.nfe.double())
    other = decode(model, LlamaGenCondition(class_labels=labels), num_tokens=16, sampling=SAMPLING,
                   decoding="mc-sjd", generator=torch.Generator().manual_seed(10))
    assert not torch.equal(other.tokens, runs[0].tokens)


def test_partial_grid_and_window_one(model):
    cond = LlamaGenCondition(class_labels=torch.tensor([1, 2]))
    greedy = SamplingConfig(temperature=0.0, guidance_scale=2.0)
    ref = decode(model, cond, num_tokens=7, sampling=greedy, decoding="ar")
    for method in METHODS[1:]:
        out = decode(model, cond, num_tokens=7, sampling=greedy, decoding=DecodingConfig.parse(method, window=1))
        assert torch.equal(out.tokens, ref.tokens)
        assert out.stats.nfe.tolist() == [7, 7]  # window 1 is AR


def test_callback_reports_progress(model):
    for method in ("ar", "sjd", "mc-sjd"):
        seen, snapshots = [], []

        def callback(progress):
            seen.append(progress.num_committed.clone())
            snapshots.append(progress.tokens.clone())

        out = decode(model, LlamaGenCondition(class_labels=torch.tensor([0, 1])), num_tokens=16, sampling=SAMPLING,
                     decoding=method, callback=callback, generator=_gens([0, 1]))
        assert seen and seen[-1].tolist() == [16, 16]
        assert all((b >= a).all() for a, b in zip(seen, seen[1:]))
        assert torch.equal(snapshots[-1], out.tokens)
        for committed, tokens in zip(seen, snapshots):  # committed prefixes are final and the rest is -1
            for b in range(2):
                k = int(committed[b])
                assert torch.equal(tokens[b, :k], out.tokens[b, :k]) and bool((tokens[b, k:] == -1).all())


def test_processors_force_row_end_tokens_in_every_window(model):
    """Emu3/Lumina-style: token 15 ends each row of 3 image tokens; image tokens are 0..14."""
    processors = (AllowedTokenRange(0, 16), PeriodicForcedToken(token_id=15, period=4))
    cond = LlamaGenCondition(class_labels=torch.tensor([0, 3]))
    greedy = SamplingConfig(temperature=0.0)
    ref = decode(model, cond, num_tokens=16, sampling=greedy, decoding="ar", processors=processors)
    for method in METHODS:
        out = decode(model, cond, num_tokens=16, sampling=SAMPLING if method != "ar" else greedy,
                     decoding=method, processors=processors, generator=_gens([0, 1]))
        forced = out.tokens[:, 3::4]
        assert bool((forced == 15).all()), method
        rest = torch.cat([out.tokens[:, i::4] for i in range(3)], 1)
        assert bool((rest != 15).all()), method
        if method != "ar":
            greedy_out = decode(model, cond, num_tokens=16, sampling=greedy, decoding=method, processors=processors)
            assert torch.equal(greedy_out.tokens, ref.tokens)


def test_decoding_config_parse_and_round_trip(tmp_path):
    assert DecodingConfig.parse("sjd-vertical").init == "vertical"
    assert DecodingConfig.parse("mc-sjd").coupling == "maximal"
    assert DecodingConfig.parse("mc-sjd-gumbel", window=8).name == "mc-sjd-gumbel:window=8"
    config = DecodingConfig(strategy="mc-sjd", window=12, init="random", coupling="gumbel")
    config.save_pretrained(tmp_path)
    loaded = DecodingConfig.from_pretrained(tmp_path)
    assert loaded == config and hash(loaded) == hash(config) and loaded.settings() == config.settings()
    assert loaded.sampling() == config.sampling()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.window = 4  # frozen: checked once, when built
    # a file saved by an older vispec (diffusers' ConfigMixin, no "acceptance" key) loads with the defaults
    from vispec.pipelines.embedded import resolve_model_path

    old = DecodingConfig.from_pretrained(resolve_model_path("vispec/tiny-c2i"), subfolder="decoding_config")
    assert old == DecodingConfig(strategy="mc-sjd", window=16, guidance_scale=3.0) and old.acceptance == "exact"
    (tmp_path / "decoding_config.json").write_text('{"strategy": "sjd", "speed": 2}')
    with pytest.raises(ValueError, match="speed"):
        DecodingConfig.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="not found"):
        DecodingConfig.from_pretrained(tmp_path / "missing")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(strategy="jacobi"), "strategy"),
        (dict(window=0), "window"),
        (dict(init="diagonal"), "init"),
        (dict(strategy="sjd", coupling="maximal"), "coupling"),
        (dict(strategy="mc-sjd", coupling="none"), "coupling"),
    ],
)
def test_bad_decoding_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DecodingConfig(**kwargs)


def test_bad_decode_inputs(model):
    cond = LlamaGenCondition(class_labels=torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="decoding"):
        decode(model, cond, num_tokens=4, decoding="fast")
    with pytest.raises(ValueError, match="generator"):
        decode(model, cond, num_tokens=4, generator=_gens([1]))
    with pytest.raises(ValueError, match="num_tokens"):
        decode(model, cond, num_tokens=0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        decode(model, cond, num_tokens=17)
    with pytest.raises(ValueError, match="top_k"):
        decode(model, cond, num_tokens=4, sampling=SamplingConfig(top_k=17))
    with pytest.raises(ValueError, match="sampling"):
        decode(model, cond, num_tokens=4, sampling={"temperature": 1.0})
    with pytest.raises(ValueError, match="class_labels"):
        decode(model, LlamaGenCondition(class_labels=torch.tensor([4])), num_tokens=4)
    with pytest.raises(ValueError, match="model"):
        decode(object(), cond, num_tokens=4)


def test_caption_conditioned_official_model_decodes_with_guidance():
    from vispec.models.llamagen_checkpoint import load_llamagen_gpt

    t2i = load_llamagen_gpt("tests/data/llamagen/t2i_tiny_raw.pt", n_head=4, cls_token_num=4, block_size=16)
    ref = torch.load("tests/data/llamagen/t2i_tiny_logits.pt", weights_only=True)
    mask = torch.tensor([[False, True, True, True], [True, True, True, True]])
    cond = LlamaGenCondition(caption_embeds=ref["caption"], caption_mask=mask)
    greedy = SamplingConfig(temperature=0.0, guidance_scale=4.0)
    ar = decode(t2i, cond, num_tokens=16, sampling=greedy, decoding="ar")
    for method in ("sjd-vertical", "mc-sjd-maximal"):
        assert torch.equal(decode(t2i, cond, num_tokens=16, sampling=greedy, decoding=method).tokens, ar.tokens)
    sampled = decode(t2i, cond, num_tokens=16, sampling=SAMPLING, decoding="mc-sjd-gumbel", generator=_gens([0, 1]))
    alone = decode(t2i, LlamaGenCondition(caption_embeds=ref["caption"][1:], caption_mask=mask[1:]), num_tokens=16,
                   sampling=SAMPLING, decoding="mc-sjd-gumbel", generator=_gens([1]))
    assert torch.equal(sampled.tokens[1], alone.tokens[0])


def test_bfloat16_model_decodes(model):
    bf16 = torch.nn.Module.to(tiny_gpt(vocab_size=16, block_size=16, num_classes=4, std=0.4, seed=5), dtype=torch.bfloat16)
    out = decode(bf16, LlamaGenCondition(class_labels=torch.tensor([0, 1])), num_tokens=16, sampling=SAMPLING,
                 decoding="mc-sjd", generator=_gens([0, 1]))
    assert out.tokens.shape == (2, 16) and bool(((out.tokens >= 0) & (out.tokens < 16)).all())


def test_decoding_label_options():
    from vispec.decoding import DecodingConfig

    base = DecodingConfig(strategy="mc-sjd", window=16, guidance_scale=3.0)
    cfg = DecodingConfig.parse("sjd-vertical:window=4", base=base)
    assert (cfg.strategy, cfg.init, cfg.window, cfg.guidance_scale) == ("sjd", "vertical", 4, 3.0)
    parsed = DecodingConfig.parse("mc-sjd:coupling=gumbel,window=8", base=base)
    assert parsed.method == "mc-sjd-gumbel:window=8" and parsed.name == "mc-sjd-gumbel:window=8,guidance_scale=3.0"
    for bad, words in (("sjd:window=x", "window must be an integer"), ("sjd:size=3", "options must be key=value"),
                       ("sjd:window", "options must be key=value"), ("sjd:window=0", r"window must be an integer in \[1, 4096\]")):
        with pytest.raises(ValueError, match=words):
            DecodingConfig.parse(bad, base=base)


SPECS = ["ar", "ar:window=8", "sjd", "sjd-random", "sjd-vertical:window=4", "mc-sjd", "mc-sjd-gumbel", "mc-sjd:window=6,init=random",
         "sd", "sd:window=3", "mc-sjd+lantern", "mc-sjd+lantern:k=10,delta=2,normalize=1", "sjd-random+gsd:d_thr=0",
         "gsd", "gsd:half_width=3", "sd+lantern:k=50,delta=0.2", "sjd:temperature=0.9,top_k=12,top_p=0.95,guidance_scale=2.5",
         "mc-sjd:cfg_interval=3+exact"]


@pytest.mark.parametrize("spec", SPECS)
def test_decoding_spec_names_round_trip(spec, tmp_path):
    config = DecodingConfig.parse(spec)
    assert DecodingConfig.parse(config.name) == config, config.name
    assert DecodingConfig.parse(config.method, base=config) == config  # the method label plus the sampling defaults
    config.save_pretrained(tmp_path)  # the acceptance rule is saved with the config
    assert DecodingConfig.from_pretrained(tmp_path) == config


def test_one_grammar_for_decode_and_the_rule_suffix(model):
    cond = LlamaGenCondition(class_labels=torch.tensor([0, 1]))
    codebook = torch.randn(16, 4, generator=torch.Generator().manual_seed(0))
    suffix = decode(model, cond, num_tokens=16, sampling=SAMPLING, decoding="mc-sjd+lantern:k=3,delta=0.1", codebook=codebook,
                    generator=_gens([0, 1]))
    keyword = decode(model, cond, num_tokens=16, sampling=SAMPLING, decoding="mc-sjd", acceptance="lantern:k=3,delta=0.1",
                     codebook=codebook, generator=_gens([0, 1]))
    assert torch.equal(suffix.tokens, keyword.tokens) and suffix.method == keyword.method == "mc-sjd-maximal+lantern:k=3,delta=0.1"
    assert suffix.stats.tv_mean is not None
    with pytest.raises(ValueError, match="not both"):
        decode(model, cond, num_tokens=16, decoding="mc-sjd+lantern:k=3", acceptance="gsd", codebook=codebook)
    with pytest.raises(ValueError, match="speculative decoder"):
        DecodingConfig.parse("ar+lantern")
    with pytest.raises(ValueError, match="gsd"):
        DecodingConfig.parse("gsd+lantern")
    spec = DecodingConfig.parse("sjd:top_k=4,temperature=0.5")  # sampling settings from the spec
    assert spec.sampling() == SamplingConfig(top_k=4, temperature=0.5)
    by_spec = decode(model, cond, num_tokens=16, decoding=spec, generator=_gens([0, 1]))
    by_arg = decode(model, cond, num_tokens=16, decoding="sjd", sampling=spec.sampling(), generator=_gens([0, 1]))
    assert torch.equal(by_spec.tokens, by_arg.tokens)
