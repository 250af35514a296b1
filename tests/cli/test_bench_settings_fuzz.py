"""The benchmarks' settings strings, fuzzed (issue 28, item 18): ``bench text --settings`` and the decoding specs of
``bench image`` / ``bench decoders --methods``. Every string is either well formed, and the benchmark starts, or
refused before any work (nothing loaded, nothing decoded) with one ``vispec: error:`` line and status 2; never a
traceback, never a malformed string that runs (``threshold@`` ran with no cache before)."""

from __future__ import annotations

import re

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from vispec.cli import main
from vispec.dllm import CACHES
from vispec.eval.bench import decoders, image, text
from vispec.eval.bench.text import RULES, STRATEGIES, TextBenchConfig, parse_setting

FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


class Reached(Exception):
    """Raised by the patched benchmark: the command line was accepted and the run would start."""


@pytest.fixture
def benches(monkeypatch):
    """The benchmarks' run functions replaced: reaching one means the settings were accepted."""

    def reached(*args, **kwargs):
        raise Reached

    for module, name in ((text, "run_text_bench"), (image, "run_image_bench"), (decoders, "run_decoder_bench")):
        monkeypatch.setattr(module, name, reached)


def run_cli(argv: list[str], capsys) -> bool:
    """True if the benchmark would start; False if refused, after checking the refusal is one line and status 2."""
    capsys.readouterr()
    try:
        status = main(argv)
    except Reached:
        return True
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1 and err[0].startswith("vispec: error:"), (argv, status, err)
    run_cli.refusal = err[0]
    return False


# ---- bench text --settings -------------------------------------------------------------------------------------

_ITEM = re.compile(rf"({'|'.join(STRATEGIES)})((?:\+(?:{'|'.join(RULES)}))*)(?:@(?:{'|'.join(CACHES)}))?")


def well_formed(settings_text: str) -> bool:
    """The grammar, written independently of the parser: comma-separated ``strategy[+rule...][@cache]`` items
    (spaces around items allowed), each rule at most once, at least one item."""
    items = [item.strip() for item in settings_text.split(",") if item.strip()]
    for item in items:
        match = _ITEM.fullmatch(item)
        if match is None:
            return False
        rules = match.group(2).split("+")[1:]
        if len(set(rules)) != len(rules):
            return False
    return bool(items)


_PIECES = st.sampled_from([*STRATEGIES, *(f"+{r}" for r in RULES), *(f"@{c}" for c in CACHES), "+", "@", ",", " ", "",
                           "thresh", "eotp", "dual", "@@", "+@", ",,", "x"])
_GOOD = st.builds(lambda strategy, rules, cache: strategy + "".join(f"+{r}" for r in rules) + cache,
                  st.sampled_from(STRATEGIES), st.lists(st.sampled_from(RULES), max_size=2),
                  st.sampled_from(["", *(f"@{c}" for c in CACHES)]))
SETTINGS_TEXT = st.one_of(st.lists(_PIECES, max_size=6).map("".join), st.text(alphabet="adehlnoprstu+@, ", max_size=16),
                          st.lists(st.one_of(_GOOD, _GOOD, _PIECES), min_size=1, max_size=3).map(",".join))


@pytest.mark.parametrize("setting", ["threshold@", "@dual", "threshold+", "@", "+", "+@", "threshold@@dual",
                                     "threshold@dual@", "threshold@dual+eotp", "threshold++eotp", " @none"])
def test_malformed_settings_are_refused(setting, benches, capsys):
    assert not well_formed(setting)
    with pytest.raises(ValueError, match="settings"):
        parse_setting(setting.strip())
    assert not run_cli(["bench", "text", f"--settings={setting}"], capsys)
    assert "settings" in run_cli.refusal


def test_well_formed_settings_parse():
    assert parse_setting("threshold") == ("threshold", (), "none")
    assert parse_setting("learn2pd+eotp+prophet@dkv") == ("learn2pd", ("eotp", "prophet"), "dkv")
    assert parse_setting("editing+ssd=auto@prefix") == ("editing", ("ssd=auto",), "prefix")  # LLaDA2's rule, by name
    assert "editing" not in TextBenchConfig().strategies  # the default grid runs on every model family


@FUZZ
@given(settings_text=SETTINGS_TEXT)
def test_settings_strings(settings_text, benches, capsys):
    """The command accepts exactly the well-formed strings; the parser agrees item by item."""
    expected = well_formed(settings_text)
    assert run_cli(["bench", "text", f"--settings={settings_text}"], capsys) == expected
    for item in (item.strip() for item in settings_text.split(",") if item.strip()):
        try:
            strategy, rules, cache = parse_setting(item)
        except ValueError as err:
            assert "settings" in str(err) and not well_formed(item)
            continue
        assert well_formed(item)
        assert item == strategy + "".join(f"+{r}" for r in rules) + ("" if cache == "none" and "@" not in item else f"@{cache}")
    event("accepted" if expected else "refused")


# ---- bench image / decoders --methods ----------------------------------------------------------------------------

_SPEC_NAMES = st.sampled_from(["ar", "sjd", "mc-sjd", "sjd-random", "mc-sjd-gumbel", "sjd-pac", "sd", "gsd", "nope", "",
                               "sjd+", "sjd:", "mc-sjd+lantern", "mc-sjd+gsd", "sjd+lumina", "+", "ar+exact"])
_SPEC_OPTIONS = st.lists(st.tuples(st.sampled_from(["window", "init", "coupling", "temperature", "top_k", "k", "delta",
                                                    "tree_width", "bogus", ""]),
                                   st.sampled_from(["4", "auto", "0", "-1", "nan", "x", "", "0.5", "horizontal"])),
                         max_size=2)


@st.composite
def _spec(draw) -> str:
    options = draw(_SPEC_OPTIONS)
    return draw(_SPEC_NAMES) + (":" + ",".join(f"{k}={v}" for k, v in options) if options else "")


METHODS_TEXT = st.one_of(st.lists(_spec(), min_size=1, max_size=3).map(",".join),
                         st.text(alphabet="acdjmrs-+:=,0123456789wx ", max_size=14))


def _parses(methods_text: str, parse) -> bool:
    from vispec.decoding.config import split_specs

    try:
        for spec in split_specs(methods_text, "--methods"):
            parse(spec)
    except ValueError:
        return False
    return True


def _decoders_parse(spec: str) -> None:
    config = decoders.decoding_config(spec, 16)
    if config.strategy in ("sd", "gad") or config.rule.rule == "lantern":  # no drafter, no codebook: refused up front
        raise ValueError(spec)


@FUZZ
@given(methods_text=METHODS_TEXT)
def test_image_bench_methods(methods_text, benches, capsys):
    """``bench image`` starts exactly when every spec parses (and sweeps its +lantern settings)."""
    expected = _parses(methods_text, lambda spec: image.expand_methods((spec,), (1000,), (0.1,)))
    assert run_cli(["bench", "image", f"--methods={methods_text}"], capsys) == expected
    event("accepted" if expected else "refused")


@FUZZ
@given(methods_text=METHODS_TEXT)
def test_decoder_bench_methods(methods_text, benches, capsys):
    """``bench decoders`` starts exactly when every spec parses and needs neither a drafter nor a codebook."""
    expected = _parses(methods_text, _decoders_parse)
    assert run_cli(["bench", "decoders", f"--methods={methods_text}"], capsys) == expected
    event("accepted" if expected else "refused")


@pytest.mark.parametrize("methods, words", [
    ("sd", "needs a drafter model"), ("ar,mc-sjd+lantern", "needs the VQ codebook"), ("sjd:window=x", "window"),
])
def test_decoder_bench_refuses_before_running_any_method(methods, words, benches, capsys):
    assert not run_cli(["bench", "decoders", "--methods", methods], capsys)
    assert words in run_cli.refusal


def test_image_bench_refuses_a_malformed_spec_before_loading(benches, capsys):
    """The spelling is checked by ``validate`` (before the model loads), not after loading as before."""
    assert not run_cli(["bench", "image", "--methods", "ar,sjd:window=x"], capsys)
    assert "window" in run_cli.refusal
