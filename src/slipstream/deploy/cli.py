"""`slipstream k8s render -c rl.toml --out DIR`: write the run's Kubernetes manifests (see deploy/k8s.py)."""

import sys
from pathlib import Path

USAGE = """usage: slipstream k8s render -c rl.toml [--key VALUE]... --out DIR

Write Kubernetes manifests for the run into DIR (apply them with `kubectl apply -f DIR`): StatefulSets and headless
Services for inference, trainer and orchestrator, the shared volume, the per-process configs and the admin token.
Settings: the [kubernetes] section (`slipstream rl --help` lists its options, e.g. --kubernetes.gpus 8
--kubernetes.image REPO/IMAGE:TAG); docs/kubernetes.md explains the layout.
"""


def main(argv: list[str]) -> int:
    if "-h" in argv or "--help" in argv:
        print(USAGE)
        return 0
    if not argv or argv[0] != "render":
        print(f"error: unknown k8s command {' '.join(argv[:1])!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    rest = list(argv[1:])
    out, rest = _take_out(rest)
    if out is None:
        print(f"error: --out DIR is required\n\n{USAGE}", file=sys.stderr)
        return 2
    from slipstream.config.base import ConfigError
    from slipstream.config.loader import load_config
    from slipstream.config.rl import RLConfig
    from slipstream.deploy.k8s import render_manifests, to_yaml

    try:
        files = render_manifests(load_config(RLConfig, rest))
    except ConfigError as e:
        for line in str(e).splitlines():
            print(f"error: {line}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    for name, docs in files.items():
        (out / name).write_text(to_yaml(docs))
    (out / "shared.yaml").chmod(0o600)  # holds the admin token
    print(f"wrote {', '.join(files)} into {out}; apply them with `kubectl apply -f {out}`")
    return 0


def _take_out(args: list[str]) -> tuple[Path | None, list[str]]:
    """Remove `--out DIR` / `--out=DIR` from `args`."""
    for i, arg in enumerate(args):
        if arg == "--out" and i + 1 < len(args):
            return Path(args[i + 1]), args[:i] + args[i + 2 :]
        if arg.startswith("--out="):
            return Path(arg.split("=", 1)[1]), args[:i] + args[i + 1 :]
    return None, args
