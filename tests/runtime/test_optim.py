"""toolkit/runtime/optim.py: AdamW groups and implementation choice, DeepSpeed's lr schedules."""
import json

import pytest
import torch
from torch import nn

from tests.oracles import deepspeed
from toolkit.errors import UserError
from toolkit.runtime.optim import Schedule, adamw_kernel_applies, build_optimizer, choose_adamw, lr_at, param_groups
from toolkit.specs import OptimizerSpec, SchedulerSpec

WARMUP, TOTAL, BASE_LR = 10, 50, 1e-3


def sched(type_, warmup_type="log", warmup=WARMUP, total=TOTAL, min_lr=1e-5, max_lr=3e-3,
          min_ratio=0.1, cos_min=0.05):
    return SchedulerSpec(type=type_, warmup_num_steps=warmup, warmup_type=warmup_type, warmup_min_lr=min_lr,
                         warmup_max_lr=max_lr, total_num_steps=total, warmup_min_ratio=min_ratio,
                         cos_min_ratio=cos_min)


def adamw_for(spec, device_type, fused_kernel=False):
    """build_optimizer over the AdamW choose_adamw picks (the engine's two steps)."""
    return lambda model: build_optimizer(spec, param_groups(model, spec.weight_decay),
                                         choose_adamw(spec.implementation, device_type, fused_kernel))


def opt_spec(implementation="auto", lr=BASE_LR, weight_decay=0.1):
    return OptimizerSpec(type="adamw", lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=weight_decay,
                         implementation=implementation)


# ---------------------------------------------------------------------------
# Reference: DeepSpeed's schedulers (tests/oracles/deepspeed.py: LRSchedule).

SCHEDULED = [(t, w) for t in ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR") for w in ("log", "linear")]
# start, 0, 1, mid-warmup, last warmup, end of warmup, mid-decay, last, past total
CHOSEN = [-1, 0, 1, WARMUP // 2, WARMUP - 1, WARMUP, (WARMUP + TOTAL) // 2, TOTAL - 1, TOTAL, TOTAL + 7]


@pytest.mark.parametrize("type_,warmup_type", SCHEDULED)
def test_lr_at_equals_deepspeed_at_chosen_iterations(type_, warmup_type):
    spec = sched(type_, warmup_type)
    ref = deepspeed.LRSchedule(spec, BASE_LR)
    for it in CHOSEN:
        ref.last_batch_iteration = it
        assert lr_at(spec, BASE_LR, it) == pytest.approx(ref.get_lr(), rel=1e-12, abs=1e-15), it


@pytest.mark.parametrize("type_,warmup_type", SCHEDULED)
def test_lr_used_by_each_optimizer_step_matches_deepspeed_engine_order(type_, warmup_type):
    # DeepSpeed's engine (_take_model_step): optimizer.step(), then lr_scheduler.step() unless fp16 overflowed.
    spec = sched(type_, warmup_type)
    ref = deepspeed.LRSchedule(spec, BASE_LR)
    p = nn.Parameter(torch.zeros(2, 2))
    opt = torch.optim.AdamW([p], lr=BASE_LR)
    schedule = Schedule(opt, spec, BASE_LR)
    for k in range(TOTAL + 10):
        assert opt.param_groups[0]["lr"] == pytest.approx(ref.get_lr(), rel=1e-12, abs=1e-15), k
        assert schedule.current_lr == opt.param_groups[0]["lr"]
        assert schedule.current_lr == lr_at(spec, BASE_LR, k - 1)  # step k uses iteration k - 1
        schedule.step()
        ref.step()


def test_hand_computed_values():
    linear_decay = sched("WarmupDecayLR", "linear", min_lr=0.0, max_lr=1.0)
    assert lr_at(linear_decay, BASE_LR, 5) == pytest.approx(0.5)          # 5 / 10
    assert lr_at(linear_decay, BASE_LR, 30) == pytest.approx(0.5)         # (50 - 30) / (50 - 10)
    assert lr_at(linear_decay, BASE_LR, 50) == 0.0
    assert lr_at(linear_decay, BASE_LR, 80) == 0.0                        # clamped at 0
    log_warmup = sched("WarmupLR", "log", min_lr=0.0, max_lr=1.0)
    assert lr_at(log_warmup, BASE_LR, 0) == 0.0                           # log(1) = 0
    assert lr_at(log_warmup, BASE_LR, 9) == pytest.approx(1.0)            # log(10) / log(10)
    assert lr_at(log_warmup, BASE_LR, 1000) == 1.0
    cosine = sched("WarmupCosineLR", "linear", min_ratio=0.0, cos_min=0.0)
    assert lr_at(cosine, BASE_LR, -1) == 0.0
    assert lr_at(cosine, BASE_LR, 29) == pytest.approx(0.5 * BASE_LR)     # progress (29 - 10 + 1) / 40
    assert lr_at(sched("WarmupCosineLR", cos_min=0.05), BASE_LR, 500) == pytest.approx(0.05 * BASE_LR)


@pytest.mark.parametrize("warmup", [0, 1])
def test_warmup_shorter_than_two_steps_is_two_as_in_deepspeed(warmup):
    short, two = sched("WarmupLR", "linear", warmup=warmup), sched("WarmupLR", "linear", warmup=2)
    assert [lr_at(short, BASE_LR, i) for i in range(-1, 4)] == [lr_at(two, BASE_LR, i) for i in range(-1, 4)]
    assert lr_at(short, BASE_LR, 1) == pytest.approx(1e-5 + (3e-3 - 1e-5) * 0.5)


def test_constant_keeps_optimizer_lr_for_every_step():
    p = nn.Parameter(torch.zeros(2, 2))
    opt = torch.optim.AdamW([p], lr=BASE_LR)
    schedule = Schedule(opt, sched("constant"), BASE_LR)
    for _ in range(3):
        assert opt.param_groups[0]["lr"] == BASE_LR
        schedule.step()
    assert [lr_at(sched("constant"), 2e-4, i) for i in (-1, 0, 10**6)] == [2e-4] * 3


def test_schedule_writes_every_param_group():
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    opt = build_optimizer(opt_spec("torch"), param_groups(model, 0.1), "torch")
    schedule = Schedule(opt, sched("WarmupCosineLR", "linear"), BASE_LR)
    for _ in range(4):
        schedule.step()
    assert [g["lr"] for g in opt.param_groups] == [lr_at(schedule.spec, BASE_LR, 3)] * 2


@pytest.mark.parametrize("type_,warmup_type", SCHEDULED)
def test_state_dict_round_trip_gives_the_same_following_lrs(type_, warmup_type):
    spec = sched(type_, warmup_type)
    first = Schedule(torch.optim.AdamW([nn.Parameter(torch.zeros(2))], lr=BASE_LR), spec, BASE_LR)
    for _ in range(WARMUP + 3):
        first.step()
    state = json.loads(json.dumps(first.state_dict()))  # plain ints survive a JSON checkpoint
    assert state == {"last_batch_iteration": WARMUP + 2}
    opt = torch.optim.AdamW([nn.Parameter(torch.zeros(2))], lr=BASE_LR)
    resumed = Schedule(opt, spec, BASE_LR)
    resumed.load_state_dict(state)
    assert opt.param_groups[0]["lr"] == first.current_lr
    following = []
    for _ in range(TOTAL):
        first.step()
        resumed.step()
        following.append((first.current_lr, resumed.current_lr, opt.param_groups[0]["lr"]))
    assert all(a == b == c for a, b, c in following)


# ---------------------------------------------------------------------------
# Defaults: a recipe that names only the scheduler's type gets DeepSpeed 0.19's constructor defaults
# (deepspeed/runtime/lr_schedules.py, identical in v0.19.0-v0.19.5 for these; engine.py builds the scheduler as
# `getattr(lr_schedules, type)(optimizer, **params)`, so these are a DeepSpeed config's defaults too):
#   WarmupLR(optimizer, warmup_min_lr=0.0, warmup_max_lr=None -> each group's lr, warmup_num_steps=1000,
#            warmup_type='log')
#   WarmupDecayLR(optimizer, total_num_steps, warmup_min_lr=0.0, warmup_max_lr=0.001, warmup_num_steps=1000,
#                 warmup_type='log')
#   WarmupCosineLR(optimizer, total_num_steps, warmup_min_ratio=0.0, warmup_num_steps=1000, cos_min_ratio=0.0001,
#                  warmup_type='log')
# total_num_steps has no default in DeepSpeed; the toolkit's is the run's length.

USER_LR, RUN_STEPS = 3e-4, 1500
DEEPSPEED_DEFAULTS = [
    *[(t, key, value) for t in ("WarmupLR", "WarmupDecayLR")
      for key, value in (("warmup_min_lr", 0.0), ("warmup_num_steps", 1000), ("warmup_type", "log"))],
    ("WarmupLR", "warmup_max_lr", USER_LR),        # None -> the optimizer's lr
    ("WarmupDecayLR", "warmup_max_lr", 0.001),     # 0.001, whatever the optimizer's lr
    *[("WarmupCosineLR", key, value) for key, value in (("warmup_min_ratio", 0.0), ("cos_min_ratio", 0.0001),
                                                         ("warmup_num_steps", 1000), ("warmup_type", "log"))],
    *[(t, "total_num_steps", RUN_STEPS) for t in ("WarmupDecayLR", "WarmupCosineLR")],
]


def scheduler_of(type_: str, **given):
    from toolkit.recipe.load import recipe_from_dict

    return recipe_from_dict({"model": {"size": "tiny"}, "data": {"num_samples": 64}, "batch": {"micro_batch_per_rank": 2},
                             "optimizer": {"lr": USER_LR}, "scheduler": {"type": type_, **given},
                             "training": {"max_steps": RUN_STEPS}})


@pytest.mark.parametrize("type_,key,expected", DEEPSPEED_DEFAULTS, ids=lambda v: str(v))
def test_scheduler_default_is_deepspeeds(type_, key, expected):
    assert getattr(scheduler_of(type_).scheduler, key) == expected


def test_warmup_lr_without_max_lr_warms_up_to_the_optimizers_lr():
    spec = scheduler_of("WarmupLR", warmup_num_steps=10).scheduler
    assert lr_at(spec, USER_LR, 9) == pytest.approx(USER_LR)
    assert lr_at(spec, USER_LR, 500) == USER_LR
    given = scheduler_of("WarmupLR", warmup_num_steps=10, warmup_max_lr=2e-3).scheduler
    assert lr_at(given, USER_LR, 500) == 2e-3  # given: it wins


def test_warmup_decay_lr_without_max_lr_warns_that_it_is_not_the_optimizers_lr():
    recipe = scheduler_of("WarmupDecayLR")
    assert recipe.warnings == ("recipe.scheduler.warmup_max_lr: not given, so WarmupDecayLR warms up to 0.001 "
                               "(DeepSpeed's default), not optimizer.lr 0.0003; set it",)
    assert scheduler_of("WarmupDecayLR", warmup_max_lr=USER_LR).warnings == ()


# ---------------------------------------------------------------------------
# Parameter groups on real transformers models

def names_by_group(model, weight_decay=0.1):
    name_of = {id(p): n for n, p in model.named_parameters()}
    groups = param_groups(model, weight_decay)
    assert [g["weight_decay"] for g in groups] == [weight_decay, 0.0]
    return [sorted(name_of[id(p)] for p in g["params"]) for g in groups]


def test_gpt2_decays_matrices_only_and_counts_tied_embedding_once():
    from transformers import GPT2Config, GPT2LMHeadModel
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16))
    assert model.lm_head.weight is model.transformer.wte.weight
    decay, no_decay = names_by_group(model)
    assert decay == sorted(["transformer.wte.weight", "transformer.wpe.weight",
                            "transformer.h.0.attn.c_attn.weight", "transformer.h.0.attn.c_proj.weight",
                            "transformer.h.0.mlp.c_fc.weight", "transformer.h.0.mlp.c_proj.weight"])
    assert no_decay == sorted(["transformer.h.0.ln_1.weight", "transformer.h.0.ln_1.bias",
                               "transformer.h.0.ln_2.weight", "transformer.h.0.ln_2.bias",
                               "transformer.ln_f.weight", "transformer.ln_f.bias",
                               "transformer.h.0.attn.c_attn.bias", "transformer.h.0.attn.c_proj.bias",
                               "transformer.h.0.mlp.c_fc.bias", "transformer.h.0.mlp.c_proj.bias"])
    n_unique = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    groups = param_groups(model, 0.1)
    assert sum(p.numel() for g in groups for p in g["params"]) == n_unique


def test_llama_rmsnorm_weights_are_not_decayed():
    from transformers import LlamaConfig, LlamaForCausalLM
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16))
    assert type(model.model.norm).__name__ == "LlamaRMSNorm"
    decay, no_decay = names_by_group(model)
    assert no_decay == sorted(["model.layers.0.input_layernorm.weight",
                               "model.layers.0.post_attention_layernorm.weight", "model.norm.weight"])
    assert "model.embed_tokens.weight" in decay and "lm_head.weight" in decay
    assert all(n.endswith("_proj.weight") for n in decay if n.startswith("model.layers."))
    assert len(decay) + len(no_decay) == len(list(model.named_parameters()))


def test_frozen_parameters_stay_out_of_the_groups():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    model[0].requires_grad_(False)
    decay, no_decay = names_by_group(model)
    assert decay == ["1.weight"] and no_decay == ["1.bias"]


# ---------------------------------------------------------------------------
# AdamW implementation

@pytest.mark.parametrize("implementation", ["auto", "torch"])
def test_cpu_builds_torch_adamw_with_recipe_hyperparameters(implementation):
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    opt = adamw_for(opt_spec(implementation), "cpu")(model)
    assert type(opt) is torch.optim.AdamW
    assert not opt.defaults["fused"]
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert all(g["lr"] == BASE_LR and g["betas"] == (0.9, 0.95) and g["eps"] == 1e-8 for g in opt.param_groups)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()


def test_fused_on_cpu_is_a_user_error():
    with pytest.raises(UserError) as err:
        adamw_for(opt_spec("fused"), "cpu")(nn.Linear(2, 2))
    assert err.value.lines == ["recipe.optimizer.implementation: 'fused' needs a CUDA device; use 'auto' or 'torch'"]


def test_choice_of_adamw_per_implementation_and_device():
    assert choose_adamw("auto", "cuda", fused_kernel=False) == "torch-fused"
    assert choose_adamw("fused", "cuda", fused_kernel=False) == "torch-fused"
    assert choose_adamw("torch", "cuda", fused_kernel=False) == "torch"
    assert choose_adamw("auto", "cpu", fused_kernel=False) == "torch"
    assert choose_adamw("torch", "cpu", fused_kernel=False) == "torch"


def test_the_toolkit_kernel_is_chosen_only_when_the_run_loaded_it_for_stage_0():
    assert choose_adamw("auto", "cuda", fused_kernel=True) == "toolkit-fused"
    assert choose_adamw("fused", "cuda", fused_kernel=True) == "toolkit-fused"
    assert choose_adamw("torch", "cuda", fused_kernel=True) == "torch"  # implementation torch wins over the kernel
    assert choose_adamw("torch_fused", "cuda", fused_kernel=True) == "torch-fused"  # never the toolkit's kernel
    assert choose_adamw("torch_fused", "cpu", fused_kernel=False) == "torch"
    assert [adamw_kernel_applies(impl, 0) for impl in ("auto", "fused", "torch_fused", "torch")] == [True, True, False,
                                                                                                   False]
    assert not any(adamw_kernel_applies(impl, stage) for impl in ("auto", "fused") for stage in (1, 2, 3))
    assert not adamw_kernel_applies("auto", 0, mesh=True)
    assert type(build_optimizer(opt_spec(), param_groups(nn.Linear(2, 2), 0.1), "toolkit-fused")).__name__ == "FusedAdamW"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("implementation", ["auto", "fused"])
def test_cuda_builds_a_fused_adamw_that_steps(implementation):
    from toolkit.ops import loader
    from toolkit.ops.fused_adamw import FusedAdamW

    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)).cuda()
    fused_kernel = loader.load_extension("adamw") is not None
    opt = adamw_for(opt_spec(implementation), "cuda", fused_kernel)(model)
    # NOTE: the toolkit's kernel where it is built and loaded, else torch's fused AdamW (choose_adamw).
    if fused_kernel:
        assert isinstance(opt, FusedAdamW)
    else:
        assert opt.defaults["fused"] is True
    before = model[0].weight.detach().clone()
    model(torch.randn(3, 4, device="cuda")).sum().backward()
    opt.step()
    assert not torch.equal(before, model[0].weight)
