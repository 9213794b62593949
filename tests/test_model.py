import ast
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

import gridtrain.model
from gridtrain.compat import TRUNC_NORMAL_REDRAWS
from gridtrain.model.args import ModelArgs, ffn_hidden_dim, model_args
from gridtrain.model.llama import Attention, Transformer, apply_rope, rope_frequencies, truncated_normal
from gridtrain.model.stats import build_meta, count_parameters, flops_per_token, model_parameters
from gridtrain.train.build import build_model, loss_fn

CPU = torch.device("cpu")


# ---------------------------------------------------------------------------------------------
# Shapes and counts


@pytest.mark.parametrize("preset, total, ffn", [
    ("llama3-8b", 8_030_261_248, 14336),
    ("llama3-70b", 70_553_706_496, 28672),
    ("llama3-405b", 405_853_388_800, 53248),
])
def test_llama3_parameter_counts_match_published(preset, total, ffn):
    args = model_args(preset)
    assert args.hidden_dim == ffn
    model = build_meta(args)
    counts = count_parameters(model)
    assert counts.total == total
    assert sum(p.numel() for p in model.parameters()) == total
    assert counts.embedding == counts.output == 128_256 * args.dim


def test_ffn_hidden_dim_rounding_rule():
    assert ffn_hidden_dim(4096, 1024, 1.3) == 14336
    assert ffn_hidden_dim(8192, 4096, 1.3) == 28672
    assert ffn_hidden_dim(16384, 4096, 1.2) == 53248
    assert ffn_hidden_dim(256, 256, None) == 768  # int(2 * 1024 / 3) = 682, rounded up to 768


# A shape small enough to count by hand: dim 16, 2 layers, 4 heads of 4, 2 KV heads, ffn 24, vocab 40.
SMALL = ModelArgs(dim=16, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=40, ffn_dim=24, max_seq_len=16)


def test_parameter_counts_by_hand():
    counts = count_parameters(build_meta(SMALL))
    # per layer: wq 16x16 + wk 16x8 + wv 16x8 + wo 16x16 = 768; mlp 3 x 16x24 = 1152; 2 norms of 16
    assert counts.embedding == 640
    assert counts.attention == 2 * 768
    assert counts.mlp == 2 * 1152
    assert counts.norms == 2 * 32 + 16
    assert counts.output == 640
    assert counts.total == 5200


def test_flops_per_token_by_hand():
    # 6 * (5200 - 640) + 12 * L(2) * H(4) * Q(4) * T(8) = 27360 + 3072
    assert flops_per_token(SMALL, seq_len=8) == 30432
    # A tied head is still a matmul: 6 * 4560 (every parameter, counted once) + attention.
    tied = replace(SMALL, tie_embeddings=True)
    assert flops_per_token(tied, seq_len=8) == 6 * 4560 + 3072


def test_forward_shapes():
    args = model_args("tiny")
    model = build_model(args, seed=0, device=CPU)
    tokens = torch.randint(0, args.vocab_size, (3, 17))
    logits = model(tokens)
    assert logits.shape == (3, 17, args.vocab_size)
    assert logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    assert model.freqs_cis.shape == (args.max_seq_len, args.head_dim // 2)


def test_forward_is_causal():
    """Changing a later token leaves the logits of earlier positions unchanged."""
    args = model_args("tiny")
    model = build_model(args, seed=0, device=CPU)
    tokens = torch.randint(0, args.vocab_size, (1, 12))
    changed = tokens.clone()
    changed[0, 8] = (tokens[0, 8] + 1) % args.vocab_size
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :8], b[:, :8], rtol=0, atol=1e-6)
    assert not torch.allclose(a[:, 8:], b[:, 8:], atol=1e-4)


# ---------------------------------------------------------------------------------------------
# Grouped-query attention against a hand-written reference


def _rope_by_hand(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate consecutive pairs (x[2i], x[2i+1]) of every head by the angle t * theta^(-2i/D)."""
    B, T, H, D = x.shape
    inv = theta ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)  # (D/2,)
    angle = torch.arange(T, dtype=torch.float64)[:, None] * inv[None, :]  # (T, D/2)
    cos, sin = angle.cos().float()[None, :, None, :], angle.sin().float()[None, :, None, :]
    even, odd = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = even * cos - odd * sin
    out[..., 1::2] = even * sin + odd * cos
    return out


def _attention_by_hand(attn: Attention, x: torch.Tensor, theta: float, kv_map: str) -> torch.Tensor:
    B, T, _ = x.shape
    H, KV, D = attn.n_heads, attn.n_kv_heads, attn.head_dim
    q = _rope_by_hand((x @ attn.wq.weight.T).view(B, T, H, D), theta)
    k = _rope_by_hand((x @ attn.wk.weight.T).view(B, T, KV, D), theta)
    v = (x @ attn.wv.weight.T).view(B, T, KV, D)
    if kv_map == "interleave":  # query head h reads KV head h // (H / KV), as in Llama's repeat_kv
        k, v = k.repeat_interleave(H // KV, dim=2), v.repeat_interleave(H // KV, dim=2)
    else:  # the wrong grouping, h % KV: the test must tell them apart
        k, v = k.repeat(1, 1, H // KV, 1), v.repeat(1, 1, H // KV, 1)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, T, D)
    scores = q @ k.transpose(-1, -2) / math.sqrt(D)  # (B, H, T, T)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    weights = scores.exp() / scores.exp().sum(-1, keepdim=True)  # softmax by hand (small scores)
    out = (weights @ v).transpose(1, 2).reshape(B, T, H * D)
    return out @ attn.wo.weight.T


def test_gqa_attention_matches_explicit_kv_repeat():
    args = ModelArgs(dim=64, n_layers=1, n_heads=8, n_kv_heads=2, vocab_size=64, ffn_dim=64,
                     max_seq_len=32, rope_theta=10_000.0)
    torch.manual_seed(0)
    attn = Attention(args)
    for w in (attn.wq, attn.wk, attn.wv, attn.wo):
        torch.nn.init.normal_(w.weight, std=0.2)
    x = torch.randn(2, 11, args.dim)
    freqs = rope_frequencies(args)[:11]
    with torch.no_grad():
        out = attn(x, freqs)
        expected = _attention_by_hand(attn, x, args.rope_theta, "interleave")
        wrong = _attention_by_hand(attn, x, args.rope_theta, "tile")
    assert out.shape == (2, 11, args.dim)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(out, wrong, rtol=1e-3, atol=1e-3)


# ---------------------------------------------------------------------------------------------
# RoPE


def test_rope_preserves_norms():
    args = model_args("tiny")
    freqs = rope_frequencies(args)[:40]
    x = torch.randn(2, 40, 3, args.head_dim)
    rotated = apply_rope(x, freqs)
    torch.testing.assert_close(rotated.norm(dim=-1), x.norm(dim=-1), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(rotated[:, 1:], x[:, 1:], atol=1e-3)  # it does rotate
    torch.testing.assert_close(rotated[:, 0], x[:, 0])  # position 0 is the identity


def test_rope_scores_depend_only_on_relative_position():
    args = ModelArgs(dim=64, n_heads=4, max_seq_len=128, rope_theta=10_000.0)
    T = 64
    freqs = rope_frequencies(args)[:T]
    torch.manual_seed(1)
    q_vec, k_vec = torch.randn(args.head_dim), torch.randn(args.head_dim)
    q = apply_rope(q_vec.expand(1, T, 1, -1).contiguous(), freqs)[0, :, 0]  # (T, head_dim)
    k = apply_rope(k_vec.expand(1, T, 1, -1).contiguous(), freqs)[0, :, 0]
    score = q @ k.T  # score[m, n] = <R_m q, R_n k>
    for offset in (0, 3, 7):
        diagonal = torch.stack([score[n + offset, n] for n in range(T - offset)])
        torch.testing.assert_close(diagonal, diagonal[0].expand_as(diagonal), rtol=1e-4, atol=1e-4)
    # ... and does depend on the offset.
    assert abs(score[3, 0] - score[7, 0]) > 1e-3


def test_rope_scaling_changes_only_low_frequencies():
    base = ModelArgs(dim=256, n_heads=2, max_seq_len=4)  # head_dim 128, theta 500,000, as Llama 3
    scaled = ModelArgs(dim=256, n_heads=2, max_seq_len=4, rope_scaling=True)
    w = torch.angle(rope_frequencies(base)[1]).double()  # the angle at t = 1 is the frequency
    w_scaled = torch.angle(rope_frequencies(scaled)[1]).double()
    wavelen = 2 * math.pi / w
    high = wavelen < 8192 / 4  # shorter than the high-frequency bound: untouched
    low = wavelen > 8192  # longer than the original context: divided by the factor 8
    assert high.sum() > 0 and low.sum() > 0
    assert torch.equal(w_scaled[high], w[high])
    torch.testing.assert_close(w_scaled[low], w[low] / 8, rtol=1e-5, atol=0)
    middle = ~high & ~low
    assert ((w_scaled[middle] <= w[middle]) & (w_scaled[middle] >= w[middle] / 8)).all()
    assert torch.equal(rope_frequencies(scaled)[0], rope_frequencies(base)[0])  # t = 0 unrotated


# ---------------------------------------------------------------------------------------------
# Tied embeddings


def test_tied_embeddings_share_one_tensor_and_count_once():
    tied_args = model_args("tiny", tie_embeddings=True)
    untied = count_parameters(build_meta(model_args("tiny")))
    model = Transformer(tied_args)
    assert model.output.weight is model.tok_embeddings.weight
    counts = count_parameters(model)
    assert counts.output == 0
    assert counts.total == untied.total - tied_args.vocab_size * tied_args.dim
    assert sum(p.numel() for p in model.parameters()) == counts.total


def test_build_model_keeps_tied_embeddings_tied():
    """The trainer's path (meta device -> to_empty -> init_weights) must keep the tie."""
    args = model_args("tiny", tie_embeddings=True)
    model = build_model(args, seed=0, device=CPU)
    assert model.output.weight is model.tok_embeddings.weight
    assert count_parameters(model) == count_parameters(build_meta(args))
    assert torch.isfinite(model(torch.randint(0, args.vocab_size, (1, 8)))).all()


# ---------------------------------------------------------------------------------------------
# Initialisation


@pytest.mark.parametrize("tie", [False, True])
def test_initial_loss_is_log_vocab(tie):
    args = model_args("tiny", tie_embeddings=tie)
    model = build_model(args, seed=0, device=CPU)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab_size, (4, 64), generator=g)
    targets = torch.randint(0, args.vocab_size, (4, 64), generator=g)
    with torch.no_grad():
        loss = loss_fn(model(tokens), targets).item()
    assert abs(loss - math.log(args.vocab_size)) < 0.1


def test_init_weights_is_deterministic_in_the_seed():
    args = model_args("tiny")
    a = build_model(args, seed=3, device=CPU).state_dict()
    b = build_model(args, seed=3, device=CPU).state_dict()
    c = build_model(args, seed=4, device=CPU).state_dict()
    assert a.keys() == b.keys() == c.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    matrices = [name for name in a if a[name].ndim == 2]
    assert matrices and all(not torch.equal(a[name], c[name]) for name in matrices)


def test_a_part_of_the_model_initialises_to_its_slice_of_the_whole():
    """A pipeline stage built on the meta device and initialised alone (layers 2-3 and the head,
    no embedding) gets the values the whole model's initialisation gives those names, and the
    RNG ends where the whole model's leaves it: what initialising a rank's share without ever
    holding the whole model rests on."""
    args = model_args("tiny", n_layers=4)
    whole = build_model(args, seed=5, device=CPU)
    after_whole = torch.get_rng_state()
    with torch.device("meta"):
        stage = Transformer(args)
    del stage.layers["0"], stage.layers["1"]
    stage.tok_embeddings = None
    stage.to_empty(device=CPU)
    stage.init_weights(5)
    assert torch.equal(torch.get_rng_state(), after_whole)
    want = whole.state_dict()
    got = stage.state_dict()
    assert sorted(got) == sorted(k for k in want if not k.startswith(("layers.0.", "layers.1.", "tok_embeddings")))
    assert all(torch.equal(got[k], want[k]) for k in got)


@pytest.mark.parametrize("shape,std", [((64, 64), 0.02), ((320, 64), 1.0), ((1000, 777), 0.02), ((3,), 0.1)])
def test_truncated_normal_draws_torchs_numbers_with_less_memory(shape, std):
    """The initialiser's truncated normal gives nn.init.trunc_normal_'s values and leaves the RNG
    where it does, bit for bit (several redraw rounds on the larger shapes); and initialising a
    parameter holds at most 2.5 times its bytes, measured (torch's needs 3 times and more)."""
    from gridtrain.train.live_bytes import LiveBytes

    for seed in (0, 1):
        torch.manual_seed(seed)
        with LiveBytes() as ours:
            got = truncated_normal(shape, std)
        after = torch.get_rng_state()
        torch.manual_seed(seed)
        with LiveBytes() as theirs:
            want = nn.init.trunc_normal_(torch.empty(shape), std=std, a=-3 * std, b=3 * std)
        if TRUNC_NORMAL_REDRAWS:  # torch < 2.13 inverts the CDF: other numbers (compat.py)
            assert torch.equal(got, want) and torch.equal(torch.get_rng_state(), after)
        else:
            assert got.abs().max() <= 3 * std and abs(got.std().item() / std - 0.987) < 0.1 + 3 / got.numel() ** 0.5
        nbytes = got.numel() * 4
        assert ours.peak <= 2.5 * nbytes + 64
        if got.numel() > 10_000 and TRUNC_NORMAL_REDRAWS:
            assert theirs.peak >= 3 * nbytes


def test_init_weights_scales():
    args = model_args("tiny")
    model = build_model(args, seed=0, device=CPU)
    assert abs(model.tok_embeddings.weight.std().item() - 1.0) < 0.05
    # trunc_normal at +-3 std: the std is ~0.987 of the nominal one.
    assert abs(model.output.weight.std().item() - args.init_std) < 0.002
    assert model.output.weight.abs().max().item() <= 3 * args.init_std
    for i, layer in model.layers.items():
        out_std = args.init_std / math.sqrt(2 * (int(i) + 1))
        assert abs(layer.attention.wo.weight.std().item() - out_std) < 0.15 * out_std
        assert torch.equal(layer.attention_norm.weight, torch.ones(args.dim))


# ---------------------------------------------------------------------------------------------
# The model knows nothing of parallelism


def _imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_model_files_never_import_torch_distributed():
    files = sorted(Path(gridtrain.model.__file__).parent.glob("*.py"))
    assert {f.name for f in files} >= {"args.py", "llama.py", "stats.py"}
    for path in files:
        text = path.read_text()
        assert "torch.distributed" not in text, path
        assert "import distributed" not in text, path
        bad = [m for m in _imported_modules(path) if m.startswith("torch.distributed")]
        assert not bad, (path, bad)


@pytest.mark.parametrize("preset, overrides", [("small", {}), ("tiny", {"tie_embeddings": True}),
                                               ("small", {"n_layers": 7, "n_kv_heads": 2})])
def test_parameters_from_two_layers_match_the_whole_model(preset, overrides):
    """`gridtrain model` extrapolates from meta models of one and two layers; every layer built."""
    args = model_args(preset, **overrides)
    assert model_parameters(args) == count_parameters(build_meta(args))
    assert model_parameters(args).total == sum(p.numel() for p in build_meta(args).parameters())
