"""Step compression of SJD / MC-SJD on tiny random unified-token models (transformers Chameleon, end-of-row token
forced every row, CFG from image start). Run from the repository root: python samples/unified_step_compression.py"""
import sys, torch
sys.path.insert(0, "tests")  # the tiny model builders of the test suite
torch.set_num_threads(1)
from unified_helpers import tiny_unified, PROMPTS
from vispec.decoding import decode
from vispec.sampling import SamplingConfig
for rows, cols in ((3, 4), (4, 8)):
    model = tiny_unified(rows=rows, cols=cols)
    n = 48
    cond = model.condition([PROMPTS[i % 3] for i in range(n)])
    for label, sampling in (("T=1 top-k 8 cfg 3", SamplingConfig(temperature=1.0, top_k=8, guidance_scale=3.0)),
                            ("greedy cfg 3", SamplingConfig(temperature=0.0, guidance_scale=3.0))):
        row = []
        for spec in ("ar", "sjd", "mc-sjd", "mc-sjd:window=4"):
            out = decode(model, cond, num_tokens=model.num_image_tokens, sampling=sampling, decoding=spec,
                         generator=[torch.Generator().manual_seed(i) for i in range(n)])
            row.append(f"{spec} NFE {out.stats.nfe.float().mean():.2f} tok/fwd {out.stats.tokens_per_forward.mean():.2f}")
        print(f"{rows}x{cols} (+EOL, {model.num_image_tokens} tokens) {label}: " + " | ".join(row), flush=True)
