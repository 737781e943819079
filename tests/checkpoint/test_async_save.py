"""--async-save: the rank's long-lived writer process (megazero/checkpoint/async_writer.py) writes
the bytes a synchronous save writes, from a shared buffer allocated once and reused (reallocated
when the state's shape changes); the pointer moves only in finish(), which the training loop calls
once the iteration's packed agreement finds no rank still writing; a failed snapshot or write and a
killed writer are reported on every rank naming the rank file; a resumed run is the same bit for
bit from an asynchronous checkpoint as from a synchronous one."""

import os
import signal

import torch

from megazero.arguments import parse_args
from megazero.checkpoint import files as ckpt
from megazero.checkpoint import schema
from megazero.checkpoint.async_writer import AsyncWriter
from megazero.testing import run_distributed
from tests.test_training import MOCK, TINY, layout_flags, train

LAYOUT = {"world_size": 2, "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
          "virtual_pipeline_model_parallel_size": None, "data_parallel_size": 2, "zero_stage": 1,
          "params_dtype": "float32"}


def _state(scale: float, n: int = 40) -> dict:
    """Views of one flat storage (as ZeRO's shards are), another dtype, a tensor named twice, an
    empty one, and plain values."""
    flat = torch.arange(n, dtype=torch.float32) * scale
    shared = torch.ones(3, dtype=torch.bfloat16) * scale
    return {"model": [{"a": flat[:10], "b": flat[10:30].view(4, 5).t()}],
            "optimizer": {"shards": [{"master": flat, "step": 7}], "same": shared, "again": shared},
            "rng": torch.tensor([1, 2, 3], dtype=torch.uint8), "empty": torch.empty(0, dtype=torch.int64),
            "scheduler": {"lr": 0.5 * scale, "name": "cosine"}, "counters": (1, None)}


def _save(root, iteration, state, writer=None):
    meta = {"iteration": iteration, "layout": LAYOUT}
    return ckpt.PendingSave(root, iteration, 0, state, meta).start(writer)


def _bytes(root, iteration, rank=0):
    with open(schema.rank_file(schema.iteration_dir(root, iteration), rank), "rb") as f:
        return f.read()


def test_async_file_is_the_sync_file_and_buffers_are_reused(tmp_path):
    sync, async_ = str(tmp_path / "sync"), str(tmp_path / "async")
    writer = AsyncWriter()
    try:
        writer.reserve(_state(9.0, 40))  # train()'s start: the writer and the first save's buffer, faulted in
        assert writer.allocations == 1 and writer.alive() and not writer.in_flight
        for it, scale, n in [(1, 1.0, 40), (2, 2.0, 40), (3, 3.0, 40), (4, 4.0, 64)]:
            _save(sync, it, _state(scale, n)).finish()
            state = _state(scale, n)
            pending = _save(async_, it, state, writer)
            state["optimizer"]["shards"][0]["master"].add_(1000.0)  # the next step: the file keeps the snapshot
            assert ckpt.latest_iteration(async_) == (it - 1 if it > 1 else None)
            assert pending.finish() == schema.iteration_dir(async_, it)
            assert _bytes(async_, it) == _bytes(sync, it), f"iteration {it}: not the synchronous save's bytes"
            loaded = ckpt.load_rank_state(async_, it, 0)  # weights_only=True
            assert torch.equal(loaded["model"][0]["b"], _state(scale, n)["model"][0]["b"])
            if it == 1:
                pid = writer.pid
                assert os.getpriority(os.PRIO_PROCESS, pid) == 19
        assert writer.pid == pid, "one writer process for the run"
        assert writer.allocations == 2, ("the reserved buffer is the first save's and is reused while the shape "
                                         "stays, reallocated when it changes")
    finally:
        writer.close()
    assert writer.proc.wait(timeout=120) == 0  # it leaves at end-of-file


def _failing(rank, world_size, root, failure):
    os.makedirs(root, exist_ok=True)
    """Rank 1's save fails: an unpicklable value (in the snapshot), or its writer meets a folder
    where the partial file goes, or its writer is killed mid-write; returns each rank's message."""
    writer = AsyncWriter()
    state = {"w": torch.full((3,), float(rank))}
    if rank == 1 and failure == "snapshot":
        state["bad"] = lambda: None
    if rank == 1 and failure != "snapshot":
        writer.submit(os.path.join(root, "warm.pt"), {"x": torch.ones(1)})  # the writer is up (not collective)
        assert writer.wait() == (None, os.path.getsize(os.path.join(root, "warm.pt")))
        os.kill(writer.pid, signal.SIGSTOP)  # it takes the message but cannot act yet
    pending = ckpt.PendingSave(root, 1, rank, state, {"iteration": 1, "layout": LAYOUT}).start(writer)
    if rank == 1 and failure == "write":
        os.mkdir(schema.rank_file(pending.tmp, rank) + ".partial")
        os.kill(writer.pid, signal.SIGCONT)
    if rank == 1 and failure == "killed":
        os.kill(writer.pid, signal.SIGKILL)
    try:
        pending.finish()
        message = None
    except schema.CheckpointError as e:
        message = str(e)
    again = None
    if failure == "killed":  # the next save starts a new writer
        pending = ckpt.PendingSave(root, 2, rank, state, {"iteration": 2, "layout": LAYOUT}).start(writer)
        again = pending.finish()
    writer.close()
    return message, again, writer.pid


def test_async_failures_are_reported_on_every_rank(tmp_path):
    for failure, cause in [("snapshot", "Can't pickle"), ("write", "is a directory"),
                           ("killed", "the writer process (pid ")]:
        root = tmp_path / failure
        # rank 1 waits for its writer (nice 19: on a busy box its start takes a while) while rank 0 is in a collective
        results = run_distributed(_failing, 2, str(root), failure, timeout_s=600, collective_timeout_s=300)
        for message, _, _ in results:
            assert message is not None and "saving " in message and "iter_0000001" in message, message
            assert "rank 1: " in message and cause in message and "rank 0:" not in message, message
            if failure != "killed":
                assert "rank_00001.pt" in message, message
            else:
                assert "was killed by signal 9" in message, message
        assert ckpt.latest_iteration(str(root)) == (2 if failure == "killed" else None)
        assert not os.path.exists(schema.iteration_dir(str(root), 1))
        if failure == "killed":
            assert [r[1] for r in results] == [schema.iteration_dir(str(root), 2)] * 2


FLAGS = TINY + MOCK + ["--zero-param-persistence-threshold", "0", "--train-iters", "6", "--save-interval", "2"]


def test_resume_from_async_checkpoint_equals_resume_from_sync(tmp_path):
    common = FLAGS + layout_flags(1, 1, None, 3)
    runs = {}
    for mode, extra in [("sync", []), ("async", ["--async-save"])]:
        ck = str(tmp_path / mode)
        first = train(2, common + ["--save", ck, "--exit-interval", "4"] + extra)
        assert ckpt.latest_iteration(ck) == 4
        runs[mode] = (ck, first, train(2, common + ["--load", ck]))
    (s_ck, s_first, s_second), (a_ck, a_first, a_second) = runs["sync"], runs["async"]
    assert a_first == s_first and a_second == s_second, "resumed runs differ"
    for it in (2, 4):
        for rank in range(2):
            a, s = (ckpt.load_rank_state(ck, it, rank) for ck in (a_ck, s_ck))
            for state in (a, s):  # Python's own stream: reseeded from the OS in each forked rank (not --seed)
                del state["rng"]["python"]
            assert _same(a, s), f"iteration {it} rank {rank}"


def _same(a, b) -> bool:
    """Equal structure, values, dtypes and bits."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _agree_writing(rank, world_size, writing):
    from megazero.parallel.topology import Topology
    from megazero.training.agree import IterationAgreement
    from megazero.zero import ZeroOptimizer
    topo = Topology(world_size, rank).create_groups()
    opt = ZeroOptimizer(torch.nn.Linear(2, 2), topo, stage=1, lr=1e-3)
    agreement = IterationAgreement(topo, torch.device("cpu"), opt)
    return [agreement.agree(None, with_loss=False, flags=(False, False, w)).writing for w in writing[rank]]


def test_the_packed_agreement_says_whether_any_rank_is_still_writing():
    """Slot +6 of the iteration's one all-reduce: True on every rank while any rank's write is in flight."""
    writing = [[True, False, False], [False, True, False]]
    assert run_distributed(_agree_writing, 2, writing) == [[True, True, False]] * 2


def _publications(rank, world_size, argv):
    from megazero.training import setup
    from megazero.training.build import build_configs
    args = parse_args(argv, world_size=world_size)
    trainer = setup(args)
    config = trainer.config
    trainer.config = build_configs(args.replace(train_iters=6))
    trainer.train(None)  # saves at 6 when it ends: the writer has started (torch imported) by then
    trainer.config = config
    trainer.train(None)
    return trainer.publications


def test_async_checkpoint_is_published_once_written_not_at_the_next_save(tmp_path):
    """Megatron's maybe_finalize_async_save(blocking=False) every iteration: a checkpoint whose
    files are written is published (renamed, pointer moved) after the first iteration whose packed
    agreement finds no rank writing -- milliseconds for this model's files once the writer runs,
    against iterations of tens of milliseconds: well before the next save, 12 iterations later
    (before this change it was published only then)."""
    argv = FLAGS[:-4] + ["--train-iters", "24", "--save-interval", "12", "--async-save", "--save", str(tmp_path / "ck")] \
        + layout_flags(1, 1, None, 1)
    for published in run_distributed(_publications, 2, argv, timeout_s=240):
        (six, at_six), (twelve, after), (last, at_end) = published
        assert (six, at_six, twelve, last, at_end) == (6, 6, 12, 24, 24), published
        assert 12 < after < 24, published
