"""A run started against an inference server that served another run (a long-lived server, one a restarted run
reuses): the orchestrator loads the model's own checkpoint back before the first rollout and says so; a server that
has taken no weight update since it started is left alone. Against the simulated server, whose log-probs follow the
version it serves; the engine side (reading the model's folder without a READY marker) against the receiver."""

import asyncio
import logging

import pytest
import torch
from safetensors.torch import save_file

from slipstream.orchestrator.client import InferenceClient
from slipstream.orchestrator.weights import WeightRelay
from slipstream.weights.receive.receiver import WeightReceiver
from slipstream_sim import SimConfig, SimServer, serve_in_thread
from tests.unit.test_async_pipeline import MODEL, config_for, publish


def _serve_initial(config) -> None:
    async def main():
        async with InferenceClient(config.inference_url, config.model.name, config.request_timeout_s) as client:
            await WeightRelay(client, config).serve_initial()

    asyncio.run(main())


def _load(url: str, run_dir, step: int) -> None:
    """Another run's orchestrator: its version `step` loaded from its run directory."""

    async def main():
        async with InferenceClient(url, MODEL, 20) as client:
            await client.load_weights(step, {"step": step, "path": str(run_dir / "weights" / f"step_{step}")})

    publish(run_dir, step)
    asyncio.run(main())


def test_a_server_that_served_another_run_gets_the_initial_weights_back(tmp_path, caplog):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    server = SimServer(SimConfig(model_name=MODEL))
    with serve_in_thread(server) as url:
        _load(url, tmp_path / "earlier_run", 3)
        assert server.engine.version == 3
        resets = server.num_prefix_cache_resets
        config = config_for(tmp_path / "run", url, model={"name": MODEL, "path": model_dir})
        with caplog.at_level(logging.INFO, logger="slipstream.orchestrator.weights"):
            _serve_initial(config)
    assert server.engine.version == 0  # the simulator's log-probs are those of policy 0 again
    assert server.transfer.received[-1] == {"step": 0, "source": str(model_dir)}
    assert server.transfer.weight_version == "0"
    assert server.num_prefix_cache_resets > resets  # the earlier run's cached KV is gone
    assert f"weight version '3'), not this run's initial ones: loading the initial weights from {model_dir}" in (
        caplog.text
    )
    assert "inference serves the initial weights again" in caplog.text


def test_a_server_that_took_no_update_since_it_started_keeps_its_weights_and_cache(tmp_path):
    server = SimServer(SimConfig(model_name=MODEL))
    with serve_in_thread(server) as url:
        _serve_initial(config_for(tmp_path / "run", url, model={"name": MODEL, "path": tmp_path}))
    assert server.transfer.received == [] and server.transfer.weight_version == "default"
    assert server.engine.version == 0
    # what another run cached stays (its requests may still run: LoRA tenants share a server); this run's requests
    # never reuse it, their cache salts are scoped to this client start (tests/unit/test_async_pipeline.py)
    assert server.num_prefix_cache_resets == 0


def test_a_lora_run_leaves_the_base_weights_alone(tmp_path, caplog):
    """vLLM with --enable-lora takes adapters only: its layers wrap the base weights, which a full load cannot name
    (GPU vLLM 0.26, which has no /weight_info so every run found its version unknown: 'no parameter named
    embed_tokens.weight ... embed_tokens.base_layer.weight'). A LoRA run never loads base weights at its start."""
    server = SimServer(SimConfig(model_name=MODEL))
    with serve_in_thread(server) as url:
        _load(url, tmp_path / "earlier_run", 3)  # a version the server cannot vouch for
        received, resets = list(server.transfer.received), server.num_prefix_cache_resets
        config = config_for(tmp_path / "run", url, model={"name": MODEL, "path": tmp_path, "lora": {}})
        with caplog.at_level(logging.INFO, logger="slipstream.orchestrator.weights"):
            _serve_initial(config)
    assert server.transfer.received == received  # no full load
    assert server.num_prefix_cache_resets == resets  # nothing waits on the requests of another tenant
    assert "model.lora: inference keeps its base weights" in caplog.text


def test_without_the_model_folder_the_run_stops_saying_why(tmp_path):
    server = SimServer(SimConfig(model_name=MODEL))
    with serve_in_thread(server) as url:
        _load(url, tmp_path / "earlier_run", 1)
        with pytest.raises(RuntimeError, match="cannot load the initial ones back: model.path is unset"):
            _serve_initial(config_for(tmp_path / "run", url))  # model.name is a Hub-style id, no folder
    assert server.engine.version == 1


def test_the_receiver_reads_a_model_folder_without_ready_marker_only_as_version_0(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    save_file({"w": torch.arange(4, dtype=torch.float32)}, str(folder / "model.safetensors"))
    receiver, loaded = WeightReceiver(torch.device("cpu")), []
    stats = receiver.receive({"step": 0, "model": str(folder)}, loaded.extend)
    assert stats.names == {"w"} and stats.source == str(folder) and torch.equal(loaded[0][1], torch.arange(4.0))
    with pytest.raises(FileNotFoundError, match="no READY marker"):  # a published version must be complete
        receiver.receive({"step": 0, "path": str(folder)}, loaded.extend)
    with pytest.raises(ValueError, match="'model' needs step 0"):
        receiver.receive({"step": 2, "model": str(folder)}, loaded.extend)


def test_a_weight_update_left_unfinished_is_closed_before_the_next(monkeypatch):
    """An incomplete version stops its run with vLLM's layer-wise reload still open (its layers on the meta device);
    the next run's first update on that server closes it first, which gives those layers their tensors back."""
    import vllm.model_executor.model_loader.reload as reload

    from slipstream.weights.receive.copy_plan import PlannedLoads
    from slipstream.weights.receive.engine import SlipstreamWeightTransferEngine

    calls = []
    monkeypatch.setattr(reload, "finalize_layerwise_reload", lambda model, config: calls.append(("finalize", config)))
    monkeypatch.setattr(reload, "initialize_layerwise_reload", lambda model: calls.append(("initialize",)))
    from slipstream.weights.receive.receiver import WeightReceiver
    from slipstream.weights.receive.staging import Stager

    engine = object.__new__(SlipstreamWeightTransferEngine)  # the state a version that failed midway leaves
    engine.model, engine.model_config, engine._layerwise = torch.nn.Linear(2, 2), "model config", True
    engine.loads = PlannedLoads(enabled=True)
    engine.stager = Stager(WeightReceiver(torch.device("cpu")))
    engine.loads.start(lambda: [])  # recording the version that failed
    engine.start_weight_update()
    assert calls == [("finalize", "model config")]  # closed; this version's reload opens where its loads begin
    engine._prepare(None)
    assert calls[1:] == [("initialize",)]
    assert engine._layerwise and engine.loads.recorder is not None  # a fresh recording, not the failed version's
    engine._layerwise = False
    engine.start_weight_update()  # after a version that finished: nothing to close
    engine._prepare(None)
    assert calls[2:] == [("initialize",)]
