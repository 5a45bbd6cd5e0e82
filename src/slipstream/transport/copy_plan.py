"""Weight loads replayed as plain copies.

A receiver hands every bucket of (name, tensor) pairs to a loader (vLLM: `model.load_weights` under its layer-wise
reload), which goes tensor by tensor in Python: tens of microseconds of host time per tensor, more than the tensor
takes on the wire. But a bf16 model's loaders only move bytes: the same slices of the same incoming tensors land in
the same places of the same parameters every version. So the first version is loaded by the loader as usual while
a dispatch mode watches every tensor operation (`LoadRecorder`); if everything the loader did with the received
data was to copy it, unchanged, into the model's parameters (possibly through temporaries, as vLLM's layer-wise
reload does), the result is a `CopyPlan`: per loader call, the copies from views of the incoming tensors into views
of the parameters (small ones fused into one `_foreach_copy_`). Later versions replay the plan instead of calling the
loader.

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

Writes the loader makes from data that was not received (a constant fill of a padded row, a default written into
a buffer) are the same every version: the replay leaves them in place.
"""

import gc
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

aten = torch.ops.aten
Pairs = list[tuple[str, torch.Tensor]]
FUSED_MAX_BYTES = 1 << 20
"""Copies up to this size are replayed by one fused `_foreach_copy_` per call (their cost is host time); larger ones
by a `copy_` each, a device memcpy, as the loaders made them (the fused elementwise kernel gains nothing there)."""
_FILLS = {aten.fill_.Scalar, aten.zero_.default}
_COPIES = {aten.clone.default, aten._to_copy.default}


class PlanRefused(Exception):
    """The loader did something with received data that a replay of copies cannot reproduce."""


@dataclass(frozen=True)
class View:
    """A strided view `offset` bytes from a base's first byte."""

    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype

    def on(self, storage: torch.UntypedStorage, base: int, device: torch.device) -> torch.Tensor:
        """This view of `storage`, `base` bytes into it being the base's first byte."""
        byte = base + self.offset
        size = self.dtype.itemsize
        if byte % size:
            raise PlanRefused(f"a view at byte {byte} is not aligned to its {self.dtype}")
        return torch.empty(0, dtype=self.dtype, device=device).set_(storage, byte // size, self.shape, self.stride)


@dataclass(frozen=True)
class Received:
    """Bytes of the `pair`-th tensor handed to the loader's `call`-th call of the version, seen as `view`."""

    call: int
    pair: int
    view: View


@dataclass
class _Write:
    start: int
    end: int
    """The destination's bytes in its storage (a contiguous span)."""
    source: Received | None
    """None: data that was not received (a fill, a copy of something else)."""


def _leaves(*trees) -> list[torch.Tensor]:
    return [x for x in tree_leaves(trees) if isinstance(x, torch.Tensor)]


def _ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _offset(t: torch.Tensor) -> int:
    """Bytes from the storage's start to the tensor's first element."""
    return t.storage_offset() * t.element_size()


def _extent(t: torch.Tensor) -> int:
    """Bytes from the tensor's first element to one past its last."""
    if t.numel() == 0:
        return 0
    return (sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True)) + 1) * t.element_size()


def _is_meta(tensors: list[torch.Tensor]) -> bool:
    return any(t.device.type == "meta" for t in tensors)


def _aliases(func) -> bool:
    """A view: every output aliases an input, none written."""
    returns = func._schema.returns
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


def _written(func, args, kwargs) -> list[torch.Tensor]:
    """The tensors an op writes into (in-place and out= arguments)."""
    out = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        out += _leaves(value)
    return out


class LoadRecorder(TorchDispatchMode):
    """Watches one version's loads (`call` per loader call, then `finish` around whatever completes the loads) and
    compiles them into a CopyPlan (`compile`). Any step it cannot reproduce sets `refused`."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, ...]] = []
        self.inputs: dict[int, list[tuple[int, int, int, int]]] = {}
        """Storage -> spans (start, end, call, pair) of the tensors handed to the loader."""
        self.writes: dict[int, list[_Write]] = {}
        self.received: set[int] = set()
        """Storages holding received bytes (apart from the inputs)."""
        self.sources: set[Received] = set()
        """Every received view that was copied anywhere: each must reach the model (see `compile`)."""
        self.holders: list[tuple[weakref.ref, int]] = []
        """Tensors that held received bytes, with their storage: alive after the version -> a derived copy."""
        self.refused: str | None = None

    @contextmanager
    def call(self, pairs: Pairs) -> Iterator[None]:
        """One loader call on `pairs`, watched."""
        k = len(self.calls)
        self.calls.append(tuple(name for name, _ in pairs))
        spans: dict[int, list[tuple[int, int, int, int]]] = {}
        for j, (_, t) in enumerate(pairs):
            if t.device.type != "meta":
                spans.setdefault(_ptr(t), []).append((_offset(t), _offset(t) + _extent(t), k, j))
        self.inputs.update({p: sorted(s) for p, s in spans.items()})  # a reused buffer: its new contents
        with self:
            yield

    @contextmanager
    def finish(self) -> Iterator[None]:
        """Whatever completes the version's loads (vLLM: finalize_layerwise_reload), watched."""
        with self:
            yield

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.refused is None:
            try:
                self._observe(func, args, kwargs, out)
            except PlanRefused as e:
                self.refused = str(e)
            except Exception as e:  # never let the watching break the load it watches
                self.refused = f"the recorder could not follow {func}: {type(e).__name__}: {e}"
        return out

    # ---- what each operation does to the received bytes

    def _observe(self, func, args, kwargs, out) -> None:
        ins, outs = _leaves(args, kwargs), _leaves(out)
        if _is_meta(ins + outs):
            return  # vLLM counts a loader's elements by running it on meta tensors
        if func is aten.copy_.default:
            self._copy(args[0], args[1])
            return
        if _aliases(func):
            for t in outs:
                self._hold(t)
            return
        fresh = [t for t in outs if not any(t is w for w in _written(func, args, kwargs))]
        for t in fresh:
            self._forget(_ptr(t))  # a new allocation: whatever that memory held before is gone
        if func in _COPIES and len(fresh) == 1 and fresh[0].dtype == args[0].dtype:
            self._copy(fresh[0], args[0])
            return
        if func in _FILLS:
            self._unreceived(args[0])
            return
        for t in ins:
            if self._is_received(t):
                raise PlanRefused(f"{func} reads received weights (shape {tuple(t.shape)}): not a plain copy")
        for t in _written(func, args, kwargs):
            self._unreceived(t)

    def _is_received(self, t: torch.Tensor) -> bool:
        return _ptr(t) in self.inputs or _ptr(t) in self.received

    def _hold(self, t: torch.Tensor) -> None:
        if _ptr(t) in self.received:
            self.holders.append((weakref.ref(t), _ptr(t)))

    def _forget(self, ptr: int) -> None:
        self.writes.pop(ptr, None)
        self.inputs.pop(ptr, None)
        self.received.discard(ptr)

    def _unreceived(self, dst: torch.Tensor) -> None:
        if _ptr(dst) in self.inputs:
            raise PlanRefused(f"the loader writes into a received tensor (shape {tuple(dst.shape)})")
        start = _offset(dst)
        self._record(dst, _Write(start, start + _extent(dst), None))

    def _record(self, dst: torch.Tensor, write: _Write) -> None:
        self.writes.setdefault(_ptr(dst), []).append(write)
        if write.source is not None:
            self.sources.add(write.source)
            self.received.add(_ptr(dst))
            self.holders.append((weakref.ref(dst), _ptr(dst)))

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if not self._is_received(src):
            self._unreceived(dst)
            return
        if src.shape != dst.shape or src.dtype != dst.dtype:
            raise PlanRefused(
                f"received weights copied from {tuple(src.shape)} {src.dtype} into {tuple(dst.shape)} {dst.dtype}"
            )
        if not dst.is_contiguous():
            raise PlanRefused(f"received weights copied into a strided view {tuple(dst.shape)} {dst.stride()}")
        if _ptr(dst) in self.inputs:
            raise PlanRefused(f"the loader writes into a received tensor (shape {tuple(dst.shape)})")
        start = _offset(dst)
        if _ptr(src) in self.inputs:
            self._record(dst, _Write(start, start + _extent(dst), self._locate(src)))
            return
        # a copy of a temporary that holds received bytes: follow them, byte for byte
        if not src.is_contiguous():
            raise PlanRefused(f"received weights copied out of a strided view {tuple(src.shape)} {src.stride()}")
        lo, hi, delta = _offset(src), _offset(src) + _extent(src), start - _offset(src)
        followed = list(self.writes.get(_ptr(src), []))  # before the write below (dst may be src itself)
        self._record(dst, _Write(start, start + _extent(dst), None))  # bytes not received, unless a write below
        for w in followed:
            if w.end <= lo or w.start >= hi:
                continue
            if w.start < lo or w.end > hi:
                raise PlanRefused("part of a received tensor's copy is copied on: not a whole view")
            self._record(dst, _Write(w.start + delta, w.end + delta, w.source))

    def _locate(self, src: torch.Tensor) -> Received:
        lo = _offset(src)
        hi = lo + _extent(src)
        for start, end, call, pair in self.inputs[_ptr(src)]:
            if start <= lo and hi <= end:
                view = View(lo - start, tuple(src.shape), tuple(src.stride()), src.dtype)
                return Received(call, pair, view)
        raise PlanRefused(f"a copy of received bytes {lo}..{hi} spans several received tensors")

    # ---- the plan

    def compile(self, tensors: Iterable[torch.Tensor]) -> "CopyPlan":
        """The plan for the model whose parameters and buffers are `tensors`; raises PlanRefused."""
        if self.refused is not None:
            raise PlanRefused(self.refused)
        tensors = list(tensors)
        kept = {}
        for t in tensors:
            if t.device.type != "meta" and t.numel():
                kept.setdefault(_ptr(t), t)
        gc.collect()  # temporaries of the loads freed through reference cycles
        for ref, ptr in self.holders:
            t = ref()
            if t is not None and ptr not in kept and _ptr(t) == ptr:
                raise PlanRefused(
                    f"a copy of received weights (shape {tuple(t.shape)}) is kept outside the model's parameters"
                )
        copies: list[list[tuple[Received, torch.Tensor, View]]] = [[] for _ in self.calls]
        for ptr, writes in self.writes.items():
            if ptr not in kept:
                continue
            for source, dst_view in _resolve(writes):
                copies[source.call].append((source, kept[ptr], dst_view))
        planned = {source for c in copies for source, _, _ in c}
        lost = sorted(self.sources - planned, key=lambda s: (s.call, s.pair))
        if lost:  # copied into a temporary that no parameter got: consumed by something the mode cannot see
            name = self.calls[lost[0].call][lost[0].pair]
            raise PlanRefused(
                f"received {name!r} was copied into a temporary that none of the model's parameters got (the layer "
                "may keep a repacked copy made by an operation that is not watched)"
            )
        return CopyPlan([_CallPlan(names, tuple(c)) for names, c in zip(self.calls, copies, strict=True)], tensors)


def _resolve(writes: list[_Write]) -> list[tuple[Received, View]]:
    """The received writes that hold in the end (a later write replaces what it covers of an earlier one), each with
    its destination view from the storage's start."""
    final: list[_Write] = []
    for w in writes:
        keep = []
        for old in final:
            if old.end <= w.start or old.start >= w.end:
                keep.append(old)  # disjoint
            elif w.start <= old.start and old.end <= w.end:
                continue  # replaced whole
            elif old.source is not None:
                raise PlanRefused("received weights are partly overwritten after their copy")
            else:
                keep += [_Write(a, b, None) for a, b in ((old.start, w.start), (w.end, old.end)) if a < b]
        final = [*keep, w]
    out = []
    for w in final:
        if w.source is None:
            continue
        view = w.source.view
        if w.end - w.start != view.dtype.itemsize * _numel(view.shape):
            raise PlanRefused("a received copy's size changed on the way")
        out.append((w.source, View(w.start, view.shape, _contiguous_strides(view.shape), view.dtype)))
    return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(strides))


@dataclass
class _CallPlan:
    names: tuple[str, ...]
    copies: tuple[tuple[Received, torch.Tensor, View], ...]
    """(source, a tensor of the destination's storage, the destination's view from that storage's start)."""
    dsts: list[torch.Tensor] = field(default_factory=list)
    srcs: list[torch.Tensor] = field(default_factory=list)
    keys: tuple = ()
    """The incoming tensors `srcs` were built on (identity and address), so they are rebuilt only when these change."""
    last: Pairs | None = None
    """The list of pairs last replayed, held: a receiver that keeps its views hands the same list every version
    (transport/bucket_receive.py), which then needs no check at all (~150 tensors a MoE bucket)."""

    def __post_init__(self) -> None:
        self.dsts = [v.on(t.untyped_storage(), 0, t.device) for _, t, v in self.copies]
        self.large = [i for i, d in enumerate(self.dsts) if d.numel() * d.element_size() > FUSED_MAX_BYTES]
        large = set(self.large)
        self.small = [i for i in range(len(self.dsts)) if i not in large]
        self.small_dsts = [self.dsts[i] for i in self.small]

    def sources(self, pairs: Pairs) -> list[torch.Tensor]:
        keys = tuple((id(t), t.data_ptr()) for _, t in pairs)
        if keys != self.keys:
            self.srcs = [
                s.view.on(pairs[s.pair][1].untyped_storage(), _offset(pairs[s.pair][1]), pairs[s.pair][1].device)
                for s, _, _ in self.copies
            ]
            self.keys = keys
        return self.srcs


class PlanMismatch(Exception):
    """A loader call whose tensors are not those the plan was recorded with."""


class CopyPlan:
    """Per loader call of a version: the tensor names it gets and its copies."""

    def __init__(self, calls: list[_CallPlan], tensors: list[torch.Tensor]) -> None:
        self.calls = calls
        self.ids = [id(t) for t in tensors]
        """The model's tensors when the plan was recorded (it holds the destinations: their ids stay theirs)."""
        dests = {id(t): t for c in calls for _, t, _ in c.copies}
        self.dests = [(t, t.data_ptr()) for t in dests.values()]

    @property
    def num_copies(self) -> int:
        return sum(len(c.copies) for c in self.calls)

    def fits(self, tensors: Iterable[torch.Tensor]) -> bool:
        """The model's tensors are the ones recorded, and every destination still has its memory (a reload from
        disk or sleep mode may give a parameter new storage). About a microsecond per tensor."""
        return [id(t) for t in tensors] == self.ids and all(t.data_ptr() == p for t, p in self.dests)

    def replay(self, k: int, pairs: Pairs) -> None:
        """Call `k`'s copies from `pairs`; PlanMismatch if `pairs` are not the tensors it was recorded with."""
        if k >= len(self.calls):
            raise PlanMismatch(f"loader call {k + 1} but the plan has {len(self.calls)}")
        call = self.calls[k]
        if pairs is not call.last:
            names = tuple(name for name, _ in pairs)
            if names != call.names:
                raise PlanMismatch(f"loader call {k + 1} gets other tensors than the plan's ({len(names)} tensors)")
            call.sources(pairs)
            call.last = pairs
        if not call.copies:
            return
        srcs = call.srcs
        if any(s.device != d.device for s, d in zip(srcs, call.dsts, strict=True)):
            for s, d in zip(srcs, call.dsts, strict=True):
                d.copy_(s, non_blocking=True)
            return
        for i in call.large:
            call.dsts[i].copy_(srcs[i], non_blocking=True)
        if call.small:
            torch._foreach_copy_(call.small_dsts, [srcs[i] for i in call.small], non_blocking=True)


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

    def start(self, tensors: Callable[[], Iterable[torch.Tensor]]) -> bool:
        """A version begins; returns True when it will be replayed (else the loader runs, watched if still worth it).
        `tensors` gives the model's parameters and buffers."""
        self.calls = 0
        if self.plan is not None and not self.plan.fits(tensors()):
            self.plan = None  # the model's storage changed (a reload from disk, sleep mode): record again
        self.recorder = None
        if self.plan is None and self.enabled and self.refused is None:
            self.recorder = LoadRecorder()
        return self.plan is not None

    def replaying(self) -> bool:
        return self.plan is not None

    def record_instead(self) -> None:
        """Give up on the plan at the version's first call (the pairs differ): the loader runs, watched. Later in a
        version the model is half loaded: the version fails (and the next one is loaded by the loader)."""
        had_calls, self.plan = self.calls, None
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
        assert self.plan is not None
        self.plan.replay(self.calls, pairs)
        self.calls += 1

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
        try:
            self.plan = recorder.compile(tensors)
        except PlanRefused as e:
            self.refused = str(e)
            return f"weight loads stay with the loader: {e}"
        return (
            f"weight loads: a copy plan of {self.plan.num_copies} copies in {len(self.plan.calls)} calls recorded; "
            "the next versions replay it"
        )
