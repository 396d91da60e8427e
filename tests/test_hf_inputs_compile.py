"""Issue 26, items 3 and 4: Hugging Face batches and losses, and torch.compile'd models.

A batch held as a mapping (a ``dict`` or a ``transformers.BatchEncoding``, which is a
``UserDict``) is called as ``model(**batch)``; with ``loss_fn=None`` the loss is the one
the model returns itself (``out.loss``). A ``torch.compile``'d model is probed through its
eager module, with the same numbers as the eager model and no ``_orig_mod.`` in the names.
Real library, tiny models: a 3-layer ALBERT (d = 16) and a 3-step tanh loop (d = 4).
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
import warnings
from types import MappingProxyType

import pytest
import torch
from torch import nn

import loopprobe as lp
from loopprobe.cli import main
from loopprobe.record.types import MappingCallError, call_model, model_loss

R = 3
FAST = {"max_iter": 30, "tol": 1e-9}


def albert(with_head: bool = True) -> nn.Module:
    from transformers import AlbertConfig, AlbertForMaskedLM, AlbertModel

    cfg = AlbertConfig(
        vocab_size=11,
        embedding_size=8,
        hidden_size=16,
        num_hidden_layers=R,
        num_hidden_groups=1,
        inner_group_num=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=16,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return (AlbertForMaskedLM if with_head else AlbertModel)(cfg).double()


def batch(labels: bool = True) -> dict:
    ids = torch.randint(11, (2, 6), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 4:] = 0  # a padded row: a call that drops attention_mask gives other numbers
    out = {"input_ids": ids, "attention_mask": mask}
    return {**out, "labels": ids.roll(-1, 1)} if labels else out


def as_batch_encoding(b: dict):
    from transformers import BatchEncoding

    return BatchEncoding(b)


def kappa(model: nn.Module, inputs, loss_fn=None, **kw) -> lp.results.AlignmentReport:
    with lp.attach(model) as probe:
        return lp.visit_alignment(
            probe,
            inputs,
            loss_fn,
            output=lambda out: out.logits,
            generator=torch.Generator().manual_seed(0),
            **FAST,
            **kw,
        )


def by_keywords(model: nn.Module, inputs):
    return model(**inputs)


def own_loss(out, _inputs):
    return out.loss


# --------------------------------------------------------------------------- mappings


@pytest.mark.parametrize("wrap", [dict, as_batch_encoding], ids=["dict", "BatchEncoding"])
def test_a_mapping_batch_is_called_with_keyword_arguments_through_the_probe(wrap):
    model = albert()
    inputs = wrap(batch())
    table = lp.attach(model).visit_table(inputs, output=lambda out: out.logits)
    assert list(table.sublayer) == ["albert.encoder.albert_layer_groups.0"]
    assert (table.attrs["M"], table.attrs["M_g"]) == (R, R)
    implicit = kappa(model, inputs, own_loss)
    explicit = kappa(model, inputs, own_loss, forward=by_keywords)
    assert implicit.kappa == explicit.kappa and implicit.loss == explicit.loss
    assert implicit.loss == float(model(**batch()).loss.detach())  # the attention mask was passed


def test_without_loss_fn_the_kappa_is_the_one_of_the_models_own_loss():
    model, inputs = albert(), as_batch_encoding(batch())
    default = kappa(model, inputs)
    explicit = kappa(model, inputs, own_loss)
    assert default.kappa == explicit.kappa and default.loss == explicit.loss
    assert default.loss == float(model(**inputs).loss.detach())
    half_square = kappa(model, inputs, lambda out, _i: 0.5 * out.logits.pow(2).mean())
    assert half_square.loss != default.loss  # the comparison can tell two losses apart
    with lp.attach(model) as probe:
        G_default = lp.per_visit_updates(probe, inputs).G[0]
        G_explicit = lp.per_visit_updates(probe, inputs, own_loss).G[0]
    assert torch.equal(G_default, G_explicit)


def test_bound_check_without_loss_fn_steps_on_the_models_own_loss():
    model, inputs = albert(), batch()
    with lp.attach(model) as probe:
        kw = {"alpha": 1.0, "beta": 1.0, "output": lambda out: out.logits, **FAST}
        default = lp.bound_check(probe, inputs, **kw)
        explicit = lp.bound_check(probe, inputs, own_loss, **kw)
    assert default.dF_true == explicit.dF_true and default.dF_true > 0


@pytest.mark.parametrize("call", ["per_visit_updates", "visit_alignment", "bound_check"])
def test_an_output_without_a_loss_is_refused_naming_the_call_and_loss_fn(call):
    model, inputs = albert(), batch(labels=False)  # no labels: ALBERT returns no .loss
    kw = (
        {"alpha": 1.0, "beta": 1.0, "output": lambda out: out.logits}
        if call == "bound_check"
        else {}
    )
    with lp.attach(model) as probe, pytest.raises(ValueError) as err:
        getattr(lp, call)(probe, inputs, **kw)
    assert str(err.value).startswith(f"{call}: loss_fn=None uses the loss the model returns")
    assert "MaskedLMOutput output has no scalar .loss" in str(err.value)
    assert "pass loss_fn=lambda out, inputs:" in str(err.value)


def test_model_loss_reads_an_attribute_or_a_key_and_only_a_scalar():
    loss = torch.tensor([2.5])
    assert model_loss({"loss": loss}).shape == () and float(model_loss({"loss": loss})) == 2.5
    assert float(model_loss(MappingProxyType({"loss": loss}))) == 2.5  # a Mapping, not a dict
    assert model_loss({"loss": torch.ones(3)}) is None
    assert model_loss(torch.ones(())) is None


class TakesTheDict(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, batch: dict) -> torch.Tensor:
        return self.lin(batch["x"])


class RaisesTypeErrorInside(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise TypeError("the model's own bug")


def test_a_forward_that_takes_the_mapping_itself_is_told_to_pass_forward():
    inputs = {"x": torch.ones(2, 4)}
    with pytest.raises(MappingCallError, match=r"model\(\*\*inputs\) \(keys \['x'\]\)") as err:
        call_model(TakesTheDict(), inputs)
    assert "pass forward=lambda model, inputs: model(inputs)" in str(err.value)
    out = call_model(TakesTheDict(), inputs, lambda m, b: m(b))  # explicit forward= wins
    assert out.shape == (2, 4)


def test_a_type_error_inside_a_model_that_takes_the_keys_is_its_own():
    with pytest.raises(TypeError, match="^the model's own bug$"):
        call_model(RaisesTypeErrorInside(), {"x": torch.ones(1)})


def test_a_tuple_is_still_passed_positionally():
    model = nn.Bilinear(2, 3, 1)
    a, b = torch.ones(1, 2), torch.ones(1, 3)
    assert torch.equal(call_model(model, (a, b)), model(a, b))


# --------------------------------------------------------------------------- the CLI

USER_MODULE = textwrap.dedent(
    """
    import torch
    from torch import nn
    from transformers import AlbertConfig, AlbertForMaskedLM, BatchEncoding

    def make():
        cfg = AlbertConfig(vocab_size=11, embedding_size=8, hidden_size=16,
            num_hidden_layers=3, num_hidden_groups=1, inner_group_num=1,
            num_attention_heads=2, intermediate_size=32, max_position_embeddings=16,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        with torch.random.fork_rng():
            torch.manual_seed(0)
            return AlbertForMaskedLM(cfg).double()

    def batch():
        ids = torch.randint(11, (2, 6), generator=torch.Generator().manual_seed(1))
        mask = torch.ones_like(ids)
        mask[1, 4:] = 0
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.roll(-1, 1)}

    def encoding():
        return BatchEncoding(batch())

    class TakesTheDict(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
        def forward(self, batch):
            h = batch["x"]
            for _ in range(2):
                h = self.lin(h)
            return h

    def make_dict_taker():
        return TakesTheDict()

    def xs():
        return {"x": torch.ones(2, 4)}
    """
)


@pytest.fixture
def user_dir(fresh_cwd):
    return fresh_cwd("hfuser", USER_MODULE)


@pytest.mark.parametrize("fn", ["batch", "encoding"])
def test_the_cli_calls_a_dict_from_inputs_with_keywords_and_uses_the_models_loss(
    user_dir, capsys, fn
):
    argv = ["kappa", "--model", f"{user_dir}:make", "--inputs", f"{user_dir}:{fn}"]
    code = main([*argv, "--max-iter", "30", "--tol", "1e-9", "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    out = json.loads(captured.out)
    assert out["loss_fn"] == "the model's own .loss" and out["M"] == R
    library = kappa(albert(), batch(), seed=0)  # the library's loss_fn=None, F = .logits
    assert out["kappa"] == pytest.approx(library.kappa, rel=1e-12)
    assert out["loss"] == pytest.approx(library.loss, rel=1e-12)


def test_the_cli_tells_a_model_that_takes_the_dict_itself_to_pass_forward(user_dir, capsys):
    argv = ["kappa", "--model", f"{user_dir}:make_dict_taker", "--inputs", f"{user_dir}:xs"]
    assert main([*argv, "--max-iter", "5"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("loopprobe kappa: error: calling the model")
    assert "model(**inputs) (keys ['x'])" in err
    assert (
        "pass --forward package.module:fn with def fn(model, inputs): return model(inputs)" in err
    )


# --------------------------------------------------------------------------- torch.compile


class Loop(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(R):
            x = x + torch.tanh(self.block(x))
        return self.head(x)


def loop() -> nn.Module:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return Loop().double()


X = torch.linspace(-1, 1, 8, dtype=torch.float64).reshape(2, 4)


def loop_kappa(model: nn.Module) -> tuple[float, list[str]]:
    with lp.attach(model) as probe:
        rep = lp.visit_alignment(
            probe, X, lambda out, _i: out.pow(2).mean(), generator=torch.Generator().manual_seed(0)
        )
    return rep.kappa, list(rep.sublayers.sublayer)


def test_a_compiled_model_has_the_eager_kappa_and_names_and_is_left_unchanged():
    model = loop()
    compiled = torch.compile(model, backend="eager")  # lazy: nothing compiles unless called
    before = {k: v.clone() for k, v in model.state_dict().items()}
    eager_kappa, eager_names = loop_kappa(loop())
    with pytest.warns(UserWarning, match="probing runs the eager module") as record:
        compiled_kappa, names = loop_kappa(compiled)
    assert compiled_kappa == eager_kappa and 0 < eager_kappa <= R
    assert names == eager_names == ["block"]
    assert [w.filename for w in record] == [__file__]  # it names the user's line
    assert lp.attach(compiled).model is model
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_plain_model_is_attached_without_a_warning_or_importing_dynamo():
    import subprocess

    code = (
        "import sys, warnings; warnings.simplefilter('error'); import torch, loopprobe as lp; "
        "lp.attach(torch.nn.Linear(2, 2)); print('torch._dynamo' in sys.modules)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"


@pytest.fixture
def one_rank(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("nesting", ["ddp(compile(m))", "compile(ddp(m))"])
def test_ddp_and_compile_nested_either_way_unwrap_to_the_eager_module(one_rank, nesting):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = loop()
    compile_ = lambda m: torch.compile(m, backend="eager")  # noqa: E731
    wrapped = DDP(compile_(model)) if nesting == "ddp(compile(m))" else compile_(DDP(model))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        probe = lp.attach(wrapped)
    assert probe.model is model and probe.ranks is not None and probe.ranks.size == 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert loop_kappa(wrapped) == loop_kappa(loop())
