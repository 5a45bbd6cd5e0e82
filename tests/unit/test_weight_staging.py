"""No-stall weight updates (`weights.no_stall`) on the worker, over a real gloo broadcast (threads of one process):
Slipstream's vLLM engine stages a version from /update_weights with `stage` while the model's loader is never called
and vLLM's layer-wise reload is never opened, and loads it at /finish_weight_update bit-identically to a paused
receive; an error in the staging thread surfaces at finish with the model untouched; delta versions stage in the
receiver's mirror (no staging buffers) and round-trip bitwise."""

import threading
import time

import pytest
import torch

from slipstream.weights.receive import receiver as receiver_module
from slipstream.weights.receive.copy_plan import PlannedLoads
from slipstream.weights.receive.engine import SlipstreamWeightTransferEngine
from slipstream.weights.receive.receiver import WeightReceiver
from slipstream.weights.receive.staging import Stager, StagingFailed
from slipstream.weights.send.delta_send import DeltaSender
from slipstream.weights.wire.collective import GroupInit, close_group, open_group, open_store
from slipstream.weights.wire.stream import Manifest, TensorMeta, broadcast, plan_buckets
from tests.e2e.helpers import free_port
from tests.unit.test_weight_delta_transfer import _model, _step

BUCKET_BYTES = 4096
"""Small buckets: the model below goes in several."""


PLAN = tuple(plan_buckets([TensorMeta.of(n, t) for n, t in _model().items()], BUCKET_BYTES))


class FakeModel(torch.nn.Module):
    """The model a worker serves: its loader copies each (name, tensor) into its own tensor and records the call."""

    def __init__(self) -> None:
        super().__init__()
        self.tensors = {n: torch.zeros_like(t) for n, t in _model().items()}
        self.calls: list[list[str]] = []

    def load_weights(self, pairs) -> None:
        self.calls.append([n for n, _ in pairs])
        for name, tensor in pairs:
            self.tensors[name].copy_(tensor)


def _engine(receiver: WeightReceiver, model: FakeModel) -> SlipstreamWeightTransferEngine:
    """Slipstream's engine around `receiver` and `model` (vLLM's constructor needs a whole vLLM config)."""
    engine = object.__new__(SlipstreamWeightTransferEngine)
    engine.model, engine.model_config, engine.receiver = model, "model config", receiver
    engine._tied, engine._loaded, engine._layerwise, engine._prepared = [], set(), False, False
    engine.loads = PlannedLoads(enabled=False)  # every version through the loader, as on vLLM's CPU build
    engine.stager = Stager(receiver)
    return engine


@pytest.fixture
def reload_calls(monkeypatch) -> list[str]:
    """vLLM's layer-wise reload, recorded instead of run (the fake model has no vLLM layers)."""
    import vllm.model_executor.model_loader.reload as reload

    calls: list[str] = []
    monkeypatch.setattr(reload, "initialize_layerwise_reload", lambda model: calls.append("initialize"))
    monkeypatch.setattr(reload, "finalize_layerwise_reload", lambda model, config: calls.append("finalize"))
    return calls


@pytest.fixture
def session():
    """A sender group (rank 0) and two workers' receivers joined to it: (group, receivers)."""
    port = free_port()
    store = open_store("127.0.0.1", port, is_master=True, timeout_s=30)
    receivers = [WeightReceiver(torch.device("cpu"), rank_in_receivers=k) for k in range(2)]
    init = GroupInit("gloo", "127.0.0.1", port, "s1", 3, timeout_s=30)
    joins = [threading.Thread(target=r.join, args=(init,)) for r in receivers]
    for t in joins:
        t.start()
    group = open_group(store, init, 0, torch.device("cpu"))
    for t in joins:
        t.join()
    yield group, receivers
    for r in receivers:
        r.shutdown()
    close_group(group)


def _send(group, model: dict[str, torch.Tensor], pause_s: float = 0.0) -> None:
    for bucket in PLAN:
        time.sleep(pause_s)
        broadcast(group, torch.cat([model[m.name].reshape(-1).view(torch.uint8) for m in bucket.tensors]))


def _bits(tensors: dict[str, torch.Tensor]) -> dict[str, bytes]:
    return {n: bytes(t.contiguous().view(torch.uint8).numpy()) for n, t in tensors.items()}


@pytest.mark.timeout(120)
def test_a_staged_version_is_received_without_the_loader_and_swapped_in_bitwise(session, reload_calls):
    group, (staged_rx, paused_rx) = session
    staged_model, paused_model = FakeModel(), FakeModel()
    staged, paused = _engine(staged_rx, staged_model), _engine(paused_rx, paused_model)
    version = _model(seed=1)
    info = {"step": 1, "manifest": Manifest(1, PLAN).to_dict()}
    assert len(PLAN) >= 3

    staged.start_weight_update()
    began = time.perf_counter()
    staged.update_weights({**info, "stage": True})  # returns at once: nothing has been sent yet
    assert time.perf_counter() - began < 1.0 and staged.stager.active
    sender = threading.Thread(target=_send, args=(group, version, 0.05))
    sender.start()
    paused.start_weight_update()
    paused.update_weights(info)  # the paused worker loads while it receives (the same broadcast)
    sender.join()
    staged.stager._thread.join()  # the whole version is in staging memory now
    assert staged_model.calls == [] and reload_calls == ["initialize"]  # the paused worker's only
    assert all(not t.any() for t in staged_model.tensors.values())  # the model still serves what it had

    staged.finish_weight_update()  # the swap: the loader gets every bucket, inside this one call
    paused.finish_weight_update()
    assert reload_calls == ["initialize", "initialize", "finalize", "finalize"]
    assert [n for call in staged_model.calls for n in call] == [m.name for b in PLAN for m in b.tensors]
    assert _bits(staged_model.tensors) == _bits(paused_model.tensors) == _bits(version)
    assert not staged.stager.active


@pytest.mark.timeout(120)
def test_an_error_while_staging_surfaces_at_finish_and_leaves_the_model_untouched(session, reload_calls, monkeypatch):
    group, receivers = session
    model = FakeModel()
    engine = _engine(receivers[0], model)

    def broken(*args, **kwargs):
        yield from ()
        raise RuntimeError("the link went down")

    monkeypatch.setattr(receiver_module, "receive_buckets", broken)
    engine.start_weight_update()
    engine.update_weights({"step": 2, "manifest": Manifest(2, PLAN).to_dict(), "stage": True})
    with pytest.raises(StagingFailed, match="weight staging failed: version 2: RuntimeError: the link went down"):
        engine.finish_weight_update()
    assert model.calls == [] and reload_calls == []
    assert not engine.stager.active  # raised once; the next update starts clean
    with pytest.raises(StagingFailed, match="only broadcasts are staged"):
        engine.update_weights({"step": 3, "path": "/nowhere", "stage": True})


@pytest.mark.timeout(120)
def test_delta_versions_stage_in_the_mirror_and_round_trip(session, reload_calls):
    group, receivers = session
    models = [FakeModel(), FakeModel()]
    engines = [_engine(r, m) for r, m in zip(receivers, models, strict=True)]
    sender = DeltaSender(full_every=10, device=torch.device("cpu"))
    version = _model(seed=1)
    for step in (1, 2, 3):
        if step > 1:
            version = _step(version, seed=step)
        info = {"step": step, "manifest": Manifest(step, PLAN, delta=True).to_dict(), "stage": True}
        for engine in engines:
            engine.start_weight_update()
            engine.update_weights(info)
        sender.begin(step, PLAN, group, "s1")
        for i, bucket in enumerate(PLAN):
            sender.send(i, bucket, torch.cat([version[m.name].reshape(-1).view(torch.uint8) for m in bucket.tensors]))
        sender.close()  # the repair round: the staging threads take part in it
        metrics = sender.take()
        assert metrics["weights/delta_full_version"] == (1.0 if step == 1 else 0.0)
        for engine, model in zip(engines, models, strict=True):
            calls = len(model.calls)
            engine.stager._thread.join()
            assert len(model.calls) == calls  # staged, not loaded
            engine.finish_weight_update()
            assert _bits(model.tensors) == _bits(version)
            assert engine.stager.buffers.slots == []  # the mirror was the staging memory
    assert reload_calls.count("initialize") == reload_calls.count("finalize") == 6


def test_staging_memory_that_does_not_fit_fails_the_update_at_once_saying_so(monkeypatch):
    from slipstream.weights.receive.bucket_receive import ReceiveBuffers

    def out_of_memory(self, manifest):
        raise RuntimeError("DefaultCPUAllocator: not enough memory: you tried to allocate 1073741824 bytes.")

    monkeypatch.setattr(ReceiveBuffers, "start", out_of_memory)
    receiver = WeightReceiver(torch.device("cpu"))
    receiver.group = object()  # joined (nothing is received: the allocation fails first)
    stager = Stager(receiver)
    with pytest.raises(
        StagingFailed,
        match=r"weight staging failed: version 4: staging needs one more copy of the published weights \(0\.0 MiB\) "
        r"on this worker's cpu, which could not be allocated \(DefaultCPUAllocator.*set weights.no_stall = false",
    ):
        stager.start({"step": 4, "manifest": Manifest(4, PLAN).to_dict()})
    assert not stager.active  # nothing runs, nothing was received
