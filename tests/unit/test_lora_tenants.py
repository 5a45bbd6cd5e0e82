"""Multi-tenant LoRA on a tiny model (CPU): one tenant's step leaves every other tenant's adapter and AdamW state
bit-identical, a tenant trained among others ends exactly as trained alone (and as `slipstream trainer` trains its
batches), tenants join, leave and rejoin, and one tenant's failure does not stop or change another."""

import json

import msgspec
import pytest
import torch
from safetensors.torch import load_file

from slipstream.config.shared import CheckpointConfig, LoRAConfig, ModelConfig
from slipstream.config.tenants import TenantConfig, TenantTrainerConfig, tenant_trainer_config
from slipstream.config.trainer import OptimConfig
from slipstream.monitor.metrics import read_metrics
from slipstream.rundir import COMMITTED, ORCHESTRATOR_PART, RunDir
from slipstream.trainer.rl import run_trainer
from slipstream.trainer.setup import setup_trainer
from slipstream.trainer.tenant_loop import Tenants, shared_trainer_config
from slipstream.trainer.tenants import active_params, build_tenant, train_tenant_step
from slipstream.transport.rollouts import MicroBatch, TrainingBatch, batch_path, write_batch
from slipstream.transport.tenants import join_tenant, leave_tenant, read_status, tenant_config_path
from slipstream.utils.fs import atomic_write_text
from slipstream.weights.send.lora_export import ADAPTER_WEIGHTS

LORA = LoRAConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "down_proj"])


def _shared_config(model_dir, tenants_dir, **kw) -> TenantTrainerConfig:
    model = ModelConfig(name=str(model_dir), lora=LORA)
    return TenantTrainerConfig(model=model, tenants_dir=tenants_dir, device="cpu", num_threads=1, **kw)


def _tenant(name: str, lr: float, max_steps: int = 3, seed: int = 0, **kw) -> TenantConfig:
    return TenantConfig(name=name, max_steps=max_steps, seed=seed, optim=OptimConfig(lr=lr, max_grad_norm=10.0), **kw)


def _batch(step: int, seed: int) -> TrainingBatch:
    """A deterministic batch of two micro-batches (positive advantages; inference log-probs below the model's)."""
    g = torch.Generator().manual_seed(seed * 1000 + step)
    micro_batches = []
    for _ in range(2):
        ids, pos, mask, adv = [], [], [], []
        for num_prompt, num_completion in ((3, 5), (2, 4)):
            n = num_prompt + num_completion
            ids += torch.randint(1, 280, (n,), generator=g).tolist()
            pos += list(range(n))
            mask += [False] * num_prompt + [True] * num_completion
            a = float(torch.rand((), generator=g)) + 0.1
            adv += [0.0] * num_prompt + [a] * num_completion
        lq = [-8.0 if m else 0.0 for m in mask]
        micro_batches.append(MicroBatch(ids, pos, mask, adv, lq, [1.0] * len(ids)))
    num_loss = sum(sum(mb.loss_mask) for mb in micro_batches)
    return TrainingBatch(step, 0, num_loss, micro_batches, metrics={"reward/mean": 0.5})


def _snapshot(run) -> dict:
    params = {k: v.detach().clone() for k, v in run.params.items()}
    state = {k: {n: t.clone() for n, t in s.items()} for k, s in run.view.optimizer.state.items()}
    return {"params": params, "state": state}


def _assert_equal(a: dict, b: dict) -> None:
    assert a["params"].keys() == b["params"].keys()
    assert all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"])
    assert len(a["state"]) == len(b["state"])
    for sa, sb in zip(a["state"].values(), b["state"].values(), strict=True):
        assert all(torch.equal(sa[n], sb[n]) for n in sa)


@pytest.fixture(scope="module")
def model_dir(tiny_qwen3_dir):
    return tiny_qwen3_dir


def test_a_tenant_step_changes_only_that_tenant(model_dir, tmp_path):
    config = _shared_config(model_dir, tmp_path)
    trainer = setup_trainer(shared_trainer_config(config))
    base = {k: v.detach().clone() for k, v in trainer.model.state_dict().items() if "lora" not in k}
    a = build_tenant(trainer, config, _tenant("a", lr=1e-2), stamp=1)
    b = build_tenant(trainer, config, _tenant("b", lr=3e-2, seed=1), stamp=1)
    assert not any(torch.equal(a.params[k], b.params[k]) for k in a.params if k.endswith("lora_A"))
    train_tenant_step(b, _batch(1, seed=2))
    before_b, before_a = _snapshot(b), _snapshot(a)
    for step in (1, 2):
        train_tenant_step(a, _batch(step, seed=1))
    _assert_equal(_snapshot(b), before_b)  # B's adapter and AdamW moments: untouched
    after_a = _snapshot(a)
    assert not all(torch.equal(after_a["params"][k], before_a["params"][k]) for k in after_a["params"])
    assert all(p is a.params[k] for k, p in active_params(trainer.model).items())  # A is the active one
    assert all(torch.equal(v, base[k]) for k, v in trainer.model.state_dict().items() if "lora" not in k)
    assert b.view.optimizer.param_groups[0]["lr"] == 3e-2 and a.view.optimizer.param_groups[0]["lr"] == 1e-2
    # Each tenant published its own adapter into its own run directory.
    for run, steps in ((a, 2), (b, 1)):
        assert RunDir(tmp_path / run.name).published_steps() == list(range(1, steps + 1))
        assert [m["step"] for m in read_metrics(tmp_path / run.name)] == list(range(1, steps + 1))


def test_interleaved_tenant_equals_it_alone_and_a_one_run_trainer(model_dir, tmp_path):
    """B trained between A's steps == B trained alone in a fresh trainer == `run_trainer` on B's batches."""
    mixed, alone, single = tmp_path / "mixed", tmp_path / "alone", tmp_path / "single"
    b_tenant = _tenant("b", lr=3e-2, seed=5)
    config = _shared_config(model_dir, mixed)
    trainer = setup_trainer(shared_trainer_config(config))
    a = build_tenant(trainer, config, _tenant("a", lr=1e-1, seed=4), stamp=1)
    b = build_tenant(trainer, config, b_tenant, stamp=1)
    for step in (1, 2, 3):
        train_tenant_step(a, _batch(step, seed=7))
        train_tenant_step(b, _batch(step, seed=8))
        write_batch(single, _batch(step, seed=8))

    config_alone = _shared_config(model_dir, alone)
    b_alone = build_tenant(setup_trainer(shared_trainer_config(config_alone)), config_alone, b_tenant, stamp=1)
    for step in (1, 2, 3):
        train_tenant_step(b_alone, _batch(step, seed=8))
    _assert_equal(_snapshot(b), _snapshot(b_alone))

    run_trainer(tenant_trainer_config(config, b_tenant, single))  # the one-run trainer on the same batches
    final = load_file(RunDir(mixed / "b").weights_dir(3) / ADAPTER_WEIGHTS)
    reference = load_file(RunDir(single).weights_dir(3) / ADAPTER_WEIGHTS)
    assert final.keys() == reference.keys() and all(torch.equal(final[k], reference[k]) for k in final)
    losses = [m["loss"] for m in read_metrics(mixed / "b")]
    assert losses == [m["loss"] for m in read_metrics(single)]


def _fake_orchestrator_part(run_dir, step):
    """The orchestrator's checkpoint part of `step` (committed), as a tenant's orchestrator writes it."""
    part = RunDir(run_dir).checkpoint_part_dir(step, ORCHESTRATOR_PART)
    part.mkdir(parents=True, exist_ok=True)
    atomic_write_text(part / COMMITTED, f"{step}\n")


def _drive(tenants: Tenants, rounds: int = 3) -> None:
    for _ in range(rounds):
        tenants.scan()
        tenants.train_ready()


def test_join_leave_failure_and_resume_keep_tenants_apart(model_dir, tmp_path):
    root = tmp_path / "tenants"
    config = _shared_config(model_dir, root, max_tenants=2)
    tenants = Tenants(setup_trainer(shared_trainer_config(config)), config)
    ckpt = CheckpointConfig(interval=1)
    a_cfg, b_cfg = _tenant("a", lr=1e-1, max_steps=3, checkpoint=ckpt), _tenant("b", lr=2e-2, max_steps=3, seed=1)
    c_cfg = _tenant("c", lr=2e-2, max_steps=1, seed=2)
    for cfg in (a_cfg, b_cfg, c_cfg):
        join_tenant(root, cfg)
    for step in (1, 2):
        _fake_orchestrator_part(root / "a", step)
        write_batch(root / "a", _batch(step, seed=1))
        write_batch(root / "b", _batch(step, seed=2))
    write_batch(root / "c", _batch(1, seed=3))
    _drive(tenants)
    assert sorted(tenants.active) == ["a", "b"] and read_status(root / "c")["state"] == "waiting"  # 2 slots
    assert tenants.active["a"].step == 2 and tenants.active["b"].step == 2

    # A's step-3 batch is garbage: A fails alone; B goes on and finishes; C gets A's slot and finishes.
    batch_path(root / "a", 3, 0).parent.mkdir(parents=True)
    batch_path(root / "a", 3, 0).write_bytes(b"not msgpack")
    write_batch(root / "b", _batch(3, seed=2))
    _drive(tenants)
    status = read_status(root / "a")
    assert status["state"] == "failed" and "not a valid training batch" in status["error"], status
    assert read_status(root / "b") == {**read_status(root / "b"), "state": "done", "step": 3}
    assert read_status(root / "c")["state"] == "done" and not tenants.active

    # A rejoins from its step-2 checkpoint and ends exactly as a tenant that never failed.
    assert join_tenant(root, a_cfg, resume=True) == 2
    _fake_orchestrator_part(root / "a", 3)
    write_batch(root / "a", _batch(3, seed=1))
    _drive(tenants)
    assert read_status(root / "a")["state"] == "done"
    assert [m["step"] for m in read_metrics(root / "a")] == [1, 2, 3]
    reference_dir = tmp_path / "reference"
    for step in (1, 2, 3):
        write_batch(reference_dir, _batch(step, seed=1))
    a_alone = a_cfg.model_copy(update={"checkpoint": CheckpointConfig()})
    run_trainer(tenant_trainer_config(config, a_alone, reference_dir))
    got = load_file(RunDir(root / "a").weights_dir(3) / ADAPTER_WEIGHTS)
    want = load_file(RunDir(reference_dir).weights_dir(3) / ADAPTER_WEIGHTS)
    assert all(torch.equal(got[k], want[k]) for k in want)

    # A restarted trainer does not take A up again from its stale registration: A must rejoin with resume.
    restarted = Tenants(tenants.trainer, config)
    restarted.scan()
    status = read_status(root / "a")
    assert "a" not in restarted.active and status["state"] == "failed" and "--resume" in status["error"], status

    # B rejoins (no checkpoint: from scratch, its old steps deleted), then leaves mid-run; the trainer drops it.
    leave_tenant(root / "b")  # done already: returns at once
    assert join_tenant(root, b_cfg.model_copy(update={"max_steps": 5}), resume=True) is None
    assert RunDir(root / "b").published_steps() == [] and read_metrics(root / "b") == []
    _drive(tenants, rounds=1)
    assert "b" in tenants.active and tenants.active["b"].step == 0
    tenant_config_path(root / "b").unlink()
    _drive(tenants, rounds=1)
    assert "b" not in tenants.active and read_status(root / "b")["state"] == "left"
    assert json.loads((root / "c" / "tenant_status.json").read_text())["state"] == "failed"  # the restart, too


def test_tenant_configs_fill_the_orchestrator_and_refuse_what_cannot_work(tmp_path):
    import tomllib

    from slipstream.config.inference import InferenceConfig
    from slipstream.config.tenants import TenantRunConfig, TenantServerConfig
    from slipstream.inference.server import lora_args
    from slipstream.launch.tenant_server import build_specs

    model = {"name": "m", "lora": {"rank": 8, "max_loras": 3}}
    tenant = {"name": "a", "max_steps": 4, "seed": 3, "checkpoint": {"interval": 2}}
    run = TenantRunConfig.model_validate(
        {"model": model, "tenants_dir": str(tmp_path), "tenant": tenant, "orchestrator": {"batch_size": 4}}
    )
    orch = run.orchestrator
    assert orch.output_dir == tmp_path / "a" and orch.max_steps == 4 and orch.seed == 3
    assert orch.model.lora.name == "a" and orch.checkpoint.interval == 2
    with pytest.raises(ValueError, match="orchestrator.output_dir is set from the tenant"):
        TenantRunConfig.model_validate(
            {"model": model, "tenants_dir": str(tmp_path), "tenant": tenant, "orchestrator": {"output_dir": "x"}}
        )
    with pytest.raises(ValueError, match="add \\[model.lora\\]"):
        TenantTrainerConfig(model=ModelConfig(name="m"), tenants_dir=tmp_path)
    with pytest.raises(ValueError, match="dropout must be 0"):
        TenantTrainerConfig(model=ModelConfig(name="m", lora=LoRAConfig(dropout=0.1)), tenants_dir=tmp_path)
    assert lora_args(LoRAConfig(rank=8, max_loras=3))[-2:] == ["--max-loras", "3"]
    server = {"model": model, "tenants_dir": str(tmp_path), "inference": {"port": 8123}, "trainer": {"max_tenants": 3}}
    specs = build_specs(TenantServerConfig.model_validate(server), RunDir(tmp_path))
    assert [s.name for s in specs] == ["inference", "tenant-trainer"]
    inference = InferenceConfig.model_validate(tomllib.loads(RunDir(tmp_path).config_path("inference").read_text()))
    assert inference.model.lora.max_loras == 3 and inference.port == 8123
    trainer = TenantTrainerConfig.model_validate(
        tomllib.loads(RunDir(tmp_path).config_path("tenant-trainer").read_text())
    )
    assert trainer.tenants_dir == tmp_path and trainer.max_tenants == 3
    with pytest.raises(ValueError, match="max_loras \\(3\\) must be at least trainer.max_tenants \\(4\\)"):
        TenantServerConfig.model_validate({**server, "trainer": {"max_tenants": 4}})
    with pytest.raises(ValueError, match="name of a folder of the server"):
        join_tenant(tmp_path, _tenant("logs", lr=1e-3))
    shared = TenantTrainerConfig(model=ModelConfig(name="m", lora=LoRAConfig()), tenants_dir=tmp_path)
    one_run = tenant_trainer_config(shared, TenantConfig.model_validate(tenant), tmp_path / "a")
    assert one_run.model.lora.name == "a" and one_run.whole_run_checkpoints and one_run.max_steps == 4


def test_nan_streak_fails_only_that_tenant(model_dir, tmp_path):
    """A's huge advantages overflow the gradient norm (inf): its step is skipped, and with max_nonfinite_steps = 1
    that fails A; B, trained between, ends exactly as B alone."""
    config = _shared_config(model_dir, tmp_path)
    tenants = Tenants(setup_trainer(shared_trainer_config(config)), config)
    b_cfg = _tenant("b", lr=1e-2, max_steps=2, seed=1)
    join_tenant(tmp_path, _tenant("a", lr=1e-2, max_steps=2, max_nonfinite_steps=1))
    join_tenant(tmp_path, b_cfg)
    good = _batch(1, seed=1)
    nan_mb = msgspec.structs.replace(good.micro_batches[0], advantages=[3e38] * len(good.micro_batches[0].input_ids))
    write_batch(tmp_path / "a", msgspec.structs.replace(good, micro_batches=[nan_mb, good.micro_batches[1]]))
    for step in (1, 2):
        write_batch(tmp_path / "b", _batch(step, seed=2))
    tenants.scan()
    b = tenants.active["b"]
    _drive(tenants)
    status = read_status(tmp_path / "a")
    assert status["state"] == "failed" and "FloatingPointError" in status["error"], status
    assert read_status(tmp_path / "b")["state"] == "done" and not tenants.active

    alone = build_tenant(tenants.trainer, config, b_cfg.model_copy(update={"name": "b_alone"}), stamp=1)
    for step in (1, 2):
        train_tenant_step(alone, _batch(step, seed=2))
    _assert_equal(_snapshot(b), _snapshot(alone))


def test_the_trainer_process_loop_serves_a_tenant_and_exits_when_idle(model_dir, tmp_path):
    from slipstream.trainer.tenant_loop import run_tenant_trainer

    join_tenant(tmp_path, _tenant("a", lr=1e-2, max_steps=2))
    for step in (1, 2):
        write_batch(tmp_path / "a", _batch(step, seed=1))
    run_tenant_trainer(_shared_config(model_dir, tmp_path, exit_when_idle_s=0.2))
    assert read_status(tmp_path / "a")["state"] == "done"
    assert RunDir(tmp_path / "a").published_steps() == [1, 2]
