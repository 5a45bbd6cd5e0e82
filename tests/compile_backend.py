"""torch.compile without Inductor's kernels, for tests whose subject is what Dynamo captures (graph breaks) and what
AOTAutograd makes of it (forward/backward graphs, checkpointed regions), not the generated code.

`nn.Module.compile` (what `parallel/fsdp.apply_compile` calls on every block) is given a backend: `aot_eager` traces
the forward and backward graphs through AOTAutograd as Inductor does, and runs them with eager kernels;
`aot_eager_decomp_partition` also applies Inductor's decompositions and its min-cut partitioner (what decides a
checkpointed block's recomputation). On the
2-core CPU VM generating and building Inductor's C++ kernels for one MoE block takes 15-135 s (cold cache);
tests/unit/test_compile_moe.py keeps Inductor for one family, so one test still builds real kernels."""

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def compile_backend(backend: str) -> Iterator[None]:
    """Within the block, `nn.Module.compile` uses `backend` unless its caller names one."""
    original = torch.nn.Module.compile

    def compile_with_backend(module: torch.nn.Module, *args, **kwargs) -> None:
        original(module, *args, **{"backend": backend, **kwargs})

    torch.nn.Module.compile = compile_with_backend
    try:
        yield
    finally:
        torch.nn.Module.compile = original
