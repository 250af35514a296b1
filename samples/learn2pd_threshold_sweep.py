"""τ sweep for Learn2PD + EoTP (+ DualCache) on tiny-mdlm-long, on held-out *training* prompts (train stream,
seed 7; the filter was fitted on seed 0's first 32 per task), so the test split stays untouched: accuracy,
agreement with LLaDA's baseline answer (one token per step, no cache, no early stop), and NFE. Batches of 40
(a row decodes as it does alone).

Usage: python samples/learn2pd_threshold_sweep.py N TAU[,TAU...] [SPLIT [TASK,...]]
e.g.   OMP_NUM_THREADS=2 python samples/learn2pd_threshold_sweep.py 80 0.96,0.999,0.9999,0.99999,0.999999
SPLIT ``test`` runs the first N test problems instead (the bench's problems; for the final check of one τ).
"""
import sys, json, torch
from vispec.pipelines import MaskedDiffusionLMPipeline
from vispec.eval.bench.text_tasks import get_task, split_items
from vispec.dllm import make_scheduler
torch.set_num_threads(int(__import__("os").environ.get("OMP_NUM_THREADS", "2")))
pipe = MaskedDiffusionLMPipeline.from_pretrained("vispec/tiny-mdlm-long"); pipe.set_progress_bar_config(disable=True)
N = int(sys.argv[1]); taus = [float(t) for t in sys.argv[2].split(",")]
split = sys.argv[3] if len(sys.argv) > 3 else "train"
tasks = sys.argv[4].split(",") if len(sys.argv) > 4 else ["arithmetic", "sort", "reverse"]
out = {}
for name in tasks:
    task = get_task(name); items = split_items(task, split, N, seed=7 if split == "train" else 0)
    prompts = [i.prompt for i in items]
    def run(strategy, **kw):
        texts, nfe = [], []
        for lo in range(0, N, 40):
            o = pipe(prompt=prompts[lo:lo+40], strategy=strategy, gen_length=256, block_length=32, **kw)
            texts += o.texts; nfe += [s["nfe"] for s in o.stats]
        acc = sum(list(task.score(t, it).values())[0] for t, it in zip(texts, items)) / N
        return texts, acc, sum(nfe) / N
    ref, ref_acc, _ = run("llada", early_stop_eos=False)
    print(name, "reference", ref_acc, flush=True)
    for tau in taus:
        texts, acc, nfe = run(make_scheduler("learn2pd", threshold=tau), eotp=True, cache="dual")
        agree = sum(a == b for a, b in zip(texts, ref)) / N
        print(name, tau, "acc", acc, "agree", agree, "nfe", round(nfe, 2), flush=True)
