"""The trainer's model as a stream of Hugging Face tensors, one layer at a time: every rank gathers a layer's FSDP
shards (the layer's FSDP unit is unsharded in one all-gather, the next layer's gather already in flight; parameters
outside any unit fall back to `full_tensor()`; all collectives, so all ranks iterate in lockstep), the tensors are
cast to the published dtype and renamed (our models through their family's adapter, experts unstacked), and only
that layer is held in full.

The stream's metadata (names, dtypes, shapes) is known before any gather, so the bucket plan can be sent first.
"""

import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from slipstream.transport.weight_stream import TensorMeta

_WRAPPER_PARTS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")
"""Name parts added by activation checkpointing, torch.compile and wrappers; not part of the model's names."""
_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True)
class _Piece:
    """One HF tensor: taken from our tensor `source` (index `index` of its first dim, or the whole tensor)."""

    hf_name: str
    source: str
    index: int | None
    shape: tuple[int, ...]


def clean_name(name: str) -> str:
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    return name


def layer_groups(names: list[str]) -> list[list[str]]:
    """Names grouped per decoder layer (`layers.<i>.`), in layer order; names outside layers form a first group
    (those before the first layer: embeddings) and a last one (final norm, LM head)."""
    pre, post, layers = [], [], {}
    for name in names:
        m = _LAYER_RE.search(name)
        if m is None:
            (post if layers else pre).append(name)
        else:
            layers.setdefault(int(m.group(1)), []).append(name)
    return [g for g in [pre, *(layers[i] for i in sorted(layers)), post] if g]


class HFWeightStream:
    """Iterate `model` (ours or transformers', possibly FSDP-sharded) as (HF name, full tensor in `dtype`)."""

    def __init__(self, model: nn.Module, dtype: torch.dtype) -> None:
        from slipstream.trainer.logprobs import is_custom_model

        self.dtype = dtype
        self.tensors = _named_tensors(model)
        self.locations = _locations(model)
        self.parents = {id(child): module for module in model.modules() for child in module.children()}
        if is_custom_model(model):
            pieces = _custom_pieces(model, self.tensors)
        else:
            pieces = {name: [_Piece(name, name, None, tuple(t.shape))] for name, t in self.tensors.items()}
        self.groups = [[p for source in group for p in pieces[source]] for group in layer_groups(list(pieces))]

    def metas(self) -> list[TensorMeta]:
        dtype = str(self.dtype).removeprefix("torch.")
        return [TensorMeta(p.hf_name, dtype, p.shape) for group in self.groups for p in group]

    @property
    def num_bytes(self) -> int:
        return sum(m.nbytes for m in self.metas())

    def __iter__(self) -> Iterator[tuple[str, Tensor]]:
        for names, stacked in self.runs():
            yield from zip(names, stacked.unbind(0), strict=True)

    def runs(self) -> Iterator[tuple[list[str], Tensor]]:
        """(names, stacked): each gathered tensor once, as the run of HF tensors it holds (a layer's experts of one
        projection come as one [E, ...] run; any other tensor as a run of one), in stream order."""
        owners = [self._fsdp_owners(group) for group in self.groups]
        handles = _unshard(owners[0]) if owners else []
        for k, group in enumerate(self.groups):
            for handle in handles:
                handle.wait()
            handles = _unshard(owners[k + 1]) if k + 1 < len(owners) else []  # prefetch: overlaps this layer's work
            for source, pieces in _by_source(group):
                live = self._live(source)
                full = _owned(_gather(live).to(self.dtype), live)
                names = [p.hf_name for p in pieces]
                if pieces[0].index is None:
                    yield names, full.unsqueeze(0)
                else:
                    first = pieces[0].index
                    if [p.index for p in pieces] != list(range(first, first + len(pieces))):
                        raise ValueError(f"the HF tensors of {source} do not come in index order")
                    yield names, full[first : first + len(pieces)]
                del full
            for module in owners[k]:
                module.reshard()

    def _live(self, name: str) -> Tensor:
        """The tensor now registered under `name` (FSDP swaps in unsharded parameters while a unit is unsharded)."""
        module, attr = self.locations[name]
        return getattr(module, attr)

    def _fsdp_owners(self, group: list[_Piece]) -> list[nn.Module]:
        """The FSDP units directly holding the group's tensors (none without FSDP)."""
        from torch.distributed.fsdp import FSDPModule

        owners: dict[int, nn.Module] = {}
        for piece in group:
            module = self.locations[piece.source][0]
            while module is not None and not isinstance(module, FSDPModule):
                module = self.parents.get(id(module))
            if module is not None:
                owners[id(module)] = module
        return list(owners.values())


def _by_source(group: list[_Piece]) -> list[tuple[str, list[_Piece]]]:
    """The group's pieces as consecutive runs of one source tensor."""
    out: list[tuple[str, list[_Piece]]] = []
    for piece in group:
        if out and out[-1][0] == piece.source:
            out[-1][1].append(piece)
        else:
            out.append((piece.source, [piece]))
    return out


def _owned(tensor: Tensor, live: Tensor) -> Tensor:
    """`tensor`, copied if it still is the module's own tensor (same dtype, no gather): resharding an FSDP unit frees
    that storage, and training changes it in place, while the sinks may still be reading it on their thread."""
    from torch.distributed.tensor import DTensor

    if not isinstance(live, DTensor) and tensor.data_ptr() == live.data_ptr():
        return tensor.clone()
    return tensor


def _unshard(modules: list[nn.Module]) -> list:
    return [h for h in (m.unshard(async_op=True) for m in modules) if h is not None]


def _locations(model: nn.Module) -> dict[str, tuple[nn.Module, str]]:
    """Clean tensor name -> (module holding it, attribute name)."""
    out: dict[str, tuple[nn.Module, str]] = {}
    for prefix, module in model.named_modules():
        for attr, _ in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            out.setdefault(clean_name(f"{prefix}.{attr}" if prefix else attr), (module, attr))
    return out


@torch.no_grad()
def _gather(tensor: Tensor) -> Tensor:
    """The whole tensor on this rank's device (a collective for FSDP's DTensors)."""
    full_tensor = getattr(tensor, "full_tensor", None)
    return (full_tensor() if callable(full_tensor) else tensor).detach()


def _named_tensors(model: nn.Module) -> dict[str, Tensor]:
    """The model's state (parameters and persistent buffers) under clean names; a tensor shared by two names (a tied
    head) appears once, under its first name, as save_pretrained writes it."""
    out: dict[str, Tensor] = {}
    seen: set[int] = set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        key = id(tensor)
        if key in seen:
            continue
        seen.add(key)
        out[clean_name(name)] = tensor
    return out


def _custom_pieces(model: nn.Module, tensors: dict[str, Tensor]) -> dict[str, list[_Piece]]:
    """Our tensor name -> its HF tensors, found by running the family's `to_hf` on meta tensors: renamed tensors come
    back as the same objects, unstacked experts as views of them (index from the view's offset)."""
    from slipstream.models.registry import MODEL_SPECS

    spec = next(s for s in MODEL_SPECS.values() if isinstance(model, s.model_cls))
    metas = {name: torch.empty(tuple(t.shape), dtype=torch.float32, device="meta") for name, t in tensors.items()}
    owner = {id(t): name for name, t in metas.items()}
    pieces: dict[str, list[_Piece]] = {name: [] for name in tensors}
    for hf_name, t in spec.to_hf(dict(metas), model.args).items():
        if id(t) in owner:
            pieces[owner[id(t)]].append(_Piece(hf_name, owner[id(t)], None, tuple(t.shape)))
        elif t._base is not None and id(t._base) in owner:
            base = t._base
            index = t.storage_offset() // base.stride(0)
            pieces[owner[id(base)]].append(_Piece(hf_name, owner[id(base)], index, tuple(t.shape)))
        else:
            raise ValueError(f"cannot tell which tensor of the model {hf_name!r} comes from")
    return {name: ps for name, ps in pieces.items() if ps}
