"""DeepSpeed's rules, transcribed (deepspeedai/DeepSpeed), for the tests that check the toolkit does
what a DeepSpeed user expects. Each keeps DeepSpeed's arithmetic as written there; only logging and
the code paths the toolkit does not offer are left out.

- DynamicLossScaler: DynamicLossScaler.update_scale in deepspeed/runtime/fp16/loss_scaler.py
  (commit 18fd4c97), copied line for line minus logging, with raise_error_at_min_scale=False.
  Used by tests/runtime/test_precision.py and tests/runtime/test_mixed_precision.py.
- LRSchedule: WarmupLR._get_gamma / get_lr, WarmupDecayLR._get_gamma and WarmupCosineLR.get_lr_ratio /
  get_lr in deepspeed/runtime/lr_schedules.py (master, commit 22779f2c6e335b494c90c05917206d3b14510d2d),
  re-expressed as one class chosen by the spec's type. Used by tests/runtime/test_optim.py.
- OneCycle, LRRangeTest: their get_lr / get_mom / constructors in deepspeed/runtime/lr_schedules.py
  (microsoft/DeepSpeed commit 38327e07), one parameter group, copied minus logging. Used by
  tests/runtime/test_optim_deepspeed_extras.py.

Not here: the ZeRO memory figures, which the tests take from the ZeRO paper (Rajbhandari et al.) as
expected values (tests/observe/test_estimate.py), and the scheduler defaults table of
tests/runtime/test_optim.py (expected values, next to the test that reads them).
"""
import math


class DynamicLossScaler:
    """DynamicLossScaler.update_scale from deepspeed/runtime/fp16/loss_scaler.py (deepspeedai/DeepSpeed,
    commit 18fd4c97), copied line for line minus logging, with raise_error_at_min_scale=False."""

    def __init__(self, init_scale, scale_window, min_scale, delayed_shift, consecutive_hysteresis):
        self.cur_scale = init_scale
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.scale_factor = 2.0
        self.scale_window = scale_window
        self.min_scale = min_scale
        self.delayed_shift = delayed_shift
        self.cur_hysteresis = delayed_shift
        self.consecutive_hysteresis = consecutive_hysteresis

    def update_scale(self, overflow):
        """The next scale and hysteresis credit after a step that did or did not overflow."""
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                self.cur_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            stable_interval = (self.cur_iter - self.last_overflow_iter) - 1
            if (stable_interval > 0) and (stable_interval % self.scale_window == 0):
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= self.scale_factor
        self.cur_iter += 1


class LRSchedule:
    """WarmupLR, WarmupDecayLR and WarmupCosineLR from deepspeed/runtime/lr_schedules.py (commit 22779f2c),
    picked by spec.type. Each constructor clamps warmup_num_steps to >= 2, sets
    inverse_log_warm_up = 1 / log(warmup_num_steps), and with last_batch_iteration == -1 writes get_lr()
    into the optimizer (the "not started" value)."""

    def __init__(self, spec, org_lr):
        self.s, self.org_lr, self.last_batch_iteration = spec, org_lr, -1
        self.warmup_num_steps = max(2, spec.warmup_num_steps)
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)

    def _warmup_gamma(self):
        it = self.last_batch_iteration
        if self.s.warmup_type == "log":
            return self.inverse_log_warm_up * math.log(it + 1)
        return it / self.warmup_num_steps

    def get_lr(self):
        """The learning rate at last_batch_iteration."""
        it, s = self.last_batch_iteration, self.s
        if s.type == "WarmupCosineLR":
            if it < 0:
                return 0.0
            if it < self.warmup_num_steps:
                return self.org_lr * (s.warmup_min_ratio + self._warmup_gamma() * (1.0 - s.warmup_min_ratio))
            real_last_step = it - self.warmup_num_steps + 1
            real_total_steps = max(1, s.total_num_steps - self.warmup_num_steps)
            cosine_progress = min(1.0, real_last_step / real_total_steps)
            ratio = (1 + math.cos(math.pi * cosine_progress)) / 2
            return self.org_lr * max(0.0, s.cos_min_ratio + (1.0 - s.cos_min_ratio) * ratio)
        if it < 0:
            return s.warmup_min_lr
        if it < self.warmup_num_steps:
            gamma = self._warmup_gamma()
        elif s.type == "WarmupLR":
            gamma = 1.0
        else:
            gamma = max(0.0, float(s.total_num_steps - it) / float(max(1.0, s.total_num_steps - self.warmup_num_steps)))
        return s.warmup_min_lr + (s.warmup_max_lr - s.warmup_min_lr) * gamma

    def step(self):
        """One scheduler step, as DeepSpeed's engine takes after each optimizer step."""
        self.last_batch_iteration += 1


class LRRangeTest:
    """LRRangeTest from deepspeed/runtime/lr_schedules.py (commit 38327e07), one param group."""

    def __init__(self, lr_range_test_min_lr=1e-3, lr_range_test_step_size=2000, lr_range_test_step_rate=1.0,
                 lr_range_test_staircase=False):
        self.min_lr, self.step_size, self.step_rate = lr_range_test_min_lr, lr_range_test_step_size, lr_range_test_step_rate
        self.staircase, self.last_batch_iteration = lr_range_test_staircase, -1
        self.lr = self.min_lr  # the constructor writes min_lr at last_batch_iteration == -1

    def get_lr(self):
        """The learning rate at last_batch_iteration."""
        if self.staircase:
            interval = math.floor(float(self.last_batch_iteration + 1) / self.step_size)
        else:
            interval = float(self.last_batch_iteration + 1) / self.step_size
        return self.min_lr * (1 + self.step_rate * interval)

    def step(self):
        """One scheduler step."""
        self.last_batch_iteration += 1
        self.lr = self.get_lr()


class OneCycle:
    """OneCycle from deepspeed/runtime/lr_schedules.py (commit 38327e07), one param group; `lr` and `betas` are
    what it last wrote into the group."""

    def __init__(self, cycle_min_lr, cycle_max_lr, decay_lr_rate=0., cycle_first_step_size=2000,
                 cycle_second_step_size=None, decay_step_size=0, cycle_momentum=True, cycle_min_mom=0.8,
                 cycle_max_mom=0.9, decay_mom_rate=0., betas=(0.9, 0.999)):
        cycle_first_step_size = float(cycle_first_step_size)
        cycle_second_step_size = float(cycle_second_step_size) if cycle_second_step_size is not None \
            else cycle_first_step_size
        self.total_size = cycle_first_step_size + cycle_second_step_size
        self.step_ratio = cycle_first_step_size / self.total_size
        self.decay_step_size = decay_step_size
        self.skip_lr_decay = self.skip_mom_decay = math.isclose(self.decay_step_size, 0)
        self.min_lr, self.max_lr, self.decay_lr_rate = cycle_min_lr, cycle_max_lr, decay_lr_rate
        self.lr = cycle_min_lr
        if math.isclose(self.decay_lr_rate, 0):
            self.skip_lr_decay = True
        self.cycle_momentum, self.betas = cycle_momentum, tuple(betas)
        if cycle_momentum:
            self.decay_mom_rate = decay_mom_rate
            self.min_mom, self.max_mom = (cycle_min_mom, 0.99), (cycle_max_mom, 0.99)
            self.betas = self.min_mom
            if math.isclose(self.decay_mom_rate, 0):
                self.skip_mom_decay = True
        self.last_batch_iteration = -1

    def _get_scale_factor(self):
        batch_iteration = (self.last_batch_iteration + 1)
        cycle = math.floor(1 + batch_iteration / self.total_size)
        x = 1. + batch_iteration / self.total_size - cycle
        if x <= self.step_ratio:
            scale_factor = x / self.step_ratio
        else:
            scale_factor = (x - 1) / (self.step_ratio - 1)
        return scale_factor

    def get_lr(self):
        """The learning rate at last_batch_iteration."""
        if self.last_batch_iteration < self.total_size:
            return self.min_lr + (self.max_lr - self.min_lr) * self._get_scale_factor()
        if self.skip_lr_decay:
            return self.min_lr
        decay_interval = (self.last_batch_iteration - self.total_size + 1) / self.decay_step_size
        return self.min_lr / (1 + self.decay_lr_rate * decay_interval)

    def get_mom(self):
        """(beta1, beta2) at last_batch_iteration."""
        if self.last_batch_iteration < self.total_size:
            return (self.max_mom[0] - (self.max_mom[0] - self.min_mom[0]) * self._get_scale_factor(), self.min_mom[1])
        if self.skip_mom_decay:
            return self.max_mom
        decay_interval = (self.last_batch_iteration - self.total_size + 1) / self.decay_step_size
        return (self.max_mom[0] * (1 + self.decay_mom_rate * decay_interval), self.max_mom[1])

    def step(self):
        """One scheduler step."""
        self.last_batch_iteration += 1
        self.lr = self.get_lr()
        if self.cycle_momentum:
            self.betas = self.get_mom()
