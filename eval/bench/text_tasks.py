"""Synthetic text tasks for the small masked-diffusion LM, and their scoring.

Three tasks, generated from a seed, with word-level text (tokens separated by spaces, numbers as words):

* ``arithmetic``: GSM8K-format multi-step word problems (Cobbe et al., arXiv 2110.14168) with a worked
  solution, one ``a + b = c .`` step per sentence, ending in ``#### <answer>``. Scored like lm-eval's GSM8K:
  **strict-match** (the first ``#### (-?[0-9.,]+)``) and **flexible-extract** (the last number).
* ``sort``: sort a list of digits that has repeats. A ParallelBench-style task (Kim et al., arXiv
  2510.04767): which value sits at an output slot depends on the counts of all smaller values, so the
  output tokens depend strongly on each other and committing several at once from independent
  marginals produces dropped / doubled values. Exact match.
* ``reverse``: reverse a list of letters. The control: every output token is a copy of one prompt
  token, nearly independent of the other outputs given the prompt, so parallel decoding should cost
  little. Exact match.

Splits: a prompt belongs to the test side iff a salted SHA-256 of it falls in 1/8 of the hash space
(:func:`is_test_prompt`). ``split_items(task, "test", n)`` keeps the first ``n`` distinct test-side
prompts of a seeded stream; :func:`train_stream` yields only train-side prompts, so no test prompt ever
appears in training, whatever the seeds and sizes.
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass
from typing import Iterator, Optional, Union

STRICT_RE = re.compile(r"#### (\-?[0-9\.\,]+)")  # lm-eval gsm8k "strict-match" (first match)
FLEXIBLE_RE = re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)")  # lm-eval gsm8k "flexible-extract" (last match)
_IGNORE = [re.compile(p) for p in (r",", r"\$", r"(?s).*#### ", r"\.$")]  # lm-eval exact_match regexes_to_ignore
SPLIT_SALT = "vispec-text-tasks-v1"
TEST_FRACTION = 8  # one prompt in 8 (by hash) is reserved for the test side


@dataclass(frozen=True)
class TextItem:
    """One example. ``answer`` is the full target text (the worked solution for arithmetic); ``target``
    is what scoring compares with (the number for arithmetic, the answer text otherwise)."""

    task: str
    prompt: str
    answer: str
    target: str


# ---------------------------------------------------------------------------------------- scoring
def strict_match_extract(text: str) -> Optional[str]:
    """The first ``#### <number>`` of ``text`` (lm-eval GSM8K strict-match filter), or None."""
    match = STRICT_RE.search(text)
    return match.group(1) if match else None


def flexible_extract(text: str) -> Optional[str]:
    """The last number in ``text`` (lm-eval GSM8K flexible-extract filter), or None."""
    matches = FLEXIBLE_RE.findall(text)
    if not matches:
        return None
    return next(group for group in matches[-1] if group)


def normalize_gsm8k(text: str) -> str:
    """lm-eval GSM8K ``exact_match`` normalisation: drop ``,``, ``$``, everything up to ``#### `` and a
    trailing ``.``; lower case; strip."""
    for pattern in _IGNORE:
        text = pattern.sub("", text)
    return text.strip().lower()


def gsm8k_scores(completion: str, reference: str) -> dict[str, float]:
    """``{"strict_match", "flexible_extract"}`` (0 or 1) of a completion against a reference number or a
    reference solution ending in ``#### <number>``."""
    gold = normalize_gsm8k(reference)
    scores = {}
    for name, extract in (("strict_match", strict_match_extract), ("flexible_extract", flexible_extract)):
        found = extract(completion)
        scores[name] = float(found is not None and normalize_gsm8k(found) == gold)
    return scores


def exact_match(completion: str, target: str) -> float:
    """1.0 if the texts agree up to whitespace, else 0.0."""
    return float(" ".join(completion.split()) == " ".join(target.split()))


# ---------------------------------------------------------------------------------------- tasks
class TextTask:
    """A seeded item generator plus its scorer; subclasses implement :meth:`sample`."""

    name: str = ""
    metrics: tuple[str, ...] = ("exact_match",)

    def sample(self, rng: random.Random) -> TextItem:
        raise NotImplementedError

    def score(self, completion: str, item: TextItem) -> dict[str, float]:
        return {"exact_match": exact_match(completion, item.target)}

    def words(self) -> list[str]:
        """Every word the task can produce (for building a tokenizer vocabulary)."""
        raise NotImplementedError


_NAMES = {"tom": "he", "sam": "he", "ben": "he", "jack": "he", "leo": "he",
          "lily": "she", "anna": "she", "mia": "she", "emma": "she", "zoe": "she"}
_ITEMS = ["apples", "pens", "cards", "books", "coins", "shells", "stickers", "marbles", "cookies", "stamps"]
_PLUS = ["buys", "finds", "gets", "wins"]
_MINUS = ["loses", "sells", "uses", "drops"]


@dataclass
class ArithmeticTask(TextTask):
    """``steps`` additions / subtractions on one quantity (module docstring). Every step is its own
    sentence and its own ``a op b = c .`` line, so each is a local lookup; values stay in ``[0, max_value]``.

    Example: ``lily has 7 apples . then she buys 5 apples . then she drops 3 apples . how many apples does
    lily have now ?`` -> ``7 + 5 = 12 . 12 - 3 = 9 . #### 9``.
    """

    # Sized for a few-million-parameter model trained for under an hour on 2 CPU cores: with word-level
    # numbers every ``a ± b`` is a fact to memorise, and a 20/10/99 range (~1000 facts) reached only 10-13%
    # strict-match after 6000 of 11000 steps, while the copying of operands was already learnt.
    min_steps: int = 2
    max_steps: int = 3
    start_max: int = 10
    operand_max: int = 5
    max_value: int = 25
    name: str = "arithmetic"
    metrics: tuple[str, ...] = ("strict_match", "flexible_extract")

    def __post_init__(self) -> None:
        if not 1 <= self.min_steps <= self.max_steps:
            raise ValueError(f"need 1 <= min_steps <= max_steps, got {self.min_steps}, {self.max_steps}")
        if self.operand_max < 1 or not 1 <= self.start_max <= self.max_value:
            raise ValueError(f"need operand_max >= 1 and 1 <= start_max <= max_value, got operand_max={self.operand_max}, "
                             f"start_max={self.start_max}, max_value={self.max_value}")

    def sample(self, rng: random.Random) -> TextItem:
        name = rng.choice(sorted(_NAMES))
        pronoun, item = _NAMES[name], rng.choice(_ITEMS)
        value = rng.randint(1, self.start_max)
        sentences, lines = [f"{name} has {value} {item} ."], []
        for _ in range(rng.randint(self.min_steps, self.max_steps)):
            operand = rng.randint(1, self.operand_max)
            plus = rng.random() < 0.5
            if plus and value + operand > self.max_value:
                plus = False
            if not plus and operand > value:
                plus = True
            verb = rng.choice(_PLUS if plus else _MINUS)
            new = value + operand if plus else value - operand
            sentences.append(f"then {pronoun} {verb} {operand} {item} .")
            lines.append(f"{value} {'+' if plus else '-'} {operand} = {new} .")
            value = new
        sentences.append(f"how many {item} does {name} have now ?")
        return TextItem(self.name, " ".join(sentences), " ".join(lines) + f" #### {value}", str(value))

    def score(self, completion: str, item: TextItem) -> dict[str, float]:
        return gsm8k_scores(completion, item.target)

    def words(self) -> list[str]:
        fixed = ["has", "then", "how", "many", "does", "have", "now", "?", ".", "+", "-", "=", "####"]
        return fixed + sorted(_NAMES) + sorted(set(_NAMES.values())) + _ITEMS + _PLUS + _MINUS + [
            str(i) for i in range(self.max_value + 1)]


@dataclass
class SortTask(TextTask):
    """Sort ``min_len..max_len`` digits drawn from ``0..max_digit`` (repeats are frequent).

    Example: ``sort the numbers : 5 3 9 3 1`` -> ``1 3 3 5 9``.
    """

    min_len: int = 5
    max_len: int = 8
    max_digit: int = 9
    name: str = "sort"

    def sample(self, rng: random.Random) -> TextItem:
        values = [rng.randint(0, self.max_digit) for _ in range(rng.randint(self.min_len, self.max_len))]
        answer = " ".join(map(str, sorted(values)))
        return TextItem(self.name, "sort the numbers : " + " ".join(map(str, values)), answer, answer)

    def words(self) -> list[str]:
        return ["sort", "the", "numbers", ":"] + [str(i) for i in range(self.max_digit + 1)]


_LETTERS = [chr(ord("a") + i) for i in range(26)]


@dataclass
class ReverseTask(TextTask):
    """Reverse ``min_len..max_len`` letters.

    Example: ``reverse the letters : k d m a`` -> ``a m d k``.
    """

    min_len: int = 4
    max_len: int = 8
    name: str = "reverse"

    def sample(self, rng: random.Random) -> TextItem:
        letters = [rng.choice(_LETTERS) for _ in range(rng.randint(self.min_len, self.max_len))]
        answer = " ".join(reversed(letters))
        return TextItem(self.name, "reverse the letters : " + " ".join(letters), answer, answer)

    def words(self) -> list[str]:
        return ["reverse", "the", "letters", ":"] + _LETTERS


TASKS: dict[str, TextTask] = {"arithmetic": ArithmeticTask(), "sort": SortTask(), "reverse": ReverseTask()}


def get_task(task: Union[str, TextTask]) -> TextTask:
    """A task by name (``arithmetic``, ``sort``, ``reverse``) or the task itself."""
    if isinstance(task, TextTask):
        return task
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; expected one of {sorted(TASKS)}")
    return TASKS[task]


# ---------------------------------------------------------------------------------------- splits
def is_test_prompt(prompt: str) -> bool:
    """Whether ``prompt`` is reserved for the test side (salted hash; independent of seeds and sizes)."""
    digest = hashlib.sha256(f"{SPLIT_SALT}\n{prompt}".encode()).digest()
    return int.from_bytes(digest[:8], "little") % TEST_FRACTION == 0


def _stream_seed(task: TextTask, split: str, seed: int) -> int:
    return int.from_bytes(hashlib.sha256(f"{task.name}/{split}/{seed}".encode()).digest()[:8], "little")


def split_items(task: Union[str, TextTask], split: str, n: int, seed: int = 0) -> list[TextItem]:
    """``n`` items of one side: ``"test"``: the first ``n`` distinct test-side items of the task's seeded
    test stream; ``"train"``: the first ``n`` items of :func:`train_stream` (repeats possible)."""
    task = get_task(task)
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if split == "train":
        stream = train_stream(task, seed)
        return [next(stream) for _ in range(n)]
    if split != "test":
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    rng, seen, items = random.Random(_stream_seed(task, "test", seed)), set(), []
    for _ in range(1000 * n + 1000):
        if len(items) == n:
            return items
        item = task.sample(rng)
        if item.prompt not in seen and is_test_prompt(item.prompt):
            seen.add(item.prompt)
            items.append(item)
    raise ValueError(f"task {task.name!r} has fewer than {n} distinct test prompts; make it harder or ask for fewer")


def train_stream(task: Union[str, TextTask], seed: int = 0) -> Iterator[TextItem]:
    """An endless seeded stream of train-side items (never a test prompt; repeats are possible)."""
    task = get_task(task)
    rng = random.Random(_stream_seed(task, "train", seed))
    while True:
        item = task.sample(rng)
        if not is_test_prompt(item.prompt):
            yield item
