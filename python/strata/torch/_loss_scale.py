"""fp16 loss scaling, shared by OffloadAdam and OffloadedModule: which
backward passes went through a scaled loss (_LossScaling), their
scale_loss/backward (_ScalesLoss), and OffloadAdam's own dynamic scale
(_Scaler, the engine's rule).
"""

import math

import torch

from .. import CONFIG, Error, INVALID


# ---- fp16 loss scaling, shared by OffloadAdam and OffloadedModule ----------------
#
# With fp16 a step divides the gradients it is handed by the loss scale
# (DeepSpeed's semantics): they must be those of the loss times the scale.
# scale_loss() multiplies (as torch's GradScaler.scale and DeepSpeed's
# engine.backward do) and hooks the product, so that a backward that runs
# through it is known to be scaled; gradients from any other backward are
# refused (offload_module: at the backward; OffloadAdam: at step()), unless
# the owner was told loss_scaled=True (the caller multiplies by loss_scale).

def _fp16_section(config):
    sec = config.get("fp16")
    return sec if isinstance(sec, dict) else {}


class _LossScaling:
    """The loss scaling of one OffloadAdam or OffloadedModule: the scale
    (`current`, a function; 1 without fp16), scale_loss(), and which
    backward passes went through a scaled loss."""

    def __init__(self, who, enabled, acknowledged, current):
        if acknowledged not in (True, False):
            raise Error(INVALID, f"{who}: loss_scaled={acknowledged!r}; True (the code multiplies each loss by "
                        "loss_scale itself) or False (the default: use scale_loss() or backward())")
        self.who, self.enabled, self.acknowledged, self._current = who, bool(enabled), acknowledged, current
        self.in_backward = False  # a backward that went through scale_loss's result is running
        self.since_step = False  # one has run since the last step

    @property
    def scale(self):
        return float(self._current()) if self.enabled else 1.0

    @property
    def checked(self):
        """Whether gradients must come from a scaled loss (fp16, not loss_scaled)."""
        return self.enabled and not self.acknowledged

    def scale_loss(self, loss):
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"{self.who}: scale_loss takes the loss tensor, not a {type(loss).__name__}")
        if not self.enabled:
            return loss
        if not loss.dtype.is_floating_point:
            raise TypeError(f"{self.who}: scale_loss takes a floating-point loss, not {loss.dtype}")
        # In float32 (DeepSpeed's loss.float() * scale): the scaled loss of
        # an fp16 model would overflow fp16 itself.
        scaled = loss.float() * self.scale
        if scaled.requires_grad:
            scaled.register_hook(self._backward_through)
        return scaled

    def _backward_through(self, grad):
        # The root of the backward (or on its way): every gradient this
        # backward produces is of the scaled loss. A reentrant checkpoint's
        # inner backward runs inside it, and the callback ends with the outer.
        self.in_backward = self.since_step = True
        torch.autograd.Variable._execution_engine.queue_callback(self._backward_ended)

    def _backward_ended(self):
        self.in_backward = False

    def stepped(self):
        self.in_backward = self.since_step = False

    def refusal(self, what, how):
        s = self.scale
        return Error(INVALID, f"{self.who}: fp16 is enabled and {what} a loss that was not scaled: the step "
                     f"divides every gradient by the loss scale (now {s:g}), so the model would train on gradients "
                     f"{s:g} times too small. {how}, or multiply each loss by loss_scale yourself and pass "
                     "loss_scaled=True. (torch's GradScaler does not apply: the engine keeps the scale, skips a "
                     "step that overflows and lowers it)")


class _ScalesLoss:
    """loss_scale, scale_loss and backward over self._scaling (a
    _LossScaling): OffloadAdam's and OffloadedModule's."""

    @property
    def loss_scale(self):
        """The scale to multiply the next loss by: fp16's (dynamic, the
        engine's, or the config's static fp16.loss_scale), 1 without fp16."""
        return self._scaling.scale

    def scale_loss(self, loss):
        """The loss to call backward() on: loss.float() * loss_scale with
        fp16 (its backward is then known to be scaled), else the loss."""
        return self._scaling.scale_loss(loss)

    def backward(self, loss, **kwargs):
        """scale_loss(loss).backward(**kwargs) (DeepSpeed's engine.backward)."""
        self.scale_loss(loss).backward(**kwargs)


_MIN_SCALE = 2.0 ** -24  # the smallest loss scale (fp16's smallest value): 1/scale stays finite in float


def _unscale_factor(scale):
    """What unscales a gradient of the loss times `scale`: 1/scale rounded
    to float32, as the engine multiplies by it (float(1 / scale)), as
    torch's GradScaler (inv_scale) and DeepSpeed (grad.mul_(1 / scale)) do.
    Not a division by the scale: for a scale that is no power of two that
    rounds a third to a half of the values 1 ulp apart. A Python float that
    float32 holds exactly: tensor.mul_(it) is one float32 product."""
    return float(torch.tensor(1.0 / scale, dtype=torch.float32))


class _Scaler:
    """OffloadAdam's fp16 loss scaler, one for all its engines: the engine's
    rule (DeepSpeed's DynamicLossScaler; engine/step/loss_scaler.h,
    docs/config.md): on an overflow the step is skipped; the first
    `hysteresis - 1` overflows only count down, every later one halves the
    scale (not below min_loss_scale); after loss_scale_window clean steps it
    doubles and the count starts again. A static loss_scale (> 0) never
    changes; one below 2^-24, or such a min_loss_scale, is refused. Its
    engines run with a static scale of 1 and get the unscaled gradients:
    their own scalers would drift apart (a step one engine skips, another
    takes)."""

    def __init__(self, fp16):
        def number(key, default, low, integer=False, allowed=None):
            v = fp16.get(key, default)
            if (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or
                    (integer and v != int(v)) or v < low):
                kind = "an integer" if integer else "a number"
                raise Error(INVALID, f"OffloadAdam: fp16.{key} is {v!r}; allowed: {allowed or f'{kind} >= {low}'}")
            return int(v) if integer else float(v)

        def not_tiny(key, v, dynamic_zero):
            # As the engine's config: its engines (static scale 1) never see
            # these, so they are refused here, in its words. The step
            # multiplies the gradients by 1/scale in float (_unscale_factor):
            # a scale below 2^-24 (min_loss_scale 0 after a run of
            # overflows) makes that infinite, NaN in every weight.
            if v < _MIN_SCALE and not (dynamic_zero and v == 0):
                raise Error(CONFIG, f"OffloadAdam: fp16.{key}: {v!r} is below 2^-24 (5.96e-08): the step's unscale "
                            "factor 1/scale would overflow float and write NaN into the weights" +
                            ("; allowed: 2^-24 or more (0: dynamic)" if dynamic_zero else
                             " (DeepSpeed's default is 1); allowed: 2^-24 or more"))
            return v

        static = not_tiny("loss_scale", number("loss_scale", 0, 0, allowed="0 (dynamic), or 2^-24 or more"), True)
        self.dynamic = static == 0
        self.power = number("initial_scale_power", 16, 0, True)
        self.window = number("loss_scale_window", 1000, 1, True)
        self.hysteresis = number("hysteresis", 2, 1, True)
        self.min_scale = not_tiny("min_loss_scale", number("min_loss_scale", 1, 0, allowed="2^-24 or more"), False)
        self.scale = math.ldexp(1.0, self.power) if self.dynamic else static
        self.hysteresis_left, self.clean_steps = self.hysteresis, 0

    def update(self, overflow):
        if not self.dynamic:
            return
        if overflow:
            # As DeepSpeed's DynamicLossScaler (and the engine's): the first
            # hysteresis - 1 overflows only count down; from then on every
            # overflow halves, until a doubling gives the counter back (not
            # each halving: that halved on every second overflow of a burst).
            self.clean_steps = 0
            if self.hysteresis_left > 1:
                self.hysteresis_left -= 1
            else:
                self.scale = max(self.scale / 2, self.min_scale)
            return
        self.clean_steps += 1
        if self.clean_steps >= self.window:
            self.scale *= 2
            self.clean_steps = 0
            self.hysteresis_left = self.hysteresis

    def state_dict(self):
        return {"scale": self.scale, "hysteresis_left": self.hysteresis_left, "clean_steps": self.clean_steps}

    @staticmethod
    def parse_state(sd):
        try:
            scale, left, clean = float(sd["scale"]), int(sd["hysteresis_left"]), int(sd["clean_steps"])
        except (KeyError, TypeError, ValueError):
            raise Error(INVALID, f"load_state_dict: loss_scaler {sd!r} is not a state_dict()'s") from None
        if not (math.isfinite(scale) and scale > 0) or left < 0 or clean < 0:
            raise Error(INVALID, f"load_state_dict: loss_scaler {sd!r}: scale must be a finite number > 0, "
                        "the counts >= 0")
        return scale, left, clean

    def set_state(self, state):
        self.scale, self.hysteresis_left, self.clean_steps = state
