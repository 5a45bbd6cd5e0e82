"""Router replay (R3) on CPU: how much of the trainer-inference mismatch does replaying inference's routing remove?

A tiny random Qwen3-MoE is the policy. "Inference" is plain transformers in bfloat16 (another implementation in
another precision, as vLLM is): it samples completions and, in one forward over each finished sequence, gives the
log-prob of every sampled token and the experts every MoE layer routed each token to (its router logits' top-k).
The trainer is Slipstream's own model in float32 with the same weights: it scores the same tokens without replay
(its own top-k: some tokens flip experts) and with replay (inference's experts, gate weights from its own router).
Mismatch KL is the trainer's metric (trainer/loss.py): mean over completion tokens of exp(r) - r - 1,
r = log p_trainer - log p_inference.

    python benchmarks/router_replay.py [--layers 4 --experts 32 --top-k 4 --samples 32 --completion-len 48]
                                       [--init-std 0.1]

The random weights' std (--init-std) sets how peaked the model's distributions are, and so how much one expert
choice moves a token's log-prob: 0.1 is the tiny test models' initializer_range; at transformers' default 0.02 a
random model's outputs are near uniform and both KLs are tiny.

Prints both KLs, the routing agreement, and last `kl_reduction: <KL without replay / KL with replay>`.
"""

import argparse
import tempfile
import time

import torch


def build_models(args):
    """(inference: transformers Qwen3-MoE in bf16, trainer: our model in float32), same random weights."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from slipstream.models.registry import load_pretrained

    config = Qwen3MoeConfig(
        vocab_size=args.vocab_size, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
        moe_intermediate_size=args.hidden // 2, num_hidden_layers=args.layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, num_experts=args.experts, num_experts_per_tok=args.top_k,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=1024,
        initializer_range=args.init_std, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(args.seed)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with tempfile.TemporaryDirectory() as folder:
        hf.save_pretrained(folder)
        trainer = load_pretrained(folder, impl="custom", dtype=torch.float32, device="cpu")
    return hf.to(torch.bfloat16).eval(), trainer.eval()


@torch.no_grad()
def generate(inference, args):
    """(tokens [B, P + C], inference log-probs of the completion [B, C], routing [B, P + C - 1, layers, top_k])."""
    g = torch.Generator().manual_seed(args.seed + 1)
    prompts = torch.randint(1, args.vocab_size, (args.samples, args.prompt_len), generator=g)
    torch.manual_seed(args.seed + 2)
    tokens = inference.generate(
        prompts, attention_mask=torch.ones_like(prompts), do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
        max_new_tokens=args.completion_len, min_new_tokens=args.completion_len, pad_token_id=0,
    )  # fmt: skip
    out = inference(tokens, output_router_logits=True, use_cache=False)
    logprobs = out.logits.float().log_softmax(-1)[:, args.prompt_len - 1 : -1]
    completion = tokens[:, args.prompt_len :]
    inference_lp = logprobs.gather(-1, completion[..., None])[..., 0]
    # vLLM routes a token when it forwards it: every token but the last sampled one.
    B, T = tokens.shape
    routing = torch.stack(
        [logits.view(B, T, -1).float().topk(args.top_k, dim=-1).indices for logits in out.router_logits], dim=2
    )[:, :-1]
    return tokens, inference_lp, routing


@torch.no_grad()
def trainer_logprobs(trainer, tokens, prompt_len, replay_BTRA=None):
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    hidden = trainer.forward_hidden(tokens, positions, None, replay_BTRA)
    logprobs = trainer.logits(hidden).float().log_softmax(-1)[:, prompt_len - 1 : -1]
    return logprobs.gather(-1, tokens[:, prompt_len:, None])[..., 0]


def mismatch_kl(trainer_lp, inference_lp) -> float:
    r = trainer_lp - inference_lp
    return float((r.exp() - r - 1).mean())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab-size", type=int, default=2048)
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--completion-len", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--init-std",
        type=float,
        default=0.1,
        help="std of the random weights (the tiny test models' initializer_range)",
    )
    args = parser.parse_args()
    torch.set_num_threads(max(torch.get_num_threads(), 1))
    start = time.perf_counter()
    inference, trainer = build_models(args)
    tokens, inference_lp, routing = generate(inference, args)
    # Padding the last token's routing with -1: the trainer routes it itself (its output is never scored).
    replay = torch.cat([routing, routing.new_full((routing.shape[0], 1, *routing.shape[2:]), -1)], dim=1)
    plain = trainer_logprobs(trainer, tokens, args.prompt_len)
    replayed = trainer_logprobs(trainer, tokens, args.prompt_len, replay)
    routers = [m.router for m in trainer.modules() if hasattr(m, "router")]
    replayed_tokens, agreeing = (sum(r.replay_counts[i] for r in routers).item() for i in (0, 1))
    kl_plain, kl_replay = mismatch_kl(plain, inference_lp), mismatch_kl(replayed, inference_lp)
    print(
        f"# tiny Qwen3-MoE: {args.layers} MoE layers, {args.experts} experts, top-{args.top_k}, hidden {args.hidden}; "
        f"{args.samples} samples of {args.prompt_len} + {args.completion_len} tokens; inference: transformers bf16, "
        f"trainer: Slipstream float32 ({time.perf_counter() - start:.1f} s)"
    )
    print(f"routing agreement (trainer's own top-k = inference's): {agreeing / replayed_tokens:.4f} of token-layers")
    print(f"mismatch_kl without replay: {kl_plain:.3e}")
    print(f"mismatch_kl with replay:    {kl_replay:.3e}")
    print(f"kl_reduction: {kl_plain / kl_replay:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
