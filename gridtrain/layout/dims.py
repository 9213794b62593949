"""`ParallelDims`: the layout's degrees, validated in one place, and the rank grid they make.

The ranks of a world form the grid `arange(world).view(pp, dp_replicate, dp_shard, cp, tp)`:
tensor parallelism varies fastest, so a TP group is consecutive ranks (the GPUs of one node, on
NVLink), and pipeline parallelism slowest, so stages cross node boundaries. For 8 processes with
pp=2, dp_shard=2, tp=2:

    rank:  0 1 | 2 3 || 4 5 | 6 7
    tp:    0 1 | 0 1 || 0 1 | 0 1
    dp:     0  |  1  ||  0  |  1
    pp:         0    ||     1
"""

from __future__ import annotations

from dataclasses import dataclass

MESH_AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    ep: int
    world_size: int

    @classmethod
    def resolve(cls, dp_replicate: int, dp_shard: int, cp: int, tp: int, pp: int, ep: int,
                world_size: int, zero_stage: int = 3) -> ParallelDims:
        """Fill in dp_shard = -1 with what the world leaves (left as -1 when it cannot). ZeRO
        stages 0 and 1 keep full copies, so there the remainder goes to dp_replicate instead."""
        if dp_shard == -1:
            rest = dp_replicate * cp * tp * pp
            if rest > 0 and world_size % rest == 0:
                dp_shard = world_size // rest
                if zero_stage in (0, 1) and dp_replicate == 1:
                    dp_replicate, dp_shard = dp_shard, 1
        return cls(dp_replicate, dp_shard, cp, tp, pp, ep, world_size)

    @property
    def degrees(self) -> dict[str, int]:
        return {"pp": self.pp, "dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard,
                "cp": self.cp, "tp": self.tp}

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many different slices of the global batch are read at once."""
        return self.dp_replicate * self.dp_shard

    @property
    def model_parallel(self) -> int:
        """GPUs per model copy (the model-parallel group): tp x pp (x cp)."""
        return self.tp * self.pp * self.cp

    def problems(self) -> list[str]:
        """Broken relations between the degrees and the world size (empty when consistent)."""
        errors = []
        for key, value in (("dp_replicate", self.dp_replicate), ("tp", self.tp), ("pp", self.pp),
                           ("cp", self.cp), ("ep", self.ep)):
            if value < 1:
                errors.append(f"parallel.{key} = {value} must be >= 1")
        if errors:
            return errors
        if self.dp_shard < 1:
            rest = self.dp_replicate * self.cp * self.tp * self.pp
            errors.append(
                f"parallel.dp_shard = -1 cannot fill world size {self.world_size}: dp_replicate("
                f"{self.dp_replicate}) * cp({self.cp}) * tp({self.tp}) * pp({self.pp}) = {rest} does not "
                f"divide it; launch a multiple of {rest} processes or lower the degrees")
            return errors
        if self.ep > 1 and self.dp * self.cp % self.ep:
            errors.append(f"parallel.ep ({self.ep}) borrows its ranks from the data- and context-parallel ranks and "
                          f"must divide dp_replicate x dp_shard x cp ({self.dp_replicate} x {self.dp_shard} x "
                          f"{self.cp} = {self.dp * self.cp}): set parallel.ep to a divisor of {self.dp * self.cp}")
        product = self.dp_replicate * self.dp_shard * self.cp * self.tp * self.pp
        if not errors and product != self.world_size:
            fix = ""
            if self.world_size % (product // self.tp) == 0:
                fix = f"set parallel.tp to {self.world_size // (product // self.tp)}, or "
            errors.append(
                f"parallel.dp_replicate({self.dp_replicate}) * dp_shard({self.dp_shard}) * cp({self.cp}) * "
                f"tp({self.tp}) * pp({self.pp}) = {product} != world size {self.world_size}: "
                f"{fix}launch {product} processes (--parallel.nproc {product}), or set "
                "parallel.dp_shard to -1 to fill the world")
        return errors

    def coordinates(self, rank: int) -> dict[str, int]:
        """This rank's index along each axis of `arange(world).view(pp, dp_rep, dp_shard, cp, tp)`."""
        coords = {}
        for axis in reversed(MESH_AXES):
            size = self.degrees[axis]
            coords[axis] = rank % size
            rank //= size
        coords["dp"] = coords["dp_replicate"] * self.dp_shard + coords["dp_shard"]
        return coords


def stage_layer_counts(n_layers: int, num_stages: int, fewer_edge_layers: int = 0) -> list[int]:
    """Layers per pipeline stage: balanced, except the first and last stage get
    `fewer_edge_layers` fewer, since they also run the embedding and the output head.

    Llama 3 405B (126 layers, 16 stages, 1 fewer): 7 layers on the edges, 8 in the middle.
    """
    if num_stages == 1:
        return [n_layers]
    weighted = n_layers + 2 * fewer_edge_layers
    base, extra = divmod(weighted, num_stages)
    counts = [base] * num_stages
    # The remainder goes to middle stages first, then to the edges.
    order = list(range(1, num_stages - 1)) + [0, num_stages - 1]
    for i in order[:extra]:
        counts[i] += 1
    counts[0] -= fewer_edge_layers
    counts[-1] -= fewer_edge_layers
    return counts
