"""Two-process gloo jobs on the CPU (``torchrun --standalone --nproc_per_node 2``) against one process: the same
tokens, images, FID and accuracy, bit for bit; and a job whose rank 1 is killed mid-run, rerun to the same end."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from vispec.cli import main

VISPEC = os.path.join(os.path.dirname(sys.executable), "vispec")
IMAGE_BENCH = ["bench", "image", "--model", "tiny-c2i", "--methods", "mc-sjd", "--num-images", "8", "--batch-size", "2",
               "--latency-images", "1", "--real-images", "8", "--noise-repeats", "1", "--quiet"]
QUALITY = ("fid", "accuracy", "nfe_batched")


def torchrun(args: list[str], tag: str = "", wait: bool = True):
    """``vispec args`` on two gloo processes; returns the finished process (or the running one, ``wait=False``)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "--no-python",
               VISPEC, *args, "--num-processes", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VISPEC_TEST_JOB": tag}
    env.pop("WORLD_SIZE", None)
    if not wait:
        return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def stored_tensors(folder: str) -> dict:
    return {os.path.relpath(path, folder): load_file(path) for path in glob.glob(os.path.join(folder, "*", "*.safetensors"))}


def assert_same_results(one: str, two: str, json_one: str, json_two: str) -> None:
    a, b = json.load(open(json_one)), json.load(open(json_two))
    assert b["config"]["num_processes"] == 2 and a["config"]["num_processes"] == 1
    for method, row in a["methods"].items():
        for key in QUALITY:
            assert row[key] == b["methods"][method][key], (method, key)  # bit for bit
    tensors_one, tensors_two = stored_tensors(one), stored_tensors(two)
    assert tensors_one.keys() == tensors_two.keys() and len(tensors_one) == 3 * 8  # ar, mc-sjd, ar-reseed-1
    for name, tensors in tensors_one.items():
        assert tensors.keys() == {"tokens", "fid_features"}
        assert all(torch.equal(tensors[k], tensors_two[name][k]) for k in tensors), name


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The image benchmark on one process, with its stored results."""
    folder = tmp_path_factory.mktemp("one")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each torchrun worker (OMP_NUM_THREADS=1): float reductions depend on the count
    try:
        assert main([*IMAGE_BENCH, "--results-dir", str(folder / "results"), "--json", str(folder / "bench.json")]) == 0
    finally:
        torch.set_num_threads(threads)
    return str(folder / "results"), str(folder / "bench.json")


def test_bench_image_on_two_processes_equals_one(one_process, tmp_path):
    torchrun([*IMAGE_BENCH, "--results-dir", str(tmp_path / "results"), "--json", str(tmp_path / "bench.json")])
    assert_same_results(*one_process[:1], str(tmp_path / "results"), one_process[1], str(tmp_path / "bench.json"))


def _pid_of_rank(tag: str, rank: int) -> int | None:
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as handle:
                env = handle.read().split(b"\0")
        except OSError:
            continue
        if f"VISPEC_TEST_JOB={tag}".encode() in env and f"RANK={rank}".encode() in env:
            return int(pid)
    return None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the rank's process through /proc")
def test_a_killed_rank_loses_only_its_unfinished_items_and_a_rerun_ends_the_same(one_process, tmp_path):
    results, tag = str(tmp_path / "results"), uuid.uuid4().hex
    args = [*IMAGE_BENCH, "--results-dir", results, "--json", str(tmp_path / "bench.json")]
    job = torchrun(args, tag, wait=False)
    first = os.path.join(results, "ar", "00000002.json")  # rank 1's first unit of the first method
    deadline = time.time() + 300
    while not os.path.exists(first) and time.time() < deadline and job.poll() is None:
        time.sleep(0.05)
    pid = _pid_of_rank(tag, 1)
    assert pid is not None and job.poll() is None, "rank 1 should be running"
    os.kill(pid, signal.SIGKILL)
    output, _ = job.communicate(timeout=300)
    assert job.returncode != 0, output[-2000:]
    kept = {path: os.path.getmtime(path) for path in glob.glob(os.path.join(results, "*", "*.json"))}
    assert 0 < len(kept) < 3 * 8, "the run should stop part way, keeping what was finished"
    assert not os.path.exists(tmp_path / "bench.json") or not json.load(open(tmp_path / "bench.json")).get("complete", True)

    torchrun(args)
    assert all(os.path.getmtime(path) == mtime for path, mtime in kept.items()), "finished items are not redone"
    assert_same_results(one_process[0], results, one_process[1], str(tmp_path / "bench.json"))


def test_bench_text_on_two_processes_equals_one(tmp_path):
    """Without --results-dir the per-problem results travel to rank 0 by gather_object (the image test above goes
    through the store)."""
    args = ["bench", "text", "--model", "tiny-mdlm", "--settings", "threshold@dual,factor+eotp", "--tasks",
            "arithmetic,reverse", "--num-problems", "5", "--batch-size", "2"]
    assert main([*args, "--json", str(tmp_path / "one.json")]) == 0
    torchrun([*args, "--json", str(tmp_path / "two.json")])
    a, b = json.load(open(tmp_path / "one.json")), json.load(open(tmp_path / "two.json"))
    assert len(a["runs"]) == len(b["runs"]) == 2 * 2 * 2 and b["config"]["num_processes"] == 2
    keys = ("task", "strategy", "rules", "cache", "batch_size", "nfe", "tokens", "strict_match", "flexible_extract",
            "exact_match")
    assert [{k: r[k] for k in keys if k in r} for r in a["runs"]] == [{k: r[k] for k in keys if k in r} for r in b["runs"]]


def test_generate_on_two_processes_equals_one(tmp_path):
    image = ["generate", "image", "--model", "tiny-c2i", "--class", "all", "--num-images", "5", "--batch-size", "2",
             "--decoding", "mc-sjd", "--quiet"]
    os.makedirs(tmp_path / "one")
    assert main([*image, "--out", str(tmp_path / "one" / "x.png"), "--npz", str(tmp_path / "one.npz")]) == 0
    os.makedirs(tmp_path / "two")
    torchrun([*image, "--out", str(tmp_path / "two" / "x.png"), "--npz", str(tmp_path / "two.npz")])
    a, b = np.load(tmp_path / "one.npz")["arr_0"], np.load(tmp_path / "two.npz")["arr_0"]
    assert a.shape == (5, 64, 64, 3) and np.array_equal(a, b)

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("sort the numbers : 5 3 9 3 1\nreverse the letters : k d m a\n\nsort the numbers : 8 1 4\n"
                       "reverse the letters : q w e\nsort the numbers : 1 2 0\n")
    text = ["generate", "text", "--model", "tiny-mdlm", "--prompts-file", str(prompts), "--batch-size", "2",
            "--temperature", "0.7", "--quiet"]
    assert main([*text, "--out", str(tmp_path / "one.jsonl")]) == 0
    torchrun([*text, "--out", str(tmp_path / "two.jsonl")])
    lines = (tmp_path / "one.jsonl").read_text().splitlines()
    assert len(lines) == 5 and [json.loads(line)["index"] for line in lines] == list(range(5))
    assert (tmp_path / "one.jsonl").read_text() == (tmp_path / "two.jsonl").read_text()
