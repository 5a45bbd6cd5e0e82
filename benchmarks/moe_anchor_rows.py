"""The plain-transformers MoE anchor's RL step ($HF_MOE_ANCHOR: the same Qwen3-30B-A3B
shape cut to LAYERS layers, pure bf16 weights and AdamW states, full activation checkpointing, chunked log-probs,
the same policy-gradient loss) on ROWS independent samples of SEQ / ROWS tokens each, one per batch row: what a
plain-transformers user runs for a batch of equal-length samples, since the anchor itself takes one sequence.

    python benchmarks/moe_anchor_rows.py SEQ LAYERS [EXPERTS_IMPL] [ROWS]
    python benchmarks/trainer_throughput.py --model qwen3-30b-a3b-4l --seq-len 16384 --num-samples 8 \
        --compare-anchor benchmarks/moe_anchor_rows.py

Prints one line in the anchor's format (`tokens_per_s=... mfu=...`); the attention term of the MFU uses the row
length, as each sample attends only to itself.
"""

import sys
import time

import torch
import torch.nn.functional as F
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, EXPERT_DIM, TOP_K, VOCAB = 2048, 32, 4, 128, 768, 8, 151936
CHUNK = 4096


def main() -> None:
    seq = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
    layers = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    impl = sys.argv[3] if len(sys.argv) > 3 else "grouped_mm"
    rows = int(sys.argv[4]) if len(sys.argv) > 4 else 1
    if seq % rows:
        raise SystemExit(f"SEQ {seq} must be a multiple of ROWS {rows}")
    length = seq // rows
    cfg = Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=6144, moe_intermediate_size=EXPERT_DIM,
        num_hidden_layers=layers, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
        num_experts=128, num_experts_per_tok=TOP_K, norm_topk_prob=True, decoder_sparse_step=1,
        tie_word_embeddings=False, max_position_embeddings=40960,
    )  # fmt: skip
    cfg._attn_implementation = "sdpa"
    if impl != "default":
        cfg._experts_implementation = impl
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(cfg).to("cuda", torch.bfloat16)
    model.gradient_checkpointing_enable()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)
    attn_params = HIDDEN * HEADS * HEAD_DIM * 2 + 2 * HIDDEN * KV_HEADS * HEAD_DIM
    active = layers * (attn_params + TOP_K * 3 * HIDDEN * EXPERT_DIM + HIDDEN * 128) + VOCAB * HIDDEN
    flops_per_token = 6 * active + 12 * layers * HEADS * HEAD_DIM * length

    def step() -> None:
        ids = torch.randint(0, VOCAB, (rows, length), device="cuda")
        hidden = model.model(input_ids=ids).last_hidden_state[:, :-1].reshape(-1, HIDDEN)
        targets = ids[:, 1:].reshape(-1)
        advantages = torch.randn(targets.numel(), device="cuda")
        logprobs = []
        for i in range(0, hidden.shape[0], CHUNK):
            logits = (hidden[i : i + CHUNK] @ model.lm_head.weight.t()).float()
            logprobs.append(torch.gather(F.log_softmax(logits, -1), 1, targets[i : i + CHUNK, None])[:, 0])
        lp = torch.cat(logprobs)
        loss = -(advantages * torch.exp(lp - lp.detach())).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start, steps = time.perf_counter(), 3
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    dt = (time.perf_counter() - start) / steps
    tps = seq / dt
    print(
        f"{torch.cuda.get_device_name(0)} moe layers={layers} seq={seq} rows={rows} impl={impl} "
        f"active={active / 1e6:.0f}M step={dt:.3f}s tokens_per_s={tps:.0f} mfu={100 * flops_per_token * tps / 989e12:.1f}% "
        f"peak_mem={torch.cuda.max_memory_allocated() / 2**30:.1f}GiB"
    )


if __name__ == "__main__":
    main()
