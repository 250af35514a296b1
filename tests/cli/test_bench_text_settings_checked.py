"""``vispec bench text`` checks every row's setting against the model before the first row (issue 47, item 19).

Before, a setting the model cannot run (self-speculation or the dual cache on the block-causal LLaDA2, ssd over dkv)
was refused by the pipeline at its row, after the rows before it had been measured (``--model tiny-llada2
--settings llada+ssd=4`` measured its stepwise twin at two batch sizes first). The tests use refusals that stay
(self-speculation on LLaDA2 is being added). Now :func:`checked_rows` runs the
pipeline's own pre-forward checks (``MaskedDiffusionLMPipeline.check_decoding``) for every row on the pipeline
without its weights, before anything decodes, and the error names ``--settings`` and the setting."""

from __future__ import annotations

import pytest

from vispec.cli import main
from vispec.eval.bench import text
from vispec.eval.bench.text import TextBenchConfig, bench_rows, checked_rows
from vispec.pipelines import MaskedDiffusionLMPipeline

REFERENCE = ("llada", (), "none", False, None)


@pytest.fixture
def nothing_decodes(monkeypatch):
    """Any decode (a row or the warm-up) or a load of the weights fails the test: the refusal must come first."""
    calls = []

    def decode(*args, **kwargs):
        calls.append("decode")
        raise AssertionError("a row or the warm-up ran before the settings were checked")

    original = MaskedDiffusionLMPipeline.from_pretrained.__func__

    def load(cls, path, **kwargs):
        if "model" not in kwargs:  # from_pretrained_without_weights passes its meta-device model
            raise AssertionError("the weights were loaded before the settings were checked")
        return original(cls, path, **kwargs)

    monkeypatch.setattr(text, "_run", decode)
    monkeypatch.setattr(MaskedDiffusionLMPipeline, "__call__", decode)
    monkeypatch.setattr(MaskedDiffusionLMPipeline, "from_pretrained", classmethod(load))
    return calls


def refusal(argv: list[str], capsys) -> str:
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    err = [line for line in err if not line.startswith("Loading pipeline components")]
    assert len(err) == 1 and err[0].startswith("vispec: error:"), err
    return err[0]


@pytest.mark.parametrize("model, settings, words", [
    # the examples, self-speculation over the dual cache and on LLaDA2 (which may become legal), where they
    # stay refused: the dual cache on the block-causal LLaDA2 (its stepwise twin is named with the setting)
    ("tiny-llada2", "threshold,llada+ssd=4@dual",
     "--settings 'llada+ssd=4@dual' (its stepwise twin llada@dual) cannot run on tiny-llada2: cache='dual'"),
    ("tiny-llada2", "threshold,threshold+prophet", "--settings 'threshold+prophet' cannot run on tiny-llada2: early_commit"),
    # a later setting is refused before the first one runs
    ("tiny-llada2", "threshold,threshold@dual", "--settings 'threshold@dual' cannot run on tiny-llada2: cache='dual'"),
    # the twin is the one the model refuses: named with the setting the user typed
    ("tiny-llada2", "threshold,llada+eotp+ssd=2",
     "--settings 'llada+eotp+ssd=2' (its stepwise twin llada+eotp@none) cannot run on tiny-llada2: eotp"),
    # refused for every model: exact self-speculation cannot reproduce dKV-Cache's approximate run
    ("tiny-mdlm", "threshold,threshold+ssd@dkv", "--settings 'threshold+ssd@dkv' cannot run on tiny-mdlm: speculative"),
    ("tiny-mdlm-long", "threshold,learn2pd+adablock",
     "--settings 'learn2pd+adablock' cannot run on tiny-mdlm-long: adaptive_block cannot run with the learn2pd policy"),
])
def test_refused_before_any_row(model, settings, words, nothing_decodes, capsys):
    line = refusal(["bench", "text", "--model", model, "--settings", settings, "--tasks", "arithmetic",
                    "--num-problems", "1", "--quiet"], capsys)
    assert words in line
    assert nothing_decodes == []


def test_the_grid_is_checked_too(nothing_decodes, capsys):
    """Without --settings the strategies x caches grid runs; its refused cells are named by those flags."""
    line = refusal(["bench", "text", "--model", "tiny-llada2", "--strategies", "llada,threshold", "--tasks", "sort",
                    "--num-problems", "1", "--quiet"], capsys)
    assert "--strategies / --cache 'llada@dual' cannot run on tiny-llada2: cache='dual'" in line
    assert nothing_decodes == []


def test_what_runs_today_is_accepted():
    """Self-speculation over the dual cache runs on LLaDA-layout models now (it was refused when the issue was
    filed): every row of ``threshold,llada+ssd=4@dual`` passes the check; on LLaDA2 the prefix cache does."""
    pipe = MaskedDiffusionLMPipeline.from_pretrained_without_weights("tiny-mdlm")
    assert pipe is not None and pipe.model.device.type == "meta"
    cfg = TextBenchConfig(settings=("threshold", "llada+ssd=4@dual", "factor+eotp@dkv"), gen_length=32, block_length=8)
    rows = bench_rows(cfg, REFERENCE)
    assert list(rows) == [("threshold", (), "none", True, None), ("llada", (), "dual", True, None),
                          ("llada", ("ssd=4",), "dual", True, None), ("factor", ("eotp",), "dkv", True, None)]
    options = checked_rows(cfg, pipe, rows)
    assert options[("llada", ("ssd=4",), "dual", True, None)]["speculative"].draft_length == 4

    llada2 = MaskedDiffusionLMPipeline.from_pretrained_without_weights("tiny-llada2")
    cfg = TextBenchConfig(model="tiny-llada2", settings=("llada@prefix", "threshold"), gen_length=32, block_length=32)
    assert len(checked_rows(cfg, llada2, bench_rows(cfg, REFERENCE))) == 2
