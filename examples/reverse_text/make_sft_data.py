"""Write reverse_text's own solved examples as SFT data (chat rows: the environment's prompt + the correct answer):
`python examples/reverse_text/make_sft_data.py [OUT_DIR]` -> OUT_DIR/train.jsonl (train split) and
OUT_DIR/val.jsonl (held-out eval split, for the validation loss only). Default OUT_DIR: outputs/reverse_text_sft_data.
The environment arguments match rl.toml's, so SFT teaches the format and the skill RL then sharpens."""

import json
import sys
from pathlib import Path

from slipstream.envs.reverse_text import ReverseTextEnv

ENV_ARGS = {"num_tasks": 1000, "num_eval_tasks": 64, "min_words": 2, "max_words": 5}


def main(out_dir: Path) -> None:
    env = ReverseTextEnv(**ENV_ARGS)
    out_dir.mkdir(parents=True, exist_ok=True)
    for split, name in (("train", "train.jsonl"), ("eval", "val.jsonl")):
        rows = []
        for task in env.tasks(split):
            answer = {"role": "assistant", "content": f"<reversed_text>{task.answer}</reversed_text>"}
            rows.append(json.dumps({"messages": [*task.prompt, answer]}))
        (out_dir / name).write_text("\n".join(rows) + "\n")
        print(f"wrote {len(rows)} rows to {out_dir / name}")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "outputs/reverse_text_sft_data"))
