"""Evaluation of a policy on an environment split: `evaluate` (library, online use) and `slipstream eval` (run.py)."""

from slipstream.eval.evaluate import evaluate
from slipstream.eval.metrics import pass_at_k
from slipstream.eval.results import EVAL_METRIC_PREFIX, EvalResult, TaskResult

__all__ = ["EVAL_METRIC_PREFIX", "EvalResult", "TaskResult", "evaluate", "pass_at_k"]
