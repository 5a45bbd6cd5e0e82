"""The demo's last step (`make demo`): held-out reward and exact reversals of the base model, after SFT and after RL,
the answers' length after RL relative to the reference answers, and `plots/phases.png` in the RL run directory.

    python examples/reverse_text/summary.py [BASE_EVAL_JSON SFT_DIR RL_DIR SFT_DATA_DIR]

Base: a `slipstream eval` result of the base model (the Makefile's `demo` writes it); after SFT: the RL run's online
evaluation of policy 0; after RL: its last one. Reference answers: the held-out tasks' solved examples in
SFT_DATA_DIR/val.jsonl (make_sft_data.py), counted with the SFT model's tokenizer plus one end token, as the model
must end its answer.
"""

import json
import sys
from pathlib import Path

from transformers import AutoTokenizer

from slipstream.monitor.phases import phase_lines, phase_score, rl_scores, write_phase_plot
from slipstream.rundir import RunDir
from slipstream.weights.wire.published import latest_ready_step

DEFAULTS = (
    "outputs/reverse_text_base_eval.json",
    "outputs/reverse_text_sft",
    "outputs/reverse_text",
    "outputs/reverse_text_sft_data",
)


def reference_tokens(val_file: Path, tokenizer_dir: Path) -> float:
    """Mean tokens of the reference answers (the assistant turns of `val_file`) plus the end token."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    answers = [json.loads(line)["messages"][-1]["content"] for line in val_file.read_text().splitlines() if line]
    return sum(len(tokenizer.encode(a, add_special_tokens=False)) + 1 for a in answers) / len(answers)


def main(base_path: Path, sft_dir: Path, rl_dir: Path, data_dir: Path) -> None:
    base = json.loads(base_path.read_text())
    sft, rl = rl_scores(rl_dir)
    sft_weights = RunDir(sft_dir).weights_dir(latest_ready_step(sft_dir))
    plot = write_phase_plot(RunDir(rl_dir).plots_dir / "phases.png", base, sft_dir, rl_dir)
    print(f"[summary] phases plot: {plot}", flush=True)
    scores = {"base": phase_score(base), "sft": sft, "rl": rl}
    for line in phase_lines(scores, reference_tokens(data_dir / "val.jsonl", sft_weights)):
        print(line, flush=True)


if __name__ == "__main__":
    main(*(Path(a) for a in (sys.argv[1:] or DEFAULTS)))
