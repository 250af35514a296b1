"""LLaDA: official names and checkpoint layout, bidirectional padding, block KV cache, bad input."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from helpers import left_padded

from vispec.models.llada import LLaDAKVCache, LLaDAModelLM
from vispec.models.llada_checkpoint import load_llada, llada_kwargs_from_config

ATOL = 1e-5
MASK, PAD = 60, 0


def tiny_llada(n_layers: int = 2, n_kv_heads: int = 2, seed: int = 0, **overrides) -> LLaDAModelLM:
    """Random tiny LLaDA with a padded embedding (64 > 61) and GQA; large init so that logits vary a lot."""
    torch.manual_seed(seed)
    kwargs = dict(d_model=32, n_heads=4, n_kv_heads=n_kv_heads, n_layers=n_layers, mlp_hidden_size=48, vocab_size=61,
                  embedding_size=64, max_sequence_length=64, rope_theta=10000.0, mask_token_id=MASK, eos_token_id=1,
                  eot_token_id=2, pad_token_id=PAD, bos_token_id=3, init_std=0.3)
    return LLaDAModelLM(**{**kwargs, **overrides}).eval()


@pytest.fixture(scope="module")
def model():
    return tiny_llada()


@pytest.fixture(scope="module")
def batch():
    gen = torch.Generator().manual_seed(1)
    a, b = torch.randint(4, 61, (12,), generator=gen), torch.randint(4, 61, (8,), generator=gen)
    a[7:] = MASK
    b[5:] = MASK
    return left_padded([a, b], PAD), (a, b)


def test_parameter_names_are_the_official_ones(model):
    names = set(model.state_dict())
    expected = {"model.transformer.wte.weight", "model.transformer.ln_f.weight", "model.transformer.ff_out.weight"}
    for i in range(2):
        expected |= {f"model.transformer.blocks.{i}.{n}.weight" for n in
                     ("attn_norm", "q_proj", "k_proj", "v_proj", "attn_out", "ff_norm", "ff_proj", "up_proj", "ff_out")}
    assert names == expected
    sd = model.state_dict()
    assert sd["model.transformer.blocks.0.k_proj.weight"].shape == (2 * 8, 32)  # GQA: 2 KV heads of 8
    assert sd["model.transformer.wte.weight"].shape == (64, 32) and sd["model.transformer.ff_out.weight"].shape == (64, 32)


def test_logits_have_embedding_width_and_attention_is_bidirectional(model):
    x = torch.randint(4, 61, (1, 10))
    with torch.no_grad():
        out = model(x).logits
        y = x.clone()
        y[0, 9] = (x[0, 9] + 1 - 4) % 57 + 4
        changed = model(y).logits
    assert out.shape == (1, 10, 64) and out.dtype == torch.float32
    assert (out[0, 0] - changed[0, 0]).abs().max() > 1e-3  # the first position sees the last token


def test_left_padding_gives_the_logits_of_the_row_alone(model, batch):
    (ids, mask), rows = batch
    with torch.no_grad():
        padded = model(ids, mask).logits
        junk = ids.clone()
        junk[mask == 0] = 17  # padded keys are hidden: their ids do not matter
        padded_junk = model(junk, mask).logits
        for i, row in enumerate(rows):
            alone = model(row[None]).logits[0]
            torch.testing.assert_close(padded[i, ids.shape[1] - len(row):], alone, atol=ATOL, rtol=0)
            torch.testing.assert_close(padded_junk[i, ids.shape[1] - len(row):], alone, atol=ATOL, rtol=0)


def test_kv_cache_spans_match_the_full_forward(model, batch):
    (ids, mask), _ = batch
    with torch.no_grad():
        full = model(ids, mask).logits
    out = model.compute_kv_cache(ids, mask)
    torch.testing.assert_close(out.logits, full, atol=ATOL, rtol=0)
    cache = out.kv_cache
    assert isinstance(cache, LLaDAKVCache) and cache.keys[0].shape == (2, 2, 12, 8) and len(cache.values) == 2
    for start, end in [(7, 10), (4, 12), (0, 3), (11, 12)]:  # DualCache blocks, PrefixCache (to the end)
        span = model.forward_span(ids[:, start:end], start, cache).logits
        assert span.shape == (2, end - start, 64)
        torch.testing.assert_close(span, full[:, start:end], atol=ATOL, rtol=0)
    torch.testing.assert_close(model.forward_span(ids[:, 4:12], 4, cache, use_suffix=False).logits, full[:, 4:12],
                               atol=ATOL, rtol=0)  # span reaching the end: no suffix either way


def test_stale_cache_is_exact_for_one_layer_and_approximate_for_more(batch):
    (ids, mask), _ = batch
    new = ids.clone()
    new[:, 8:10] = torch.tensor([[5, 6], [7, 8]])  # commit two tokens inside the block [7, 11)
    for layers in (1, 2):
        m = tiny_llada(n_layers=layers)
        cache = m.compute_kv_cache(ids, mask).kv_cache  # from the sequence before the commit
        span = m.forward_span(new[:, 7:11], 7, cache).logits
        with torch.no_grad():
            full = m(new, mask).logits[:, 7:11]
        gap = (span - full).abs().max().item()
        if layers == 1:  # layer-0 K/V depend on a position's own token only: stale entries are exact
            assert gap < ATOL
        else:  # deeper K/V outside the block still reflect the old block tokens
            assert gap > 1e-3
            assert torch.equal(cache.input_ids[:, 7:11], new[:, 7:11])  # span written into the cache
            torch.testing.assert_close(m.forward_span(new[:, 7:11], 7, m.compute_kv_cache(new, mask).kv_cache).logits,
                                       full, atol=ATOL, rtol=0)


def test_span_without_suffix_sees_only_the_prefix():
    m = tiny_llada(n_layers=1)  # one layer: cached prefix K/V do not depend on the suffix
    x = torch.randint(4, 61, (2, 10))
    span = m.forward_span(x[:, 3:6], 3, m.compute_kv_cache(x).kv_cache, use_suffix=False).logits
    with torch.no_grad():
        torch.testing.assert_close(span, m(x[:, :6]).logits[:, 3:6], atol=ATOL, rtol=0)


def test_logits_shift_moves_outputs_one_position_in_all_paths(batch):
    (ids, mask), _ = batch
    plain, shifted = tiny_llada(), tiny_llada(logits_shift=True)
    with torch.no_grad():
        a, b = plain(ids, mask).logits, shifted(ids, mask).logits
    torch.testing.assert_close(b[:, 1:], a[:, :-1], atol=ATOL, rtol=0)
    torch.testing.assert_close(b[:, 0], a[:, 0], atol=ATOL, rtol=0)
    cache = shifted.compute_kv_cache(ids, mask).kv_cache
    for start, end in [(0, 4), (7, 10)]:
        torch.testing.assert_close(shifted.forward_span(ids[:, start:end], start, cache).logits, b[:, start:end],
                                   atol=ATOL, rtol=0)


def test_cache_select_and_save_load_round_trip(tmp_path, model, batch):
    (ids, mask), _ = batch
    cache = model.compute_kv_cache(ids, mask).kv_cache
    one = cache.select(torch.tensor([1]))
    with torch.no_grad():
        full = model(ids[1:], mask[1:]).logits
    torch.testing.assert_close(model.forward_span(ids[1:, 7:10], 7, one).logits, full[:, 7:10], atol=ATOL, rtol=0)
    model.save_pretrained(tmp_path / "m")
    again = load_llada(tmp_path / "m")
    assert again.config.n_kv_heads == 2 and again.config.embedding_size == 64
    with torch.no_grad():
        torch.testing.assert_close(again(ids, mask).logits, model(ids, mask).logits, atol=0, rtol=0)


def _write_official(folder, model: LLaDAModelLM, config_extra: dict | None = None, drop=None, extra=None) -> None:
    folder.mkdir()
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    if drop:
        del sd[drop]
    sd.update(extra or {})
    names = sorted(sd)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for file, keys in shards.items():
        save_file({k: sd[k] for k in keys}, str(folder / file), metadata={"format": "pt"})
    index = {"metadata": {"total_size": sum(v.numel() * 4 for v in sd.values())},
             "weight_map": {k: file for file, keys in shards.items() for k in keys}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    c = model.config
    config = {  # official key names, plus keys the loader must ignore
        "architectures": ["LLaDAModelLM"], "auto_map": {"AutoModel": "modeling_llada.LLaDAModelLM"}, "model_type": "llada",
        "activation_type": "silu", "alibi": False, "block_type": "llama", "block_group_size": 1, "d_model": c.d_model,
        "embedding_size": c.embedding_size, "include_bias": False, "layer_norm_type": "rms", "mask_token_id": MASK,
        "eos_token_id": 1, "pad_token_id": PAD, "max_sequence_length": 64, "mlp_hidden_size": c.mlp_hidden_size,
        "mlp_ratio": 4, "n_heads": c.n_heads, "n_kv_heads": c.n_kv_heads, "n_layers": c.n_layers, "rope": True,
        "rope_theta": c.rope_theta, "rms_norm_eps": 1e-5, "vocab_size": c.vocab_size, "weight_tying": False,
        "scale_logits": False, "torch_dtype": "float32", "transformers_version": "4.38.2", "use_cache": False,
        **(config_extra or {}),
    }
    (folder / "config.json").write_text(json.dumps(config))


def test_official_sharded_checkpoint_loads_strictly(tmp_path, model, batch):
    (ids, mask), _ = batch
    _write_official(tmp_path / "ok", model)
    loaded = load_llada(tmp_path / "ok", eot_token_id=2)
    assert loaded.config.eot_token_id == 2 and loaded.config.bos_token_id is None and not loaded.training
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids, mask).logits, model(ids, mask).logits, atol=0, rtol=0)
    assert load_llada(tmp_path / "ok", dtype=torch.bfloat16).dtype == torch.bfloat16

    _write_official(tmp_path / "missing", model, drop="model.transformer.blocks.1.up_proj.weight",
                    extra={"model.transformer.blocks.1.up.weight": torch.zeros(48, 32)})
    with pytest.raises(ValueError, match=r"missing keys \['model.transformer.blocks.1.up_proj.weight'\].*unexpected keys "
                                         r"\['model.transformer.blocks.1.up.weight'\]"):
        load_llada(tmp_path / "missing")
    _write_official(tmp_path / "shape", model, config_extra={"mlp_hidden_size": 40})
    with pytest.raises(ValueError, match=r"shape mismatches \['model.transformer.blocks.0.ff_out.weight: checkpoint"):
        load_llada(tmp_path / "shape")
    _write_official(tmp_path / "tied", model, config_extra={"weight_tying": True})
    with pytest.raises(ValueError, match="weight_tying"):
        load_llada(tmp_path / "tied")
    index = json.loads((tmp_path / "ok" / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.transformer.ghost.weight"] = "model-00001-of-00002.safetensors"
    (tmp_path / "ok" / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="disagrees with model.safetensors.index.json.*ghost"):
        load_llada(tmp_path / "ok")


def test_official_8b_config_maps_onto_the_model_arguments():
    official = {"d_model": 4096, "n_heads": 32, "n_kv_heads": 32, "n_layers": 32, "mlp_hidden_size": 12288,
                "vocab_size": 126464, "embedding_size": 126464, "max_sequence_length": 4096, "rope_theta": 500000.0,
                "rms_norm_eps": 1e-5, "mask_token_id": 126336, "eos_token_id": 126081, "pad_token_id": 126081,
                "block_type": "llama", "auto_map": {}, "architectures": ["LLaDAModelLM"]}
    kwargs = llada_kwargs_from_config(official)
    assert kwargs["eot_token_id"] == 126348 and kwargs["bos_token_id"] == 126080 and kwargs["n_kv_heads"] == 32
    with torch.device("meta"):
        big = LLaDAModelLM(**kwargs)
    assert sum(p.numel() for p in big.parameters()) == 8_015_581_184  # 2 x 126464 x 4096 + 32 layers x 218.1M + 4096


def test_bad_input_raises_value_errors(model, batch):
    (ids, mask), _ = batch
    with pytest.raises(ValueError, match="input_ids must be an integer tensor"):
        model(ids.float())
    with pytest.raises(ValueError, match="attention_mask must have shape"):
        model(ids, mask[:, 1:])
    cache = model.compute_kv_cache(ids, mask).kv_cache
    with pytest.raises(ValueError, match="start must satisfy"):
        model.forward_span(ids[:, 8:12], 9, cache)
    with pytest.raises(ValueError, match="span_ids must have 2 rows"):
        model.forward_span(ids[:1, 8:12], 8, cache)
    with pytest.raises(ValueError, match="pad_token_id must differ from mask_token_id"):
        tiny_llada(pad_token_id=MASK)
    with pytest.raises(ValueError, match="mask_token_id=126336 must lie in"):
        tiny_llada(mask_token_id=126336)
    with pytest.raises(ValueError, match="n_heads=4 must be a multiple of n_kv_heads=3"):
        tiny_llada(n_kv_heads=3)


def test_models_share_their_layers():
    """RMSNorm and RoPE live in vispec.models.layers (LLaDA and LlamaGen use the same code), and the LLaDA files
    import nothing from the LlamaGen files (tests/project/test_layering.py checks the imports of the other layers)."""
    import ast
    import pathlib

    import vispec.models
    from vispec.models import layers, llada, llamagen_gpt

    assert llada.RMSNorm is layers.RMSNorm and llamagen_gpt.RMSNorm is layers.RMSNorm
    assert llada.rope_cos_sin is layers.rope_cos_sin and llamagen_gpt.rope_cache_2d is layers.rope_cache_2d
    for path in sorted(pathlib.Path(vispec.models.__file__).parent.glob("llada*.py")):
        tree = ast.parse(path.read_text())
        names = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
        names |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        assert not [n for n in names if n.startswith("vispec.models.llamagen")], path


def test_rope_frequencies_are_shared():
    """Both pairings use w_i = base^(-2i / dim): LLaDA's over head_dim, each axis of LlamaGen's 2-D table over head_dim / 2."""
    from vispec.models.layers import rope_cache_2d, rope_cos_sin, rope_inv_freq

    inv = rope_inv_freq(8, 10000.0)
    torch.testing.assert_close(inv, torch.tensor([10000.0 ** (-i / 4) for i in range(4)]), rtol=1e-6, atol=0)
    cos, sin = rope_cos_sin(torch.tensor([[3]]), 8, 10000.0)
    torch.testing.assert_close(cos[0, 0], torch.cat([(3 * inv).cos()] * 2), rtol=0, atol=0)
    table = rope_cache_2d(grid_size=2, head_dim=16, base=10000.0, cls_token_num=1)  # token (row 1, col 0) at 1 + 2
    assert table.shape == (5, 8, 2) and not table[0].any()
    torch.testing.assert_close(table[3, :4, 0], (1 * rope_inv_freq(8, 10000.0)).cos(), rtol=0, atol=0)
    torch.testing.assert_close(table[3, 4:, 0], torch.ones(4), rtol=0, atol=0)
