"""The planner's advice against published layouts, the attention backend in the activations, the GPU
presets and the step-time formulas (megazero.planner.timing; docs/plan.md)."""

import json

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from megazero import planner as plan
from megazero.model import GPTConfig
from megazero.planner.cli import main as planner_main
from megazero.planner.presets import GPUS
from megazero.planner.timing import flops_per_token, step_time, within_node
from tests.test_plan_cp import saved_beyond_inputs

GiB = 2 ** 30

# Megatron-LM examples/llama/train_llama3_8b_h100_fp8.sh and train_llama3_8b_h200_bf16.sh (8 GPUs, TP1 PP1
# CP1, distributed optimizer, fused attention, seq 8192, mbs 1, gbs 128), model and training flags.
LLAMA3_8B = ("--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 "
             "--group-query-attention --num-query-groups 8 --kv-channels 128 --seq-length 8192 "
             "--max-position-embeddings 8192 --position-embedding-type rope --rotary-base 1000000 "
             "--attention-dropout 0.0 --hidden-dropout 0.0 --swiglu --normalization RMSNorm --attention-backend fused "
             "--untie-embeddings-and-output-weights --disable-bias-linear --micro-batch-size 1 --global-batch-size 128 "
             "--bf16 --vocab-size 128256 --use-distributed-optimizer --sequence-parallel --world-size 8").split()
# Megatron-LM examples/llama/train_llama2_7b_h100_fp16_fp8.sh's defaults: TP1 PP1, selective recompute
# (--recompute-activations), distributed optimizer, flash attention, bf16, seq 2048, mbs 1, gbs 2048.
LLAMA2_7B = ("--num-layers 32 --hidden-size 4096 --num-attention-heads 32 --ffn-hidden-size 11008 --seq-length 2048 "
             "--max-position-embeddings 4096 --swiglu --normalization RMSNorm --position-embedding-type rope "
             "--untie-embeddings-and-output-weights --disable-bias-linear --micro-batch-size 1 "
             "--global-batch-size 2048 --bf16 --vocab-size 32000 --recompute-activations --use-distributed-optimizer "
             "--use-flash-attn --world-size 8").split()
# Megatron-LM examples/gpt3/train_gpt3_175b_distributed.sh: TP8 PP16, seq 2048, mbs 1, gbs 1536, fp16,
# attention auto; the script sets no node count (one node cannot hold TP8 x PP16): 1024 A100-80G, DP 8.
GPT3_175B = ("--num-layers 96 --hidden-size 12288 --num-attention-heads 96 --seq-length 2048 "
             "--max-position-embeddings 2048 --micro-batch-size 1 --global-batch-size 1536 --fp16 --vocab-size 50257 "
             "--attention-backend auto --world-size 1024 --gpu a100-80g").split()

# NeMo's nemo/collections/llm/recipes/llama3_70b.py pretrain_recipe: 4 nodes x 8 H100, TP4 PP4 VP5 CP2 with
# sequence parallelism, the distributed optimizer, bf16, seq 8192, mbs 1, gbs 512 (the Llama-2 70B shape with
# Llama-3's vocabulary and sequence; Megatron-LM has no 70B pretraining example for NVIDIA GPUs).
LLAMA3_70B = ("--num-layers 80 --hidden-size 8192 --ffn-hidden-size 28672 --num-attention-heads 64 "
              "--group-query-attention --num-query-groups 8 --kv-channels 128 --seq-length 8192 "
              "--max-position-embeddings 8192 --position-embedding-type rope --attention-dropout 0.0 "
              "--hidden-dropout 0.0 --swiglu --normalization RMSNorm --untie-embeddings-and-output-weights "
              "--disable-bias-linear --micro-batch-size 1 --global-batch-size 512 --bf16 --vocab-size 128256 "
              "--use-distributed-optimizer --sequence-parallel --world-size 32 "
              "--num-layers-per-virtual-pipeline-stage 4 --try-context-parallel").split()


def _rows(capsys, argv):
    assert planner_main(argv + ["--json"]) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def _key(r):
    return r["tp"], r["pp"], r["dp"], r["zero"]


def test_llama3_8b_megatron_layout_is_recommended_on_h200(capsys):
    """Megatron's bf16 script (H200): TP1 PP1 DP8 with the distributed optimizer fits and is the top row."""
    rows = _rows(capsys, LLAMA3_8B + ["--gpu", "h200"])
    top = rows[0]
    assert _key(top) == (1, 1, 8, 1) and top["fits"] and top["total_bytes"] < 140 * GiB
    assert all(r["step_s"] >= top["step_s"] for r in rows if r["fits"])


def test_llama3_8b_on_h100_flash_not_scores(capsys):
    """The issue's 414 GiB was the a s^2 scores: with fused attention the TP1 layout needs ~94 GiB (megazero
    keeps fp32 gradients with bf16, as Megatron does without --grad-reduce-in-bf16; the H100 script also
    uses fp8), the scores would add 5 a s / h = 320 s b h per layer; on H100 the top layout fits, TP <= 2."""
    rows = _rows(capsys, LLAMA3_8B + ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
                                      "--zero-stage", "1"])
    (tp1,) = rows
    assert 85 * GiB < tp1["total_bytes"] < 100 * GiB
    unfused = _rows(capsys, LLAMA3_8B[:LLAMA3_8B.index("fused")] + ["unfused"] + LLAMA3_8B[LLAMA3_8B.index("fused") + 1:]
                    + ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1", "--zero-stage", "1"])[0]
    sbh = 8192 * 4096
    assert unfused["activation_bytes"] - tp1["activation_bytes"] == pytest.approx(32 * 320 * sbh)
    top = _rows(capsys, LLAMA3_8B)[0]
    assert top["fits"] and top["tp"] <= 2 and top["zero"] == 1


def test_llama2_7b_on_8_h100_recommends_small_tp_without_zero3(capsys):
    """The Megatron script's own layout (TP1 PP1, distributed optimizer) is the recommendation; TP8 and
    ZeRO-3 layouts, which move 10-30x the bytes, rank below every TP <= 2 layout that fits."""
    rows = _rows(capsys, LLAMA2_7B)
    top = rows[0]
    assert _key(top) == (1, 1, 8, 1) and top["fits"]
    fits = [r for r in rows if r["fits"]]
    worst_small = max(r["step_s"] for r in fits if r["tp"] <= 2 and r["zero"] < 3)
    assert all(r["step_s"] > top["step_s"] * 1.03 for r in fits if r["tp"] == 8 or r["zero"] == 3)
    assert worst_small < min(r["step_s"] for r in fits if r["tp"] == 8)


def test_gpt3_175b_on_1024_a100(capsys):
    """TP 8 (one node) is recommended; the published TP8 PP16 layout fits and is within 2 % of the top."""
    rows = _rows(capsys, GPT3_175B)
    top = rows[0]
    assert top["tp"] == 8 and top["fits"] and top["zero"] < 3
    published = min((r for r in rows if (r["tp"], r["pp"]) == (8, 16)), key=lambda r: r["step_s"])
    assert published["fits"] and published["step_s"] < 1.02 * top["step_s"]
    assert published["links"]["tp"] == "nvlink" and published["links"]["dp"] == "network"


def test_llama_70b_nemo_layout_on_32_h100(capsys):
    """NeMo's TP4 PP4 VP5 CP2 is the top recommendation among the layouts with 4 layers per virtual stage."""
    rows = _rows(capsys, LLAMA3_70B)
    top = rows[0]
    assert (top["tp"], top["pp"], top["vp"], top["cp"], top["dp"], top["zero"]) == (4, 4, 5, 2, 1, 1)
    assert top["fits"] and top["links"]["tp"] == "nvlink" and top["links"]["pp"] == "network"
    assert not any(r["fits"] for r in rows if r["tp"] * r["cp"] == 1)  # 70B needs model or context parallelism


@pytest.mark.parametrize("backend,dropout", [(SDPBackend.FLASH_ATTENTION, 0.0), (SDPBackend.MATH, 0.0),
                                             (SDPBackend.MATH, 0.1)])
def test_attention_kernels_keep_what_the_planner_assumes(backend, dropout):
    """SDPA's flash kernel keeps its output and an fp32 log-sum-exp per row, no a s^2 term (the planner's
    flash/fused figure); the math kernel (--attention-backend unfused/local) keeps the a s^2 scores --
    in bf16 4.75 a s^2 b bytes at dropout 0 (CPU, and an H200 with torch 2.11), with dropout 12.75 on
    CPU and 9.75 on the H200, against Korthikanti's 5 for Megatron's fused softmax (docs/plan.md)."""
    b, a, s, d = 2, 4, 128, 16
    q, k, v = (torch.randn(b, a, s, d, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    with sdpa_kernel([backend]):
        got = saved_beyond_inputs(lambda: F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True),
                                   (q, k, v))
    if backend == SDPBackend.FLASH_ATTENTION:
        assert got == b * a * s * d * 2 + b * a * s * 4
    else:
        assert got == (4.75 if dropout == 0 else 12.75) * a * s * s * b  # CPU keeps more with dropout than CUDA


def test_step_time_formulas():
    """Compute 6N + 12 L s a d per token at peak x MFU, bubble (p-1)/(v m), bytes over the link's bandwidth."""
    shape = GPTConfig(num_layers=4, hidden_size=256, num_attention_heads=4, vocab_size=1000, seq_length=512)
    assert shape.tied_embeddings  # the output layer's matmul uses the embedding: every parameter counts
    n = plan.total_params(shape) - shape.max_position_embeddings * 256  # learned positions: a lookup
    assert flops_per_token(shape) == 6 * n + 12 * 4 * 512 * 256
    assert flops_per_token(shape, "full") == pytest.approx(8 * n + 16 * 4 * 512 * 256)  # x 4/3
    gpu = GPUS["h100"]
    x = plan.estimate(shape, 2, 2, 4, 1, micro_batch_size=2, micro_batches=8)
    t = step_time(shape, x, gpu, 2, 0.5)
    tokens = 8 * 2 * 4 * 512
    assert t.compute == pytest.approx(flops_per_token(shape) * tokens / 16 / (989e12 * 0.5))
    assert t.bubble == pytest.approx(t.compute * 1 / 8)
    assert t.links == dict(tp="nvlink", cp="nvlink", dp="nvlink", pp="network", ep="nvlink", edp="nvlink")
    assert t.comm["tp"] == pytest.approx(x.comm_tp_bytes / 450e9)
    assert t.comm["pp"] == pytest.approx(x.comm_pp_bytes / 50e9)
    assert within_node(1, 8, 8) and not within_node(2, 8, 8) and within_node(64, 1, 8)


def test_help_shows_planner_flags_first(capsys):
    assert planner_main(["--help"]) == 0
    short = capsys.readouterr().out
    assert "--gpu" in short and "--world-size" in short and "--lr-decay-style" not in short
    assert len(short.splitlines()) < 60
    assert planner_main(["--help-all"]) == 0
    assert "--lr-decay-style" in capsys.readouterr().out


@pytest.mark.parametrize("bad", [["--assumed-mfu", "0"], ["--assumed-mfu", "nan"], ["--gpu-memory-gb", "-1"],
                                 ["--gpus-per-node", "0"], ["--gpu", "v100"]])
def test_bad_planner_values(capsys, bad):
    with pytest.raises(SystemExit):
        planner_main(LLAMA2_7B + bad)
    assert bad[0] in capsys.readouterr().err


def test_recommendation_lines(capsys):
    """The top layout first with its time split and the cheaper-in-memory alternative; the selective-
    recompute note under flash attention; the smallest layout named when nothing fits."""
    assert planner_main(LLAMA2_7B + ["--top", "3"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[2].startswith("recommended: TP1 PP1 DP8 ZeRO-1: fits in ") and out[2].endswith(" s/step")
    assert out[3].startswith("  time: compute ") and "(MFU 0.45 assumed)" in out[3] and "DP " in out[3]
    assert " would save " in out[4] and out[4].endswith("% more time")
    assert out[5].startswith("  selective recompute saves no memory with flash/fused attention")
    assert len(out) == 6 + 2 + 3 + 1  # the table's head, rule, 3 rows, the closing line
    assert planner_main(LLAMA2_7B + ["--gpu", "a100-40g", "--gpu-memory-gb", "1", "--fits-only"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[2].startswith("no layout fits 1 GiB: the smallest, ") and "--recompute-granularity full" in out[2]
