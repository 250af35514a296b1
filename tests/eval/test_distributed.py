"""Sharded, resumable evaluation: the unit split, the per-item result store, and resuming after a failure (one
process here; the multi-process runs are in ``test_distributed_jobs.py``)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from vispec.eval.bench.distributed import Workers, merge_records, run_units
from vispec.eval.bench.results import ResultStore, group_folder


@pytest.mark.parametrize("world", [1, 2, 3, 5])
@pytest.mark.parametrize("n, size", [(10, 3), (7, 7), (1, 4), (12, 4)])
def test_units_cover_every_item_once_and_do_not_depend_on_the_world_size(world, n, size):
    units = [u for rank in range(world) for u in Workers(rank, world, torch.device("cpu")).my_units(n, size)]
    assert sorted(i for u in units for i in u) == list(range(n))
    # the units themselves (the batches, and so every float in them) are the same for any world size
    assert sorted((u.start, u.stop) for u in units) == [(lo, min(lo + size, n)) for lo in range(0, n, size)]


def test_one_process_needs_no_process_group(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    workers = Workers.start("cpu")
    assert (workers.rank, workers.world_size, workers.is_main, workers.distributed) == (0, 1, True, False)
    assert workers.gather({"a": 1}) == [{"a": 1}] and workers.broadcast(3) == 3


@pytest.mark.parametrize("world, expected", [(None, 2), ("3", 2), ("1", 4)])
def test_a_world_size_other_than_asked_is_an_error_before_any_work(monkeypatch, world, expected):
    if world is None:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("WORLD_SIZE", world)
    with pytest.raises(ValueError, match=rf"num_processes is {expected} but .*torchrun --nproc_per_node {expected}"):
        Workers.start("cpu", expected=expected)


@pytest.mark.parametrize("kwargs, match", [
    ({"expected": 0}, "num_processes must be an integer >= 1"), ({"expected": "2"}, "num_processes must be an integer"),
    ({"device": "gpu"}, "device must be cpu, cuda"),
])
def test_workers_bad_input(monkeypatch, kwargs, match):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match=match):
        Workers.start(**{"device": "cpu", **kwargs})


def test_world_size_must_be_a_number(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(ValueError, match="WORLD_SIZE environment variable must be an integer"):
        Workers.start("cpu")


def test_store_round_trip_and_refuses_other_settings(tmp_path):
    store = ResultStore(str(tmp_path / "run"), {"model": "m", "seed": 0, "sizes": (1, 2)})
    record = {"nfe": 3, "tv": float("nan"), "text": "a b", "checks": {"colour": True, "count": None}}
    store.write("mc-sjd+lantern:k=10", 4, record, {"tokens": torch.arange(5), "features": torch.rand(3).double()})
    store.write("ar", 0, {"nfe": 1})
    got, tensors = store.read("mc-sjd+lantern:k=10", 4)
    assert got["nfe"] == 3 and got["text"] == "a b" and got["checks"] == {"colour": True, "count": None}
    assert got["tv"] != got["tv"]  # NaN survives
    assert torch.equal(tensors["tokens"], torch.arange(5)) and tensors["features"].dtype == torch.float64
    assert store.read("ar", 0) == ({"nfe": 1}, {})
    assert store.has("ar", 0) and not store.has("ar", 1) and store.has_all("ar", range(1)) and not store.has_all("ar", range(2))
    with pytest.raises(FileNotFoundError, match="item 1 of 'ar'"):
        store.read("ar", 1)
    assert not [name for _, _, files in os.walk(tmp_path) for name in files if ".tmp" in name]
    # the same settings (tuples read back as lists) reopen it; others are refused, naming what differs
    ResultStore(str(tmp_path / "run"), {"model": "m", "seed": 0, "sizes": [1, 2]})
    with pytest.raises(ValueError, match=r"other settings \(differing: batch, seed\)"):
        ResultStore(str(tmp_path / "run"), {"model": "m", "seed": 1, "sizes": [1, 2], "batch": 4})
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="must be a folder"):
        ResultStore(str(tmp_path / "file"), {})


def test_group_folders_are_safe_and_distinct():
    names = ["ar", "mc-sjd+lantern:k=100,delta=0.1", "mc-sjd+lantern:k=10,0delta=0.1", "arithmetic/llada@none/B1"]
    folders = [group_folder(n) for n in names]
    assert folders[0] == "ar" and len(set(folders)) == len(folders)
    assert all("/" not in f and ":" not in f and "+" not in f for f in folders)


def _compute_counting(calls: list, fail_at: int = -1):
    def compute(unit: range) -> dict:
        if unit.start == fail_at:
            raise RuntimeError("killed")
        calls.append(unit.start)
        return {i: ({"i": i, "unit": unit.start}, {"x": torch.full((2,), float(i))}) for i in unit}
    return compute


def test_a_rerun_after_a_failure_computes_only_the_missing_units_and_ends_the_same(tmp_path):
    one = Workers(0, 1, torch.device("cpu"))
    clean = run_units(one, 10, 3, _compute_counting([]), None, "g")
    store = ResultStore(str(tmp_path), {"k": 1})
    calls: list = []
    with pytest.raises(RuntimeError, match="killed"):
        run_units(one, 10, 3, _compute_counting(calls, fail_at=6), store, "g")
    assert calls == [0, 3] and store.has_all("g", range(6)) and not store.has("g", 6)
    before = {i: os.path.getmtime(tmp_path / "g" / f"{i:08d}.json") for i in range(6)}
    calls.clear()
    resumed = run_units(one, 10, 3, _compute_counting(calls), store, "g")
    assert calls == [6, 9]  # the stored units are not recomputed, nor rewritten
    assert before == {i: os.path.getmtime(tmp_path / "g" / f"{i:08d}.json") for i in range(6)}
    assert [r for r, _ in resumed] == [r for r, _ in clean]
    assert all(torch.equal(a["x"], b["x"]) for (_, a), (_, b) in zip(resumed, clean))


def test_a_compute_that_skips_items_is_a_bug_not_a_gap(tmp_path):
    one = Workers(0, 1, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="for the unit"):
        run_units(one, 4, 2, lambda unit: {unit.start: ({}, {})}, None, "g")


def test_merge_records_refuses_an_item_computed_twice():
    assert merge_records([{0: "a"}, {1: "b"}]) == {0: "a", 1: "b"}
    with pytest.raises(RuntimeError, match="computed by two processes"):
        merge_records([{0: "a"}, {0: "b"}])


def test_run_json_is_written_once_and_readable(tmp_path):
    ResultStore(str(tmp_path / "r"), {"a": (1, 2), "b": None})
    assert json.loads((tmp_path / "r" / "run.json").read_text()) == {"a": [1, 2], "b": None}


@pytest.mark.slow
def test_generate_image_resumes_only_with_the_same_settings(tmp_path, monkeypatch, capsys):
    from vispec.cli import main
    from vispec.pipelines import LlamaGenPipeline

    calls = []
    real = LlamaGenPipeline.__call__

    def counting(self, *args, **kwargs):
        calls.append(len(kwargs["generator"]))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(LlamaGenPipeline, "__call__", counting)
    out = tmp_path / "img" / "x.png"
    out.parent.mkdir()
    args = ["generate", "image", "--class", "all", "--num-images", "3", "--batch-size", "2", "--decoding", "mc-sjd",
            "--quiet", "--out", str(out)]
    assert main(args) == 0 and calls == [2, 1]
    first = {p.name: p.read_bytes() for p in out.parent.glob("x-*.png")}
    assert sorted(first) == ["x-0.png", "x-1.png", "x-2.png"] and (out.parent / "x.run.json").is_file()
    (out.parent / "x-1.png").unlink()  # a unit left unfinished
    calls.clear()
    assert main([*args, "--resume"]) == 0 and calls == [2]  # only the unit that is not complete, whole
    assert {p.name: p.read_bytes() for p in out.parent.glob("x-*.png")} == first
    calls.clear()
    assert main([*args, "--resume", "--seed", "5"]) == 2 and calls == []
    assert "holds results of other settings (differing: seed)" in capsys.readouterr().err
    assert main(args) == 0 and calls == [2, 1]  # without --resume: made anew
    (out.parent / "x.run.json").unlink()
    capsys.readouterr()
    assert main([*args, "--resume"]) == 2
    assert "but no" in capsys.readouterr().err
