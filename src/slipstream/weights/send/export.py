"""The trainer's model as a stream of Hugging Face tensors, one layer at a time, in lockstep on every rank (the
gathers are collectives): sharded tensors arrive whole from weights/send/shard_gather.py (several layers per
all-gather, cast to the published dtype before they travel, the next chunk in flight), or, with LoRA adapters to fold
into float32 weights, from unsharding each layer's FSDP unit (the next layer's already in flight); tensors sharded
in another way fall back to `full_tensor()`. The tensors are renamed (our models through their family's adapter,
experts unstacked), and only a chunk of layers is held in full. LoRA adapters are folded into their weights (a
merged model; weights/send/lora_export.py writes the adapter alone).

The stream's metadata (names, dtypes, shapes) is known before any gather, so the bucket plan can be sent first.
The tensors are cast to the published dtype where they are copied into their bucket (weights/wire/bucket_assembly.py).
"""

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from slipstream.models.common.lora import has_lora, is_lora_name, merged_tensor
from slipstream.weights.send.shard_gather import CHUNK_BYTES, ShardGatherer
from slipstream.weights.wire.bucket_assembly import Run
from slipstream.weights.wire.stream import TensorMeta

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
    """Iterate `model` (ours or transformers', possibly FSDP-sharded) layer by layer as runs of HF tensors; the
    published dtype `dtype` is what the metadata (and so the bucket plan) says: the tensors themselves come in the
    model's dtype and are cast where they are copied into their bucket. Build it once per model: the per-layer plan
    (which module attribute holds which HF tensors, which FSDP units to unshard) is computed here, so a version
    costs a few Python operations per tensor."""

    def __init__(
        self, model: nn.Module, dtype: torch.dtype, gather: bool = True, chunk_bytes: int = CHUNK_BYTES
    ) -> None:
        from slipstream.trainer.logprobs import is_custom_model

        self.dtype = dtype
        tensors = _named_tensors(model)
        locations = _locations(model)
        parents = {id(child): module for module in model.modules() for child in module.children()}
        self.model = model
        if is_custom_model(model):
            pieces = _custom_pieces(model, tensors)
        else:
            pieces = {name: [_Piece(name, name, None, tuple(t.shape))] for name, t in tensors.items()}
        groups = [[p for source in group for p in pieces[source]] for group in layer_groups(list(pieces))]
        self.plan = [[_entry(locations[source], ps) for source, ps in _by_source(group)] for group in groups]
        self.owners = [_fsdp_owners([locations[p.source][0] for p in group], parents) for group in groups]
        # transformers' models keep some tensors in another layout than their checkpoints (MoE experts fused into
        # one [E, ...] tensor per projection): those layers are converted back as save_pretrained does.
        self.converted: list[list[str] | None] = [None] * len(groups)
        # and some (Qwen3-VL-MoE's fused experts) save_pretrained writes transposed from the checkpoint they came
        # from, which inference reads: those are published as the source checkpoint lays them out.
        self.transposed: set[str] = set()
        source = {} if is_custom_model(model) else source_checkpoint_shapes(model)
        published: list[tuple[str, tuple[int, ...]]] = []
        for k, group in enumerate(groups):
            layout = [(p.hf_name, p.shape) for p in group]
            if not is_custom_model(model):
                saved = _checkpoint_layout(model, {p.source: tensors[p.source] for p in group})
                if saved != layout:
                    self.converted[k], layout = [name for name, _ in saved], saved
                for i, (name, shape) in enumerate(layout):
                    if _is_transpose(source.get(name), shape):
                        self.transposed.add(name)
                        layout[i] = (name, source[name])
            published += layout
        dtype_name = str(dtype).removeprefix("torch.")
        fp32 = keep_in_fp32(model)
        self.metas_ = [
            TensorMeta(name, "float32" if is_kept_in_fp32(name, fp32) else dtype_name, shape)
            for name, shape in published
        ]
        # Sharded tensors are gathered several layers at a time, already cast (weights/send/shard_gather.py), unless
        # LoRA adapters must be folded into the float32 weights first: then each layer's FSDP unit is unsharded.
        self.gatherer: ShardGatherer | None = None
        if gather and not has_lora(model):
            dtypes = [
                [torch.float32 if any(is_kept_in_fp32(n, fp32) for n in names) else dtype for _, _, names, _ in group]
                for group in self.plan
            ]
            gatherer = ShardGatherer(self.plan, dtypes, chunk_bytes)
            self.gatherer = gatherer if gatherer.num_collectives else None

    def metas(self) -> list[TensorMeta]:
        return list(self.metas_)

    @property
    def num_bytes(self) -> int:
        return sum(m.nbytes for m in self.metas_)

    @torch.no_grad()
    def layers(self) -> Iterator[list[Run]]:
        """Each layer's runs, in stream order. With a gatherer, the sharded tensors of a chunk of layers arrive whole
        from one all-gather per process group (the next chunk's already in flight); without, a layer's FSDP units are
        unsharded (the next layer's already in flight) while its runs are consumed, and resharded when the next
        layer is requested."""
        if self.gatherer is not None:
            yield from self._gathered_layers(self.gatherer)
            return
        handles = _unshard(self.owners[0]) if self.owners else []
        for k in range(len(self.plan)):
            for handle in handles:
                handle.wait()
            handles = _unshard(self.owners[k + 1]) if k + 1 < len(self.owners) else []  # overlaps this layer
            # FSDP swaps in the unsharded parameters while their unit is unsharded
            yield self._runs(k, {})
            for module in self.owners[k]:
                module.reshard()

    def _gathered_layers(self, gatherer: ShardGatherer) -> Iterator[list[Run]]:
        pending = gatherer.start(0)
        whole: dict[tuple[int, int], Tensor] = {}
        for k in range(len(self.plan)):
            chunk = gatherer.chunk_of[k]
            if gatherer.chunks[chunk][0] == k:
                whole = gatherer.finish(pending)
                if chunk + 1 < len(gatherer.chunks):
                    pending = gatherer.start(chunk + 1)  # overlaps this chunk's layers
            yield self._runs(k, whole)

    def _runs(self, k: int, whole: dict[tuple[int, int], Tensor]) -> list[Run]:
        """Layer group k as runs of HF tensors; `whole` holds the entries already gathered (by (k, entry index))."""
        from torch.distributed.tensor import DTensor

        runs = []
        for i, (module, attr, names, first) in enumerate(self.plan[k]):
            tensor = whole.pop((k, i), None)
            if tensor is None:
                tensor = getattr(module, attr)
                if isinstance(tensor, DTensor):
                    tensor = tensor.full_tensor()  # outside any unit (or sharded twice): gathered alone
                tensor = merged_tensor(module, attr, tensor)  # LoRA: the adapter folded in (W + s B A)
            if first is None:
                runs.append(Run(names, tensor, False))
            else:
                runs.append(Run(names, tensor[first : first + len(names)], True))
        if self.converted[k] is not None:
            runs = self._to_checkpoint_layout(runs, self.converted[k])
        if self.transposed:
            runs = [self._as_source(run) for run in runs]
        return runs

    def _as_source(self, run: Run) -> Run:
        """A run of one tensor that the source checkpoint holds transposed, as a transposed view (the bucket copy
        takes strided tensors)."""
        if len(run.names) == 1 and run.names[0] in self.transposed:
            return Run(run.names, run.tensor.transpose(-1, -2), False)
        return run

    def _to_checkpoint_layout(self, runs: list[Run], names: list[str]) -> list[Run]:
        """A transformers model's layer in its checkpoint layout (save_pretrained's reverse conversion; copies)."""
        from transformers.core_model_loading import revert_weight_conversion

        saved = revert_weight_conversion(self.model, {run.names[0]: run.tensor for run in runs})
        if list(saved) != names:
            raise RuntimeError(f"transformers' reverse weight conversion changed: {list(saved)[:3]} vs {names[:3]}")
        return [Run([name], tensor, False) for name, tensor in saved.items()]


def keep_in_fp32(model: nn.Module) -> tuple[str, ...]:
    """Names of the tensors (or modules) the model keeps in float32 whatever its dtype: our family's `keep_in_fp32`,
    or transformers' `_keep_in_fp32_modules_strict` (e.g. GLM-4.5's `e_score_correction_bias`)."""
    return tuple(getattr(model, "keep_in_fp32", None) or getattr(model, "_keep_in_fp32_modules_strict", None) or ())


def is_kept_in_fp32(name: str, kept: tuple[str, ...]) -> bool:
    """Whether tensor `name` (dotted) is, or lies in, one of the `kept` names."""
    parts = name.split(".")
    return any(k in parts for k in kept)


def source_checkpoint_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape in the safetensors files of the folder a transformers model was loaded from (their
    headers only); {} when it was not loaded from a local folder."""
    from safetensors import safe_open

    folder = Path(str(getattr(model, "name_or_path", "") or ""))
    if not str(folder) or not folder.is_dir():
        return {}
    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            shapes.update({name: tuple(f.get_slice(name).get_shape()) for name in f.keys()})
    return shapes


def _is_transpose(source: tuple[int, ...] | None, shape: tuple[int, ...]) -> bool:
    """Whether the source checkpoint holds a tensor of `shape` with its last two dimensions swapped."""
    return source is not None and len(shape) >= 2 and source != shape and source == (*shape[:-2], shape[-1], shape[-2])


def _checkpoint_layout(model: nn.Module, tensors: dict[str, Tensor]) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of the checkpoint tensors save_pretrained writes for these tensors of a transformers model
    (its weight-conversion mapping reversed, on meta tensors)."""
    from transformers.core_model_loading import revert_weight_conversion

    metas = {name: torch.empty(tuple(t.shape), device="meta") for name, t in tensors.items()}
    return [(name, tuple(t.shape)) for name, t in revert_weight_conversion(model, metas).items()]


def _entry(location: tuple[nn.Module, str], pieces: list[_Piece]) -> tuple[nn.Module, str, list[str], int | None]:
    """(module, attribute, HF names, first index or None): one run of HF tensors taken from one of our tensors."""
    names = [p.hf_name for p in pieces]
    if pieces[0].index is None:
        return (*location, names, None)
    first = pieces[0].index
    if [p.index for p in pieces] != list(range(first, first + len(pieces))):
        raise ValueError(f"the HF tensors of {pieces[0].source} do not come in index order")
    return (*location, names, first)


def _fsdp_owners(modules: list[nn.Module], parents: dict[int, nn.Module]) -> list[nn.Module]:
    """The FSDP units directly holding tensors of these modules (none without FSDP)."""
    from torch.distributed.fsdp import FSDPModule

    owners: dict[int, nn.Module] = {}
    for module in modules:
        while module is not None and not isinstance(module, FSDPModule):
            module = parents.get(id(module))
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


def _unshard(modules: list[nn.Module]) -> list:
    return [h for h in (m.unshard(async_op=True) for m in modules) if h is not None]


def _locations(model: nn.Module) -> dict[str, tuple[nn.Module, str]]:
    """Clean tensor name -> (module holding it, attribute name)."""
    out: dict[str, tuple[nn.Module, str]] = {}
    for prefix, module in model.named_modules():
        for attr, _ in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            out.setdefault(clean_name(f"{prefix}.{attr}" if prefix else attr), (module, attr))
    return out


def _named_tensors(model: nn.Module) -> dict[str, Tensor]:
    """The model's state (parameters and persistent buffers) under clean names; a tensor shared by two names (a tied
    head) appears once, under its first name, as save_pretrained writes it. LoRA adapters are left out: the stream
    publishes the merged weights."""
    out: dict[str, Tensor] = {}
    seen: set[int] = set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        key = id(tensor)
        if key in seen or is_lora_name(name):
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
