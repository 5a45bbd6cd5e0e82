"""weights.master_port 0 (the default): `slipstream rl` picks a free port where it starts both the trainer and the
orchestrator; anything else that needs the port and was not given one fails with a message."""

import socket

import pytest

from slipstream.config.base import ConfigError
from slipstream.config.rl import RLConfig
from slipstream.config.weights import WeightsConfig
from slipstream.launch.local import choose_store_port
from tests.e2e.helpers import tiny_rl_config


def _config(tmp_path, transport: str, run: list[str], port: int = 0) -> RLConfig:
    raw = tiny_rl_config(tmp_path / "model", tmp_path / "out", max_steps=1)
    raw["weights"] = {"transport": transport, "master_port": port}
    raw.setdefault("deployment", {})["run"] = run
    return RLConfig.model_validate(raw)


def test_auto_port_is_free_and_written_for_trainer_and_orchestrator(tmp_path):
    config = choose_store_port(_config(tmp_path, "gloo", ["inference", "trainer", "orchestrator"]))
    port = config.weights.master_port
    assert 0 < port < 65536
    with socket.socket() as s:  # nobody listens there yet: the trainer can open its store on it
        s.bind((config.weights.master_addr, port))


def test_fixed_ports_filesystem_and_inference_only_are_left_alone(tmp_path):
    assert (
        choose_store_port(_config(tmp_path, "gloo", ["trainer", "orchestrator"], port=4321)).weights.master_port == 4321
    )
    assert choose_store_port(_config(tmp_path, "filesystem", ["trainer", "orchestrator"])).weights.master_port == 0
    assert choose_store_port(_config(tmp_path, "gloo", ["inference"])).weights.master_port == 0


def test_auto_port_split_across_launches_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="weights.master_port = 0 .* needs the trainer and the orchestrator"):
        choose_store_port(_config(tmp_path, "gloo", ["inference", "trainer"]))


def test_processes_started_without_a_port_say_what_to_set():
    with pytest.raises(ValueError, match="set --weights.master_port to a free TCP port"):
        WeightsConfig(transport="gloo").store_port("the trainer")
    assert WeightsConfig(transport="gloo", master_port=5000).store_port("the trainer") == 5000
