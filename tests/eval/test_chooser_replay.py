"""samples/chooser_replay.py: the shape chooser's choices priced by a fixed cost table. Its argument errors, and one
image per contender on tiny-c2i: every auto pass is priced by the table, so its seconds are its passes' costs."""

import importlib.util
import json
import os
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "samples", "chooser_replay.py")


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("chooser_replay", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


@pytest.mark.parametrize("argv, words", [
    (["--images", "0"], "--images must be a positive integer, got 0"),
    (["--chains", "16,3"], "--chains must hold powers of two from 2 to 64, got [16, 3]"),
    (["--chains", "x"], "--chains must be a comma list of windows, got 'x'"),
    (["--sample-shrink", "0"], "--sample-shrink must be a positive number or inf, got 0.0"),
])
def test_bad_arguments_are_refused_naming_the_flag(script, capsys, argv, words):
    with pytest.raises(SystemExit) as info:
        script.parse_args(argv)
    assert info.value.code == 2 and words in capsys.readouterr().err


def test_a_cost_table_missing_a_label_is_refused(script, capsys, tmp_path):
    path = tmp_path / "costs.json"
    path.write_text(json.dumps({"ar": 4.0}))
    with pytest.raises(SystemExit):
        script.parse_args(["--costs", str(path)])
    assert "missing or not positive: ['chain:16'," in capsys.readouterr().err


def test_one_image_each_is_priced_by_the_table(script, tmp_path, monkeypatch):
    monkeypatch.setenv("VISPEC_CACHE_DIR", "off")
    costs = {label: 1.0 for label in script.TINY_C2I_B1_MS}  # every pass 1 ms: seconds are passes / 1000
    path = tmp_path / "costs.json"
    path.write_text(json.dumps(costs))
    report = script.main(["--images", "1", "--costs", str(path), "--json", str(tmp_path / "out.json")])
    auto, chain = report["rows"]["auto"], report["rows"]["mc-sjd:window=16"]
    assert auto["s_per_image"] == pytest.approx(sum(auto["shapes"].values()) / 1000)
    assert report["ar_s_per_image"] == pytest.approx(0.255)
    assert 0 < chain["s_per_image"] < 0.255  # fewer passes than AR's at the same price
    assert json.loads((tmp_path / "out.json").read_text())["rows"].keys() == report["rows"].keys()
