#!/usr/bin/env python3
"""Single-device throughput baseline: torchtitan 0.3.0's Llama 3 model.

Standalone (imports nothing of gridtrain). It drives torchtitan's own building
blocks the way ``torchtitan.trainer.Trainer`` does on one GPU, minus the data
loader / tokenizer / checkpointer / metrics:

* model: ``torchtitan.models.llama3`` layer builder (``_build_llama3_layers``,
  the same helper the 1B/3B/8B flavors use) with the exact --dim/--n-layers/
  --n-heads/--n-kv-heads/--ffn-dim/--vocab; tied embeddings by default, like
  the 1B flavor (``enable_weight_tying=True``, embedding init skipped); built on
  the meta device, then ``to_empty`` + ``init_weights`` like the trainer.
* parallelize: torchtitan's ``parallelize_llama`` itself, i.e. AC
  (``FullAC`` / ``SelectiveAC`` from ``torchtitan.distributed.activation_checkpoint``)
  -> per-TransformerBlock ``torch.compile(fullgraph=True)`` (``apply_compile``)
  -> ``apply_fsdp_to_decoder`` on a 1-rank "fsdp" mesh.  NOTE: torchtitan 0.3.0
  has no ``maybe_enable_amp``/autocast path any more: on one GPU it always
  runs FSDP2 at degree 1 "to install the MixedPrecisionPolicy"
  (param bf16, reduce fp32, fp32 master params).  ``--mp autocast`` is an
  optional non-torchtitan variant (AC + compile applied the same way, no FSDP,
  fp32 params under ``torch.autocast(bf16)``).
* attention: FlexAttention (torchtitan's only default LM backend; SDPA is
  rejected for language models in 0.3.0) with a causal+document BlockMask built
  by ``model.get_attention_masks(positions)`` (positions = arange, one
  document per row, as the dataloader would emit for unbroken text).
* loss: torchtitan ``CrossEntropyLoss`` (fp32 CE, sum / n_tokens; compiled when
  --compile 1 since the default compile components are ["model", "loss"]).
  torchtitan's llama3 recipes wrap it in ``ChunkedLossWrapper``; we do not
  (full fp32 logits are materialised, like a plain CE).
* optimizer: torchtitan ``default_adamw(lr=8e-4)`` container (AdamW betas
  (0.9, 0.95), eps 1e-8, weight_decay 0.1, implementation "fused"), no LR
  scheduler (affects loss values only, not speed); grad clipping with
  ``torchtitan.distributed.utils.clip_grad_norm_(max_norm=1.0, foreach=True)``;
  torchtitan's GarbageCollection(gc_freq=50).
* CUDA graphs: torchtitan's trainer wraps forward+backward in
  ``wrap_with_cuda_graph`` unless ``training.disable_cuda_graphs``; here that is
  opt-in with ``--cuda-graph 1`` (default 0).

Compatibility shim (torch 2.11): torchtitan 0.3.0's ``distributed/fsdp.py``
does ``from torch.distributed.fsdp import DataParallelMeshDims`` which only
exists in newer torch; it is used only for the full_dtensor backend
(``dp_mesh_dims``), so a placeholder class is installed before import.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
import traceback


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--n-layers", type=int, default=16)
    p.add_argument("--n-heads", type=int, default=32)
    p.add_argument("--n-kv-heads", type=int, default=8)
    p.add_argument("--ffn-dim", type=int, default=8192)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--ac", choices=["none", "selective", "full"], default="none")
    p.add_argument("--compile", type=int, choices=[0, 1], default=0)
    p.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--mp", choices=["fsdp", "autocast"], default="fsdp",
                   help="fsdp = torchtitan 0.3.0's own 1-GPU path (FSDP2 degree 1 "
                        "MixedPrecisionPolicy); autocast = AC+compile without FSDP, "
                        "torch.autocast(bf16)")
    p.add_argument("--attn", choices=["auto", "flex", "flex_flash", "varlen", "sdpa"],
                   default="auto",
                   help="auto = flex on CUDA (torchtitan's default LM backend), "
                        "sdpa on CPU (FlexAttention has no CPU backward; sdpa is a "
                        "non-default torchtitan module, causal via is_causal)")
    p.add_argument("--flex-autotune", type=int, choices=[0, 1], default=1,
                   help="1 = torchtitan's FlexAttention inductor options "
                        "(max_autotune + coordinate_descent_tuning); 0 = plain compile")
    p.add_argument("--tie", type=int, choices=[0, 1], default=1,
                   help="tie tok_embeddings and lm_head (Llama 3.2 1B style)")
    p.add_argument("--cuda-graph", type=int, choices=[0, 1], default=0,
                   help="wrap fwd+bwd in torchtitan's wrap_with_cuda_graph "
                        "(torchtitan trainer default is on)")
    p.add_argument("--spmd-backend", choices=["partial_dtensor", "spmd_types"],
                   default="partial_dtensor",
                   help="torchtitan ParallelismConfig.spmd_backend; identical math "
                        "on one device (no TP/CP)")
    p.add_argument("--float8", choices=["none", "tensorwise", "rowwise"], default="none",
                   help="torchao's float8 training of the block linears (torchtitan 0.3.0's own converter is "
                        "rowwise only and goes through its model config; this applies torchao's directly, with "
                        "torchtitan's filter: block linears with dimensions multiple of 16, not the output head)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="titan_result.json")
    return p.parse_args(argv)


def _shim_torch():
    """torch-2.11 compatibility shims needed before importing torchtitan."""
    import torch.distributed.fsdp as _fsdp

    if not hasattr(_fsdp, "DataParallelMeshDims"):
        class DataParallelMeshDims:  # placeholder; only the full_dtensor path uses it
            def __init__(self, *a, **k):
                raise RuntimeError("DataParallelMeshDims needs a newer torch")

        _fsdp.DataParallelMeshDims = DataParallelMeshDims
        return ["torch.distributed.fsdp.DataParallelMeshDims placeholder"]
    return []


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def run(args, result: dict) -> None:
    import torch

    result["shims"] = _shim_torch()
    import torchtitan
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
    from torchtitan.distributed.compile import apply_compile
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.components.optimizer import default_adamw
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import FlexAttention
    from torchtitan.models import llama3 as tt_llama3
    from torchtitan.models.llama3 import parallelize_llama
    from torchtitan.models.llama3.model import Llama3Model
    from torchtitan.tools import utils as tt_utils
    import spmd_types as spmd

    result["torchtitan_version"] = getattr(torchtitan, "__version__", "?")
    result["torch_version"] = torch.__version__

    on_cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if on_cuda else torch.device("cpu")
    result["device"] = torch.cuda.get_device_name(0) if on_cuda else "cpu"
    if on_cuda:
        torch.cuda.set_device(device)

    # ---- 1-rank process group (torchtitan's init_distributed does the same
    # init_process_group; it is skipped for its flight-recorder env fiddling and
    # because it picks "nccl" even without a GPU).
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    torch.autograd.set_multithreading_enabled(False)  # as init_distributed does
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if on_cuda else "gloo",
                                rank=0, world_size=1)

    if not on_cuda:
        # torchtitan.tools.utils.device_type falls back to "cuda" when no
        # accelerator exists; point the module-level copies at "cpu" (CPU test only).
        import torchtitan.distributed.parallel_dims as _tt_pd

        for _m in (tt_utils, _tt_pd, dist_utils):
            if getattr(_m, "device_type", None) == "cuda":
                _m.device_type = "cpu"
        result["shims"].append("device_type=cpu (no CUDA)")

    parallelism = ParallelismConfig(spmd_backend=args.spmd_backend)
    dist_utils.set_spmd_backend(parallelism.spmd_backend)
    parallel_dims = ParallelDims.from_config(parallelism, 1)
    parallel_dims.build_mesh()
    torch.manual_seed(args.seed)

    # torch-2.11 shim: torchtitan 0.3.0 calls create_block_mask(...,
    # separate_full_blocks=not batch_invariant) -- a kwarg newer torch added.
    # torch 2.11 always separates full blocks (== the default True), so drop it.
    import inspect
    from torch.nn.attention.flex_attention import create_block_mask
    import torchtitan.models.common.attention as tt_attn

    if "separate_full_blocks" not in inspect.signature(create_block_mask).parameters:
        def _create_block_mask_211(*a, separate_full_blocks=True, **k):
            if not separate_full_blocks:
                raise RuntimeError("separate_full_blocks=False needs newer torch")
            return create_block_mask(*a, **k)

        tt_attn._compiled_create_block_mask = torch.compile(_create_block_mask_211)
        result["shims"].append("create_block_mask: drop separate_full_blocks=True")

    # ---- FlexAttention compile options
    if args.attn.startswith("flex") and not args.flex_autotune:
        from torch.nn.attention.flex_attention import flex_attention

        opts = dict(FlexAttention.inductor_configs)
        opts["max_autotune"] = False
        opts["coordinate_descent_tuning"] = False
        FlexAttention._compiled_flex_attn = torch.compile(flex_attention, options=opts)

    if args.attn == "auto":
        args.attn = "flex" if on_cuda else "sdpa"
    result["attn_backend"] = args.attn

    # ---- model config (exact dims)
    dim, n_heads = args.dim, args.n_heads
    vocab = args.vocab
    emb_init = tt_llama3._EMBEDDING_SKIP_INIT if args.tie else tt_llama3._EMBEDDING_INIT
    cfg = Llama3Model.Config(
        dim=dim,
        vocab_size=vocab,
        enable_weight_tying=bool(args.tie),
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim,
                                        param_init=emb_init),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=tt_llama3._NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab,
                              param_init=tt_llama3._output_linear_init(dim)),
        layers=tt_llama3._build_llama3_layers(
            fuse_qkv=True,
            n_layers=args.n_layers,
            dim=dim,
            n_heads=n_heads,
            n_kv_heads=args.n_kv_heads,
            hidden_dim=args.ffn_dim,
            # trainer's update_from_config resizes RoPE max_seq_len to seq_len
            rope=ComplexRoPE.Config(dim=dim // n_heads, max_seq_len=args.seq,
                                    theta=500000, scaling="llama"),
            attn_backend="flex" if args.attn == "sdpa" else args.attn,
        ),
    )
    if args.attn == "sdpa":
        # torchtitan 0.3.0's get_attention_config rejects "sdpa" for LMs; use
        # its ScaledDotProductAttention module directly (is_causal=True, no mask).
        from torchtitan.models.common.attention import ScaledDotProductAttention

        for layer_cfg in cfg.layers:
            layer_cfg.attention.inner_attention = ScaledDotProductAttention.Config()

    # Llama3Model.Config.update_from_config would import torchtitan.trainer
    # (-> torchdata, datasets, ...); for a dense 1-device model it only validates
    # TP/PP and calls set_llama3_sharding_config, so call that directly.
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config

    set_llama3_sharding_config(cfg, enable_sp=parallelism.enable_sequence_parallel)

    with torch.device("meta"):
        model = cfg.build()
    model.verify_module_protocol()
    n_params, flops_per_token = cfg.get_nparams_and_flops(model, args.seq)
    ffn_hidden = model.layers["0"].feed_forward.w1.out_features
    assert ffn_hidden == args.ffn_dim, (ffn_hidden, args.ffn_dim)
    result.update(
        n_params=int(n_params),
        flops_per_token=int(flops_per_token),
        ffn_hidden=int(ffn_hidden),
        tied_embeddings=bool(model.enable_weight_tying),
    )

    if args.float8 != "none":
        import dataclasses as _dc

        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        fp8_matmul = device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)
        f8 = _dc.replace(Float8LinearConfig.from_recipe_name(args.float8), emulate=not fp8_matmul)
        keep = lambda m, fqn: (isinstance(m, torch.nn.Linear) and fqn.startswith("layers.")  # noqa: E731
                               and m.in_features % 16 == 0 and m.out_features % 16 == 0)
        convert_to_float8_training(model, config=f8, module_filter_fn=keep)
        result["float8_mode"] = f"{args.float8} ({'emulated' if f8.emulate else 'float8 matmuls'})"

    # ---- AC / compile / mixed precision, as parallelize_llama applies them
    precision_name = "bfloat16" if args.precision == "bf16" else "float32"
    training = TrainingConfig(local_batch_size=args.micro_batch, seq_len=args.seq,
                              mixed_precision_param=precision_name)
    compile_config = CompileConfig(enable=bool(args.compile))
    ac_config = {"none": None, "selective": SelectiveAC.Config(),
                 "full": FullAC.Config()}[args.ac]
    dump_folder = tempfile.mkdtemp(prefix="titan_side_")
    use_autocast = args.mp == "autocast" and args.precision == "bf16"
    if args.mp == "fsdp":
        model = parallelize_llama(
            model,
            parallel_dims=parallel_dims,
            training=training,
            parallelism=parallelism,
            compile_config=compile_config,
            ac_config=ac_config,
            dump_folder=dump_folder,
        )
    else:
        if ac_config is not None:
            ac_config.build(dump_folder=dump_folder).apply(model)
        if compile_config.enable:
            apply_compile(model, compile_config=compile_config,
                          parallel_dims=parallel_dims)
    blk = model.layers["0"]
    result["block0_wrapping"] = " > ".join(
        [type(blk).__name__]
        + [type(m).__name__ for m in (getattr(blk, "_checkpoint_wrapped_module", None),) if m is not None]
        + (["compiled"] if getattr(blk, "_compiled_call_impl", None) is not None else []))
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    result["mixed_precision"] = (
        "fsdp2(degree=1) MixedPrecisionPolicy(param=%s, reduce=float32), fp32 master"
        % precision_name if args.mp == "fsdp" else
        ("torch.autocast(bfloat16), fp32 params" if use_autocast else "fp32"))
    uniq = {id(p): p for p in model.parameters()}
    result["n_params_unique"] = int(sum(p.numel() for p in uniq.values()))
    result["param_dtype_master"] = str(next(iter(uniq.values())).dtype)

    loss_fn = CrossEntropyLoss.Config(global_vocab_size=vocab).build(
        compile_config=compile_config)
    optimizers = default_adamw(lr=8e-4).build(model_parts=[model])
    opt0 = optimizers.optimizers[0]
    result["optimizer"] = {k: (list(v) if isinstance(v, tuple) else v)
                           for k, v in opt0.param_groups[0].items()
                           if k in ("lr", "betas", "eps", "weight_decay", "fused",
                                    "foreach")}
    result["optimizer"]["class"] = type(opt0).__name__
    train_context = dist_utils.get_spmd_context(parallel_dims=parallel_dims,
                                                spmd_typechecking=False)
    gc_handler = tt_utils.GarbageCollection(gc_freq=50)

    B, S = args.micro_batch, args.seq
    positions = torch.arange(S, device=device, dtype=torch.int64).unsqueeze(0).expand(B, S)
    positions = positions.contiguous()
    extra_kwargs = {"positions": positions}
    if args.attn != "sdpa":
        extra_kwargs["attention_masks"] = model.get_attention_masks(positions=positions)
    if args.spmd_backend == "spmd_types":
        from torchtitan.distributed.spmd_types import annotate_input_spmd_types

    def fwd_bwd(inputs, labels, global_valid_tokens, kwargs):
        with train_context():
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_autocast):
                pred = model(inputs, **kwargs)
            loss, _ = loss_fn(pred, labels, global_valid_tokens)
            del pred
            with spmd.no_typecheck():
                loss.backward()
        return loss

    if args.cuda_graph:
        from torchtitan.distributed.cudagraph import wrap_with_cuda_graph

        fwd_bwd_fn = wrap_with_cuda_graph(fwd_bwd)
    else:
        fwd_bwd_fn = fwd_bwd

    params = [p for p in model.parameters()]
    gen = torch.Generator(device=device).manual_seed(args.seed + 1)
    times, losses, grad_norms = [], [], []
    if on_cuda:
        torch.cuda.reset_peak_memory_stats()
    for step in range(1, args.steps + 1):
        ids = torch.randint(0, vocab, (B, S + 1), device=device, generator=gen)
        inputs, labels = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
        kwargs = dict(extra_kwargs)
        if args.spmd_backend == "spmd_types":
            inputs, labels, kwargs = annotate_input_spmd_types(
                parallel_dims, inputs, labels, kwargs)
        gvt = torch.tensor(labels.numel(), device=device, dtype=torch.int64)
        if on_cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        gc_handler.run(step)
        optimizers.zero_grad(set_to_none=not args.cuda_graph)
        loss = fwd_bwd_fn(inputs, labels, gvt, kwargs)
        loss = loss.detach().clone()
        grad_norm = dist_utils.clip_grad_norm_(params, 1.0, foreach=True,
                                               pp_mesh=None, ep_enabled=False)
        optimizers.step()
        if on_cuda:
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        times.append(dt)
        losses.append(loss)
        grad_norms.append(grad_norm.detach())
        print(f"step {step}: {dt * 1e3:.1f} ms", file=sys.stderr, flush=True)

    timed = times[args.warmup:] or times
    med = statistics.median(timed)
    losses_f = [float(x.full_tensor() if hasattr(x, "full_tensor") else x) for x in losses]
    gn_f = [float(x.full_tensor() if hasattr(x, "full_tensor") else x) for x in grad_norms]
    result.update(
        step_times_s=[round(t, 6) for t in times],
        median_step_s=med,
        tokens_per_s=B * S / med,
        model_tflops_per_s=flops_per_token * B * S / med / 1e12,
        loss_first=losses_f[0],
        loss_last=losses_f[-1],
        grad_norm_first=gn_f[0],
        grad_norm_last=gn_f[-1],
    )
    if on_cuda:
        gib = 1024 ** 3
        result["max_memory_allocated_gib"] = torch.cuda.max_memory_allocated() / gib
        result["max_memory_reserved_gib"] = torch.cuda.max_memory_reserved() / gib
    else:
        result["max_memory_allocated_gib"] = None
        result["max_memory_reserved_gib"] = None


def main(argv=None) -> int:
    args = parse_args(argv)
    result: dict = {"impl": "torchtitan", "args": vars(args)}
    rc = 0
    try:
        run(args, result)
    except BaseException:  # noqa: BLE001 - report everything, incl. KeyboardInterrupt
        result["error"] = traceback.format_exc()
        rc = 1
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2, default=str)
    print(json.dumps(result, indent=2, default=str))
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        pass
    return rc


if __name__ == "__main__":
    sys.exit(main())
