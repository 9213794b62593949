"""Document masking (issue 32): attention never crosses a document inside a packed sequence.

References are independent: a dense boolean mask written out by hand for SDPA, and each document
run alone through the model's own unmasked path (torch's SDPA, causal). Under TP, PP, CP and every
data parallelism, masked runs are compared with one process by the parity matrix's attention axis
(tests/test_parity.py: its CI subset holds fp32 masked cases under TP, PP and CP)."""

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from gridtrain.model.args import ModelArgs
from gridtrain.model.blockwise import Block
from gridtrain.model.documents import Documents, document_attention, document_blocks, document_ids
from gridtrain.model.llama import Transformer

EOS = 3


def test_document_ids_count_end_tokens_hand_derived():
    inputs = torch.tensor([[5, 3, 7, 8, 3, 9], [3, 3, 4, 4, 4, 4]])
    assert document_ids(inputs, EOS).tolist() == [[0, 0, 1, 1, 1, 2], [0, 1, 2, 2, 2, 2]]
    docs = Documents(document_ids(inputs, EOS))
    assert docs.spans == [[(0, 2), (2, 5), (5, 6)], [(0, 1), (1, 2), (2, 6)]]
    assert docs.positions().tolist() == [[0, 1, 0, 1, 2, 0], [0, 0, 0, 1, 2, 3]]


def test_document_blocks_skip_hidden_pairs_hand_derived():
    # one sequence of 8 in chunks of 4; documents [0, 3) and [3, 8)
    blocks = document_blocks([[(0, 3), (3, 8)]], [0, 1], [0, 1], 4)
    assert blocks == [Block(slice(0, 3), slice(0, 3), True), Block(slice(3, 4), slice(3, 4), True),
                      Block(slice(4, 8), slice(3, 4), False), Block(slice(4, 8), slice(4, 8), True)]
    # a context-parallel rank holding chunks 1 and 2 of 4 (size 2) against chunks 0 and 3: only
    # position 2 (document 0) sees keys 0 and 1; chunk 2 (document 1) meets neither key chunk
    blocks = document_blocks([[(0, 3), (3, 8)]], [1, 2], [0, 3], 2)
    assert blocks == [Block(slice(0, 1), slice(0, 2), False)]
    # sequences with the same documents share their blocks; the others get their own rows
    blocks = document_blocks([[(0, 4)], [(0, 4)], [(0, 1), (1, 4)]], [0], [0], 4)
    assert blocks == [Block(slice(0, 4), slice(0, 4), True, slice(0, 2)),
                      Block(slice(0, 1), slice(0, 1), True, slice(2, 3)),
                      Block(slice(1, 4), slice(1, 4), True, slice(2, 3))]


def dense_mask(ids: torch.Tensor) -> torch.Tensor:
    """(B, 1, T, T) True where query t may see key s: s <= t and the same document."""
    T = ids.shape[1]
    same = ids[:, :, None] == ids[:, None, :]
    return (same & torch.ones(T, T, dtype=torch.bool).tril())[:, None]


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_document_attention_matches_dense_masked_sdpa(kv_heads):
    torch.manual_seed(0)
    B, H, T, D = 3, 4, 48, 16
    ids = torch.tensor([[0] * 10 + [1] * 30 + [2] * 8, [0] * 48, [0] * 10 + [1] * 30 + [2] * 8])
    q = torch.randn(B, H, T, D, requires_grad=True)
    k = torch.randn(B, kv_heads, T, D, requires_grad=True)
    v = torch.randn(B, kv_heads, T, D, requires_grad=True)
    out = document_attention(q, k, v, Documents(ids))
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=dense_mask(ids), enable_gqa=True)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), g)
    want = torch.autograd.grad(ref, (q, k, v), g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def tiny_model() -> Transformer:
    torch.manual_seed(0)
    model = Transformer(ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=32, multiple_of=32,
                                  max_seq_len=64))
    model.init_weights(seed=0)
    return model


def token_loss_sum(model: Transformer, inputs: torch.Tensor, targets: torch.Tensor,
                   doc_ids: torch.Tensor | None = None) -> torch.Tensor:
    logits = model(inputs, doc_ids) if doc_ids is not None else model(inputs)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")


@pytest.mark.parametrize("restart", [True, False])
def test_packed_sequence_equals_its_documents_one_by_one(restart):
    """The loss and gradients of packed sequences (the training loss: the mean over the batch's
    tokens) equal those of their documents run alone, each from position 0, their token losses
    summed over the same count, to 1e-6 in fp32. Without restarted positions the documents sit at other
    RoPE positions in the packed sequence, the same attention in exact arithmetic (RoPE's scores
    depend on the positions' difference only)."""
    tol = 1e-6
    model = tiny_model()
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(4, 32, (2, 41), generator=g)
    tokens[0, [6, 19, 33]] = EOS  # the second sequence starts mid-document, holds one end
    tokens[1, [24]] = EOS
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    model.restart_positions = restart
    docs = Documents(document_ids(inputs, EOS))
    packed = token_loss_sum(model, inputs, targets, docs.ids) / inputs.numel()
    packed_grads = torch.autograd.grad(packed, list(model.parameters()))
    alone = torch.zeros(())
    for row, spans in enumerate(docs.spans):
        for start, end in spans:
            alone = alone + token_loss_sum(model, inputs[row:row + 1, start:end], targets[row:row + 1, start:end])
    alone = alone / inputs.numel()
    alone_grads = torch.autograd.grad(alone, list(model.parameters()))
    assert len(docs.spans[0]) == 4 and len(docs.spans[1]) == 2
    torch.testing.assert_close(packed, alone, atol=tol, rtol=tol)
    for a, b in zip(packed_grads, alone_grads):
        torch.testing.assert_close(a, b, atol=tol, rtol=tol)


def test_one_document_is_causal_attention():
    model = tiny_model()
    inputs = torch.randint(4, 32, (2, 16), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(model(inputs, document_ids(inputs, EOS)), model(inputs), atol=1e-6, rtol=1e-6)


def test_trainer_step_with_doc_mask_equals_documents_one_by_one(tmp_path, make_config):
    """The data path end to end: a trainer with data.doc_mask reads each batch's documents from its
    end-of-document tokens; its step's gradient (its two micro-batches accumulated) equals the
    gradient of the same sequences' documents run alone from position 0 through a copy of the
    model, summed over the batch's tokens."""
    from gridtrain.train.trainer import Trainer
    from tests.test_train import _capture_grads

    corpus = short_documents(tmp_path / "corpus")
    trainer = Trainer(make_config(tmp_path, **{"data.corpus": str(corpus), "data.doc_mask": True,
                                               "data.doc_positions": "restart"}))
    reference = copy.deepcopy(trainer.model)
    grads = _capture_grads(trainer)
    trainer.train_step()
    inputs, targets = trainer.data.train.read(0, 4)
    docs = Documents(document_ids(inputs, trainer.data.eos_id))
    assert min(len(row) for row in docs.spans) >= 2
    alone = sum(token_loss_sum(reference, inputs[row:row + 1, s:e], targets[row:row + 1, s:e])
                for row, spans in enumerate(docs.spans) for s, e in spans) / inputs.numel()
    alone.backward()
    for name, p in reference.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, atol=1e-6, rtol=1e-6)


def short_documents(root: Path, count: int = 60) -> Path:
    """`count` documents of 5 to 24 bytes: every 32-token sequence holds several."""
    root.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        (root / f"d{i:02}.txt").write_text("abcdefghijklmnopqrstuvwxyz"[: 5 + (7 * i) % 20])
    return root


def test_varlen_packing_hands_each_document_to_the_kernel():
    """The CUDA path's packing (rows of every sequence end to end, cumulative document lengths),
    checked on CPU with a stand-in for torch's varlen kernel that runs causal SDPA per segment as
    its documentation defines it: the result is the dense-masked attention."""
    from gridtrain.model.documents import _varlen_attention

    def varlen(q, k, v, cu_q, cu_k, max_q, max_k, window_size, enable_gqa, scale):  # (T, H, D) packed
        assert window_size == (-1, 0) and torch.equal(cu_q, cu_k) and cu_q.dtype == torch.int32
        bounds = cu_q.tolist()
        assert max_q == max(b - a for a, b in zip(bounds, bounds[1:]))
        parts = [F.scaled_dot_product_attention(*(t[a:b].transpose(0, 1) for t in (q, k, v)), is_causal=True,
                                                scale=scale, enable_gqa=enable_gqa).transpose(0, 1)
                 for a, b in zip(bounds, bounds[1:])]
        return torch.cat(parts)

    torch.manual_seed(0)
    ids = torch.tensor([[0] * 5 + [1] * 11, [0] * 16])
    q, k, v = torch.randn(2, 4, 16, 8), torch.randn(2, 2, 16, 8), torch.randn(2, 2, 16, 8)
    out = _varlen_attention(q, k, v, Documents(ids), varlen)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=dense_mask(ids), enable_gqa=True)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)


def test_restarted_positions_of_a_context_parallel_rank_hand_derived():
    """CP rank 0 of 2 holds chunks 0 and 3 of an 8-token sequence (positions 0, 1, 6, 7); with
    documents [0, 3) and [3, 8) their positions in their documents are 0, 1, 3, 4."""
    model = tiny_model()
    whole = model.freqs_cis.clone()
    model.rotate_at(torch.tensor([0, 1, 6, 7]))
    docs = Documents(torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1]]), restart=True)
    assert torch.equal(model.document_rotations(docs), whole[torch.tensor([[0, 1, 3, 4]])])


def test_eval_of_a_doc_mask_run_reproduces_its_validation_loss(tmp_path, make_config):
    """`gridtrain eval` evaluates a data.doc_mask run inside its documents, as its validation did."""
    import contextlib
    import io
    import json

    from gridtrain.cli import main
    from gridtrain.train.trainer import Trainer

    corpus = short_documents(tmp_path / "corpus", count=300)
    cfg = make_config(tmp_path, **{"data.corpus": str(corpus), "data.doc_mask": True, "data.doc_positions": "restart",
                                   "data.val_fraction": 0.2, "train.steps": 2, "train.val_every": 2,
                                   "checkpoint.final": True})
    Trainer(cfg).run()
    rows = [json.loads(line) for line in (Path(cfg.run_dir) / "metrics.jsonl").read_text().splitlines()]
    val = [r["loss/val"] for r in rows if "loss/val" in r][-1]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["eval", str(cfg.run_dir), "--json"]) == 0
    assert json.loads(out.getvalue())["loss"] == pytest.approx(val, rel=1e-6, abs=0)
