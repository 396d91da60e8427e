"""Issue 24 for lp.increments: no wrong increment statistic comes back ``converged=True``.

The toys are written the way third-party code is (plain ``nn.Module`` loops, not
``loopprobe.models``); every figure is checked against the loop unrolled by hand in float64.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import loopprobe as lp

D = 8


def _x(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)


class Body(nn.Module):
    """An MLP that returns the new state (no residual of its own)."""

    def __init__(self, d: int = D) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc2(torch.relu(self.fc1(u))))


class InjectionLoop(nn.Module):
    """``z <- f(x + z)`` looped R times (DEQ / HRM / TRM style input injection).

    ``z0``: "zero" (the common start) or "random"; ``scale``: the injection at step r is
    ``x * scale(r)`` (a constant 1 is a plain input injection); ``head``: a projection to
    another width after the loop (so the model output tells nothing).
    """

    def __init__(self, R: int = 5, z0: str = "zero", head: bool = True, scale=None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.R, self.z0, self.scale = R, z0, scale or (lambda r: 1.0)
        self.body = Body()
        self.head = nn.Linear(D, 3) if head else None
        self.double()

    def start(self, x: torch.Tensor) -> torch.Tensor:
        if self.z0 == "zero":
            return torch.zeros_like(x)
        return 0.5 * torch.randn(x.shape, generator=torch.Generator().manual_seed(7)).to(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.start(x)
        for r in range(self.R):
            z = self.body(x * self.scale(r) + z)
        return z if self.head is None else self.head(z)

    def unrolled(self, x: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
        """The increments of the stream the visits read, u_r = x + z_r, and u_0 .. u_R."""
        with torch.no_grad():
            z, us = self.start(x), []
            for _ in range(self.R):
                us.append(x + z)
                z = self.body(x + z)
            us.append(x + z)
        return [us[r + 1] - us[r] for r in range(self.R)], us


def _cos(zs: list[torch.Tensor]) -> np.ndarray:
    Z = torch.stack([z.reshape(-1) for z in zs])
    Z = Z / Z.norm(dim=1, keepdim=True)
    return (Z @ Z.T).numpy()


# --------------------------------------------------------------------------- case 2


@pytest.mark.parametrize("z0", ["zero", "random"])
@pytest.mark.parametrize("head", [True, False])
def test_an_input_injection_is_measured_as_the_change_of_the_stream_between_reads(z0, head):
    # z0 = 0: the first visit's input + output is the next input, so a one-visit decision
    # took the sublayer for an increment-returning branch and measured the states (issue 24)
    model, x = InjectionLoop(z0=z0, head=head), _x(3, 4, D)
    zs, us = model.unrolled(x)
    inc = lp.increments(model, x)
    assert inc.measured == {"body": "output + injection - input"}
    assert "input injection" in inc.evidence["body"]
    np.testing.assert_allclose(inc.cos[0], _cos(zs), atol=1e-10)
    assert inc.growth == pytest.approx(float((us[-1] - us[0]).norm() / us[0].norm()), rel=1e-10)
    assert "injection" in inc.hN_source and inc.converged and inc.reason == ""


def test_a_first_visit_that_only_an_injection_from_zero_explains_is_not_evidence():
    # R = 2 and a head: the only chain reading is the first visit's, where input + output
    # is also what x + z_1 is; nothing tells a residual branch from z <- f(x + z)
    with pytest.raises(ValueError, match=r"cannot tell .*'body'.*zero state") as e:
        lp.increments(InjectionLoop(R=2), _x(3, 4, D))
    assert "increment='output'" in str(e.value) and "increment='delta'" in str(e.value)


def test_a_loop_output_that_reads_the_state_does_not_outvote_visits_that_read_neither():
    # the injection changes every step (x * (r + 1)): no visit reads output, input + output
    # or output + a fixed tensor; only the model output reads the last output
    model = InjectionLoop(head=False, scale=lambda r: float(r + 1))
    with pytest.raises(ValueError, match=r"says both: .*neither its output .*reads its output"):
        lp.increments(model, _x(3, 4, D))


@pytest.mark.parametrize("mode", ["output", "delta"])
def test_an_explicit_choice_that_an_input_injection_contradicts_is_unconverged(mode):
    inc = lp.increments(InjectionLoop(), _x(3, 4, D), increment=mode)
    assert not inc.converged
    assert f"increment={mode!r} but the next visit reads output + the same tensor" in inc.reason
    assert "increment='auto' measures its increments" in inc.reason


class Residual(nn.Module):
    """``h <- h + 0.3 f(h)``, the stream multiplied by inf before visit ``blow_up_at``."""

    def __init__(self, R: int = 4, blow_up_at: int = 2) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.R, self.blow_up_at = R, blow_up_at
        self.block = Body()
        self.double()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for r in range(self.R):
            if r == self.blow_up_at:
                h = h * float("inf")
            h = h + 0.3 * self.block(h)
        return h


@pytest.mark.parametrize("mode", ["auto", "output", "delta"])
def test_non_finite_increments_are_unconverged_in_every_mode(mode):
    inc = lp.increments(Residual(), _x(3, 4, D), increment=mode)
    assert not inc.converged and "non-finite" in inc.reason
    assert not np.isfinite(inc.inc_norm[2:]).any()


# --------------------------------------------------------------------------- case 3


class TupleLayer(nn.Module):
    """Hugging Face style: returns ``(hidden, attention_weights)``."""

    def __init__(self, d: int = D) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, None]:
        return h + 0.3 * torch.tanh(self.fc(h)), None


class TupleLoop(nn.Module):
    def __init__(self, R: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.R, self.layer = R, TupleLayer()
        self.double()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for _ in range(self.R):
            h = self.layer(h)[0]
        return h


class TensorLoop(TupleLoop):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for _ in range(self.R):
            h = self.layer.fc(h) * 0.1 + h
        return h


def test_a_callable_gets_the_output_as_the_module_returned_it():
    # written for the raw (hidden, extras) output; the old rec.output was already element 0,
    # so rec.output[0] indexed the batch and broadcast (cosines 0.972 instead of 0.970)
    model, x = TupleLoop(), _x(3, 5, D)
    raw = lp.increments(model, x, increment=lambda rec: rec.output[0] - rec.args[0])
    delta = lp.increments(model, x, increment="delta")
    np.testing.assert_allclose(raw.inc_norm, delta.inc_norm, rtol=1e-12)
    np.testing.assert_allclose(raw.cos[0], delta.cos[0], atol=1e-12)
    assert raw.converged and "as the module returned it" in raw.evidence["layer"]


def test_a_callable_treating_a_tuple_output_as_a_tensor_is_told_what_rec_output_is():
    with pytest.raises(TypeError, match=r"callable failed at visit r=0 .*'layer'.*a tuple of 2"):
        lp.increments(TupleLoop(), _x(3, 5, D), increment=lambda rec: rec.output - rec.args[0])


def test_a_callable_result_not_shaped_like_the_stream_is_refused_naming_both_shapes():
    probe = lp.attach(TensorLoop(), sublayers=["layer.fc"])
    with pytest.raises(ValueError, match=r"returned shape \(5, 8\) .*\(3, 5, 8\).*index the batch"):
        lp.increments(probe, _x(3, 5, D), increment=lambda rec: rec.output[0])


def test_a_callable_returning_the_updated_stream_is_unconverged():
    # rec.output[0] is the new hidden state: what the next visit reads, not what it adds
    inc = lp.increments(TupleLoop(), _x(3, 5, D), increment=lambda rec: rec.output[0])
    assert not inc.converged
    assert "callable's result for sublayer 'layer' is not what the visit adds" in inc.reason
