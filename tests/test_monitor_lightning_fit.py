"""The Lightning callback as a Lightning user expects it, on a real Trainer: two monitors in
one Trainer, each resumed from its own checkpoint state; loopprobe's numbers in
``trainer.callback_metrics`` for ModelCheckpoint / EarlyStopping; a callback made from plain
configuration values, with the probe batch from the datamodule."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from test_integrations_ecosystem import PROBE, PROBE_TGT, framed, probe_loss
from test_monitor_integrations import lit_module

import loopprobe as lp
from loopprobe.monitor.monitor import Monitor


def lightning_fit(lit, mon, max_steps, data, ckpt_path=None, first_callback=None, **kw):
    """``Trainer.fit`` with ``MonitorCallback(mon)`` (or ``first_callback``) first."""
    import lightning.pytorch as pl

    from loopprobe.integrations.lightning import MonitorCallback

    first = first_callback if first_callback is not None else MonitorCallback(mon)
    base = dict(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    callbacks = [first, *kw.pop("callbacks", [])]
    trainer = pl.Trainer(max_steps=max_steps, callbacks=callbacks, **{**base, **kw})
    trainer.fit(lit, data, ckpt_path=ckpt_path)
    return trainer


def token_data(n: int = 8, seed: int = 1):
    idx, tgt = lp.tasks.random_tokens(n, 6, 16, generator=torch.Generator().manual_seed(seed))
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(idx, tgt), batch_size=2)


def test_two_monitors_in_one_trainer_each_log_and_resume_their_own_state(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    from loopprobe.integrations.lightning import MonitorCallback

    def monitors(lit):
        cheap = Monitor(lit.model, PROBE, probe_loss, diagnostics=["updates"], every=1)
        deep = Monitor(lit.model, PROBE, probe_loss, diagnostics=["increments"], every=2)
        return cheap, deep, [MonitorCallback(cheap), MonitorCallback(deep, name="deep")]

    lit = lit_module()
    cheap, deep, cbs = monitors(lit)
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1)
    trainer = lightning_fit(lit, None, 2, token_data(), callbacks=[*cbs[1:], ckpt],
                            enable_checkpointing=True, first_callback=cbs[0])  # fmt: skip
    assert sorted(framed(cheap, "probe_loss")) == [1, 2] and sorted(framed(deep, "growth")) == [2]
    assert math.isclose(float(trainer.callback_metrics["deep/growth"]), framed(deep, "growth")[2])
    saved = torch.load(tmp_path / "epoch=0-step=2.ckpt", weights_only=False)["callbacks"]
    assert len([k for k in saved if k.startswith("MonitorCallback")]) == 2

    lit2 = lit_module()
    cheap2, deep2, cbs2 = monitors(lit2)
    lightning_fit(lit2, None, 4, token_data(), ckpt_path=str(tmp_path / "epoch=0-step=2.ckpt"),
                  callbacks=cbs2[1:], first_callback=cbs2[0])  # fmt: skip
    assert sorted(framed(cheap2, "probe_loss")) == [1, 2, 3, 4]
    assert sorted(framed(deep2, "growth")) == [2, 4]
    assert framed(cheap2, "probe_loss")[2] == framed(cheap, "probe_loss")[2]


def test_model_checkpoint_and_early_stopping_watch_loopprobes_numbers(tmp_path):
    from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint

    lit = lit_module()
    mon = Monitor(lit.model, PROBE, probe_loss, diagnostics=["updates", "kappa"], every=1)
    best = ModelCheckpoint(dirpath=tmp_path, monitor="loopprobe/kappa_R", mode="max",
                           every_n_train_steps=1, save_top_k=1)  # fmt: skip
    stop = EarlyStopping(monitor="loopprobe/probe_loss", stopping_threshold=1e9,
                         check_on_train_epoch_end=True)  # fmt: skip
    trainer = lightning_fit(lit, mon, 12, token_data(), callbacks=[best, stop],
                            enable_checkpointing=True, max_epochs=3)  # fmt: skip
    kappa = framed(mon, "kappa_R")
    assert sorted(kappa) == [1, 2, 3, 4]  # 4 batches an epoch; stopped after the first epoch
    assert trainer.should_stop and stop.stopped_epoch == 0
    top = max(kappa, key=kappa.get)
    assert float(best.best_model_score) == kappa[top]
    assert best.best_model_path.endswith(f"step={top}.ckpt")


class ProbeData:
    """A LightningDataModule with the probe batch the config-built callback asks for."""

    @staticmethod
    def make():
        import lightning.pytorch as pl

        class Data(pl.LightningDataModule):
            def train_dataloader(self):
                return token_data()

            def probe_batch(self):
                return PROBE

        return Data()


def lit_with_probe_loss():
    lit = lit_module()
    lit.probe_loss = lambda out, inputs: F.cross_entropy(out.flatten(0, 1), PROBE_TGT.flatten())
    return lit


def test_a_callback_from_plain_configuration_values_builds_its_monitor_at_fit_and_resumes(
    tmp_path,
):
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from loopprobe.integrations.lightning import MonitorCallback

    config = json.loads('{"every": 1, "diagnostics": ["updates", "kappa"], "module": "model"}')
    cb = MonitorCallback(**config)
    lit = lit_with_probe_loss()
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1)
    kw = dict(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
              enable_model_summary=False)  # fmt: skip
    pl.Trainer(max_steps=2, callbacks=[cb, ckpt], **kw).fit(lit, datamodule=ProbeData.make())
    assert cb.monitor.model is lit.model and sorted(framed(cb.monitor, "kappa_R")) == [1, 2]
    with lp.attach(lit.model) as probe:  # the monitor's kappa is the direct call's, inside
        rep = lp.visit_alignment(probe, PROBE, probe_loss, tol=1e-2)  # both certified intervals
    err = framed(cb.monitor, "kappa_err")[2] + rep.kappa_err  # (the monitor's starts warm)
    assert abs(framed(cb.monitor, "kappa_R")[2] - rep.kappa) <= err

    again = MonitorCallback(**config)
    trainer = pl.Trainer(max_steps=3, callbacks=[again], enable_checkpointing=False, **kw)
    trainer.fit(lit_with_probe_loss(), datamodule=ProbeData.make(),
                ckpt_path=str(tmp_path / "epoch=0-step=2.ckpt"))  # fmt: skip
    assert sorted(framed(again.monitor, "kappa_R")) == [1, 2, 3]
    assert framed(again.monitor, "kappa_R")[2] == framed(cb.monitor, "kappa_R")[2]


def test_a_config_built_callback_without_a_probe_batch_says_where_to_put_one():
    import lightning.pytorch as pl

    from loopprobe.integrations.lightning import MonitorCallback

    trainer = pl.Trainer(max_steps=1, callbacks=[MonitorCallback(every=1, module="model")],
                         logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False)  # fmt: skip
    with pytest.raises(ValueError, match="probe_batch\\(\\)"):
        trainer.fit(lit_with_probe_loss(), token_data())
    with pytest.raises(ValueError, match="name='a/b'"):
        MonitorCallback(every=1, name="a/b")


def test_a_checkpoint_from_before_callback_names_still_resumes_the_default_callback(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    lit = lit_module()
    first = Monitor(lit.model, PROBE, probe_loss, diagnostics=["updates"], every=1)
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1)
    lightning_fit(lit, first, 2, token_data(), callbacks=[ckpt], enable_checkpointing=True)
    path = tmp_path / "epoch=0-step=2.ckpt"
    saved = torch.load(path, weights_only=False)
    (key,) = [k for k in saved["callbacks"] if k.startswith("MonitorCallback")]
    saved["callbacks"] = {"_callback_class.<locals>.MonitorCallback": saved["callbacks"][key]}
    torch.save(saved, path)  # the key loopprobe 0.1's callback wrote

    lit2 = lit_module()
    again = Monitor(lit2.model, PROBE, probe_loss, diagnostics=["updates"], every=1)
    lightning_fit(lit2, again, 3, token_data(), ckpt_path=str(path))
    assert sorted(framed(again, "probe_loss")) == [1, 2, 3]


def test_a_config_built_callback_judges_the_trainers_own_adamw_step():
    # The Trainer's optimizer becomes the monitor's update= once fit has made it: the logged
    # G at the last step is the AdamW-preconditioned per-visit update of the state training
    # ended with (not the raw gradient); update= given to the callback wins.
    import lightning.pytorch as pl

    from loopprobe.integrations.lightning import MonitorCallback

    lit = lit_with_probe_loss()
    lit.configure_optimizers = lambda: torch.optim.AdamW(lit.parameters(), lr=1e-2)
    cb = MonitorCallback(every=2, diagnostics=["updates"], module="model")
    kw = dict(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
              enable_model_summary=False, enable_checkpointing=False)  # fmt: skip
    trainer = pl.Trainer(max_steps=2, callbacks=[cb], **kw)
    trainer.fit(lit, datamodule=ProbeData.make())
    opt = cb.monitor.update
    assert type(opt) is torch.optim.AdamW and opt is trainer.optimizers[0]
    probe = lp.attach(lit.model)
    adamw = lp.per_visit_updates(probe, PROBE, probe_loss, update=opt)
    raw = lp.per_visit_updates(probe, PROBE, probe_loss)
    for j, name in enumerate(adamw.sublayers):
        f = cb.monitor.frame
        got = f[(f.quantity == "G_norm") & (f.step == 2) & (f.sublayer == name)].value.tolist()
        assert got == pytest.approx(adamw.norms(j).tolist(), rel=1e-5)
        assert got != pytest.approx(raw.norms(j).tolist(), rel=1e-2)

    lit = lit_with_probe_loss()
    lit.configure_optimizers = lambda: torch.optim.AdamW(lit.parameters(), lr=1e-2)
    cb = MonitorCallback(every=2, diagnostics=["updates"], module="model", update="sgd")
    pl.Trainer(max_steps=2, callbacks=[cb], **kw).fit(lit, datamodule=ProbeData.make())
    assert cb.monitor.update == "sgd"
