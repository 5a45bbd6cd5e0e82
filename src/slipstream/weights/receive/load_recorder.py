"""Watching a receiver's weight loads (weights/receive/copy_plan.py replays what this finds): a dispatch mode that
follows every received byte through the loader's operations into the model's parameters, possibly through temporaries
(as vLLM's layer-wise reload materialises a layer, then copies it into the kernel tensors), and refuses at the first
step a replay of copies could not reproduce (copy_plan.py's docstring gives the rules).

Storages are known by identity (`storage_key`), never by address: memory a freed temporary held is handed out again
by malloc, also to tensors the mode never sees allocated (`torch.tensor(1.0)` dispatches only `aten.lift_fresh`, a
view; a tensor of another thread), which an address would take for the temporary (issue #39)."""

import gc
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

aten = torch.ops.aten
Pairs = list[tuple[str, torch.Tensor]]
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


Copies = tuple[tuple[Received, torch.Tensor, View], ...]
"""One loader call's copies: (source, a tensor of the destination's storage, the destination's view from that
storage's start)."""


@dataclass
class _Write:
    start: int
    end: int
    """The destination's bytes in its storage (a contiguous span)."""
    source: Received | None
    """None: data that was not received (a fill, a copy of something else)."""


def _leaves(*trees) -> list[torch.Tensor]:
    return [x for x in tree_leaves(trees) if isinstance(x, torch.Tensor)]


def storage_key(t: torch.Tensor) -> StorageWeakRef:
    """The tensor's storage, by identity (its key in the recorder): a weak reference keeps the storage's record, not
    its memory, so no later storage has this key while the recorder holds it. Its memory's address would not do: a
    later tensor may be given it (above)."""
    return StorageWeakRef(t.untyped_storage())


def byte_offset(t: torch.Tensor) -> int:
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
    compiles them into the copies that replay them (`compile`). Any step it cannot reproduce sets `refused`."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, ...]] = []
        self.inputs: dict[StorageWeakRef, list[tuple[int, int, int, int]]] = {}
        """Storage -> spans (start, end, call, pair) of the tensors handed to the loader."""
        self.writes: dict[StorageWeakRef, list[_Write]] = {}
        self.received: set[StorageWeakRef] = set()
        """Storages holding received bytes (apart from the inputs)."""
        self.sources: set[Received] = set()
        """Every received view that was copied anywhere: each must reach the model (see `compile`)."""
        self.holders: list[tuple[weakref.ref, StorageWeakRef]] = []
        """Tensors that held received bytes, with their storage: alive after the version -> a derived copy."""
        self.refused: str | None = None

    @contextmanager
    def call(self, pairs: Pairs) -> Iterator[None]:
        """One loader call on `pairs`, watched."""
        k = len(self.calls)
        self.calls.append(tuple(name for name, _ in pairs))
        spans: dict[StorageWeakRef, list[tuple[int, int, int, int]]] = {}
        for j, (_, t) in enumerate(pairs):
            if t.device.type != "meta":
                spans.setdefault(storage_key(t), []).append((byte_offset(t), byte_offset(t) + _extent(t), k, j))
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
        key = storage_key(t)
        return key in self.inputs or key in self.received

    def _hold(self, t: torch.Tensor) -> None:
        key = storage_key(t)
        if key in self.received:
            self.holders.append((weakref.ref(t), key))

    def _unreceived(self, dst: torch.Tensor) -> None:
        if storage_key(dst) in self.inputs:
            raise PlanRefused(f"the loader writes into a received tensor (shape {tuple(dst.shape)})")
        start = byte_offset(dst)
        self._record(dst, _Write(start, start + _extent(dst), None))

    def _record(self, dst: torch.Tensor, write: _Write) -> None:
        key = storage_key(dst)
        self.writes.setdefault(key, []).append(write)
        if write.source is not None:
            self.sources.add(write.source)
            self.received.add(key)
            self.holders.append((weakref.ref(dst), key))

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
        if storage_key(dst) in self.inputs:
            raise PlanRefused(f"the loader writes into a received tensor (shape {tuple(dst.shape)})")
        start = byte_offset(dst)
        if storage_key(src) in self.inputs:
            self._record(dst, _Write(start, start + _extent(dst), self._locate(src)))
            return
        # a copy of a temporary that holds received bytes: follow them, byte for byte
        if not src.is_contiguous():
            raise PlanRefused(f"received weights copied out of a strided view {tuple(src.shape)} {src.stride()}")
        lo, hi, delta = byte_offset(src), byte_offset(src) + _extent(src), start - byte_offset(src)
        followed = list(self.writes.get(storage_key(src), []))  # before the write below (dst may be src itself)
        self._record(dst, _Write(start, start + _extent(dst), None))  # bytes not received, unless a write below
        for w in followed:
            if w.end <= lo or w.start >= hi:
                continue
            if w.start < lo or w.end > hi:
                raise PlanRefused("part of a received tensor's copy is copied on: not a whole view")
            self._record(dst, _Write(w.start + delta, w.end + delta, w.source))

    def _locate(self, src: torch.Tensor) -> Received:
        lo = byte_offset(src)
        hi = lo + _extent(src)
        for start, end, call, pair in self.inputs[storage_key(src)]:
            if start <= lo and hi <= end:
                view = View(lo - start, tuple(src.shape), tuple(src.stride()), src.dtype)
                return Received(call, pair, view)
        raise PlanRefused(f"a copy of received bytes {lo}..{hi} spans several received tensors")

    # ---- the plan

    def compile(self, tensors: list[torch.Tensor]) -> list["Copies"]:
        """Per loader call, the copies that replay it into the model whose parameters and buffers are `tensors`;
        raises PlanRefused."""
        if self.refused is not None:
            raise PlanRefused(self.refused)
        kept: dict[StorageWeakRef, torch.Tensor] = {}
        for t in tensors:
            if t.device.type != "meta" and t.numel():
                kept.setdefault(storage_key(t), t)
        gc.collect()  # temporaries of the loads freed through reference cycles
        for ref, key in self.holders:
            t = ref()
            if t is not None and key not in kept and storage_key(t) == key:
                raise PlanRefused(
                    f"a copy of received weights (shape {tuple(t.shape)}) is kept outside the model's parameters"
                )
        copies: list[list[tuple[Received, torch.Tensor, View]]] = [[] for _ in self.calls]
        for key, writes in self.writes.items():
            if key not in kept:
                continue
            for source, dst_view in _resolve(writes):
                copies[source.call].append((source, kept[key], dst_view))
        planned = {source for c in copies for source, _, _ in c}
        lost = sorted(self.sources - planned, key=lambda s: (s.call, s.pair))
        if lost:  # copied into a temporary that no parameter got: consumed by something the mode cannot see
            name = self.calls[lost[0].call][lost[0].pair]
            raise PlanRefused(
                f"received {name!r} was copied into a temporary that none of the model's parameters got (the layer "
                "may keep a repacked copy made by an operation that is not watched)"
            )
        return [tuple(c) for c in copies]


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
