"""Call paths of one request (issue 26): frames from LlamaGenPipeline.__call__ and from sjd_step to the accept
operation (reference backend), and the project files one image request, one SJD step, one text request and one text
step run code in. Usage: python samples/call_paths.py [repository root]."""
import os, sys, inspect, json
os.environ.setdefault("VISPEC_KERNELS", "reference")
import torch
ROOT = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else ".")

def ours(fn):
    if fn.startswith("<"): return False
    fn = os.path.abspath(fn)
    return fn.startswith(ROOT) and "/.venv/" not in fn and "/tests/" not in fn

def trace_files(fn):
    files, lines = set(), {}
    def prof(frame, event, arg):
        if event == "call" and ours(frame.f_code.co_filename):
            files.add(os.path.relpath(frame.f_code.co_filename, ROOT))
    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return sorted(files)

def nlines(files):
    return sum(sum(1 for _ in open(os.path.join(ROOT, f))) for f in files)

import vispec.kernels.verify as V
stacks = []
orig = V.accept_reference
def spy(*a, **k):
    st = [f for f in inspect.stack()[1:] if ours(f.filename)]
    stacks.append([(os.path.relpath(f.filename, ROOT), f.function) for f in st])
    return orig(*a, **k)
V.accept_reference = spy
import vispec.kernels.target as T
if hasattr(T, "verify"):
    pass

from vispec.pipelines import LlamaGenPipeline
pipe = LlamaGenPipeline.from_pretrained("vispec/tiny-c2i"); pipe.set_progress_bar_config(disable=True)
run = lambda: pipe(class_labels=[3], decoding="sjd", generator=torch.Generator().manual_seed(0), output_type="latent")
run()
stacks.clear()
files = trace_files(run)
st = stacks[0]
names = [fn for _, fn in st]
call = max(i for i, n in enumerate(names) if n == "__call__")
frames_pipe = call + 1
step_idx = [i for i, n in enumerate(names) if n in ("sjd_step",)]
res = {"image_files_per_request": len(files), "image_lines_per_request": nlines(files),
       "image_frames_call_to_accept": frames_pipe,
       "image_frames_sjd_step_to_accept": (step_idx[0] + 1) if step_idx else None,
       "image_stack": st[:frames_pipe]}
# files per step: trace one sjd_step
import vispec.decoding.sjd as S
one = {}
orig_step = S.sjd_step
def step_spy(*a, **k):
    if "files" in one:
        return orig_step(*a, **k)
    fs = []
    out = [None]
    def f(): out[0] = orig_step(*a, **k)
    one["files"] = trace_files(f)
    return out[0]
S.sjd_step = step_spy
for mod in list(sys.modules.values()):
    if getattr(mod, "sjd_step", None) is orig_step and mod is not S:
        mod.sjd_step = step_spy
run()
if "files" in one:
    res["image_files_per_step"] = len(one["files"]); res["image_lines_per_step"] = nlines(one["files"]); res["image_step_files"] = one["files"]

from vispec.pipelines import MaskedDiffusionLMPipeline
tp = MaskedDiffusionLMPipeline.from_pretrained("vispec/tiny-mdlm"); tp.set_progress_bar_config(disable=True)
trun = lambda: tp("What is 2 + 3?", gen_length=32, block_length=32)
try:
    trun()
except Exception as e:
    res["text_error"] = repr(e)
else:
    tf = trace_files(trun)
    res["text_files_per_request"] = len(tf); res["text_lines_per_request"] = nlines(tf); res["text_files"] = tf
    # one step: the model forward counts; trace the files touched inside one step via callback boundaries
    seen = []
    cur = set()
    def prof(frame, event, arg):
        if event == "call" and ours(frame.f_code.co_filename):
            cur.add(os.path.relpath(frame.f_code.co_filename, ROOT))
    marks = []
    def cb(*a, **k):
        marks.append(set(cur)); cur.clear()
        return k.get("callback_kwargs", a[-1] if a else None) if False else (a[-1] if a and isinstance(a[-1], dict) else {})
    sys.setprofile(prof)
    try:
        tp("What is 2 + 3?", gen_length=32, block_length=32, callback_on_step_end=cb)
    except Exception as e:
        res["text_step_error"] = repr(e)
    finally:
        sys.setprofile(None)
    if len(marks) > 2:
        s = marks[2]
        res["text_files_per_step"] = len(s); res["text_step_files"] = sorted(s)
print(json.dumps(res, indent=1))
