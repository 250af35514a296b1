"""Dream: the official checkpoint layout, the shifted bidirectional forward, and Dream's sampler as a scheduler."""

from __future__ import annotations

import json
import math

import pytest
import torch

from dream_reference import dream_forward, dream_sample, random_dream_state, shifted, tiny_dream_config, write_dream_folder
from helpers import left_padded

from vispec.dllm import SCHEDULERS, DreamScheduler, StopDecoding, decode, make_scheduler
from vispec.dllm.dream import dream_candidates, dream_transfer_ratios, top_k_filter, top_p_filter
from vispec.kernels.unmask import RowNoise
from vispec.models.dream_checkpoint import (
    DREAM_7B_CONFIG,
    dream_config_to_kwargs,
    dream_state_dict,
    load_dream_checkpoint,
)
from vispec.models.llada import LLaDAModelLM

MASK, PAD = 60, 1
ALGS = ("maskgit_plus", "topk_margin", "entropy")


@pytest.fixture(scope="module")
def config():
    return tiny_dream_config()


@pytest.fixture(scope="module")
def state(config):
    return random_dream_state(config)


@pytest.fixture(scope="module")
def folder(tmp_path_factory, config, state):
    return write_dream_folder(tmp_path_factory.mktemp("dream") / "official", state, config)


@pytest.fixture(scope="module")
def model(folder):
    return load_dream_checkpoint(folder)


def prompts() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(3, MASK, (n,), generator=gen) for n in (7, 4, 9)]


def reference(state, config):
    return lambda x, mask4, tok_idx: dream_forward(state, config, x, mask4, tok_idx)


def real_positions(mask: torch.Tensor) -> torch.Tensor:
    """Positions whose shifted logits come from a real token (``mask[j - 1] == 1``)."""
    prev = torch.cat([torch.zeros_like(mask[:, :1]), mask[:, :-1]], dim=1)
    return (prev == 1) & (mask == 1)


# ---------------------------------------------------------------------------- checkpoint


@pytest.mark.parametrize("sharded", [True, False])
def test_official_layout_loads_and_matches_the_reference_forward(tmp_path, config, state, sharded):
    model = load_dream_checkpoint(write_dream_folder(tmp_path / "m", state, config, sharded=sharded))
    c = model.config
    assert c.logits_shift and c.include_qkv_bias and not model.training and model.dtype == torch.float32
    assert (c.d_model, c.n_heads, c.n_kv_heads, c.n_layers, c.mlp_hidden_size, c.vocab_size) == (32, 4, 2, 2, 48, 64)
    assert (c.mask_token_id, c.pad_token_id, c.eos_token_id, c.bos_token_id, c.eot_token_id) == (MASK, PAD, 1, 2, None)
    assert c.rms_norm_eps == 1e-6 and c.max_sequence_length == 128
    assert {k: torch.equal(v, state[k]) for k, v in dream_state_dict(model).items()} == {k: True for k in state}
    rows = prompts()
    ids, mask = left_padded(rows, PAD)
    ids[1, 3:] = MASK  # some masked positions too
    with torch.no_grad():
        ours = model(ids, mask).logits
    valid = mask.bool()
    tok_idx = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    ref = shifted(dream_forward(state, config, ids, valid[:, None, None, :] & valid[:, None, :, None], tok_idx))
    keep = real_positions(mask)
    torch.testing.assert_close(ours[keep], ref[keep], atol=2e-5, rtol=0)
    for i, row in enumerate(rows):  # a padded row's real positions: the row alone
        alone = shifted(dream_forward(state, config, ids[i, mask[i] == 1][None]))[0]
        torch.testing.assert_close(ours[i, mask[i] == 1][1:], alone[1:], atol=2e-5, rtol=0)
    assert load_dream_checkpoint(tmp_path / "m", dtype=torch.bfloat16).dtype == torch.bfloat16


def test_shift_reaches_the_cached_forwards(model):
    rows = prompts()
    ids, mask = left_padded(rows, PAD)
    with torch.no_grad():
        full = model(ids, mask).logits
    out = model.compute_kv_cache(ids, mask)
    torch.testing.assert_close(out.logits, full, atol=1e-5, rtol=0)
    for start, end in [(0, 3), (4, 7), (6, 9)]:  # a block (DualCache) and the rest (PrefixCache)
        torch.testing.assert_close(model.forward_span(ids[:, start:end], start, out.kv_cache).logits, full[:, start:end],
                                   atol=1e-5, rtol=0)
        torch.testing.assert_close(model.forward_span(ids[:, start:], start, out.kv_cache).logits, full[:, start:],
                                   atol=1e-5, rtol=0)


def test_strict_key_checks_list_dream_names(tmp_path, config, state):
    folder = write_dream_folder(tmp_path / "keys", state, config, drop=["model.layers.1.self_attn.k_proj.bias"],
                                extra={"model.layers.1.self_attn.o_proj.bias": torch.zeros(32)})
    with pytest.raises(ValueError, match=r"missing keys \['model.layers.1.self_attn.k_proj.bias'\], unexpected keys "
                                         r"\['model.layers.1.self_attn.o_proj.bias'\]"):
        load_dream_checkpoint(folder)
    folder = write_dream_folder(tmp_path / "shape", state, tiny_dream_config(intermediate_size=40), sharded=False)
    with pytest.raises(ValueError, match=r"shape mismatches \['model.layers.0.mlp.down_proj.weight: checkpoint \(32, 48\) "
                                         r"vs model \(32, 40\)'"):
        load_dream_checkpoint(folder)
    folder = write_dream_folder(tmp_path / "ghost", state, config)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.9.mlp.up_proj.weight"] = "model-00001-of-00002.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="disagrees with model.safetensors.index.json.*layers.9"):
        load_dream_checkpoint(folder)
    (folder / "config.json").unlink()
    with pytest.raises(ValueError, match="config.json is missing"):
        load_dream_checkpoint(folder)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="holds neither model.safetensors.index.json nor model.safetensors"):
        load_dream_checkpoint(tmp_path / "empty")


@pytest.mark.parametrize("key,value", [
    ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}), ("use_sliding_window", True), ("tie_word_embeddings", True),
    ("hidden_act", "gelu"), ("model_type", "qwen2"), ("head_dim", 16), ("num_attention_heads", 0),
    ("hidden_size", None), ("eos_token_id", "eos"), ("rope_theta", "big"), ("rms_norm_eps", -1.0),
    ("mask_token_id", 151666),
])
def test_settings_not_implemented_are_refused_by_name(tmp_path, state, key, value):
    config = tiny_dream_config(**{key: value})
    folder = write_dream_folder(tmp_path / "bad", state, config)
    with pytest.raises(ValueError, match=key):
        load_dream_checkpoint(folder)


def test_keys_the_network_does_not_depend_on_are_ignored(tmp_path, state):
    config = tiny_dream_config(sliding_window=4096, max_window_layers=28, attention_bias=False, mlp_bias=False,
                               eos_token_id=[1, 5], rms_norm_eps=None, rope_theta=None)
    model = load_dream_checkpoint(write_dream_folder(tmp_path / "ok", state, config))
    assert model.config.eos_token_id == 1 and model.config.rms_norm_eps == 1e-6 and model.config.rope_theta == 10000.0


def test_official_7b_config_maps_onto_the_model_arguments():
    kwargs = dream_config_to_kwargs(DREAM_7B_CONFIG)
    assert kwargs["mask_token_id"] == 151666 and kwargs["eot_token_id"] == 151645 and kwargs["pad_token_id"] == 151643
    with torch.device("meta"):
        big = LLaDAModelLM(**kwargs)
    assert sum(p.numel() for p in big.parameters()) == 7_615_616_512  # Qwen2.5-7B, untied head
    assert big.model.transformer.blocks[0].k_proj.bias.shape == (512,)  # 4 KV heads of 128
    with pytest.raises(ValueError, match="config must be a dict"):
        dream_config_to_kwargs([("hidden_size", 8)])


def test_save_pretrained_round_trip(tmp_path, model):
    model.save_pretrained(tmp_path / "saved")
    again = load_dream_checkpoint(tmp_path / "saved")
    ids = torch.randint(3, MASK, (2, 6))
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, model(ids).logits, atol=0, rtol=0)
    LLaDAModelLM(d_model=16, n_heads=2, n_layers=1, mlp_hidden_size=16, vocab_size=64, embedding_size=64,
                 mask_token_id=MASK, eos_token_id=1, eot_token_id=None, pad_token_id=0,
                 bos_token_id=None).save_pretrained(tmp_path / "llada")
    with pytest.raises(ValueError, match="not a Dream model"):
        load_dream_checkpoint(tmp_path / "llada")


# ---------------------------------------------------------------------------- sampler vs Dream's _sample


@pytest.mark.parametrize("settings", [{}, {"top_p": 0.8, "top_k": 6}, {"eps": 0.05}])
@pytest.mark.parametrize("alg", ALGS)
def test_tokens_equal_dreams_sample_at_batch_one(model, config, state, alg, settings):
    for prompt in prompts()[:2]:
        out = decode(model, prompt[None], scheduler=DreamScheduler(alg=alg, **settings), gen_length=12, block_length=12,
                     steps=5)
        ref = dream_sample(reference(state, config), prompt[None], None, max_new_tokens=12, steps=5, mask_id=MASK,
                           alg=alg, never_propose=[MASK], **settings)
        assert torch.equal(out.tokens, ref), (alg, settings)
        assert out.stats.nfe.tolist() == [5] and out.method == "dream"


@pytest.mark.parametrize("alg", ALGS)
def test_padded_batch_equals_dreams_sample_row_by_row(model, config, state, alg):
    """vispec counts masks per row: each row of a padded batch is Dream's batch-1 result for that row, with or
    without padding around it (Dream's 4-D mask and tok_idx, at batch 1)."""
    rows = prompts()
    ids, mask = left_padded(rows, PAD)
    out = decode(model, ids, mask, scheduler=DreamScheduler(alg=alg), gen_length=10, block_length=10, steps=4)
    forward = reference(state, config)
    for i, row in enumerate(rows):
        alone = dream_sample(forward, row[None], None, max_new_tokens=10, steps=4, mask_id=MASK, alg=alg,
                             never_propose=[MASK])
        padded = dream_sample(forward, ids[i:i + 1], mask[i:i + 1], max_new_tokens=10, steps=4, mask_id=MASK, alg=alg,
                              never_propose=[MASK])
        assert torch.equal(out.tokens[i], alone[0]) and torch.equal(out.tokens[i], padded[0]), (alg, i)


@pytest.mark.parametrize("block_length", [12, 6])
def test_commit_counts_follow_the_timestep_schedule_per_block(model, block_length):
    steps, eps = 8, 1e-3
    per_block = steps // (12 // block_length)
    seen = []
    decode(model, prompts()[0][None], scheduler=DreamScheduler(alg="maskgit_plus", eps=eps), gen_length=12,
           block_length=block_length, steps=steps, callback=lambda p: seen.append(int(p.details["transfer_index"].sum())))
    t = torch.linspace(1, eps, per_block + 1)
    expected = []
    for _ in range(12 // block_length):
        left = block_length
        for i in range(per_block):
            n = int(torch.tensor(float(left)) * (1 - t[i + 1] / t[i])) if i < per_block - 1 else left
            expected.append(n)
            left -= n
    assert seen == expected and sum(seen) == 12
    assert torch.equal(dream_transfer_ratios(per_block, eps), 1 - t[1:] / t[:-1])


def test_origin_commits_each_mask_with_the_step_probability(model):
    """origin at T = 0: every position is committed by the last step; at step i each masked position is committed
    independently with probability r_i = 1 - t_{i+1}/t_i (aggregate counts within 5 binomial sigmas)."""
    batch, gen, steps = 48, 16, 4
    prompt = prompts()[1]
    counts = []

    def callback(progress):  # commits per batch row (rows whose canvas is complete sit out: 0)
        per_row = torch.zeros(batch, dtype=torch.long)
        per_row[progress.details["rows"]] = progress.details["transfer_index"].sum(dim=1)
        counts.append(per_row)

    out = decode(model, prompt[None].expand(batch, -1).contiguous(), scheduler=DreamScheduler(alg="origin"),
                 gen_length=gen, block_length=gen, steps=steps, callback=callback,
                 generator=[torch.Generator().manual_seed(100 + i) for i in range(batch)])
    assert not (out.tokens == MASK).any() and len(counts) == steps and (out.stats.nfe <= steps).all()
    ratios = dream_transfer_ratios(steps, 1e-3).double()
    left = torch.full((batch,), gen)
    for i in range(steps - 1):
        expected = float((left * ratios[i]).sum())
        sigma = math.sqrt(float((left * ratios[i] * (1 - ratios[i])).sum()))
        assert abs(float(counts[i].sum()) - expected) < 5 * sigma, (i, counts[i].sum(), expected)
        left = left - counts[i]
    assert torch.equal(counts[-1], left) and (left > 0).any()  # the last step commits what is left
    assert torch.equal(out.stats.nfe, steps - (left == 0).long())  # a row complete before the last step stops
    assert len({tuple(row) for row in torch.stack(counts, dim=1).tolist()}) > 1  # rows draw their own coins


@pytest.mark.parametrize("alg,settings", [("origin", {}), ("maskgit_plus", {"alg_temp": 0.5}),
                                          ("entropy", {"top_p": 0.9, "top_k": 8}), ("topk_margin", {})])
def test_rows_do_not_depend_on_the_batch_at_temperature(model, alg, settings):
    rows = prompts()
    ids, mask = left_padded(rows, PAD)
    gens = lambda: [torch.Generator().manual_seed(7 + i) for i in range(len(rows))]  # noqa: E731
    kwargs = dict(gen_length=12, block_length=6, steps=6, temperature=0.9)
    batched = decode(model, ids, mask, scheduler=DreamScheduler(alg=alg, **settings), generator=gens(), **kwargs)
    for i, row in enumerate(rows):
        alone = decode(model, row[None], scheduler=DreamScheduler(alg=alg, **settings), generator=[gens()[i]], **kwargs)
        assert torch.equal(batched.tokens[i], alone.tokens[0]), (alg, i)
    greedy = decode(model, ids, mask, scheduler=DreamScheduler(alg=alg, **settings), generator=gens(),
                    **{**kwargs, "temperature": 0.0})
    assert not torch.equal(greedy.tokens, batched.tokens)


def test_candidates_sample_the_processed_distribution():
    """T > 0: x̂ ~ softmax(topk(topp(ℓ / T))); confidences are q(x̂), the top-2 margin and Σ q log(q + 1e-10)."""
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -1.0, -3.0, 4.0])
    rows = 20000
    noise = RowNoise(torch.full((rows,), 11), torch.arange(rows), torch.zeros(rows, dtype=torch.long))
    tokens, conf = dream_candidates(logits.expand(rows, -1), 0.7, "maskgit_plus", top_p=0.95, top_k=4, noise=noise)
    x = logits / 0.7
    order = x.argsort(descending=True)
    mass = torch.softmax(x[order], 0).cumsum(0)
    keep = torch.zeros(8, dtype=torch.bool)
    keep[order[torch.cat([torch.tensor([True]), mass[:-1] <= 0.95])]] = True
    keep &= x >= x.topk(4).values[-1]
    q = torch.softmax(x.masked_fill(~keep, float("-inf")), 0)
    freq = torch.bincount(tokens, minlength=8).double() / rows
    assert (freq[~keep] == 0).all()
    assert ((freq - q).abs() < 5 * (q * (1 - q) / rows).sqrt() + 1e-9).all(), (freq, q)
    torch.testing.assert_close(conf, q[tokens].double(), atol=1e-6, rtol=0)
    greedy_tok, margin = dream_candidates(logits[None], 0.0, "topk_margin")
    p = torch.softmax(logits, 0).sort(descending=True).values
    assert greedy_tok.item() == 7 and abs(margin.item() - float(p[0] - p[1])) < 1e-6
    _, negent = dream_candidates(logits[None], 0.0, "entropy", proposal_mask=torch.arange(8) == 7)
    p = torch.softmax(logits[:7], 0)
    assert abs(negent.item() - float((p * p.log()).sum())) < 1e-5
    # the filters keep the first token past top_p and ties with the k-th largest
    assert torch.equal(top_p_filter(torch.tensor([[3.0, 0.0, 0.0]]), 0.5) > -1e30, torch.tensor([[True, False, False]]))
    assert torch.equal(top_k_filter(torch.tensor([[1.0, 2.0, 2.0, 0.0]]), 2) > -1e30, torch.tensor([[False, True, True, False]]))


def test_triton_kernel_samples_the_same_candidates(monkeypatch):
    """The T > 0 sample goes through the unmasking kernel (Triton on CUDA; here its interpreter): the same tokens as
    the PyTorch reference, with the -inf (suppressed) and lowest-float (filtered) logits Dream's processing leaves."""
    pytest.importorskip("triton")
    from vispec.kernels.backend import interpreter_enabled

    if not interpreter_enabled():
        pytest.skip("needs TRITON_INTERPRET=1 (set by conftest) to run the kernel on the CPU")
    logits = torch.randn(16, 100, generator=torch.Generator().manual_seed(0)) * 3
    suppressed = torch.zeros(100, dtype=torch.bool)
    suppressed[[5, 60, 99]] = True
    noise = RowNoise(torch.arange(16) * 7 + 1, torch.arange(16), torch.full((16,), 3))
    outs = {}
    for backend in ("reference", "triton"):
        monkeypatch.setenv("VISPEC_KERNELS", backend)
        outs[backend] = dream_candidates(logits, 0.8, "entropy", top_p=0.9, top_k=10, proposal_mask=suppressed, noise=noise)
    assert torch.equal(outs["triton"][0], outs["reference"][0]) and torch.equal(outs["triton"][1], outs["reference"][1])
    assert not suppressed[outs["triton"][0]].any()


def test_alg_temp_draws_positions_without_replacement():
    """alg_temp > 0: the n committed positions are a draw without replacement from softmax(c / alg_temp): with a
    confidence gap far above alg_temp the most confident wins, with a huge alg_temp the draw is near uniform."""
    sched = DreamScheduler(alg="maskgit_plus", alg_temp=0.01)
    sched.set_timesteps(2, 4, 4)
    logits = torch.zeros(1, 4, 8)
    logits[0, 2, 3] = 8.0  # position 2 is by far the most confident
    sample = torch.full((1, 4), MASK)
    from vispec.dllm import UnmaskNoise

    picks = []
    for draw in range(200):
        noise = UnmaskNoise(torch.tensor([5]), torch.arange(4)[None], torch.tensor([draw]))
        out = sched.step(logits, 0, sample, mask_token_id=MASK, noise=noise)
        assert int(out.transfer_index.sum()) == 1  # ⌊4 · (1 - t_1/t_0)⌋ = 1
        picks.append(int(out.transfer_index[0].nonzero()))
    assert set(picks) == {2}
    hot = DreamScheduler(alg="maskgit_plus", alg_temp=1e6)
    hot.set_timesteps(2, 4, 4)
    picks = [int(hot.step(logits, 0, sample, mask_token_id=MASK, noise=UnmaskNoise(
        torch.tensor([5]), torch.arange(4)[None], torch.tensor([d]))).transfer_index[0].nonzero()) for d in range(400)]
    assert min(picks.count(k) for k in range(4)) > 60


def test_confidence_eos_eot_inf_ranks_eos_proposals_last(model):
    sched = DreamScheduler(alg="maskgit_plus")
    sched.set_timesteps(2, 3, 3)
    logits = torch.zeros(1, 3, 8)
    logits[0, 0, 1] = 9.0  # position 0 proposes EOS (id 1), most confidently
    logits[0, 1, 5] = 5.0
    logits[0, 2, 6] = 3.0
    sample = torch.full((1, 3), MASK)
    plain = sched.step(logits, 0, sample, mask_token_id=MASK)
    eos_last = sched.step(logits, 0, sample, mask_token_id=MASK, confidence_mask=torch.arange(8) == 1)
    assert plain.transfer_index.tolist() == [[True, False, False]]
    assert eos_last.transfer_index.tolist() == [[False, True, False]]
    out = decode(model, prompts()[0][None], scheduler=DreamScheduler(), gen_length=8, block_length=8, steps=4,
                 confidence_eos_eot_inf=True, logits_eos_inf=True, early_stop_eos=True)
    assert not (out.tokens == MASK).any() and not (out.tokens == 1).any()


# ---------------------------------------------------------------------------- caches


def test_caches_run_and_are_exact_for_one_layer(tmp_path):
    """One layer: a position's cached K/V depend on its own token only, so the prefix and dual caches are exact
    and give the cache-free tokens (the shift included: a wrong shift in the span forward would change them)."""
    config = tiny_dream_config(num_hidden_layers=1)
    one = load_dream_checkpoint(write_dream_folder(tmp_path / "one", random_dream_state(config, seed=4), config))
    ids, mask = left_padded(prompts(), PAD)
    kwargs = dict(scheduler=DreamScheduler(alg="entropy"), gen_length=12, block_length=4, steps=6)
    ref = decode(one, ids, mask, **kwargs)
    for cache in ("prefix", "dual"):
        out = decode(one, ids, mask, cache=cache, **kwargs)
        assert torch.equal(out.tokens, ref.tokens), cache
        assert torch.equal(out.stats.nfe, ref.stats.nfe)


@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_caches_run_with_the_dream_model(model, cache):
    """Two layers: the caches are approximate. They run, fill the canvas, and a single block's first step (the
    cache-refreshing full forward) commits what the cache-free decode commits."""
    ids, mask = left_padded(prompts(), PAD)
    out = decode(model, ids, mask, scheduler=DreamScheduler(alg="topk_margin"), gen_length=12, block_length=4, steps=9,
                 cache=cache)
    assert not (out.tokens == MASK).any() and out.stats.nfe.tolist() == [9, 9, 9]

    def stop(progress):
        raise StopDecoding

    first = {c: decode(model, ids, mask, scheduler=DreamScheduler(alg="topk_margin"), gen_length=12, block_length=12,
                       steps=4, cache=c, callback=stop).tokens for c in ("none", cache)}
    assert torch.equal(first["none"], first[cache]) and (first[cache] != MASK).sum() > 0


# ---------------------------------------------------------------------------- registry and bad input


def test_registered_as_a_strategy():
    assert SCHEDULERS["dream"] is DreamScheduler and DreamScheduler.strategy == "dream"
    sched = make_scheduler("dream", alg="topk_margin", alg_temp=0.0, top_k=5)
    assert isinstance(sched, DreamScheduler) and sched.config.alg == "topk_margin" and not sched.uses_remask_noise
    assert DreamScheduler(alg="origin").uses_remask_noise and DreamScheduler(alg_temp=0.3).uses_remask_noise


@pytest.mark.parametrize("settings,name", [
    ({"alg": "greedy"}, "alg"), ({"alg": None}, "alg"), ({"alg_temp": -0.1}, "alg_temp"), ({"alg_temp": "hot"}, "alg_temp"),
    ({"alg": "origin", "alg_temp": 0.5}, "alg_temp"), ({"eps": 0.0}, "eps"), ({"eps": 1.5}, "eps"), ({"eps": True}, "eps"),
    ({"top_p": 0.0}, "top_p"), ({"top_p": 1.2}, "top_p"), ({"top_k": -1}, "top_k"), ({"top_k": 2.5}, "top_k"),
])
def test_bad_settings_raise_naming_the_argument(settings, name):
    with pytest.raises(ValueError, match=rf"^{name}[ =]"):
        DreamScheduler(**settings)


def test_bad_step_input_raises_before_any_work(model):
    sched = DreamScheduler()
    logits, sample = torch.zeros(1, 4, 8), torch.full((1, 4), MASK)
    with pytest.raises(ValueError, match="set_timesteps"):
        sched.step(logits, 0, sample, mask_token_id=MASK)
    with pytest.raises(ValueError, match="steps must be an integer"):
        decode(model, prompts()[0][None], scheduler=DreamScheduler(), gen_length=4, block_length=4)
    with pytest.raises(ValueError, match="steps .6. must be divisible"):
        decode(model, prompts()[0][None], scheduler=DreamScheduler(), gen_length=8, block_length=2, steps=6)
    sched.set_timesteps(2, 4, 4)
    with pytest.raises(ValueError, match="timestep must be an integer in \\[0, 1\\]"):
        sched.step(logits, 2, sample, mask_token_id=MASK)
    with pytest.raises(ValueError, match="model_output must be float logits"):
        sched.step(logits[:, :3], 0, sample, mask_token_id=MASK)
    with pytest.raises(ValueError, match="noise is needed"):
        sched.step(logits, 0, sample, mask_token_id=MASK, temperature=0.5)
    with pytest.raises(ValueError, match="noise is needed"):
        origin = DreamScheduler(alg="origin")
        origin.set_timesteps(2, 4, 4)
        origin.step(logits, 0, sample, mask_token_id=MASK)
    with pytest.raises(ValueError, match="proposal_mask must be None or a bool tensor of shape \\(8,\\)"):
        sched.step(logits, 0, sample, mask_token_id=MASK, proposal_mask=torch.zeros(7, dtype=torch.bool))
    with pytest.raises(ValueError, match="steps must be an integer"):
        dream_transfer_ratios(0, 1e-3)
