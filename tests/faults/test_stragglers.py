"""``--log-straggler`` (issue 46, item 3): a rank made slow by a sleep in its forward step
(``MEGAZERO_FAULTS=slow:...``, megazero/training/faults.py) is named, with its host, as the
slowest in Megatron-LM's report line and in TensorBoard; ``--disable-straggler-on-startup`` waits
for a connection to ``--straggler-ctrlr-port``."""

import os
import socket

from megazero.arguments import parse_args
from megazero.testing import free_port, run_distributed

TINY = ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8",
        "--micro-batch-size", "1", "--global-batch-size", "6", "--lr", "1e-3", "--attention-dropout", "0",
        "--hidden-dropout", "0", "--eval-interval", "1000", "--eval-iters", "0", "--distributed-backend", "gloo",
        "--seed", "3", "--mock-data", "--vocab-size", "64", "--log-interval", "2", "--train-iters", "6",
        "--log-straggler"]


def _train(rank, world, argv, toggle_port):
    from megazero.training import setup
    os.environ["MEGAZERO_FAULTS"] = "slow:rank=1:seconds=0.04"
    trainer = setup(parse_args(TINY + argv, world_size=world))
    if toggle_port and rank == 0:  # what `curl rank0:PORT` does
        with socket.create_connection(("127.0.0.1", toggle_port), timeout=30) as conn:
            conn.sendall(b"GET / HTTP/1.0\r\n\r\n")
            reply = conn.recv(1024).decode()
        assert "Will turn StragglerDetector ON at next logging interval" in reply, reply
    trainer.train(None)
    trainer.tb.close()
    return [(it, r.slowest, r.fastest, r.hosts[r.slowest]) for it, r in trainer.straggler_reports]


def test_the_slowed_rank_is_named_with_its_host(tmp_path, capfd):
    tb = tmp_path / "tb"
    reports = run_distributed(_train, 3, ["--straggler-ctrlr-port", str(free_port()), "--straggler-minmax-count", "2",
                                          "--tensorboard-dir", str(tb)], None, timeout_s=240)
    out = capfd.readouterr().out
    host = socket.gethostname()
    assert all(r == reports[0] for r in reports) and [it for it, *_ in reports[0]] == [2, 4, 6]
    assert all(slowest == 1 and h == host for _, slowest, _, h in reports[0]), reports[0]
    lines = [l for l in out.splitlines() if "| MnRtt/Rnk: " in l]
    assert len(lines) == 3 and all("ms/1 | MnDRtt/Rnk:" in l for l in lines), lines  # MxRtt/Rnk: ...ms/1
    assert f"stragglers: slowest rank 1 on {host}" in out
    assert "^^^^ Bottom 2 Ranks with lowest  Etpt(TF):" in out and "^^^^ Top    2 Ranks with highest Etpt(TF):" in out
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(tb))
    acc.Reload()
    assert [e.value for e in acc.Scalars("straggler-max-rtt-rank")] == [1.0, 1.0, 1.0]
    assert "skipped-iterations" in acc.Tags()["scalars"]


def test_disabled_on_startup_until_the_control_port_is_called(capfd):
    port = free_port()
    reports = run_distributed(_train, 2, ["--disable-straggler-on-startup", "--straggler-ctrlr-port", str(port)],
                              port, timeout_s=240)
    out = capfd.readouterr().out
    assert f"Controller ready to recv commands on port {port}. Current state OFF" in out
    assert "Toggling StragglerDetector State ON" in out
    assert [(it, slowest) for it, slowest, *_ in reports[0]] == [(4, 1), (6, 1)], "on from the first log iteration"
