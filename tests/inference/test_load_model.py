"""``megazero.load_model``: a checkpoint saved by a TP2 run, loaded into one process, gives the
training-time model's logits over the real vocabulary (issue 30 §6)."""

import torch

import megazero
from megazero.arguments import parse_args
from megazero.testing import run_distributed
from tests.test_training import MOCK, TINY

TOKENS = torch.tensor([[1, 5, 9, 33, 77, 99, 0, 42], [3, 3, 8, 64, 12, 7, 50, 98]])


def _train_and_logits(rank, world_size, argv):
    """Train and save; then the trained TP-sharded model's logits, gathered over TP, on rank 0."""
    import signal

    import torch.distributed as dist

    from megazero.training import setup
    from megazero.training.signals import ExitSignal
    trainer = setup(parse_args(argv, world_size=world_size))
    trainer.train(ExitSignal.install((signal.SIGUSR1,)))
    chunk = trainer.chunks[0].eval()
    with torch.no_grad():
        local = chunk(TOKENS)  # [b, s, V'/TP]
    parts = [torch.empty_like(local) for _ in range(world_size)]
    dist.all_gather(parts, local.contiguous(), group=trainer.topo.tp_group)
    return torch.cat(parts, dim=-1)


def test_load_model_of_a_tp2_checkpoint_gives_the_training_models_logits(tmp_path):
    save = tmp_path / "ck"
    argv = TINY + MOCK + ["--train-iters", "2", "--tensor-model-parallel-size", "2", "--zero-stage", "1",
                          "--save", str(save), "--save-interval", "2", "--make-vocab-size-divisible-by", "16"]
    trained = run_distributed(_train_and_logits, 2, argv, timeout_s=240)[0]
    assert trained.shape == (2, 8, 128)  # padded to a multiple of 16 x TP 2
    model = megazero.load_model(str(save))
    with torch.no_grad():
        logits = model(TOKENS)
    assert logits.shape == (2, 8, 100) and model.iteration == 2 and not model.training
    torch.testing.assert_close(logits, trained[..., :100], rtol=1e-5, atol=1e-5)
    assert megazero.load_model(str(save), dtype=torch.bfloat16).gpt.config.params_dtype == torch.bfloat16
