"""benchmarks/gpu_loop.py: its summary of a run folder (the no-stall figures: the server's swap, the engine's own), and
the config it hands `slipstream rl`."""

import json

import pytest
import tomli_w

from slipstream.config.loader import load_config
from slipstream.config.rl import RLConfig
from tests.benchmark_scripts import load_benchmark


def _write_run(run, swap_lines: list[str]) -> None:
    records = []
    for step in range(1, 6):
        r = {"step": step, "time": 100.0 + step, "timing/generate_s": 1.0, "batch/completion_tokens": 1000.0}
        if step >= 3:  # one staged update a step: the server's handled swap 12, 14, 40 ms
            swap_s = {3: 0.012, 4: 0.014, 5: 0.040}[step]
            r |= {
                "weights/num_updates": 1.0,
                "timing/weight_pause_s": swap_s,
                "timing/weight_pause/swap_s": swap_s + 0.003,
                "timing/weight_pause/swap_server_s": swap_s,
                "timing/weight_update_s": 0.5,
            }
        records.append(r)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    checks = [{"kind": "calibration", "max_abs_diff": 0.02}, {"kind": "update", "passed": True, "margin": 0.05}]
    (run / "weight_checks.jsonl").write_text("".join(json.dumps(c) + "\n" for c in checks))
    (run / "logs").mkdir()
    (run / "logs" / "inference.log").write_text("".join(line + "\n" for line in swap_lines))


def test_the_engines_own_swap_comes_from_the_line_vllms_worker_logs(tmp_path):
    from slipstream.weights.receive.engine import SWAP_LOG

    gpu_loop = load_benchmark("gpu_loop")
    lines = [
        "(EngineCore pid=42) 2026-11-30T04:33:10.686Z INFO [vllm] " + SWAP_LOG % (step, seconds, 0.0)
        for step, seconds in [(2, 0.0069), (3, 0.0066), (4, 0.0094)]
    ]
    _write_run(tmp_path, ["INFO [vllm] slipstream weight transfer: staged {...}", *lines])
    summary = gpu_loop.summarize(tmp_path, wall=10.0)
    assert summary["engine_swap_ms"] == {"median": pytest.approx(6.9), "max": pytest.approx(9.4), "n": 3}
    # the pause of a staged update is the server's handled swap, medians over the steps after the first two
    assert summary["pause_ms"] == pytest.approx(14.0)
    assert summary["pause_phases_ms"]["swap_server"] == pytest.approx(14.0)


def test_a_run_without_staged_versions_has_no_engine_swap(tmp_path):
    _write_run(tmp_path, ["INFO [vllm] slipstream weight transfer: loaded version 3"])
    assert load_benchmark("gpu_loop").summarize(tmp_path, wall=10.0)["engine_swap_ms"] is None


def test_each_received_version_comes_from_the_workers_log_with_its_host_time(tmp_path):
    from slipstream.weights.receive.receiver import ReceiveStats

    def line(stats: ReceiveStats, staged: str = "") -> str:  # as weights/receive/engine.py logs it
        return f"(EngineCore pid=42) INFO [vllm] slipstream weight transfer: {staged}{stats.to_dict()}"

    lines = [
        line(ReceiveStats(0, 3, 10, 0.5, "/models/x")),  # the initial weights: no mark, no host time
        line(ReceiveStats(3, 3, 10, 0.0042, "broadcast", host_s=0.0011, marked_s=0.0003)),
        line(ReceiveStats(4, 3, 10, 0.0090, "broadcast", host_s=0.0085, marked_s=0.0002, load_s=0.006), "staged "),
    ]
    _write_run(tmp_path, lines)
    summary = load_benchmark("gpu_loop").summarize(tmp_path, wall=10.0)
    assert summary["receives_ms"] == [
        {"step": 3, "seconds": pytest.approx(4.2), "marked_s": pytest.approx(0.3), "host_s": pytest.approx(1.1)},
        {
            "step": 4,
            "seconds": pytest.approx(9.0),
            "marked_s": pytest.approx(0.2),
            "host_s": pytest.approx(8.5),
            "load_s": pytest.approx(6.0),
        },
    ]


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["--compile", "--packed-attention", "flex", "--no-stall", "--profile-steps", "6", "7"],
        ["--delta", "--lr", "1e-5", "--stream-interval", "8"],
        ["--colocate", "--gpu", "1", "--sleep-level", "0", "--eager"],
        ["--receive-buffers", "4"],
    ],
)
def test_the_loops_config_is_one_slipstream_rl_accepts(tmp_path, argv):
    """What gpu_loop.py hands `slipstream rl` parses, with each flag where it belongs."""
    gpu_loop = load_benchmark("gpu_loop")
    args = gpu_loop.build_parser().parse_args(["--model", str(tmp_path / "model"), *argv])
    path = tmp_path / "rl.toml"
    path.write_text(tomli_w.dumps(gpu_loop.rl_config(args.model, tmp_path / "run", 4, 1, args)))
    config = load_config(RLConfig, ["-c", str(path)])
    assert config.trainer.packed_attention == args.packed_attention and config.trainer.compile == args.compile
    assert config.weights.no_stall == args.no_stall and config.weights.delta.enabled == args.delta
    assert config.weights.receive_buffers == (args.receive_buffers or 2)
    assert config.deployment.colocate == (True if args.colocate else None)
