"""Tokens committed per verification pass in ``vispec bench image`` and ``vispec bench decoders``: the per-method
histogram (``commits_per_pass``), its log2 bins and table, the ``1-token`` column derived from it, the plot."""

from __future__ import annotations

import json
import math

import torch
from PIL import Image

from vispec.cli import main
from vispec.eval.bench import commits, decoders, image

SMALL = ["--model", "GPT-mini", "--vocab-size", "64", "--image-tokens", "16", "--num-classes", "4", "--num-images", "2",
         "--window", "4", "--init-std", "0.3"]


def test_histogram_aggregates_samples_and_decodes_of_any_width():
    ar = torch.zeros(3, 3, dtype=torch.long)
    ar[:, 1] = 255  # AR: every pass after the prefill commits one token
    assert commits.histogram(ar) == [0, 765]
    sjd = torch.tensor([[0, 2, 1, 0, 0, 0], [0, 1, 0, 1, 0, 0]])  # N = 1 + 2 + 2 = 5 and 1 + 1 + 3 = 5
    assert commits.histogram(sjd) == [0, 3, 1, 1]
    assert commits.histogram([0, 4, 0, 0]) == [0, 4]  # one sample's list
    assert commits.merge([commits.histogram(ar), None, commits.histogram(sjd), []]) == [0, 768, 1, 1]
    assert commits.merge([[0, 0]]) == []
    hist = [0, 3, 1, 1]
    assert commits.passes(hist) == 5 and commits.share(hist, 1) == 0.6 and commits.share(hist, 9) == 0.0
    assert commits.mean_per_pass(hist) == (3 + 2 + 3) / 5 and commits.mean_per_pass([0, 765]) == 1.0
    assert math.isnan(commits.share([])) and math.isnan(commits.mean_per_pass([0]))


def test_log2_bins():
    edges = {1: "1", 2: "2", 3: "3-4", 4: "3-4", 5: "5-8", 8: "5-8", 9: "9-16", 16: "9-16", 17: "17-32", 32: "17-32",
             33: "33-64", 64: "33-64", 65: ">64", 256: ">64"}
    for k, label in edges.items():
        assert commits.BIN_LABELS[commits.bin_of(k)] == label, k
    hist = [0] * 101
    hist[1], hist[2], hist[3], hist[4], hist[7], hist[100] = 10, 5, 1, 2, 3, 4
    assert commits.binned(hist) == [10, 5, 3, 3, 0, 0, 0, 4]


def _methods_result() -> dict:
    return {"methods": {"ar": {commits.KEY: [0, 30]}, "sjd-pac": {commits.KEY: [0, 6, 2, 0, 1, 0, 0, 0, 0, 0, 1]},
                        "ar-reseed-1": {"fid": 1.0}}}


def test_table_shows_the_reached_bins_and_the_mean():
    table = commits.format_commits_table(_methods_result())
    lines = table.splitlines()
    header = lines[1].split()
    assert header == ["method", "passes", "1", "2", "3-4", "9-16", "mean"]  # 5-8 and above 16: no method reaches them
    ar, pac = lines[3].split(), lines[4].split()
    assert ar == ["ar", "30", "100.0%", "0.0%", "0.0%", "0.0%", "1.00"]
    assert pac == ["sjd-pac", "10", "60.0%", "20.0%", "10.0%", "10.0%", f"{(6 + 4 + 4 + 10) / 10:.2f}"]
    assert "ar-reseed-1" not in table
    assert commits.format_commits_table({"methods": {"ar": {"nfe": 3}}}) == ""


def test_a_decoder_sweep_merges_a_methods_rows():
    result = {"rows": [{"method": "ar", commits.KEY: [0, 3]}, {"method": "sjd", commits.KEY: [0, 1, 1]},
                       {"method": "ar", commits.KEY: [0, 3]}, {"method": "sjd", commits.KEY: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1]}]}
    assert commits.method_histograms(result) == {"ar": [0, 6], "sjd": [0, 1, 1, 0, 0, 0, 0, 0, 0, 0, 1]}


def test_bench_decoders_keeps_the_histogram_and_derives_one_token_passes(tmp_path, capsys):
    """Every decoder's ``stats.commits`` summed over the images: sum_k k * hist[k] = images x (N - 1), AR's all at k = 1;
    the ``1-token`` column is hist[1] / passes, and the second table follows the first."""
    path = tmp_path / "bench.json"
    assert main(["bench", "decoders", *SMALL, "--methods", "mc-sjd-gumbel,sjd-pac", "--batch-size", "2", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "tokens committed per verification pass" in out and out.index("1-token") < out.index("tokens committed per")
    result = json.loads(path.read_text())
    for name, row in result["methods"].items():
        hist = row[commits.KEY]
        assert hist[0] == 0 and hist[-1] > 0
        assert sum(k * c for k, c in enumerate(hist)) == 2 * 15, name
        assert sum(hist) == round(2 * (row["nfe"] - 1)), name
        assert row["single_token_passes"] == hist[1] / sum(hist)
    assert result["methods"]["ar"][commits.KEY] == [0, 30] and result["methods"]["ar"]["single_token_passes"] == 1.0


def test_decoders_table_appends_the_histogram_table():
    row = dict(nfe=4.0, accepted_per_forward=1.0, step_compression=1.0, single_token_passes=0.5, latency_s=0.1, speedup=1.0,
               images_per_s=1.0, peak_mem_mb=1.0)
    result = {"methods": {"ar": {**row, commits.KEY: [0, 3]}, "sjd": {**row, commits.KEY: [0, 1, 0, 0, 0, 0, 1]}}}
    table = decoders.format_table(result)
    assert "1-token" in table and "5-8" in table and "3-4" not in table and table.index("1-token") < table.index("5-8")
    assert "tokens committed" not in decoders.format_table({"methods": {"ar": row}})  # results without histograms


def test_image_bench_takes_the_histogram_from_every_images_stats():
    """Per-image ``commits`` (a tensor or a list) are kept as trimmed lists; the ``1-token`` share comes from them, AR
    included; images without them fall back to ``single_passes`` (test_bench_output)."""
    assert image._json_stats({"nfe": 3, "commits": torch.tensor([0, 2, 0, 0])}) == {"nfe": 3, "commits": [0, 2]}
    stats = [{"nfe": 3, "commits": [0, 2], "single_passes": 0}, {"nfe": 3, "commits": [0, 0, 1, 0, 0, 0, 0, 0, 0, 1]}]
    assert image.commits_histogram(stats) == [0, 2, 1, 0, 0, 0, 0, 0, 0, 1]
    assert image.single_token_share(stats) == 0.5  # from the histogram, not single_passes
    assert image.single_token_share([{"nfe": 17, "commits": [0, 16]}]) == 1.0
    assert image.commits_histogram([{"nfe": 3, "commits": [0, 2]}, {"nfe": 3}]) is None


def _image_result() -> dict:
    """A class-to-image result as ``run_image_bench`` returns it (sjd-pac: 100 passes of 1, 50 of 2, 100 of 66 tokens)."""
    row = dict(nfe=256.0, step_compression=1.0, single_token_passes=1.0, latency_s=1.0, speedup=1.0, speedup_vs_compression=1.0,
               images_per_s=1.0, speedup_batched=1.0, accuracy=0.5, fid=40.0, fid_z=0.0, peak_mem_mb=100.0)
    return {
        "config": {},
        "methods": {"ar": {**row, commits.KEY: [0, 1020]},
                    "sjd-pac": {**row, "nfe": 66.0, "step_compression": 3.9, "fid": 42.0, "single_token_passes": 0.4,
                                commits.KEY: [0, 100, 50] + [0] * 63 + [100]},
                    "ar-reseed-1": {"accuracy": 0.5, "fid": 41.0, "images_per_s": 1.0, "peak_mem_mb": 100.0}},
        "noise": {"ar_runs": 2, "fid_mean": 40.5, "fid_sd": 0.7, "fid_interval": 9.0, "accuracy_mean": 0.5, "accuracy_sd": 0.0,
                  "accuracy_interval": 0.0},
        "real": {"accuracy": 0.9, "fid_real_vs_real": 30.0},
    }


def test_image_table_appends_the_histogram_table():
    table = image.format_image_table(_image_result())
    main_table, _, histogram_table = table.partition("tokens committed per verification pass")
    assert "1-tok" in main_table and "FID real vs real" in main_table
    header = histogram_table.splitlines()[1].split()
    assert header == ["method", "passes", "1", "2", ">64", "mean"]
    assert histogram_table.splitlines()[4].split()[:5] == ["sjd-pac", "250", "40.0%", "20.0%", "40.0%"]


def test_commits_plot_writes_a_png_of_the_requested_size_next_to_the_plot(tmp_path):
    result = _image_result()
    path = commits.draw_commits_plot(result, str(tmp_path / "h.png"), size=(640, 400))
    with Image.open(path) as png:
        assert png.format == "PNG" and png.size == (640, 400)
    assert commits.commits_plot_path(str(tmp_path / "run.png")) == str(tmp_path / "run.commits.png")
    written = decoders.commits_plot({"rows": [{"method": "ar", commits.KEY: [0, 3]}]}, str(tmp_path / "d.png"), (300, 200))
    assert written == str(tmp_path / "d.commits.png")
    with Image.open(written) as png:
        assert png.size == (300, 200)
    # --plot PATH of bench image: the speed/FID plot at PATH and the histogram at <PATH stem>.commits.png
    assert image.speed_fid_plot(result, str(tmp_path / "speed.png"), size=(500, 300)) == str(tmp_path / "speed.png")
    for name in ("speed.png", "speed.commits.png"):
        with Image.open(tmp_path / name) as png:
            assert png.size == (500, 300)
    stripped = {**result, "methods": {k: {m: v for m, v in r.items() if m != commits.KEY} for k, r in result["methods"].items()}}
    image.speed_fid_plot(stripped, str(tmp_path / "old.png"))  # a result without histograms: the speed/FID plot only
    assert (tmp_path / "old.png").exists() and not (tmp_path / "old.commits.png").exists()


def test_speed_fid_plot_joins_each_family_of_relaxed_rules(tmp_path):
    assert [image.method_family(m) for m in ("mc-sjd", "mc-sjd+budget:delta=0.1", "sjd+budget:delta=0.2,decay=0.8",
                                             "mc-sjd+budget:delta=0.1,neighbors=50", "mc-sjd+lantern:k=100,delta=0.1",
                                             "mc-sjd+lantern:k=10,delta=2", "gsd", "sjd+lumina")] == [
        "exact", "budget", "budget, annealed", "budget, neighbours", "LANTERN", "LANTERN++ (ratio)", "GSD", "lumina"]
    result = _image_result()
    for k, (name, x, fid) in enumerate([("mc-sjd+budget:delta=0.05", 3.9, 2.6), ("mc-sjd+budget:delta=0.2", 5.0, 3.1),
                                        ("mc-sjd+lantern:k=100,delta=0.1", 6.1, 30.0)]):
        result["methods"][name] = {"step_compression": x, "fid": fid}
    path = image.speed_fid_plot(result, str(tmp_path / "curve.png"), size=(600, 400), commits=False)
    with Image.open(path) as png:  # FID spans more than 3x: a log axis; the drawing itself is checked by eye
        assert png.size == (600, 400)


def test_budget_table_prints_the_requested_budget_next_to_the_measured_tv():
    result = {"methods": {"ar": {"fid": 2.5},
                          "mc-sjd-maximal+budget:delta=0.2,ratio=2": {"tv_mean": 0.03, "tv_max": 0.2, "tv_bound": 28.3,
                                                                      "tv_budget": 50.9, "budget_binding": 0.1}}}
    table = image.format_budget_table(result)
    row = table.splitlines()[2].split()
    assert row == ["mc-sjd-maximal+budget:delta=0.2,ratio=2", "0.200", "0.0300", "0.2000", "yes", "28.30", "50.90", "10.0%"]
    result["methods"]["mc-sjd-maximal+budget:delta=0.2,ratio=2"]["tv_max"] = 0.25
    assert " NO " in image.format_budget_table(result)
    assert image.format_budget_table({"methods": {"ar": {}}}) == ""
