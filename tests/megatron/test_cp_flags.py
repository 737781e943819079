"""--context-parallel-size and --cp-comm-type as Megatron-LM names them: honoured values reach the
parallel and model configs, bad input stops with one line naming the flag before any process group."""

import pytest

from megazero.arguments import parse_args
from megazero.config.run_config import parallel_config
from megazero.config.model import gpt_config

BASE = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "1", "--mock-data", "--vocab-size", "64", "--train-iters", "2", "--lr", "1e-3",
        "--attention-dropout", "0", "--position-embedding-type", "rope"]


def _error(capsys, extra, world=4):
    with pytest.raises(SystemExit):
        parse_args(BASE + extra, world_size=world, training=True)
    return capsys.readouterr().err


def test_cp_reaches_the_configs():
    a = parse_args(BASE + ["--context-parallel-size", "2", "--cp-comm-type", "a2a", "--global-batch-size", "4"],
                   world_size=8)
    assert a.data_parallel_size == 4 and a.num_micro_batches == 1  # DP excludes CP, as Megatron
    par = parallel_config(a)
    assert (par.cp, par.dp) == (2, 4)
    assert gpt_config(a).cp_comm_type == "a2a"


@pytest.mark.parametrize("extra,message", [
    (["--context-parallel-size", "3"], "not divisible by --tensor-model-parallel-size 1 x "
                                       "--pipeline-model-parallel-size 1 x --context-parallel-size 3 = 3"),
    (["--context-parallel-size", "2", "--cp-comm-type", "allgather"], "--cp-comm-type allgather: the all-gather"),
    (["--context-parallel-size", "2", "--cp-comm-type", "a2a+p2p"], "hierarchical a2a+p2p is not available"),
    (["--context-parallel-size", "2", "--cp-comm-type", "p2p", "a2a", "p2p", "p2p"], "one type per layer"),
    (["--context-parallel-size", "4", "--seq-length", "12"], "--seq-length 12 is not divisible by 8"),
    (["--context-parallel-size", "2", "--cp-comm-type", "a2a", "--group-query-attention", "--num-query-groups", "1"],
     "query groups (1) per TP rank divisible by --context-parallel-size 2"),
    (["--context-parallel-size", "2", "--attention-dropout", "0.1"], "needs --attention-dropout 0"),
    (["--context-parallel-size", "2", "--reset-attention-mask"], "--reset-attention-mask is not available"),
    (["--context-parallel-size", "2", "--hierarchical-context-parallel-sizes", "1", "2"], "hierarchical"),
])
def test_bad_cp_input_is_one_line(capsys, extra, message):
    last = _error(capsys, extra).strip().splitlines()[-1]  # the one "prog: error: ..." line
    assert "error:" in last and message in last
