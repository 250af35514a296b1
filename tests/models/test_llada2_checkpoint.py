"""LLaDA2 (``llada2_moe``): the official checkpoint layout loads under its own tensor names, the forward equals an
independent reference of the official modeling code, the attention is block-causal, and what the network does not
implement is refused by name."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from llada2_reference import block_mask, llada2_forward, random_llada2_state, tiny_llada2_config, write_llada2_folder

from vispec.models.llada2 import LLaDA2MoeModelLM, block_causal_mask
from vispec.models.llada2_checkpoint import llada2_kwargs_from_config, load_llada2


@pytest.fixture(scope="module")
def config():
    return tiny_llada2_config()


@pytest.fixture(scope="module")
def state(config):
    return random_llada2_state(config)


@pytest.fixture(scope="module")
def model(tmp_path_factory, config, state):
    return load_llada2(write_llada2_folder(tmp_path_factory.mktemp("llada2") / "official", state, config), block_length=4)


def ids(batch=2, length=13, seed=0):
    return torch.randint(3, 95, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("sharded", [True, False])
def test_official_layout_loads_and_matches_the_reference_forward(tmp_path, config, state, sharded):
    model = load_llada2(write_llada2_folder(tmp_path / "m", state, config, sharded=sharded), block_length=4)
    c = model.config
    assert not model.training and model.dtype == torch.float64 and model.attention_layout == "block_causal"
    assert (c.hidden_size, c.num_hidden_layers, c.num_experts, c.head_dim, c.block_length) == (32, 2, 8, 8, 4)
    assert (c.mask_token_id, c.eos_token_id, c.pad_token_id, c.use_bias) == (95, 1, 2, False)
    assert {k: torch.equal(v, state[k]) for k, v in model.state_dict().items()} == {k: True for k in state}
    x = ids()
    positions = torch.arange(x.shape[1])[None].expand(2, -1)
    reference = llada2_forward(state, config, x, block_mask(x.shape[1], 4), positions)
    with torch.no_grad():
        for mask in (None, torch.ones_like(x), block_mask(x.shape[1], 4)):  # implied, 2-D, the official 4-D mask
            ours = model(x, attention_mask=mask, position_ids=positions).logits
            assert ours.dtype == torch.float32
            torch.testing.assert_close(ours.double(), reference, atol=2e-5, rtol=1e-6)


def test_attention_is_block_causal_and_padding_hidden(model):
    x = ids(1, 12)
    later = x.clone()
    later[0, 9] = 7  # a token of the third block
    with torch.no_grad():
        a, b = model(x).logits, model(later).logits
        assert torch.equal(a[:, :8], b[:, :8]) and not torch.equal(a[:, 8:], b[:, 8:])
        # a hidden key (2-D mask 0) changes nothing for anyone else; the bool 4-D form is the same mask
        hidden = torch.ones_like(x)
        hidden[0, 2] = 0
        changed = x.clone()
        changed[0, 2] = 9
        m1, m2 = model(x, attention_mask=hidden).logits, model(changed, attention_mask=hidden).logits
        keep = torch.arange(12) != 2
        assert torch.equal(m1[:, keep], m2[:, keep])
        index = torch.arange(12)
        assert torch.equal(model(x, attention_mask=block_causal_mask(index, index, 4, hidden)).logits, m1)


def test_cached_forward_equals_the_full_forward(model):
    x = ids(3, 14)
    index = torch.arange(14)
    positions = index[None].expand(3, -1)
    with torch.no_grad():
        full = model(x).logits
        cache = model.new_kv_cache(3, 16)
        first = model.forward_cached(x[:, :8], positions[:, :8], cache, 0, block_causal_mask(index[:8], index[:8], 4)).logits
        rows = torch.tensor([0, 2])  # a subset of the rows, reading and writing their own cache rows
        rest = model.forward_cached(x[rows, 8:], positions[rows, 8:], cache, 8,
                                    block_causal_mask(index[8:], index, 4), rows=rows).logits
    torch.testing.assert_close(first, full[:, :8], atol=1e-6, rtol=0)
    torch.testing.assert_close(rest, full[rows, 8:], atol=1e-6, rtol=0)
    assert torch.equal(rest.argmax(-1), full[rows, 8:].argmax(-1))


def test_save_pretrained_round_trip(tmp_path, model):
    model.save_pretrained(tmp_path / "saved")
    again = load_llada2(tmp_path / "saved", dtype=torch.float64)
    assert again.dtype == torch.float64 and again.config.block_length == 4
    x = ids()
    with torch.no_grad():
        assert torch.equal(again(x).logits, model(x).logits)


def test_optional_tensors_are_read_from_the_checkpoint(tmp_path, config, state):
    bare = {k: v for k, v in config.items() if k not in ("use_bias", "use_qk_norm", "moe_router_enable_expert_bias")}
    model = load_llada2(write_llada2_folder(tmp_path / "m", state, bare))
    assert (model.config.use_bias, model.config.use_qk_norm, model.config.moe_router_enable_expert_bias) == (False, True, True)


def test_llada2_vocabulary_gets_the_official_token_ids(config):
    kwargs = llada2_kwargs_from_config({k: v for k, v in config.items() if k not in ("mask_token_id", "eos_token_id")}
                                       | {"vocab_size": 157184})
    assert (kwargs["mask_token_id"], kwargs["eos_token_id"], kwargs["block_length"]) == (156895, 156892, 32)
    with pytest.raises(ValueError, match="names no mask_token_id .* pass mask_token_id="):
        llada2_kwargs_from_config({k: v for k, v in config.items() if k != "mask_token_id"})


@pytest.mark.parametrize("change, match", [
    (dict(model_type="bailing_moe_v2"), "model_type='bailing_moe_v2'.*llada2_moe"),
    (dict(tie_word_embeddings=True), "tie_word_embeddings=True"),
    (dict(score_function="softmax"), "score_function='softmax'"),
    (dict(norm_head=True), "norm_head=True"),
    (dict(rope_scaling={"type": "yarn"}), "rope_scaling"),
    (dict(rotary_dim=8), "rotary_dim=8.*head_dim \\* partial_rotary_factor = 4"),
    (dict(num_attention_heads=3), "num_attention_heads=3 must be a multiple of num_key_value_heads=2"),
    (dict(topk_group=5), "topk_group=5"),
])
def test_unsupported_configs_are_refused_by_name(config, change, match):
    with pytest.raises(ValueError, match=match):
        LLaDA2MoeModelLM(**llada2_kwargs_from_config({**config, **change}))


def test_wrong_checkpoints_are_refused_before_loading(tmp_path, config, state):
    missing = {k: v for k, v in state.items() if k != "model.layers.1.mlp.experts.3.up_proj.weight"}
    with pytest.raises(ValueError, match="missing.*experts.3.up_proj"):
        load_llada2(write_llada2_folder(tmp_path / "a", missing, config))
    merged = {k: v for k, v in state.items() if ".mlp.experts." not in k}
    merged["model.layers.1.mlp.experts.gate_proj"] = torch.zeros(8, 16, 32, dtype=torch.float64)
    with pytest.raises(ValueError, match="merged experts .*moe_convertor.py --mode split"):
        load_llada2(write_llada2_folder(tmp_path / "b", merged, config))
    folder = tmp_path / "c"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    save_file({"lm_head.weight": torch.zeros(2, 2)}, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match="lm_head.weight: checkpoint \\(2, 2\\)"):
        load_llada2(folder)
    with pytest.raises(ValueError, match="config.json is missing"):
        load_llada2(tmp_path / "nowhere")
