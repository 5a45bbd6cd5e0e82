"""The trainer throughput model, calibrated on two recorded figures, predicts the held-out ones within 15%.

Figures from benchmarks/RESULTS.md, section "Trainer throughput: RL step, custom models vs plain transformers
(`trainer_throughput.py`)": its first table (H100, custom rows) and its sub-section "Session of 2026-11-26 (later):
MoE compiled whole, attention kept by checkpointing, torchtitan side by side" (Slipstream column). Calibration uses
the dense 1 x 16384 full-checkpointing row and the MoE 4-layer 1 x 16384 "current" row; everything else is held out.
"""

import pytest

from slipstream.planner.hardware import GPUS, QWEN3_0_6B, QWEN3_30B_A3B
from slipstream.planner.trainer_model import (
    Measured,
    TrainerCalibration,
    TrainerShape,
    fit_calibration,
    predict_step,
)


def one(checkpointing: str, state_bytes: int = 8) -> TrainerShape:
    return TrainerShape(num_gpus=1, checkpointing=checkpointing, optimizer_state_bytes=state_bytes)


MOE4, MOE8 = QWEN3_30B_A3B.cut(4), QWEN3_30B_A3B.cut(8)
CAL_DENSE = Measured("Qwen3-0.6B 1x16384 full ckpt, H100", QWEN3_0_6B, "h100", one("full"), 16384, 16384, 37589)
CAL_MOE = Measured("30B-A3B 4l 1x16384 keeps attention, H100", MOE4, "h100", one("keep_attention"), 16384, 16384, 60206)
HELD_OUT = [
    Measured("Qwen3-0.6B 8x2048 full ckpt, H100", QWEN3_0_6B, "h100", one("full"), 16384, 2048, 65127),
    Measured(
        "Qwen3-0.6B 1x16384 keeps attention, H100", QWEN3_0_6B, "h100", one("keep_attention"), 16384, 16384, 42515
    ),
    Measured("Qwen3-0.6B 8x2048 keeps attention, H100", QWEN3_0_6B, "h100", one("keep_attention"), 16384, 2048, 68973),
    Measured("Qwen3-0.6B 8x2048 no ckpt, H100", QWEN3_0_6B, "h100", one("none"), 16384, 2048, 74716),
    Measured("30B-A3B 4l 8x2048, H100", MOE4, "h100", one("keep_attention"), 16384, 2048, 72319),
    Measured("30B-A3B 4l 1x16384 bf16 moments, H200", MOE4, "h200", one("keep_attention", 4), 16384, 16384, 62894),
    Measured(
        "30B-A3B 8l 1x16384/GPU, 2xH200 FSDP2 x EP2 (token dispatch, 2026-11-27)",
        MOE8,
        "h200",
        TrainerShape(num_gpus=2, ep=2, checkpointing="keep_attention"),
        16384,
        16384,
        37878,
    ),
]


@pytest.fixture(scope="module")
def calibration():
    return fit_calibration(CAL_DENSE, CAL_MOE)


def predicted_tokens_per_s(m: Measured, cal) -> float:
    step = predict_step(m.shape, GPUS[m.gpu], m.trainer, m.tokens_per_gpu * m.trainer.num_gpus, m.context, cal)
    return step.tokens_per_s_per_gpu


def test_calibration_reproduces_its_own_figures(calibration):
    for m in (CAL_DENSE, CAL_MOE):
        assert predicted_tokens_per_s(m, calibration) == pytest.approx(m.tokens_per_s_per_gpu, rel=1e-6)
    assert 0.05 < calibration.elementwise_ns < 1.0  # plausible: a few HBM passes per layer and hidden unit
    assert 50e12 < calibration.expert_flops_per_s < 740e12
    default = TrainerCalibration()  # what `slipstream plan` uses: the same fit, rounded
    assert default.elementwise_ns == pytest.approx(calibration.elementwise_ns, rel=0.01)
    assert default.expert_flops_per_s == pytest.approx(calibration.expert_flops_per_s, rel=0.01)


@pytest.mark.parametrize("m", HELD_OUT, ids=lambda m: m.label)
def test_held_out_figures_within_15_percent(m, calibration):
    predicted = predicted_tokens_per_s(m, calibration)
    assert predicted == pytest.approx(m.tokens_per_s_per_gpu, rel=0.15), f"{m.label}: {predicted:.0f}"


def test_communication_terms_grow_with_parallelism(calibration):
    gpu = GPUS["h100"]
    base = predict_step(QWEN3_30B_A3B, gpu, TrainerShape(num_gpus=16, ep=1), 16 * 16384, 16384, calibration)
    ep = predict_step(QWEN3_30B_A3B, gpu, TrainerShape(num_gpus=16, ep=8), 16 * 16384, 16384, calibration)
    cross = predict_step(QWEN3_30B_A3B, gpu, TrainerShape(num_gpus=16, ep=16), 16 * 16384, 16384, calibration)
    assert base.all_to_all_s == 0 < ep.all_to_all_s < cross.all_to_all_s  # 16 spans two nodes: slower links
    assert ep.memory_gib < base.memory_gib  # experts split instead of replicated per FSDP gather
    cp = predict_step(QWEN3_0_6B, gpu, TrainerShape(num_gpus=8, cp=4), 8 * 65536, 65536, calibration)
    assert cp.cp_s > 0


def test_fit_refuses_multi_gpu_figures():
    with pytest.raises(ValueError, match="single-GPU"):
        fit_calibration(HELD_OUT[-1], CAL_MOE)
