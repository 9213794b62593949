"""The zero-bubble schedules' weight pass under full recomputation (parallel/pipeline_parallel.py,
merged_param_groups): torch's `stage_backward_weight` calls `autograd.grad` once per parameter
group, one per weight of a block, and each call recomputes the checkpointed block; gridtrain
hands it the groups as one. Compared in one process on two checkpointed blocks of the small
model, through torch's own input and weight passes: the same gradients bit for bit, and the
attention run once per block in the weight pass instead of once per weight."""

from __future__ import annotations

import copy

import torch
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight
from torch.utils.checkpoint import checkpoint

from gridtrain.model.args import model_args
from gridtrain.model.llama import Transformer
from gridtrain.parallel.pipeline_parallel import merged_param_groups


def _split_backward(model: Transformer, x0: torch.Tensor, merge: bool) -> tuple[int, torch.Tensor, list[torch.Tensor]]:
    """(attention calls, input gradient, weight gradients) of the blocks' forward under full
    recomputation and torch's input then weight pass."""
    blocks = list(copy.deepcopy(model).layers.values())
    calls = [0]
    for block in blocks:
        block.attention.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    freqs = model.freqs_cis[: x0.shape[1]]
    x = x0.clone().requires_grad_(True)
    out = x
    for block in blocks:
        out = checkpoint(block, out, freqs, use_reentrant=False)
    weights = [p for block in blocks for p in block.parameters()]
    (grad_x,), groups = stage_backward_input([out], [torch.ones_like(out)], [x], iter(weights))
    assert len(groups) == len(weights)  # one group per weight: what the merge is for
    stage_backward_weight(iter(weights), merged_param_groups(groups) if merge else groups)
    return calls[0], grad_x, [p.grad for p in weights]


def test_one_weight_pass_for_all_groups_gives_the_same_gradients_and_recomputes_once():
    torch.manual_seed(0)
    args = model_args("small", n_layers=2)
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    model.after_to_empty()
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    x0 = torch.randn(2, 32, args.dim)
    torch_calls, torch_grad_x, torch_grads = _split_backward(model, x0, merge=False)
    calls, grad_x, grads = _split_backward(model, x0, merge=True)
    # 2 blocks: a forward each, a recomputation each in the input pass, then in the weight pass
    # one per weight (9 a block) from torch's groups, one per block from the merged group.
    assert (torch_calls, calls) == (2 + 2 + 18, 2 + 2 + 2)
    assert torch.equal(grad_x, torch_grad_x)
    assert all(g is not None for g in grads)
    for mine, theirs in zip(grads, torch_grads):
        assert torch.equal(mine, theirs)
