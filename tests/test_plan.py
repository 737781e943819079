"""megazero.planner: parameter counts against real models, the ZeRO formulas, layout validity,
activation formulas and the command line."""

import json
import math

import pytest
import torch
from torch import nn

from megazero import planner as plan
from megazero.planner.cli import main as planner_main
from megazero.model import GPTConfig, GPTModel
from megazero.parallel.topology import Topology

GPT2_SMALL = GPTConfig(num_layers=12, hidden_size=768, num_attention_heads=12, vocab_size=50257, seq_length=1024)


def _plain_gpt2_small_count() -> int:
    """GPT-2 small in plain PyTorch modules on the meta device (tied head, vocab 50257)."""
    h, v = 768, 50257
    with torch.device("meta"):
        layer = lambda: nn.ModuleList([nn.LayerNorm(h), nn.Linear(h, 3 * h), nn.Linear(h, h),  # noqa: E731
                                       nn.LayerNorm(h), nn.Linear(h, 4 * h), nn.Linear(4 * h, h)])
        model = nn.ModuleList([nn.Embedding(v, h), nn.Embedding(1024, h), *[layer() for _ in range(12)],
                               nn.LayerNorm(h)])
    return sum(p.numel() for p in model.parameters())


def test_gpt2_small_parameter_count():
    plain = _plain_gpt2_small_count()
    assert plain == 124_439_808  # Hugging Face's GPT-2 small
    phi = plan.total_params(GPT2_SMALL)
    assert phi == plain + (50304 - 50257) * 768  # megazero pads the vocabulary to a multiple of 128
    assert abs(phi - plain) / plain < 0.01


SMALL = dict(num_layers=4, hidden_size=32, num_attention_heads=4, vocab_size=50, seq_length=8,
             make_vocab_size_divisible_by=4)
VARIANTS = [
    {},
    dict(untie_embeddings_and_output_weights=True),
    dict(num_query_groups=2, position_embedding_type="rope", normalization="RMSNorm", activation="swiglu",
         add_bias_linear=False, untie_embeddings_and_output_weights=True),
    dict(ffn_hidden_size=48, max_position_embeddings=16),
    dict(num_query_groups=2, position_embedding_type="rope", normalization="RMSNorm", activation="swiglu",
         add_bias_linear=False, add_qkv_bias=True),  # Qwen2: a bias on QKV alone
]


def _shape(kw) -> GPTConfig:
    return GPTConfig(**SMALL, **kw)


def _numel(model) -> int:
    return sum(p.numel() for p in model.parameters())


def _slices(kw, topo, pp):
    """Parameter count of each pipeline stage's GPTModel slice on this TP rank."""
    per = SMALL["num_layers"] // pp
    return [_numel(GPTModel(GPTConfig(**SMALL, **kw), topo, r * per, (r + 1) * per, pre_process=r == 0,
                            post_process=r == pp - 1)) for r in range(pp)]


@pytest.mark.parametrize("kw", VARIANTS)
def test_stage_params_match_megazero_model_slices(kw):
    shape = _shape(kw)
    assert plan.total_params(shape) == _numel(GPTModel(GPTConfig(**SMALL, **kw)))
    for pp in (2, 4):
        assert _slices(kw, None, pp) == [plan.stage_params(shape, 1, pp, r) for r in range(pp)], (kw, pp)


@pytest.mark.parametrize("kw", VARIANTS[:2])
def test_stage_params_with_the_v_match_the_chunks(kw):
    """zbv at PP 2: rank 0 holds stages 0 and 3 (embedding and head); tied, its head multiplies by
    its embedding's weight (one matrix: the ranks' sum is the whole model), untied it has both."""
    from megazero.parallel.layout import chunk_layer_ranges, chunk_roles
    shape, counts = _shape(kw), []
    for r in range(2):
        chunks, embedding = [], None
        for (a, b), (pre, post) in zip(chunk_layer_ranges(4, 2, 2, r, "v"), chunk_roles(2, 2, r, "v")):
            chunks.append(GPTModel(shape, None, a, b, pre_process=pre, post_process=post, tied_embedding=embedding))
            embedding = chunks[-1].embedding.word_embeddings if pre else embedding
        counts.append(sum(map(_numel, chunks)))
        assert counts[-1] == sum(plan.stage_param_split(shape, 1, 2, r, 2, schedule="zbv")), (kw, r)
    assert sum(counts) == plan.total_params(shape)


def _tp_counts(rank, world):
    topo = Topology(world, rank, tp=world).create_groups()
    return [_slices(kw, topo, pp) for kw in VARIANTS for pp in (1, 2)]


def test_stage_params_match_megazero_model_at_tp2(distributed):
    got = distributed(_tp_counts, 2)
    want = [[plan.stage_params(_shape(kw), 2, pp, r) for r in range(pp)] for kw in VARIANTS for pp in (1, 2)]
    assert got[0] == got[1] == want


def test_zero_formulas():
    phi, n = 1_000_000, 8
    got = [plan.model_state_bytes(phi, s, n) for s in range(4)]
    assert got == [16 * phi, 4 * phi + 12 * phi / n, 2 * phi + 14 * phi / n, 16 * phi / n]
    assert [plan.model_state_bytes(phi, s, 1) for s in range(4)] == [16 * phi] * 4
    # bf16 accumulates gradients in fp32 (g = 4); fp32 training: p = g = 4.
    assert plan.model_state_bytes(phi, 2, n, 2, 4) == 2 * phi + 16 * phi / n
    assert plan.model_state_bytes(phi, 0, n, 4, 4) == 20 * phi


def _zero_states(rank, world, stage):
    from megazero.zero import ZeroOptimizer
    topo = Topology(world, rank, tp=2).create_groups()
    model = GPTModel(GPTConfig(**SMALL, params_dtype=torch.bfloat16), topo)
    # persistence 0: every parameter partitioned at stage 3 (small ones are kept whole by default)
    return ZeroOptimizer([model], topo, stage=stage, params_dtype=torch.bfloat16,
                         param_persistence_threshold=0).state_bytes()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_model_states_match_zero_optimizer(distributed, stage):
    """TP 2 x DP 2, bf16: Φ and the formula equal the optimizer's; its buffers within 10 %."""
    got = distributed(_zero_states, 4, stage)[0]
    shape = _shape({})
    phi = plan.stage_params(shape, 2, 1, 0)
    assert got["phi"] == phi
    want = plan.model_state_bytes(phi, stage, 2, param_bytes=2, grad_bytes=4)
    assert got["formula"] == pytest.approx(want)
    assert got["total"] == pytest.approx(want, rel=0.10)


def test_invalid_layouts_excluded():
    shape = GPTConfig(num_layers=6, hidden_size=768, num_attention_heads=12, vocab_size=1000, seq_length=128)
    layouts = plan.plan(shape, 16, micro_batch_size=1)
    assert layouts
    for x in layouts:
        assert x.tp * x.pp * x.dp == 16 and x.tp <= 8
        assert 12 % x.tp == 0 and 6 % x.pp == 0
    assert {x.tp for x in layouts} == {1, 2, 4}  # 8 and 16 do not divide 12 heads
    assert {x.pp for x in layouts} == {1, 2}  # 4, 8, 16 do not divide 6 layers
    assert all(x.zero == 0 for x in layouts if x.dp == 1)
    assert len({(x.tp, x.pp, x.zero) for x in layouts}) == len(layouts)
    totals = [x.total_bytes for x in layouts]
    assert totals == sorted(totals)
    # the global batch must split into whole micro-batches per DP rank
    gbs = plan.plan(shape, 16, micro_batch_size=3, global_batch_size=24)
    assert gbs and all(24 % (3 * x.dp) == 0 and x.micro_batches == 24 // (3 * x.dp) for x in gbs)
    assert {x.dp for x in gbs} == {2, 4, 8}  # 16 does not divide 24 / 3; DP 1 needs TP PP = 16
    # fixed dimensions and the one-node TP limit
    assert {(x.tp, x.zero) for x in plan.plan(shape, 16, micro_batch_size=1, tp=2, zero=3)} == {(2, 3)}
    assert {x.tp for x in plan.plan(shape, 16, micro_batch_size=1, max_tp=2)} == {1, 2}


def test_activation_formulas():
    s, b, h, a, t = 2048, 1, 4096, 32, 8
    sbh = s * b * h
    assert plan.layer_activation_bytes(s, b, h, a, 1) == sbh * (34 + 5 * a * s / h)
    assert plan.layer_activation_bytes(s, b, h, a, t, sp=True) == pytest.approx(sbh * (34 + 5 * a * s / h) / t)
    assert plan.layer_activation_bytes(s, b, h, a, t) == pytest.approx(sbh * (10 + 24 / t + 5 * a * s / (h * t)))
    assert plan.layer_activation_bytes(s, b, h, a, t, sp=True, recompute="selective") == pytest.approx(34 * sbh / t)
    assert plan.layer_activation_bytes(s, b, h, a, t, recompute="full") == 2 * sbh
    kept, transient = plan.chunk_activation_bytes(8, s, b, h, a, 1, False, "full", "uniform", 2)
    assert kept == 4 * 2 * sbh and transient == 2 * plan.layer_activation_bytes(s, b, h, a, 1)


def test_pipeline_keeps_pp_micro_batches_on_the_first_stage():
    shape = GPTConfig(num_layers=16, hidden_size=1024, num_attention_heads=16, vocab_size=1024, seq_length=512)
    kw = dict(micro_batch_size=1, micro_batches=16, sequence_parallel=False)
    per_layer = plan.layer_activation_bytes(512, 1, 1024, 16, 1)
    emb_mask = 512 * 1024
    one = plan.estimate(shape, 1, 4, 1, 0, **kw)
    assert one.stage == 0  # embedding + 4 in-flight micro-batches of 4 layers
    assert one.activation_bytes == pytest.approx(16 * per_layer + 4 * emb_mask)
    inter = plan.estimate(shape, 1, 4, 1, 0, vp=2, **kw)  # L (1 + (p-1)/(p v)) layers' worth
    in_flight = 2 * 3 + (2 - 1) * 4 + 1  # chunk-activations of 2 layers; 6 of them on chunk 0
    assert in_flight * 2 == 16 * (1 + 3 / 8)
    assert inter.activation_bytes == pytest.approx(16 * (1 + 3 / 8) * per_layer + 6 * emb_mask)
    assert inter.comm_pp_bytes == 2 * one.comm_pp_bytes


def test_cli_table_and_json(capsys):
    argv = ["--num-layers", "24", "--hidden-size", "2048", "--num-attention-heads", "16", "--seq-length", "2048",
            "--micro-batch-size", "1", "--vocab-size", "50257", "--world-size", "8", "--bf16",
            "--sequence-parallel", "--recompute-granularity", "selective", "--gpu-memory-gb", "24"]
    assert planner_main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("model: 1,3")  # ~1.3B parameters
    assert lines[1].startswith("gpu: 8 x H100")
    assert lines[2].startswith("recommended: TP")
    head = next(i for i, line in enumerate(lines) if line.split()[:2] == ["TP", "PP"])
    assert lines[head].split()[:5] == ["TP", "PP", "VP", "DP", "ZeRO"]
    assert any(line.split()[-2] == "yes" for line in lines[head + 2:-1])
    assert planner_main(argv + ["--json", "--zero-stage", "3"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert rows and all(r["zero"] == 3 for r in rows)
    fits = [r for r in rows if r["fits"]]
    assert fits and all(r["total_bytes"] <= 24 * 2 ** 30 for r in fits)
    assert planner_main(argv[:-2] + ["--gpu-memory-gb", "0.001", "--fits-only"]) == 1
    with pytest.raises(SystemExit):
        planner_main(["--num-layers", "2", "--world-size", "2"])


def test_gpt3_1p3b_zero_beats_replication():
    """A 1.3B GPT on 8 GPUs: ZeRO-3 model states are 1/8 of stage 0's; everything at DP 8 fits 80 GiB."""
    shape = GPTConfig(num_layers=24, hidden_size=2048, num_attention_heads=16, vocab_size=50257, seq_length=2048)
    assert math.isclose(plan.total_params(shape) / 1e9, 1.3, rel_tol=0.05)
    rows = {x.zero: x for x in plan.plan(shape, 8, micro_batch_size=1, tp=1, pp=1, param_bytes=2, grad_bytes=2,
                                         recompute="full")}
    assert rows[3].model_state_bytes == pytest.approx(rows[0].model_state_bytes / 8)
    assert all(x.fits for x in rows.values())
