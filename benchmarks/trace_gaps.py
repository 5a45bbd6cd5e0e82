"""Where the GPU waits: the idle gaps of a torch.profiler Chrome trace (`trainer_throughput.py --profile PATH`
writes PATH.json), with the Python frames of Slipstream that were running on the host meanwhile.

    python benchmarks/trace_gaps.py prof.txt.json [--top 15]

Busy time is the union of kernels, copies and memsets; a gap is time between them. Each of the largest gaps is
listed with the operators and Slipstream frames that overlap it (frames need the trace's Python stacks, which
`--profile` records)."""

import argparse
import json
from pathlib import Path

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_CATEGORIES = ("cpu_op", "python_function", "user_annotation", "cuda_runtime")


def busy_and_gaps(events: list[dict]) -> tuple[float, float, list[tuple[float, float, float]]]:
    """(span, busy, gaps as (length, start, end)) of the GPU events, in microseconds."""
    spans = sorted((e["ts"], e["ts"] + e.get("dur", 0)) for e in events)
    if not spans:
        raise ValueError("the trace holds no GPU events: profile with CUDA activity on a GPU")
    busy, gaps = 0.0, []
    cur_start, cur_end = spans[0]
    for start, end in spans[1:]:
        if start > cur_end:
            busy += cur_end - cur_start
            gaps.append((start - cur_end, cur_end, start))
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    busy += cur_end - cur_start
    return spans[-1][1] - spans[0][0], busy, gaps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", type=Path)
    parser.add_argument("--top", type=int, default=15, help="list this many of the largest gaps")
    args = parser.parse_args()
    data = json.loads(args.trace.read_text())
    events = [e for e in (data["traceEvents"] if isinstance(data, dict) else data) if e.get("ph") == "X"]
    gpu = [e for e in events if e.get("cat") in GPU_CATEGORIES]
    host = [e for e in events if e.get("cat") in HOST_CATEGORIES and e.get("dur", 0) > 0]
    span, busy, gaps = busy_and_gaps(gpu)
    t0 = min(e["ts"] for e in gpu)
    print(
        f"GPU span {span / 1e3:.1f} ms, busy {busy / 1e3:.1f} ms, idle {(span - busy) / 1e3:.1f} ms in {len(gaps)} gaps"
    )
    small = sum(g for g, _, _ in gaps if g <= 50)
    print(f"gaps <= 0.05 ms (launch latency): {small / 1e3:.1f} ms; larger gaps: {(span - busy - small) / 1e3:.1f} ms")
    for length, start, end in sorted(gaps, reverse=True)[: args.top]:
        over = sorted(
            (e for e in host if e["ts"] < end and e["ts"] + e["dur"] > start and e["dur"] > 0.3 * length),
            key=lambda e: e["dur"],
        )
        ops = "; ".join(f"{e['name'][:60]} ({e['dur'] / 1e3:.1f} ms)" for e in over if e["cat"] != "python_function")
        print(f"gap {length / 1e3:6.2f} ms at +{(start - t0) / 1e3:7.1f} ms: {ops[:300]}")
        for e in [e for e in over if e["cat"] == "python_function" and "slipstream" in e["name"]][:6]:
            print(f"    {e['name'][:110]} ({e['dur'] / 1e3:.2f} ms)")


if __name__ == "__main__":
    main()
