"""``python -m vispec.eval.lm_eval_tasks``: print the folder of vispec's lm-eval tasks (for ``--include_path``)."""

from vispec.eval.lm_eval_tasks import TASKS_DIR

print(TASKS_DIR)
