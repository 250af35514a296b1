"""The command line's errors (issue 13, items 8 and 10): output paths checked before any work, a model of the
wrong kind named as such, every user error one line on stderr with status 2, real bugs still a traceback."""

from __future__ import annotations

import pytest

import vispec.cli as cli
from vispec.cli import main


def one_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("vispec: error:"), err
    return err[0]


@pytest.fixture
def no_work(monkeypatch):
    """Loading a pipeline or running a benchmark or trainer fails the test: the checks must come first."""
    from vispec.eval import demo
    from vispec.eval.bench import decoders, image, kernels, text
    from vispec.pipelines import LlamaGenPipeline, MaskedDiffusionLMPipeline

    def refuse(*args, **kwargs):
        raise AssertionError("work started before the arguments were checked")

    for cls in (LlamaGenPipeline, MaskedDiffusionLMPipeline):
        monkeypatch.setattr(cls, "from_pretrained", refuse)
    for module, name in ((decoders, "run_decoder_bench"), (image, "run_image_bench"), (text, "run_text_bench"),
                         (kernels, "run_kernel_bench"), (demo, "run_demo")):
        monkeypatch.setattr(module, name, refuse)
    monkeypatch.setattr("vispec.models.llamagen_checkpoint.read_checkpoint", refuse)


@pytest.mark.parametrize("argv,words", [
    (["generate", "image", "--class", "1", "--out", "DIR"], "--out 'DIR' is a folder; expected a file name"),
    (["generate", "image", "--class", "1", "--out", "DIR/file.txt/cat.png"], "DIR/file.txt is a file, so the folder"),
    (["generate", "image", "--class", "1", "--out", "DIR/cat"], "does not end in an image extension"),
    (["generate", "image", "--class", "1", "--out", "DIR/cat.json"], "does not end in an image extension"),
    (["generate", "image", "--class", "1", "--num-images", "4", "--batch-size", "0"], "--batch-size must be >= 1"),
    (["bench", "image", "--json", "DIR"], "--json 'DIR' is a folder"),
    (["bench", "image", "--json", "DIR/r.json", "--plot", "DIR/plot.txt"], "--plot 'DIR/plot.txt' does not end in an image"),
    (["bench", "image", "--json", "DIR/r"], "--plot (from --json) 'DIR/r.png'"),  # the default plot is fine: only --json lacks an ext
    (["bench", "decoders", "--json", "DIR"], "--json 'DIR' is a folder"),
    (["bench", "decoders", "--json", "DIR/file.txt/r.json"], "DIR/file.txt is a file, so the folder"),
    (["bench", "text", "--json", "DIR"], "--json 'DIR' is a folder"),
    (["bench", "kernels", "--json", "DIR"], "--json 'DIR' is a folder"),
    (["demo", "--out", "DIR/file.txt"], "--out 'DIR/file.txt' is a file; expected a folder"),
    (["convert", "llamagen", "--gpt", "x.pt", "--vq", "y.pt", "--out", "DIR/file.txt"], "is a file; expected a folder"),
    (["train", "vq", "--out", "DIR/file.txt"], "is a file; expected a folder"),
])
def test_output_paths_are_checked_before_any_work(tmp_path, capsys, no_work, argv, words):
    (tmp_path / "file.txt").write_text("x")
    argv = [a.replace("DIR", str(tmp_path)) for a in argv]
    if "--plot (from --json)" in words:
        (tmp_path / "r.png").mkdir()  # the plot's default path is a folder: found before the run, not after it
        words = f"--plot (from --json) '{tmp_path}/r.png' is a folder"
    assert main(argv) == 2
    assert words.replace("DIR", str(tmp_path)) in one_line(capsys)


@pytest.mark.parametrize("argv,words", [
    (["generate", "image", "--model", "tiny-mdlm", "--class", "1"], "holds a MaskedDiffusionLMPipeline (model_index.json), "
                                                                      "not a LlamaGenPipeline: use `vispec generate text`"),
    (["generate", "text", "--model", "tiny-c2i", "--prompt", "x"], "not a MaskedDiffusionLMPipeline: use `vispec generate image`"),
    (["bench", "image", "--model", "tiny-mdlm"], "not a LlamaGenPipeline: a text model: use `vispec bench text`"),
    (["bench", "text", "--model", "tiny-c2i"], "not a MaskedDiffusionLMPipeline: an image model: use `vispec bench image`"),
])
def test_a_model_of_the_wrong_kind_is_named(capsys, monkeypatch, argv, words):
    from vispec.pipelines import LlamaGenPipeline, MaskedDiffusionLMPipeline

    def refuse(*args, **kwargs):
        raise AssertionError("the pipeline was loaded before its kind was checked")

    for cls in (LlamaGenPipeline, MaskedDiffusionLMPipeline):
        monkeypatch.setattr(cls, "from_pretrained", refuse)
    assert main(argv) == 2
    line = one_line(capsys)
    assert words in line and "set()" not in line


@pytest.mark.parametrize("argv,words", [
    (["bench", "image", "--lantern-k", "abc"], "--lantern-k must be a comma-separated list of integers, got 'abc'"),
    (["bench", "image", "--lantern-delta", "0.1,x"], "--lantern-delta must be a comma-separated list of numbers"),
    (["bench", "image", "--batch-sizes", "1,a"], "--batch-sizes must be a comma-separated list of integers"),
    (["bench", "image", "--num-images", "1"], "num_images must be >= 2 (FID needs at least two images)"),
    (["bench", "image", "--batch-sizes", "4,0"], "batch_sizes must be integers >= 1"),
    (["bench", "image", "--rounds", "0"], "rounds must be >= 1"),
    (["generate", "image", "--class", "1", "--max-batch-size", "abc"], "argument --max-batch-size: invalid int value: 'abc'"),
    (["generate", "image", "--class", "one"], "--class must be a class id or 'all', got 'one'"),
    (["generate", "image"], "tiny-c2i is a class-conditional pipeline: pass --class"),
    (["generate", "image", "--class", "1", "--windw", "4"], "unrecognized arguments: --windw 4"),
    (["generate", "text", "--prompt", "x", "--steps", "0"], "--steps must be >= 1"),
    (["bench", "warp"], "invalid choice: 'warp'"),
    (["bench", "decoders", "--device", "gpu"], "device must be cpu, cuda or cuda:N (a torch device), got 'gpu'"),
    (["bench", "text", "--cache", "paged"], "unknown cache 'paged'"),
    (["bench", "kernels", "--device", "tpu"], "device must be cpu, cuda or cuda:N"),
])
def test_bad_flag_values_are_one_line(capsys, no_work, argv, words):
    assert main(argv) == 2
    line = one_line(capsys)
    assert words in line
    if "argument" in words or "required" in words or "unrecognized" in words:  # argparse's errors name the --help to read
        assert "--help`" in line


def _command(monkeypatch, error: BaseException):
    """``vispec demo`` replaced by a command that raises ``error``."""
    def run(out_dir):
        raise error

    monkeypatch.setattr("vispec.eval.demo.run_demo", run)


def test_user_errors_are_one_line_and_bugs_keep_their_traceback(tmp_path, capsys, monkeypatch):
    argv = ["demo", "--out", str(tmp_path / "demo")]
    _command(monkeypatch, ValueError("window must be >= 1,\n  got 0"))  # raised on purpose: one line, newlines folded
    assert main(argv) == 2
    assert one_line(capsys) == "vispec: error: window must be >= 1, got 0"
    _command(monkeypatch, PermissionError(13, "Permission denied", "x.json"))
    assert main(argv) == 2
    assert "Permission denied" in one_line(capsys)

    def unpack(out_dir):  # an implicit ValueError from the interpreter is a bug: its traceback is kept
        a, b = (1, 2, 3)

    monkeypatch.setattr("vispec.eval.demo.run_demo", unpack)
    with pytest.raises(ValueError, match="too many values to unpack"):
        main(argv)
    for bug in (KeyError("0"), TypeError("can only concatenate str (not \"int\") to str"), IndexError("index 5")):
        _command(monkeypatch, bug)
        with pytest.raises(type(bug)):
            main(argv)
    _command(monkeypatch, ValueError("anything"))
    monkeypatch.setenv("VISPEC_TRACEBACK", "1")  # every error with its traceback, for debugging
    with pytest.raises(ValueError):
        main(argv)


def test_ctrl_c_is_one_line_with_status_130(tmp_path, capsys, monkeypatch):
    _command(monkeypatch, KeyboardInterrupt())
    assert main(["demo", "--out", str(tmp_path / "demo")]) == 130
    assert capsys.readouterr().err.strip() == "vispec: interrupted"


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("bench", ["decoders", "image", "text"])
def test_cuda_without_cuda_is_a_user_error(capsys, no_work, bench):
    assert main(["bench", bench, "--device", "cuda"]) == 2
    assert "device='cuda' but CUDA is not available here" in one_line(capsys)


def test_user_error_classification():
    assert cli.is_user_error(cli.UsageError("x")) and cli.is_user_error(FileNotFoundError("x"))
    assert not cli.is_user_error(RuntimeError("x")) and not cli.is_user_error(KeyError("x"))
