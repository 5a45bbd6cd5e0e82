"""The trainer's device mesh, sized from ParallelConfig and checked against the world size, and the sub-meshes each
kind of parallelism runs on.

World mesh (outermost first): dp_replicate x dp_shard x cp, with dp_shard split as dp_shard_mod_ep x dp_shard_in_ep.
Expert parallelism is carved out of dp_shard x cp (as in torchtitan) and does not multiply the world: ep =
dp_shard_in_ep x cp, so an ep group spans whole cp groups (ranks that share one packed row).

| sub-mesh     | dims                                        | what runs on it                                      |
|--------------|---------------------------------------------|------------------------------------------------------|
| fsdp         | (dp_replicate,) dp_shard x cp (flattened)   | FSDP of every parameter but the experts               |
| expert_fsdp  | (dp_replicate,) dp_shard_mod_ep             | FSDP of the experts (each holding E / ep of them)     |
| ep           | dp_shard_in_ep x cp (flattened)             | expert sharding on dim 0 and the tokens' all-to-all   |
| cp           | cp                                          | K/V all-gather, log-prob sums                         |

Gradients are summed over every rank (fsdp and expert_fsdp reduce; cp ranks are data-parallel for the weights).
Ranks of one cp group read the same batch: data rank = rank // cp.
"""

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from slipstream.config.trainer import ParallelConfig

WORLD_DIMS = ("dp_replicate", "dp_shard_mod_ep", "dp_shard_in_ep", "cp")


@dataclass(frozen=True)
class ParallelDims:
    """Resolved degrees of each parallel dimension; dp_replicate * dp_shard * cp == world_size."""

    dp_replicate: int
    dp_shard: int
    cp: int
    ep: int
    world_size: int

    @property
    def dp_shard_in_ep(self) -> int:
        """dp_shard ranks inside one ep group (ep spans whole cp groups)."""
        return self.ep // self.cp if self.ep > 1 else 1

    @property
    def dp_shard_mod_ep(self) -> int:
        """dp_shard ranks that hold the same experts: the experts' FSDP degree (x dp_replicate with HSDP)."""
        return self.dp_shard // self.dp_shard_in_ep

    @property
    def num_data_ranks(self) -> int:
        """Ranks with their own batch: all but the cp ranks of one group, which share a batch."""
        return self.world_size // self.cp

    def data_rank(self, rank: int) -> int:
        """Index of the batch file that `rank` reads (cp is the innermost mesh dimension)."""
        return rank // self.cp


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
    return ParallelDims(config.dp_replicate, dp_shard, config.cp, config.ep, world_size)


@dataclass(frozen=True)
class TrainerMesh:
    """The world mesh and its named sub-meshes (see the module docstring)."""

    world: DeviceMesh
    dims: ParallelDims

    @property
    def device_type(self) -> str:
        return self.world.device_type

    @property
    def fsdp(self) -> DeviceMesh:
        """Shards (and, with HSDP, replicates) every parameter except EP-sharded experts."""
        return self.world["dp_replicate", "dp_shard_cp"] if self.dims.dp_replicate > 1 else self.world["dp_shard_cp"]

    @property
    def expert_fsdp(self) -> DeviceMesh:
        """Shards (HSDP: replicates) the experts a rank holds under EP, over the ranks holding the same experts."""
        if self.dims.dp_replicate > 1:
            return self.world["dp_replicate", "dp_shard_mod_ep"]
        return self.world["dp_shard_mod_ep"]

    @property
    def ep(self) -> DeviceMesh | None:
        return self.world["ep"] if self.dims.ep > 1 else None

    @property
    def cp(self) -> DeviceMesh | None:
        return self.world["cp"] if self.dims.cp > 1 else None


def build_mesh(dims: ParallelDims, device_type: str) -> TrainerMesh:
    """The world mesh over all ranks and its flattened dimensions (needs the default process group)."""
    shape = (dims.dp_replicate, dims.dp_shard_mod_ep, dims.dp_shard_in_ep, dims.cp)
    world = init_device_mesh(device_type, shape, mesh_dim_names=WORLD_DIMS)
    world["dp_shard_mod_ep", "dp_shard_in_ep", "cp"]._flatten("dp_shard_cp")
    if dims.ep > 1:
        world["dp_shard_in_ep", "cp"]._flatten("ep")
    return TrainerMesh(world, dims)
