"""Context parallelism's attention against torch's SDPA on the same inputs: ring attention over 2 and
4 gloo processes (both rotations, causal and full masks, GQA, sequence lengths 2 x cp x {1, 3, 64}),
the head-tail split, and blockwise causal attention in one process."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from gridtrain.model import blockwise
from gridtrain.model.blockwise import Block, blockwise_causal_attention, causal_blocks
from gridtrain.parallel.context_parallel import chunk_positions, split_sequence, unsplit_sequence

TOL = 1e-5  # fp32, absolute, on values of order one


def _inputs(seq: int, heads: int, kv_heads: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(2, heads, seq, 16), (2, kv_heads, seq, 16), (2, kv_heads, seq, 16), (2, heads, seq, 16)]
    return [torch.randn(s, generator=g) for s in shapes]  # q, k, v and the output's gradient


def _sdpa(q, k, v, d, causal):  # noqa: ANN001, ANN202
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves, is_causal=causal, enable_gqa=True)
    out.backward(d)
    return [out.detach()] + [t.grad for t in leaves]


# -- one process ---------------------------------------------------------------------------------

def test_the_head_tail_split_gives_every_rank_the_same_causal_work():
    """cp 4: rank r holds chunks r and 7 - r of 8, so the causal query-key pairs per rank are equal
    (chunk i sees i earlier chunks whole and its own half: (r + 0.5) + (7 - r + 0.5) = 8 chunks)."""
    x = torch.arange(16)[None]
    parts = [split_sequence(x, r, 4) for r in range(4)]
    assert parts[0].tolist() == [[0, 1, 14, 15]] and parts[3].tolist() == [[6, 7, 8, 9]]
    assert torch.equal(unsplit_sequence(parts), x)
    assert chunk_positions(16, 1, 4).tolist() == [2, 3, 12, 13]
    work = []
    for r in range(4):
        blocks = [blk for owner in range(4) for blk in causal_blocks([r, 7 - r], [owner, 7 - owner], 1)]
        work.append(sum((b.k.stop - b.k.start) * (0.5 if b.causal else 1) for b in blocks))
    assert work == [8.0] * 4


def test_causal_blocks_skip_what_the_mask_hides():
    """4 chunks of 2 rows: chunk i sees chunks 0..i-1 as one whole block and itself causally."""
    blocks = causal_blocks([0, 1, 2, 3], [0, 1, 2, 3], 2)
    assert blocks == [Block(slice(0, 2), slice(0, 2), True),
                      Block(slice(2, 4), slice(0, 2), False), Block(slice(2, 4), slice(2, 4), True),
                      Block(slice(4, 6), slice(0, 4), False), Block(slice(4, 6), slice(4, 6), True),
                      Block(slice(6, 8), slice(0, 6), False), Block(slice(6, 8), slice(6, 8), True)]


@pytest.mark.parametrize("chunks, seq, kv_heads", [(1, 8, 4), (2, 12, 2), (4, 64, 4), (8, 256, 2)])
def test_blockwise_causal_attention_is_sdpa(chunks, seq, kv_heads):
    q, k, v, d = _inputs(seq, 4, kv_heads, seed=chunks)
    want = _sdpa(q, k, v, d, causal=True)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = blockwise_causal_attention(*leaves, chunks)
    out.backward(d)
    for name, got, ref in zip(("out", "dq", "dk", "dv"), [out.detach()] + [t.grad for t in leaves], want):
        assert (got - ref).abs().max() < TOL, name


DEVICES = ["cpu"] + ([torch.accelerator.current_accelerator().type] if torch.accelerator.is_available() else [])


@pytest.mark.parametrize("dtype, tol", [(torch.float32, TOL), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("device", DEVICES)
def test_blocks_run_the_devices_fused_kernel_and_equal_sdpa(device, dtype, tol, monkeypatch):
    """Every block goes through the device's fused kernel (on CUDA flash for 16-bit blocks, the
    memory-efficient kernel for fp32), never the written-out scores, and blockwise attention equals
    the device's SDPA: within 1e-5 in fp32, within bf16's rounding of values of order one in bf16."""
    def written_out(*args):  # noqa: ANN002, ANN202
        raise AssertionError("the written-out block ran where a fused kernel exists")

    monkeypatch.setattr(blockwise, "_math_forward", written_out)
    monkeypatch.setattr(blockwise, "_math_backward", written_out)
    q, k, v, d = (t.to(device, dtype) for t in _inputs(64, 4, 2, seed=3))
    want = _sdpa(q, k, v, d, causal=True)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = blockwise_causal_attention(*leaves, 4)
    out.backward(d)
    for name, got, ref in zip(("out", "dq", "dk", "dv"), [out.detach()] + [t.grad for t in leaves], want):
        assert (got.float() - ref.float()).abs().max() < tol, name


@pytest.mark.parametrize("causal", [True, False])
def test_the_written_out_block_is_the_cpu_kernel(causal):
    """The arithmetic used where no fused kernel is wired in (blockwise._math_forward and
    _math_backward) gives the CPU flash kernel's output, log-sum-exp and gradients."""
    q, k, v, d = _inputs(24, 4, 4, seed=5)
    scale = 16 ** -0.5
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    m_out, m_lse = blockwise._math_forward(q, k, v, causal, scale)
    assert (m_out - out).abs().max() < TOL and (m_lse - lse).abs().max() < TOL
    grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(d, q, k, v, out, lse, 0.0, causal,
                                                                                   scale=scale)
    for got, want in zip(blockwise._math_backward(d, q, k, v, out, lse, causal, scale), grads):
        assert (got - want).abs().max() < TOL


# -- ring attention over gloo processes -----------------------------------------------------------

def _ring_worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from gridtrain.parallel.context_parallel import ring_attention

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    errors = {}
    for rotate in ("ring", "allgather"):
        for causal in (True, False):
            for per_chunk in (1, 3, 64):
                for kv_heads in (4, 2):
                    q, k, v, d = _inputs(2 * world * per_chunk, 4, kv_heads, seed=per_chunk + kv_heads)
                    want = _sdpa(q, k, v, d, causal)
                    local = [split_sequence(t, rank, world, dim=2).requires_grad_() for t in (q, k, v)]
                    got = ring_attention(*local, dist.group.WORLD, rotate, causal)
                    got.backward(split_sequence(d, rank, world, dim=2))
                    errors[f"{rotate} causal={causal} seq={2 * world * per_chunk} kv_heads={kv_heads}"] = [
                        (a - split_sequence(b, rank, world, dim=2)).abs().max().item()
                        for a, b in zip([got.detach()] + [t.grad for t in local], want)]
    Path(out, f"rank{rank}.json").write_text(json.dumps(errors))
    dist.destroy_process_group()


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 4])
def test_ring_attention_is_sdpa(world, tmp_path):
    """Every rank's output rows and its dQ, dK, dV (the gradients of its own chunks, dK and dV summed
    over every rank that read them) equal SDPA's on the whole sequence within 1e-5."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_ring_worker, args=(world, port, str(tmp_path)), nprocs=world, join=True)
    for rank in range(world):
        errors = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert len(errors) == 24
        for case, (out, dq, dk, dv) in errors.items():
            assert max(out, dq, dk, dv) < TOL, (rank, case, out, dq, dk, dv)
