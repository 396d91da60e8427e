"""``loopprobe fixed-point``: the JSON report on a tiny user model, and one-line errors."""

import json

import pytest
import torch

from loopprobe.cli import main
from loopprobe.cli.fixed_point import default_model
from loopprobe.models import LinearLoop, LinearLoopConfig


class TokenLinearLoop(LinearLoop):
    """A LinearLoop behind a token embedding: closed-form answers through the CLI."""

    def __init__(self):
        spectrum = tuple(-0.4 * (i + 1) for i in range(6))  # transition eigenvalues 0.9 .. 0.4
        super().__init__(LinearLoopConfig(d=6, R=4, spectrum=spectrum, recall=True),
                         generator=torch.Generator().manual_seed(0))  # fmt: skip
        self.emb = torch.nn.Embedding(5, 6)

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        return self.emb(idx)


def make_model() -> TokenLinearLoop:
    return TokenLinearLoop()


def make_inputs(model) -> torch.Tensor:
    return torch.tensor([[0, 3, 1]])


def run_json(capsys, *argv) -> dict:
    code = main(["fixed-point", *argv, "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return json.loads(captured.out)


def test_json_report_on_a_linear_loop_has_the_closed_form_radius(capsys):
    spec = ["--model", f"{__name__}:make_model", "--inputs", f"{__name__}:make_inputs"]
    out = run_json(capsys, *spec, "--tol", "1e-10", "--max-iter", "1000", "--k", "2")
    for key in ("converged", "spectral_radius", "spectral_radius_converged",
                "input_dependence", "residuals"):  # fmt: skip
        assert key in out
    assert out["converged"] and out["spectral_radius_converged"]
    model = make_model().double()
    A, U = model.transition_matrix(), model.U.weight.detach()
    rho = torch.linalg.eigvalsh(A).abs().max().item()  # 0.9 = 1 + (-0.4) / 4, up to float32 init
    assert out["spectral_radius"] == pytest.approx(rho, rel=1e-10)
    closed = torch.linalg.matrix_norm(torch.linalg.solve(torch.eye(6, dtype=A.dtype) - A, U), 2)
    assert out["input_dependence"] == pytest.approx(closed.item(), rel=1e-6)
    assert out["state_shape"] == [1, 3, 6] and out["rounds"] == 4
    assert out["residuals"][-1] <= 1e-10 and len(out["residuals"]) == out["iterations"] + 1


def test_text_report_has_one_line_per_quantity(capsys):
    spec = ["--model", f"{__name__}:make_model", "--inputs", f"{__name__}:make_inputs"]
    assert main(["fixed-point", *spec, "--k", "2", "--method", "anderson"]) == 0
    lines = capsys.readouterr().out.splitlines()
    keys = [line.split()[0] for line in lines]
    assert keys[:3] == ["state_shape", "dtype", "converged"] and "input_dependence" in keys
    assert lines[2].split()[1] == "True" and len(lines) == 23


def test_default_model_is_one_block_with_additive_recall_and_outer_norm():
    cfg = default_model().cfg
    assert (cfg.K, cfg.recall, cfg.outer_norm, cfg.tied) == (1, "add", True, True)


def test_bad_model_spec_is_one_line_error(capsys):
    assert main(["fixed-point", "--model", "no_such_module_xyz:make"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("loopprobe fixed-point: error: --model") and err.count("\n") == 1
