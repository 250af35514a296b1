"""Offline lm-evaluation-harness tasks on vispec's own data (``vispec.eval.lm_eval_tasks``).

``vispec_arithmetic`` (``vispec_arithmetic.yaml``) is GSM8K's lm-eval task (``lm_eval/tasks/gsm8k/gsm8k.yaml``: the
same ``exact_match`` normalisation, the ``strict-match`` and ``flexible-extract`` filters, greedy generation with
GSM8K's stop strings) on :mod:`vispec.eval.bench.text_tasks`' arithmetic word problems, stored here as JSONL in
GSM8K's format (``{"question": ..., "answer": "<worked solution> #### <number>"}``):

* ``vispec_arithmetic.test.jsonl``: the first :data:`NUM_TEST` test-side problems of seed 0, in the order
  ``vispec bench text --tasks arithmetic`` decodes them (``split_items("arithmetic", "test", n, 0)``), so
  ``--limit N`` in lm-eval and ``--num-problems N`` in the bench score the same problems;
* ``vispec_arithmetic.train.jsonl``: :data:`NUM_TRAIN` train-side problems (the few-shot pool, as GSM8K's ``train``).

The prompt is the question alone (``doc_to_text: "{{question}}"``, zero-shot), as the bench prompts the model;
with ``--apply_chat_template`` lm-eval wraps it in the tokenizer's chat template exactly as the pipeline does.
Nothing is downloaded: the YAML's ``custom_dataset`` (``load_arithmetic`` in ``vispec_arithmetic_data.py``, which
lm-eval imports from the YAML's folder) reads the JSONL files next to it.

``python -m vispec.eval.lm_eval_tasks`` prints this folder (lm-eval's ``--include_path``);
:func:`write_arithmetic_jsonl` rewrites the JSONL files (``tests/eval/test_lm_eval.py`` checks they are what it writes).
"""

from __future__ import annotations

import json
import os

TASKS_DIR = os.path.dirname(os.path.abspath(__file__))
NUM_TEST = 100  # vispec bench text's default --num-problems
NUM_TRAIN = 200
SEED = 0


def arithmetic_jsonl_path(split: str, folder: str = TASKS_DIR) -> str:
    """The JSONL file of ``split`` (``"test"`` or ``"train"``) in ``folder``."""
    if split not in ("test", "train"):
        raise ValueError(f"split must be 'test' or 'train', got {split!r}")
    return os.path.join(folder, f"vispec_arithmetic.{split}.jsonl")


def arithmetic_records(split: str, n: int, seed: int = SEED) -> list[dict[str, str]]:
    """``n`` arithmetic problems of ``split`` as GSM8K records (``question``, ``answer``), in the bench's order."""
    from vispec.eval.bench.text_tasks import split_items

    return [{"question": item.prompt, "answer": item.answer} for item in split_items("arithmetic", split, n, seed)]


def arithmetic_jsonl_text(split: str) -> str:
    """The shipped JSONL file's text for ``split`` (one record a line)."""
    n = NUM_TEST if split == "test" else NUM_TRAIN
    return "".join(json.dumps(record) + "\n" for record in arithmetic_records(split, n))


def write_arithmetic_jsonl(folder: str = TASKS_DIR) -> list[str]:
    """Write both splits' JSONL files into ``folder``; returns their paths."""
    paths = []
    for split in ("test", "train"):
        path = arithmetic_jsonl_path(split, folder)
        with open(path, "w") as handle:
            handle.write(arithmetic_jsonl_text(split))
        paths.append(path)
    return paths
