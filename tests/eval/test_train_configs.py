"""The trainer configs (:mod:`vispec.eval.train.configs`, issue 28): torch-free, re-exported by the trainer modules,
their copies of the models' constants in agreement with the models, and their size checks: a model whose training
would not fit the machine's memory is refused before any work, naming the fields that set its size; the estimates
match the built models' parameter counts, and the shipped settings fit an 8 GiB machine."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from vispec.cli.train import CONFIGS, TRAINERS
from vispec.eval.train import checks, configs
from vispec.eval.train.configs import (CLIPTrainConfig, DrafterTrainConfig, EvaluatorTrainConfig, FilterTrainConfig,
                                       GPTTrainConfig, MDLMTrainConfig, T2ITrainConfig, VQTrainConfig)

GIB = 2**30


@pytest.fixture
def memory(monkeypatch):
    """The machine's memory fixed at 8 GiB: no test depends on this machine's."""
    monkeypatch.setattr(checks, "total_memory", lambda: 8 * GIB)


@pytest.fixture
def vq_folder(tmp_path):
    (tmp_path / "vq").mkdir()
    (tmp_path / "vq" / "config.json").write_text("{}")
    return str(tmp_path / "vq")


# ---- torch-free, and the old imports still work --------------------------------------------------------------

def test_configs_and_their_checks_import_no_torch():
    """A fresh process builds and validates the torch-free configs (defaults, and one refused size) without
    importing torch, the models or a trainer's module."""
    code = ("import sys\n"
            "from vispec.eval.train import configs\n"
            "for cls in (configs.VQTrainConfig, configs.EvaluatorTrainConfig, configs.CLIPTrainConfig, configs.MDLMTrainConfig):\n"
            "    cls().validate()\n"
            "try:\n"
            "    configs.GPTTrainConfig(dim=10**9).validate()\n"
            "except ValueError as err:\n"
            "    assert str(err).startswith('dim 1000000000'), err\n"
            "heavy = ('torch', 'diffusers', 'transformers', 'vispec.models', 'vispec.pipelines', 'vispec.eval.train.common')\n"
            "print([m for m in sys.modules if m.split('.')[0] in heavy or m.startswith(heavy[3:])])\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip() == "[]"


@pytest.mark.parametrize("trainer", list(TRAINERS))
def test_trainer_modules_re_export_their_config(trainer):
    module, config_name, _, _ = TRAINERS[trainer]
    assert getattr(importlib.import_module(module), config_name) is getattr(importlib.import_module(CONFIGS), config_name)


def test_common_re_exports_the_checks():
    common = importlib.import_module("vispec.eval.train.common")
    for name in ("Namer", "MAX_SEED", "field_name", "check_fields", "check_common", "check_folder", "check_choice",
                 "check_heads", "check_pipeline_name", "check_decoding_defaults"):
        assert getattr(common, name) is getattr(checks, name), name


def test_the_copied_constants_agree_with_the_models():
    """The configs keep torch-free copies of a few constants of torch-importing modules."""
    pytest.importorskip("skimage", reason="the scene and photo samplers need the train extra (scikit-image)")
    from vispec.eval.bench.data import IMAGE_SIZE
    from vispec.eval.bench.scenes import DEFAULT_SIZES
    from vispec.eval.train import clip
    from vispec.models.llamagen_vq import LLAMAGEN_VQ_VARIANTS, llamagen_vq_config

    assert configs.VQ4_CHANNEL_MULT == LLAMAGEN_VQ_VARIANTS["VQ-4"]
    assert configs.VQ8_CHANNEL_MULT == LLAMAGEN_VQ_VARIANTS["VQ-8"]
    assert configs.VQ_NORM_GROUPS == llamagen_vq_config("VQ-4")["norm_num_groups"]
    assert configs.SCENE_SIZES == DEFAULT_SIZES
    assert configs.PHOTO_PIXELS == IMAGE_SIZE**2 and configs.GPT_TOKENS == (IMAGE_SIZE // 4) ** 2
    assert clip.SWAP_KINDS is configs.SWAP_KINDS


# ---- the estimates ---------------------------------------------------------------------------------------------

def _parameters(model, skip: tuple[str, ...] = ()) -> int:
    return sum(p.numel() for name, p in model.named_parameters() if not any(s in name for s in skip))


@pytest.mark.parametrize("cfg", [VQTrainConfig(), VQTrainConfig(base_channels=64, channel_mult=(1, 2, 4), layers_per_block=2),
                                 VQTrainConfig(channel_mult=(1, 1, 2, 2))])
def test_vq_footprint_is_near_the_built_vq(cfg):
    """The VQ estimate leaves out the shortcut convolutions and the norms: within 10% of the built VQModel; three
    channel levels give a downsample-4 VQ, four a downsample-8 one."""
    pytest.importorskip("skimage")
    import torch

    from vispec.eval.train.vq import build_vq
    from vispec.models.llamagen_vq import downsample_factor, encode_to_tokens

    vq = build_vq(cfg).eval()
    built = _parameters(vq)
    assert 0.9 * built <= cfg.footprint().parameters <= built
    side = 64 // downsample_factor(vq)
    assert side == {3: 16, 4: 8}[len(cfg.channel_mult)]
    assert encode_to_tokens(vq, torch.zeros(1, 3, 64, 64)).shape == (1, side, side)


def test_the_other_footprints_count_the_built_models_parameters():
    """Exactly, less the parts the estimates leave out (embeddings sized by a VQ or a tokenizer, the class head)."""
    pytest.importorskip("skimage")
    from vispec.dllm.learned import ParallelDecodeFilter
    from vispec.eval.bench.evaluator import CropClassifier
    from vispec.eval.train.clip import build_clip, clip_tokenizer
    from vispec.eval.train.gpt import build_gpt
    from vispec.eval.train.mdlm import build_model, make_tasks
    from vispec.eval.train.t2i import build_chameleon, caption_tokenizer
    from vispec.eval.train.tokenizer import train_task_tokenizer

    cases = [
        (EvaluatorTrainConfig(width=8, feature_dim=32), lambda c: CropClassifier(14, c.width, c.feature_dim), ("head",)),
        (GPTTrainConfig(dim=64, n_layer=2, n_head=2), lambda c: build_gpt(c, 64, 14), ("tok_emb", "output", "cls_emb")),
        (T2ITrainConfig(hidden_size=64, layers=2, heads=2), lambda c: build_chameleon(c, 100, caption_tokenizer()),
         ("vqmodel", "embed_tokens", "lm_head")),
        (CLIPTrainConfig(hidden_size=32, vision_layers=2, text_layers=1, heads=2, projection_dim=16, patch_size=16),
         lambda c: build_clip(c, clip_tokenizer(c.text_length)), ("token_embedding",)),
        (MDLMTrainConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, mlp_hidden_size=48),
         lambda c: build_model(c, train_task_tokenizer(make_tasks(c), 20)), ("wte", "transformer.ff_out")),
        (FilterTrainConfig(block_length=8, hidden_size=16), lambda c: ParallelDecodeFilter(c.block_length, c.hidden_size), ()),
    ]
    for cfg, build, skip in cases:
        assert cfg.footprint().parameters == _parameters(build(cfg), skip), type(cfg).__name__


def test_the_shipped_settings_fit_8_gib(memory, vq_folder):
    """Every trainer's defaults, and the settings of the sample scripts, pass ``validate`` on an 8 GiB machine."""
    shipped = [VQTrainConfig(), VQTrainConfig(data="scenes", steps=2200, codebook_size=512), EvaluatorTrainConfig(),
               GPTTrainConfig(vq=vq_folder), DrafterTrainConfig(), T2ITrainConfig(vq=vq_folder, num_sequences=40000),
               CLIPTrainConfig(), MDLMTrainConfig(), FilterTrainConfig(prompts_per_task=32),
               MDLMTrainConfig(init_from="vispec/tiny-mdlm", answer_length=32, long_answer_length=256, long_every=3,
                               long_batch_size=8, final_eval_n=200, eval_answer_length=256, eval_block_length=32,
                               eval_batch_size=100)]
    for cfg in shipped:
        cfg.validate()
        assert cfg.footprint().bytes < 4 * GIB, (cfg, cfg.footprint())


# ---- refusals --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("cfg, words", [
    (GPTTrainConfig(dim=10**9), r"^dim 1000000000 \(with n_layer 4, n_head 4, batch_size 32, num_sequences 25600\) "
                                r"gives ~4\.8e19 parameters and ~.* bytes of activations and data: ~7\.7e20 bytes to "
                                r"train .*; this machine has 8\.0 GiB of memory$"),
    (MDLMTrainConfig(d_model=10**9), r"^d_model 1000000000 \(with n_layers 4, "),
    (VQTrainConfig(base_channels=10**9), r"^base_channels 1000000000 \(with channel_mult 1,1,2, "),
    (GPTTrainConfig(dim=4096, n_layer=48, n_head=32), r"^dim 4096, n_layer 48, n_head 32 \(with batch_size 32, "),
    (GPTTrainConfig(n_layer=10**5000), r"^n_layer 1e5000 \(with dim 256, "),  # past Python's int-to-str limit
    (CLIPTrainConfig(threads=2**40), r"^threads must be an integer in \[0, 1024\]"),
    (MDLMTrainConfig(threads=5000), r"^threads must be an integer in \[0, 1024\]"),
])
def test_python_names_the_fields_that_set_the_size(cfg, words, memory):
    with pytest.raises(ValueError, match=words):
        cfg.validate()


def test_a_refused_size_does_no_work(tmp_path, memory):
    """The trainer refuses before anything is made: no output folder."""
    pytest.importorskip("skimage")
    from vispec.eval.train.gpt import train_gpt
    from vispec.eval.train.mdlm import train_mdlm

    with pytest.raises(ValueError, match="^dim 1000000000 "):
        train_gpt(GPTTrainConfig(vq=str(tmp_path / "none"), out=str(tmp_path / "gpt"), dim=10**9))
    with pytest.raises(ValueError, match="^mlp_hidden_size 1000000000000 "):
        train_mdlm(MDLMTrainConfig(out=str(tmp_path / "mdlm"), mlp_hidden_size=10**12))
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_without_a_memory_reading_nothing_is_refused_for_size(monkeypatch):
    """Where ``os.sysconf`` cannot say, the size check is off (the other checks still run)."""
    assert checks.total_memory() > 0  # this machine can say (its value is not used by any test)

    def unavailable(name):
        raise ValueError(f"unrecognized configuration name {name!r}")

    monkeypatch.setattr(checks.os, "sysconf", unavailable)
    assert checks.total_memory() is None
    VQTrainConfig(base_channels=2**30).validate()
    with pytest.raises(ValueError, match="^steps must be"):
        VQTrainConfig(base_channels=2**30, steps=0).validate()


def test_init_from_leaves_the_architecture_out(memory):
    """Fine-tuning takes the folder's model: ``d_model`` and the other sizes are ignored, so they are not counted."""
    cfg = MDLMTrainConfig(d_model=2**20, n_heads=2**10, init_from="vispec/tiny-mdlm")
    assert cfg.footprint().parameters == 0
    cfg.validate()


@pytest.mark.parametrize("count, text", [(0, "0"), (9999, "9999"), (10_000, "1e4"), (48 * 10**18, "4.8e19"),
                                         (10**100 - 1, "1e100"), (10**5000, "1e5000"), (123_456, "1.2e5")],
                         ids=lambda value: value if isinstance(value, str) else "")
def test_approx(count, text):
    assert checks.approx(count) == text
