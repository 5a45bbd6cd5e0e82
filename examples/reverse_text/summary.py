"""The demo's last step (`make demo`): held-out reward and exact reversals of the base model, after SFT and after RL,
the answers' length after RL relative to the reference answers, and `plots/phases.png` in the RL run directory.

    python examples/reverse_text/summary.py [BASE_EVAL_JSON SFT_DIR RL_DIR]

Base: a `slipstream eval` result of the base model (the Makefile's `demo` writes it); after SFT: the RL run's online
evaluation of policy 0; after RL: its last one. Reference answers: the exact reversals of the held-out tasks the RL
run evaluated (its environment rebuilt from the run's resolved config, `config/rl.toml`; the SFT data may use other
text lengths), counted with the SFT model's tokenizer plus one end token, as the model must end its answer.
"""

import json
import sys
import tomllib
from pathlib import Path

from transformers import AutoTokenizer

from slipstream.envs.registry import build_env
from slipstream.monitor.phases import phase_lines, phase_score, rl_scores, write_phase_plot
from slipstream.rundir import RunDir
from slipstream.weights.wire.published import latest_ready_step

DEFAULTS = (
    "outputs/reverse_text_base_eval.json",
    "outputs/reverse_text_sft",
    "outputs/reverse_text",
)


def heldout_answers(rl_dir: Path) -> list[str]:
    """The reference answers of the held-out tasks the RL run evaluated, as the model must write them."""
    config = tomllib.loads(RunDir(rl_dir).config_path("rl").read_text())
    env = config["orchestrator"]["env"]
    if env["name"] != "reverse_text":
        raise SystemExit(f"error: {rl_dir} ran environment {env['name']!r}; this summary is for reverse_text")
    return [
        f"<reversed_text>{task.answer}</reversed_text>" for task in build_env(env["name"], **env["args"]).tasks("eval")
    ]


def reference_tokens(answers: list[str], tokenizer_dir: Path) -> float:
    """Mean tokens of the reference answers plus the end token."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    return sum(len(tokenizer.encode(a, add_special_tokens=False)) + 1 for a in answers) / len(answers)


def main(base_path: Path, sft_dir: Path, rl_dir: Path) -> None:
    base = json.loads(base_path.read_text())
    sft, rl = rl_scores(rl_dir)
    sft_weights = RunDir(sft_dir).weights_dir(latest_ready_step(sft_dir))
    plot = write_phase_plot(RunDir(rl_dir).plots_dir / "phases.png", base, sft_dir, rl_dir)
    print(f"[summary] phases plot: {plot}", flush=True)
    scores = {"base": phase_score(base), "sft": sft, "rl": rl}
    for line in phase_lines(scores, reference_tokens(heldout_answers(rl_dir), sft_weights)):
        print(line, flush=True)


if __name__ == "__main__":
    main(*(Path(a) for a in (sys.argv[1:] or DEFAULTS)))
