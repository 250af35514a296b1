"""Function-preserving inflation (vispec.models.inflate): the same logits and tokens at a bigger model's cost."""

from __future__ import annotations

import pytest
import torch

from vispec.decoding import decode
from vispec.eval.bench.configs import DecoderBenchConfig, ImageBenchConfig, split_inflated_name
from vispec.models import inflate as inflate_module
from vispec.models import offload
from vispec.models.inflate import InflationError, inflate, parameter_count, plan_inflation
from vispec.models.llamagen_gpt import LlamaGenCondition, LlamaGenGPT
from vispec.sampling import SamplingConfig

ATOL = 1e-5
TARGET = dict(dim=128, n_layer=4)  # 64 -> 128 wide (a non-power-of-4 ratio), 2 -> 4 layers


def tiny_source(**overrides) -> LlamaGenGPT:
    """A random c2i GPT with peaked distributions (std 0.1) and a null class (CFG): 64 wide, 2 heads of 32."""
    torch.manual_seed(0)
    kwargs = dict(vocab_size=128, dim=64, n_layer=2, n_head=2, multiple_of=32, num_classes=10, block_size=16,
                  initializer_range=0.1, token_dropout_p=0.0, resid_dropout_p=0.0, ffn_dropout_p=0.0)
    model = LlamaGenGPT(**{**kwargs, **overrides}).eval()
    torch.nn.init.normal_(model.output.weight, std=0.1)  # LlamaGen zero-inits the head
    return model


@pytest.fixture(scope="module")
def pair():
    source = tiny_source()
    return source, inflate(source, TARGET, seed=3)


def windows_logits(model: LlamaGenGPT, tokens: torch.Tensor, condition, widths=(1, 5, 9)) -> torch.Tensor:
    """Conditional and unconditional logits of the whole sequence through the decode protocol: prefill, then windows."""
    state, first = model.prefill(condition, guidance=True, max_new_tokens=tokens.shape[1], window=max(widths))
    cond, uncond, at = [first.cond], [first.uncond], 0
    for width in widths:
        out = model.forward_window(state, tokens[:, at:at + width])
        model.rollback(state, torch.full((tokens.shape[0],), width))  # keep the whole window
        cond.append(out.cond), uncond.append(out.uncond)
        at += width
    return torch.cat([torch.cat(cond, 1), torch.cat(uncond, 1)])


def test_sizes_and_plan(pair):
    source, big = pair
    cfg = big.config
    assert (cfg.dim, cfg.n_layer, cfg.n_head, cfg.vocab_size, cfg.num_classes) == (128, 4, 4, 128, 10)
    assert cfg.norm_eps == pytest.approx(source.config.norm_eps / 2)
    assert big.layers[0].feed_forward.w1.out_features == 352  # the source's SwiGLU rule at width 128
    assert big.inflation.layer_slots == (0, 2) and big.inflation.head_dim == 32
    assert torch.equal(big.freqs_cis, source.freqs_cis)
    assert big.dtype == source.dtype and not big.training


@pytest.mark.parametrize("overrides", [{}, {"n_head": 4, "n_kv_head": 2, "dim": 64}], ids=["mha", "gqa"])
def test_logits_equal_teacher_forced_and_cached(overrides):
    source = tiny_source(**overrides)
    big = inflate(source, TARGET)
    if overrides:
        assert (big.config.n_head, big.config.n_kv_head) == (8, 4)  # the source's group of 2 query heads per KV head
    tokens = torch.randint(0, 128, (3, 15), generator=torch.Generator().manual_seed(1))
    condition = LlamaGenCondition(class_labels=torch.tensor([0, 4, 9]))
    with torch.no_grad():
        expected = source(tokens, condition)
        torch.testing.assert_close(big(tokens, condition), expected, atol=ATOL, rtol=0)
    cached = windows_logits(big, tokens, condition)
    torch.testing.assert_close(cached, windows_logits(source, tokens, condition), atol=ATOL, rtol=0)
    torch.testing.assert_close(cached[:3], expected, atol=ATOL, rtol=0)


def test_padded_channels_of_the_residual_stream_stay_zero(pair):
    _, big = pair
    seen = []
    hooks = [layer.register_forward_hook(lambda module, args, out: seen.append(out)) for layer in big.layers]
    hooks.append(big.tok_embeddings.register_forward_hook(lambda module, args, out: seen.append(out)))
    try:
        tokens = torch.randint(0, 128, (2, 15), generator=torch.Generator().manual_seed(2))
        condition = LlamaGenCondition(class_labels=torch.tensor([1, 2]))
        with torch.no_grad():
            big(tokens, condition)
        windows_logits(big, tokens, condition)  # the cached path too
    finally:
        for hook in hooks:
            hook.remove()
    layers = len(big.layers)
    assert len(seen) == (layers + 1) + layers + 3 * (layers + 1)  # forward; prefill (layers only); three windows
    for hidden in seen:
        assert hidden.shape[-1] == 128 and torch.equal(hidden[..., 64:], torch.zeros_like(hidden[..., 64:]))
        assert hidden[..., :64].abs().max() > 0


def test_extra_weights_are_random_where_the_function_allows(pair):
    source, big = pair
    new_layer, old_layer = big.layers[1], big.layers[0]  # an identity layer; source layer 0 (slots 0 and 2)
    assert new_layer.attention.wqkv.weight.std() > 0.05 and new_layer.feed_forward.w1.weight.std() > 0.05
    assert not new_layer.attention.wo.weight.any() and not new_layer.feed_forward.w2.weight.any()
    wqkv = old_layer.attention.wqkv.weight  # [q 4 heads | k 4 | v 4] x 128 of 32-dim heads
    for part in wqkv.split(128):
        assert part[64:].std() > 0.05  # the extra heads' rows
        assert part[:64, 64:].std() > 0.05  # the real heads reading the zero channels
    assert not old_layer.attention.wo.weight[:, 64:].any() and not old_layer.attention.wo.weight[64:].any()
    assert old_layer.feed_forward.w1.weight[192:].std() > 0.05 and not old_layer.feed_forward.w2.weight[:, 192:].any()
    assert big.output.weight[:, 64:].std() > 0.05
    assert torch.equal(old_layer.attention_norm.weight[:64], source.layers[0].attention_norm.weight)
    scale = 0.5 ** 0.5  # sqrt(D / D') folded into the columns after each norm
    torch.testing.assert_close(big.output.weight[:, :64], source.output.weight * scale)


@pytest.mark.parametrize("method", ["ar", "mc-sjd"])
def test_tokens_equal_for_seeds(pair, method):
    source, big = pair
    sampling = SamplingConfig(guidance_scale=2.0, temperature=1.0)
    condition = LlamaGenCondition(class_labels=torch.tensor([3, 3, 7, 0]))
    outs = [decode(model, condition, num_tokens=16, sampling=sampling, decoding=method,
                   generator=[torch.Generator().manual_seed(s) for s in range(4)]) for model in (source, big)]
    assert torch.equal(outs[0].tokens, outs[1].tokens)
    assert torch.equal(outs[0].stats.nfe, outs[1].stats.nfe)


def test_deterministic_from_seed_and_global_rng_untouched():
    source = tiny_source()
    rng = torch.get_rng_state()
    a, b, c = inflate(source, TARGET, seed=5), inflate(source, TARGET, seed=5), inflate(source, TARGET, seed=6)
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert not torch.equal(a.layers[1].attention.wqkv.weight, c.layers[1].attention.wqkv.weight)


def test_bfloat16_matches_to_bfloat16_tolerance():
    source = tiny_source()
    tokens = torch.randint(0, 128, (3, 15), generator=torch.Generator().manual_seed(4))
    condition = LlamaGenCondition(class_labels=torch.tensor([0, 4, 9]))
    low = torch.nn.Module.to(tiny_source(), dtype=torch.bfloat16)
    with torch.no_grad():
        exact, rounded = source(tokens, condition), low(tokens, condition)
        bf16_error = (rounded - exact).abs().max()
        for target, ratio in ((TARGET, 2), (dict(dim=256), 4)):
            big = inflate(low, target)
            assert big.dtype == torch.bfloat16 and torch.equal(big.layers[0].ffn_norm.weight[:64], low.layers[0].ffn_norm.weight)
            logits = big(tokens, condition)
            # no further from float32 than twice bfloat16's own error; a power-of-4 ratio folds an exact power of
            # two, leaving only the products' summation order (bit-equal on the CPU this was written on)
            assert (logits - exact).abs().max() <= 2 * bf16_error
            if ratio == 4:
                assert (logits - rounded).abs().max() <= 0.5 * bf16_error


def test_caption_model_and_save_load_roundtrip(tmp_path):
    source = tiny_source(model_type="t2i", caption_dim=16, cls_token_num=4, num_classes=1000)
    big = inflate(source, dict(dim=96, n_layer=3, ffn_hidden=320))
    assert big.layers[0].feed_forward.w1.out_features == 320
    captions = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(0))
    condition = LlamaGenCondition(caption_embeds=captions, caption_mask=torch.tensor([[False, True, True, True]] * 2))
    tokens = torch.randint(0, 128, (2, 15), generator=torch.Generator().manual_seed(1))
    big.save_pretrained(tmp_path)
    loaded = LlamaGenGPT.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        expected = source(tokens, condition)
        torch.testing.assert_close(big(tokens, condition), expected, atol=ATOL, rtol=0)
        torch.testing.assert_close(loaded(tokens, condition), expected, atol=ATOL, rtol=0)


def test_named_target_keeps_the_head_size():
    config = tiny_source().config  # heads of 32; LlamaGen's GPT-B has 12 heads of 64
    plan = plan_inflation(config, "GPT-B")
    assert (plan.dim, plan.n_layer, plan.n_head, plan.nominal_n_head, plan.ffn_hidden) == (768, 12, 24, 12, 2048)
    assert "24 heads of 32" in plan.describe() and "GPT-B has 12 heads of 64" in plan.describe()


@pytest.mark.parametrize("target, message", [
    ("GPT-Q", "unknown GPT config 'GPT-Q'"),
    (dict(dim=32), r"width \(dim\) 32 is smaller than the source's 64"),
    (dict(dim=128, n_layer=1), r"depth \(n_layer\) 1 is smaller"),
    (dict(dim=128, ffn_hidden=100), r"SwiGLU width \(ffn_hidden\) 100 is smaller than the source's 192"),
    (dict(dim=80), "not a multiple of the source's head size 32"),
    (dict(dim=128, n_head=3), "does not split into n_head=3"),
    (dict(width=128), "keys must be a non-empty subset"),
    (dict(dim=128.0), r"target\['dim'\] must be an integer"),
    (["GPT-B"], "target must be a GPT config name or a dict"),
])
def test_bad_targets_fail_before_any_work(target, message):
    with pytest.raises(ValueError, match=message):
        inflate(tiny_source(), target)


def test_bad_models_and_seeds():
    with pytest.raises(InflationError, match="model must be a LlamaGenGPT"):
        inflate(torch.nn.Linear(4, 4), "GPT-B")
    with pytest.raises(ValueError, match="seed must be an integer"):
        inflate(tiny_source(), TARGET, seed=-1)
    gqa = tiny_source(n_head=4, n_kv_head=2, dim=64)  # heads of 16: width 80 gives 5 heads, not groups of 2
    with pytest.raises(InflationError, match="groups of 2 query heads"):
        inflate(gqa, dict(dim=80))


def test_bench_model_names():
    assert split_inflated_name("tiny-c2i@GPT-B") == ("tiny-c2i", "GPT-B") and split_inflated_name("GPT-B") == ("GPT-B", None)
    DecoderBenchConfig(model="tiny-c2i@GPT-B").validate()
    for name, message in (("tiny-c2i@GPT-Q", "unknown GPT config 'GPT-Q'"), ("foo@GPT-B", "only a trained model"),
                          ("tiny-c2i@", "<trained model>@<GPT config>"), ("foo", "unknown model 'foo'")):
        with pytest.raises(ValueError, match=message):
            DecoderBenchConfig(model=name).validate()
    ImageBenchConfig(model="tiny-t2i@GPT-B").validate()  # a Chameleon transformer
    with pytest.raises(ValueError, match="tiny-mdlm has no transformer/config.json"):
        ImageBenchConfig(model="tiny-mdlm@GPT-B").validate()


def count(model) -> int:
    return sum(tensor.numel() for tensor in model.state_dict().values())


def test_parameter_count_is_the_built_models():
    """The size estimate the memory check reads (:func:`parameter_count`, plain arithmetic) is the built models' count
    of parameters and buffers: sources and inflations, class and caption LlamaGens, grouped-query attention, Chameleon
    (its VQ model aside) with and without biases."""
    from transformers import ChameleonForConditionalGeneration
    from unified_helpers import tiny_chameleon

    llamagens = [(tiny_source(), TARGET), (tiny_source(n_head=4, n_kv_head=2, dim=64), TARGET),
                 (tiny_source(class_dropout_prob=0.0), dict(dim=96)),
                 (tiny_source(model_type="t2i", caption_dim=16, cls_token_num=4), dict(dim=96, n_layer=3, ffn_hidden=320))]
    for source, target in llamagens:
        big = inflate(source, target)
        assert parameter_count(source.config) == count(source)
        assert parameter_count(source.config, big.inflation) == count(big), (source.config.model_type, target)
    chameleon = tiny_chameleon()
    config = chameleon.config
    config.attention_bias = config.mlp_bias = True
    torch.manual_seed(0)
    biased = ChameleonForConditionalGeneration(config).eval()
    for source in (tiny_chameleon(), biased):
        vq = sum(v.numel() for k, v in source.state_dict().items() if k.startswith("model.vqmodel."))
        big = inflate(source, dict(dim=64, n_layer=4))
        assert parameter_count(source.config) + vq == count(source)
        assert parameter_count(source.config, big.inflation) + vq == count(big)


def test_a_target_past_the_memory_is_refused_before_building(monkeypatch):
    """Issue 47 item 3: ``inflate(model, {"dim": 65536, "n_layer": 64})`` started allocating ~12 TiB. The estimate
    (parameters at the model's dtype) is compared with the memory available on the model's device first; the error
    names the target's keys, the estimate and what is available, in GiB, and nothing is built."""
    source = tiny_source()
    if offload.available_memory(torch.device("cpu")) is not None:  # no machine has 12 TiB free
        with pytest.raises(InflationError, match=r"^target \{'dim': 65536, 'n_layer': 64\}: the inflated model .* has "
                                                 r"~3\.3e12 parameters, 12289\.1 GiB in float32, more than the .* GiB "
                                                 r"available on cpu"):
            inflate(source, {"dim": 65536, "n_layer": 64})

    def no_build(*args):
        raise AssertionError("the inflated model was built")

    monkeypatch.setattr(inflate_module, "_inflate_llamagen", no_build)
    monkeypatch.setattr(offload, "available_memory", lambda device: 2**27)  # 128 MiB free
    with pytest.raises(InflationError, match=r"^target 'GPT-B': the inflated model \(GPT-B: width 768, 12 layers, .*\) "
                                             r"has ~8\.5e7 parameters, 0\.3 GiB in float32, more than the 0\.1 GiB "
                                             r"available on cpu; ask for a smaller target$"):
        inflate(source, "GPT-B")
    with pytest.raises(InflationError, match=r"^target \{'dim': 2048\}: .* 0\.2 GiB in bfloat16, more than the 0\.1 GiB"):
        inflate(torch.nn.Module.to(tiny_source(), dtype=torch.bfloat16), {"dim": 2048})  # 2 layers, ~1e8 parameters
    monkeypatch.setattr(offload, "available_memory", lambda device: None)  # cannot be told: nothing refused
    with pytest.raises(AssertionError, match="was built"):
        inflate(source, "GPT-B")


def test_bench_decoders_refuses_a_model_past_the_memory_before_loading(monkeypatch, capsys):
    """Issue 47 item 3: ``vispec bench decoders --model tiny-c2i@GPT-7B`` (~26 GiB of float32 weights) headed for the
    OOM killer on a 24 GiB machine; it is now one line naming --model, the estimate and what is available, before
    anything is loaded. A batch whose key/value cache does not fit names the batch flag."""
    from vispec.cli import main
    from vispec.eval.bench import decoders

    monkeypatch.setattr(offload, "available_memory", lambda device: 8 * 2**30)
    monkeypatch.setattr(decoders, "build_model", lambda cfg: pytest.fail("a model was built"))
    with pytest.raises(ValueError, match=r"^model \(--model\) 'tiny-c2i@GPT-7B': ~6\.5e9 parameters \(tiny-c2i's logits "
                                         r"at GPT-7B cost: width 4096, 32 layers\) need 24\.2 GiB of float32 weights .*"
                                         r"more than the 8\.0 GiB available on cpu; pick a smaller --model$"):
        DecoderBenchConfig(model="tiny-c2i@GPT-7B").validate()
    with pytest.raises(ValueError, match=r"^model \(--model\) 'GPT-7B': .*built on the CPU before the cast to --dtype "
                                         r"bfloat16\): 24\.6 GiB, more than the 8\.0 GiB"):
        DecoderBenchConfig(model="GPT-7B", dtype="bfloat16").validate()
    with pytest.raises(ValueError, match=r"GiB of key/value cache \(--batch-sizes 4096, x2 rows for guidance, 273 "
                                         r"positions\): .* pick a smaller --batch-sizes$"):
        DecoderBenchConfig(model="GPT-B", batch_sizes=(1, 4096)).validate()
    DecoderBenchConfig(model="tiny-c2i@GPT-L").validate()  # ~0.3e9 parameters: 1.2 GiB
    assert main(["bench", "decoders", "--model", "tiny-c2i@GPT-7B"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("vispec: error: model (--model) 'tiny-c2i@GPT-7B'") and "GiB" in err[0]


@pytest.mark.parametrize("swin_norm", [False, True])
def test_chameleon_logits_and_adapter_tokens_equal(swin_norm):
    from transformers import ChameleonForConditionalGeneration
    from unified_helpers import PROMPTS, tiny_chameleon, tiny_layout

    from vispec.models.unified import UnifiedTokenModel
    from vispec.models.unified_families import chameleon_backbone

    source = tiny_chameleon()  # 32 wide, 4 heads of 8 (2 KV heads), MLP 64, 2 layers
    if swin_norm:
        source.config.swin_norm = True
        torch.manual_seed(0)
        source = ChameleonForConditionalGeneration(source.config).eval()
        with torch.no_grad():
            source.lm_head.weight.normal_(std=0.5)
    big = inflate(source, dict(dim=64, n_layer=4), seed=1)
    cfg = big.config
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size) == (64, 8, 4, 128)
    assert isinstance(big, ChameleonForConditionalGeneration) and big.config.swin_norm == swin_norm
    assert not big.model.layers[1].self_attn.o_proj.weight.any() and big.model.layers[1].self_attn.q_proj.weight.std() > 0
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(big(input_ids=ids).logits, source(input_ids=ids).logits, atol=ATOL, rtol=0)
    layout = tiny_layout()
    outs = []
    for model in (source, big):
        unified = UnifiedTokenModel(chameleon_backbone(model, layout), layout, cfg_mode="image_start")
        outs.append(decode(unified, unified.condition(PROMPTS), num_tokens=layout.num_tokens, decoding="mc-sjd",
                           sampling=SamplingConfig(guidance_scale=3.0),
                           generator=[torch.Generator().manual_seed(s) for s in range(len(PROMPTS))]))
    assert torch.equal(outs[0].tokens, outs[1].tokens) and torch.equal(outs[0].stats.nfe, outs[1].stats.nfe)


@pytest.mark.slow
def test_tiny_c2i_at_gpt_b_through_the_bench_loader():
    from vispec.eval.bench.decoders import build_model, model_note

    cfg = DecoderBenchConfig(model="tiny-c2i@GPT-B")
    big = build_model(cfg)
    source = build_model(DecoderBenchConfig(model="tiny-c2i"))
    assert (big.config.dim, big.config.n_layer, big.config.n_head) == (768, 12, 12)
    assert model_note(cfg, big).startswith("tiny-c2i's logits at GPT-B cost")
    tokens = torch.randint(0, 1024, (2, 40), generator=torch.Generator().manual_seed(0))
    condition = LlamaGenCondition(class_labels=torch.tensor([2, 11]))
    with torch.no_grad():
        torch.testing.assert_close(big(tokens, condition), source(tokens, condition), atol=1e-4, rtol=0)
    sampling = SamplingConfig(guidance_scale=2.0)
    outs = [decode(model, condition, num_tokens=32, sampling=sampling, decoding="mc-sjd",  # two rows: ~3 s on GPT-B
                   generator=[torch.Generator().manual_seed(s) for s in (0, 1)]) for model in (source, big)]
    assert torch.equal(outs[0].tokens, outs[1].tokens) and torch.equal(outs[0].stats.nfe, outs[1].stats.nfe)
