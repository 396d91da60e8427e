"""The trainer adapters: a real transformers.Trainer and a real Lightning Trainer, a few steps
each on tiny random models, with the monitor's numbers checked against direct calls."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import loopprobe as lp
from loopprobe.monitor.monitor import KAPPA_TOL, Monitor


def last_kappa(mon: Monitor) -> float:
    f = mon.frame
    return float(f[(f.quantity == "kappa_R") & (f.step == f.step.max())].value.iloc[0])


def assert_same_kappa(mon: Monitor, rep) -> None:
    """The monitor's last kappa_R and a direct call's: both certified intervals hold the true
    value, so they meet (the monitor's starts from its previous kappa, the direct one cold)."""
    f = mon.frame
    err = float(f[(f.quantity == "kappa_err") & (f.step == f.step.max())].value.iloc[0])
    assert abs(last_kappa(mon) - rep.kappa) <= err + rep.kappa_err
    assert err <= KAPPA_TOL and rep.kappa_err <= KAPPA_TOL


# ----------------------------------------------------------------------------- Hugging Face


def tiny_albert():
    import transformers

    cfg = transformers.AlbertConfig(
        vocab_size=32,
        embedding_size=8,
        hidden_size=16,
        num_hidden_layers=3,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=16,
    )
    torch.manual_seed(0)
    return transformers.AlbertForMaskedLM(cfg)


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 8) -> None:
        self.ids = torch.randint(0, 32, (n, 8), generator=torch.Generator().manual_seed(3))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


PROBE = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(4))


def reconstruction(out, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits.flatten(0, 1), ids.flatten())


def test_the_hf_callback_runs_the_monitor_after_each_trainer_step(hf_args):
    import transformers

    from loopprobe.integrations.huggingface import MonitorCallback

    model = tiny_albert()
    mon = Monitor(model, PROBE, reconstruction, diagnostics=["updates", "kappa"], every=1)
    cb = MonitorCallback(mon)
    assert isinstance(cb, transformers.TrainerCallback)
    before = [p.detach().clone() for p in model.parameters()]
    trainer = transformers.Trainer(
        model=model, args=hf_args(), train_dataset=Tokens(), callbacks=[cb]
    )
    trainer.train()
    assert sorted(set(mon.frame.step)) == [1, 2, 3]  # global_step counts the finished step
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    with lp.attach(model) as probe:  # the model after the last step, as the monitor saw it
        rep = lp.visit_alignment(probe, PROBE, reconstruction, tol=KAPPA_TOL)
    assert_same_kappa(mon, rep)
    body = mon.frame[(mon.frame.quantity == "G_norm") & (mon.frame.step == 3)]
    assert body.visit.tolist() == [0, 1, 2]  # one shared layer group, 3 visits


def test_the_hf_callback_builds_its_monitor_on_the_trainers_model(hf_args):
    import transformers

    from loopprobe.integrations.huggingface import MonitorCallback

    model = tiny_albert()
    cb = MonitorCallback(inputs=PROBE, loss_fn=reconstruction, diagnostics=["updates"], every=2)
    args = hf_args()
    transformers.Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[cb]).train()
    assert cb.monitor.model is model
    assert sorted(set(cb.monitor.frame.step)) == [2]


def test_the_hf_callback_refuses_a_monitor_of_another_model_and_ambiguous_arguments(hf_args):
    import transformers

    from loopprobe.integrations.huggingface import MonitorCallback

    with pytest.raises(ValueError, match="pass a Monitor, or Monitor's arguments"):
        MonitorCallback()
    other = Monitor(tiny_albert(), PROBE, reconstruction, diagnostics=["updates"])
    trainer = transformers.Trainer(
        model=tiny_albert(),
        args=hf_args(),
        train_dataset=Tokens(),
        callbacks=[MonitorCallback(other)],
    )
    with pytest.raises(ValueError, match="not \\(part of\\) the Trainer's model"):
        trainer.train()


# -------------------------------------------------------------------------------- Lightning


def lit_module(lr: float = 0.5):
    import lightning.pytorch as pl

    class LitGPT(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            cfg = lp.models.GPTConfig(K=1, R=3, d_model=8, n_heads=2, seq_len=6, vocab_size=16)
            self.model = lp.models.LoopedGPT(cfg, generator=torch.Generator().manual_seed(0))

        def training_step(self, batch, batch_idx):
            idx, tgt = batch
            return F.cross_entropy(self.model(idx).flatten(0, 1), tgt.flatten())

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=lr)

    return LitGPT()


def test_the_lightning_callback_runs_the_monitor_once_per_optimizer_step():
    import lightning.pytorch as pl

    from loopprobe.integrations.lightning import MonitorCallback

    idx, tgt = lp.tasks.random_tokens(8, 6, 16, generator=torch.Generator().manual_seed(1))
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(idx, tgt), batch_size=2)
    lit = lit_module()
    probe, probe_tgt = lp.tasks.random_tokens(2, 6, 16, generator=torch.Generator().manual_seed(2))

    def loss_fn(out, inputs):
        return F.cross_entropy(out.flatten(0, 1), probe_tgt.flatten())

    mon = Monitor(lit.model, probe, loss_fn, diagnostics=["updates", "kappa"], every=1)
    trainer = pl.Trainer(
        max_steps=3,
        accumulate_grad_batches=2,  # 6 batches, 3 optimizer steps: the monitor runs 3 times
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[MonitorCallback(mon)],
    )
    trainer.fit(lit, data)
    f = mon.frame
    assert sorted(set(f.step)) == [1, 2, 3]
    assert len(f[f.quantity == "kappa_R"]) == 3
    assert f[f.quantity == "loss"].value.notna().all() and (f.quantity == "loss").sum() == 3
    with lp.attach(lit.model) as p:
        rep = lp.visit_alignment(p, probe, loss_fn, tol=KAPPA_TOL)
    assert_same_kappa(mon, rep)


def test_importing_the_integration_modules_imports_neither_transformers_nor_lightning():
    code = "import sys, loopprobe, loopprobe.integrations.huggingface\n"
    code += "import loopprobe.integrations.lightning\n"
    code += "print(sorted({m.split('.')[0] for m in sys.modules}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = set(eval(out.stdout))
    assert not {"transformers", "lightning", "pytorch_lightning"} & loaded
