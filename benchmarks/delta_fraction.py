"""How much of a model's published weights one optimizer step changes: the share of elements whose bits differ after
casting the float32 masters to the published dtype, and what a delta update would send (an int32 index + the new
value per changed element, the price `weights.track_changes` reports as `weights/delta_ratio`), for AdamW steps on
reverse_text's solved examples (the demo's SFT data). Issue #40's target: <= 15% of the full bytes for SmolLM2 at the
demo's RL learning rate. No inference: the trainer's half of the question, in a minute on a CPU.

    slipstream model import smollm2-135m-instruct
    python benchmarks/delta_fraction.py ~/.cache/slipstream/models/smollm2-135m-instruct --lr 1e-5 --steps 6
"""

import argparse

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from slipstream.envs.reverse_text import ReverseTextEnv

INDEX_BYTES = 4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a Hugging Face model folder")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch", type=int, default=8, help="conversations per step")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    dtype = getattr(torch, args.dtype)
    words = {2: torch.int16, 4: torch.int32}[dtype.itemsize]
    tasks = ReverseTextEnv(num_tasks=args.steps * args.batch, min_words=2, max_words=5).tasks("train")
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)

    def published() -> dict[str, torch.Tensor]:
        return {k: v.detach().to(dtype).view(words).clone() for k, v in model.named_parameters()}  # tied: once

    before = published()
    total = sum(v.numel() for v in before.values())
    print(f"{args.model}: {total:,} elements published in {args.dtype}; AdamW lr {args.lr}, {args.batch} per step")
    for step in range(1, args.steps + 1):
        loss = torch.zeros(())
        for task in tasks[(step - 1) * args.batch : step * args.batch]:
            answer = {"role": "assistant", "content": f"<reversed_text>{task.answer}</reversed_text>"}
            ids = tokenizer.apply_chat_template([*task.prompt, answer], return_tensors="pt", return_dict=True)
            loss = loss + model(ids["input_ids"], labels=ids["input_ids"]).loss / args.batch
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        after = published()
        changed = sum(int((after[k] != before[k]).sum()) for k in after)
        delta = min(1.0, changed * (INDEX_BYTES + dtype.itemsize) / (total * dtype.itemsize))
        print(
            f"step {step}: loss {loss.item():.3f} | changed {changed / total:.4f} of the elements | delta {delta:.4f} of the full bytes"
        )
        before = after


if __name__ == "__main__":
    main()
