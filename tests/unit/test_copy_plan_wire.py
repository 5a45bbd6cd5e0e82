"""Copy-plan replays that read several senders' pieces straight from the buffer they arrived in
(weights/receive/copy_plan.py `replay_wire`, weights/wire/pieces.py `PieceLayout.runs`): every view a loader copies from
is split where the senders' rows meet and read on the wire, leaving the bytes a replay from the whole layout leaves; a
view that cannot be split (an index holding rows of two senders) is refused, and that bucket is laid out and replayed as
before."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from slipstream.weights.receive.copy_plan import PlanMismatch, PlannedLoads
from slipstream.weights.wire.pieces import piece_layout
from tests.unit.test_copy_plan import (
    DEVICES,
    LOADERS,
    H,
    _expected,
    _model,
    _weights,
    direct_loader,
    load_bucket,
)
from tests.unit.test_weight_pieces import _wire

ROWS = {"q": (2, 2), "k": (4, 0), "v": (1, 3), "embed": (4, 3), "w": (3, 1), "norm": (5, 3)}
"""Uneven rows and a tensor held by one sender (the experts: one row to sender 0, the rest to sender 1)."""


def _rows(name: str, shape) -> tuple[int, int]:
    return ROWS.get(name, (1, shape[0] - 1))


def _pieces(weights: dict[str, torch.Tensor], sizes=(3, 4, 10)):
    """Buckets as two senders' pieces: (names, layout, wire buffer, the tensors laid out whole as (name, view))."""
    names, out, at = list(weights), [], 0
    for n in sizes:
        chunk, at = names[at : at + n], at + n
        tensors = [weights[x] for x in chunk]
        rows = tuple(_rows(x, weights[x].shape) for x in chunk)
        layout = piece_layout([tuple(t.shape) for t in tensors], 4, rows)
        whole = torch.cat([t.reshape(-1) for t in tensors])
        pairs, pos = [], 0
        for x, t in zip(chunk, tensors, strict=True):
            pairs.append((x, whole[pos : pos + t.numel()].view(t.shape)))
            pos += t.numel()
        out.append((tuple(chunk), layout, _wire(tensors, rows), pairs))
    return out


def _version(loads: PlannedLoads, model, loader, weights) -> list[bool]:
    """One version; returns, per bucket, whether it was replayed from the wire."""
    loads.start(lambda: model.values())
    wired = []
    for names, layout, wire, pairs in _pieces(weights):
        wired.append(loads.replay_wire(names, layout, wire))
        if not wired[-1]:
            load_bucket(loads, loader, pairs)
    loads.end(model.values())
    return wired


@LOADERS
@DEVICES
def test_replays_from_the_wire_leave_the_loaders_bytes(loader_cls, device, fused):
    model = _model(device)
    loads = PlannedLoads()
    assert _version(loads, model, loader_cls(model), _weights(0, device)) == [False] * 3  # recorded by the loader
    assert loads.plan is not None
    for seed in (1, 2):
        for t in model.values():
            t.fill_(float("nan"))  # a byte the replay misses cannot keep the loads' value
        assert _version(loads, model, None, _weights(seed, device)) == [True] * 3
        expected = _expected(loader_cls, _weights(seed, device), device)
        for name in model:
            if name != "embed":  # the embedding's padding rows are a fill, kept from the loader's version
                assert torch.equal(model[name], expected[name]), name
        assert torch.equal(model["embed"][:7], expected["embed"][:7])
    # a copy is split where the senders' rows meet: more copies than the plan's, one fused copy per bucket
    assert len(fused) == 6 and sum(fused[:3]) > loads.plan.num_copies


def test_a_view_holding_two_senders_rows_in_one_index_is_laid_out_instead():
    weights = {"x": torch.randn(4, H), "y": torch.randn(2, H)}
    model = {"p": torch.zeros(2, 2 * H), "y": torch.zeros(2, H)}

    def loader(pairs):
        for name, t in pairs:
            model[name if name == "y" else "p"].copy_(t.view(2, 2 * H) if name == "x" else t)

    ROWS["x"], ROWS["y"] = (1, 3), (1, 1)  # row 0 of the (2, 2H) view is row 0 (sender 0) and row 1 (sender 1)
    try:
        loads = PlannedLoads()
        loads.start(lambda: model.values())
        ((names, layout, wire, pairs),) = _pieces(weights, sizes=(2,))
        with loads.call(pairs):
            loader(pairs)
        loads.end(model.values())
        new = {n: torch.randn_like(t) for n, t in weights.items()}
        ((names, layout, wire, pairs),) = _pieces(new, sizes=(2,))
        model["p"].zero_()
        loads.start(lambda: model.values())
        assert not loads.replay_wire(names, layout, wire)  # nothing copied: the caller lays the bucket out
        assert torch.equal(model["p"], torch.zeros(2, 2 * H))
        loads.replay(pairs)
        loads.end(model.values())
        assert torch.equal(model["p"], new["x"].view(2, 2 * H)) and torch.equal(model["y"], new["y"])
    finally:
        del ROWS["x"], ROWS["y"]


def test_a_moved_parameter_is_a_mismatch_before_anything_is_copied_from_the_wire():
    model = _model()
    loads = PlannedLoads()
    _version(loads, model, direct_loader(model), _weights(0))
    model["qkv"] = model["qkv"].clone()  # vLLM re-allocated a parameter (a reload from disk, sleep mode)
    snapshot = {n: t.clone() for n, t in model.items()}
    loads.start(lambda: model.values())
    names, layout, wire, _ = _pieces(_weights(1))[0]
    with pytest.raises(PlanMismatch, match="memory changed"):
        loads.replay_wire(names, layout, wire)
    assert all(torch.equal(model[n], t) for n, t in snapshot.items())


def test_other_tensors_on_the_wire_are_a_mismatch():
    model = _model()
    loads = PlannedLoads()
    _version(loads, model, direct_loader(model), _weights(0))
    loads.start(lambda: model.values())
    names, layout, wire, _ = _pieces(_weights(1))[0]
    with pytest.raises(PlanMismatch, match="other tensors"):
        loads.replay_wire(names[::-1], layout, wire)


@st.composite
def _views(draw):
    """A tensor's shape, its rows among 1-3 senders, and a view of it a loader may copy from: narrowed along any
    dim, possibly transposed."""
    shape = tuple(draw(st.lists(st.integers(1, 5), min_size=0, max_size=3)))
    senders = draw(st.integers(1, 3))
    total = shape[0] if shape else 1
    cuts = sorted(draw(st.lists(st.integers(0, total), min_size=senders - 1, max_size=senders - 1)))
    rows = tuple(b - a for a, b in zip([0, *cuts], [*cuts, total], strict=True))
    narrows = []
    for n in shape:
        start = draw(st.integers(0, n - 1))
        narrows.append((start, draw(st.integers(1, n - start))))
    transpose = len(shape) >= 2 and draw(st.booleans())
    return shape, rows, narrows, transpose


@settings(max_examples=300, deadline=None)
@given(_views())
def test_runs_find_every_element_of_a_view_on_the_wire(case):
    shape, rows, narrows, transpose = case
    t = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
    other = torch.randn(3, 2)  # a tensor before it in the bucket: tensor j=1's pieces are not at the wire's start
    layout = piece_layout([(3, 2), shape], 4, ((3,) + (0,) * (len(rows) - 1), rows))
    wire = _wire([other, t], ((3,) + (0,) * (len(rows) - 1), rows)).view(torch.float32)
    view = t
    for d, (start, n) in enumerate(narrows):
        view = view.narrow(d, start, n)
    if transpose:
        view = view.transpose(0, 1)
    order = sorted(range(view.dim()), key=lambda d: (view.shape[d] == 1, -view.stride(d)))
    view = view.permute(order) if order else view
    runs = layout.runs(1, view.storage_offset() * 4, tuple(view.shape), view.stride(), 4)
    assert runs is not None  # a narrowed or transposed view never holds two senders' rows in one index
    if not view.dim():
        ((first, end, at),) = runs
        assert (first, end) == (0, 1) and wire[at // 4] == view
        return
    parts = [wire.as_strided((end - first, *view.shape[1:]), view.stride(), at // 4) for first, end, at in runs]
    assert [r[:2] for r in runs] == sorted(r[:2] for r in runs)
    assert torch.equal(torch.cat(parts), view)
