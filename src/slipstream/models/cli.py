"""`slipstream model ...`: import GGUF models into the model cache, build tiny random models for tests."""

import argparse
from pathlib import Path

from slipstream.models.tiny import FAMILIES
from slipstream.models.tiny_vlm import VLM_FAMILIES


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="slipstream model", description="Model utilities.")
    sub = parser.add_subparsers(dest="action", required=True)
    imp = sub.add_parser("import", help="import a known model alias or a GGUF file into the model cache")
    imp.add_argument("source", help="alias (e.g. smollm2-135m-instruct) or path to a .gguf file")
    imp.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="model cache (default $SLIPSTREAM_CACHE_DIR or ~/.cache/slipstream)",
    )
    imp.add_argument("--force", action="store_true", help="re-import even if the folder exists")
    tiny = sub.add_parser(
        "tiny",
        help="build a tiny random model with a locally trained tokenizer (for tests); the vision-language families "
        f"({', '.join(VLM_FAMILIES)}) come with an image processor",
    )
    tiny.add_argument("--family", choices=(*FAMILIES, *VLM_FAMILIES), required=True)
    tiny.add_argument("--out", type=Path, required=True, help="output folder")
    tiny.add_argument("--seed", type=int, default=0)
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.action == "import":
        from slipstream.models.gguf_import import import_model

        try:
            path = import_model(args.source, cache_dir=args.cache_dir, force=args.force)
        except (ValueError, FileNotFoundError) as e:
            print(f"error: {e}")
            return 2
        print(path)
        return 0
    if args.family in VLM_FAMILIES:
        from slipstream.models.tiny_vlm import build_tiny_vlm

        print(build_tiny_vlm(args.out, seed=args.seed, family=args.family))
        return 0
    from slipstream.models.tiny import build_tiny_model

    print(build_tiny_model(args.family, args.out, seed=args.seed))
    return 0
