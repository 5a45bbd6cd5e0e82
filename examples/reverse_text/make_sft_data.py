"""Write reverse_text's own solved examples as SFT data (chat rows: the environment's prompt + the correct answer):
`python examples/reverse_text/make_sft_data.py [OUT_DIR] [--min-words N] [--max-words M] [--answer-format F]` ->
OUT_DIR/train.jsonl (train split) and OUT_DIR/val.jsonl (held-out eval split, for the validation loss only). Default
OUT_DIR: outputs/reverse_text_sft_data. The default environment arguments match rl.toml's; the word range can differ
from it, and the answer format must be the one RL uses (orchestrator.env.args.answer_format)."""

import argparse
import json
from pathlib import Path

from slipstream.envs.reverse_text import ANSWER_FORMATS, ReverseTextEnv

ENV_ARGS = {"num_tasks": 1000, "num_eval_tasks": 64, "min_words": 2, "max_words": 5, "answer_format": "tags"}


def main(out_dir: Path, min_words: int, max_words: int, answer_format: str) -> None:
    env = ReverseTextEnv(**ENV_ARGS | {"min_words": min_words, "max_words": max_words, "answer_format": answer_format})
    out_dir.mkdir(parents=True, exist_ok=True)
    for split, name in (("train", "train.jsonl"), ("eval", "val.jsonl")):
        rows = []
        for task in env.tasks(split):
            answer = {"role": "assistant", "content": env.solution(task)}
            rows.append(json.dumps({"messages": [*task.prompt, answer]}))
        (out_dir / name).write_text("\n".join(rows) + "\n")
        print(f"wrote {len(rows)} rows to {out_dir / name}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description="Write reverse_text's own solved examples as SFT data (JSONL chat rows)."
    )
    parser.add_argument("out_dir", nargs="?", type=Path, default=Path("outputs/reverse_text_sft_data"))
    parser.add_argument("--min-words", type=int, default=ENV_ARGS["min_words"], help="fewest words per text")
    parser.add_argument("--max-words", type=int, default=ENV_ARGS["max_words"], help="most words per text")
    parser.add_argument(
        "--answer-format",
        choices=ANSWER_FORMATS,
        default=ENV_ARGS["answer_format"],
        help="the environment's answer_format (tags: <reversed_text>...</reversed_text>; plain: the reversed text alone)",
    )
    args = parser.parse_args()
    main(args.out_dir, args.min_words, args.max_words, args.answer_format)
