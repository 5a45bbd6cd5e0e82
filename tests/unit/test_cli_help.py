"""`slipstream <command> --help` lists every option of its config (recursively), with its type (a Literal's values
spelled out), default and doc; only the options set elsewhere (HELP_SKIP: shared top-level keys, derived ones) are
left out, and only exactly those (no prefix match swallowing `--orchestrator.seed_requests`)."""

import importlib
import typing

import pytest
from pydantic import BaseModel

from slipstream.cli import CONFIG_COMMANDS
from slipstream.cli import main as cli_main
from slipstream.config.loader import _model_of, type_label


def _leaves(cls: type[BaseModel], prefix: str = "") -> dict[str, typing.Any]:
    out = {}
    for name, field in cls.model_fields.items():
        sub = _model_of(field.annotation)
        if sub is not None:
            out.update(_leaves(sub, f"{prefix}{name}."))
        else:
            out[f"--{prefix}{name}"] = field
    return out


@pytest.mark.parametrize("command", sorted(CONFIG_COMMANDS))
def test_help_lists_every_option_with_type_default_and_doc(command, capsys):
    config_module, config_name, _, _ = CONFIG_COMMANDS[command]
    module = importlib.import_module(config_module)
    leaves = _leaves(getattr(module, config_name))
    skip = getattr(module, "HELP_SKIP", ())
    assert cli_main([command, "--help"]) == 0
    text = capsys.readouterr().out
    listed = {line.split()[0] for line in text.splitlines() if line.startswith("  --")}
    skipped = {o for o in leaves if any(o == s or o.startswith(f"{s}.") for s in skip)}
    assert listed == set(leaves) - skipped
    for s in skip:  # every skip names real options
        assert any(o == s or o.startswith(f"{s}.") for o in leaves), s
    for option in listed:
        field = leaves[option]
        line = next(line for line in text.splitlines() if line.startswith(f"  {option}  "))
        assert type_label(field.annotation) in line
        assert ("required" in line) == field.is_required()
        if field.description:
            assert field.description.split()[0] in text.split(line, 1)[1].split("\n  --", 1)[0]


def test_the_keys_a_prefix_match_used_to_swallow_are_listed(capsys):
    cli_main(["rl", "--help"])
    text = capsys.readouterr().out
    assert "--orchestrator.seed_requests  (bool" in text
    assert "--trainer.model_impl  (one of {'auto', 'custom', 'hf'}, default 'auto')" in text
    assert "--orchestrator.seed  " not in text and "--trainer.model.name" not in text  # set at the top level
    assert type_label(typing.Literal["a", "b"] | None) == "one of {'a', 'b'} | None"


def test_help_shows_the_defaults_a_section_is_given(capsys):
    """SFT's `optim = OptimConfig(lr=2e-5)`: its lr default is 2e-5, not OptimConfig's own 1e-6."""
    cli_main(["sft", "--help"])
    text = capsys.readouterr().out
    assert "--optim.lr  (float, default 2e-05)" in text
    assert "--optim.eps  (float, default 1e-08)" in text
