"""``vispec demo``: decode with AR, SJD and MC-SJD and write a comparison report.

Until the embedded trained models exist, the demo runs on a randomly initialised GPT-mini at
LlamaGen's init scale. Such a model barely conditions on context, so Jacobi drafts sampled from the
previous pass's distributions are accepted unusually often: the step compression shown here says
that the decoders work end to end, not what a trained model will get.
"""

from __future__ import annotations

import json
import os

from vispec.eval.bench_decoders import ALL_METHODS, DecoderBenchConfig, format_table, run_decoder_bench

DEMO_CONFIG = DecoderBenchConfig(
    model="GPT-mini", vocab_size=1024, image_tokens=256, num_classes=10, init_std=0.02,
    methods=ALL_METHODS, window=16, num_images=2, batch_size=1, guidance_scale=2.0, seed=0,
)


def run_demo(out_dir: str = "out/demo") -> dict:
    print("vispec demo: AR vs SJD vs MC-SJD on a randomly initialised LlamaGen GPT-mini (256 tokens, CFG 2.0)")
    result = run_decoder_bench(DEMO_CONFIG, progress=lambda msg: print("  " + msg, flush=True))
    table = format_table(result)
    print(table)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "report.json"), "w") as handle:
        json.dump(result, handle, indent=2)
    with open(os.path.join(out_dir, "report.md"), "w") as handle:
        handle.write("# vispec demo: decoders on a random-init GPT-mini\n\n")
        handle.write((__doc__ or "").split("\n\n", 1)[1].strip() + "\n\n```\n" + table + "\n```\n")
    print(f"report: {out_dir}/report.md, {out_dir}/report.json")
    return result
