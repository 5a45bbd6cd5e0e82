"""How far the reversal skill reaches beyond reverse_text's vocabulary: greedy answers of each model folder given on
the command line, on 64 texts of 2-5 words outside the environment's word list and on 64 texts of random letters,
scored with the environment's own answer parsing and difflib ratio (the training reward). CPU, ~2 minutes a model.

    python examples/reverse_text/probe_unseen.py ~/.cache/slipstream/models/smollm2-135m-instruct \\
        outputs/reverse_text_sft/weights/step_120 outputs/reverse_text/weights/step_20
"""

import difflib
import random
import string
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from slipstream.envs.reverse_text import _WORDS, SYSTEM_PROMPT, parse_answer

UNSEEN = [
    w
    for w in "harbor velvet quartz meadow copper lantern pebble saddle walnut jacket kettle ribbon tunnel falcon violin "
    "marble cactus donkey pillow turtle canyon glacier mango pepper".split()
    if w not in _WORDS
]


def texts(seed: int) -> dict[str, list[str]]:
    rng = random.Random(seed)
    unseen = [" ".join(rng.choice(UNSEEN) for _ in range(rng.randint(2, 5))) for _ in range(64)]
    letters = [
        " ".join(
            "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 7)))
            for _ in range(rng.randint(2, 5))
        )
        for _ in range(64)
    ]
    return {"unseen words": unseen, "random letters": letters}


def main(folders: list[str]) -> None:
    torch.set_num_threads(1)
    probes = texts(seed=1)
    for folder in folders:
        tokenizer = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        for name, items in probes.items():
            rewards, exact = [], 0
            for text in items:
                messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": text}]
                ids = tokenizer.apply_chat_template(
                    messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
                )
                out = model.generate(ids["input_ids"], max_new_tokens=48, do_sample=False)
                answer = parse_answer(tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True))
                rewards.append(difflib.SequenceMatcher(None, answer, text[::-1], autojunk=False).ratio())
                exact += answer == text[::-1]
            print(
                f"{folder}: {name}: mean reward {sum(rewards) / len(rewards):.3f}, exact {exact}/{len(items)}",
                flush=True,
            )


if __name__ == "__main__":
    main(sys.argv[1:])
