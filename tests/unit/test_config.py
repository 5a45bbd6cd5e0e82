"""Config parsing: TOML files, dotted overrides, shared RL fields, and one-line errors naming the key."""

import re
import subprocess
import sys
import tomllib

import pytest

from slipstream.config import ConfigError, RLConfig, TrainerConfig
from slipstream.config.loader import load_config, parse_cli

BASE = """
max_steps = 5
output_dir = "out/run"
[model]
name = "some-model"
[trainer.optim]
lr = 2e-6
[orchestrator]
batch_size = 8
group_size = 4
"""


@pytest.fixture
def base_toml(tmp_path):
    path = tmp_path / "rl.toml"
    path.write_text(BASE)
    return path


def test_parse_cli_values_and_flags():
    files, overrides, replaced = parse_cli(
        ["-c", "a.toml", "--config", "b.toml", "--a.b", "3", "--a.c=x y", "--flag", "--n", "[1, 2]", "--t", "{x = 1}"]
    )
    assert [str(f) for f in files] == ["a.toml", "b.toml"]
    assert overrides == {"a": {"b": 3, "c": "x y"}, "flag": True, "n": [1, 2], "t": {"x": 1}}
    assert replaced == ["t"]


def test_text_fields_take_the_value_as_typed(base_toml):
    """A value TOML reads as a time, an integer or a boolean, or cannot read, is the text typed where the field is
    text; elsewhere TOML's reading stands (and a wrong one is an error naming the key)."""
    cfg = load_config(
        RLConfig,
        ["-c", str(base_toml), "--slurm.time_limit", "12:00:00", "--slurm.mem", "0", "--slurm.partition", "true"]
        + ["--slurm.env.OMP_NUM_THREADS", "4", "--model.name", "org/m", "--model.revision", "1234567"]
        + ["--output_dir", "2024", "--slurm.job_name", '"quoted"', "--slurm.account", "a=b:c"],
    )
    assert (cfg.slurm.time_limit, cfg.slurm.mem, cfg.slurm.partition) == ("12:00:00", "0", "true")
    assert cfg.slurm.env == {"OMP_NUM_THREADS": "4"} and cfg.slurm.job_name == "quoted" and cfg.slurm.account == "a=b:c"
    assert cfg.model.revision == cfg.trainer.model.revision == "1234567"
    assert str(cfg.output_dir) == str(cfg.trainer.output_dir) == "2024"
    assert cfg.seed == 0 and cfg.trainer.optim.lr == 2e-6
    with pytest.raises(ConfigError, match=r"^seed: Input should be a valid integer \(got datetime\.time\(12, 0\)\)$"):
        load_config(RLConfig, ["-c", str(base_toml), "--seed", "12:00:00"])
    with pytest.raises(ConfigError, match=r"^slurm\.mem: Input should be a valid string \(got True\)$"):
        load_config(RLConfig, ["-c", str(base_toml), "--slurm.mem"])  # a bare flag stays a boolean


def test_slurm_text_fields_written_bare_in_toml(tmp_path):
    """`mem = 0` and `time_limit = 12:00:00` in a TOML file are an integer and a time there: the text written."""
    path = tmp_path / "rl.toml"
    path.write_text(BASE + "[slurm]\nmem = 0\ntime_limit = 12:00:00\n")
    cfg = load_config(RLConfig, ["-c", str(path)])
    assert (cfg.slurm.mem, cfg.slurm.time_limit) == ("0", "12:00:00")
    with pytest.raises(ConfigError, match=r"^slurm\.mem: String should have at least 1 character"):
        load_config(RLConfig, ["-c", str(path), "--slurm.mem", '""'])


def test_a_table_given_whole_replaces_the_files_one(base_toml, tmp_path):
    env = tmp_path / "env.toml"
    env.write_text('[orchestrator.env]\nname = "reverse_text"\nargs = { num_tasks = 10, min_words = 2 }\n')
    files = ["-c", str(base_toml), "-c", str(env)]

    def args(*overrides):
        return load_config(RLConfig, [*files, *overrides]).orchestrator.env.args

    assert args() == {"num_tasks": 10, "min_words": 2}
    assert args("--orchestrator.env.args", "{}") == {}
    assert args("--orchestrator.env.args", "{ max_words = 3 }") == {"max_words": 3}
    assert args("--orchestrator.env.args", '{"num_tasks": 4}') == {"num_tasks": 4}  # JSON, as often written
    assert args("--orchestrator.env.args.max_words", "3") == {"num_tasks": 10, "min_words": 2, "max_words": 3}
    assert args("--orchestrator.env.args={}", "--orchestrator.env.args.num_tasks", "2") == {"num_tasks": 2}
    assert args("--orchestrator.env.args.max_words", "3", "--orchestrator.env.args", "{}") == {}
    # a section given whole: its other keys go back to their defaults, not the files' values
    cfg = load_config(RLConfig, [*files, "--orchestrator.env", '{ name = "wordle" }'])
    assert (cfg.orchestrator.env.name, cfg.orchestrator.env.args) == ("wordle", {})


def test_rl_shared_fields_are_copied_into_sections(base_toml):
    cfg = load_config(RLConfig, ["-c", str(base_toml)])
    for section in (cfg.inference, cfg.orchestrator, cfg.trainer):
        assert section.model.name == "some-model"
        assert section.seed == 0
    assert cfg.trainer.max_steps == cfg.orchestrator.max_steps == 5
    assert str(cfg.trainer.output_dir) == "out/run"
    assert cfg.trainer.optim.lr == 2e-6
    assert cfg.orchestrator.inference_url == "http://127.0.0.1:8000"


def test_later_files_and_overrides_win(base_toml, tmp_path):
    second = tmp_path / "b.toml"
    second.write_text("[trainer.optim]\nlr = 5e-6\n[inference]\nport = 8123\n")
    cfg = load_config(
        RLConfig, ["-c", str(base_toml), "-c", str(second), "--trainer.optim.lr", "1e-5", "--max-steps", "7"]
    )
    assert cfg.trainer.optim.lr == 1e-5
    assert cfg.max_steps == cfg.trainer.max_steps == 7
    assert cfg.orchestrator.inference_url == "http://127.0.0.1:8123"


def test_unknown_key_suggests_the_right_one(base_toml):
    with pytest.raises(ConfigError, match=r"unknown key trainer\.optim\.lrr; did you mean trainer\.optim\.lr\?"):
        load_config(RLConfig, ["-c", str(base_toml), "--trainer.optim.lrr", "1e-5"])


def test_wrong_type_names_key_and_value(base_toml):
    with pytest.raises(ConfigError, match=r"trainer\.optim\.lr: .*number.*'fast'"):
        load_config(RLConfig, ["-c", str(base_toml), "--trainer.optim.lr", "fast"])


def test_missing_required_field():
    with pytest.raises(ConfigError) as e:
        load_config(RLConfig, ["--model.name", "m"])
    assert str(e.value) == "max_steps is required; set it in the TOML file or with --max_steps VALUE"


def test_a_shared_key_is_reported_once_by_its_top_level_name(base_toml):
    """model, seed, ... are copied into every section that uses them: a mistake in one is one line, naming the key
    the user sets."""
    cases = {
        ("--model.dtype", "float"): r"model\.dtype: Input should be 'float32' or 'bfloat16' \(got 'float'\)",
        ("--seed", "x"): r"seed: Input should be a valid integer.*\(got 'x'\)",
        ("--model.revision", "v1"): r"model: model\.revision only applies to Hugging Face Hub ids.*",
        ("--checkpoint.interval", "-1"): r"checkpoint\.interval: .*",
        ("--trainer.max_stepz", "3"): r"unknown key trainer\.max_stepz; did you mean max_steps\?",
    }
    for argv, message in cases.items():
        with pytest.raises(ConfigError) as e:
            load_config(RLConfig, ["-c", str(base_toml), *argv])
        assert re.fullmatch(message, str(e.value)), (argv, str(e.value))


def test_cross_field_rule_says_what_to_change(base_toml):
    with pytest.raises(ConfigError, match=r"batch_size \(10\) must be a multiple of group_size \(4\)"):
        load_config(RLConfig, ["-c", str(base_toml), "--orchestrator.batch_size", "10"])


def test_section_conflicting_with_shared_field(base_toml):
    with pytest.raises(ConfigError, match=r"trainer\.max_steps differs from the top-level max_steps"):
        load_config(RLConfig, ["-c", str(base_toml), "--trainer.max_steps", "3"])


def test_bad_toml_and_missing_file(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("max_steps = = 3")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(RLConfig, ["-c", str(bad)])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(RLConfig, ["-c", str(tmp_path / "nope.toml")])


def test_round_trip_through_toml(base_toml, tmp_path):
    cfg = load_config(RLConfig, ["-c", str(base_toml), "--inference.extra_args", '["--foo", "1"]'])
    out = tmp_path / "resolved.toml"
    cfg.write_toml(out)
    again = RLConfig.model_validate(tomllib.loads(out.read_text()))
    assert again == cfg
    cfg.trainer.write_toml(tmp_path / "trainer.toml")
    trainer = load_config(TrainerConfig, ["-c", str(tmp_path / "trainer.toml")])
    assert trainer == cfg.trainer


def test_cli_prints_one_line_errors_without_traceback(base_toml):
    proc = subprocess.run(
        [sys.executable, "-m", "slipstream", "rl", "-c", str(base_toml), "--orchestrator.group_sise", "2"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("error: unknown key orchestrator.group_sise; did you mean orchestrator.group_size?")
    assert "Traceback" not in proc.stderr


def test_help_is_fast_and_lists_options():
    proc = subprocess.run([sys.executable, "-m", "slipstream", "trainer", "--help"], capture_output=True, text=True)
    assert proc.returncode == 0
    assert "--optim.lr" in proc.stdout and "Learning rate." in proc.stdout
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, slipstream.cli as c; c.main(['rl','--help']); print('torch' in sys.modules)",
        ],
        capture_output=True,
        text=True,
    )
    assert proc.stdout.strip().endswith("False")


def test_storage_errors_become_one_clear_line(monkeypatch, capsys, tmp_path):
    """Disk full / read-only output: the process exits 1 with the path and the fix, not a traceback."""
    import errno
    import types

    import slipstream.cli as cli

    def full_disk(config):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "weights" / "step_3"))

    fake = types.ModuleType("fake_run")
    fake.run = full_disk
    monkeypatch.setitem(sys.modules, "fake_run", fake)
    monkeypatch.setitem(
        cli.CONFIG_COMMANDS, "trainer", ("slipstream.config.trainer", "TrainerConfig", "fake_run", "run")
    )
    code = cli.main(["trainer", "--model.name", "m", "--max_steps", "1", "--output_dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 1
    assert err.startswith(f"error: cannot write {tmp_path / 'weights' / 'step_3'}: No space left on device; free space")
    assert "Traceback" not in err


def test_context_parallel_groups_share_one_batch(base_toml):
    cfg = load_config(RLConfig, ["-c", str(base_toml), "--launch.num_trainer_procs", "4", "--trainer.parallel.cp", "2"])
    assert cfg.orchestrator.num_trainer_ranks == 2  # one batch per group of cp ranks
    with pytest.raises(ConfigError, match=r"trainer.parallel.cp \(3\) must divide launch.num_trainer_procs \(4\)"):
        load_config(RLConfig, ["-c", str(base_toml), "--launch.num_trainer_procs", "4", "--trainer.parallel.cp", "3"])
    with pytest.raises(ConfigError, match=r"ep \(2\) must be a multiple of trainer.parallel.cp \(4\)"):
        load_config(RLConfig, ["-c", str(base_toml), "--trainer.parallel.ep", "2", "--trainer.parallel.cp", "4"])


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (
            ["--deployment.run", '["trainer", "orchestrator"]', "--launch.num_trainer_procs", "1"],
            "only part of the run",
        ),
        (["--orchestrator.inference_url", "http://10.0.0.7:8000"], "inference runs on 10.0.0.7"),
    ],
)
def test_ipc_transport_needs_the_whole_run_on_one_machine(base_toml, overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(RLConfig, ["-c", str(base_toml), "--weights.transport", "ipc", *overrides])
    assert load_config(RLConfig, ["-c", str(base_toml), "--weights.transport", "ipc"]).weights.transport == "ipc"
