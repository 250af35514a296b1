"""LlamaGen GPT: official-checkpoint compatibility, the ragged KV cache, save/load, bad input."""

from __future__ import annotations

import torch
import pytest

from vispec.models.llamagen_checkpoint import load_llamagen_gpt
from vispec.models.llamagen_gpt import GPT_CONFIGS, LlamaGenCondition, LlamaGenGPT, ffn_hidden_dim

from helpers import tiny_gpt

DATA = "tests/data/llamagen"
ATOL = 1e-4


@pytest.fixture(scope="module")
def c2i():
    return load_llamagen_gpt(f"{DATA}/c2i_tiny.pt", trust_pickle=True, n_head=4)


@pytest.fixture(scope="module")
def t2i():
    return load_llamagen_gpt(f"{DATA}/t2i_tiny_raw.pt", n_head=4, cls_token_num=4, block_size=16)


def test_c2i_official_logits_teacher_forced_and_cached(c2i):
    ref = torch.load(f"{DATA}/c2i_tiny_logits.pt", weights_only=True)
    assert c2i.config.num_classes == 10 and c2i.config.class_dropout_prob == 0.0 and c2i.config.block_size == 16
    cond = LlamaGenCondition(class_labels=ref["cond"])
    with torch.no_grad():
        torch.testing.assert_close(c2i(ref["idx"], cond), ref["logits"], atol=ATOL, rtol=0)
    state, first = c2i.prefill(cond, guidance=False, max_new_tokens=16, window=15)
    rest = c2i.forward_window(state, ref["idx"])
    torch.testing.assert_close(torch.cat([first.cond, rest.cond], 1), ref["logits"], atol=ATOL, rtol=0)


def test_t2i_official_raw_layout_logits(t2i):
    ref = torch.load(f"{DATA}/t2i_tiny_logits.pt", weights_only=True)
    assert t2i.config.model_type == "t2i" and t2i.config.caption_dim == 16
    cond = LlamaGenCondition(caption_embeds=ref["caption"])
    with torch.no_grad():
        torch.testing.assert_close(t2i(ref["idx"], cond), ref["logits"], atol=ATOL, rtol=0)
    state, first = t2i.prefill(cond, guidance=True, max_new_tokens=16, window=15)
    rest = t2i.forward_window(state, ref["idx"])
    torch.testing.assert_close(torch.cat([first.cond, rest.cond], 1), ref["logits"], atol=ATOL, rtol=0)


def test_t2i_caption_padding_mask_matches_between_paths(t2i):
    ref = torch.load(f"{DATA}/t2i_tiny_logits.pt", weights_only=True)
    mask = torch.tensor([[False, True, True, True], [False, False, True, True]])  # left padding
    cond = LlamaGenCondition(caption_embeds=ref["caption"], caption_mask=mask)
    with torch.no_grad():
        full = t2i(ref["idx"], cond)
    state, first = t2i.prefill(cond, guidance=False, max_new_tokens=16, window=15)
    rest = t2i.forward_window(state, ref["idx"])
    torch.testing.assert_close(torch.cat([first.cond, rest.cond], 1), full, atol=ATOL, rtol=0)
    assert (full - ref["logits"]).abs().max() > 1e-3  # the mask changes the result


def test_pickled_checkpoint_needs_opt_in():
    with pytest.raises(ValueError, match="trust_pickle=True"):
        load_llamagen_gpt(f"{DATA}/c2i_tiny.pt", n_head=4)


@pytest.mark.parametrize("layout", ["model", "module", "state_dict", "raw"])
def test_official_layouts_and_safetensors(tmp_path, c2i, layout):
    sd = c2i.state_dict()
    obj = sd if layout == "raw" else {layout: sd}
    torch.save(obj, tmp_path / "ckpt.pt")
    model = load_llamagen_gpt(tmp_path / "ckpt.pt", n_head=4, num_classes=10, image_size=64)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), sd.values()))
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in sd.items()}, tmp_path / "ckpt.safetensors")
    assert load_llamagen_gpt(tmp_path / "ckpt.safetensors", n_head=4, num_classes=10, block_size=16).config.vocab_size == 64


def test_key_mismatches_are_listed(tmp_path, c2i):
    sd = dict(c2i.state_dict())
    sd.pop("norm.weight")
    sd["extra.weight"] = torch.zeros(1)
    torch.save({"model": sd}, tmp_path / "bad.pt")
    with pytest.raises(ValueError, match=r"missing keys \['norm.weight'\].*unexpected keys \['extra.weight'\]"):
        load_llamagen_gpt(tmp_path / "bad.pt", n_head=4, num_classes=10, image_size=64)


def test_unknown_layout_corrupted_file_and_missing_config(tmp_path):
    torch.save([1, 2, 3], tmp_path / "list.pt")
    with pytest.raises(ValueError, match="state dict"):
        load_llamagen_gpt(tmp_path / "list.pt", n_head=4, image_size=64)
    (tmp_path / "broken.pt").write_bytes(b"not a checkpoint at all")
    with pytest.raises(ValueError, match="not a readable torch checkpoint"):
        load_llamagen_gpt(tmp_path / "broken.pt", n_head=4, image_size=64)
    with pytest.raises(ValueError, match="image_size"):
        load_llamagen_gpt(f"{DATA}/t2i_tiny_raw.pt", n_head=4)
    with pytest.raises(ValueError, match="n_head"):
        load_llamagen_gpt(f"{DATA}/t2i_tiny_raw.pt", block_size=16)


def test_save_pretrained_round_trip(tmp_path, c2i):
    c2i.save_pretrained(tmp_path / "gpt")
    loaded = LlamaGenGPT.from_pretrained(tmp_path / "gpt").eval()
    ref = torch.load(f"{DATA}/c2i_tiny_logits.pt", weights_only=True)
    cond = LlamaGenCondition(class_labels=ref["cond"])
    with torch.no_grad():
        assert torch.equal(loaded(ref["idx"], cond), c2i(ref["idx"], cond))


def test_named_configs_follow_llamagen_sizes():
    assert set(["GPT-B", "GPT-L", "GPT-XL", "GPT-XXL", "GPT-3B"]) <= set(GPT_CONFIGS)
    assert ffn_hidden_dim(768, 256, None) == 2048  # GPT-B
    model = LlamaGenGPT.from_name("GPT-B", vocab_size=16384, block_size=256)
    params = sum(p.numel() for p in model.parameters())
    assert 105e6 < params < 115e6  # LlamaGen reports 111M for GPT-B
    with pytest.raises(ValueError, match="gpt_model"):
        LlamaGenGPT.from_name("GPT-Q")


def test_ragged_windows_and_rollback_match_teacher_forcing():
    model = tiny_gpt(vocab_size=16, block_size=16, num_classes=3)
    torch.manual_seed(0)
    idx = torch.randint(0, 16, (3, 15))
    cond = LlamaGenCondition(class_labels=torch.tensor([0, 1, 2]))
    with torch.no_grad():
        full = model(idx, cond)
    with torch.no_grad():  # every label dropped to the null class
        full_null = model(idx, cond, condition_drop=torch.ones(3, dtype=torch.bool))
    state, first = model.prefill(cond, guidance=True, max_new_tokens=16, window=4)
    torch.testing.assert_close(first.cond[:, 0], full[:, 0], atol=ATOL, rtol=0)
    torch.testing.assert_close(first.uncond[:, 0], full_null[:, 0], atol=ATOL, rtol=0)
    done = torch.zeros(3, dtype=torch.long)  # tokens of idx already cached per sample
    for keep_pattern in ([1, 3, 2], [4, 1, 3], [2, 4, 1], [3, 2, 4]):
        window = torch.stack([idx[b, done[b] : done[b] + 4] for b in range(3)])
        out = model.forward_window(state, window)
        for b in range(3):
            torch.testing.assert_close(out.cond[b], full[b, done[b] + 1 : done[b] + 5], atol=ATOL, rtol=0)
            torch.testing.assert_close(out.uncond[b], full_null[b, done[b] + 1 : done[b] + 5], atol=ATOL, rtol=0)
        keep = torch.tensor(keep_pattern)
        model.rollback(state, keep)
        done += keep
    # dropping a sample keeps the others intact
    state = model.select(state, torch.tensor([0, 2]))
    window = torch.stack([idx[b, done[b] : done[b] + 1] for b in (0, 2)])
    out = model.forward_window(state, window)
    torch.testing.assert_close(out.cond[1, 0], full[2, done[2] + 1], atol=ATOL, rtol=0)


def test_bad_inputs_name_the_argument():
    model = tiny_gpt(vocab_size=16, block_size=16, num_classes=3)
    with pytest.raises(ValueError, match="class_labels"):
        model.prefill(LlamaGenCondition(class_labels=torch.tensor([3])), guidance=False, max_new_tokens=4)
    with pytest.raises(ValueError, match="class_labels"):
        model.prefill(LlamaGenCondition(class_labels=torch.tensor([[0]])), guidance=False, max_new_tokens=4)
    with pytest.raises(ValueError, match="window"):
        model.prefill(LlamaGenCondition(class_labels=torch.tensor([0])), guidance=False, max_new_tokens=4, window=0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        model.prefill(LlamaGenCondition(class_labels=torch.tensor([0])), guidance=False, max_new_tokens=17)
    state, _ = model.prefill(LlamaGenCondition(class_labels=torch.tensor([0])), guidance=False, max_new_tokens=4, window=2)
    with pytest.raises(ValueError, match="tokens"):
        model.forward_window(state, torch.zeros(2, 1, dtype=torch.long))
    no_null = tiny_gpt(vocab_size=16, block_size=16, num_classes=3, class_dropout_prob=0.0)
    with pytest.raises(ValueError, match="unconditional"):
        no_null.prefill(LlamaGenCondition(class_labels=torch.tensor([0])), guidance=True, max_new_tokens=4)
    with pytest.raises(ValueError, match="block_size"):
        LlamaGenGPT(block_size=15)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_masked_attention_is_sdpa_on_a_prefix_of_a_wider_cache(dtype, atol):
    """The compiled CPU step's attention (``masked_attention``: ``q kᵀ`` in float32, ``(k qᵀ)ᵀ`` in bfloat16) reads
    a prefix of a cache with room for wider windows, a strided batch; it is SDPA's attention on the same keys."""
    from vispec.models.layers import masked_attention

    gen = torch.Generator().manual_seed(0)
    rows, heads, width, capacity, read, dim = 2, 4, 5, 40, 29, 16
    q = torch.randn(rows, heads, width, dim, generator=gen).to(dtype)
    cache_k, cache_v = (torch.randn(rows, heads, capacity, dim, generator=gen).to(dtype) for _ in range(2))
    k, v = cache_k[:, :, :read], cache_v[:, :, :read]
    assert not k.is_contiguous()
    positions = torch.arange(read - width, read)
    mask = (torch.arange(read)[None, :] <= positions[:, None])[None, None].expand(rows, 1, width, read)
    out = masked_attention(q, k, v, mask)
    expected = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), expected, atol=atol, rtol=0)
