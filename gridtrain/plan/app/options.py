"""`gridtrain plan`'s command-line options, shared by the command and the explorer's API (which
answers a request by parsing the same options)."""

from __future__ import annotations

import argparse

from gridtrain.argtypes import number
from gridtrain.names import FLOAT8, PRECISIONS
from gridtrain.plan.state import CONVENTIONS


def add_plan_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """`gridtrain plan`'s options (model.* keys come as extra arguments, as for train)."""
    p = sub.add_parser("plan", help="memory, step time, cost and the best layouts for a model on a cluster; "
                       "--model.KEY VALUE overrides the model's shape")
    p.add_argument("--model", default="llama3-8b", help="a model preset (see `gridtrain model --list`)")
    p.add_argument("--arch", default="llama", choices=["llama", "gpt"],
                   help="block family: llama (RMSNorm, GQA, SwiGLU) or gpt (LayerNorm, GELU ffn = 4h, learned positions)")
    p.add_argument("--gpu", default="h100", help="accelerator: h100, h200, a100, a100-40gb, b200, v100, tpu-v5p, ...; "
                   "local: N processes of this machine, as `gridtrain calibrate` measured it")
    p.add_argument("--cluster", help="a cluster shape (dgx-h100, selene-a100, or one from --hardware)")
    p.add_argument("--hardware", help="TOML file of [accelerator.NAME] and [cluster.NAME] tables")
    p.add_argument("--num-gpus", default="8", help="GPUs (K/M suffixes allowed)")
    p.add_argument("--seq-len", help="tokens per sequence (default: the model's context)")
    p.add_argument("--global-batch-tokens", help="tokens per optimizer step, e.g. 16M")
    p.add_argument("--global-batch", help="sequences per optimizer step (instead of --global-batch-tokens)")
    p.add_argument("--tokens", help="training tokens, e.g. 15.6T (default: Chinchilla, 20 per parameter)")
    p.add_argument("--layout", help="fix some choices: tp=8,pp=16,cp=1,dp=128,zero=1,mb=1,recompute=full,"
                   "schedule=interleaved-1f1b,v=2 (the search fills in the rest)")
    p.add_argument("--top", type=number(int, 1), default=10, help="layouts to rank")
    p.add_argument("--hbm-usable", type=number(float, 0, 1, low_open=True), default=0.9, help="share of HBM a layout may plan for")
    p.add_argument("--no-flash", action="store_true", help="attention keeps its s x s scores")
    p.add_argument("--doc-len", help="document masking (data.doc_mask): documents of this many tokens, packed from "
                   "each sequence's start (the last one cut), or a prepared folder (gridtrain data prepare) whose "
                   "documents are cut at --seq-len as training cuts them; attention's FLOPs, the step time and "
                   "MFU count attention inside documents only")
    p.add_argument("--precision", default="bf16", choices=PRECISIONS,
                   help="training precision (gridtrain's train.precision)")
    p.add_argument("--float8", default="none", choices=[*FLOAT8, "auto"],
                   help="FP8 training of the block linears beside bf16 (gridtrain's train.float8): their matmuls "
                        "at the device's FP8 peak, FSDP gathering 1 byte a parameter with tensorwise; auto: the "
                        "search ranks with and without it (tensorwise) and takes the faster")
    p.add_argument("--any-layout", action="store_true",
                   help="also rank layouts gridtrain train refuses (ZeRO-1 beside TP, CP beside DDP, ...), labelled")
    p.add_argument("--implementation", default="eager", choices=["eager", "compiled", "megatron"],
                   help="what the kernels reach: gridtrain as it runs (PyTorch eager), under torch.compile, or "
                        "Megatron-LM's fused kernels (each calibrated on published runs)")
    p.add_argument("--convention", default="gridtrain", choices=list(CONVENTIONS),
                   help="bytes per parameter: gridtrain's runtime (fp32 state, 16-bit compute copies), the "
                   "ZeRO paper's 2 + 2 + 12, Megatron-LM's 2 + 4 + 12, or the 12 of lecture notes, 2 + 2 + 8 "
                   "(no fp32 master copy)")
    p.add_argument("--price", type=number(float, 0), help="$ per GPU-hour (default: the cluster's, $2)")
    p.add_argument("--pue", type=number(float, 1), default=1.4, help="facility power usage effectiveness")
    p.add_argument("--electricity-price", type=number(float, 0), default=0.05, help="$ per kWh")
    p.add_argument("--mtbf-hours", type=number(float, 0, low_open=True), default=50_000, help="mean time between failures of one GPU, hours")
    p.add_argument("--check", metavar="RUN_DIR", help="the prediction for a finished gridtrain run beside "
                   "what its ranks measured (memory per bucket)")
    p.add_argument("--json", action="store_true", help="emit the whole plan as JSON")
    p.add_argument("--explain", action="store_true", help="show each formula with its numbers")
    p.add_argument("--reference", action="store_true",
                   help="predicted vs published: Megatron-LM's SC21 Table 1 (TFLOP/s per GPU, Megatron kernels) "
                        "and torchtitan's H100 benchmark (tokens/s per GPU and memory, eager and compiled)")
    return p


def plan_parser() -> argparse.ArgumentParser:
    """A parser of `gridtrain plan`'s options alone, without the command's name (the explorer's)."""
    parser = argparse.ArgumentParser(prog="gridtrain")
    return add_plan_parser(parser.add_subparsers(dest="command"))
