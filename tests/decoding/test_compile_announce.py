"""A first ``compile=True`` call says on stderr what it is compiling, once per step and shape in a process, before the
compile starts (issue 47 item 29: the first SJD-PAC call compiled for minutes with no output). ``torch.compile`` is
replaced by the identity here: what is tested is the announcement, not inductor."""

from __future__ import annotations

import torch
from helpers import tree_decode, tree_gpt

from vispec.decoding import compiled


def test_the_first_compiled_sjd_pac_call_announces_each_step_once(monkeypatch, capsys):
    monkeypatch.setattr(torch, "compile", lambda step, **_: step)
    monkeypatch.setattr(compiled, "_graphs", {})
    monkeypatch.setattr(compiled, "_announced", set())
    model = tree_gpt()
    tree_decode(model, "sjd-pac:window=6,tree_width=2,tree_depth=2", compile=True)
    first = capsys.readouterr().err
    assert first.count("vispec: compiling the SJD-PAC step") == 1, first
    tree_decode(model, "sjd-pac:window=6,tree_width=2,tree_depth=2", compile=True)
    assert "vispec: compiling" not in capsys.readouterr().err


def test_eager_calls_announce_nothing(capsys):
    tree_decode(tree_gpt(), "sjd-pac:window=6,tree_width=2,tree_depth=2")
    assert "vispec: compiling" not in capsys.readouterr().err
