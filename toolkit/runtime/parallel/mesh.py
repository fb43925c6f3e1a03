"""The device mesh of a tensor/pipeline/data-parallel run: a torch DeviceMesh of shape (pp, dp, tp),
tensor-parallel ranks adjacent (they communicate every layer, so on one node they share NVLink), then
data-parallel replicas, then pipeline stages. Rank r sits at pp = r // (dp*tp), dp = r // tp % dp, tp = r % tp.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from toolkit.distributed import DistInfo
from toolkit.specs import ParallelSpec


@dataclass(frozen=True)
class ParallelMesh:
    """This rank's place in the (pp, dp, tp) mesh and the process groups along each dimension."""
    mesh: DeviceMesh
    pp: int  # sizes
    dp: int
    tp: int
    pp_rank: int  # this rank's coordinates
    dp_rank: int
    tp_rank: int

    @property
    def tp_mesh(self) -> DeviceMesh:
        """The 1-d mesh of this rank's tensor-parallel group (what parallelize_module shards over)."""
        return self.mesh["tp"]

    def group(self, dim: str):
        """The process group along `dim` ('pp', 'dp' or 'tp') that holds this rank."""
        return self.mesh.get_group(dim)

    def describe(self) -> str:
        """One line for the start-up table."""
        return (f"mesh pp {self.pp} x dp {self.dp} x tp {self.tp} (this rank: stage {self.pp_rank}, replica "
                f"{self.dp_rank}, tensor shard {self.tp_rank})")


def build_mesh(spec: ParallelSpec, info: DistInfo, device: torch.device) -> ParallelMesh:
    """The (pp, dp, tp) mesh over the joined process group (every rank calls it: it creates subgroups)."""
    tp, pp = spec.tensor, spec.pipeline
    dp = info.world_size // (tp * pp)
    mesh = init_device_mesh(device.type, (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
    r = info.rank
    return ParallelMesh(mesh, pp, dp, tp, pp_rank=r // (dp * tp), dp_rank=r // tp % dp, tp_rank=r % tp)
