"""Weight loads replayed as fused copies (weights/receive/copy_plan.py): a loader that only copies received bytes into
the model (whole, fused q/k/v slices, stacked experts, through temporaries that are copied on, transposed, with constant
padding) is recorded once and replayed bit for bit on new data; anything else is refused and the loader keeps every
version."""

import struct

import pytest
import torch

from slipstream.weights.receive.copy_plan import LoadRecorder, PlanMismatch, PlannedLoads, PlanRefused

VOCAB, PADDED, H, E, W = 7, 10, 8, 2, 3


def _model(device: str = "cpu") -> dict[str, torch.Tensor]:
    return {
        n: t.to(device)
        for n, t in {
            "qkv": torch.zeros(12, H),
            "embed": torch.full((PADDED, H), 5.0),
            "w_t": torch.zeros(H, 4),
            "w13": torch.zeros(E, 2 * W, H),
            "norm": torch.zeros(H),
        }.items()
    }


def _weights(seed: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = {"q": (4, H), "k": (4, H), "v": (4, H), "embed": (VOCAB, H), "w": (4, H), "norm": (H,)}
    shapes |= {f"experts.{e}.{p}": (W, H) for e in range(E) for p in ("gate", "up")}
    return {n: torch.randn(s, generator=g).to(device) for n, s in shapes.items()}


def _buckets(weights: dict[str, torch.Tensor], sizes=(3, 4, 10)) -> list[list[tuple[str, torch.Tensor]]]:
    """The weights in buckets as a receiver hands them over: views into one flat buffer per bucket."""
    names, out, at = list(weights), [], 0
    for n in sizes:
        chunk = names[at : at + n]
        at += n
        flat = torch.cat([weights[x].reshape(-1) for x in chunk])
        views, pos = [], 0
        for x in chunk:
            views.append((x, flat[pos : pos + weights[x].numel()].view(weights[x].shape)))
            pos += weights[x].numel()
        out.append(views)
    return out


def _slot(model: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """Where a checkpoint tensor goes in the model (a view)."""
    if name in ("q", "k", "v"):
        i = "qkv".index(name)
        return model["qkv"][4 * i : 4 * i + 4]
    if name == "embed":
        return model["embed"][:VOCAB]
    if name == "w":
        return model["w_t"].t()
    if name == "norm":
        return model["norm"]
    _, e, part = name.split(".")
    return model["w13"][int(e), (0 if part == "gate" else W) : (W if part == "gate" else 2 * W)]


def direct_loader(model):
    def load(pairs):
        for name, t in pairs:
            if name == "w":
                model["w_t"].copy_(t.t().contiguous())  # a transposed layout: still a copy of a view
            else:
                _slot(model, name).copy_(t)
            if name == "embed":
                model["embed"][VOCAB:].fill_(0)  # the padding rows: the same every version

    return load


class DeferredLoader:
    """vLLM's layer-wise reload in small: a module's tensors are kept until the module is complete, then loaded into a
    fresh temporary of the module's parameter, which is copied into the parameter."""

    MODULES = {"qkv": ("q", "k", "v"), "w13": tuple(f"experts.{e}.{p}" for e in range(E) for p in ("gate", "up"))}

    def __init__(self, model):
        self.model, self.pending = model, {}

    def __call__(self, pairs):
        for name, t in pairs:
            module = next((m for m, parts in self.MODULES.items() if name in parts), None)
            if module is None:
                direct_loader(self.model)([(name, t)])
                continue
            self.pending.setdefault(module, {})[name] = t
            if len(self.pending[module]) == len(self.MODULES[module]):
                temp = torch.empty_like(self.model[module])
                view = {module: temp}
                for part, data in self.pending.pop(module).items():
                    _slot(view | {k: v for k, v in self.model.items() if k != module}, part).copy_(data)
                self.model[module].copy_(temp)


def load_bucket(loads: PlannedLoads, loader, pairs) -> None:
    """One bucket as the engine loads it: replayed from the plan, or by the loader (watched while recording)."""
    if loads.replaying():
        loads.replay(pairs)
        return
    with loads.call(pairs):
        loader(pairs)


def _run(loads: PlannedLoads, model, loader, weights, sizes=(3, 4, 10)) -> bool:
    replayed = loads.start(lambda: model.values())
    for pairs in _buckets(weights, sizes):
        load_bucket(loads, loader, pairs)
    loads.end(model.values())
    return replayed


def _expected(loader_cls, weights, device: str = "cpu"):
    model = _model(device)
    (loader_cls(model) if loader_cls is DeferredLoader else loader_cls(model))(list(weights.items()))
    return model


LOADERS = pytest.mark.parametrize("loader_cls", [direct_loader, DeferredLoader], ids=["direct", "deferred"])
DEVICES = pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")],
        ),
    ],
)


@LOADERS
@DEVICES
def test_recorded_loads_replay_bit_for_bit(loader_cls, device, fused):
    model = _model(device)
    loader = loader_cls(model)
    calls = []

    def counted(pairs):
        calls.append(len(pairs))
        loader(pairs)

    loads = PlannedLoads()
    assert not _run(loads, model, counted, _weights(0, device))  # recorded
    assert loads.plan is not None and loads.refused is None
    assert len(calls) == 3
    for seed in (1, 2):
        assert _run(loads, model, counted, _weights(seed, device))  # replayed: the loader is not called
        assert len(calls) == 3
        expected = _expected(loader_cls, _weights(seed, device), device)
        for name in model:
            assert torch.equal(model[name], expected[name]), name
    assert torch.equal(model["embed"][VOCAB:].cpu(), torch.zeros(PADDED - VOCAB, H))
    # one copy per received tensor here, replayed as one fused copy per loader call
    assert loads.plan.num_copies == len(_weights(0))
    assert fused == [len(c.copies) for c in loads.plan.calls if c.copies] * 2


@pytest.mark.parametrize(
    "transform,reason",
    [
        (lambda dst, t: dst.copy_(t * 2), "reads received weights"),
        (lambda dst, t: dst.copy_(t.to(torch.float64).float()), "reads received weights"),
        (lambda dst, t: dst.copy_(t.sum().expand_as(dst)), "reads received weights"),
        (lambda dst, t: dst.copy_(t[:1].expand_as(dst)), None),  # a broadcast view of a received row: a copy
    ],
    ids=["scaled", "dtype round trip", "checksum", "broadcast view"],
)
def test_anything_but_a_copy_is_refused(transform, reason):
    model = _model()

    def loader(pairs):
        for name, t in pairs:
            if name == "norm":
                transform(_slot(model, name), t)
            else:
                direct_loader(model)([(name, t)])

    loads = PlannedLoads()
    _run(loads, model, loader, _weights(0))
    if reason is None:
        assert loads.plan is not None
        _run(loads, model, loader, _weights(1))
        assert torch.equal(model["norm"], _weights(1)["norm"][:1].expand(H))
        return
    assert loads.plan is None and reason in loads.refused
    assert not _run(loads, model, loader, _weights(1))  # no plan: the loader keeps every version, unwatched
    assert loads.recorder is None


def test_a_derived_copy_kept_outside_the_parameters_is_refused():
    model, kept = _model(), {}

    def loader(pairs):
        direct_loader(model)(pairs)
        if any(name == "q" for name, _ in pairs):
            kept["packed"] = model["qkv"].clone()  # a repacked copy the module would use: a replay leaves it stale

    loads = PlannedLoads()
    _run(loads, model, loader, _weights(0))
    assert loads.plan is None and "kept outside the model's parameters" in loads.refused
    kept.clear()


def test_dtype_conversion_in_the_copy_is_refused():
    rec = LoadRecorder()
    dst = torch.zeros(4, dtype=torch.float64)
    src = torch.ones(4)
    with rec.call([("x", src)]):
        dst.copy_(src)
    with pytest.raises(PlanRefused, match="float32 into"):
        rec.compile([dst])


def test_partly_overwritten_received_bytes_are_refused():
    rec = LoadRecorder()
    dst = torch.zeros(8)
    src = torch.ones(8)
    with rec.call([("x", src)]):
        dst.copy_(src)
        dst[2:4].fill_(0)
    with pytest.raises(PlanRefused, match="partly overwritten"):
        rec.compile([dst])


def test_other_tensors_than_the_plans_are_a_mismatch():
    model = _model()
    loads = PlannedLoads()
    _run(loads, model, direct_loader(model), _weights(0))
    # the first call differs: the version goes to the loader and is recorded anew
    assert loads.start(lambda: model.values())
    with pytest.raises(PlanMismatch):
        loads.replay(_buckets(_weights(1), (4, 3, 10))[0])
    loads.record_instead()
    for pairs in _buckets(_weights(1), (4, 3, 10)):
        with loads.call(pairs):
            direct_loader(model)(pairs)
    loads.end(model.values())
    assert loads.plan is not None and loads.plan.calls[0].names == ("q", "k", "v", "embed")
    # a call in the middle of a version differs: that version fails, and says so
    assert loads.start(lambda: model.values())
    buckets = _buckets(_weights(2), (4, 3, 10))
    loads.replay(buckets[0])
    with pytest.raises(PlanMismatch):
        loads.replay(_buckets(_weights(2), (4, 4, 9))[1])
    with pytest.raises(PlanMismatch, match="middle of a version"):
        loads.record_instead()


def test_a_plan_is_dropped_when_the_models_storage_changes():
    """Checked at the version's first replay, not at its start (which comes before the first receives are queued):
    the first bucket is then a mismatch, loaded by the loader and recorded anew, and nothing is copied before."""
    model = _model()
    loads = PlannedLoads()
    _run(loads, model, direct_loader(model), _weights(0))
    assert loads.plan is not None
    old = model["qkv"]
    model["qkv"] = torch.zeros(12, H)  # vLLM re-allocated a parameter (a reload from disk, sleep mode)
    before = old.clone()
    looked = []
    assert loads.start(lambda: looked.append(1) or model.values())
    assert not looked  # no pass over the model's tensors yet
    buckets = _buckets(_weights(1), (3, 4, 10))
    with pytest.raises(PlanMismatch, match="memory changed"):
        loads.replay(buckets[0])
    assert looked == [1] and torch.equal(old, before) and not model["qkv"].any()
    loads.record_instead()
    for pairs in buckets:
        load_bucket(loads, direct_loader(model), pairs)
    assert loads.end(model.values()) is not None  # a new plan, for the new storage
    assert torch.equal(model["qkv"], _expected(direct_loader, _weights(1))["qkv"])
    assert _run(loads, model, None, _weights(2))  # replayed into the new storage
    assert torch.equal(model["qkv"], _expected(direct_loader, _weights(2))["qkv"])


def test_the_fit_check_runs_once_per_version_at_its_first_replay():
    model = _model()
    loads = PlannedLoads()
    _run(loads, model, direct_loader(model), _weights(0))
    looked = []
    assert loads.start(lambda: looked.append(1) or model.values())
    for pairs in _buckets(_weights(1), (3, 4, 10)):
        loads.replay(pairs)
        assert looked == [1]
    loads.end(model.values())


def test_disabled_never_records():
    model = _model()
    loads = PlannedLoads(enabled=False)
    for seed in range(2):
        assert not _run(loads, model, direct_loader(model), _weights(seed))
    assert loads.plan is None and loads.recorder is None


def test_a_version_known_to_differ_is_loaded_by_the_loader_from_its_start():
    model = _model()
    loads = PlannedLoads()
    _run(loads, model, direct_loader(model), _weights(0))
    names = [c.names for c in loads.plan.calls]
    assert loads.start(lambda: model.values())
    assert loads.expect(names)  # the same buckets: replayed
    assert not loads.expect([names[0] + names[1], *names[2:]])  # other buckets: the loader, watched
    assert loads.recorder is not None and not loads.replaying()


def _freed_temporary_then_new_tensor(loads: PlannedLoads, model, new_tensor) -> None:
    """One version whose loader copies `norm` into the model through a temporary, which is freed, and whose memory the
    next allocation takes: `new_tensor(memory)` made after it (malloc reuses freed memory as it likes; here both come
    from one buffer, so every time)."""
    memory = bytearray(4 * H)
    src = _weights(0)["norm"]
    loads.start(lambda: model.values())
    with loads.call([("norm", src)]):
        temp = torch.frombuffer(memory, dtype=torch.float32)  # a layer materialised to load into
        temp.copy_(src)
        model["norm"].copy_(temp)
        del temp  # the layer is complete: its temporary is freed
    with loads.finish():
        new_tensor(memory)
    loads.end(model.values())


def test_a_scalar_made_where_a_freed_received_temporary_was_is_no_kept_copy():
    """Issue #39: vLLM's attention layers make `_k_scale_cpu = torch.tensor(1.0)` at finalize_layerwise_reload, which
    the mode sees only as `aten.lift_fresh` (a view: the tensor is allocated before dispatch). When malloc gave it the
    memory of a freed temporary that had held received bytes, the recorder (which knew storages by their address) took
    the scale for a copy of received weights kept outside the model, and refused the plan: a flake, as whether malloc
    reuses that memory depends on what ran before (the GC freeing the loaders' reference cycles, other threads)."""
    model, layer = {"norm": torch.zeros(H)}, {}

    def scale(memory):
        kept = torch.frombuffer(memory, dtype=torch.float32, count=1).view(())
        layer["_k_scale_cpu"] = torch.ops.aten.lift_fresh.default(kept)

    loads = PlannedLoads()
    _freed_temporary_then_new_tensor(loads, model, scale)
    assert loads.refused is None and loads.plan is not None and loads.plan.num_copies == 1
    assert _run(loads, model, None, {"norm": _weights(1)["norm"]}, sizes=(1,))
    assert torch.equal(model["norm"], _weights(1)["norm"])


def test_a_constant_made_where_a_freed_received_temporary_was_is_not_replayed_as_received():
    """The same reuse without a refusal, worse: a loader that copies a constant made in the freed temporary's memory
    (filled before dispatch, as `torch.tensor(list)` is) into a parameter must leave that constant to every replay, not
    record a copy of the received bytes the memory held before."""
    model = {"norm": torch.zeros(H), "pad": torch.zeros(H)}

    def constant(memory):
        memory[:] = struct.pack(f"{H}f", *[7.0] * H)  # filled before dispatch, as `torch.tensor(list)` is
        model["pad"].copy_(torch.ops.aten.lift_fresh.default(torch.frombuffer(memory, dtype=torch.float32)))

    loads = PlannedLoads()
    _freed_temporary_then_new_tensor(loads, model, constant)
    assert loads.refused is None and loads.plan.num_copies == 1
    _run(loads, model, None, {"norm": _weights(1)["norm"]}, sizes=(1,))
    assert torch.equal(model["norm"], _weights(1)["norm"]) and torch.equal(model["pad"], torch.full((H,), 7.0))
