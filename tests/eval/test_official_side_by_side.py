"""The argument errors of samples/official_side_by_side.py, checked in-process through its ``parse_args`` (no model,
no official LlamaGen code: a fake checkout with empty files stands in for it)."""

import importlib.util
import os
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "samples", "official_side_by_side.py")


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("official_side_by_side", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


@pytest.fixture
def fake_checkout(tmp_path):
    folder = tmp_path / "llamagen"
    (folder / "autoregressive" / "models").mkdir(parents=True)
    for name in ("generate.py", "gpt.py"):
        (folder / "autoregressive" / "models" / name).write_text("")
    return str(folder)


def usage_error(script, capsys, argv) -> str:
    with pytest.raises(SystemExit) as info:
        script.parse_args(argv)
    assert info.value.code == 2
    return capsys.readouterr().err


def test_missing_official(script, capsys):
    err = usage_error(script, capsys, ["--batch-sizes", "1"])
    assert "--official" in err and "required" in err


def test_official_path_without_llamagen_files(script, capsys, tmp_path):
    err = usage_error(script, capsys, ["--official", str(tmp_path)])
    assert "--official" in err and "autoregressive/models/generate.py" in err
    err = usage_error(script, capsys, ["--official", str(tmp_path / "nowhere")])
    assert "--official" in err and "no such directory" in err


def test_unknown_contender_suffix(script, capsys, fake_checkout):
    err = usage_error(script, capsys, ["--official", fake_checkout, "--contenders", "official-compiled,ar-fast"])
    assert "--contenders" in err and "'ar-fast'" in err and "-eager or -compiled" in err
    err = usage_error(script, capsys, ["--official", fake_checkout, "--contenders", "official-jit-compiled"])
    assert "official-eager and official-compiled" in err


def test_valid_arguments(script, fake_checkout):
    args = script.parse_args(["--official", fake_checkout, "--batch-sizes", "1,4", "--contenders",
                              "official-eager,sjd-pac:window=16,tree_width=2,tree_depth=2-compiled,auto-eager"])
    assert args.batch_sizes == [1, 4] and args.models == ["tiny-c2i"]
    official, pac, auto = args.contenders
    assert official.official and not official.compiled
    assert pac.spec == "sjd-pac:window=16,tree_width=2,tree_depth=2" and pac.compiled and not pac.official
    assert auto.spec == "auto" and not auto.compiled  # specs are checked when the run starts, not here
    assert args.dtype == "float32"


def test_dtype(script, capsys, fake_checkout):
    assert script.parse_args(["--official", fake_checkout, "--dtype", "bfloat16"]).dtype == "bfloat16"
    err = usage_error(script, capsys, ["--official", fake_checkout, "--dtype", "bf16"])
    assert "--dtype" in err and "'bf16'" in err and "bfloat16" in err
