"""megazero.planner with context parallelism: the ring's and Ulysses' traffic against what
RingAttention and ulysses_attention send (one process, the exchange recorded), what the CP
attention saves for its backward, ZeRO states over DP x CP against the optimizer's buffers, the
activations at s / CP, the layouts CP adds, the command line."""

import json

import pytest
import torch

from megazero import planner as plan
from megazero.model import GPTConfig, GPTModel
from megazero.context_parallel import ring as cpa
from megazero.context_parallel import ulysses
from megazero.planner import cp_memory
from megazero.model.stages import expert_parallel_params
from megazero.parallel.topology import Topology
from megazero.planner.cli import main as planner_main

BASE = dict(num_layers=4, hidden_size=64, num_attention_heads=8, num_query_groups=4, seq_length=32,
            attention_dropout=0.0, hidden_dropout=0.0, make_vocab_size_divisible_by=4)
B, TP = 2, 2  # micro-batch; the TP the attention's local heads are cut for (8 / 2 heads, 4 / 2 groups)


def _shape(**kw) -> GPTConfig:
    return GPTConfig.from_megatron(dict(BASE, **kw), vocab_size=50)


def _qkv(shape, cp, dtype):
    """One TP rank's q, k, v ``[b, heads / TP, s / CP, d]`` and an output gradient."""
    g, s, d = torch.Generator().manual_seed(0), shape.seq_length // cp, shape.kv_channels
    heads, groups = shape.num_attention_heads // TP, shape.num_query_groups // TP
    q, k, v = (torch.randn(B, n, s, d, generator=g).to(dtype).requires_grad_() for n in (heads, groups, groups))
    return q, k, v, torch.randn(B, heads, s, d, generator=g).to(dtype)


class _Ring:
    """A one-process stand-in for the CP ring: records the bytes RingAttention hands to each shift
    (what the real ring sends to the next rank) and returns copies as the received blocks."""

    def __init__(self, cp, rank, tile_elems=cpa.TILE_ELEMS):
        self.cp, self.rank, self.tile_elems, self.sent = cp, rank, tile_elems, []

    def shift(self, tensors):
        self.sent.append(sum(t.numel() * t.element_size() for t in tensors))
        return [t.detach().clone() for t in tensors], lambda: None


@pytest.mark.parametrize("cp,rank,dtype", [(2, 0, torch.bfloat16), (2, 1, torch.float32), (4, 2, torch.bfloat16)])
def test_ring_traffic_is_what_ring_attention_sends(cp, rank, dtype):
    """Forward: CP - 1 steps of (K, V) in the activation dtype; backward: K, V again and CP steps of
    the fp32 dK, dV. The formula, per layer and micro-batch, equals the recorded bytes."""
    shape, A = _shape(), torch.tensor([], dtype=dtype).element_size()
    q, k, v, do = _qkv(shape, cp, dtype)
    ring = _Ring(cp, rank)
    out = cpa.RingAttention.apply(q, k, v, ring)
    forward = sum(ring.sent)
    out.backward(do)
    s, block = shape.seq_length // cp, k.numel()  # B = b (G/t) s' d elements
    assert forward == (cp - 1) * 2 * block * A
    assert sum(ring.sent) == plan.ring_bytes(shape, s, B, TP, cp, A) == 2 * forward + cp * 2 * block * 4
    assert plan.ring_bytes(shape, s, B, TP, cp, A, recompute_full=True) == sum(ring.sent) + forward


class _AllToAll(torch.autograd.Function):
    """A one-process all-to-all of equal splits: records the rows that would go to the other ranks
    (forward and backward) and keeps the tensor (the shapes are the real exchange's)."""
    sent: list = []

    @staticmethod
    def forward(ctx, x, peers):
        ctx.peers = peers
        _AllToAll.sent.append(x.numel() * x.element_size() * (peers - 1) // peers)
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        _AllToAll.sent.append(g.numel() * g.element_size() * (ctx.peers - 1) // ctx.peers)
        return g.clone(), None


@pytest.mark.parametrize("cp,dtype", [(2, torch.bfloat16), (4, torch.float32)])
def test_ulysses_traffic_is_its_all_to_alls(monkeypatch, cp, dtype):
    """q, k, v and the output each cross (CP - 1)/CP of themselves, and their gradients back."""
    monkeypatch.setattr(ulysses, "all_to_all", lambda x, group, out_splits, in_splits: _AllToAll.apply(x, len(in_splits)))
    _AllToAll.sent = []
    shape, A = _shape(cp_comm_type="a2a", num_query_groups=8), torch.tensor([], dtype=dtype).element_size()
    q, k, v, do = _qkv(shape, cp, dtype)
    out = ulysses.ulysses_attention(q, k, v, None, cp, enable_gqa=False)
    forward = sum(_AllToAll.sent)
    out.backward(do)
    assert len(_AllToAll.sent) == 8 and sum(_AllToAll.sent) == 2 * forward
    s = shape.seq_length // cp
    assert sum(_AllToAll.sent) == pytest.approx(plan.ulysses_bytes(shape, s, B, TP, cp, A))
    assert plan.ulysses_bytes(shape, s, B, TP, cp, A, True) == pytest.approx(3 * forward)


def saved_beyond_inputs(fn, inputs) -> int:
    """Bytes autograd saves while ``fn`` runs, beyond the size of ``inputs`` (q, k, v: Korthikanti's
    Q, K, V, whichever copies of them are saved)."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(storages.values()) - sum(t.numel() * t.element_size() for t in inputs)


@pytest.mark.parametrize("kind", ["p2p", "a2a"])
def test_cp_attention_keeps_its_output_and_log_sum_exp(monkeypatch, kind):
    """Ring: its fp32 output and log-sum-exp; Ulysses: SDPA's output and fp32 log-sum-exp."""
    monkeypatch.setattr(ulysses, "all_to_all", lambda x, group, out_splits, in_splits: _AllToAll.apply(x, len(in_splits)))
    shape, cp = _shape(cp_comm_type=kind), 2
    q, k, v, _ = _qkv(shape, cp, torch.bfloat16)
    run = (lambda: cpa.RingAttention.apply(q, k, v, _Ring(cp, 0))) if kind == "p2p" else \
        (lambda: ulysses.ulysses_attention(q, k, v, None, cp, enable_gqa=True))
    got = saved_beyond_inputs(run, (q, k, v))
    assert got == plan.cp_attention_kept_bytes(shape, shape.seq_length // cp, B, TP, cp, 2)
    assert plan.cp_attention_kept_bytes(shape, 16, B, TP, 1, 2) == 0


def test_ring_working_set_follows_the_ring_tiles():
    """The transient: 12 fp32 ``[b, a/t, s', d]`` tensors and two score tiles of at most
    TILE_ELEMS elements (the ring's own constant), one query row at least."""
    assert cp_memory.TILE_ELEMS == cpa.TILE_ELEMS
    shape, s = _shape(), 16
    heads, L, d = B * 4, 8, 8
    assert plan.ring_transient_bytes(shape, s, B, TP) == 4 * (12 * heads * s * d + 2 * heads * L * L)
    long = _shape(num_layers=1, hidden_size=4096, num_attention_heads=32, num_query_groups=8, seq_length=65536)
    s, heads, d, L = 32768, 1 * 32 // 8, 128, 16384  # CP 2, TP 8, b 1: one tile of 64 rows x L keys
    rows = cpa.TILE_ELEMS // (heads * L)
    assert rows == 64 and plan.ring_transient_bytes(long, s, 1, 8) == 4 * (12 * heads * s * d + 2 * heads * rows * L)


def _zero_states(rank, world):
    from megazero.zero import ZeroOptimizer
    topo = Topology(world, rank, cp=2).create_groups()
    out = []
    for shape in (_shape(params_dtype=torch.bfloat16), _moe_shape()):
        model = GPTModel(shape, topo)
        out.append([ZeroOptimizer([model], topo, stage=stage, params_dtype=torch.bfloat16,
                                  param_persistence_threshold=0,
                                  expert_params=expert_parallel_params([model])).state_bytes()
                    for stage in range(4)])
    return out


def _moe_shape():
    return _shape(params_dtype=torch.bfloat16, add_bias_linear=False, num_experts=4, moe_ffn_hidden_size=16,
                  moe_router_topk=2, moe_layer_freq=2)


def test_zero_states_partition_over_dp_times_cp(distributed):
    """CP 2 x DP 1, bf16: ZeRO partitions over DP x CP = 2 (the experts' over EDP = TP CP DP /
    (ETP EP) = 2); the optimizer's formula equals the planner's and its buffers are within 2 %."""
    got = distributed(_zero_states, 2)[0]
    for shape, per_stage in zip((_shape(params_dtype=torch.bfloat16), _moe_shape()), got):
        dense, expert = plan.stage_param_split(shape, 1, 1, 0)
        for stage, real in enumerate(per_stage):
            x = plan.estimate(shape, 1, 1, 1, stage, micro_batch_size=1, micro_batches=1, grad_bytes=4, cp=2)
            assert (x.cp, x.dp, x.edp) == (2, 1, 2)
            want = plan.model_state_bytes(dense, stage, 2, 2, 4) + plan.model_state_bytes(expert, stage, 2, 2, 4)
            assert x.model_state_bytes == pytest.approx(want)
            assert real["formula"] == pytest.approx(plan.model_state_bytes(dense + expert, stage, 2, 2, 4))
            assert real["total"] == pytest.approx(want, rel=0.02), (shape.moe is not None, stage)
            if stage:
                assert x.model_state_bytes < plan.estimate(shape, 1, 1, 1, stage, micro_batch_size=1, micro_batches=1,
                                                           grad_bytes=4).model_state_bytes


@pytest.mark.parametrize("kind,param_bytes", [("p2p", 2), ("a2a", 2), ("p2p", 4)])
def test_activations_are_the_cp1_figure_at_s_over_cp(kind, param_bytes):
    """No recompute, PP 1: the selective figure (no a s^2 scores) at s / CP for every layer, plus
    the attention's saved output and log-sum-exp per layer, plus the ring's working set."""
    shape, cp = _shape(cp_comm_type=kind, seq_length=64), 2
    half = _shape(cp_comm_type=kind, seq_length=32)
    kw = dict(micro_batch_size=B, micro_batches=1, param_bytes=param_bytes, grad_bytes=4)
    x = plan.estimate(shape, TP, 1, 1, 0, cp=cp, **kw)
    ref = plan.estimate(half, TP, 1, 1, 0, recompute="selective", **kw)
    A, s = param_bytes, 32
    per = plan.cp_attention_kept_bytes(shape, s, B, TP, cp, A)
    ring = plan.ring_transient_bytes(shape, s, B, TP) if kind == "p2p" else 0
    assert x.activation_bytes == pytest.approx(ref.activation_bytes + 4 * per + ring)
    # full recompute: each layer keeps its input; one layer's activations (and the ring) while recomputed
    full = plan.estimate(shape, TP, 1, 1, 0, cp=cp, recompute="full", **kw)
    ref_full = plan.estimate(half, TP, 1, 1, 0, recompute="full", **kw)
    scores = (plan.layer_activation_bytes(s, B, 64, 8, TP) - plan.layer_activation_bytes(s, B, 64, 8, TP, scores=False))
    assert full.activation_bytes == pytest.approx(ref_full.activation_bytes - scores * A / 2 + per + ring)


def test_communication_over_cp():
    """DP gradients over DP x CP; TP and PP traffic at s / CP; the ring per layer and micro-batch."""
    shape, m, cp, A = _shape(num_layers=8), 3, 2, 2
    x = plan.estimate(shape, TP, 2, 1, 1, micro_batch_size=B, micro_batches=m, cp=cp, sequence_parallel=True)
    dense = x.params
    assert x.comm_dp_bytes == pytest.approx(dense * 2 / 2 + dense * 2 / 2)  # RS(g Φ) + AG(p Φ), 2 ranks, g = p = 2
    s, h = 16, 64
    assert x.comm_tp_bytes == pytest.approx(m * 4 * 4 * (2 * (TP - 1) / TP * s * B * h * A))  # 4 layers per stage
    assert x.comm_pp_bytes == pytest.approx(m * 2 * s * B * h * A / TP)
    assert x.comm_cp_bytes == pytest.approx(m * 4 * plan.ring_bytes(shape, s, B, TP, cp, A))
    assert x.comm_bytes == pytest.approx(x.comm_dp_bytes + x.comm_tp_bytes + x.comm_pp_bytes + x.comm_cp_bytes)


def test_layouts_range_over_cp_only_when_asked():
    shape = _shape(seq_length=48)
    default = plan.plan(shape, 16, micro_batch_size=1)
    assert default and all(x.cp == 1 and x.comm_cp_bytes == 0 for x in default)
    every = plan.plan(shape, 16, micro_batch_size=1, global_batch_size=32, cp=None)
    assert {x.cp for x in every} == {1, 2, 4, 8}  # 2 CP divides 48: not CP 16
    for x in every:
        assert x.tp * x.pp * x.cp * x.dp == 16 and x.micro_batches == 32 // x.dp  # CP ranks share samples
    assert {x.zero for x in every if x.dp == 1 and x.cp > 1} == {0, 1, 2, 3}  # ZeRO over DP x CP
    sp = plan.plan(shape, 16, micro_batch_size=1, cp=None, tp=4, sequence_parallel=True)
    assert {x.cp for x in sp} == {1, 2}  # with SP the sequence splits over 2 CP x TP 4
    a2a = plan.plan(_shape(cp_comm_type="a2a", num_query_groups=2), 16, micro_batch_size=1, cp=None)
    assert {(x.tp, x.cp) for x in a2a if x.pp == 1} >= {(1, 2), (2, 1)}
    assert all((2 // x.tp) % x.cp == 0 for x in a2a)  # query groups per TP rank divisible by CP
    moe = plan.plan(_moe_shape(), 8, micro_batch_size=1, cp=2, pp=1)
    assert moe and all(x.cp == 2 and x.edp == x.tp * 2 * x.dp // (x.etp * x.ep) for x in moe)
    with pytest.raises(ValueError, match="divisible"):
        plan.estimate(shape, 1, 1, 1, 0, micro_batch_size=1, micro_batches=1, cp=16)


def test_cli_context_parallel(capsys):
    argv = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "8", "--seq-length", "64",
            "--micro-batch-size", "1", "--vocab-size", "100", "--world-size", "8", "--bf16"]
    assert planner_main(argv) == 0
    plain = capsys.readouterr().out.splitlines()
    h = next(i for i, line in enumerate(plain) if line.split()[:2] == ["TP", "PP"])
    assert "CP" not in plain[h].split() and "context parallel" not in plain[0]
    assert planner_main(argv + ["--attention-dropout", "0", "--context-parallel-size", "2", "--cp-comm-type",
                                "a2a"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith("; context parallel a2a (Ulysses)")
    h = next(i for i, line in enumerate(lines) if line.split()[:2] == ["TP", "PP"])
    assert lines[h].split()[:6] == ["TP", "PP", "VP", "CP", "DP", "ZeRO"] and lines[h].split()[-6:-4] == ["pp", "cp)"]
    assert all(row.split()[3] == "2" for row in lines[h + 2:-1])
    assert planner_main(argv + ["--attention-dropout", "0", "--try-context-parallel", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert {r["cp"] for r in rows} == {1, 2, 4, 8} and all((r["comm_cp_bytes"] > 0) == (r["cp"] > 1) for r in rows)
    for bad in (["--context-parallel-size", "2"], ["--try-context-parallel"],
                ["--attention-dropout", "0", "--context-parallel-size", "2", "--cp-comm-type", "allgather"],
                ["--attention-dropout", "0", "--try-context-parallel", "--context-parallel-size", "2"]):
        with pytest.raises(SystemExit):
            planner_main(argv + bad)
    assert "--attention-dropout 0" in capsys.readouterr().err


def test_llama3_8b_at_32k_docs_example():
    """docs/plan.md's example: TP 8, PP 1, ZeRO 1, selective recompute with SP, bf16: CP 4 keeps
    0.29x the activations of CP 1 (5.48 against 19.05 GiB) for 112 GiB of ring traffic per step."""
    shape = GPTConfig.from_megatron(dict(num_layers=32, hidden_size=4096, num_attention_heads=32, num_query_groups=8,
                                         ffn_hidden_size=14336, swiglu=True, normalization="RMSNorm",
                                         position_embedding_type="rope", add_bias_linear=False,
                                         untie_embeddings_and_output_weights=True, seq_length=32768,
                                         attention_dropout=0.0), vocab_size=128256)
    kw = dict(micro_batch_size=1, param_bytes=2, grad_bytes=4, sequence_parallel=True, recompute="selective")
    cp4 = plan.estimate(shape, 8, 1, 1, 1, micro_batches=64, cp=4, **kw)
    cp1 = plan.estimate(shape, 8, 1, 4, 1, micro_batches=16, **kw)
    assert (round(cp4.activation_bytes / plan.GiB, 2), round(cp1.activation_bytes / plan.GiB, 2)) == (5.48, 19.05)
    assert cp4.activation_bytes / cp1.activation_bytes < 0.3 and round(cp4.comm_cp_bytes / plan.GiB, 2) == 112
    assert cp4.model_state_bytes == pytest.approx(cp1.model_state_bytes)  # ZeRO over DP x CP = 4 either way
    assert not plan.cp_valid(GPTConfig.from_megatron(dict(shape.to_args(), cp_comm_type="a2a",
                                                          attention_dropout=0.0)), 2, 8)  # 1 group per TP rank
