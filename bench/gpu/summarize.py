"""Turn the GPU suite's output folder into the README's GPU table (Markdown on stdout).

    python bench/gpu/summarize.py bench/gpu/results/<date>/part1 [more folders of the same GPU]

MFU is computed alike for both sides from tokens/s: gridtrain's model FLOPs per token,
6N + 12 L H Q T (gridtrain.plan.flops), against the dense bf16 peak (989 TFLOP/s on an H100)
and against the bf16 matmul peak the suite measured on the same GPU (env.json).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from gridtrain.plan.flops import flops_per_token  # noqa: E402
from gridtrain.plan.shape import ModelShape  # noqa: E402
from gridtrain.plan.specs import accelerator_of_device  # noqa: E402


def _load(path: Path) -> object:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def shape_of(row: dict) -> ModelShape:
    return ModelShape(hidden=row["dim"], num_layers=row["n_layers"], num_heads=row["n_heads"],
                      num_kv_heads=row["n_kv_heads"], ffn=row["ffn_dim"], vocab=row["vocab"], block="llama",
                      tie_embeddings=True)


def speed_table(outs: list[Path], env: dict) -> list[str]:
    spec = accelerator_of_device(env.get("name", ""))
    peak = spec.peak_flops if spec else None
    measured = env.get("matmul_bf16_TFLOPs", 0) * 1e12
    lines = ["| shape | seq | recompute | compile | side | tokens/s | MFU (dense peak) | MFU (measured matmul) "
             "| peak allocated GiB | peak reserved GiB | vs torchtitan |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    rows = [r for out in outs for part in ("speed", "compiled", "fp8") for r in (_load(out / f"{part}.json") or [])]
    done = {r["name"] for r in rows if "skipped" not in r}
    rows = [r for r in rows if "skipped" not in r or r["name"] not in done]  # a later folder ran it
    by_key = {(r.get("shape"), r.get("compile"), r.get("side"), r.get("float8", "none")): r for r in rows}
    for r in rows:
        if "skipped" in r or "shape" not in r:
            lines.append(f"| {r['name']} | | | | | skipped ({r.get('skipped', '')}) | | | | | |")
            continue
        tps = r.get("tokens_per_s")
        if not tps:
            lines.append(f"| {r['shape']} | {r['seq']} | {r['ac']} | {'on' if r['compile'] else 'off'} | {r['side']} "
                         f"| failed (rc {r.get('rc')}) | | | | | |")
            continue
        achieved = flops_per_token(shape_of(r), r["seq"]) * tps
        recipe = r.get("float8", "none")
        titan = by_key.get((r["shape"], r["compile"], "torchtitan", recipe), {}).get("tokens_per_s")
        fp8 = recipe != "none"
        ratio = f"{tps / titan:.2f}x" if titan and r["side"] == "gridtrain" else ""
        side = f"{r['side']} fp8 {r['float8']}" if fp8 else r["side"]
        mfu = f"{100 * achieved / peak:.1f}%" if peak else "n/a"
        mfu_m = f"{100 * achieved / measured:.1f}%" if measured else "n/a"
        lines.append(f"| {r['shape']} | {r['seq']} | {r['ac']} | {'on' if r['compile'] else 'off'} | {side} "
                     f"| {tps:,.0f} | {mfu} | {mfu_m} | {_gib(r.get('peak_allocated_GiB', r.get('max_memory_allocated_gib')))} "
                     f"| {_gib(r.get('peak_reserved_GiB', r.get('max_memory_reserved_gib')))} | {ratio} |")
    return lines


def _gib(x: float | None) -> str:
    return f"{x:.1f}" if isinstance(x, (int, float)) else ""


def main() -> None:
    outs = [Path(a) for a in sys.argv[1:]]
    out, env = outs[0], _load(outs[0] / "env.json") or {}
    print(f"{env.get('name', '?')}, torch {env.get('torch', '?')} (CUDA {env.get('cuda')}), Python {env.get('python')}; "
          f"bf16 matmul {env.get('matmul_n')}^3 measured at {env.get('matmul_bf16_TFLOPs', 0):.0f} TFLOP/s\n")
    print("\n".join(speed_table(outs, env)))
    parity, fp16, tests = _load(out / "parity.json") or {}, _load(out / "fp16.json") or {}, _load(out / "tests.json") or {}
    if parity.get("worst"):
        w, b = parity["worst"], parity["bounds"]
        print(f"\nbf16, {parity['steps']} steps, device against CPU: loss within {w['loss_rel']:.2e} "
              f"(bound {b['loss_rtol']:.2e}), gradient norm {w['grad_norm_rel']:.2e} (bound {b['norm_rtol']:.2e}), "
              f"weight update {w['update_rel']:.2e} (bound {b['update_rtol']:.2e}); within every bound: {parity['within']}")
    if fp16.get("losses"):
        print(f"fp16 with loss scaling, {len(fp16['losses'])} logged steps: loss {fp16['losses'][0]:.3f} -> "
              f"{fp16['losses'][-1]:.3f}")
    if tests:
        print(f"single-process tests on the device: {tests.get('summary', '')} (rc {tests.get('rc')})")


if __name__ == "__main__":
    main()
