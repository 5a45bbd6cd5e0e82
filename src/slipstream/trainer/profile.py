"""`trainer.profile_steps`: chosen steps' training (the window `tokens_per_s` times: forward, backward, optimizer step)
under torch.profiler, written beside the run's metrics, so a slow step in a real run (a GPU waiting on its host, a
kernel that dominates) can be read without rerunning it in a benchmark.

Per profiled step and rank, in `<output_dir>/profiles/`:
- `trainer_step<N>_rank<R>.txt`: a header (the window's wall time, the summed self time of the device's kernels and of
  the host's operators) and the top operators by self time on the device (the host on CPU runs);
- `trainer_step<N>_rank<R>.json`: the Chrome trace of the window (open it in Perfetto or chrome://tracing).
"""

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from slipstream.utils.fs import atomic_write_text, fsync_dir

ROWS = 40
"""Operators listed in the text summary."""


def profile_paths(output_dir: Path, step: int, rank: int) -> tuple[Path, Path]:
    """The summary and the trace of `step` on `rank`."""
    base = Path(output_dir) / "profiles" / f"trainer_step{step}_rank{rank}"
    return base.with_suffix(".txt"), base.with_suffix(".json")


@contextmanager
def profiled(step: int, steps: list[int], output_dir: Path, rank: int, device: torch.device) -> Iterator[None]:
    """Run the block under torch.profiler when `step` is one of `steps` (else as is) and write its summary and trace.
    On CUDA the device is synchronized before the window closes, so the kernels the block queued are inside it."""
    if step not in steps:
        yield
        return
    from torch.profiler import ProfilerActivity, profile

    on_cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if on_cuda else [])]
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        yield
        if on_cuda:
            torch.cuda.synchronize(device)
    wall = time.perf_counter() - start
    summary, trace = profile_paths(output_dir, step, rank)
    averages = prof.key_averages()
    host_s = sum(e.self_cpu_time_total for e in averages) / 1e6
    device_s = sum(e.self_device_time_total for e in averages) / 1e6 if on_cuda else None
    busy = f"; the device's kernels {device_s:.3f} s (self times summed)" if device_s is not None else ""
    header = (
        f"trainer step {step}, rank {rank}, {device}: the window (forward, backward, optimizer step) took {wall:.3f} s "
        f"of wall time{busy}; the host's operators {host_s:.3f} s (self times summed, the profiler's own cost "
        "included)\n"
    )
    sort_by = "self_cuda_time_total" if on_cuda else "self_cpu_time_total"
    atomic_write_text(summary, header + averages.table(sort_by=sort_by, row_limit=ROWS) + "\n")
    _export_trace(prof, trace)


def _export_trace(prof, path: Path) -> None:
    """The Chrome trace written under a temporary name, fsynced, then renamed (readers never see half a trace)."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        prof.export_chrome_trace(str(tmp))
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)
