"""Megatron's log-line format (parsers depend on it) and the model-FLOPs formula."""

import re

from megazero.model import GPTConfig
from megazero.training.logger import iteration_line, model_flops_per_iteration, validation_line

EXAMPLE = (" iteration      100/    1000 | consumed samples:         3200 | elapsed time per iteration (ms): 512.3 |"
           " throughput per GPU (TFLOP/s/GPU): 0.1 | learning rate: 2.999999E-04 | global batch size:    32 |"
           " lm loss: 5.123456E+00 | loss scale: 1.0 | grad norm: 1.234 | number of skipped iterations:   0 |"
           " number of nan iterations:   0 |")


def test_iteration_line_matches_megatron_byte_for_byte():
    line = iteration_line(iteration=100, train_iters=1000, consumed_samples=3200, iteration_ms=512.3,
                          tflops_per_gpu=0.1, lr=2.999999e-4, global_batch_size=32, losses={"lm loss": 5.123456},
                          loss_scale=1.0, grad_norm=1.234, skipped=0, nans=0)
    assert line == EXAMPLE


def test_validation_line():
    text = validation_line(7, 2.0)
    assert re.search(r"validation loss at iteration 7 \| lm loss value: 2\.000000E\+00 \| lm loss PPL: 7\.389056E\+00",
                     text)


def test_flops_formula_gpt3_style():
    c = GPTConfig(seq_length=2048, num_layers=24, hidden_size=2048, num_attention_heads=16, num_query_groups=16,
                  kv_channels=128, ffn_hidden_size=8192, vocab_size=50257)
    assert c.padded_vocab(1) == 50304
    f = model_flops_per_iteration(c, batch_size=1)
    # 6 * N * tokens (N ~ 1.3B incl. embedding) plus attention, per token ~ 8.5-9.5 GFLOP
    assert 8.0e9 * 2048 < f < 1.0e10 * 2048
