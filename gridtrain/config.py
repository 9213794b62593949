"""Run configuration: nested dataclasses, one docstring per field.

Every field's docstring is shown by `gridtrain train --help-config`. A configuration is built by
`gridtrain.config_load.load_config(toml_path, overrides)` and checked once by `validate(cfg)`,
before any process or process group exists; every broken relation is reported together, with the
numbers and the fix.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, fields
from pathlib import Path

from gridtrain.errors import UserError
from gridtrain.layout.schedules import DEFAULT_SCHEDULE, RuntimeScheduleName
from gridtrain.model.args import ModelArgs, model_args
from gridtrain.model.moe_args import Balance, RouterScore
from gridtrain.names import Float8, LRSchedule, OnSaveError, Precision, Recompute


class ConfigError(UserError, ValueError):
    """An invalid configuration; `problems` lists each broken relation."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        if len(problems) == 1:
            super().__init__(f"invalid configuration: {problems[0]}")
        else:
            super().__init__("invalid configuration:\n" + "\n".join(f"  - {p}" for p in problems))


@functools.cache
def _names(cls: type) -> tuple[str, ...]:
    """A dataclass's field names, read once (`ModelConfig.args` is asked for often)."""
    return tuple(f.name for f in fields(cls))


@dataclass
class MoEConfig:
    """Mixture-of-experts keys: they override a mixture-of-experts preset's (tiny-moe, small-moe,
    mixtral-8x7b, ...); on a dense preset they are refused."""

    num_experts: int | None = None
    """Routed experts per MoE layer."""
    top_k: int | None = None
    """Routed experts each token goes to."""
    expert_ffn_dim: int | None = None
    """Hidden width of each expert's SwiGLU."""
    num_shared_experts: int | None = None
    """Experts every token passes through (DeepSeekMoE)."""
    score: RouterScore | None = None
    """Router scores: 'softmax' or 'sigmoid' (computed in fp32)."""
    normalize_top_k: bool | None = None
    """Renormalise the k chosen scores to sum to 1."""
    route_scale: float | None = None
    """Multiply the gate values by this."""
    balance: Balance | None = None
    """Load balance: 'aux_loss' (Switch/GShard), 'bias' (DeepSeek-V3's auxiliary-loss-free expert
    bias, updated once per optimizer step from the step's global counts) or 'none'."""
    aux_loss_coef: float | None = None
    """Coefficient of the auxiliary balance loss."""
    bias_update_rate: float | None = None
    """Step of the expert bias per optimizer step (DeepSeek-V3: 0.001)."""
    z_loss_coef: float | None = None
    """Router z-loss coefficient (ST-MoE); 0 turns it off."""
    capacity_factor: float | None = None
    """The tokens an expert takes per micro-batch, as a multiple of its even share (the rest are
    dropped and keep their residual); None keeps the preset's (every preset is dropless)."""
    every: int | None = None
    """MoE on every n-th layer (from first_dense on)."""
    first_dense: int | None = None
    """Leading layers that stay dense."""
    grouped_mm: bool | None = None
    """Experts through torch._grouped_mm (true) or a loop over them (false): the same numbers."""


@dataclass
class ModelConfig:
    preset: str = "small"
    """Named model shape (see `gridtrain model --list`); the fields below override it."""
    dim: int | None = None
    """Width of the residual stream; None keeps the preset's."""
    n_layers: int | None = None
    """Number of transformer blocks; None keeps the preset's."""
    n_heads: int | None = None
    """Attention query heads; None keeps the preset's."""
    n_kv_heads: int | None = None
    """Key/value heads (grouped-query attention); None keeps the preset's."""
    ffn_dim: int | None = None
    """SwiGLU hidden width; None keeps the preset's (or Llama's rounding rule)."""
    vocab_size: int | None = None
    """Embedding rows; None keeps the preset's. Must hold the tokenizer's vocabulary."""
    rope_theta: float | None = None
    """RoPE base frequency; None keeps the preset's."""
    rope_scaling: bool | None = None
    """Llama 3.1 RoPE frequency scaling; None keeps the preset's."""
    max_seq_len: int | None = None
    """The model's context (RoPE table length); None keeps the preset's."""
    tie_embeddings: bool | None = None
    """Share embedding and output head; None keeps the preset's."""
    head_dim: int | None = None
    """Width of each attention head where it is not dim / n_heads; None keeps the preset's."""
    qk_norm: bool | None = None
    """RMSNorm on each head's queries and keys (Qwen3); None keeps the preset's."""
    moe: MoEConfig = field(default_factory=MoEConfig)

    def args(self) -> ModelArgs:
        """The shape: the preset's, with these keys' values over it (raises ValueError for MoE keys on
        a dense preset; `validate` reports it first)."""
        overrides = {name: getattr(self, name) for name in _names(type(self)) if name not in ("preset", "moe", "head_dim")}
        moe = {name: getattr(self.moe, name) for name in _names(type(self.moe))}
        return model_args(self.preset, moe=moe, explicit_head_dim=self.head_dim, **overrides)


@dataclass
class DataConfig:
    corpus: str | None = None
    """Text, parquet or JSON-lines (.gz, .zst) file, a datasets save_to_disk folder, a directory of those, or a
    prepared token directory; None: the Python stdlib."""
    text_column: str = "text"
    """The column (parquet, Arrow) or field (JSON lines) that holds the text."""
    mix: str | None = None
    """A weighted mixture instead of data.corpus: 'PATH=WEIGHT,PATH=WEIGHT,...' (any corpus or prepared
    directory per PATH; weights relative, each > 0). Batches interleave the sources in proportion."""
    tokenizer: str = "byte"
    """'byte' (no files), a path to a tokenizer.json, or 'bpe:N' to train a BPE of vocabulary N."""
    seq_len: int = 256
    """Tokens per training sequence."""
    val_fraction: float = 0.005
    """Fraction of the corpus's documents held out for validation."""
    cache_dir: str = "~/.cache/gridtrain"
    """Where prepared token shards and trained tokenizers are kept."""
    doc_mask: bool = False
    """Keep attention inside each document of a packed sequence (documents end with the tokenizer's
    end-of-document token); off: attention crosses documents, as packed pretraining often does."""
    doc_positions: str = "continue"
    """RoPE positions with data.doc_mask: 'continue' (the sequence's) or 'restart' (0 at each document)."""


@dataclass
class TrainConfig:
    steps: int = 250
    """Optimizer steps of the run."""
    global_batch: int = 16
    """Sequences per optimizer step (micro_batch x accumulation x data-parallel degree)."""
    global_batch_tokens: int | None = None
    """Global batch in tokens instead of sequences; must be a multiple of data.seq_len."""
    micro_batch: int = 4
    """Sequences in one forward/backward pass of one data-parallel rank."""
    lr: float = 2e-3
    """Peak learning rate."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of the peak (cosine, linear, wsd)."""
    warmup_steps: int = 25
    """Steps of linear warm-up from 0 to the peak learning rate."""
    schedule: LRSchedule = "cosine"
    """Decay after warm-up: 'cosine', 'linear', 'wsd' (warmup-stable-decay) or 'constant'."""
    decay_fraction: float = 0.2
    """For 'wsd': the final fraction of the steps over which the rate decays."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay (applied to matrices, not to norms or embeddings)."""
    beta1: float = 0.9
    """AdamW first-moment decay."""
    beta2: float = 0.95
    """AdamW second-moment decay."""
    eps: float = 1e-8
    """AdamW epsilon."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this; 0 turns clipping off (the norm is still reported)."""
    precision: Precision = "fp32"
    """'fp32', 'bf16' (autocast, fp32 master weights) or 'fp16' (autocast + dynamic loss scaling)."""
    float8: Float8 = "none"
    """FP8 matmuls in the blocks' linear layers beside bf16 (torchao's float8 training; needs
    train.precision = 'bf16' and `pip install gridtrain[fp8]`): 'none', 'tensorwise' (a scale per
    tensor; FSDP gathers weights in float8) or 'rowwise' (a scale per row). Emulated on CPU."""
    loss_scale_init: float = 65536.0
    """fp16: initial loss scale."""
    loss_scale_growth_interval: int = 2000
    """fp16: clean steps after which the loss scale doubles (it halves on every overflow)."""
    recompute: Recompute = "none"
    """Activation recomputation: 'none', 'selective' (recompute cheap ops, keep matmul and
    attention outputs) or 'full' (whole blocks)."""
    seed: int = 0
    """Seed of initialisation and data order."""
    compile: bool = False
    """Compile each transformer block with torch.compile."""
    val_every: int = 50
    """Validation loss every N steps (and at the end); 0 turns it off."""
    val_batches: int = 8
    """Micro-batches of held-out data per validation."""
    sample_tokens: int = 200
    """At the end of the run, print a sample of this many tokens from its final checkpoint
    (`gridtrain sample` with the defaults below; 0: none)."""
    sample_prompt: str = ""
    """The end-of-run sample's prompt ('': a new document)."""
    threads: int | None = None
    """CPU threads for torch (None: torch's default)."""
    collective_timeout_s: float = 600.0
    """A collective that waits longer than this fails the run with an error naming the stalled
    rank, the collective and the step (and each rank writes its last collectives to
    <run_dir>/failures/)."""
    max_bad_steps: int = 5
    """Steps with a non-finite loss or gradient norm are skipped (no update) and counted; this
    many in a row stop the run."""
    spike_zscore: float = 6.0
    """Log a loss spike when a step's loss lies this many standard deviations above the mean of
    the last 100 steps (after 20); 0 turns it off."""


@dataclass
class CheckpointConfig:
    dir: str | None = None
    """Checkpoint directory; None means <run_dir>/checkpoints."""
    interval: int | str = "auto"
    """Save every N steps and at the last; "auto" times a save after 5 steps and saves every
    Daly-optimal interval for checkpoint.mtbf_hours (and at the last step); 0: no saves along the
    way (the last step's still, unless checkpoint.final is false)."""
    final: bool = True
    """With interval 0, still save the last step, so every finished run keeps its model (for
    `gridtrain sample`, `eval`, `export` and --resume); false: a run that saves nothing. (With an
    interval the last step is always saved.)"""
    mtbf_hours: float = 24.0
    """Mean time between failures of the whole job, for interval = "auto" (a cluster's per-GPU
    MTBF divided by the GPU count; Llama 3 saw one interruption every ~2.8 h on 16,384 GPUs)."""
    keep: int = 3
    """Number of most recent checkpoints kept."""
    resume: bool = False
    """Continue from the newest complete, intact checkpoint in the checkpoint directory
    (always on when torchrun restarts the run)."""
    on_save_error: OnSaveError = "stop"
    """A save that fails (disk full, permission denied): 'stop' the run with the error, or
    'continue' training and try again at the next interval. Earlier checkpoints stay intact."""
    timeout_s: float = 1800.0
    """How long ranks wait for each other while saving or loading (rank 0 alone hashes and
    commits every shard meanwhile): a separate group from training's collective timeout."""
    async_save: bool = False
    """Write checkpoints in the background while training goes on (committed at the next save
    or the end of the run)."""
    signal_grace_s: float = 60.0
    """On SIGTERM or SIGUSR1 (what SLURM, Kubernetes and torchrun send before they stop a job):
    finish the step, save a checkpoint and exit within this many seconds (past it, the process
    exits as the signal would have); 0 exits at once without saving."""


@dataclass
class FaultConfig:
    """Fault injection, for testing recovery: it fires on the first attempt only, never after
    torchrun restarts the run."""

    at_step: int = 0
    """The step at whose start the fault fires (0: never)."""
    kill_rank: int = -1
    """This rank kills itself with SIGKILL at fault.at_step (-1: none)."""
    hang_rank: int = -1
    """This rank stops responding (sleeps) at fault.at_step (-1: none)."""
    slow_rank: int = -1
    """This rank computes fault.slow_factor times slower from fault.at_step on, in every attempt
    (it burns CPU after each forward and backward): a straggler (-1: none)."""
    slow_factor: float = 2.0
    """How much slower fault.slow_rank computes (2: half speed)."""
    pause_s: float = 0.0
    """Every rank sleeps this many seconds after each step from fault.at_step on, in every
    attempt, without using the CPU: paces a run while another job joins it (0: never)."""


@dataclass
class FaultToleranceConfig:
    """Replica groups that drop out and rejoin while the others train, through torchft (the `ft`
    extra). Each of parallel.dp_replicate replica groups is its own torchrun job of
    dp_shard x ... ranks; groups meet at a lighthouse each step, all-reduce gradients across the
    live ones, and a group that starts late is sent the weights and optimizer state by a live
    peer, without a checkpoint read (fault_tolerance.lighthouse says how to start the lighthouse)."""

    enabled: bool = False
    """Make the dp_replicate axis torchft replica groups (HSDP: zero_stage 2 or 3)."""
    lighthouse: str = ""
    """The lighthouse's address, e.g. http://127.0.0.1:29510: start it first, bound to an address
    every group reaches, with `torchft_lighthouse --bind 127.0.0.1:29510 --min_replicas 1
    --join_timeout_ms 1000` (the binary comes with torchft; loopback in tests)."""
    replica_group: int = 0
    """This job's replica group, 0..parallel.dp_replicate-1; a restarted group keeps its number."""
    min_replicas: int = 1
    """Steps commit only while at least this many replica groups take part."""
    quorum_timeout_s: float = 60.0
    """How long a step waits for the lighthouse's quorum before the job fails; a new run's first
    step also waits up to this long for all parallel.dp_replicate groups, then starts with those
    that came."""
    timeout_s: float = 30.0
    """Cross-group collectives, commits and the weight transfer to a rejoining group fail after
    this many seconds (the step is then redone by the live groups)."""


@dataclass
class ParallelConfig:
    dp_replicate: int = 1
    """Data-parallel replicas that hold full copies of the (tensor/pipeline-split) model."""
    dp_shard: int = -1
    """Data-parallel ranks that shard parameters, gradients and optimizer state (ZeRO/FSDP);
    -1 takes what the world leaves after the other degrees."""
    tp: int = 1
    """Tensor-parallel degree: attention heads and MLP columns split across this many ranks."""
    pp: int = 1
    """Pipeline-parallel degree: the layers split into this many groups of stages."""
    cp: int = 1
    """Context-parallel degree: each sequence split over this many ranks (2 x cp chunks, rank r
    holding chunks r and 2cp-1-r), attention by ring attention; FSDP shards over dp_shard x cp."""
    cp_rotate: str = "ring"
    """How context parallelism moves keys and values: 'ring' (to the next rank, overlapped with
    the block computed meanwhile) or 'allgather' (all of them at once, as Llama 3 trained)."""
    ep: int = 1
    """Expert-parallel degree (reserved: must be 1 until mixture-of-experts lands)."""
    zero_stage: int = 3
    """0: DDP; 1: optimizer state sharded; 2: also gradients; 3: also parameters (FSDP).
    Stages 0 and 1 treat every data-parallel rank as a replica; 2 and 3 shard over dp_shard and
    replicate over dp_replicate (HSDP when both exceed 1)."""
    sequence_parallel: bool = False
    """With tp > 1: also split norms and residual regions along the sequence (Megatron SP)."""
    pp_schedule: RuntimeScheduleName = DEFAULT_SCHEDULE
    """The pipeline schedule (gridtrain.layout.schedules has what each one does)."""
    pp_virtual_stages: int = 1
    """Stages per pipeline rank (2 or more interleaves; 'zbv' and 'dualpipev' need exactly 2)."""
    pp_fewer_edge_layers: int = 0
    """Layers fewer on the first and last stage, which also hold embedding and head (Llama 3: 1)."""
    nproc: int = 1
    """Processes started by `gridtrain train --nproc N` (torchrun sets the world size itself)."""


@dataclass
class MetricsConfig:
    log_every: int = 10
    """Log a line every N steps (metrics.jsonl and TensorBoard get every step)."""
    tensorboard: bool = True
    """Also write TensorBoard event files into the run directory."""
    progress: bool = True
    """Show a progress bar when standard error is a terminal."""
    account_every: int = 50
    """Measure memory buckets and collective bytes on step 1 and every N steps; 0 turns it off."""
    straggler_every: int = 50
    """Every N steps log the spread of per-rank compute time per step and name a rank that was
    the slowest, by over 1.2x the median, in 2 such windows in a row (a straggler); 0 turns it off."""


@dataclass
class Config:
    run_dir: str = "runs/default"
    """The run directory: metrics.jsonl, TensorBoard events, checkpoints by default."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    fault_tolerance: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.checkpoint.dir) if self.checkpoint.dir else Path(self.run_dir) / "checkpoints"

    @property
    def global_batch_seqs(self) -> int:
        if self.train.global_batch_tokens is not None:
            return self.train.global_batch_tokens // self.data.seq_len
        return self.train.global_batch

    def local_batch(self, dp: int) -> int:
        """Sequences one of `dp` data-parallel ranks reads per step."""
        return self.global_batch_seqs // dp

    def microbatches(self, dp: int) -> int:
        """Micro-batches one data-parallel rank runs per step (accumulated, or through the pipeline)."""
        return self.local_batch(dp) // self.train.micro_batch
