"""What a weight version costs inside the real vLLM (CPU build) with Slipstream's engine: vLLM's own loaders under
its layer-wise reload, against the copy plan's replay (weights/receive/copy_plan.py), on the same model and stream.

A random Qwen3 of 28 layers at tiny widths (Qwen3-0.6B's 311 checkpoint tensors, 23 MB in float32) takes three
versions by gloo broadcast in one bucket, through vLLM's weight-transfer API
(tests/e2e/vllm_reload_script.py, whose layers keep their weights as loaded, as on the GPU build), once with the copy
plan turned off (SLIPSTREAM_WEIGHT_COPY_PLAN=0) and once on. Each version's seconds run from /start_weight_update to
/finish_weight_update; the first version with the plan on is the recorded one. Both runs must end with the model's
own weights bit for bit.

    python benchmarks/vllm_reload_cpu.py [--repeats 2]
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO))

LAYERS = 28
BUCKET_BYTES = 64 << 20


def build_model(folder: Path) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from slipstream.models.tiny import build_tiny_model

    tiny = build_tiny_model("qwen3", folder / "tiny")
    config = AutoConfig.from_pretrained(tiny)
    config.num_hidden_layers = LAYERS
    config.layer_types = ["full_attention"] * LAYERS
    torch.manual_seed(0)
    out = folder / "qwen3-28l"
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    for f in tiny.iterdir():
        if f.suffix not in (".safetensors",) and f.name != "config.json":
            shutil.copy(f, out / f.name)
    return out


def run_once(model: Path, plan: bool) -> dict:
    from slipstream.utils.net import free_port

    env = {**os.environ, "SLIPSTREAM_WEIGHT_COPY_PLAN": "1" if plan else "0", "PYTHONPATH": f"{REPO / 'src'}:{REPO}"}
    script = REPO / "tests" / "e2e" / "vllm_reload_script.py"
    cmd = [sys.executable, str(script), str(model), str(free_port()), str(BUCKET_BYTES), "--unpacked"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"vllm_reload_script failed:\n{proc.stderr[-4000:]}")
    result = json.loads(lines[-1].removeprefix("RESULT "))
    if result["after"][1] != result["before"]:
        raise RuntimeError("the model's own weights did not come back bit for bit")
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=2, help="runs of each (off, on), alternating")
    cli = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="slipstream-reload-"))
    try:
        model = build_model(folder)
        print(
            f"# {os.cpu_count()} CPUs, vLLM CPU build, {LAYERS}-layer tiny Qwen3 (311 tensors), one bucket", flush=True
        )
        best = {False: [], True: []}
        for _ in range(cli.repeats):
            for plan in (False, True):
                r = run_once(model, plan)
                state = r["plans"][-1]
                print(json.dumps({"copy_plan": plan, "seconds": [round(s, 4) for s in r["seconds"]], **state}))
                best[plan].append(min(r["seconds"][1:]))
        off, on = min(best[False]), min(best[True])
        print(f"vLLM loaders {off * 1e3:.1f} ms per version, copy plan {on * 1e3:.1f} ms: {off / on:.1f}x")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
