"""The data of lm-eval's ``vispec_arithmetic`` task: its YAML's ``custom_dataset`` (lm-eval imports this file from
the YAML's folder, by path, so it stands alone: no relative imports)."""

from __future__ import annotations

import json
import os
from typing import Any

FOLDER = os.path.dirname(os.path.abspath(__file__))


def load_arithmetic(**_: Any):
    """A ``datasets.DatasetDict`` with ``test`` and ``train`` read from ``vispec_arithmetic.{test,train}.jsonl`` next
    to this file. lm-eval passes the task's metadata and the model arguments as keywords; the data does not depend
    on them."""
    import datasets

    splits = {}
    for split in ("test", "train"):
        with open(os.path.join(FOLDER, f"vispec_arithmetic.{split}.jsonl")) as handle:
            splits[split] = datasets.Dataset.from_list([json.loads(line) for line in handle if line.strip()])
    return datasets.DatasetDict(splits)
