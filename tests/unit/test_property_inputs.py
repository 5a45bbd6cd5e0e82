"""Property-based: invalid configs and malformed batch files give a clean, documented error naming the key or the
file (ConfigError / BatchFormatError), never a raw exception, and a failed write leaves no half-written output."""

import errno
import math
from pathlib import Path

import msgspec
import pytest
import tomli_w
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slipstream import cli
from slipstream.config import ConfigError, RLConfig
from slipstream.config.loader import deep_merge, describe_fields, load_config
from slipstream.launch.plan import config_paths, write_configs
from slipstream.transport.rollouts import (
    BatchFormatError,
    MicroBatch,
    TrainingBatch,
    batch_path,
    read_batch,
    wait_for_batch,
    write_batch,
)

# derandomize: CI runs the same examples every time (a failure reproduces); new inputs come from changing the tests
FAST = settings(
    max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
BASE = {"max_steps": 3, "model": {"name": "some-model"}, "orchestrator": {"batch_size": 8, "group_size": 4}}
LEAF_KEYS = [option.removeprefix("--") for option, _, _ in describe_fields(RLConfig)]
SECTIONS = sorted({key.rsplit(".", 1)[0] for key in LEAF_KEYS if "." in key})
NAMES = sorted({part for key in LEAF_KEYS for part in key.split(".")})

scalars = st.one_of(
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.text(max_size=12),
)
toml_values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.one_of(st.sampled_from(NAMES), st.text(max_size=6)), inner)
    ),
    max_leaves=8,
)


def set_dotted(data: dict, key: str, value: object) -> dict:
    node = data
    *parents, leaf = key.split(".")
    for part in parents:
        child = node.get(part)
        node[part] = child = dict(child) if isinstance(child, dict) else {}
        node = child
    node[leaf] = value
    return data


def load_or_config_error(tmp_path: Path, data: dict) -> tuple[RLConfig | None, str]:
    """Load `data` through a TOML file like `slipstream rl -c`; any exception but ConfigError fails the test."""
    path = tmp_path / "rl.toml"
    path.write_text(tomli_w.dumps(data))
    try:
        return load_config(RLConfig, ["-c", str(path)]), ""
    except ConfigError as e:
        message = str(e)
        assert message.strip() and all(line.strip() for line in message.splitlines()), repr(message)
        return None, message


@FAST
@given(key=st.sampled_from(LEAF_KEYS), value=toml_values)
def test_a_wrong_value_for_any_key_names_that_key(tmp_path, key, value):
    config, message = load_or_config_error(tmp_path, set_dotted(deep_merge(BASE, {}), key, value))
    if config is None:
        # the key (or the table holding it: `orchestrator.model` is a shared key), or, for cross-field rules, its
        # name and where it lives
        parts = key.split(".")
        prefixes = [".".join(parts[:i]) for i in range(min(2, len(parts)), len(parts) + 1)]
        leaf, section = parts[-1], ".".join(parts[:-1])
        assert any(p in message for p in prefixes) or (leaf in message and section in message), (key, message)


@FAST
@given(extra=st.dictionaries(st.one_of(st.sampled_from(NAMES + SECTIONS), st.text(max_size=8)), toml_values))
def test_random_keys_and_tables_give_a_config_error_or_a_valid_config(tmp_path, extra):
    config, message = load_or_config_error(tmp_path, deep_merge(BASE, extra))
    unknown = [k for k in extra if k not in RLConfig.model_fields and not isinstance(extra[k], dict)]
    if unknown:
        assert config is None and "unknown key" in message


@FAST
@given(data=st.binary(max_size=200))
def test_a_config_file_that_is_not_toml_names_the_file(tmp_path, data):
    path = tmp_path / "bad.toml"
    path.write_bytes(data)
    try:
        load_config(RLConfig, ["-c", str(path)])
    except ConfigError as e:
        assert str(path) in str(e) or "is required" in str(e) or "unknown key" in str(e), str(e)


ARGV_TOKENS = st.one_of(
    st.sampled_from(["-c", "--config", "--", "-", "--=", "--.", "--a..b", ".", "/", "--max-steps", "--model"]),
    st.sampled_from([f"--{k}" for k in LEAF_KEYS]),
    st.text(max_size=10),
)


@FAST
@given(argv=st.lists(ARGV_TOKENS, max_size=6))
def test_any_command_line_gives_a_clean_error_or_a_run(tmp_path, monkeypatch, capsys, argv):
    base = tmp_path / "base.toml"
    base.write_text(tomli_w.dumps(BASE))
    started = []
    monkeypatch.setattr("slipstream.launch.local.run_rl", lambda config: started.append(config) or 0)
    monkeypatch.chdir(tmp_path)
    rc = cli.main(["rl", "-c", str(base), *argv])
    err = capsys.readouterr().err
    if rc == 0:
        assert len(started) == 1 or "-h" in argv or "--help" in argv
    else:
        assert rc == 2 and not started and err.startswith("error: "), err
        assert "Traceback" not in err


def valid_batch(num_tokens: int = 4, step: int = 1, rank: int = 0) -> TrainingBatch:
    mb = MicroBatch(
        input_ids=list(range(num_tokens)),
        position_ids=list(range(num_tokens)),
        loss_mask=[False] + [True] * (num_tokens - 1),
        advantages=[0.0] + [0.5] * (num_tokens - 1),
        inference_logprobs=[0.0] + [-1.0] * (num_tokens - 1),
        temperatures=[1.0] * num_tokens,
    )
    return TrainingBatch(step=step, rank=rank, num_loss_tokens=num_tokens - 1, micro_batches=[mb])


def read_or_format_error(path: Path) -> TrainingBatch | None:
    try:
        return read_batch(path)
    except BatchFormatError as e:
        assert str(path) in str(e), str(e)
        return None


@FAST
@given(data=st.binary(max_size=300))
def test_random_bytes_are_a_batch_format_error(tmp_path, data):
    path = tmp_path / "rank_0.msgpack"
    path.write_bytes(data)
    read_or_format_error(path)


@FAST
@given(cut=st.integers(min_value=0), num_tokens=st.integers(min_value=2, max_value=40))
def test_a_truncated_batch_is_a_batch_format_error(tmp_path, cut, num_tokens):
    encoded = msgspec.msgpack.encode(valid_batch(num_tokens))
    path = tmp_path / "rank_0.msgpack"
    path.write_bytes(encoded[: cut % len(encoded)])
    assert read_or_format_error(path) is None


ARRAYS = ["input_ids", "position_ids", "loss_mask", "advantages", "inference_logprobs", "temperatures"]


@FAST
@given(
    lengths=st.fixed_dictionaries({name: st.integers(min_value=0, max_value=6) for name in ARRAYS}),
    version=st.integers(min_value=-5, max_value=5),
    field=st.sampled_from(["step", "rank", "num_loss_tokens", "format_version", "micro_batches", "metrics"]),
    junk=st.one_of(st.text(max_size=5), st.floats(allow_nan=True), st.lists(st.integers(), max_size=2), st.none()),
)
def test_wrong_shapes_versions_and_types_are_batch_format_errors(tmp_path, lengths, version, field, junk):
    mb = {name: [1] * n if name in ("input_ids", "position_ids") else [True] * n for name, n in lengths.items()}
    mb |= {k: [0.5] * lengths[k] for k in ("advantages", "inference_logprobs", "temperatures")}
    raw = {"step": 1, "rank": 0, "num_loss_tokens": 1, "micro_batches": [mb], "format_version": version}
    path = tmp_path / "rank_0.msgpack"
    path.write_bytes(msgspec.msgpack.encode(raw))
    batch = read_or_format_error(path)
    if batch is not None:
        assert version == 1 and len(set(lengths.values())) == 1
    raw[field] = junk
    path.write_bytes(msgspec.msgpack.encode(raw))
    read_or_format_error(path)


def test_a_batch_under_another_steps_name_is_refused(tmp_path):
    write_batch(tmp_path, valid_batch(step=2))
    batch_path(tmp_path, 2, 0).rename(batch_path(tmp_path, 2, 0).with_name("rank_1.msgpack"))
    with pytest.raises(BatchFormatError, match="step 2 rank 0, expected step 2 rank 1"):
        wait_for_batch(tmp_path, 2, 1, timeout_s=1)


@FAST
@given(fail_at=st.integers(min_value=1, max_value=4), existing=st.booleans())
def test_a_failed_config_write_leaves_all_old_or_all_new_files(tmp_path_factory, monkeypatch, fail_at, existing):
    """`slipstream rl` writes the resolved configs first; a write failing midway (disk full) must not leave a mix."""
    out = tmp_path_factory.mktemp("run")
    config = load_config(RLConfig, ["--max-steps", "3", "--model.name", "m", "--output-dir", str(out)])
    if existing:
        write_configs(config.model_copy(update={"max_steps": 2}))
    before = {p.name: p.read_bytes() for p in (out / "config").glob("*")} if existing else {}
    import slipstream.utils.fs as fs

    real, calls = fs.atomic_write_bytes, []

    def flaky(path, data):
        calls.append(path)
        if len(calls) == fail_at:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real(path, data)

    monkeypatch.setattr(fs, "atomic_write_bytes", flaky)
    with pytest.raises(OSError):
        write_configs(config)
    monkeypatch.undo()
    after = {p.name: p.read_bytes() for p in (out / "config").glob("*")} if (out / "config").exists() else {}
    assert after == before  # the old configs (or none), never a mix with new ones
    assert sorted(p.name for p in out.iterdir()) == (["config"] if existing else [])
    assert set(before) in (set(), {p.name for p in config_paths(config).values()})


def test_nan_and_infinite_values_are_refused_where_they_make_no_sense(tmp_path):
    for key in ("trainer.optim.lr", "orchestrator.sampling.temperature", "orchestrator.request_timeout_s"):
        for value in (math.nan, math.inf, -math.inf):
            config, message = load_or_config_error(tmp_path, set_dotted(deep_merge(BASE, {}), key, value))
            assert config is None and key in message, (key, value, message)


@settings(max_examples=20, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(depth=st.integers(min_value=0, max_value=3))
def test_an_output_dir_through_a_file_is_a_clean_error_and_writes_nothing(tmp_path_factory, capsys, depth):
    root = tmp_path_factory.mktemp("out")
    blocker = root / "a_file"
    blocker.write_text("not a folder")
    out = blocker.joinpath(*[f"d{i}" for i in range(depth)])
    rc = cli.main(["rl", "--max-steps", "1", "--model.name", "m", "--output-dir", str(out)])
    err = capsys.readouterr().err
    assert rc == 1 and err.startswith("error: cannot write") and "Traceback" not in err, err
    assert sorted(p.name for p in root.iterdir()) == ["a_file"] and blocker.read_text() == "not a folder"
