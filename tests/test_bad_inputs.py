"""Bad input, whatever the command: exit status 2, one line on stderr that names the value and
the fix, no traceback, and no file changed anywhere (the inputs the case points at included).

Table-driven: each case is argv and words the message must hold. `{d}` in argv stands for a
folder of inputs: `afile` (a text file), `bad.toml` (not TOML), `notok.json` (not a tokenizer),
`run` (a run directory: config.json and a metrics.jsonl with a broken line), `badrun` (its
config.json a JSON list), `hf` (a Hugging
Face directory with a malformed config.json), `trunc` (one whose safetensors file is cut short).
Besides the hand-written cases, every configuration key of each type gets the values its type
refuses (generated from `all_keys`, so a new key is covered the day it is added).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from gridtrain.cli import main
from gridtrain.config_load import all_keys

PLAN = [
    (["plan", "--top", "0"], "--top: 0 must be >= 1"),
    (["plan", "--top", "-1"], "--top: -1 must be >= 1"),
    (["plan", "--top", "x"], "--top: 'x' is not a whole number"),
    (["plan", "--num-gpus", "1.5"], "--num-gpus = '1.5' is 1.5, not a whole number"),
    (["plan", "--num-gpus", "0"], "--num-gpus = '0' must be a positive finite count"),
    (["plan", "--num-gpus", "inf"], "--num-gpus = 'inf' must be a positive finite count"),
    (["plan", "--num-gpus", "16M"], "more GPUs than this model and batch can keep busy, at most 1,048,576"),
    (["plan", "--seq-len", "-5"], "--seq-len = '-5' must be a positive finite count"),
    (["plan", "--seq-len", "1e20"], "--seq-len = '1e20' is too large"),
    (["plan", "--num-gpus", "1e9"], "more GPUs than this model and batch can keep busy"),
    (["plan", "--global-batch-tokens", "1e20"], "--global-batch-tokens = '1e20' is too large"),
    (["plan", "--global-batch", "2.5"], "--global-batch = '2.5' is 2.5, not a whole number"),
    (["plan", "--global-batch", "16", "--global-batch-tokens", "1M"], "--global-batch and --global-batch-tokens are both given"),
    (["plan", "--tokens", "abc"], "--tokens = 'abc' is not a count"),
    (["plan", "--tokens", "0"], "--tokens = '0' must be a positive finite count"),
    (["plan", "--price", "-2"], "--price: -2 must be >= 0"),
    (["plan", "--pue", "0.5"], "--pue: 0.5 must be >= 1"),
    (["plan", "--electricity-price", "nan"], "--electricity-price: nan must be >= 0"),
    (["plan", "--mtbf-hours", "0"], "--mtbf-hours: 0 must be > 0"),
    (["plan", "--mtbf-hours", "inf"], "--mtbf-hours: inf must be > 0"),
    (["plan", "--hbm-usable", "0"], "--hbm-usable: 0 must be > 0 and <= 1"),
    (["plan", "--hbm-usable", "1.5"], "--hbm-usable: 1.5 must be > 0 and <= 1"),
    (["plan", "--precision", "fp8"], "invalid choice: 'fp8'"),
    (["plan", "--gpu", "nosuch"], "unknown accelerator 'nosuch'"),
    (["plan", "--cluster", "nosuch"], "unknown cluster 'nosuch'"),
    (["plan", "--hardware", "{d}/missing.toml"], "No such file or directory"),
    (["plan", "--hardware", "{d}/bad.toml"], "--hardware {d}/bad.toml"),
    (["plan", "--layout", "garbage"], "--layout item 'garbage': expected KEY=VALUE"),
    (["plan", "--layout", "tp=0"], "--layout tp=0 is out of range"),
    (["plan", "--layout", "tp=8,tp=4"], "--layout gives tp twice"),
    (["plan", "--layout", "schedule=nosuch"], "--layout schedule=nosuch: choose one of"),
    (["plan", "--layout", "zero=4"], "(ZeRO stages are 0-3)"),
    (["plan", "--model", "nosuch"], "unknown model preset 'nosuch'"),
    (["plan", "--model.n_layers", "0"], "model.n_layers = 0 must be positive"),
    (["plan", "--model.dim", "x"], "model.dim = 'x' is not a valid int"),
    (["plan", "--arch", "rnn"], "invalid choice: 'rnn'"),
    (["plan", "--check", "{d}/missing"], "is not a gridtrain run directory (no config.json)"),
    (["plan", "--check", "{d}/afile"], "is not a gridtrain run directory (no config.json)"),
    (["plan", "--check", "{d}/run"], "{d}/run/config.json is not a gridtrain run record (KeyError: 'dims')"),
    (["plan", "--check", "{d}/badrun"], "{d}/badrun/config.json is not a gridtrain run record (TypeError"),
    (["plan", "--bogus"], "gridtrain plan takes model.* keys beyond its own options, not bogus"),
    (["plan", "--model", "small", "--model.moe.top_k", "2"], "model.moe.top_k is set, but model.preset 'small' is dense"),
]

MODEL = [
    (["model", "nosuch"], "unknown model preset 'nosuch'; choose one of"),
    (["model", "llama3-8b", "--seq-len", "-5"], "--seq-len: -5 must be >= 1"),
    (["model", "llama3-8b", "--seq-len", "0"], "--seq-len: 0 must be >= 1"),
    (["model", "llama3-8b", "--model.dim", "0"], "model.dim = 0 must be positive"),
    (["model", "llama3-8b", "--model.n_heads", "7"], "must be divisible by model.n_heads (7)"),  # two problems
    (["model", "llama3-8b", "--model.n_layers", "1e20"], "model.n_layers = '1e20' is too large"),
    (["model", "llama3-8b", "--model.vocab_size", "0"], "model.vocab_size = 0 must be positive"),
    (["model", "llama3-8b", "--model.dim", "4096000000"], "model.dim (4,096,000,000) makes a weight of"),
    (["model", "llama3-8b", "--model.rope_theta", "-5"], "model.rope_theta = -5.0 must be positive"),
    (["model", "llama3-8b", "--model.nosuch", "1"], "unknown config key 'model.nosuch'"),
    (["model", "tiny", "--model.moe.top_k", "2"], "model.moe.top_k is set, but model.preset 'tiny' is dense"),
    (["model", "tiny-moe", "--model.moe.top_k", "9"], "model.moe.top_k (9) is more than model.moe.num_experts (8)"),
    (["model", "tiny-moe", "--model.moe.num_experts", "0"], "model.moe.num_experts = 0 must be >= 1"),
    (["model", "tiny-moe", "--model.moe.capacity_factor", "-1"], "model.moe.capacity_factor = -1.0 must be > 0"),
    (["model", "tiny-moe", "--model.moe.capacity_factor", "0"], "model.moe.capacity_factor = 0.0 must be > 0"),
    (["model", "tiny-moe", "--model.moe.score", "relu"], "model.moe.score = 'relu' is not one of softmax, sigmoid"),
    (["model", "tiny-moe", "--model.moe.balance", "loss"], "model.moe.balance = 'loss' is not one of aux_loss, bias"),
    (["model", "tiny-moe", "--model.moe.first_dense", "2"], "model.moe.first_dense (2) leaves no MoE layer"),
    (["model", "tiny-moe", "--model.moe.expert_ffn_dim", "30"],
     "model.moe.expert_ffn_dim = 30 is not a multiple of 8, which torch._grouped_mm needs"),
    (["model", "tiny-moe", "--model.moe.aux_loss_coef", "-0.1"], "model.moe.aux_loss_coef = -0.1 must be >= 0"),
    (["model", "tiny", "--model.head_dim", "15"], "model.head_dim = 15 must be even for RoPE"),
    (["model", "tiny-moe", "--model.moe.top_k", "1"], "makes every gate value route_scale, so the language-model loss"),
]

TRAIN = [
    (["train", "--dry-run", "--model.preset", "tiny"], "--dry-run needs --world N"),
    (["train", "--world", "4", "--model.preset", "tiny"], "--world and --rank go with --dry-run"),
    (["train", "--dry-run", "--world", "0"], "--world: 0 must be >= 1"),
    (["train", "--dry-run", "--world", "4", "--rank", "4", "--model.preset", "tiny"],
     "--rank 4 is not a rank of a 4-rank job: give 0 to 3"),
    (["train", "--dry-run", "--world", "4", "--run_dir", "{d}/run", "--model.preset", "tiny"],
     "holds a training run: give the dry run another --run_dir"),
    (["train", "--dry-run", "--world", "3", "--parallel.tp", "2", "--model.preset", "tiny"], "cannot fill world size 3"),
    (["train", "--dry-run", "--world", "1", "--model.preset", "tiny-moe"],
     "cannot run torch._grouped_mm on fake tensors (its meta kernel takes bf16 only)"),
    (["train", "--model.preset", "tiny-moe", "--nproc", "4", "--parallel.cp", "2", "--model.moe.capacity_factor", "1"],
     "model.moe.capacity_factor (1.0) keeps each expert's first tokens of a micro-batch, which parallel.cp (2) splits"),
    (["train", "--model.preset", "tiny-moe", "--nproc", "16", "--parallel.ep", "2", "--model.moe.expert_ffn_dim", "36"],
     "model.moe.expert_ffn_dim (36) must be a multiple of the 8 ranks that FSDP shards each expert over "
     "(dp_shard x cp / ep = 16 x 1 / 2)"),
    (["train", "--model.preset", "tiny-moe", "--nproc", "2", "--parallel.ep", "2", "--model.moe.num_experts", "3",
      "--model.moe.top_k", "1"], "parallel.ep (2) must divide model.moe.num_experts (3)"),
    (["train", "--model.preset", "tiny-moe", "--train.compile"], "which train.compile has not been compared"),
    (["train", "--model.preset", "tiny", "--model.qk_norm", "--nproc", "2", "--parallel.tp", "2"],
     "model.qk_norm normalises each head with one weight, which parallel.tp (2) has not been compared"),
    (["train", "--model.preset", "tiny-moe", "--parallel.ep", "2"], "parallel.ep (2) borrows its ranks from the "
     "data- and context-parallel ranks and must divide dp_replicate x dp_shard x cp (1 x 1 x 1 = 1)"),
    (["train", "--max-restarts", "-1"], "--max-restarts: -1 must be >= 0"),
    (["train", "--nproc", "0"], "--nproc: 0 must be >= 1"),
    (["train", "--nproc", "two"], "--nproc: 'two' is not a whole number"),
    (["train", "--train.threads", "0"], "train.threads = 0 must be >= 1"),
    (["train", "--train.threads", "100000"], "train.threads = 100000 is more than this machine's"),
    (["train", "--checkpoint.signal_grace_s", "-1"], "checkpoint.signal_grace_s = -1.0 must be a number of seconds >= 0"),
    (["train", "--train.step", "3"], "unknown config key 'train.step'; did you mean 'train.steps'?"),
    (["train", "--train.steps"], "--train.steps needs a value (--train.steps VALUE)"),
    (["train", "--train.steps", "-5"], "train.steps = -5 must be >= 1"),
    (["train", "stray"], "unexpected argument 'stray'"),
    (["train", "--run_dir", ""], "run_dir is empty (it would write into the current directory)"),
    (["train", "--run_dir", "{d}/afile"], "run_dir {d}/afile is a file, not a directory"),
    (["train", "--run_dir", "{d}/afile/sub"], "{d}/afile is a file, not a directory: give another --run_dir"),
    (["train", "--run_dir", "/proc/gridtrain-run"], "run_dir /proc/gridtrain-run: /proc cannot be written"),
    (["train", "--run_dir", "{d}/run"], "already holds a run (its config.json): continue it with --resume"),
    (["train", "--run_dir", "{d}/badrun", "--resume"], "{d}/badrun/config.json is not a gridtrain run record"),
    (["train", "--config", "missing.toml"], "--config missing.toml: no such file or directory"),
    (["train", "--config", "."], "--config .: is a directory"),
    (["train", "--config", "{d}/bad.toml"], "--config {d}/bad.toml is not valid TOML"),
    (["train", "--train.global_batch", "16", "--train.global_batch_tokens", "4096"],
     "train.global_batch and train.global_batch_tokens are both given"),
    (["train", "--train.global_batch", "15"], "train.global_batch (15 sequences) must be divisible by"),
    (["train", "--train.global_batch_tokens", "1000"], "must be a positive multiple of data.seq_len (256)"),
    (["train", "--train.micro_batch", "0"], "train.micro_batch = 0 must be >= 1"),
    (["train", "--model.preset", "nosuch"], "model.preset = 'nosuch' is unknown"),
    (["train", "--model.max_seq_len", "10000000000"], "the rotary table, model.max_seq_len (10,000,000,000) x head_dim"),
    (["train", "--model.dim", "268435456", "--model.n_heads", "1", "--model.n_kv_heads", "1"], "makes a weight of"),
    (["train", "--data.seq_len", "100000"], "data.seq_len (100000) is longer than the model's context"),
    (["train", "--model.vocab_size", "10"], "model.vocab_size (10) is smaller than the vocabulary"),
    (["train", "--model.dim", "7"], "model.dim (7) must be divisible by model.n_heads (8)"),
    (["train", "--model.dim", "24", "--model.n_heads", "8"], "head_dim = model.dim / model.n_heads = 24 / 8 = 3 must be even"),
    (["train", "--parallel.dp_shard", "-2"], "parallel.dp_shard = -2 must be >= 1, or -1 to fill the world"),
    (["train", "--parallel.tp", "0"], "parallel.tp = 0 must be >= 1"),
    (["train", "--parallel.tp", "3"], "does not divide it; launch a multiple of 3 processes"),
    (["train", "--parallel.pp_fewer_edge_layers", "5"], "pp_fewer_edge_layers = 5 does nothing with one pipeline stage"),
    (["train", "--parallel.zero_stage", "4"], "parallel.zero_stage = 4 is not one of 0, 1, 2, 3"),
    (["train", "--parallel.pp_schedule", "nosuch"], "parallel.pp_schedule = 'nosuch' is not one of"),
    (["train", "--nproc", "4", "--parallel.cp", "4", "--data.seq_len", "100"],
     "parallel.cp (4) cuts each sequence into 2 x cp = 8 equal chunks, which data.seq_len (100) does not divide: "
     "set data.seq_len to 96"),
    (["train", "--nproc", "3", "--parallel.cp", "2"], "dp_replicate(1) * cp(2) * tp(1) * pp(1) = 2 does not divide it"),
    (["train", "--nproc", "4", "--parallel.cp", "2", "--parallel.zero_stage", "0", "--parallel.dp_replicate", "2"],
     "parallel.zero_stage 0 does not: set parallel.zero_stage to 2 or 3"),
    (["train", "--nproc", "2", "--parallel.cp", "2", "--train.compile", "true"],
     "which train.compile's whole-block graphs cannot hold: set train.compile to false"),
    (["train", "--nproc", "2", "--parallel.cp", "2", "--parallel.cp_rotate", "spiral"],
     "parallel.cp_rotate = 'spiral' is not one of"),
    (["train", "--data.doc_positions", "reset", "--data.doc_mask", "true"],
     "data.doc_positions = 'reset' is not one of continue, restart"),
    (["train", "--data.doc_positions", "restart"], "restarts RoPE positions at each document, which needs data.doc_mask"),
    (["train", "--data.doc_mask", "true", "--train.compile", "true"],
     "data.doc_mask gives every micro-batch its own attention blocks"),
    (["train", "--nproc", "2", "--model.preset", "tiny-moe", "--data.doc_mask", "true", "--train.precision", "fp16"],
     "data.doc_mask beside model.preset 'tiny-moe' (a mixture of experts) in fp16 is not compared over several ranks"),
    (["train", "--nproc", "2", "--parallel.ep", "2"], "parallel.ep (2) shards the routed experts of a mixture of "
     "experts, and model.preset 'small' is dense"),
    (["train", "--nproc", "2", "--parallel.tp", "2", "--parallel.sequence_parallel", "true", "--data.seq_len", "255"],
     "parallel.sequence_parallel splits data.seq_len (255)"),
    (["train", "--train.precision", "fp8"], "train.precision = 'fp8' is not one of fp32, bf16, fp16"),
    (["train", "--train.float8", "e4m3"], "train.float8 = 'e4m3' is not one of none, tensorwise, rowwise"),
    (["train", "--train.float8", "tensorwise"], "not beside train.precision = 'fp32': set train.precision = 'bf16'"),
    (["train", "--train.float8", "rowwise", "--train.precision", "bf16", "--model.ffn_dim", "776"],
     "model.ffn_dim = 776 is not: make it a multiple of 16"),
    (["train", "--nproc", "2", "--parallel.pp", "2", "--train.float8", "tensorwise", "--train.precision", "bf16"],
     "not with parallel.pp (2)"),
    (["train", "--train.float8", "tensorwise", "--train.precision", "bf16", "--train.compile", "true"],
     "beside train.compile = true has not been compared with one process"),
    (["train", "--dry-run", "--world", "2", "--train.float8", "tensorwise", "--train.precision", "bf16"],
     "dry-run the layout with train.float8 = 'none'"),
    (["train", "--train.recompute", "some"], "train.recompute = 'some'"),
    (["train", "--train.warmup_steps", "1000"], "train.warmup_steps (1000) must lie in [0, train.steps (250)]"),
    (["train", "--train.beta1", "1.5"], "train.beta1 = 1.5 must lie in [0, 1)"),
    (["train", "--train.grad_clip", "-1"], "train.grad_clip = -1.0 must be >= 0.0"),
    (["train", "--train.weight_decay", "-1"], "train.weight_decay = -1.0 must be >= 0.0"),
    (["train", "--train.loss_scale_init", "0"], "train.loss_scale_init = 0.0 must be > 0"),
    (["train", "--data.val_fraction", "0.7"], "data.val_fraction = 0.7 must lie in (0, 0.5)"),
    (["train", "--data.tokenizer", "bpe:100"], "a BPE needs N >= 257 (256 byte symbols + <eos>)"),
    (["train", "--data.tokenizer", "bpe:x"], "N in bpe:N must be a whole number"),
    (["train", "--data.tokenizer", "{d}/missing.json"], "is not 'byte', 'bpe:N' or an existing tokenizer.json file"),
    (["train", "--data.tokenizer", "{d}/notok.json"], "is not a tokenizer.json that tokenizers can read"),
    (["train", "--data.corpus", "{d}/missing"], "data.corpus = '{d}/missing' does not exist"),
    (["train", "--checkpoint.interval", "banana"], "checkpoint.interval = 'banana' is neither a number of steps nor 'auto'"),
    (["train", "--checkpoint.keep", "-1"], "checkpoint.keep = -1 must be >= 1"),
    (["train", "--metrics.log_every", "0"], "metrics.log_every = 0 must be >= 1"),
    (["train", "--nosuch.key", "1"], "unknown config key 'nosuch.key'"),
    (["train", "--nproc", "2", "--parallel.dp_replicate", "2", "--parallel.dp_shard", "2", "--fault_tolerance.enabled", "true"], "fault_tolerance.enabled needs fault_tolerance.lighthouse"),
    (["train", "--nproc", "2", "--fault_tolerance.enabled", "true", "--fault_tolerance.lighthouse", "http://127.0.0.1:29510"],
     "fault_tolerance.enabled needs parallel.dp_replicate >= 2 replica groups, not 1"),
    (["train", "--nproc", "2", "--parallel.dp_replicate", "2", "--parallel.dp_shard", "2", "--fault_tolerance.enabled", "true", "--fault_tolerance.lighthouse", "http://127.0.0.1:29510", "--fault_tolerance.replica_group", "2"],
     "fault_tolerance.replica_group = 2 is not one of the parallel.dp_replicate (2) replica groups: pick 0..1"),
    (["train", "--nproc", "2", "--parallel.dp_replicate", "2", "--parallel.dp_shard", "2", "--fault_tolerance.enabled", "true", "--fault_tolerance.lighthouse", "http://127.0.0.1:29510", "--fault_tolerance.min_replicas", "3"],
     "fault_tolerance.min_replicas = 3 must be in [1, parallel.dp_replicate (2)]"),
    (["train", "--nproc", "2", "--parallel.dp_replicate", "2", "--parallel.dp_shard", "2", "--fault_tolerance.enabled", "true", "--fault_tolerance.lighthouse", "http://127.0.0.1:29510", "--parallel.zero_stage", "1", "--parallel.dp_shard", "1"],
     "not zero_stage 1: torchft's DDP wrapper fails the survivor"),
    (["train", "--nproc", "4", "--parallel.dp_replicate", "2", "--parallel.dp_shard", "2", "--parallel.tp", "2",
      "--fault_tolerance.enabled", "true", "--fault_tolerance.lighthouse", "http://127.0.0.1:29510"], "fault_tolerance runs dense models (moe: False) over data parallelism (tp 2"),
    (["train", "--nproc", "2", "--parallel.dp_replicate", "2", "--parallel.dp_shard", "2", "--fault_tolerance.enabled", "true", "--fault_tolerance.lighthouse", "http://127.0.0.1:29510", "--train.global_batch", "6", "--train.micro_batch", "1"],
     "train.global_batch (6 sequences) must be divisible by 2 live replica groups x dp_shard (2) x train.micro_batch (1) = 4"),
    (["train", "--fault.pause_s", "-1"], "fault.pause_s = -1.0 must be a number of seconds >= 0"),
    (["train", "--parallel.dp_replicate", "2", "--parallel.dp_shard", "1", "--fault_tolerance.enabled", "true",
      "--fault_tolerance.lighthouse", "http://127.0.0.1:29510"], "fault_tolerance needs FSDP inside each replica group"),
]

OTHERS = [
    (["data", "prepare", "--val-fraction", "0"], "--val-fraction: 0 must be > 0 and <= 0.5"),
    (["data", "prepare", "--val-fraction", "0.9"], "--val-fraction: 0.9 must be > 0 and <= 0.5"),
    (["data", "prepare", "--seed", "-1"], "--seed: -1 must be >= 0"),
    (["data", "prepare", "{d}/missing", "--out", "{d}/out"], "corpus {d}/missing not found"),
    (["data", "prepare", "--tokenizer", "bpe:100", "--out", "{d}/out"], "--tokenizer = 'bpe:100': a BPE needs N >= 257"),
    (["data", "prepare", "--tokenizer", "{d}/missing.json", "--out", "{d}/out"], "an existing tokenizer.json file"),
    (["data", "prepare", "--tokenizer", "{d}/notok.json", "--out", "{d}/out"], "is not a tokenizer.json that tokenizers can read"),
    (["data", "prepare", "{d}/afile", "--out", "/proc/gridtrain-data"], "--out /proc/gridtrain-data: /proc cannot be written"),
    (["data", "prepare", "{d}/afile", "--out", "{d}/afile/x"], "--out {d}/afile/x: {d}/afile is a file, not a directory"),
    (["data", "prepare", "{d}/afile", "--out", "{d}"], "exists and is not a prepared directory"),
    (["data", "prepare", "{d}/afile", "--tokenizer", "bpe:300", "--out", "{d}"], "exists and is not a prepared directory"),
    (["data", "prepare", "{d}/afile", "--tokenizer", "bpe:300", "--out", "{d}/o", "--cache-dir", "/proc/gridtrain-cache"],
     "--cache-dir /proc/gridtrain-cache"),
    (["data", "nosuch"], "invalid choice: 'nosuch'"),
    (["calibrate", "--seconds", "0"], "--seconds: 0 must be > 0 and <= 600"),
    (["calibrate", "--seconds", "1e9"], "--seconds: 1e9 must be > 0 and <= 600"),
    (["calibrate", "--threads", "100000"], "--threads: 100000 must be >= 1 and <= "),
    (["plot", "{d}/missing"], "{d}/missing is not a gridtrain run directory (no metrics.jsonl)"),
    (["plot", "{d}/afile"], "is not a gridtrain run directory (no metrics.jsonl)"),
    (["plot", "{d}/run"], "{d}/run/metrics.jsonl:1 is not a metrics record"),
    (["export", "{d}/missing", "{d}/out"], "is not a gridtrain run directory (no config.json)"),
    (["export", "{d}/afile", "{d}/out"], "is not a gridtrain run directory (no config.json)"),
    (["export", "run", "out", "--step", "-3"], "--step: -3 must be >= 0"),
    (["export", "run", "out", "--max-shard-gb", "0"], "--max-shard-gb: 0 must be > 0"),
    (["export", "run", "out", "--max-shard-gb", "inf"], "--max-shard-gb: inf must be > 0"),
    (["export", "{d}/badrun", "{d}/out"], "{d}/badrun/config.json is not a gridtrain run record"),
    (["export", "{d}/run", "{d}/out"], "no intact checkpoint in {d}/run/checkpoints"),
    (["plot", "--out", "/proc/curves.png", "{d}/run"], "--out /proc/curves.png: /proc cannot be written"),
    (["plot", "--out", "{d}", "{d}/run"], "--out {d} is a directory: give a file name"),
    (["model", "tiny", "--dim", "64"], "gridtrain model takes --model.KEY VALUE overrides, not --dim"),
    (["import", "{d}/missing", "{d}/new"], "has no config.json: give a Hugging Face model directory"),
    (["import", "{d}/hf", "{d}/new"], "{d}/hf/config.json is not readable JSON"),
    (["import", "{d}/trunc", "{d}/new"], "{d}/trunc/model.safetensors is not a readable safetensors file"),
    (["bogus"], "invalid choice: 'bogus'"),
    # Files gridtrain reads, checked before they are trusted (hf* folders: see `inputs`).
    (["import", "{d}/hflist", "{d}/new"], "{d}/hflist/config.json is an array (a list), not an object of settings"),
    (["import", "{d}/hfzcfg", "{d}/new"], "{d}/hfzcfg/config.json is not a regular file"),
    (["import", "{d}/hfvocab", "{d}/new"], "vocab_size = 320.5 is not a JSON integer"),
    (["import", "{d}/hflayers", "{d}/new"], 'num_hidden_layers = "2" is not a JSON integer'),
    (["import", "{d}/hfcount", "{d}/new"], "intermediate_size = 160.0 is not a JSON integer (a count is written 2, not 2.0"),
    (["import", "{d}/hfeps", "{d}/new"], 'rms_norm_eps = "abc" is not a finite JSON number'),
    (["import", "{d}/hftie", "{d}/new"], 'tie_word_embeddings = "yes" is not true or false'),
    (["import", "{d}/hfrope", "{d}/new"], 'rope_parameters = "default" is not a JSON object'),
    (["import", "{d}/hfmaxpos", "{d}/new"], "max_position_embeddings = 1000000000000.0 is not a JSON integer"),
    (["import", "{d}/hfrotary", "{d}/new"], "the rotary table, model.max_seq_len (1,000,000,000,000) x head_dim"),
    (["import", "{d}/hfmillion", "{d}/new"],
     "the weights in {d}/hfmillion do not fit its config.json: num_hidden_layers is 1,000,000, the safetensors headers hold 2"),
    (["import", "{d}/hfvocab640", "{d}/new"],
     "model.embed_tokens.weight has shape [320, 64], (vocab_size, hidden_size) is [640, 64]"),
    (["import", "{d}/hfzero", "{d}/new"], "{d}/hfzero/model.safetensors is not a regular file"),
    (["import", "{d}/hfdir", "{d}/new"], "{d}/hfdir/model.safetensors is a directory, not a file"),
    (["import", "{d}/hfindex", "{d}/new"], "names shard files outside {d}/hfindex (['../hfmillion/model.safetensors'])"),
    (["sample", "{d}/run", "--prompt-file", "/dev/zero"], "--prompt-file /dev/zero is not a regular file"),
    (["sample", "{d}/run", "--prompt-file", "{d}/fifo"], "--prompt-file {d}/fifo is not a regular file"),
    (["sample", "{d}/run", "--prompt-file", "{d}"], "--prompt-file {d} is a directory, not a file"),
    (["data", "prepare", "--tokenizer", "/dev/zero", "--out", "{d}/out"], "--tokenizer = '/dev/zero' is not a regular file"),
    (["data", "prepare", "--tokenizer", "{d}/fifo", "--out", "{d}/out"], "--tokenizer = '{d}/fifo' is not a regular file"),
    (["data", "prepare", "--tokenizer", "{d}", "--out", "{d}/out"], "--tokenizer = '{d}' is a directory, not a file"),
    (["train", "--data.tokenizer", "/dev/zero"], "data.tokenizer = '/dev/zero' is not a regular file"),
    (["train", "--data.tokenizer", "{d}"], "data.tokenizer = '{d}' is a directory, not a file"),
]

BAD_BY_TYPE = {"int": ["abc", "1.5", "1e20"], "float": ["abc", "inf", "nan"], "bool": ["maybe"]}
WORDS_BY_VALUE = {"abc": "is not a valid", "1.5": "is not a valid int", "1e20": "is too large",
                  "inf": "must be a finite number", "nan": "must be a finite number", "maybe": "is not a valid bool"}


def generated() -> list[tuple[list[str], str]]:
    """Every key with a value its type refuses: a word for a number, 1.5 for a count, 1e20 (past
    int64 once multiplied), inf and nan for a float, 'maybe' for a switch."""
    cases = []
    for key, (hint, _) in all_keys().items():
        kind = str(hint).replace("<class '", "").replace("'>", "").replace(" | None", "")
        for value in BAD_BY_TYPE.get(kind, []):
            cases.append((["train", f"--{key}", value], f"{key} = '{value}' {WORDS_BY_VALUE[value]}"))
    return cases


DATA = [  # the corpora of issue 32: `records` (in the inputs fixture) holds the files these cases point at
    (["train", "--data.corpus", "{d}/records/cut.parquet"], "cut.parquet is not a readable parquet file"),
    (["data", "prepare", "{d}/records/cut.parquet", "--out", "{d}/out"], "cut.parquet is not a readable parquet file"),
    (["train", "--data.corpus", "{d}/records/pq"], "has no column 'text' (its columns: content): set data.text_column"),
    (["data", "prepare", "{d}/records/pq", "--out", "{d}/out"], "has no column 'text' (its columns: content)"),
    (["data", "prepare", "{d}/records/pq", "--text-column", "body", "--out", "{d}/out"], "has no column 'body'"),
    (["data", "prepare", "{d}/records/bad.jsonl.zst", "--out", "{d}/out", "--workers", "1"],
     "bad.jsonl.zst:2 is not valid UTF-8"),
    (["train", "--data.mix", "{d}/afile=0"], "weight 0 must be a positive finite number"),
    (["train", "--data.mix", "{d}/afile=1,{d}/records/pq=-0.5"], "weight -0.5 must be a positive finite number"),
    (["train", "--data.mix", "{d}/afile=1,{d}/missing=1"], "data.mix source '{d}/missing' does not exist"),
    (["train", "--data.mix", "{d}/afile=1", "--data.corpus", "{d}/afile"], "data.mix and data.corpus"),
    (["train", "--data.tokenizer", "{d}/records/big.json"],
     "model.vocab_size (320) is smaller than the vocabulary of data.tokenizer '{d}/records/big.json' (401)"),
    (["train", "--data.mix", "{d}/afile=1", "--data.tokenizer", "{d}/records/big.json"],
     "set model.vocab_size to at least 448"),
    (["train", "--data.corpus", "{d}/records/prepared"],
     "was prepared with the tokenizer bpe-300-0badcafe (vocabulary 300), not data.tokenizer 'byte'"),
    (["train", "--data.mix", "{d}/afile=1,{d}/records/prepared=1", "--data.tokenizer", "bpe:400"],
     "not data.tokenizer 'bpe:400'"),
    (["plan", "--doc-len", "0"], "--doc-len = '0' must be a positive finite count"),
    (["plan", "--doc-len", "{d}/records"], "--doc-len {d}/records: {d}/records is not a prepared data directory"),
]

CASES = PLAN + MODEL + TRAIN + OTHERS + DATA + generated()


def test_the_table_is_large_and_covers_every_command():
    assert len(CASES) >= 150
    assert {argv[0] for argv, _ in CASES} >= {"plan", "model", "train", "data", "calibrate", "plot", "export", "import"}


@pytest.fixture
def inputs(tmp_path: Path) -> Path:
    d = tmp_path / "inputs"
    d.mkdir()
    (d / "afile").write_text("some text\n" * 20)
    (d / "bad.toml").write_text("x = [\n")
    (d / "notok.json").write_text("not json")
    run = d / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"config": {"model": {"preset": "tiny"}}}))
    (run / "metrics.jsonl").write_text('{"step": 1, "loss/train": 2.0\n{"step": 2, "loss/train": 1.9}\n')
    (d / "badrun").mkdir()
    (d / "badrun" / "config.json").write_text("[1, 2]")
    (d / "hf").mkdir()
    (d / "hf" / "config.json").write_text("{not json")
    (d / "trunc").mkdir()
    (d / "trunc" / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
        "vocab_size": 320, "max_position_embeddings": 64, "rope_theta": 10000.0, "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False}))
    (d / "trunc" / "model.safetensors").write_bytes(b"\x40\x00\x00\x00\x00\x00\x00\x00{\"a\":")
    # Files gridtrain reads, checked before they are trusted: Hugging Face folders whose config.json
    # changes one key of `trunc`'s; two layers' worth of tiny weights beside some.
    import os

    import torch
    from safetensors.torch import save_file

    config = json.loads((d / "trunc" / "config.json").read_text()) | {"model_type": "llama"}
    weights = {"model.embed_tokens.weight": torch.zeros(320, 64), "model.layers.0.input_layernorm.weight": torch.ones(64),
               "model.layers.1.input_layernorm.weight": torch.ones(64)}
    for name, change in {"hfvocab": {"vocab_size": 320.5}, "hflayers": {"num_hidden_layers": "2"},
                         "hfcount": {"intermediate_size": 160.0}, "hfeps": {"rms_norm_eps": "abc"},
                         "hftie": {"tie_word_embeddings": "yes"}, "hfrope": {"rope_parameters": "default"},
                         "hfmaxpos": {"max_position_embeddings": 1e12},
                         "hfrotary": {"max_position_embeddings": 10**12}, "hfmillion": {"num_hidden_layers": 10**6},
                         "hfvocab640": {"vocab_size": 640}, "hfzero": {}, "hfdir": {}, "hfindex": {}}.items():
        (d / name).mkdir()
        (d / name / "config.json").write_text(json.dumps(config | change))
        if name not in ("hfzero", "hfdir", "hfindex"):
            save_file(weights, d / name / "model.safetensors")
    (d / "hfzero" / "model.safetensors").symlink_to("/dev/zero")
    (d / "hfdir" / "model.safetensors").mkdir()
    (d / "hfindex" / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"model.norm.weight": "../hfmillion/model.safetensors"}}))
    (d / "hflist").mkdir()
    (d / "hflist" / "config.json").write_text("[1, 2]")
    (d / "hfzcfg").mkdir()
    (d / "hfzcfg" / "config.json").symlink_to("/dev/zero")
    os.mkfifo(d / "fifo")
    write_records(d / "records")
    return d


def write_records(r: Path) -> None:
    """Corpora refused in one line: a parquet file cut in half, a folder of parquet without a 'text'
    column, zstd JSON lines whose second line is not UTF-8, a tokenizer.json of 401 tokens (the
    tiny model has 320), a prepared folder's manifest naming another tokenizer than the default byte."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard
    from tokenizers import Tokenizer, models

    (r / "pq").mkdir(parents=True)
    pq.write_table(pa.table({"content": ["some text"] * 50}), r / "pq" / "part-0.parquet")
    data = (r / "pq" / "part-0.parquet").read_bytes()
    (r / "cut.parquet").write_bytes(data[: len(data) // 2])
    (r / "bad.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(b'{"text": "ok"}\n{"text": "\xff"}\n'))
    vocab = {"<eos>": 0, "<unk>": 1} | {f"w{i}": i + 2 for i in range(399)}
    Tokenizer(models.WordLevel(vocab, unk_token="<unk>")).save(str(r / "big.json"))
    (r / "prepared").mkdir()
    (r / "prepared" / "index.json").write_text(json.dumps({"format_version": 1, "tokenizer": "bpe-300-0badcafe",
                                                           "vocab_size": 300, "eos_id": 0, "splits": {}}))


def snapshot(root: Path) -> dict[str, str]:
    """Every path under root with a digest of its content (directories: their name only)."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(root.rglob("*"))}


def run(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exit_:  # argparse's errors
        return exit_.code


@pytest.mark.parametrize("argv,words", CASES, ids=[" ".join(a) for a, _ in CASES])
def test_bad_input_gets_one_clear_line(argv, words, tmp_path, inputs, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # the default cache lives under it
    argv = [a.replace("{d}", str(inputs)) for a in argv]
    words = words.replace("{d}", str(inputs))
    before = snapshot(tmp_path)
    assert run(argv) == 2
    out, err = capsys.readouterr()
    assert words in err, err
    assert "Traceback" not in err and out == ""
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines[0].startswith("gridtrain"), err
    assert len(lines) == 1 or (lines[0].endswith("invalid configuration:")  # or one line per broken relation
                               and all(line.startswith("  - ") for line in lines[1:])), err
    assert snapshot(tmp_path) == before  # nothing written, nothing changed, inputs included


def test_a_failure_is_one_line_and_debug_gives_the_traceback(tmp_path, monkeypatch, capsys):
    """A failure nobody anticipated (here: plotting raises deep inside) is one line naming its
    type, exit status 1, and says how to get the traceback; --debug prints it, same status."""
    import gridtrain.train.plot

    def broken(run_dir, out):
        raise RuntimeError("the renderer ran out of fonts\nsecond line")

    monkeypatch.setattr(gridtrain.train.plot, "plot_run", broken)
    monkeypatch.chdir(tmp_path)
    argv = ["plot", str(tmp_path)]
    assert run(argv) == 1
    err = capsys.readouterr().err
    assert err == "gridtrain: RuntimeError: the renderer ran out of fonts (run again with --debug for the traceback)\n"
    assert run(["--debug", *argv]) == 1  # the same status, with the traceback before the line
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):") and "second line" in err
    assert err.endswith("gridtrain: RuntimeError: the renderer ran out of fonts\n")
    assert run(["train", "--debug", "--train.steps", "0"]) == 2  # bad input: still 2 with --debug
    assert "ConfigError" in capsys.readouterr().err


@pytest.mark.parametrize("extra, words", [
    (["--run_dir", "{d}/afile"], "run_dir {d}/afile is a file, not a directory"),
    (["--run_dir", "{d}/run"], "already holds a run"),
    (["--parallel.tp", "3"], "launch a multiple of 3 processes"),
])
def test_under_nproc_a_bad_configuration_is_said_once_before_any_process(inputs, extra, words):
    """The launcher checks the configuration and the run directory before torchrun starts a
    process: one line, from one process, the cause first."""
    import subprocess
    import sys

    argv = [a.replace("{d}", str(inputs)) for a in extra]
    out = subprocess.run([sys.executable, "-m", "gridtrain", "train", "--nproc", "2", *argv],
                         capture_output=True, text=True, timeout=120, cwd=inputs)
    assert out.returncode == 2
    lines = out.stderr.splitlines()
    assert len(lines) == 1 and words.replace("{d}", str(inputs)) in lines[0], out.stderr
    assert "launching" not in out.stderr and out.stdout == ""


def test_a_bare_switch_reaches_plan_as_true(capsys):
    assert run(["plan", "--model", "llama3-8b", "--model.tie_embeddings", "--json"]) == 0
    out = capsys.readouterr().out
    assert "\\u0000" not in out and '"tie_embeddings": true' in out.replace("True", "true")


def test_the_batch_form_on_the_command_line_replaces_the_files(tmp_path):
    """configs/default.toml gives train.global_batch; --train.global_batch_tokens replaces it
    (both on one source is the refusal), and 'none' clears a form."""
    from gridtrain.config import ConfigError
    from gridtrain.config_load import load_config

    toml = tmp_path / "c.toml"
    toml.write_text("[train]\nglobal_batch = 16\n")
    cfg = load_config(toml, {"train.global_batch_tokens": "8192", "data.seq_len": "256"})
    assert cfg.train.global_batch_tokens == 8192 and cfg.global_batch_seqs == 32
    assert load_config(None, {"train.global_batch": "8", "train.global_batch_tokens": "null"}).global_batch_seqs == 8
    toml.write_text("[train]\nglobal_batch = 16\nglobal_batch_tokens = 4096\n")
    with pytest.raises(ConfigError, match="both given on --config"):
        load_config(toml)
    toml.write_text("[train]\nglobal_batch_tokens = 100000000000000000000\n")
    with pytest.raises(ConfigError, match=r"train.global_batch_tokens = 100000000000000000000 is too large"):
        load_config(toml)


def test_a_none_batch_form_on_the_command_line_keeps_the_files(tmp_path):
    from gridtrain.config_load import load_config

    toml = tmp_path / "c.toml"
    toml.write_text("[train]\nglobal_batch = 24\n")
    assert load_config(toml, {"train.global_batch_tokens": "none"}).global_batch_seqs == 24
    assert load_config(None, {"train.seed": "1732345678901234567"}).train.seed == 1732345678901234567  # not a count


def test_plot_writes_where_it_says(tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "loss/train": 2.0, "throughput/tokens_per_s": 9.0}\n')
    assert run(["plot", str(run_dir), "--out", str(tmp_path / "new" / "curves")]) == 0
    assert capsys.readouterr().out == f"wrote {tmp_path / 'new' / 'curves.png'}\n"
    assert (tmp_path / "new" / "curves.png").is_file()
