"""``vispec train`` checks every flag before any work (issue 28, item 15): a bad value is one ``vispec: error:``
line naming the flag, exit status 2, with no data made, no model built, nothing written and no network used;
good values reach the trainer. The trainers are replaced by stubs, so nothing here trains."""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
import re
import socket
import typing

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from vispec.cli import main
from vispec.cli.args import config_flag
from vispec.cli.train import TRAINERS
from vispec.eval.train import checks

MEMORY = 8 * 2**30  # the machine's memory as the tests set it (the size checks must not depend on this machine)


def one_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("vispec: error:"), err
    return err[0]


def config_class(trainer: str) -> type:
    module, config_name, _, _ = TRAINERS[trainer]
    return getattr(importlib.import_module(module), config_name)


def flag_fields(trainer: str) -> list[str]:
    """The fields that have a value flag (switches and dict fields have none to get wrong)."""
    cls = config_class(trainer)
    hints = typing.get_type_hints(cls)
    return [f.name for f in dataclasses.fields(cls) if hints[f.name] not in (bool, dict)]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Folders that pass the path checks of the trainers (the files they look for, empty of weights)."""
    root = tmp_path_factory.mktemp("trained")
    files = {"vq": ["config.json"], "gpt": ["config.json"], "evaluator": ["config.json"], "drafter": ["config.json"],
             "t2i": ["config.json", "train_config.json"], "clip": ["config.json"], "mdlm": ["train_config.json"],
             "pipeline": ["model_index.json"]}
    for folder, names in files.items():
        (root / folder).mkdir()
        for name in names:
            (root / folder / name).write_text("{}")
    return root


def base_args(trainer: str, root) -> list[str]:
    """The path flags of ``trainer`` pointed at :func:`folders`, and ``--out`` at a folder to be made."""
    paths = {"gpt": {"--vq": "vq"}, "t2i": {"--vq": "vq"}, "assemble": {"--vq": "vq", "--gpt": "gpt", "--evaluator": "evaluator"},
             "assemble-drafter": {"--drafter": "drafter", "--pipeline": "pipeline"},
             "assemble-gad-drafter": {"--drafter": "drafter", "--pipeline": "pipeline"},
             "assemble-t2i": {"--vq": "vq", "--t2i": "t2i", "--clip": "clip"}, "assemble-mdlm": {"--trained": "mdlm"},
             "assemble-edit": {"--edit": "t2i"}, "assemble-llada2": {"--trained": "mdlm"}}
    argv = [item for flag, folder in paths.get(trainer, {}).items() for item in (flag, str(root / folder))]
    if "out" in flag_fields(trainer):
        argv += ["--out", str(root / "out" / trainer)]
    return argv


@pytest.fixture
def stubs(monkeypatch):
    """Every trainer replaced by a stub recording its config; any network connection fails the test; the machine's
    memory fixed at :data:`MEMORY`."""
    calls: list = []
    monkeypatch.setattr(checks, "total_memory", lambda: MEMORY)
    for module, _, func_name, _ in TRAINERS.values():
        monkeypatch.setattr(importlib.import_module(module), func_name, lambda cfg: calls.append(cfg) or {"stub": True})

    def no_network(*args, **kwargs):
        raise AssertionError("a trainer's check went to the network")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    return calls


# ---- every trainer: its defaults pass, and its config has validate(name) ---------------------------------------

@pytest.mark.parametrize("trainer", list(TRAINERS))
def test_defaults_reach_the_trainer(trainer, folders, stubs, capsys):
    assert callable(getattr(config_class(trainer), "validate", None)), f"{trainer}'s config has no validate()"
    assert main(["train", trainer, *base_args(trainer, folders)]) == 0, capsys.readouterr().err
    assert len(stubs) == 1 and isinstance(stubs[0], config_class(trainer))
    assert json.loads(capsys.readouterr().out) == {"stub": True}
    assert not (folders / "out" / trainer).exists()  # the stub wrote nothing, and the checks made no folder


# ---- the cases -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv,words", [
    (["vq", "--batch-size", "0"], "--batch-size must be an integer >= 1, got 0"),
    (["vq", "--steps", "-5"], "--steps must be an integer >= 1, got -5"),
    (["gpt", "--vq", "MISSING"], "--vq 'MISSING' does not exist"),
    (["t2i", "--vq", "MISSING"], "--vq 'MISSING' does not exist"),
    (["gpt", "--vq", "ROOT"], "has no config.json"),
    (["vq", "--lr", "nan"], "--lr must be a finite number > 0, got nan"),
    (["vq", "--channel-mult", "1,1"], "--channel-mult must be 3 or 4 integers >= 1"),
    (["vq", "--base-channels", "16"], "--base-channels x --channel-mult gives channel widths [16, 16, 32]"),
    (["vq", "--data", "faces"], "--data must be one of photos, scenes, got 'faces'"),
    (["vq", "--seed", "-1"], "--seed must be an integer >= 0"),
    (["vq", "--seed", str(2**40)], "--seed must be an integer in [0, 4294967295]"),
    (["gpt", "--dim", "30"], "--dim (30) must split into --n-head (4) heads"),
    (["gpt", "--dropout", "1"], "--dropout must be a probability in [0, 1)"),
    (["clip", "--image-size", "60"], "--image-size (60) must be a multiple of --patch-size (8)"),
    (["clip", "--hard-negatives", "texture"], "--hard-negatives must be kinds among"),
    (["mdlm", "--tasks", "arithmetic,poetry"], "--tasks must name distinct tasks among arithmetic, sort, reverse"),
    (["mdlm", "--task-weights", "1,1"], "--task-weights must give one weight per task of --tasks (3"),
    (["mdlm", "--long-every", "2"], "--long-every and --long-answer-length must both be > 0"),
    (["mdlm", "--warmup", "0"], "--warmup must be an integer >= 1"),
    (["mdlm", "--init-from", "MISSING"], "--init-from: unknown model"),
    (["t2i", "--init-from", "tiny-c2i"], "--init-from 'tiny-c2i' is a LlamaGenPipeline, not a UnifiedImagePipeline"),
    (["t2i", "--init-from", "tiny-t2i", "--layers", "3"], "--layers 3 differs from the 6 of --init-from 'tiny-t2i'"),
    (["drafter", "--sample-decoding", "fast"], "--sample-decoding: unknown decoding 'fast'"),
    (["drafter", "--target", "MISSING"], "--target: unknown model"),
    (["filter", "--model", "MISSING"], "--model: unknown model"),
    (["filter", "--tasks", "poetry"], "--tasks must name tasks among"),
    (["assemble", "--top-p", "2"], "--top-p must be a finite number in (0, 1]"),
    (["assemble", "--init", "diagonal"], "--init must be one of"),
    (["assemble-t2i", "--window", "0"], "--window must be an integer in [1, 4096]"),
    (["assemble-mdlm", "--gen-length", "12", "--block-length", "8"], "--gen-length (12) must be a multiple of --block-length (8)"),
    (["assemble-drafter", "--lantern-k", "0"], "--lantern-k must be an integer >= 1"),
    # sizes past the machine's memory (issue 28): the flags that set the size, the one changed first
    (["gpt", "--dim", "1000000000"], "--dim 1000000000 (with --n-layer 4, --n-head 4, --batch-size 32, --num-sequences "
                                     "25600) gives ~4.8e19 parameters"),
    (["gpt", "--dim", "1000000000"], "this machine has 8.0 GiB of memory"),
    (["mdlm", "--d-model", "1000000000"], "--d-model 1000000000 (with --n-layers 4,"),
    (["vq", "--base-channels", "1000000000"], "--base-channels 1000000000 (with --channel-mult 1,1,2,"),
    (["vq", "--channel-mult", "1,1,1000000000"], "--channel-mult 1,1,1000000000 (with --base-channels 32,"),
    (["evaluator", "--width", "1000000"], "--width 1000000 (with"),
    (["drafter", "--batch-size", "1000000"], "--batch-size 1000000 (with --dim 128,"),
    (["t2i", "--layers", "1000000000"], "--layers 1000000000 (with"),
    (["clip", "--image-size", "1000000"], "--image-size 1000000 (with"),
    (["filter", "--block-length", "1000000000"], "--block-length 1000000000 (with"),
    (["mdlm", "--eval-batch-size", "1000000000"], "--eval-batch-size 1000000000 (with"),
    (["clip", "--threads", "5000"], "--threads must be an integer in [0, 1024]"),
    # issue 47 items 4, 8, 13, 14
    (["llada2", "--batch-size", "10000000"], "--batch-size 10000000 (with --answer-length 32,"),
    (["llada2", "--answer-length", "30"], "--answer-length (30) must be a multiple of --block-length (32)"),
    (["llada2", "--num-experts", "1"], "--num-experts must be an integer >= 2"),
    (["gad-drafter", "--target", "tiny-mdlm"], "--target 'tiny-mdlm' is a MaskedDiffusionLMPipeline, not a LlamaGenPipeline"),
    (["llada2", "--init-from", "tiny-llada2", "--num-experts", "8"],
     "--num-experts 8 differs from the 4 of --init-from 'tiny-llada2': a LLaDA2 folder is continued with its own"),
    (["filter", "--threads", "5000"], "--threads must be an integer in [1, 1024]"),
    # issue 47 item 20: the warm start's shape, from its config.json, before minutes of sampling
    (["gad-drafter", "--dim", "64"], "--dim 64 does not fit --warm-start drafter (the drafter of --target 'tiny-c2i'), "
                                     "whose dim is 128: pass --dim 128, or --warm-start '' to start from random weights"),
    (["gad-drafter", "--n-layer", "3"], "--n-layer 3 does not fit --warm-start drafter (the drafter of --target "
                                        "'tiny-c2i'), whose n_layer is 2: pass --n-layer 2"),
    (["gad-drafter", "--n-head", "8"], "--n-head 8 does not fit --warm-start drafter (the drafter of --target "
                                       "'tiny-c2i'), whose n_head is 4: pass --n-head 4"),
    (["gad-drafter", "--warm-start", "transformer"], "--dim 128 does not fit --warm-start transformer (the transformer "
                                                     "of --target 'tiny-c2i'), whose dim is 256: pass --dim 256"),
    (["gad-drafter", "--class-dropout-prob", "0"], "--class-dropout-prob 0.0 does not fit --warm-start drafter (the "
                                                   "drafter of --target 'tiny-c2i'), whose class table has a null-class "
                                                   "row (class_dropout_prob 0.1): pass a --class-dropout-prob above 0"),
])
def test_bad_trainer_flags_are_one_line_naming_the_flag(argv, words, folders, stubs, capsys, tmp_path):
    trainer = argv[0]
    fill = {"MISSING": str(tmp_path / "missing"), "ROOT": str(tmp_path)}
    argv = [fill.get(a, a) for a in argv]
    assert main(["train", trainer, *base_args(trainer, folders), *argv[1:]]) == 2
    line = one_line(capsys)
    assert words.replace("MISSING", fill["MISSING"]) in line and stubs == []


def test_a_warm_start_of_the_drafters_shape_reaches_the_trainer(folders, stubs, capsys):
    """Issue 47 item 20: flags that fit the warm start pass (tiny-c2i's transformer: 256 wide, 4 layers, 4 heads);
    without a warm start any shape does."""
    assert main(["train", "gad-drafter", *base_args("gad-drafter", folders), "--warm-start", "transformer", "--dim", "256",
                 "--n-layer", "4"]) == 0, capsys.readouterr().err
    assert main(["train", "gad-drafter", *base_args("gad-drafter", folders), "--warm-start", "", "--dim", "64"]) == 0
    assert [(cfg.warm_start, cfg.dim) for cfg in stubs] == [("transformer", 256), ("", 64)]


OUT_TRAINERS = [trainer for trainer in TRAINERS if "out" in flag_fields(trainer)]


@pytest.mark.parametrize("trainer", OUT_TRAINERS)
def test_an_output_folder_that_cannot_be_made_is_one_line_naming_out(trainer, folders, stubs, capsys, tmp_path):
    """Issue 47 item 15: every trainer with --out checks up front that the folder can be made and written (root's
    permission bits say yes for /proc, where no folder can be made: "[Errno 2] No such file or directory" came from
    inside the trainer, after the sampling); nothing is left behind by the check."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    cases = [(str(blocker / "out"), f"--out '{blocker / 'out'}': {blocker} is a file, so the folder cannot be made")]
    if __import__("os").path.isdir("/proc/self"):  # Linux: procfs takes no new folders, whoever asks
        cases.append(("/proc/vispec-out/x", "--out '/proc/vispec-out/x': cannot make folders in /proc ("))
    for out, words in cases:
        assert main(["train", trainer, *base_args(trainer, folders), "--out", out]) == 2
        assert words in one_line(capsys) and stubs == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


def test_the_output_check_leaves_nothing_behind(tmp_path, stubs, capsys):
    """A writable --out passes, made by nobody but the trainer: neither a missing folder nor an existing one keeps
    anything from the check."""
    from vispec.eval.train.checks import check_output_folder
    from vispec.eval.train.configs import EvaluatorTrainConfig

    for out in (tmp_path / "new" / "deeper", tmp_path):
        check_output_folder(EvaluatorTrainConfig(out=str(out)))
        assert sorted(p.name for p in tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match=r"^out '.*' is a file; expected a folder$"):
        (tmp_path / "f").write_text("")
        check_output_folder(EvaluatorTrainConfig(out=str(tmp_path / "f")))


def test_gpt_with_a_missing_vq_folder_says_so_without_the_network(tmp_path, stubs, capsys):
    """Before: "could not connect to huggingface.co" (the missing folder read as a Hub repository id)."""
    missing = tmp_path / "no-such-vq"
    assert main(["train", "gpt", "--vq", str(missing), "--out", str(tmp_path / "gpt")]) == 2
    line = one_line(capsys)
    assert f"--vq '{missing}' does not exist" in line and "huggingface" not in line


def test_python_api_names_the_fields(tmp_path):
    """Called from Python, the same checks name the config field, and run before any work."""
    from vispec.eval.train.gpt import GPTTrainConfig, train_gpt
    from vispec.eval.train.vq import VQTrainConfig, train_vq

    with pytest.raises(ValueError, match=r"^batch_size must be an integer >= 1, got 0$"):
        train_vq(VQTrainConfig(out=str(tmp_path / "vq"), batch_size=0))
    with pytest.raises(ValueError, match=r"^vq '.*' does not exist"):
        train_gpt(GPTTrainConfig(vq=str(tmp_path / "none"), out=str(tmp_path / "gpt")))
    assert not (tmp_path / "vq").exists() and not (tmp_path / "gpt").exists()


# ---- fuzzing: every flag of every trainer ----------------------------------------------------------------------

# fields where 0 is a meaningful setting ("off", "the default", "leave as is")
ZERO_OK = {"restart_every", "top_k", "n_kv_heads", "eval_every", "final_eval_n", "long_answer_length", "long_every",
           "long_batch_size", "eval_answer_length", "eval_block_length", "max_sequence_length", "seed"}
ZERO_OK_IN = {("gad-drafter", "context"), ("clip", "warmup"), ("clip", "threads"), ("mdlm", "threads"), ("filter", "gen_length"),
              ("filter", "block_length"), ("assemble-mdlm", "gen_length"), ("llada2", "first_k_dense_replace"),
              ("llada2", "warmup"), ("llada2", "checkpoint_every"), ("llada2", "initial_eval_n"), ("llada2", "threads"),
              ("assemble-llada2", "gen_length")}
FRACTIONS = {"class_dropout_prob", "dropout", "caption_dropout", "edit_noise"}  # [0, 1)
POSITIVE = {"lr", "rope_theta", "routed_scaling_factor"}
UNIT_INTERVAL = {"top_p", "threshold", "mask_eps", "eval_threshold"}  # (0, 1], mask_eps (0, 1)
ANY_FINITE = {"guidance_scale"}
CHOICES = {"data": {"photos", "scenes"}, "init": {"random", "horizontal", "vertical"}, "attention": {"bidirectional", "causal"},
           "warm_start": {"drafter", "transformer", ""}}  # GADDrafterTrainConfig: '' is a random init
PATHS = {"vq", "gpt", "evaluator", "drafter", "pipeline", "t2i", "clip", "trained", "edit"}
# fields each unit of which costs at least a byte of memory (a weight, an activation, a data item): accepted with
# the others at their defaults, none can exceed MEMORY
SIZE_FIELDS = {
    "vq": {"base_channels", "channel_mult[]", "z_channels", "codebook_size", "embed_dim", "layers_per_block", "batch_size",
           "eval_images"},
    "evaluator": {"width", "feature_dim", "batch_size", "eval_images"},
    "gpt": {"dim", "n_layer", "n_head", "batch_size", "num_sequences"},
    "drafter": {"dim", "n_layer", "n_head", "batch_size", "num_sequences"},
    "gad-drafter": {"dim", "n_layer", "n_head", "batch_size", "blocks_per_sequence", "num_sequences"},
    "t2i": {"hidden_size", "layers", "heads", "batch_size", "num_sequences"},
    "clip": {"hidden_size", "vision_layers", "text_layers", "heads", "projection_dim", "image_size", "patch_size",
             "text_length", "batch_size", "eval_candidates"},
    "mdlm": {"d_model", "n_layers", "n_heads", "mlp_hidden_size", "answer_length", "batch_size", "eval_answer_length",
             "eval_batch_size", "tokenizer_corpus", "eval_n", "final_eval_n"},
    "filter": {"hidden_size", "block_length", "gen_length", "prompts_per_task"},
}


def sane(trainer: str, field: str, value) -> bool:
    """What an accepted value of one field must satisfy (the test's own statement of the flags' ranges)."""
    if isinstance(value, bool):
        return False
    if isinstance(value, float):
        if not math.isfinite(value):
            return False
        if field in POSITIVE:
            return value > 0
        if field in FRACTIONS:
            return 0 <= value < 1
        if field in UNIT_INTERVAL:
            return 0 < value <= 1 and (field != "mask_eps" or value < 1)
        return field in ANY_FINITE or value >= 0
    if isinstance(value, int):
        if field == "seed":
            return 0 <= value < 2**32
        if field == "threads":
            return (0 if (trainer, field) in ZERO_OK_IN else 1) <= value <= 1024
        if field in SIZE_FIELDS.get(trainer, ()) and value > MEMORY:
            return False
        return value >= (0 if field in ZERO_OK or (trainer, field) in ZERO_OK_IN else 1)
    if isinstance(value, tuple):
        return len(value) > 0 and all(sane(trainer, field + "[]", v) if not isinstance(v, str) else bool(v) for v in value)
    if isinstance(value, str):
        if field in CHOICES:
            return value in CHOICES[field]
        if field == "device":
            return re.fullmatch(r"cpu|cuda(:\d+)?", value) is not None
        return bool(value) or field == "script" or (trainer == "assemble-t2i" and field == "clip") \
            or (trainer == "assemble-edit" and field == "evaluation") \
            or (trainer == "assemble-llada2" and field == "bench")  # optional: empty means none
    return False


FUZZ_VALUES = st.one_of(
    st.sampled_from(["0", "1", "-1", "2", "3", "7", "8", "16", "64", "256", "0.5", "1.0", "1e-3", "-0.5", "2.5", "nan", "inf",
                     "-inf", "abc", "", " ", "1,2", "1,1,2", "0,1,1", "arithmetic", "sort,reverse", "colour", "ar",
                     "mc-sjd", "photos", "scenes", "vertical", str(2**32), str(2**64), "1" * 25,
                     # sizes: plausible, past MEMORY, absurd
                     "512", "4096", "100000", "1000000000", str(2**31), str(10**18), "1,1,1000000000", "1,2,100000"]),
    st.integers(-3, 300).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.text(max_size=6),
)
FIELDS = [(trainer, field) for trainer in TRAINERS for field in flag_fields(trainer)
          if field not in PATHS | {"out", "target", "model", "init_from"}]  # paths: the cases above


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=st.sampled_from(FIELDS), value=FUZZ_VALUES)
def test_every_trainer_flag_is_checked_before_any_work(case, value, folders, stubs, capsys):
    """One flag of one trainer set to a fuzzed value, the others at their defaults: the value reaches the trainer
    and is sane (:func:`sane`; a size within :data:`MEMORY`), or it is refused by one line naming the flag, exit 2,
    and the trainer never runs."""
    trainer, field = case
    flag = config_flag(config_class(trainer), field)
    stubs.clear()  # the fixture outlives an example: one that failed before its clear left its trainer call behind
    rc = main(["train", trainer, *base_args(trainer, folders), f"{flag}={value}"])
    err = capsys.readouterr().err.strip().splitlines()
    if rc == 0:
        event("accepted")
        assert len(stubs) == 1, (trainer, flag, value)
        got = getattr(stubs[0], field)
        assert sane(trainer, field, got), f"{trainer} {flag}={value!r} reached the trainer as {got!r}"
    else:
        event("refused")
        assert rc == 2 and stubs == [], (trainer, flag, value, rc)
        assert len(err) == 1 and err[0].startswith("vispec: error:"), err
        assert flag in err[0], f"{trainer} {flag}={value!r}: the error does not name the flag: {err[0]}"
    stubs.clear()


@pytest.mark.parametrize("trainer, field", sorted((t, f) for t, fields in SIZE_FIELDS.items() for f in fields
                                                   if not f.endswith("[]")))
def test_every_size_flag_past_the_memory_is_refused(trainer, field, folders, stubs, capsys):
    """Each size flag at 10^12 (the others at their defaults) is refused in one line naming it, before any work."""
    flag = config_flag(config_class(trainer), field)
    assert main(["train", trainer, *base_args(trainer, folders), flag, str(10**12)]) == 2
    assert flag in one_line(capsys) and stubs == []


def test_the_fuzzed_fields_cover_every_value_flag():
    """Every value flag of every trainer is fuzzed or has a path case above."""
    covered = {t for t, _ in FIELDS}
    only_paths = {t for t in TRAINERS if all(f in PATHS | {"out", "target", "model", "init_from"} for f in flag_fields(t))}
    assert covered == set(TRAINERS) - only_paths  # a trainer that takes only paths has its cases above
    for trainer in TRAINERS:
        for field in flag_fields(trainer):
            assert (trainer, field) in FIELDS or field in PATHS | {"out", "target", "model", "init_from"}


def test_train_help_says_the_gad_drafters_default_attention(capsys):
    """Issue 47 item 25: the help said "(bidirectional, masked)" while --attention defaults to causal."""
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--help"])
    assert exit_info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "causal over masked inputs by default" in out and "(bidirectional, masked)" not in out


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a machine with CUDA trains there")
def test_a_missing_cuda_device_is_one_line(folders, stubs, capsys):
    """Issue 47 item 13: a traceback ending in "Torch not compiled with CUDA enabled" before."""
    assert main(["train", "llada2", *base_args("llada2", folders), "--device", "cuda"]) == 2
    assert "--device cuda, but CUDA is not available here" in one_line(capsys) and stubs == []
