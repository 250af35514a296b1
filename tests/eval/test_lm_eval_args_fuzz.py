"""lm-eval's ``--model_args`` for ``vispec-dllm``, fuzzed (issue 47, item 21): every generated string (wrong keys, bad
decoding specs, bad numbers, keys that do not fit the decoding or the model) either starts lm-eval or is refused by
``python -m vispec.eval.lm_eval_model`` before lm-eval starts, with status 2 and one ``vispec-dllm: error:`` line
naming a key the string holds; never a traceback from inside. Strings lm-eval's own parser refuses (an item without
``=``) are left to lm-eval, which reports them before it indexes anything. No task is indexed here: lm-eval's CLI is
replaced by a recorder, and the pipelines without weights are built once per model."""

from __future__ import annotations

import functools
import sys

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

pytest.importorskip("lm_eval")

import lm_eval.__main__  # noqa: E402
from lm_eval._cli.utils import key_val_to_dict  # noqa: E402

import vispec.eval.lm_eval_model as lm_eval_model  # noqa: E402
from vispec.dllm import CACHES  # noqa: E402
from vispec.eval.bench.text import RULES, STRATEGIES  # noqa: E402
from vispec.pipelines import MaskedDiffusionLMPipeline  # noqa: E402

FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
KNOWN = [name for name in lm_eval_model.inspect.signature(lm_eval_model.VispecDLLM.__init__).parameters if name != "self"]
WRONG_KEYS = ["temprature", "cfg", "model", "max_new_tokens", "Decoding", "strategy", "cache", "pretrained_model"]

_NUMBERS = ["0", "1", "2", "4", "8", "16", "32", "64", "-1", "0.5", "0.9", "1.5", "2.0", "1e9", "nan", "inf", "abc", "",
            "True", "False", "None", "[1]", "x1"]
_SETTING = st.builds(lambda strategy, rules, cache: strategy + "".join(f"+{r}" for r in rules) + cache,
                     st.sampled_from([*STRATEGIES, "thresh", "", "gemma", "editing"]),
                     st.lists(st.sampled_from([*RULES, "ssd=4", "ssd=0", "ssd=auto", "ssd=x", "ssd=300", "eotp=1", ""]),
                              max_size=2),
                     st.sampled_from(["", *(f"@{c}" for c in CACHES), "@", "@paged"]))
VALUES = {
    "pretrained": st.sampled_from(["tiny-mdlm", "tiny-llada2", "tiny-mdlm-long", "tiny-c2i", "nope", "", "5", "None"]),
    "decoding": st.one_of(_SETTING, st.sampled_from(["1", "None", "[1]", "threshold@dual", "llada+ssd=4"])),
    "early_stop_eos": st.sampled_from(["True", "False", "1", "yes"]),
    "check_greedy": st.sampled_from(["True", "False", "0"]),
    "device": st.sampled_from(["cpu", "gpu", "cuda", "cuda:0", "", "5", "meta"]),
    "dtype": st.sampled_from(["float32", "bfloat16", "fp8", ""]),
    "batch_size": st.sampled_from(["1", "2", "auto", "auto:4", "0", "-1", "x"]),
}
_KEY = st.sampled_from(KNOWN + WRONG_KEYS)


@st.composite
def model_args(draw) -> str:
    """``pretrained=...`` (usually) and up to four more ``key=value`` items, now and then a malformed one."""
    items = [f"pretrained={draw(VALUES['pretrained'])}"] if draw(st.integers(0, 9)) else []
    for key in draw(st.lists(_KEY, max_size=4)):
        items.append(f"{key}={draw(VALUES.get(key, st.sampled_from(_NUMBERS)))}")
    if not draw(st.integers(0, 14)):
        items.append(draw(st.sampled_from(["threshold", "=", "=1", "decoding"])))
    return ",".join(draw(st.permutations(items)))


@pytest.fixture(scope="module")
def cached_pipelines():
    """Each model's pipeline without weights built once (the checks only read it)."""
    with pytest.MonkeyPatch.context() as patch:
        build = functools.cache(MaskedDiffusionLMPipeline.from_pretrained_without_weights.__func__)
        patch.setattr(MaskedDiffusionLMPipeline, "from_pretrained_without_weights",
                      classmethod(lambda cls, path, **kwargs: build(cls, path, **kwargs)))
        yield


@pytest.fixture
def launcher(monkeypatch, cached_pipelines):
    started = []
    monkeypatch.setattr(lm_eval.__main__, "cli_evaluate", lambda: started.append(True))
    monkeypatch.setattr(lm_eval_model, "_patch_lm_eval", lambda: None)
    monkeypatch.setattr(sys, "argv", ["lm_eval"])
    return started


def launch(text: str, launcher, capsys) -> tuple[bool, str]:
    """(lm-eval started, the error line or ""); a refusal must be status 2 and one line."""
    capsys.readouterr()
    before = len(launcher)
    try:
        lm_eval_model.main(["--model", "vispec-dllm", "--model_args", text, "--tasks", "vispec_arithmetic"])
    except SystemExit as exit_info:
        err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert exit_info.code == 2 and len(err) == 1 and err[0].startswith("vispec-dllm: error: --model_args"), \
            (text, exit_info.code, err)
        assert len(launcher) == before
        return False, err[0]
    assert len(launcher) == before + 1
    return True, ""


@FUZZ
@given(text=model_args())
def test_model_args_are_checked_before_lm_eval(text, launcher, capsys):
    try:
        parsed = key_val_to_dict(text)
    except ValueError:  # lm-eval's own parser refuses it, in its words, before indexing
        parsed = None
    started, line = launch(text, launcher, capsys)
    if parsed is None:
        assert started
        event("left to lm-eval")
        return
    unknown = [key for key in parsed if key not in KNOWN]
    if unknown:
        assert not started and f"takes no argument {unknown[0]!r}" in line, (text, line)
        event("unknown key")
        return
    if not started:
        named = [key for key in (*parsed, "pretrained") if key in line]
        assert named, (text, line)
        event("refused")
    else:
        assert "pretrained" in parsed
        event("accepted")


@pytest.mark.parametrize("text, words", [
    ("pretrained=tiny-mdlm,gen_length=abc", "gen_length must be an integer >= 1, got 'abc'"),
    ("pretrained=tiny-mdlm,gen_length=1e9", "gen_length must be an integer >= 1, got 1000000000.0"),
    ("pretrained=tiny-mdlm,decoding=threshold,threshold=nan", "threshold"),
    ("pretrained=tiny-mdlm,guidance_scale=abc", "guidance_scale must be a finite number >= 1"),
    ("pretrained=tiny-mdlm,cache_reload_steps=0", "cache_reload_steps must be an integer >= 1"),
    ("pretrained=tiny-mdlm,decoding=llada+ssd=4,draft_length=300", "draft_length"),
    ("pretrained=tiny-mdlm,block_length=64", "block_length (64)"),
    ("pretrained=5", "pretrained must be a pipeline folder or an embedded model name, got 5"),
    ("pretrained=tiny-c2i", "not a MaskedDiffusionLMPipeline"),
    ("pretrained=tiny-mdlm,device=meta", "device"),
    ("decoding=threshold", "needs pretrained="),
])
def test_bad_values_name_their_key(text, words, launcher, capsys):
    started, line = launch(text, launcher, capsys)
    assert not started and words in line, line
