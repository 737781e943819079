"""Result validation, fault injection and straggler detection on the command line.

Megatron-LM's flags with its names, dests, types, choices and defaults (core_v0.19.0, commit
5be9626: ``megatron/training/config/resilience_config.py`` ``RerunStateMachineConfig`` and
``StragglerDetectionConfig``; ``megatron/training/arguments.py`` ``--no-check-for-nan-in-loss-and-grad``
and ``--check-for-large-grads``), and megazero's one addition, ``--rerun-on-transient-error``
(what to do once a re-run showed a NaN/Inf to be transient; docs/reliability.md says why its
default is ``continue``). What they do is :mod:`megazero.training.rerun`'s and
:mod:`megazero.training.stragglers`'; the checks here refuse, before any process group, a setting
that cannot be honoured, one line each naming the flag.
"""

from __future__ import annotations

import argparse
import warnings

RERUN_MODES = ("disabled", "validate_results", "report_stats")
INJECTION_TYPES = ("correct_result", "transient_error", "persistent_error")
TRANSIENT_ACTIONS = ("continue", "exit", "checkpoint_and_exit")
# Megatron-LM arguments.py (validate_args): fp16 with dynamic loss scaling turns the NaN check off
FP16_WARNING = ("Setting args.check_for_nan_in_loss_and_grad to False since dynamic loss scaling is being used "
                "(an fp16 overflow is the loss scaler's signal: the step is skipped and the scale backs off)")


def add_reliability_flags(p: argparse.ArgumentParser) -> None:
    """Megatron's rerun-engine, NaN/spike/large-gradient and straggler flags (its defaults)."""
    g = p.add_argument_group("result validation (Megatron-LM's rerun engine) and stragglers")
    g.add_argument("--rerun-mode", choices=RERUN_MODES, default="validate_results",
                   help="validate_results: a NaN/Inf, spiky loss or large gradient re-runs the iteration (same data, "
                        "same RNG) to tell a transient fault from a reproducible one; report_stats: re-run every "
                        "iteration and report how much the checked values vary; disabled: check without re-running")
    g.add_argument("--error-injection-rate", type=int, default=0,
                   help="inject an unexpected result once every N result validations (0: never; testing)")
    g.add_argument("--error-injection-type", choices=INJECTION_TYPES, default="transient_error",
                   help="what the re-run of an injected result finds")
    g.add_argument("--no-check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad",
                   action="store_false", help="do not check the loss and the gradients for NaN/Inf (on by default, "
                                              "off with --fp16 and dynamic loss scaling, as in Megatron-LM)")
    g.add_argument("--check-for-spiky-loss", action="store_true",
                   help="a micro-batch loss >= 10x the largest of the first 100 is a spike (not fatal)")
    g.add_argument("--check-for-large-grads", action="store_true",
                   help="a local gradient-bucket norm >= 10x the largest of the first 100 is suspect (not fatal)")
    g.add_argument("--rerun-on-transient-error", choices=TRANSIENT_ACTIONS, default="continue",
                   help="megazero: after a NaN/Inf that its re-run did not reproduce, continue with the re-run's "
                        "result (default), exit 17 saving nothing (Megatron-LM's), or apply the re-run's step, "
                        "save and exit 16 so the job restarts off the suspect node")
    g.add_argument("--log-straggler", action="store_true",
                   help="every --log-interval iterations, the slowest and fastest ranks (forward time, with host)")
    g.add_argument("--straggler-ctrlr-port", type=int, default=65535,
                   help="rank 0 listens here: any connection (curl HOST:PORT) toggles straggler detection")
    g.add_argument("--straggler-minmax-count", type=int, default=1,
                   help="also list this many lowest and highest estimated-throughput ranks")
    g.add_argument("--disable-straggler-on-startup", action="store_true",
                   help="start with straggler detection off (turn it on through --straggler-ctrlr-port)")


def nan_check_on(args) -> bool:
    """Whether the NaN/Inf check runs: on unless ``--no-check-for-nan-in-loss-and-grad``, and off
    with ``--fp16`` under dynamic loss scaling (no ``--loss-scale``), as Megatron-LM's validate_args."""
    return bool(args.check_for_nan_in_loss_and_grad) and not (args.fp16 and args.loss_scale is None)


def derive_reliability(args) -> None:
    """Megatron's one derived value: fp16 with dynamic loss scaling turns the NaN check off (warned)."""
    if args.check_for_nan_in_loss_and_grad and not nan_check_on(args):
        args.check_for_nan_in_loss_and_grad = False
        warnings.warn(FP16_WARNING, stacklevel=3)


def check_reliability(err, args) -> None:
    """The settings that cannot be honoured, one line each (numeric domains: :mod:`.domains`)."""
    checks = nan_check_on(args) or args.check_for_spiky_loss or args.check_for_large_grads
    if args.error_injection_rate and args.rerun_mode != "validate_results":
        err(f"--error-injection-rate {args.error_injection_rate} needs --rerun-mode validate_results (got "
            f"{args.rerun_mode}: Megatron-LM injects only while validating results)")
    elif args.error_injection_rate and not checks:
        err(f"--error-injection-rate {args.error_injection_rate} has no result validation to inject into: the NaN "
            "check is off (--no-check-for-nan-in-loss-and-grad, or --fp16 with dynamic loss scaling); add "
            "--check-for-spiky-loss or --check-for-large-grads, or drop the injection")
    action = args.rerun_on_transient_error
    if action != "continue" and (args.rerun_mode != "validate_results" or not nan_check_on(args)):
        err(f"--rerun-on-transient-error {action} needs --rerun-mode validate_results and the NaN check (only a "
            "re-run of a NaN/Inf tells a transient fault)")
    if action == "checkpoint_and_exit" and not args.save:
        err("--rerun-on-transient-error checkpoint_and_exit needs --save (it saves before exiting 16)")
    if not args.log_straggler:
        given = [f for f, on in (("--disable-straggler-on-startup", args.disable_straggler_on_startup),
                                 ("--straggler-minmax-count", args.straggler_minmax_count != 1)) if on]
        if given:
            warnings.warn(f"{', '.join(given)} without --log-straggler: no effect", stacklevel=5)
