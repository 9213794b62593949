"""A planned layout as a `gridtrain train` run: its configuration keys, validate's verdict on
them, and the command line that launches it. The search ranks only layouts this module's
`refusal` finds nothing against, so what `gridtrain plan` recommends is what `gridtrain train` runs.
No torch: validation is the configuration's own arithmetic (gridtrain/validate.py).
"""

from __future__ import annotations

import functools
import shlex

from gridtrain.config import ConfigError
from gridtrain.config_load import load_config
from gridtrain.names import RECOMPUTE
from gridtrain.plan.layout import Layout
from gridtrain.validate import validate


@functools.lru_cache(maxsize=8192)
def refusal(model_keys: tuple[tuple[str, object], ...], global_batch_seqs: int, precision: str,
            layout: Layout) -> str:
    """Why `gridtrain train` would refuse the layout ('' when it accepts it)."""
    if layout.recompute not in RECOMPUTE:
        return f"recompute '{layout.recompute}' is not one of gridtrain's modes ({', '.join(RECOMPUTE)})"
    try:
        cfg = load_config(None, run_keys(model_keys, global_batch_seqs, precision, layout))
        validate(cfg, world=layout.num_gpus, installed=False)  # the planning machine need not train
    except ConfigError as err:
        return err.problems[0]
    return ""


def run_keys(model_keys: tuple[tuple[str, object], ...], global_batch_seqs: int, precision: str,
             layout: Layout) -> dict[str, object]:
    """The configuration keys of the run (model keys first: the preset and its overrides)."""
    keys: dict[str, object] = dict(model_keys)
    keys.update({"data.seq_len": layout.seq_len, "train.global_batch": global_batch_seqs,
                 "train.micro_batch": layout.micro_batch, "train.precision": precision,
                 "train.recompute": layout.recompute,
                 "parallel.tp": layout.tp, "parallel.pp": layout.pp, "parallel.cp": layout.cp,
                 "parallel.dp_replicate": layout.dp_replicate, "parallel.dp_shard": layout.dp_shard,
                 "parallel.zero_stage": layout.zero_stage, "parallel.sequence_parallel": layout.sequence_parallel,
                 "parallel.ep": layout.ep})
    if layout.float8 != "none":
        keys["train.float8"] = layout.float8
    if layout.pp > 1:
        keys.update({"parallel.pp_schedule": layout.pp_schedule, "parallel.pp_virtual_stages": layout.pp_virtual_stages,
                     "parallel.pp_fewer_edge_layers": layout.fewer_edge_layers})
    if load_config(None, dict(model_keys)).model.args().max_seq_len < layout.seq_len:
        keys["model.max_seq_len"] = layout.seq_len
    return keys


def train_command(model_keys: tuple[tuple[str, object], ...], global_batch_seqs: int, precision: str,
                  layout: Layout, gpus_per_node: int) -> str:
    """The command that runs the layout: `gridtrain train --nproc N` on one node, torchrun on
    each node beyond that (the same line everywhere, --node-rank differing)."""
    keys = run_keys(model_keys, global_batch_seqs, precision, layout)
    flags = " ".join(f"--{k} {shlex.quote(str(v).lower() if isinstance(v, bool) else str(v))}"
                     for k, v in keys.items() if not _default(k, v))
    if layout.num_gpus <= gpus_per_node:
        return f"gridtrain train --nproc {layout.num_gpus} {flags}"
    nodes = layout.num_gpus // gpus_per_node
    # --rdzv-id names the job: its restarts continue the run directory (gridtrain/rundir.py)
    return (f"torchrun --nnodes {nodes} --nproc-per-node {gpus_per_node} --node-rank $NODE_RANK "
            f"--rdzv-backend c10d --rdzv-id $JOB_ID --rdzv-endpoint $HEAD_NODE:29500 -m gridtrain train {flags}")


def _default(key: str, value: object) -> bool:
    """Keys a command line can leave out: degree 1, no sequence parallelism, no fewer edge layers."""
    return (key in ("parallel.tp", "parallel.pp", "parallel.cp", "parallel.dp_replicate", "parallel.ep") and value == 1) or \
        (key in ("parallel.sequence_parallel",) and value is False) or \
        (key == "parallel.pp_fewer_edge_layers" and value == 0)
