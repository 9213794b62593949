"""The `gridtrain` command: train, model, data prepare, calibrate, plan, explore, plot, export, import,
sample, eval."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import traceback
import typing
from pathlib import Path

from gridtrain.config import ConfigError
from gridtrain.config_load import all_keys, load_config, parse_overrides
from gridtrain.errors import BadInput, UserError, one_line
from gridtrain.argtypes import number
from gridtrain.cli_data import add_data_parser
from gridtrain.cli_inference import add_inference_parsers
from gridtrain.launch import launch
from gridtrain.rundir import check_run_dir, unwritable
from gridtrain.runlock import job_dirs, refuse_if_held
from gridtrain.plan.app.options import add_plan_parser
from gridtrain.validate import validate

log = logging.getLogger("gridtrain")


def setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s",
                        datefmt="%H:%M:%S", stream=sys.stderr)


def cmd_train(args: argparse.Namespace, extra: list[str]) -> int:
    if args.help_config:
        for key, (hint, doc) in all_keys().items():
            choices = typing.get_args(hint) if typing.get_origin(hint) is typing.Literal else ()
            print(f"--{key:<36} {doc}" + (f" One of: {', '.join(choices)}." if choices else ""))
        return 0
    overrides = parse_overrides(extra)
    if args.resume:
        overrides["checkpoint.resume"] = "true"
    if args.nproc is not None:
        overrides["parallel.nproc"] = str(args.nproc)
    cfg = load_config(args.config, overrides)
    if args.dry_run:
        return cmd_dry_run(cfg, args.world, args.rank or 0)
    if args.world is not None or args.rank is not None:
        print("gridtrain: --world and --rank go with --dry-run (to train on several processes: --nproc)",
              file=sys.stderr)
        return 2
    dims = validate(cfg)  # every rank checks again, but nothing starts if this fails
    if "LOCAL_RANK" not in os.environ:  # under torchrun, the job's rank 0 decides for every rank (Trainer)
        for directory in job_dirs(cfg):  # another job trains into it: say whose, before anything starts
            refuse_if_held(directory)
        check_run_dir(cfg)  # before any rank writes into it
    if cfg.parallel.nproc > 1 and "LOCAL_RANK" not in os.environ:
        return launch(cfg.parallel.nproc, sys.argv[1:] if args.argv is None else args.argv, args.max_restarts)
    if args.max_restarts:
        print("gridtrain: --max-restarts needs --nproc (or torchrun's own --max-restarts)", file=sys.stderr)
        return 2
    # torch and the data stack load only when needed
    from gridtrain.checkpoint.store import CheckpointSaveError, InvalidCheckpointError
    from gridtrain.checkpoint.checkpointer import Stopped
    from gridtrain.train.distributed import shutdown
    from gridtrain.train.resilience import CollectiveTimeout, TrainingDiverged
    from gridtrain.train.trainer import Trainer

    trainer = None
    try:
        trainer = Trainer(cfg)
        final = trainer.run()
    except (CollectiveTimeout, TrainingDiverged, CheckpointSaveError, InvalidCheckpointError) as err:
        print(f"gridtrain: {one_line(err, anticipated=True)}", file=sys.stderr, flush=True)
        if isinstance(err, CollectiveTimeout):
            # A peer is gone or stalled: leaving the process group (or the interpreter's own
            # clean-up of it) waits on that peer, and torchrun waited ~16 s to kill each such rank.
            if trainer is not None:
                trainer.release()
            logging.shutdown()
            sys.stdout.flush()
            os._exit(1)
        shutdown()
        return 2 if isinstance(err, InvalidCheckpointError) else 1
    except Stopped as stopped:
        if trainer.world.rank == 0:
            print(f"gridtrain: {stopped}", file=sys.stderr, flush=True)
        shutdown()
        return 128 + stopped.signum
    except KeyboardInterrupt:
        print(f"gridtrain: {interrupted(trainer)}", file=sys.stderr, flush=True)
        shutdown()
        return 130
    except BaseException:
        shutdown()
        raise
    finally:
        if trainer is not None:
            trainer.release()
    shutdown(finished=True)
    if "loss/val" in final and trainer.is_writer:
        print(f"final validation loss {final['loss/val']:.4f} (perplexity {final['loss/val_ppl']:.2f})")
    if cfg.train.sample_tokens and trainer.world.rank == 0 and (cfg.checkpoint.final or cfg.checkpoint.interval):
        from gridtrain.train.inference import print_sample

        print_sample(Path(cfg.run_dir), cfg.train.sample_tokens, cfg.train.sample_prompt)
    del dims
    return 0


def cmd_dry_run(cfg, world: int | None, rank: int) -> int:  # noqa: ANN001 - a Config
    if world is None:
        print("gridtrain: --dry-run needs --world N, the number of ranks of the job to rehearse", file=sys.stderr)
        return 2
    import os
    import resource

    # A dry run computes on fake CPU tensors: hidden from it, an accelerator's driver is not loaded
    # by torch's availability probes (fake tensors, the device mesh, each optimizer step), which on
    # a GPU host would add its libraries to the resident memory the dry run reports.
    hidden = {name: os.environ.get(name) for name in ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES")}
    os.environ.update(dict.fromkeys(hidden, ""))

    from gridtrain.plan.check_run import check_run, format_check
    from gridtrain.train.dry_run import dry_run

    try:
        result = dry_run(cfg, world, rank)
    finally:  # as they were, for whatever this process runs next (tests call main() in-process)
        for name, value in hidden.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    rec, coords = result.record, validate(cfg, world).coordinates(rank)
    where = ", ".join(f"{axis} {index}" for axis, index in coords.items())
    print(f"dry run of rank {rank} of {world} (coordinates {where}): one step on fake tensors in "
          f"{result.seconds:.1f} s, this process's peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB")
    print(f"the rank's tensors: {rec['memory/built_bytes'] / 2**30:,.3f} GiB once built, "
          f"{rec['memory/peak_bytes'] / 2**30:,.3f} GiB at the step's peak")
    print(format_check([row for row in check_run(result.run_dir) if row.rank == rank]))
    print(f"written to {result.run_dir} (`gridtrain plan --check {result.run_dir}` lists every rank dry-run there)")
    return 0


def interrupted(trainer) -> str:
    """Ctrl-C: commit a checkpoint already written in the background (it used to be lost), then
    say where the run stands and how to continue it."""
    if trainer is None:
        return "interrupted while starting; nothing was trained"
    return trainer.checkpointer.interrupted(trainer.step)


def cmd_model(args: argparse.Namespace, extra: list[str]) -> int:
    from gridtrain.model.args import PRESETS
    from gridtrain.model.stats import flops_per_token, model_parameters

    if args.list or not args.preset:
        for name, fn in PRESETS.items():
            print(f"{name:<14} {fn.__doc__.splitlines()[0]}")
        return 0
    if args.preset not in PRESETS:
        raise BadInput(f"unknown model preset {args.preset!r}; choose one of {', '.join(PRESETS)} "
                       "(gridtrain model --list)")
    overrides = parse_overrides(extra)
    stray = [k for k in overrides if not k.startswith("model.")]
    if stray:
        raise BadInput(f"gridtrain model takes --model.KEY VALUE overrides, not --{stray[0]} (see gridtrain train "
                       "--help-config)")
    cfg = load_config(None, overrides | {"model.preset": args.preset})
    try:
        margs = cfg.model.args()
    except ValueError as err:  # MoE keys on a dense preset
        raise ConfigError([str(err)]) from None
    problems = margs.validate()
    if problems:
        raise ConfigError(problems)
    counts = model_parameters(margs)
    seq_len = args.seq_len or margs.max_seq_len
    moe = margs.moe
    heads = f" of {margs.head_dim}" if margs.explicit_head_dim else ""
    dense = not moe or moe.moe_layers(margs.n_layers) < margs.n_layers
    print(f"{args.preset}: dim {margs.dim}, {margs.n_layers} layers, {margs.n_heads} heads{heads}, "
          f"{margs.n_kv_heads} KV heads{f', ffn {margs.hidden_dim}' if dense else ''}, vocab {margs.vocab_size}"
          + (", QK-norm" if margs.qk_norm else ""))
    parts = ("embedding", "attention", "mlp", "norms", "output") + (("experts",) if moe else ())
    if moe:
        print(f"  mixture of experts on {moe.moe_layers(margs.n_layers)} of {margs.n_layers} layers: {moe.num_experts} "
              f"routed experts of ffn {moe.expert_ffn_dim}, top {moe.top_k}"
              + (f", {moe.num_shared_experts} shared" if moe.num_shared_experts else "")
              + f" (mlp holds the routers{' and shared experts' if moe.num_shared_experts else ''})")
    for part in parts:
        n = getattr(counts, part)
        print(f"  {part:<10} {n:>17,}  {n / 1e9:9.4f}B  {100 * n / counts.total:5.1f}%")
    print(f"  {'total':<10} {counts.total:>17,}  {counts.total / 1e9:9.4f}B")
    if moe:
        print(f"  {'active':<10} {counts.active:>17,}  {counts.active / 1e9:9.4f}B  per token: the total less "
              f"the {moe.num_experts - moe.top_k} of {moe.num_experts} routed experts it does not use")
    fpt = flops_per_token(margs, seq_len, counts)
    n_is = "N the active parameters without the input embedding" if moe else "N without the input embedding"
    print(f"model FLOPs per token at seq_len {seq_len}: {fpt:,.0f} ({fpt / 1e9:.2f} GFLOP) "
          f"= 6N + 12*L*H*Q*T, {n_is}")
    return 0


def cmd_calibrate(args: argparse.Namespace, extra: list[str]) -> int:
    from gridtrain.plan.machine import calibration_path
    from gridtrain.train.calibrate import calibrate

    entry, not_cached = calibrate(args.threads, args.seconds)
    for mode, flops in entry["peak_flops"].items():
        attention = entry["attention_flops"].get(mode)
        extra_text = f", attention fwd+bwd {attention / 1e9:8.1f} GFLOP/s" if attention else ""
        print(f"{mode:<5} peak matmul {flops / 1e9:10.1f} GFLOP/s{extra_text}")
    print(f"memory bandwidth {entry['memory_bytes_per_s'] / 1e9:.1f} GB/s; gloo all-reduce between two ranks "
          f"{entry['gloo_bytes_per_s'] / 1e9:.2f} GB/s, latency {entry['gloo_latency_s'] * 1e6:.0f} us")
    if "fsdp_call_s" in entry:
        steps = ", ".join(f"{t * 1e3:.2f} ms over {n}" for n, t in entry["gloo_ring_step_s"].items())
        print(f"between processes: a ring step {steps} processes; host time per FSDP collective call "
              f"{entry['fsdp_call_s'] * 1e3:.2f} ms, per tensor-parallel layer {entry['tp_block_s'] * 1e3:.2f} ms")
    for mode, share in entry.get("elementwise_share", {}).items():
        widths = entry["matmul_flops_by_dim"][mode]
        print(f"{mode:<5} a block's linear layers reach {min(widths.values()) / 1e9:.0f}-{max(widths.values()) / 1e9:.0f} "
              f"GFLOP/s (widths {min(map(int, widths))}-{max(map(int, widths))}); its elementwise work runs at "
              f"{share:.0%} of the memory bandwidth")
    print(f"calibration {not_cached}" if not_cached else f"cached in {calibration_path()}")
    return 0


def cmd_plan(args: argparse.Namespace, extra: list[str]) -> int:
    if args.check:
        from gridtrain.cli_check import plan_check

        return plan_check(Path(args.check))
    from gridtrain.plan.app.command import run_plan

    return run_plan(args, extra)


def cmd_plot(args: argparse.Namespace, extra: list[str]) -> int:
    from gridtrain.train.plot import plot_run

    out = Path(args.out) if args.out else None
    if out is not None:
        if out.is_dir():
            raise BadInput(f"--out {out} is a directory: give a file name, e.g. {out / 'curves.png'}")
        why = unwritable(out.parent)
        if why:
            raise BadInput(f"--out {out}: {why}")
        out = out if out.suffix else out.with_suffix(".png")  # what matplotlib would write
    out = plot_run(Path(args.run_dir), out)
    print(f"wrote {out}")
    return 0


def cmd_explore(args: argparse.Namespace, extra: list[str]) -> int:
    from gridtrain.explore.server import serve

    runs = Path(args.runs) if args.runs else None
    if runs is not None and not runs.is_dir():
        raise BadInput(f"--runs {runs}: no such folder; give the folder that holds your run directories")
    return serve(args.host, args.port, runs, args.open)


def add_explore_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("explore", help="the strategy explorer: a local web page over the planner")
    p.add_argument("--port", type=number(int, 0, 65535), default=0, help="port (default: a free one)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    p.add_argument("--runs", help="a folder of runs to list beside their plans (e.g. runs/)")
    p.add_argument("--open", action="store_true", help="open the page in a browser")
    p.set_defaults(func=cmd_explore)


def cmd_export(args: argparse.Namespace, extra: list[str]) -> int:
    from gridtrain.train.hf_run import export_run

    # InterchangeError: one line, exit 2
    out = export_run(Path(args.run_dir), Path(args.out), args.step, round(args.max_shard_gb * 1e9))
    architecture = json.loads((out / "config.json").read_text())["architectures"][0]
    print(f"wrote {out} (transformers: {architecture}.from_pretrained('{out}'))")
    return 0


def cmd_import(args: argparse.Namespace, extra: list[str]) -> int:
    from gridtrain.train.hf_import import import_hf

    run_dir = import_hf(Path(args.hf_dir), Path(args.run_dir))  # InterchangeError: one line, exit 2
    print(f"wrote a step-0 checkpoint in {run_dir}; continue training with\n"
          f"  gridtrain train --config {run_dir / 'imported.toml'} --data.corpus ...")
    return 0


def add_interchange_parsers(sub: argparse._SubParsersAction) -> None:
    """`gridtrain export` and `gridtrain import`: Hugging Face Llama and Mixtral directories."""
    p = sub.add_parser("export", help="write a run's checkpoint as a Hugging Face Llama (or, for a mixture of "
                       "experts, Mixtral) directory (config.json, safetensors files)")
    p.add_argument("run_dir")
    p.add_argument("out", help="output directory (must not exist, or be empty)")
    p.add_argument("--step", type=number(int, 0), help="the checkpoint of this step (default: the newest)")
    p.add_argument("--max-shard-gb", type=number(float, 0, low_open=True), default=5.0,
                   help="largest safetensors file, GB (default 5, as transformers): a larger model is written "
                   "as several files with model.safetensors.index.json, one file in memory at a time")
    p.set_defaults(func=cmd_export)
    p = sub.add_parser("import", help="turn a Hugging Face Llama or Mixtral directory (safetensors) into a run "
                       "with a step-0 checkpoint and imported.toml")
    p.add_argument("hf_dir")
    p.add_argument("run_dir", help="the new run directory (must not exist, or be empty)")
    p.set_defaults(func=cmd_import)


class Parser(argparse.ArgumentParser):
    """argparse with its errors on one line (no usage block): what is wrong and where help is."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="gridtrain", description=__doc__)
    parser.add_argument("--debug", action="store_true",
                        help="print the traceback of a failure (anywhere on the command line)")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("train", help="train a model; --section.key VALUE overrides any config key")
    p.add_argument("--config", help="a TOML file (see configs/)")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    p.add_argument("--help-config", action="store_true", help="list every config key with its meaning")
    p.add_argument("--nproc", type=number(int, 1), help="start this many local processes through torchrun")
    p.add_argument("--max-restarts", type=number(int, 0), default=0,
                   help="with --nproc: torchrun restarts the run up to this many times after a failure, "
                        "each time resuming from the newest intact checkpoint")
    p.add_argument("--dry-run", action="store_true",
                   help="run one step of one rank (--rank) of a --world-rank job on fake tensors and a fake process "
                        "group: its bytes per memory bucket and collectives per axis beside the plan's")
    p.add_argument("--world", type=number(int, 1), help="with --dry-run: the job's number of ranks")
    p.add_argument("--rank", type=number(int, 0), help="with --dry-run: the rank to run (default 0)")
    p.set_defaults(func=cmd_train, argv=None)
    p = sub.add_parser("model", help="parameter count and FLOPs per token of a model preset")
    p.add_argument("preset", nargs="?")
    p.add_argument("--list", action="store_true", help="list the presets")
    p.add_argument("--seq-len", type=number(int, 1), help="sequence length for the FLOPs (default: the context)")
    p.set_defaults(func=cmd_model)
    add_data_parser(sub)
    p = sub.add_parser("calibrate", help="measure this CPU's peak matmul FLOP/s (for MFU)")
    p.add_argument("--threads", type=number(int, 1, os.cpu_count() or 1))
    p.add_argument("--seconds", type=number(float, 0, 600, low_open=True), default=2.0, help="time per precision")
    p.set_defaults(func=cmd_calibrate)
    add_plan_parser(sub).set_defaults(func=cmd_plan)
    add_explore_parser(sub)
    p = sub.add_parser("plot", help="PNG of a run's loss and throughput curves")
    p.add_argument("run_dir")
    p.add_argument("--out", help="default: RUN_DIR/curves.png")
    p.set_defaults(func=cmd_plot)
    add_interchange_parsers(sub)
    add_inference_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    setup_logging()
    given = sys.argv[1:] if argv is None else argv
    debug = "--debug" in given  # any position; ranks under --nproc get it too
    parser = build_parser()
    args, extra = parser.parse_known_args([a for a in given if a != "--debug"])
    if argv is not None:
        args.argv = argv
    if extra and args.command not in ("train", "model", "plan"):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        code = args.func(args, extra)
        sys.stdout.flush()  # inside the try: a closed pipe shows up here
        return code
    except BrokenPipeError:  # `gridtrain ... | head` closed the pipe: nothing more to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (UserError, Exception, KeyboardInterrupt) as err:
        if debug:
            traceback.print_exc()  # and the same line and exit status as without --debug
        code = 2 if isinstance(err, UserError) else 130 if isinstance(err, KeyboardInterrupt) else 1
        hint = "" if code != 1 or debug else " (run again with --debug for the traceback)"
        print(f"gridtrain: {'interrupted' if code == 130 else one_line(err)}{hint}", file=sys.stderr, flush=True)
        return code


if __name__ == "__main__":
    sys.exit(main())
