"""The receiving side of a weight stream's broadcasts (weights/wire/stream.py's BroadcastSink, or several
senders' pieces, weights/wire/pieces.py): each bucket lands in one of a few reused buffers (`weights.receive_buffers`,
2 by default) while the caller loads the ones before, and is handed on as (name, tensor) views.

Buffers and every view into them are kept from one version to the next while the plan is the same (it is, every
step of a run): a version then costs a few operations per bucket on the receiving host, not a view per tensor
(3,147 tensors for an 8-layer Qwen3-30B-A3B slice; the receiver's host time is what bounds the stream once the
sender is fast).
"""

from collections.abc import Callable, Iterator

import torch

from slipstream.weights.wire.collective import Lanes
from slipstream.weights.wire.pieces import concat
from slipstream.weights.wire.stream import Bucket, Manifest, start_broadcast, start_pieces, unpack

DirectLoader = Callable[[Bucket, torch.Tensor], bool]
"""Loads a bucket straight from its wire buffer (uint8, its piece layout) and returns True, or returns False."""

NUM_SLOTS = 2
"""Buckets in flight on a receiver by default (weights.receive_buffers): one being loaded while the next is
received."""


class ReceiveBuffers:
    """A receiver's bucket buffers and the views into them, for one plan at a time: `num_slots` buffers of the
    largest bucket (no more than the plan has buckets). With several senders these take the wire layout, and as many
    more (allocated at the first bucket laid out whole) the tensors laid out whole; loads that read the wire need no
    more."""

    def __init__(self, device: torch.device, keep_all: bool = False, num_slots: int = NUM_SLOTS) -> None:
        _check_slots(num_slots)
        self.device = device
        self.keep_all = keep_all
        """A buffer of its own per bucket, all allocated at `start`: every bucket's views stay valid until the next
        version (staging, weights/receive/staging.py: one copy of the published weights; with several senders
        `num_slots` wire buffers more)."""
        self.num_slots = num_slots
        """Buffers the receives fill (and so buckets received ahead of the caller's loads): the slots, or with several
        senders the wire buffers."""
        self.buckets: tuple[Bucket, ...] | None = None
        self.slots: list[torch.Tensor | None] = []
        self.wires: list[torch.Tensor] = []
        self.pairs: dict[int, list[tuple[str, torch.Tensor]]] = {}
        """Bucket index -> its tensors' views into its slot."""
        self.copies: dict[int, list[torch.Tensor]] = {}
        """Bucket index -> its wire segments in the whole layout's order (several senders)."""

    def resize(self, num_slots: int) -> None:
        """Use `num_slots` buffers from the next plan on (the ones held now are let go when that changes)."""
        if num_slots != self.num_slots:
            _check_slots(num_slots)
            self.release()
            self.num_slots = num_slots

    def start(self, manifest: Manifest) -> None:
        """Keep everything when the plan is the one of the last version; else size the buffers for this plan."""
        if manifest.buckets is self.buckets or manifest.buckets == self.buckets:
            return
        self.release()
        buckets = manifest.buckets
        self.buckets = buckets
        size = max((b.nbytes for b in buckets), default=0)
        n = min(self.num_slots, len(buckets))
        if manifest.senders > 1:
            self.wires = [torch.empty(size, dtype=torch.uint8, device=self.device) for _ in range(n)]
        if self.keep_all:
            self.slots = [torch.empty(b.nbytes, dtype=torch.uint8, device=self.device) for b in buckets]
        elif manifest.senders > 1:
            self.slots = [None] * n  # allocated when a bucket is first laid out (loads that read the wire need none)
        else:
            self.slots = [torch.empty(size, dtype=torch.uint8, device=self.device) for _ in range(n)]

    def flat(self, i: int) -> torch.Tensor:
        assert self.buckets is not None
        k = i % len(self.slots)
        if self.slots[k] is None:
            self.slots[k] = torch.empty(max(b.nbytes for b in self.buckets), dtype=torch.uint8, device=self.device)
        return self.slots[k][: self.buckets[i].nbytes]

    def wire(self, i: int) -> torch.Tensor:
        assert self.buckets is not None
        return self.wires[i % len(self.wires)][: self.buckets[i].nbytes]

    def views(self, i: int) -> list[tuple[str, torch.Tensor]]:
        pairs = self.pairs.get(i)
        if pairs is None:
            assert self.buckets is not None
            pairs = self.pairs[i] = unpack(self.flat(i), self.buckets[i])
        return pairs

    def reassemble(self, i: int) -> None:
        """Lay bucket i's pieces (in its wire buffer) out whole in its slot: one concatenation."""
        segments = self.copies.get(i)
        if segments is None:
            assert self.buckets is not None
            segments = self.copies[i] = self.buckets[i].layout.in_whole_order(self.wire(i))
        concat(segments, self.flat(i))

    def release(self) -> None:
        self.buckets, self.slots, self.wires, self.pairs, self.copies = None, [], [], {}, {}


def receive_buckets(
    group: "torch.distributed.ProcessGroup | Lanes",
    manifest: Manifest,
    device: torch.device,
    buffers: ReceiveBuffers | None = None,
    direct: DirectLoader | None = None,
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Yields each bucket's (name, tensor) views, in plan order. The receives of the next buckets are posted before
    the caller loads this one, one per free buffer of the largest bucket's size (`buffers.num_slots`, 2 by default:
    the next bucket only): with more buffers the sender may run further ahead of a receiver's host, whose loads then
    pace the stream less. A bucket's views are valid until the next bucket is requested (its buffer may then receive
    a later bucket: a caller that keeps views longer, as vLLM's layer-wise reload does, copies them;
    weights/receive/engine.py keep_deferred_loads). Pieces of several senders arrive on `group`'s lanes (side by
    side) into as many more such buffers and are laid out whole by one copy, unless `direct(bucket, wire)` (asked
    first, on the caller's stream) loads the bucket straight from its wire buffer and returns True: that bucket is not
    laid out and not yielded (a copy plan composed with the piece layout, weights/receive/copy_plan.py). `buffers`
    (kept by the caller from one version to the next) hold the buffers and views.

    On CUDA the broadcasts are queued from a receive stream that holds only the waits for free buffers: bucket k+1's
    broadcasts are queued before the caller's stream waits for bucket k (an event per work), so on each NCCL stream
    they follow bucket k's without a gap, and the receive of bucket k + n (n buffers) waits only for what read bucket
    k's buffer: the caller's loads of bucket k (one sender), or the layout copy or direct loads of bucket k
    (several)."""
    buckets = manifest.buckets
    lanes = len(group.groups) if isinstance(group, Lanes) else 1
    if lanes != manifest.senders:
        raise ValueError(
            f"the weight manifest of step {manifest.step} is sent by {manifest.senders} trainer rank(s), but this "
            f"worker joined a session of {lanes}: the orchestrator opens a new session when the senders change"
        )
    if not buckets:
        return
    buffers = buffers if buffers is not None else ReceiveBuffers(device)
    buffers.start(manifest)
    # The buffers the receives fill: the wire buffers with several senders (staging keeps a layout slot per bucket
    # but only these few wire buffers), else the slots.
    num_slots = len(buffers.wires) if manifest.senders > 1 else len(buffers.slots)
    recv_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
    loaded: dict[int, torch.cuda.Event] = {}

    def start(i: int) -> list:
        """Start receiving bucket i; returns its works (gloo: already complete)."""
        if recv_stream is None:
            works = _start(group, manifest, buffers, i)
            for work in works:
                work.wait()  # gloo: synchronous here (the CPU twin needs no overlap)
            return []
        # The broadcasts wait only for the buffer they fill to be free (an event on the receive stream, which holds
        # nothing else), so on each lane's NCCL stream bucket i queues right behind bucket i - 1 and starts the moment
        # it ends. Had the receive stream also waited for bucket i - 1 (as it did), bucket i would have become ready
        # together with the copies that wait for bucket i - 1: a copy kernel filling every SM first held the next
        # broadcast back for its whole length (gaps of 50-140 us between buckets in a 4 x H200 trace).
        with torch.cuda.stream(recv_stream):
            if i >= num_slots:
                recv_stream.wait_event(loaded.pop(i - num_slots))
            return _start(group, manifest, buffers, i)

    pending: dict[int, list] = {}
    posted = 0
    for i in range(len(buckets)):
        if recv_stream is not None and i >= 1 and manifest.senders == 1:
            # The caller's loads of bucket i - 1 are queued by now, so its buffer may take bucket i - 1 + num_slots.
            loaded[i - 1] = torch.cuda.current_stream(device).record_event()
        while posted < min(len(buckets), i + num_slots):  # every buffer not holding bucket i takes a later bucket
            pending[posted] = start(posted)
            posted += 1
        for work in pending.pop(i):
            work.wait()  # CUDA: the caller's stream waits for bucket i's broadcasts, not this thread
        if manifest.senders > 1:
            taken = direct is not None and direct(buckets[i], buffers.wire(i))
            if not taken:
                buffers.reassemble(i)  # on the caller's stream, after bucket i arrived and before its loads
            if recv_stream is not None:
                # Bucket i's wire buffer may take bucket i + num_slots once read: laid out (the loads read the
                # layout), or loaded from directly.
                loaded[i] = torch.cuda.current_stream(device).record_event()
            if taken:
                continue
        yield buffers.views(i)


def _check_slots(num_slots: int) -> None:
    if not isinstance(num_slots, int) or isinstance(num_slots, bool) or num_slots < 2:
        raise ValueError(f"a receiver needs at least 2 bucket buffers (weights.receive_buffers), got {num_slots!r}")


def _start(group, manifest: Manifest, buffers: ReceiveBuffers, i: int) -> list:
    if manifest.senders == 1:
        return [start_broadcast(group, buffers.flat(i))]
    return start_pieces(group, buffers.wire(i), manifest.buckets[i].layout)
