"""The trainer's device mesh: (dp_replicate, dp_shard, cp) with named dimensions, sized from ParallelConfig and
checked against the world size; ep is carved out of dp_shard x cp (as in torchtitan) and does not multiply it."""

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from slipstream.config.trainer import ParallelConfig

MESH_DIMS = ("dp_replicate", "dp_shard", "cp")


@dataclass(frozen=True)
class ParallelDims:
    """Resolved degrees of each parallel dimension; dp_replicate * dp_shard * cp == world_size."""

    dp_replicate: int
    dp_shard: int
    cp: int
    ep: int
    world_size: int


def resolve_parallel_dims(config: ParallelConfig, world_size: int) -> ParallelDims:
    """Fill in dp_shard (default: the ranks left) and check the mesh covers exactly `world_size` ranks."""
    rest = config.dp_replicate * config.cp
    dp_shard = config.dp_shard if config.dp_shard is not None else world_size // rest
    product = config.dp_replicate * dp_shard * config.cp
    if product != world_size or dp_shard < 1:
        raise ValueError(
            f"trainer.parallel: dp_replicate ({config.dp_replicate}) x dp_shard ({config.dp_shard or 'auto'}) x "
            f"cp ({config.cp}) = {product} ranks, but WORLD_SIZE is {world_size}; make the product equal the number "
            "of trainer ranks (torchrun --nproc-per-node x nodes), or leave dp_shard unset to use the ranks left"
        )
    if (dp_shard * config.cp) % config.ep != 0:
        raise ValueError(
            f"trainer.parallel.ep ({config.ep}) must divide dp_shard x cp ({dp_shard} x {config.cp}): expert-parallel "
            "ranks are taken from the data-parallel shard ranks"
        )
    for name, degree in (("ep", config.ep), ("cp", config.cp)):
        if degree > 1:
            raise NotImplementedError(
                f"trainer.parallel.{name} = {degree}: {name.upper()} is not implemented yet; set it to 1 "
                "(FSDP over dp_shard and HSDP over dp_replicate are)"
            )
    return ParallelDims(config.dp_replicate, dp_shard, config.cp, config.ep, world_size)


def build_mesh(dims: ParallelDims, device_type: str) -> DeviceMesh:
    """A 3-D mesh named MESH_DIMS over all ranks (needs the default process group)."""
    return init_device_mesh(device_type, (dims.dp_replicate, dims.dp_shard, dims.cp), mesh_dim_names=MESH_DIMS)


def fsdp_mesh_dims(mesh: DeviceMesh) -> tuple[str, ...]:
    """Mesh dimensions parameters are sharded over (dp_shard) and, with HSDP, replicated over (dp_replicate)."""
    return ("dp_replicate", "dp_shard") if mesh["dp_replicate"].size() > 1 else ("dp_shard",)
