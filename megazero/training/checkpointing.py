"""The training loop's checkpoints: save (synchronous or ``--async-save``), wait, load (a mixin
of :class:`megazero.training.loop.Trainer`; the format: docs/checkpoints.md)."""

from __future__ import annotations

import time

from megazero.checkpoint import schema
from megazero.checkpoint.api import load_run, reserve_save, start_save
from megazero.checkpoint.async_writer import AsyncWriter
from megazero.checkpoint.dcp import is_dcp, load_dcp, save_dcp
from megazero.checkpoint.files import latest_iteration
from megazero.checkpoint.torch_dist import is_megatron_dist, load_torch_dist
from megazero.training.optimizer_match import check_optimizer_matches


def print_rank(rank: int, target: int, text: str) -> None:
    """``text`` on rank ``target`` only."""
    if rank == target:
        print(text, flush=True)


class TrainerCheckpoints:
    """Checkpoint methods of the Trainer (they read its ``config``, ``topo``, ``stages``,
    ``optimizer``, ``scheduler``, ``model_config`` and counters, and set them on load)."""

    def save(self) -> None:
        """Every rank writes what it alone owns; rank 0 adds the gathered per-rank index (names, TP
        split rules, ZeRO regions) to ``metadata.json`` so any layout can load it
        (docs/checkpoints.md). ``--async-save``: the state is copied into this rank's writer
        process's shared buffer and written there (:meth:`async_writer`) while training goes on;
        a new save (or the end of :meth:`train`) first finishes the previous one."""
        ck = self.config.checkpoint
        self.finish_save()
        self.optimizer.wait_params()
        t0 = time.time()
        if ck.ckpt_format == "torch_dcp":
            path = save_dcp(ck.save, topo=self.topo, stages=self.stages, optimizer=self.optimizer,
                            model_config=self.model_config, scheduler_state=self.scheduler.state_dict(),
                            counters={"skipped": self.skipped, "nans": self.nans}, iteration=self.iteration,
                            consumed_samples=self.consumed_samples, layout=self.layout_record(),
                            saved_args={**self.config.flags, **self.model_config.to_args(self.topo.tp)},
                            save_optim=ck.save_optim)
            print_rank(self.rank, 0, f"saved DCP checkpoint at iteration {self.iteration:7d} to {path} "
                                      f"in {time.time() - t0:.2f} s")
            return
        pending = start_save(ck.save, **self._rank_state_args(), iteration=self.iteration,
                             consumed_samples=self.consumed_samples, layout=self.layout_record(),
                             saved_args={**self.config.flags, **self.model_config.to_args(self.topo.tp)},
                             writer=self.async_writer() if ck.async_save else None)
        if ck.async_save:  # every rank alike: finish() is collective, whatever this rank's snapshot did
            self.pending_save = pending
            print_rank(self.rank, 0, f"saving checkpoint at iteration {self.iteration:7d} to {pending.final} "
                                      f"in the background (snapshot {time.time() - t0:.2f} s)")
            return
        path = pending.finish()
        print_rank(self.rank, 0, f"saved checkpoint at iteration {self.iteration:7d} to {path} "
                                  f"in {time.time() - t0:.2f} s")

    def layout_record(self) -> dict:
        """This run's parallel layout as a checkpoint records it (:func:`schema.layout`)."""
        par, opt = self.config.parallel, self.config.optimizer
        return schema.layout(par.world_size, par.tp, par.pp, par.vp, par.dp, opt.stage, opt.params_dtype,
                             ep=self.topo.ep, etp=self.topo.etp, cp=self.topo.cp)

    def _rank_state_args(self) -> dict:
        """The keywords that say what this rank's checkpoint file holds."""
        return dict(topo=self.topo, stages=self.stages, optimizer=self.optimizer,
                    scheduler_state=self.scheduler.state_dict(), counters={"skipped": self.skipped, "nans": self.nans},
                    save_optim=self.config.checkpoint.save_optim, save_rng=self.config.checkpoint.save_rng)

    def prepare_async_save(self) -> None:
        """``--async-save``: start this rank's writer and fault in its snapshot buffer before the
        first step (a torch import and the buffer's page faults, not in the step after a save)."""
        reserve_save(self.async_writer(), **self._rank_state_args())

    def async_writer(self) -> AsyncWriter:
        """This rank's writer (``--async-save``): started by ``train()`` (or the first save), kept for the run."""
        if self.__dict__.get("_async_writer") is None:
            self._async_writer = AsyncWriter()
        return self._async_writer

    def finish_save(self) -> None:
        """Wait for the background checkpoint (if any) and publish it (collective); a failed write
        on any rank raises :class:`CheckpointError` here. The loop calls it after the first
        iteration whose packed agreement (:mod:`.agree`, slot +6) says no rank is still writing,
        so a checkpoint is published within an iteration of its last file being written, not at
        the next save (Megatron-LM's ``train`` calls ``maybe_finalize_async_save(blocking=False)``
        every iteration, megatron/training/training.py @d98e8a64, its "not done" flags all-reduced
        in megatron/core/dist_checkpointing/strategies/async_utils.py)."""
        pending, self.pending_save = self.pending_save, None
        if pending is not None:
            path = pending.finish()
            self.publications.append((pending.iteration, self.iteration))
            print_rank(self.rank, 0, f"saved checkpoint at iteration {pending.iteration:7d} to {path} "
                                      f"({time.time() - pending.started:.2f} s after it started; "
                                      f"published after iteration {self.iteration})")

    def load(self) -> None:
        """Fast path (same layout and same regions): this rank's file as saved, RNG included.
        Otherwise reshard: each parameter's full tensor from the files that hold it, sliced for
        this rank's TP/PP/ZeRO shard; the RNG states are not restored (megazero.checkpoint.api).
        A DCP folder (``--ckpt-format torch_dcp``) and a Megatron-LM torch_dist folder load the
        same way from their full tensors (megazero.checkpoint.dcp, megazero.checkpoint.torch_dist)."""
        ck = self.config.checkpoint
        self.optimizer.wait_params()
        iteration = latest_iteration(ck.load) if ck.load else None
        common = dict(topo=self.topo, stages=self.stages, optimizer=self.optimizer, model_config=self.model_config,
                      load_optim=ck.load_optim, finetune=ck.finetune)
        megatron = iteration is not None and is_megatron_dist(ck.load, iteration)  # before is_dcp: both have .metadata
        if iteration is not None and not megatron and ck.load_optim and not ck.finetune:
            check_optimizer_matches(ck.load, iteration, self.config.flags)  # AdamW state into Muon, or the reverse
        if megatron:
            loaded = load_torch_dist(ck.load, iteration, **common)  # weights only: no optimizer state to match
        elif iteration is not None and is_dcp(ck.load, iteration):
            loaded = load_dcp(ck.load, iteration, **common)
        else:
            loaded = load_run(ck.load, topo=self.topo, stages=self.stages, optimizer=self.optimizer,
                              layout=self.layout_record(), model_config=self.model_config, device=self.device,
                              load_optim=ck.load_optim, load_rng=ck.load_rng, finetune=ck.finetune)
        if loaded is None:
            if ck.exit_on_missing_checkpoint:
                print_rank(self.rank, 0, f">> no checkpoint in --load {ck.load} and --exit-on-missing-checkpoint "
                                          "is set: exiting")
                raise SystemExit(0)
            return
        self.load_path, self.load_bytes = loaded.path, loaded.bytes_read
        if loaded.scheduler is not None:  # None: finetune, or imported weights (tools/convert_checkpoint.py)
            self.scheduler.load_state_dict(loaded.scheduler)
        if loaded.counters is not None:
            self.skipped, self.nans = loaded.counters["skipped"], loaded.counters["nans"]
        self.iteration, self.consumed_samples = loaded.iteration, loaded.consumed_samples
