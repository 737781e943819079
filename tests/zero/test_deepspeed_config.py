"""DeepSpeed configs as DeepSpeed reads them (megazero.config.deepspeed_config): real-shaped configs
checked against values worked out by hand from DeepSpeed 0.19.8's formulas (batch arithmetic,
optimizer defaults, LR curves, loss-scaler defaults) and the errors' text; the seed-style stage-3
config trains like torch.optim.AdamW; Adam's L2 mode equals torch.optim.Adam."""

import json
import math

import pytest
import torch

from megazero import planner
from megazero.arguments import parse_args
from megazero.config.optimizer import OptimizerConfig
from megazero.model.config import GPTConfig
from megazero.parallel.topology import Topology
from megazero.config.model import gpt_config
from megazero.config.run_config import lr_config
from megazero.optim.lr_schedule import DeepSpeedLRScheduler, build_lr_scheduler
from megazero.zero import DynamicLossScaler, ZeroOptimizer, find_units
from megazero.optim.adamw import adamw_step
from megazero.zero.regions import buckets as _buckets

from .common import Net, batches, launch, max_rel, reference

SEED = {"zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True, "sub_group_size": 1e9,
                              "reduce_bucket_size": 1, "stage3_prefetch_bucket_size": 1,
                              "stage3_param_persistence_threshold": 1, "stage3_max_live_parameters": 1e9,
                              "stage3_max_reuse_distance": 1e9}}


def _train(rank, world, args, data):
    topo = Topology(world, rank).create_groups()
    model = Net()
    opt = ZeroOptimizer([model], topo, **OptimizerConfig.from_args(args).kwargs())
    for step in data:
        for x, y in step[topo.dp_rank]:
            model(x, y).backward(opt.loss_scale / args.num_micro_batches)
        opt.finish_grad_sync()
        assert opt.step()[0]
    with opt.gathered_params():
        params = [p.detach().clone() for p in model.parameters()]
    # checkpoint round trip: state_dict() gathers, load_state_dict() re-reads the master shards
    sd = model.state_dict()
    assert all(torch.equal(a, b) for a, b in zip(sd.values(), params))
    model2 = Net(seed=5)
    opt2 = ZeroOptimizer([model2], topo, **OptimizerConfig.from_args(args).kwargs())
    model2.load_state_dict(sd)
    assert all(torch.equal(a["master"], b["master"]) for a, b in zip(opt.state_dict()["shards"],
                                                                      opt2.state_dict()["shards"]))
    return params, opt.last_comm, len(opt.regions)


def test_seed_deepspeed_config_trains(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(SEED))
    M = 2
    with pytest.warns(UserWarning, match="sub_group_size"):
        args = parse_args(["--deepspeed-config", str(path), "--micro-batch-size", "2", "--global-batch-size",
                           str(2 * M), "--lr", "1e-2", "--num-layers", "2", "--hidden-size", "16",
                           "--num-attention-heads", "2", "--seq-length", "8", "--adam-beta2", "0.95",
                           "--weight-decay", "0.1", "--clip-grad", "1.0"])
    assert (args.zero_stage, args.zero_reduce_bucket_size, args.zero_prefetch_bucket_size) == (3, 1, 1)
    data = batches(5, 2, M)
    results = launch(_train, 2, args, data)
    ref = reference(data, clip=1.0)
    for params, comm, nregions in results:
        assert max_rel(params, ref) <= 1e-5
        assert nregions == 4  # 3 blocks + the root unit (input, norm, head); nothing persistent (threshold 1)
        # reuse distance 1e9 keeps every unit gathered once fetched (one forward gather per step,
        # none in backward) while gradients are still reduce-scattered every micro-batch: (1 + M)Φ
        assert comm["dp_logical_multiple"] == pytest.approx(1 + M)


def test_loss_scaler_megatron_semantics():
    s = DynamicLossScaler(initial_scale=8.0, min_scale=2.0, window=3, hysteresis=2)
    s.update(True)
    assert s.scale == 8.0  # hysteresis absorbs the first overflow
    s.update(True)
    assert s.scale == 4.0
    s.update(True)
    assert s.scale == 2.0  # tracker not reset until growth: backs off at once
    s.update(True)
    assert s.scale == 2.0  # min scale
    for _ in range(3):
        s.update(False)
    assert s.scale == 4.0 and s.hysteresis_tracker == 2


def test_units_and_buckets():
    net = Net(layers=2)
    units = find_units(net)
    assert [m for m, _ in units] == [net.layers[0], net.layers[1], net]
    assert sum(len(ps) for _, ps in units) == len(list(net.parameters()))
    ps = [torch.nn.Parameter(torch.zeros(n)) for n in (5, 5, 5, 20, 1)]
    assert [len(b) for b in _buckets(ps, 10)] == [2, 1, 1, 1]  # closed before overflowing (DeepSpeed)
    assert [len(b) for b in _buckets(ps, 1)] == [1, 1, 1, 1, 1]
    assert [len(b) for b in _buckets(ps, 100)] == [5]


# ---- parsing real-shaped configs ------------------------------------------------------------
SHAPE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32"]


def write(tmp_path, obj, name="ds.json"):
    p = tmp_path / name
    p.write_text(obj if isinstance(obj, str) else json.dumps(obj))
    return str(p)


def parse(tmp_path, config, extra=(), world_size=8, name="ds.json"):
    return parse_args(["--deepspeed-config", write(tmp_path, config, name), *SHAPE, *extra], world_size=world_size,
                      prog="pretrain_gpt.py")


def fails(capsys, tmp_path, config, extra, *needles, world_size=8):
    with pytest.raises(SystemExit) as exc:
        parse(tmp_path, config, extra, world_size)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("pretrain_gpt.py: error:"), err
    for needle in needles:
        assert needle in err, (needle, err)
    return err


FULL = {  # a Megatron-DeepSpeed-style training config
    "train_batch_size": 64, "train_micro_batch_size_per_gpu": 4, "steps_per_print": 10,
    "optimizer": {"type": "AdamW", "params": {"lr": 6e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 6e-5, "warmup_max_lr": 6e-4,
                                                      "warmup_num_steps": 100, "total_num_steps": 1000}},
    "gradient_clipping": 1.0, "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 12,
                                       "loss_scale_window": 500},
    "zero_optimization": {"stage": 2, "contiguous_gradients": True, "reduce_bucket_size": 2e8},
    "wall_clock_breakdown": False, "my_note": "x",
}


def test_full_config_batch_optimizer_schedule_and_scaler(tmp_path, capsys):
    with pytest.warns(UserWarning) as rec:
        a = parse(tmp_path, FULL, ["--tensor-model-parallel-size", "2"])  # 8 ranks / TP 2: DP 4
    # GAS = 64 // 4 // 4 = 4 (DeepSpeed derives the missing one); M = GAS
    assert (a.micro_batch_size, a.global_batch_size, a.num_micro_batches) == (4, 64, 4)
    assert (a.lr, a.adam_beta1, a.adam_beta2, a.adam_eps, a.weight_decay) == (6e-4, 0.9, 0.95, 1e-8, 0.1)
    assert a.adam_w_mode is True and a.clip_grad == 1.0 and a.fp16
    # a dynamic key is present: DeepSpeed's config defaults fill the rest (hysteresis 2, min 1)
    assert (a.initial_loss_scale, a.loss_scale, a.loss_scale_window, a.hysteresis, a.min_loss_scale) == \
        (2.0 ** 12, None, 500, 2, 1.0)
    assert (a.zero_stage, a.zero_reduce_bucket_size, a.zero_overlap_comm) == (2, 200_000_000, False)
    s = build_lr_scheduler(lr_config(a))
    lo, hi = 6e-5, 6e-4  # WarmupDecayLR, log warm-up over W = 100, linear decay to T = 1000
    curve = {0: lo, 1: lo, 11: lo + (hi - lo) * math.log(11) / math.log(100), 100: hi,
             551: lo + (hi - lo) * 450 / 900, 1001: lo}
    assert {n: s.get_lr(n) for n in curve} == pytest.approx(curve)
    line = capsys.readouterr().out.strip()
    assert len(line.splitlines()) == 1 and "config: optimizer.type='AdamW'" in line
    assert "DeepSpeed default: adam_w_mode (effective)=True" in line and "fp16.hysteresis=2" in line
    # the config's key report (fp16 with dynamic scaling also warns that the NaN check is off, as Megatron)
    assert [str(w.message).split(" -- ")[1] for w in rec if " -- " in str(w.message)] == [
        "harmless: steps_per_print, wall_clock_breakdown; no effect: zero_optimization.contiguous_gradients; "
        "unknown, not read: my_note"]


HF = {  # Hugging Face Trainer style
    "fp16": {"enabled": "auto", "loss_scale": 0, "initial_scale_power": 16, "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                 "warmup_num_steps": "auto"}},
    "zero_optimization": {"stage": 2, "allgather_partitions": True, "allgather_bucket_size": 2e8,
                          "overlap_comm": True, "reduce_scatter": True, "reduce_bucket_size": "auto",
                          "contiguous_gradients": True},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
}


def test_hf_auto_config_resolves_from_flags(tmp_path, capsys):
    flags = ["--micro-batch-size", "2", "--global-batch-size", "16", "--lr", "1e-4", "--adam-beta2", "0.98",
             "--weight-decay", "0.05", "--lr-warmup-iters", "10", "--bf16"]
    with pytest.warns(UserWarning, match="allgather_bucket_size"):
        a = parse(tmp_path, HF, flags, world_size=2)
    assert (a.micro_batch_size, a.global_batch_size, a.num_micro_batches) == (2, 16, 4)  # 16 = 2 * 4 * 2
    assert (a.lr, a.adam_beta1, a.adam_beta2, a.adam_eps, a.weight_decay) == (1e-4, 0.9, 0.98, 1e-8, 0.05)
    assert a.bf16 and not a.fp16 and a.clip_grad == 1.0 and a.zero_reduce_bucket_size == 500_000_000
    assert a.deepspeed_scheduler == {"type": "WarmupLR", "warmup_min_lr": 0.0, "warmup_max_lr": 1e-4,
                                     "warmup_num_steps": 10, "warmup_type": "log"}
    assert build_lr_scheduler(lr_config(a)).get_lr(6) == pytest.approx(1e-4 * math.log(6) / math.log(10))
    assert "auto: " in capsys.readouterr().out
    err = fails(capsys, tmp_path, HF, [], '"auto" values', "train_batch_size (--global-batch-size)",
                "train_micro_batch_size_per_gpu (--micro-batch-size)", "optimizer.params.lr (--lr)",
                "scheduler.params.warmup_max_lr (--lr)")
    assert "gradient_clipping" not in err  # --clip-grad has a value (its default)


def test_seed_stage3_config_defaults(tmp_path, capsys):
    with pytest.warns(UserWarning, match="no effect: zero_optimization.contiguous_gradients, "
                                         "zero_optimization.sub_group_size"):
        a = parse(tmp_path, SEED, ["--micro-batch-size", "2", "--lr", "1e-3", "--fp16", "--train-iters", "10"])
    assert a.zero_stage == 3 and a.zero_overlap_comm and a.zero_reduce_bucket_size == 1
    assert (a.zero_prefetch_bucket_size, a.zero_param_persistence_threshold) == (1, 1)
    assert a.zero_max_live_parameters == 10 ** 9 and isinstance(a.zero_max_live_parameters, int)
    assert a.zero_max_reuse_distance == 10 ** 9
    # train_batch_size absent, GAS absent: DeepSpeed sets GAS 1 and train = micro * DP = 16
    assert (a.global_batch_size, a.num_micro_batches) == (16, 1)
    # DeepSpeed defaults, not Megatron's: no clipping; fp16 with no scaler key at ZeRO 1-3 is
    # DynamicLossScaler(): 2**32, window 1000, min 1, no hysteresis
    assert a.clip_grad == 0.0 and (a.initial_loss_scale, a.hysteresis, a.loss_scale_window) == (2.0 ** 32, 1, 1000)
    assert a.deepspeed_scheduler is None and build_lr_scheduler(lr_config(a)).get_lr(0) == 1e-3  # Megatron's schedule
    a = parse(tmp_path, {"fp16": {"enabled": True}}, ["--micro-batch-size", "2", "--lr", "1e-3"])
    assert (a.initial_loss_scale, a.hysteresis, a.zero_overlap_comm) == (2.0 ** 16, 1, False)  # stage 0


def test_explicit_flags_win_and_precision(tmp_path):  # moved from tests/test_arguments.py
    a = parse(tmp_path, {"zero_optimization": {"stage": 2, "reduce_bucket_size": 5e8}, "bf16": {"enabled": True},
                         "gradient_clipping": 0.5, "train_micro_batch_size_per_gpu": 2},
              ["--zero-stage", "1", "--zero-reduce-bucket-size=1e6", "--lr", "1"])
    assert a.zero_stage == 1 and a.zero_reduce_bucket_size == 10 ** 6
    assert a.bf16 and a.params_dtype == torch.bfloat16 and a.clip_grad == 0.5
    a = parse(tmp_path, {"fp16": {"enabled": True, "initial_scale_power": 16, "loss_scale": 0},
                         "train_micro_batch_size_per_gpu": 2}, ["--lr", "1"], name="f.json")
    assert a.fp16 and a.initial_loss_scale == 2.0 ** 16 and a.loss_scale is None


def test_batch_arithmetic_as_deepspeed(tmp_path, capsys):
    bad = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4}
    fails(capsys, tmp_path, bad, ["--lr", "1"], "train_batch_size is not equal to micro_batch_per_gpu * "
          "gradient_acc_step * world_size 16 != 2 * 4 * 1", world_size=1)
    a = parse(tmp_path, {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4}, ["--lr", "1"], 2)
    assert (a.global_batch_size, a.num_micro_batches) == (16, 4)  # train = 2 * 4 * 2
    a = parse(tmp_path, {"train_batch_size": 32, "gradient_accumulation_steps": 2}, ["--lr", "1"], 4)
    assert (a.micro_batch_size, a.num_micro_batches) == (4, 2)  # micro = 32 // 4 // 2
    a = parse(tmp_path, {**bad, "train_batch_size": "auto"}, ["--lr", "1", "--global-batch-size", "64"], 8)
    assert (a.global_batch_size, a.num_micro_batches) == (64, 4)  # 64 = 2 * 4 * 8
    fails(capsys, tmp_path, bad, ["--lr", "1", "--global-batch-size", "64"], "key 'train_batch_size' = 16 disagrees "
          "with --global-batch-size 64", "_batch_assertion")  # DeepSpeed would train with 16
    fails(capsys, tmp_path, {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 3}, ["--lr", "1"],
          "16 != 3 * 5 * 1", world_size=1)  # GAS = 16 // 3 // 1 = 5
    fails(capsys, tmp_path, {"gradient_accumulation_steps": 2}, ["--lr", "1"],
          "either train_batch_size or train_micro_batch_size_per_gpu needs to be provided")


def test_offload_is_refused_with_the_planners_figure(tmp_path, capsys):
    shape = ["--num-layers", "24", "--hidden-size", "2048", "--num-attention-heads", "16", "--seq-length", "2048",
             "--vocab-size", "50257", "--micro-batch-size", "4", "--lr", "1e-4"]
    cfg = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}
    with pytest.raises(SystemExit):
        parse_args(["--deepspeed", "--deepspeed_config", write(tmp_path, cfg), *shape], world_size=4)
    err = capsys.readouterr().err
    cfg["zero_optimization"]["offload_optimizer"]["device"] = "none"  # accepted: nothing moves
    a = parse_args(["--deepspeed_config", write(tmp_path, cfg), *shape], world_size=4)
    assert a.zero_stage == 3 and a.num_micro_batches == 1
    est = planner.estimate(gpt_config(a), 1, 1, 4, 3, micro_batch_size=4, micro_batches=1, param_bytes=2,
                           grad_bytes=4, attention_scores=False)  # bf16 params, fp32 grads, flash attention
    assert "zero_optimization.offload_optimizer (device cpu): optimizer offload is not available" in err
    assert f"ZeRO stage 3 at DP 4 (TP 1, PP 1) needs {est.total_bytes / 2 ** 30:.2f} GiB per rank" in err
    assert "python -m megazero.planner" in err and est.total_bytes > 2 ** 30


def test_optimizer_modes_and_defaults(tmp_path):
    def opt(typ, **params):
        return parse(tmp_path, {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": typ, "params": params}})
    assert opt("Adam").adam_w_mode is True  # DeepSpeed: Adam means AdamW unless adam_w_mode is false
    assert opt("Adam", adam_w_mode=False).adam_w_mode is False
    assert opt("AdamW", adam_w_mode=False).adam_w_mode is True  # type AdamW forces it
    a = opt("adamw")  # FusedAdam's defaults
    assert (a.lr, a.adam_beta1, a.adam_beta2, a.adam_eps, a.weight_decay) == (1e-3, 0.9, 0.999, 1e-8, 0.0)
    assert opt("AdamW", torch_adam=True).weight_decay == 0.01  # torch.optim.AdamW's default
    assert opt("Adam", torch_adam=True, adam_w_mode=False).weight_decay == 0.0
    a = parse(tmp_path, {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Adam", "params": {"lr": 1.0}},
                         "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 50}}},
              ["--lr", "0.5", "--lr-warmup-iters", "10"])
    assert a.deepspeed_scheduler["base_lr"] == 0.5 and a.deepspeed_scheduler["warmup_num_steps"] == 10
    a = parse(tmp_path, {"train_micro_batch_size_per_gpu": 1, "scheduler": {"type": "WarmupLR"}},
              ["--lr", "0.5", "--lr-decay-style", "cosine", "--train-iters", "9"])
    assert a.deepspeed_scheduler is None  # an explicit --lr-decay-style replaces the block


def test_errors_name_the_key(tmp_path, capsys):
    mb = {"train_micro_batch_size_per_gpu": 1}
    cases = [
        ({}, [], "--lr is required", "no optimizer block"),
        ({"optimizer": {"type": "Lamb"}}, [], "optimizer.type 'Lamb' is not available"),
        ({"optimizer": {"type": "Adam", "params": {"max_grad_norm": 1.0}}}, [], "'gradient_clipping'"),
        ({"optimizer": {"type": "Adam", "params": {"amsgrad": True}}}, [], "optimizer.params.amsgrad"),
        ({"scheduler": {"type": "OneCycle"}}, ["--lr", "1"], "scheduler.type 'OneCycle' is not available"),
        ({"scheduler": {"type": "WarmupDecayLR"}}, ["--lr", "1"], "WarmupDecayLR needs scheduler.params.total_num_steps"),
        ({"scheduler": {"type": "WarmupLR", "params": {"warmup_type": "cos"}}}, ["--lr", "1"], "warmup_type"),
        ({"scheduler": {"type": "WarmupLR"}}, [], "WarmupLR without scheduler.params.warmup_max_lr takes the "
         "optimizer's lr"),
        ({"scheduler": {"type": "WarmupLR", "params": {"total_num_steps": 5}}}, [], "not a parameter of WarmupLR"),
        ({"prescale_gradients": True}, ["--lr", "1"], "'prescale_gradients' = true changes training"),
        ({"zero_optimization": {"stage3_prefetch": 1}}, ["--lr", "1"], "zero_optimization.stage3_prefetch"),
        ({"zero_optimization": {"stage": "three"}}, ["--lr", "1"], "zero_optimization.stage", "'three'"),
        ({"zero_optimization": {"overlap_comm": 1}}, ["--lr", "1"], "zero_optimization.overlap_comm"),
        ({"zero_optimization": {"reduce_bucket_size": 1.5}}, ["--lr", "1"], "reduce_bucket_size", "integer"),
        ({"zero_optimization": {"stage": 7}}, ["--lr", "1"], "--zero-stage", "7"),
    ]
    for cfg, extra, *needles in cases:
        fails(capsys, tmp_path, {**mb, **cfg}, extra, *needles)
    fails(capsys, tmp_path, '{"fp16": {}, "fp16": {}}', [], "duplicate keys: fp16")
    fails(capsys, tmp_path, "{not json", [], "not valid JSON")
    with pytest.raises(SystemExit):
        parse_args(["--deepspeed-config", str(tmp_path / "missing.json")], prog="p")
    err = capsys.readouterr().err
    assert "missing.json" in err and "file not found" in err


def test_adam_l2_mode_equals_torch_adam():
    torch.manual_seed(0)
    p0, grads = torch.randn(4, 3), [torch.randn(4, 3) for _ in range(4)]
    hyper = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for decoupled, cls in ((False, torch.optim.Adam), (True, torch.optim.AdamW)):
        ref = p0.clone().requires_grad_()
        opt = cls([ref], **hyper)
        flat, m, v = p0.clone().reshape(-1), torch.zeros(12), torch.zeros(12)
        for t, g in enumerate(grads, 1):
            ref.grad = g.clone()
            opt.step()
            gf = g.clone().reshape(-1)
            adamw_step([flat], [gf], [m], [v], [flat[:]], step=t, **hyper, decoupled=decoupled, decay_grads=[gf[:]])
        assert torch.allclose(flat.view(4, 3), ref.detach(), rtol=1e-6, atol=1e-7), cls
