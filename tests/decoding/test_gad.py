"""GAD for images (``decoding="gad"``, :mod:`vispec.decoding.gad`) and its masked block drafter
(:class:`vispec.models.gad_drafter.GADDrafter`): shapes, what the drafter may see, clear errors before any work,
batch independence, composition with the acceptance rules, and the pipeline's ``gad_drafter`` slot.

The distributional certificate (chi-square against the exact AR joint, with negative controls) is
``tests/exactness/test_gad_exactness.py``."""

from __future__ import annotations

import pytest
import torch

from vispec.decoding import DecodingConfig, decode
from vispec.models.gad_drafter import GADDrafter
from vispec.models.llamagen_gpt import LlamaGenCondition
from vispec.sampling import SamplingConfig

from helpers import gens, image_components, tiny_gpt

VOCAB, TOKENS, CLASSES = 32, 36, 5
SAMPLING = SamplingConfig(temperature=0.9, top_k=12, top_p=0.95, guidance_scale=2.0)


def tiny_drafter(seed: int = 5, std: float = 0.3, **overrides) -> GADDrafter:
    """A random block drafter with peaked, context-dependent proposals (output head re-initialised: the
    constructor zeroes it, which would make every ``q`` uniform)."""
    torch.manual_seed(seed)
    settings = dict(vocab_size=VOCAB, dim=16, n_layer=1, n_head=2, num_classes=CLASSES, block_size=TOKENS, context=12,
                    max_block=8)
    drafter = GADDrafter(**{**settings, **overrides}).eval()
    torch.nn.init.normal_(drafter.output.weight, std=std)
    return drafter


@pytest.fixture(scope="module")
def model():
    return tiny_gpt(vocab_size=VOCAB, block_size=TOKENS, num_classes=CLASSES, std=0.5, seed=3)


@pytest.fixture(scope="module")
def drafter():
    return tiny_drafter()


def condition(labels) -> LlamaGenCondition:
    return LlamaGenCondition(class_labels=torch.as_tensor(labels, dtype=torch.long))


# ---------------------------------------------------------------------- the drafter
def test_drafter_shapes_and_guidance_halves(drafter):
    tokens = torch.randint(0, VOCAB, (3, TOKENS), generator=torch.Generator().manual_seed(0))
    prefix, masked = torch.tensor([1, 20, 30]), torch.tensor([8, 5, 4])
    out = drafter.propose(tokens, prefix, masked, condition([0, 1, 2]), guidance=True)
    assert out.cond.shape == out.uncond.shape == (3, 8, VOCAB) and out.cond.dtype == torch.float32
    plain = drafter.propose(tokens, prefix, masked, condition([0, 1, 2]), guidance=False)
    assert plain.uncond is None and torch.allclose(plain.cond, out.cond, atol=1e-5)
    null = drafter(tokens, prefix, masked, torch.tensor([0, 1, 2]), torch.ones(3, dtype=torch.bool))
    assert torch.allclose(null, out.uncond, atol=1e-5)
    assert not torch.allclose(out.cond, out.uncond)  # the class matters


def test_drafter_sees_only_the_committed_context(drafter):
    """Rows depend on the last ``context`` committed tokens only: not on what follows the prefix (drafts, stale
    tokens), nor on tokens before the context; padding masks (rows >= k) do not change the real rows."""
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (1, TOKENS), generator=gen)
    n, labels = torch.tensor([30]), torch.tensor([2])
    base = drafter(tokens, n, torch.tensor([5]), labels)
    later = tokens.clone()
    later[:, 30:] = torch.randint(0, VOCAB, (1, TOKENS - 30), generator=gen)
    early = tokens.clone()
    early[:, : 30 - drafter.context_size] = 0
    assert torch.equal(drafter(later, n, torch.tensor([5]), labels), base)
    assert torch.allclose(drafter(early, n, torch.tensor([5]), labels), base, atol=1e-6)
    inside = tokens.clone()
    inside[:, 29] = (inside[:, 29] + 1) % VOCAB
    assert not torch.allclose(drafter(inside, n, torch.tensor([5]), labels), base)
    shorter = drafter(tokens, n, torch.tensor([3]), labels)
    assert not torch.allclose(shorter[:, :3], base[:, :3])  # the block's size is visible to its masks ...
    assert torch.allclose(drafter(tokens.repeat(2, 1), n.repeat(2), torch.tensor([5, 3]), labels.repeat(2))[1], shorter[0],
                          atol=1e-5)  # ... and a ragged batch gives each row its own


def test_drafter_save_load_roundtrip(drafter, tmp_path):
    drafter.save_pretrained(tmp_path / "gad")
    assert (tmp_path / "gad" / "config.json").is_file() and any(p.suffix == ".safetensors" for p in (tmp_path / "gad").iterdir())
    loaded = GADDrafter.from_pretrained(tmp_path / "gad").eval()
    tokens = torch.randint(0, VOCAB, (2, TOKENS), generator=torch.Generator().manual_seed(2))
    args = (tokens, torch.tensor([4, 9]), torch.tensor([8, 8]), torch.tensor([0, 4]))
    assert torch.equal(loaded(*args), drafter(*args))


@pytest.mark.parametrize("kwargs,name", [
    (dict(tokens=torch.zeros(2, TOKENS)), "tokens"),
    (dict(tokens=torch.zeros(TOKENS, dtype=torch.long)), "tokens"),
    (dict(num_prefix=torch.tensor([1])), "num_prefix"),
    (dict(num_prefix=torch.tensor([0, 3])), "num_prefix"),
    (dict(num_masked=torch.tensor([9, 1])), "num_masked"),
    (dict(num_prefix=torch.tensor([30, 3]), num_masked=torch.tensor([8, 1])), "num_prefix \\+ num_masked"),
    (dict(labels=torch.tensor([0, 5])), "labels"),
    (dict(tokens=torch.full((2, TOKENS), VOCAB)), "tokens"),
    (dict(condition_drop=torch.tensor([1, 0])), "condition_drop"),
])
def test_drafter_bad_input_names_the_argument(drafter, kwargs, name):
    args = dict(tokens=torch.zeros(2, TOKENS, dtype=torch.long), num_prefix=torch.tensor([1, 3]), num_masked=torch.tensor([2, 2]),
                labels=torch.tensor([0, 1]))
    args.update(kwargs)
    with pytest.raises(ValueError, match=name):
        drafter(**args)


@pytest.mark.parametrize("kwargs,name", [(dict(context=TOKENS + 1), "context"), (dict(max_block=0), "max_block"),
                                         (dict(block_size=60), "block_size"), (dict(dim=12, n_head=2), "dim")])
def test_drafter_bad_config_names_the_setting(kwargs, name):
    with pytest.raises(ValueError, match=name):
        tiny_drafter(**kwargs)


# ---------------------------------------------------------------------- the causal drafter
def causal_drafter(**overrides) -> GADDrafter:
    return tiny_drafter(**{"context": 0, "attention": "causal", **overrides})


def test_causal_drafter_rows_see_only_what_lies_left():
    """``attention="causal"``: row ``i`` of a block at ``n`` is read at the slot of ``x_{n+i-1}`` and sees the class,
    the whole prefix and the masks before it, so it does not depend on the block's length (later masks) nor on any
    token at or after ``n``; a token anywhere in the prefix (even position 0) changes every row."""
    drafter = causal_drafter()
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (1, TOKENS), generator=gen)
    n, labels = torch.tensor([20]), torch.tensor([2])
    base = drafter(tokens, n, torch.tensor([8]), labels)
    later = tokens.clone()
    later[:, 20:] = torch.randint(0, VOCAB, (1, TOKENS - 20), generator=gen)
    assert torch.equal(drafter(later, n, torch.tensor([8]), labels), base)
    assert torch.allclose(drafter(tokens, n, torch.tensor([3]), labels)[:, :3], base[:, :3], atol=1e-6)
    early = tokens.clone()
    early[:, 0] = (early[:, 0] + 1) % VOCAB
    assert not torch.allclose(drafter(early, n, torch.tensor([8]), labels)[:, 0], base[:, 0])
    with pytest.raises(ValueError, match="context must be 0"):
        tiny_drafter(attention="causal")
    with pytest.raises(ValueError, match="attention"):
        tiny_drafter(attention="sideways")


def test_causal_drafter_packed_training_forward_equals_the_decoding_forward():
    """``forward_packed`` (many blocks per sequence, the trainer's) gives the rows ``forward`` gives block by block,
    including blocks cut at the image's end; a bidirectional drafter refuses it."""
    drafter = causal_drafter(n_layer=2)
    tokens = torch.randint(0, VOCAB, (2, TOKENS), generator=torch.Generator().manual_seed(3))
    labels, starts = torch.tensor([1, 4]), torch.tensor([[1, 7, 33], [2, 20, 35]])
    first, rest = drafter.forward_packed(tokens, starts, labels, torch.tensor([False, True]))
    assert first.shape == (2, TOKENS - 1, VOCAB) and rest.shape == (2, 3, 7, VOCAB)
    for b in range(2):
        for m in range(3):
            n = int(starts[b, m])
            k = min(8, TOKENS - n)
            rows = drafter(tokens[b:b + 1], torch.tensor([n]), torch.tensor([k]), labels[b:b + 1], torch.tensor([b == 1]))[0]
            assert torch.allclose(rows[0], first[b, n - 1], atol=1e-5)
            assert torch.allclose(rows[1:k], rest[b, m, :k - 1], atol=1e-5)
    with pytest.raises(ValueError, match="causal"):
        tiny_drafter().forward_packed(tokens, starts, labels)


def test_causal_drafter_warm_started_from_a_gpt_drafts_its_first_row_as_the_gpt(model):
    """Warm-started from a same-shaped LlamaGen GPT, a causal drafter's first row is the GPT's next-token logits."""
    from vispec.eval.train.gad import warm_start_from_ar

    drafter = causal_drafter(dim=32, n_layer=2, n_head=2)
    warm_start_from_ar(drafter, model)
    tokens = torch.randint(0, VOCAB, (2, TOKENS), generator=torch.Generator().manual_seed(4))
    labels = torch.tensor([0, 3])
    with torch.no_grad():
        reference = model(tokens[:, :-1], condition(labels))  # output t predicts token t
        first, _ = drafter.forward_packed(tokens, torch.tensor([[5], [9]]), labels)
    assert torch.allclose(first, reference[:, 1:].float(), atol=1e-4)


# ---------------------------------------------------------------------- the decoder
def test_gad_spec_parses_and_names():
    config = DecodingConfig.parse("gad")
    assert config.strategy == "gad" and config.window == 9 and config.method == "gad"
    assert DecodingConfig.parse("gad:window=5+budget:delta=0.1").name == "gad:window=5+budget:delta=0.1"
    assert DecodingConfig.parse(DecodingConfig.parse("gad:window=4").name) == DecodingConfig.parse("gad:window=4")


def test_gad_passes_parse_name_and_refuse_bad_values():
    config = DecodingConfig.parse("gad:passes=4,groups=doubling")
    assert (config.passes, config.groups) == (4, "doubling") and config.method == "gad:passes=4,groups=doubling"
    assert DecodingConfig.parse(config.name) == config and DecodingConfig.parse("gad:passes=1") == DecodingConfig.parse("gad")
    assert DecodingConfig.parse("sd", base=config).passes == 1  # another strategy parsed over it drops gad's passes
    for spec, name in [("gad:passes=0", "passes"), ("gad:passes=9", "passes=9 exceeds gad's 8 drafts"),
                       ("gad:window=3,passes=3", "passes=3 exceeds"), ("gad:passes=two", "passes must be an integer"),
                       ("gad:passes=2,groups=halving", "groups must be one of"), ("sd:passes=2", "apply to gad"),
                       ("mc-sjd:groups=doubling", "apply to gad")]:
        with pytest.raises(ValueError, match=name):
            DecodingConfig.parse(spec)


@pytest.mark.parametrize("gamma,passes,groups,bounds", [
    (8, 1, "even", [0, 8]), (8, 2, "even", [0, 4, 8]), (8, 3, "even", [0, 3, 6, 8]), (8, 8, "even", list(range(9))),
    (8, 4, "doubling", [0, 1, 2, 4, 8]), (8, 3, "doubling", [0, 2, 4, 8]), (5, 3, "doubling", [0, 2, 3, 5]), (8, 5, "doubling", [0, 1, 2, 3, 4, 8]),
    (16, 4, "doubling", [0, 2, 4, 8, 16]), (4, 4, "doubling", [0, 1, 2, 3, 4]),
])
def test_draft_groups(gamma, passes, groups, bounds):
    from vispec.decoding.gad import draft_groups

    assert draft_groups(gamma, passes, groups) == bounds


def test_gad_passes_draft_left_to_right_on_earlier_drafts(model, drafter, monkeypatch):
    """Each pass drafts its group with the earlier passes' drafts as committed context: its prefix ends where the
    group starts (clipped to the sample's block), its masks cover the rest of the block, and the drafts it reads
    are the ones the decoder verifies. ``passes=1`` is the single-forward decode token for token."""
    calls = []
    propose = type(drafter).propose

    def recording(self, tokens, num_prefix, num_masked, *args, **kwargs):
        calls.append((tokens.clone(), num_prefix.clone(), num_masked.clone()))
        return propose(self, tokens, num_prefix, num_masked, *args, **kwargs)

    kwargs = dict(num_tokens=TOKENS, sampling=SAMPLING, drafter=drafter)
    one = decode(model, condition([0, 2]), decoding="gad:window=6", generator=gens(2), **kwargs)
    assert torch.equal(decode(model, condition([0, 2]), decoding="gad:window=6,passes=1", generator=gens(2),
                              **kwargs).tokens, one.tokens)
    monkeypatch.setattr(type(drafter), "propose", recording)
    out = decode(model, condition([0, 2]), decoding="gad:window=6,passes=3,groups=doubling", generator=gens(2), **kwargs)
    rounds = 0
    while 3 * rounds + 3 <= len(calls) and int(calls[3 * rounds][2].max()) > 3:  # rounds with all three passes
        first, second, third = calls[3 * rounds: 3 * rounds + 3]  # bounds 0, 2, 3, 5 (doubling, 5 drafts)
        n, block = first[1], first[2]
        rounds += 1
        assert torch.equal(second[1], n + block.clamp(max=2)) and torch.equal(third[1], n + block.clamp(max=3))
        assert torch.equal(second[1] + second[2], n + block) and torch.equal(third[1] + third[2], n + block)
        for b in range(2):  # the later passes read the first pass's drafts at n, n + 1 (they are in their context)
            if int(block[b]) >= 3:
                assert torch.equal(second[0][b, n[b]:n[b] + 2], third[0][b, n[b]:n[b] + 2])
    assert rounds >= 5
    drafter_nfe = out.stats.extra["drafter_nfe"]
    assert bool((drafter_nfe > out.stats.nfe).all()) and bool((drafter_nfe <= 3 * (out.stats.nfe - 1)).all())


def test_gad_block_proposal_counts_forwards(model, drafter):
    out = decode(model, condition([0, 1, 2]), num_tokens=TOKENS, sampling=SAMPLING, decoding="gad:window=6",
                 drafter=drafter, generator=gens(3))
    assert out.tokens.shape == (3, TOKENS) and bool(((out.tokens >= 0) & (out.tokens < VOCAB)).all())
    nfe, drafter_nfe = out.stats.nfe, out.stats.extra["drafter_nfe"]
    # one drafter forward per target forward that had drafts (all but the prefill and the final bonus-only pass)
    assert bool((drafter_nfe <= nfe - 1).all()) and bool((drafter_nfe >= nfe - 2).all())
    assert bool((out.stats.accepted_drafts > 0).all()) and bool((nfe < TOKENS).all())
    assert int(out.stats.commits[:, 6:].sum()) == 0  # at most window tokens per pass


@pytest.mark.parametrize("spec,causal", [("gad:window=5", False), ("gad:window=5,passes=2", False), ("gad:window=5", True)])
def test_gad_greedy_matches_ar(model, drafter, spec, causal):
    greedy = SamplingConfig(temperature=0.0, guidance_scale=3.0)
    reference = decode(model, condition(list(range(CLASSES))), num_tokens=TOKENS, sampling=greedy, decoding="ar")
    out = decode(model, condition(list(range(CLASSES))), num_tokens=TOKENS, sampling=greedy, decoding=spec,
                 drafter=causal_drafter() if causal else drafter)
    assert torch.equal(out.tokens, reference.tokens)


@pytest.mark.parametrize("spec,max_batch_size", [("gad", None), ("gad:passes=3,groups=doubling", None),
                                                  pytest.param("gad", 2, marks=pytest.mark.slow)])
def test_gad_outputs_do_not_depend_on_the_batch(model, drafter, spec, max_batch_size):
    """Per-sample generators: a sample's tokens are the same alone, in a batch, and streamed through fewer slots."""
    labels = [3, 0, 4, 1]
    batch = decode(model, condition(labels), num_tokens=TOKENS, sampling=SAMPLING, decoding=spec, drafter=drafter,
                   generator=gens(4, seed=10), max_batch_size=max_batch_size)
    for i in (0, 2):
        alone = decode(model, condition([labels[i]]), num_tokens=TOKENS, sampling=SAMPLING, decoding=spec, drafter=drafter,
                       generator=gens(1, seed=10 + i))
        assert torch.equal(alone.tokens[0], batch.tokens[i])
        assert int(alone.stats.nfe[0]) == int(batch.stats.nfe[i])
        assert int(alone.stats.extra["drafter_nfe"][0]) == int(batch.stats.extra["drafter_nfe"][i])


def test_gad_composes_with_the_acceptance_rules(model, drafter):
    """The exact rule is the default (``+exact`` is the same decode); lossy rules are allowed, as for ``sd``, and
    report their measured TV; the budgeted rule at δ = 0 is the exact rule token for token."""
    kwargs = dict(num_tokens=TOKENS, sampling=SAMPLING, drafter=drafter)
    assert DecodingConfig.parse("gad+exact") == DecodingConfig.parse("gad")
    exact = decode(model, condition([0, 1]), decoding="gad", generator=gens(2), **kwargs)
    assert torch.equal(decode(model, condition([0, 1]), decoding="gad", acceptance="budget:delta=0", generator=gens(2),
                              **kwargs).tokens, exact.tokens)
    lossy = decode(model, condition([0, 1]), decoding="gad+budget:delta=0.2", generator=gens(2), **kwargs)
    assert lossy.stats.tv_mean is not None and float(lossy.stats.tv_max.max()) <= 0.2 + 1e-6
    assert int(lossy.stats.accepted_drafts.sum()) >= int(exact.stats.accepted_drafts.sum()) - 8


def test_gad_bad_input_is_refused_before_any_work(model, drafter, monkeypatch):
    calls = []
    monkeypatch.setattr(type(model), "prefill", lambda *a, **k: calls.append(1))
    cases = [
        (dict(drafter=None), "drafter"),
        (dict(drafter=tiny_gpt(vocab_size=VOCAB, block_size=TOKENS, num_classes=CLASSES)), "drafter"),  # an AR GPT
        (dict(drafter=tiny_drafter(vocab_size=VOCAB + 1)), "vocabulary"),
        (dict(drafter=tiny_drafter(block_size=16, context=4)), "drafter covers"),
        (dict(decoding="gad:window=10"), "window"),  # 9 drafts > max_block 8
        (dict(decoding="gad:window=1"), "window"),
        (dict(drafter=tiny_drafter(class_dropout_prob=0.0)), "unconditional"),
        (dict(compile=True), "compile"),
    ]
    for overrides, name in cases:
        kwargs = dict(num_tokens=TOKENS, sampling=SAMPLING, decoding="gad", drafter=drafter, generator=gens(1))
        kwargs.update(overrides)
        with pytest.raises(ValueError, match=name):
            decode(model, condition([0]), **kwargs)
    assert not calls


# ---------------------------------------------------------------------- the pipeline
def test_pipeline_gad_drafter_slot(tmp_path):
    from vispec.pipelines import LlamaGenPipeline

    components = image_components(drafter=False)
    transformer = components["transformer"]
    without = LlamaGenPipeline(**components)
    without.set_progress_bar_config(disable=True)
    with pytest.raises(ValueError, match="gad_drafter"):
        without(class_labels=[0], decoding="gad", output_type="latent")
    t = transformer.config
    torch.manual_seed(0)
    gad = GADDrafter(vocab_size=t.vocab_size, dim=16, n_layer=1, n_head=2, num_classes=t.num_classes, block_size=t.block_size,
                     context=8, max_block=4)
    pipe = LlamaGenPipeline(**components, gad_drafter=gad)
    pipe.set_progress_bar_config(disable=True)
    out = pipe(class_labels=[0, 1], decoding="gad:window=3", generator=gens(2), output_type="latent")
    assert out.stats[0]["method"] == "gad:window=3" and out.stats[0]["drafter_nfe"] > 0
    pipe.save_pretrained(tmp_path / "p")
    loaded = LlamaGenPipeline.from_pretrained(tmp_path / "p")
    loaded.set_progress_bar_config(disable=True)
    assert isinstance(loaded.gad_drafter, GADDrafter)
    again = loaded(class_labels=[0, 1], decoding="gad:window=3", generator=gens(2), output_type="latent")
    assert torch.equal(again.images, out.images)


def test_warm_start_copies_a_same_shaped_gpt_and_keeps_the_mask_row(model):
    """``vispec train gad-drafter --warm-start``: every shared parameter comes from the GPT, the [MASK] row stays as
    initialised; a GPT of another shape is refused by name."""
    from vispec.eval.train.gad import warm_start_from_ar

    drafter = tiny_drafter(dim=32, n_layer=2, n_head=2)
    mask_row = drafter.tok_embeddings.weight[-1].clone()
    warm_start_from_ar(drafter, model)
    theirs = model.state_dict()
    for key, value in drafter.state_dict().items():
        expected = theirs[key] if key != "tok_embeddings.weight" else torch.cat([theirs[key], mask_row[None]])
        assert torch.equal(value, expected), key
    with pytest.raises(ValueError, match="dim, n_layer and n_head must match"):
        warm_start_from_ar(tiny_drafter(), model)


def test_train_config_causal_drafter_reads_the_whole_prefix():
    from vispec.eval.train.configs import GADDrafterTrainConfig

    with pytest.raises(ValueError, match="context must be 0"):
        GADDrafterTrainConfig(attention="causal", context=48).validate()
    with pytest.raises(ValueError, match="attention must be 'bidirectional' or 'causal'"):
        GADDrafterTrainConfig(attention="both").validate()


SOURCE = dict(vocab_size=VOCAB, dim=32, n_layer=2, n_head=2, n_kv_head=None, multiple_of=256, ffn_dim_multiplier=None,
              num_classes=CLASSES, class_dropout_prob=0.1, block_size=TOKENS, model_type="c2i")


@pytest.mark.parametrize("source, flags, words", [
    ({}, {}, None),
    ({"norm_eps": 1e-6, "rope_base": 100.0}, {}, None),  # no shape: still a fit
    ({}, {"dim": 64, "n_head": 4}, "--dim 64 does not fit --warm-start drafter"),
    ({}, {"n_layer": 3}, "--n-layer 3 does not fit"),
    # the same tensor shapes split into other heads: warm_start_from_ar would copy them, but the drafter would not
    # compute the GPT's function (nor use its RoPE table): refused, as its docstring asks ("n_head must match")
    ({}, {"n_head": 4}, "--n-head 4 does not fit"),
    ({}, {"class_dropout_prob": 0.0}, "--class-dropout-prob 0.0 does not fit"),
    ({"class_dropout_prob": 0.0}, {}, "--class-dropout-prob 0.1 does not fit .* has no null-class row"),
    ({"n_kv_head": 1}, {}, "has n_kv_head 1, the GAD drafter needs 2"),
    ({"multiple_of": 32}, {}, "has SwiGLU width 96, the GAD drafter needs 256"),
    ({"vocab_size": VOCAB + 1}, {}, f"has vocab_size {VOCAB + 1}, the GAD drafter needs {VOCAB}"),
    ({"num_classes": CLASSES + 1}, {}, f"has num_classes {CLASSES + 1}, the GAD drafter needs {CLASSES}"),
], ids=lambda v: str(v)[:40])
def test_train_config_checks_the_warm_start_as_warm_start_from_ar_loads(source, flags, words, tmp_path):
    """Issue 47 item 20: ``GADDrafterTrainConfig.validate`` reads the warm start's and the target's config.json (before
    any sampling) and accepts exactly the shapes :func:`warm_start_from_ar` loads; a refusal names the flag, its value
    and the value required, or (for what no flag sets) the warm start."""
    import json

    from vispec.cli.args import config_flag
    from vispec.eval.train.configs import GADDrafterTrainConfig
    from vispec.eval.train.gad import build_gad_drafter, warm_start_from_ar
    from vispec.models.llamagen_gpt import LlamaGenGPT

    pipe = tmp_path / "pipe"
    components = {"transformer": SOURCE, "drafter": {**SOURCE, **source}}
    for name, config in components.items():
        (pipe / name).mkdir(parents=True)
        (pipe / name / "config.json").write_text(json.dumps(config))
    (pipe / "model_index.json").write_text(json.dumps({"_class_name": "LlamaGenPipeline",
                                                       **{n: ["vispec.models.llamagen_gpt", "LlamaGenGPT"] for n in components}}))
    cfg = GADDrafterTrainConfig(target=str(pipe), out=str(tmp_path / "out"), **{**dict(dim=32, n_layer=2, n_head=2), **flags})
    flag = lambda field: config_flag(GADDrafterTrainConfig, field)  # noqa: E731
    target, ar = (LlamaGenGPT(**config) for config in components.values())
    if words is None:
        cfg.validate(flag)
        warm_start_from_ar(build_gad_drafter(cfg, target), ar)
    else:
        with pytest.raises(ValueError, match=words):
            cfg.validate(flag)
        if "n_head" not in flags:
            with pytest.raises(ValueError, match="warm start"):
                warm_start_from_ar(build_gad_drafter(cfg, target), ar)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pipe"]  # the --out check made nothing
    GADDrafterTrainConfig(target=str(pipe), out=str(tmp_path / "out"), warm_start="", **flags).validate()
