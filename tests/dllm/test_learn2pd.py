"""Learn2PD: the filter's training data (oracle pass), its training, the scheduler and the pipeline component."""

from __future__ import annotations

import json
import os

import pytest
import torch

from vispec.cli import main
from vispec.dllm import LearnedFilterScheduler, LLaDAScheduler, ParallelDecodeFilter, decode, make_scheduler
from vispec.dllm.learned import block_features
from vispec.eval.train.filter import (
    FilterTrainConfig,
    fit_filter,
    oracle_dataset,
    oracle_rows,
    reference_answers,
    split_rows,
    training_prompts,
)
from vispec.pipelines import MaskedDiffusionLMPipeline

GEN, BLOCK = 32, 8
PROMPTS = ["sort the numbers : 5 3 9 3 1", "reverse the letters : k d m a", "sort the numbers : 8 1 4 4 2 7"]


@pytest.fixture(scope="module")
def pipe(tiny_mdlm):
    return tiny_mdlm


@pytest.fixture(scope="module")
def inputs(pipe):
    ids, mask = pipe.prepare_input_ids(prompt=PROMPTS)
    return ids, mask


@pytest.fixture(scope="module")
def rows(pipe, inputs):
    ids, mask = inputs
    reference = reference_answers(pipe.model, ids, mask, GEN, BLOCK)
    return reference, oracle_rows(pipe.model, ids, mask, reference, BLOCK, pipe.mask_token_id)


def constant_filter(bias: float, block_length: int = BLOCK) -> ParallelDecodeFilter:
    """A filter whose logit is ``bias`` everywhere (accepts all for large ``bias``, none for very negative)."""
    f = ParallelDecodeFilter(block_length=block_length, hidden_size=4)
    with torch.no_grad():
        for p in f.parameters():
            p.zero_()
        f.net[2].bias.fill_(bias)
    return f


def test_reference_answers_are_llada_baseline(pipe, inputs, rows):
    reference, _ = rows
    ids, mask = inputs
    out = pipe(input_ids=ids, attention_mask=mask, strategy="llada", gen_length=GEN, block_length=BLOCK, steps=GEN,
               early_stop_eos=False, output_type="seq")
    assert torch.equal(reference, out.sequences)


def test_oracle_rows_follow_their_definition(pipe, inputs, rows):
    reference, data = rows
    ids, mask = inputs
    n = data["features"].shape[0]
    assert data["features"].shape == (n, BLOCK) and data["features"].dtype == torch.float32
    assert data["labels"].shape == data["masked"].shape == (n, BLOCK)
    assert bool(data["masked"].any(dim=1).all())  # a row is recorded only while its block has masks
    assert bool(((data["features"] > 0) & (data["features"] <= 1)).all())
    # each block of each sample: steps 0, 1, ... and at most Lb of them
    assert int(data["step"].max()) < BLOCK
    blocks = GEN // BLOCK
    for sample in range(len(PROMPTS)):
        steps = data["step"][data["sample"] == sample]
        assert int((steps == 0).sum()) == blocks
    # the first recorded row of a sample is the all-mask first block: features are those of one full forward
    x = torch.cat([ids, torch.full((len(PROMPTS), GEN), pipe.mask_token_id)], dim=1)
    logits = pipe.model(x, attention_mask=torch.cat([mask, torch.ones(len(PROMPTS), GEN, dtype=mask.dtype)], 1)).logits
    first = logits[:, ids.shape[1]:ids.shape[1] + BLOCK]
    from vispec.dllm.tokens import proposal_mask
    proposal = proposal_mask(pipe.model, first.shape[-1], pipe.mask_token_id, first.device)
    expected = block_features(first, proposal)
    got = data["features"][:len(PROMPTS)]
    assert torch.allclose(got, expected, atol=1e-5)
    guess = first.masked_fill(proposal, float("-inf")).argmax(-1)
    assert torch.equal(data["labels"][:len(PROMPTS)], guess == reference[:, :BLOCK])


def test_oracle_rows_are_batch_independent(pipe, inputs, rows):
    reference, data = rows
    ids, mask = inputs
    one_ids, one_mask = pipe.prepare_input_ids(prompt=PROMPTS[1:2])
    alone = oracle_rows(pipe.model, one_ids, None, reference[1:2], BLOCK, pipe.mask_token_id)
    mine = data["sample"] == 1
    assert torch.equal(alone["labels"], data["labels"][mine])
    assert torch.equal(alone["step"], data["step"][mine])
    assert torch.allclose(alone["features"], data["features"][mine], atol=1e-5)


def test_oracle_dataset_is_seeded(pipe):
    prompts = training_prompts(("arithmetic", "sort"), 2, seed=3)
    assert prompts == training_prompts(("arithmetic", "sort"), 2, seed=3)
    a = oracle_dataset(pipe, prompts, GEN, BLOCK, batch_size=3)
    b = oracle_dataset(pipe, prompts, GEN, BLOCK, batch_size=4)  # batching does not change the rows' content
    order = lambda d: torch.argsort(d["sample"] * 1000 + d["step"] * 10, stable=True)  # noqa: E731
    assert torch.equal(a["labels"][order(a)].sum(0), b["labels"][order(b)].sum(0))
    assert sorted(a["sample"].tolist()) == sorted(b["sample"].tolist())


def test_fit_filter_is_seeded_and_learns(rows):
    _, data = rows
    f1, rec1 = fit_filter(data, BLOCK, hidden_size=8, epochs=200, seed=0, log_every=50)
    f2, rec2 = fit_filter(data, BLOCK, hidden_size=8, epochs=200, seed=0, log_every=50)
    for p1, p2 in zip(f1.parameters(), f2.parameters()):
        assert torch.equal(p1, p2)
    assert rec1["test"] == rec2["test"]
    assert rec1["history"][-1]["train_bce"] < rec1["history"][0]["train_bce"] or rec1["history"][0]["train_bce"] < 0.3
    assert set(rec1["test"]) == {"bce", "false_positive_rate", "recall", "precision", "accepted_fraction"}
    n = data["features"].shape[0]
    assert sum(rec1["rows"].values()) == n
    train, val, test = split_rows(n, 0)
    assert len(set(train.tolist()) | set(val.tolist()) | set(test.tolist())) == n


def test_fit_filter_rejects_bad_rows(rows):
    _, data = rows
    with pytest.raises(ValueError, match="features must be"):
        fit_filter(data, BLOCK + 1)
    small = {k: v[:5] for k, v in data.items()}
    with pytest.raises(ValueError, match="at least 10"):
        fit_filter(small, BLOCK)


def test_accept_all_filter_commits_the_block_in_one_step(pipe, inputs):
    ids, mask = inputs
    out = decode(pipe.model, ids, mask, scheduler=LearnedFilterScheduler(filter=constant_filter(20.0)),
                 gen_length=GEN, block_length=BLOCK)
    assert out.stats.nfe.tolist() == [GEN // BLOCK] * len(PROMPTS)


def test_reject_all_filter_is_one_token_per_step(pipe, inputs):
    ids, mask = inputs
    seen = []
    sched = LearnedFilterScheduler(filter=constant_filter(-20.0))
    out = decode(pipe.model, ids, mask, scheduler=sched, gen_length=GEN, block_length=BLOCK,
                 callback=lambda p: seen.append(p.details["transfer_index"].sum(dim=1)))
    assert out.stats.nfe.tolist() == [GEN] * len(PROMPTS)
    assert all(bool((s == 1).all()) for s in seen)


def test_accepted_positions_are_committed_masked_positions(pipe):
    torch.manual_seed(0)
    sched = LearnedFilterScheduler(threshold=0.5, filter=ParallelDecodeFilter(block_length=4, hidden_size=4))
    sched.set_timesteps(None, 8, 4)
    logits = torch.randn(3, 4, 11) * 3
    sample = torch.tensor([[1, 10, 10, 10], [10, 10, 10, 10], [2, 3, 4, 10]])
    out = sched.step(logits, 0, sample, mask_token_id=10)
    masked = sample == 10
    assert bool((out.accepted <= masked).all()) and bool((out.accepted <= out.transfer_index).all())
    assert bool((out.transfer_index.sum(1) >= 1).all())
    assert torch.equal(out.prev_sample, torch.where(out.transfer_index, out.sampled_tokens, sample))


def test_learn2pd_batch_equals_single(pipe, inputs, rows):
    _, data = rows
    filt, _ = fit_filter(data, BLOCK, hidden_size=8, epochs=300, seed=0)
    ids, mask = inputs
    sched = LearnedFilterScheduler(threshold=0.9, filter=filt)
    batch = decode(pipe.model, ids, mask, scheduler=sched, gen_length=GEN, block_length=BLOCK, cache="dual")
    for i, prompt in enumerate(PROMPTS):
        one_ids, _ = pipe.prepare_input_ids(prompt=[prompt])
        alone = decode(pipe.model, one_ids, None, scheduler=sched, gen_length=GEN, block_length=BLOCK, cache="dual")
        assert torch.equal(alone.tokens[0], batch.tokens[i])
        assert int(alone.stats.nfe[0]) == int(batch.stats.nfe[i])


@pytest.mark.parametrize("kwargs, match", [
    ({"threshold": 0.0}, "threshold"), ({"threshold": 1.5}, "threshold"), ({"threshold": "high"}, "threshold"),
    ({"filter": torch.nn.Linear(8, 8)}, "filter must be a ParallelDecodeFilter"),
])
def test_scheduler_bad_inputs(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LearnedFilterScheduler(**kwargs)


def test_scheduler_needs_a_filter_of_the_block_length(pipe, inputs):
    ids, mask = inputs
    with pytest.raises(ValueError, match="needs a trained filter"):
        decode(pipe.model, ids, mask, scheduler=make_scheduler("learn2pd"), gen_length=GEN, block_length=BLOCK)
    with pytest.raises(ValueError, match="block_length \\(8\\) must equal the filter's block_length \\(16\\)"):
        decode(pipe.model, ids, mask, scheduler=LearnedFilterScheduler(filter=constant_filter(0.0, 16)),
               gen_length=GEN, block_length=BLOCK)
    with pytest.raises(ValueError, match="block_length"):
        ParallelDecodeFilter(block_length=0)
    with pytest.raises(ValueError, match="features must have 8"):
        constant_filter(0.0)(torch.zeros(2, 5))


def test_pipeline_without_filter_refuses_learn2pd(pipe):
    with pytest.raises(ValueError, match="no filter component"):
        pipe(prompt=PROMPTS[0], strategy="learn2pd")
    with pytest.raises(ValueError, match="filter must be a ParallelDecodeFilter"):
        MaskedDiffusionLMPipeline(model=pipe.model, tokenizer=pipe.tokenizer, scheduler=LLaDAScheduler(),
                                  filter=torch.nn.Linear(2, 2))


def test_filter_is_a_pipeline_component(pipe, tmp_path):
    filt = constant_filter(20.0)
    with_filter = MaskedDiffusionLMPipeline(model=pipe.model, tokenizer=pipe.tokenizer, scheduler=pipe.scheduler,
                                            default_gen_length=GEN, default_block_length=BLOCK, filter=filt)
    with_filter.save_pretrained(tmp_path / "p")
    loaded = MaskedDiffusionLMPipeline.from_pretrained(tmp_path / "p")
    loaded.set_progress_bar_config(disable=True)
    assert isinstance(loaded.filter, ParallelDecodeFilter)
    out = loaded(prompt=PROMPTS, strategy="learn2pd", early_stop_eos=False)
    assert [s["nfe"] for s in out.stats] == [GEN // BLOCK] * len(PROMPTS)
    assert out.stats[0]["method"] == "learn2pd"
    # the threshold override keeps the filter
    out = loaded(prompt=PROMPTS[:1], strategy="learn2pd", threshold=0.99, early_stop_eos=False)
    assert out.stats[0]["nfe"] == GEN // BLOCK
    assert loaded.scheduler.__class__.__name__ == "ThresholdScheduler"  # the saved default is untouched


def test_train_filter_cli_writes_a_loadable_pipeline(tmp_path, capsys):
    out = tmp_path / "l2p"
    code = main(["train", "filter", "--model", "tiny-mdlm", "--out", str(out), "--prompts-per-task", "2",
                 "--epochs", "30", "--hidden-size", "8", "--threads", "1"])
    assert code == 0
    printed = capsys.readouterr().out
    summary = json.loads(printed[printed.index("{"):])
    assert summary["block_length"] == BLOCK and summary["oracle_rows"] > 0
    record = json.load(open(out / "filter" / "training.json"))
    assert record["config"]["prompts_per_task"] == 2 and "test" in record["metrics"]
    assert os.path.exists(out / "model_index.json")
    loaded = MaskedDiffusionLMPipeline.from_pretrained(out)
    loaded.set_progress_bar_config(disable=True)
    assert loaded.filter.config.block_length == BLOCK
    assert loaded(prompt=PROMPTS[0], strategy="learn2pd").texts[0]


@pytest.mark.parametrize("field, value", [("prompts_per_task", 0), ("epochs", 0), ("lr", 0.0), ("threshold", 1.5),
                                          ("gen_length", -1), ("tasks", ())])
def test_train_config_bad_inputs(field, value):
    cfg = FilterTrainConfig(**{field: value})
    with pytest.raises(ValueError, match=field):
        cfg.validate()


def test_text_demo_section_runs():
    from vispec.eval import demo

    report = demo.run_text_demo("vispec/tiny-mdlm", ("arithmetic", "sort"), problems=1)
    assert list(report["settings"]) == list(demo._text_settings(long=False))
    assert report["settings"]["llada, 1 token/step (LLaDA's baseline)"]["nfe"] == GEN
    assert "tiny-mdlm on arithmetic, sort" in demo._text_report_md(report)


def test_train_filter_adds_to_an_existing_folder(pipe, tmp_path, capsys):
    folder = tmp_path / "model"
    pipe.save_pretrained(folder)
    (folder / "README.md").write_text("card")
    assert main(["train", "filter", "--model", str(folder), "--out", str(folder), "--prompts-per-task", "2",
                 "--tasks", "sort", "--epochs", "5", "--hidden-size", "4", "--threads", "1"]) == 0
    assert (folder / "README.md").read_text() == "card"
    loaded = MaskedDiffusionLMPipeline.from_pretrained(folder)
    assert loaded.filter is not None and loaded.filter.config.hidden_size == 4


def test_embedded_long_model_ships_its_filter():
    """tiny-mdlm-long carries the filter it was trained with (block 32); Learn2PD + EoTP decodes a batch as each row
    alone, in far fewer forwards than the 256 of LLaDA's baseline."""
    long = MaskedDiffusionLMPipeline.from_pretrained("vispec/tiny-mdlm-long")
    long.set_progress_bar_config(disable=True)
    assert isinstance(long.filter, ParallelDecodeFilter) and long.filter.config.block_length == 32
    prompts = ["reverse the letters : k d m a", "sort the numbers : 5 3 9 3 1 2"]
    batch = long(prompt=prompts, strategy="learn2pd", eotp=True, cache="dual", early_stop_eos=False)
    for i, prompt in enumerate(prompts):
        alone = long(prompt=prompt, strategy="learn2pd", eotp=True, cache="dual", early_stop_eos=False)
        assert alone.texts[0] == batch.texts[i] and alone.stats[0]["nfe"] == batch.stats[i]["nfe"]
        assert batch.stats[i]["nfe"] < 32
    assert batch.texts[0] == "a m d k"


class RecordingFilter(ParallelDecodeFilter):
    """A constant filter that keeps every feature vector it is given."""

    def __init__(self, bias: float, block_length: int):
        super().__init__(block_length=block_length, hidden_size=4)
        with torch.no_grad():
            for p in self.parameters():
                p.zero_()
            self.net[2].bias.fill_(bias)
        self.seen: list = []

    def forward(self, features):
        self.seen.append(features.detach().clone())
        return super().forward(features)


@pytest.mark.parametrize("cache", ["none", "dual"])
def test_positions_cut_by_eotp_read_as_decided_eos_to_the_filter(pipe, cache):
    """After end-of-text prediction cuts a row inside its block, the filter reads confidence 1 at the dropped
    positions (an EOS the row has decided), whether or not the forward computed them: alone the forward stops at
    the cut, beside a longer row it does not. Zero logits there (confidence 1/V) made the filter's input, and so
    its decisions, depend on the batch and left the filter's training distribution."""
    block = 16
    prompts = ["reverse the letters : k d m a", "sort the numbers : 8 1 4 4 2 7 9 3"]
    ids, mask = pipe.prepare_input_ids(prompt=prompts)
    alone_ids, _ = pipe.prepare_input_ids(prompt=prompts[:1])
    seen = {}
    for name, (p_ids, p_mask) in {"alone": (alone_ids, None), "batch": (ids, mask)}.items():
        filt, cuts = RecordingFilter(-20.0, block), []
        decode(pipe.model, p_ids, p_mask, scheduler=LearnedFilterScheduler(filter=filt), gen_length=GEN,
               block_length=block, eotp=True, cache=cache,
               callback=lambda p: cuts.append(dict(zip(p.details["rows"].tolist(), p.details["canvas_length"].tolist()))))
        # the filter's call k reads the cut after step k - 1; keep the calls where row 0 is cut inside its block
        pairs = [(f[0], cuts[k - 1][0]) for k, f in enumerate(filt.seen[: len(cuts)]) if k and cuts[k - 1].get(0, GEN) < block
                 and 0 in cuts[k]]
        assert pairs, "the test needs a cut inside the first block"
        assert all(bool((f[cut:] == 1.0).all()) for f, cut in pairs)
        seen[name] = [f for f, _ in pairs]
    # the kept positions agree up to float rounding (a padded batch runs other matmul shapes)
    assert len(seen["alone"]) == len(seen["batch"])
    assert all(torch.allclose(a, b, atol=1e-4) for a, b in zip(seen["alone"], seen["batch"]))
