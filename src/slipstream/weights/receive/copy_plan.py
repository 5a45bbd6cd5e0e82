"""Weight loads replayed as plain copies.

A receiver hands every bucket of (name, tensor) pairs to a loader (vLLM: `model.load_weights` under its layer-wise
reload), which goes tensor by tensor in Python: tens of microseconds of host time per tensor, more than the tensor
takes on the wire. But a bf16 model's loaders only move bytes: the same slices of the same incoming tensors land in
the same places of the same parameters every version. So the first version is loaded by the loader as usual while
a dispatch mode watches every tensor operation (`LoadRecorder`, weights/receive/load_recorder.py); if everything the
loader did with the received data was to copy it, unchanged, into the model's parameters (possibly through
temporaries, as vLLM's layer-wise reload does), the result is a `CopyPlan`: per loader call, the copies from views of
the incoming tensors into views of the parameters (replayed as one `_foreach_copy_`). Later versions replay
the plan instead of calling the loader.

The recording refuses (and the loader keeps every version) as soon as received data is read by anything but a copy
or a view (a dtype conversion, arithmetic, a quantization, a checksum; a transposed or sliced copy is still a copy),
copied with a dtype change or broadcast, written over partly, still held after the version by a tensor that is not
one of the model's parameters or buffers (a derived copy the plan would leave stale), or copied into a temporary
that no parameter got (a kernel that repacks weights through an operation the mode cannot see, as vLLM's CPU oneDNN
handles do: their C++ reads the tensor's memory directly).

An operation that the dispatcher never sees cannot be watched: a layer that keeps its parameter AND an unwatched
packed copy of it would be replayed into the parameter only. Slipstream's probe check after every load (log-probs
of the new version against the trainer's) is what catches that. vLLM's CPU build repacks linear weights after
loading, so on CPU the plan is refused and loads stay with vLLM; on GPU, bf16 linear and MoE layers only copy.

Several trainer ranks' pieces of a bucket (weights/wire/pieces.py) need not be laid out whole for a replay: each copy is
split where the senders' rows meet, and its parts read the buffer the pieces arrived in (`replay_wire`). That saves
a copy of every byte on the receiving GPU, where such copies delayed the next bucket's broadcasts. A copy whose view
holds two senders' rows in one index cannot be split, and that bucket is laid out and replayed as usual.

Writes the loader makes from data that was not received (a constant fill of a padded row, a default written into
a buffer) are the same every version: the replay leaves them in place.
"""

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from slipstream.weights.receive.load_recorder import Copies, LoadRecorder, Pairs, PlanRefused, View, byte_offset
from slipstream.weights.wire.pieces import PieceLayout

__all__ = ["CopyPlan", "LoadRecorder", "PlanMismatch", "PlanRefused", "PlannedLoads"]


@dataclass
class _CallPlan:
    names: tuple[str, ...]
    copies: Copies
    dsts: list[torch.Tensor] = field(default_factory=list)
    srcs: list[torch.Tensor] = field(default_factory=list)
    """Views of `last`'s tensors, the copies' sources."""
    across: bool = False
    """Some source is on another device than its destination (then every copy goes alone)."""
    last: Pairs | None = None
    """The list of pairs last replayed, held: a receiver that keeps its views hands the same list every version
    (weights/receive/bucket_receive.py), which then needs no check and no new views (~150 tensors a MoE bucket)."""
    wired: "_Wired | None" = None
    """The copies composed with the bucket's piece layout (`CopyPlan.replay_wire`), once worked out."""

    def __post_init__(self) -> None:
        self.dsts = [v.on(t.untyped_storage(), 0, t.device) for _, t, v in self.copies]

    def sources(self, pairs: Pairs) -> list[torch.Tensor]:
        """The copies' sources in `pairs` (views of its tensors)."""
        return [
            s.view.on(pairs[s.pair][1].untyped_storage(), byte_offset(pairs[s.pair][1]), pairs[s.pair][1].device)
            for s, _, _ in self.copies
        ]


@dataclass
class _Wired:
    """One loader call's copies composed with a piece layout: from the wire buffer straight into the parameters."""

    layout: PieceLayout
    srcs: list[View] | None
    """Views of the wire buffer from its first byte; None: some copy cannot read the wire (load from the whole
    layout instead)."""
    dsts: list[torch.Tensor] = field(default_factory=list)
    key: tuple[int, int] | None = None
    """The wire buffer (storage address, byte offset) that `views` are of."""
    views: list[torch.Tensor] = field(default_factory=list)


def _compose(copies: Copies, layout: PieceLayout) -> _Wired:
    """Split every copy of a loader call where the senders' rows meet, each part reading the wire where its sender's
    rows of that tensor arrived (weights/wire/pieces.py)."""
    srcs, dsts = [], []
    for source, base, dst in copies:
        view = source.view
        # the source's dims from the largest stride down (dims of one element last), the destination's alike
        order = sorted(range(len(view.shape)), key=lambda d: (view.shape[d] == 1, -view.stride[d]))
        shape = tuple(view.shape[d] for d in order)
        stride, dst_stride = tuple(view.stride[d] for d in order), tuple(dst.stride[d] for d in order)
        runs = layout.runs(source.pair, view.offset, shape, stride, view.dtype.itemsize)
        if runs is None:
            return _Wired(layout, None)
        for first, end, at in runs:
            part = (end - first, *shape[1:]) if shape else ()
            srcs.append(View(at, part, stride if shape else (), view.dtype))
            offset = dst.offset + (first * dst_stride[0] * view.dtype.itemsize if shape else 0)
            dsts.append(
                View(offset, part, dst_stride if shape else (), view.dtype).on(base.untyped_storage(), 0, base.device)
            )
    return _Wired(layout, srcs, dsts)


class PlanMismatch(Exception):
    """A loader call whose tensors are not those the plan was recorded with."""


class CopyPlan:
    """Per loader call of a version: the tensor names it gets and its copies."""

    def __init__(self, calls: list[_CallPlan], tensors: list[torch.Tensor]) -> None:
        self.calls = calls
        self.ids = [id(t) for t in tensors]
        """The model's tensors when the plan was recorded (it holds the destinations: their ids stay theirs)."""
        dests = {id(t): t for c in calls for _, t, _ in c.copies}
        self.dests = list(dests.values())
        self.ptrs = [t.data_ptr() for t in self.dests]

    @property
    def num_copies(self) -> int:
        return sum(len(c.copies) for c in self.calls)

    def fits(self, tensors: Iterable[torch.Tensor]) -> bool:
        """The model's tensors are the ones recorded, and every destination still has its memory (a reload from
        disk or sleep mode may give a parameter new storage). About a microsecond per tensor."""
        return list(map(id, tensors)) == self.ids and list(map(torch.Tensor.data_ptr, self.dests)) == self.ptrs

    def _call(self, k: int) -> _CallPlan:
        if k >= len(self.calls):
            raise PlanMismatch(f"loader call {k + 1} but the plan has {len(self.calls)}")
        return self.calls[k]

    def replay_wire(self, k: int, names: tuple[str, ...], layout: PieceLayout, wire: torch.Tensor) -> bool:
        """Call `k`'s copies straight from a bucket's wire buffer (several senders' pieces, not laid out whole):
        `names` are the bucket's tensors, `layout` its piece layout. Returns False, copying nothing, when a copy
        cannot be split where the senders' rows meet or reads another device (then lay the bucket out and `replay`);
        PlanMismatch if the names are not the plan's."""
        call = self._call(k)
        if names != call.names:
            raise PlanMismatch(f"loader call {k + 1} gets other tensors than the plan's ({len(names)} tensors)")
        wired = call.wired
        if wired is None or wired.layout != layout:
            wired = call.wired = _compose(call.copies, layout)
        if wired.srcs is None:
            return False
        key = (wire.untyped_storage().data_ptr(), byte_offset(wire))
        if key != wired.key:
            if any(d.device != wire.device for d in wired.dsts):
                return False
            wired.views = [v.on(wire.untyped_storage(), key[1], wire.device) for v in wired.srcs]
            wired.key = key
        if wired.dsts:
            torch._foreach_copy_(wired.dsts, wired.views, non_blocking=True)
        return True

    def replay(self, k: int, pairs: Pairs) -> None:
        """Call `k`'s copies from `pairs`; PlanMismatch if `pairs` are not the tensors it was recorded with."""
        call = self._call(k)
        if pairs is not call.last:
            names = tuple(name for name, _ in pairs)
            if names != call.names:
                raise PlanMismatch(f"loader call {k + 1} gets other tensors than the plan's ({len(names)} tensors)")
            call.srcs, call.last = call.sources(pairs), pairs
            call.across = any(s.device != d.device for s, d in zip(call.srcs, call.dsts, strict=True))
        if not call.copies:
            return
        srcs = call.srcs
        if call.across:
            for s, d in zip(srcs, call.dsts, strict=True):
                d.copy_(s, non_blocking=True)
            return
        # One fused copy for the whole call, whatever the sizes: a `copy_` per tensor costs ~5-15 us of host time
        # on a GPU node, so a MoE bucket's ~170 copies fell behind the link (benchmarks/RESULTS.md).
        torch._foreach_copy_(call.dsts, srcs, non_blocking=True)


class PlannedLoads:
    """A receiver's loads, version after version: the first (and any that stop matching the plan) by the loader,
    watched; the others by replaying the plan it gave. `enabled=False` always uses the loader."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.plan: CopyPlan | None = None
        self.recorder: LoadRecorder | None = None
        self.refused: str | None = None
        """Why the last recording gave no plan (then every version uses the loader)."""
        self.calls = 0
        self.replays = 0
        """Versions loaded by replaying a plan."""
        self.wire_calls = 0
        """Loader calls replayed straight from a bucket's wire buffer (`replay_wire`), over all versions."""
        self.unchecked: Callable[[], Iterable[torch.Tensor]] | None = None
        """The model's tensors, while the version's plan is not yet checked against them (`start`)."""

    def start(self, tensors: Callable[[], Iterable[torch.Tensor]]) -> bool:
        """A version begins; returns True when it is to be replayed (else the loader runs, watched if still worth it).
        `tensors` gives the model's parameters and buffers.

        Whether the plan still fits the model (the same tensors, each with its memory: a reload from disk or sleep
        mode may give a parameter new storage) is checked at the version's first replay, not here. The receiver
        calls that after queuing the first buckets' receives, so the check (a pass over the model's tensors, 0.16-0.28
        ms for the Qwen3-0.6B shape on an H200 node) overlaps the wire instead of delaying the stream's start. A plan
        that no longer fits makes that first replay raise PlanMismatch, as other tensors than the plan's do: the
        caller loads the version with the loader instead, watched (`record_instead`), and a new plan is recorded."""
        self.calls = 0
        self.unchecked = tensors if self.plan is not None else None
        self.recorder = None
        if self.plan is None and self.enabled and self.refused is None:
            self.recorder = LoadRecorder()
        return self.plan is not None

    def _check(self) -> None:
        """At the version's first replay: the plan must still fit the model (see `start`)."""
        tensors, self.unchecked = self.unchecked, None
        if tensors is not None and self.plan is not None and not self.plan.fits(tensors()):
            raise PlanMismatch(
                "the model's tensors or their memory changed since the copy plan was recorded (a reload from disk, "
                "sleep mode)"
            )

    def replaying(self) -> bool:
        return self.plan is not None

    def abandon(self) -> None:
        """The version never finished: nothing recorded of it becomes a plan (a plan being replayed stays: the
        model's tensors keep their memory)."""
        self.recorder = None

    def record_instead(self) -> None:
        """Give up on the plan at the version's first call (the pairs differ): the loader runs, watched. Later in a
        version the model is half loaded: the version fails (and the next one is loaded by the loader)."""
        had_calls, self.plan, self.unchecked = self.calls, None, None
        if had_calls:
            raise PlanMismatch("the weights stopped matching the copy plan in the middle of a version")
        self.recorder = LoadRecorder() if self.enabled else None

    def expect(self, calls: list[tuple[str, ...]]) -> bool:
        """The version's loader calls are known before it starts (the names each bucket of a manifest holds): when
        they are not the plan's, give the plan up now rather than in the middle of the version. Returns whether the
        version is still replayed."""
        if self.plan is not None and self.calls == 0 and calls != [c.names for c in self.plan.calls]:
            self.record_instead()
        return self.plan is not None

    def replay(self, pairs: Pairs) -> None:
        """The next loader call's copies from `pairs`; PlanMismatch when they are not the plan's tensors, or (at the
        version's first call) when the plan no longer fits the model."""
        assert self.plan is not None
        self._check()
        self.plan.replay(self.calls, pairs)
        self.calls += 1

    def replay_wire(self, names: tuple[str, ...], layout: PieceLayout, wire: torch.Tensor) -> bool:
        """The next loader call's copies straight from a bucket's wire buffer (CopyPlan.replay_wire); False when
        this bucket must be laid out whole and handed to `replay` (or the loader) instead. PlanMismatch as `replay`."""
        if self.plan is None:
            return False
        self._check()
        if not self.plan.replay_wire(self.calls, names, layout, wire):
            return False
        self.calls += 1
        self.wire_calls += 1
        return True

    @contextmanager
    def call(self, pairs: Pairs) -> Iterator[None]:
        """Around one loader call (watched while recording)."""
        self.calls += 1
        if self.recorder is None:
            yield
            return
        with self.recorder.call(pairs):
            yield

    @contextmanager
    def finish(self) -> Iterator[None]:
        if self.recorder is None:
            yield
            return
        with self.recorder.finish():
            yield

    def end(self, tensors: Iterable[torch.Tensor]) -> str | None:
        """The version is complete: compile what was recorded. Returns a line for the log (None if nothing new)."""
        if self.plan is not None and self.recorder is None:
            if self.calls != len(self.plan.calls):
                self.plan = None
                raise PlanMismatch("the version had fewer loader calls than the copy plan")
            self.replays += 1
            return None
        recorder, self.recorder = self.recorder, None
        if recorder is None:
            return None
        tensors = list(tensors)
        try:
            copies = recorder.compile(tensors)
        except PlanRefused as e:
            self.refused = str(e)
            return f"weight loads stay with the loader: {e}"
        self.plan = CopyPlan([_CallPlan(n, c) for n, c in zip(recorder.calls, copies, strict=True)], tensors)
        return (
            f"weight loads: a copy plan of {self.plan.num_copies} copies in {len(self.plan.calls)} calls recorded; "
            "the next versions replay it"
        )
