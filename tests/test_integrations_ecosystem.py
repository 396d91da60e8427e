"""The monitor fits the tools researchers train with (issue 26): real transformers and
Lightning trainers get its numbers in their logs and keep its state across a resume; a
Hugging Face batch (a mapping, the model's own loss) goes straight in; a diagnostic that
fails mid-run becomes rows, not an exception, and never changes the training; a budget
caps the monitor's share of wall time."""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from test_monitor_integrations import (  # the same tiny ALBERT and data
    Tokens,
    lit_module,
    tiny_albert,
)
from torch import nn

import loopprobe as lp
import loopprobe.monitor.monitor as monitor_module
from loopprobe.monitor.monitor import Monitor

# ----------------------------------------------------------------------------- Hugging Face


IDS = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(4))
BATCH = {"input_ids": IDS, "labels": IDS}  # the model returns its own .loss


def hf_train(hf_args, mon, resume=None, first=False, **kw):
    import transformers

    from loopprobe.integrations.huggingface import MonitorCallback

    cb = MonitorCallback(mon)
    trainer = transformers.Trainer(
        model=mon.model,
        args=hf_args(**{"max_steps": 4, "seed": 0, **kw}),
        train_dataset=Tokens(),
        callbacks=None if first else [cb],
    )
    if first:
        trainer.callback_handler.callbacks.insert(0, cb)
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def logged(history: list[dict], name: str) -> dict[int, float]:
    return {h["step"]: h[name] for h in history if name in h}


def framed(mon: Monitor, quantity: str, sublayer=None) -> dict[int, float]:
    f = mon.frame[mon.frame.quantity == quantity]
    if sublayer is not None:
        f = f[(f.sublayer == sublayer) & f.visit.isna()]
    return dict(zip(f.step.tolist(), f.value.tolist(), strict=True))


GROUP = "albert.encoder.albert_layer_groups.0"


def test_the_hf_trainers_log_history_holds_the_monitors_numbers_at_their_steps(tmp_path, hf_args):
    mon = Monitor(tiny_albert(), BATCH, diagnostics=["updates"], every=2)
    trainer = hf_train(hf_args, mon)  # logging_strategy="no": only the monitor's steps log
    history = trainer.state.log_history
    assert logged(history, "loopprobe/probe_loss") == framed(mon, "probe_loss")
    assert sorted(framed(mon, "probe_loss")) == [2, 4]
    name = f"loopprobe/G_norm/{GROUP}/r1"
    g = mon.frame[(mon.frame.quantity == "G_norm") & (mon.frame.visit == 1)]
    assert logged(history, name) == dict(zip(g.step.tolist(), g.value.tolist(), strict=True))
    assert all("loss" in h for h in history if "loopprobe/probe_loss" in h)  # the Trainer's own


def test_report_to_tensorboard_gets_the_numbers_when_the_callback_goes_first(tmp_path, hf_args):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    mon = Monitor(tiny_albert(), BATCH, diagnostics=["updates"], every=2)
    hf_train(hf_args, mon, first=True, report_to="tensorboard")
    (events,) = tmp_path.glob("runs/*/events.out.tfevents.*")  # the Trainer's own writer
    ea = EventAccumulator(str(events), size_guidance={"scalars": 0})
    ea.Reload()
    got = {e.step: e.value for e in ea.Scalars("train/loopprobe/probe_loss")}
    want = framed(mon, "probe_loss")
    assert sorted(got) == sorted(want) == [2, 4]
    assert all(math.isclose(got[s], want[s], rel_tol=1e-6) for s in want)


def test_an_hf_resume_from_a_checkpoint_continues_the_monitors_frame_and_phase(tmp_path, hf_args):
    diag = {"updates": 1, "increments": 2}  # increments on every 2nd monitored step
    first = Monitor(tiny_albert(), BATCH, diagnostics=diag, every=1)
    hf_train(hf_args, first, max_steps=1, save_strategy="steps", save_steps=1)
    ckpt = tmp_path / "checkpoint-1"
    saved = json.loads((ckpt / "trainer_state.json").read_text())["stateful_callbacks"]
    assert saved["MonitorCallback"]["attributes"]["monitor_state"]["runs"] == 1

    again = Monitor(tiny_albert(), BATCH, diagnostics=diag, every=1)  # a new process's
    hf_train(hf_args, again, resume=str(ckpt), max_steps=3)
    assert sorted(framed(again, "probe_loss")) == [1, 2, 3]
    assert framed(again, "probe_loss")[1] == framed(first, "probe_loss")[1]
    assert sorted(framed(again, "growth")) == [1, 3]  # the phase went on: not at step 2


def test_a_process_other_than_the_main_one_neither_monitors_nor_logs():
    import transformers

    from loopprobe.integrations.huggingface import MonitorCallback

    mon = Monitor(tiny_albert(), BATCH, diagnostics=["updates"], every=1)
    cb = MonitorCallback(mon)
    state = transformers.TrainerState(global_step=1, is_world_process_zero=False)
    control = cb.on_step_end(None, state, transformers.TrainerControl())
    cb.on_log(None, state, control, logs={})
    assert mon.frame.empty and state.log_history == []
    assert control.should_log  # every process logs the step: the Trainer gathers the loss


def test_a_dict_or_batch_encoding_probe_batch_with_the_models_own_loss_works_in_the_monitor():
    import transformers

    model = tiny_albert()
    for batch in (BATCH, transformers.BatchEncoding(BATCH)):
        mon = Monitor(model, batch, diagnostics=["updates", "increments"], every=1)
        rows = mon.step(0)
        with torch.no_grad():
            own = float(model(**BATCH).loss)
        got = rows[rows.quantity == "probe_loss"].value.tolist()
        assert len(got) == 1 and math.isclose(got[0], own, rel_tol=1e-6)
        assert not rows.quantity.str.endswith("_failed").any()
        assert rows[rows.quantity == "G_norm"].visit.tolist() == [0, 1, 2]


# -------------------------------------------------------------------------------- Lightning


PROBE, PROBE_TGT = lp.tasks.random_tokens(2, 6, 16, generator=torch.Generator().manual_seed(2))


def probe_loss(out, inputs):
    return F.cross_entropy(out.flatten(0, 1), PROBE_TGT.flatten())


def lightning_fit(lit, mon, max_steps, data, ckpt_path=None, **kw):
    import lightning.pytorch as pl

    from loopprobe.integrations.lightning import MonitorCallback

    base = dict(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    callbacks = [MonitorCallback(mon), *kw.pop("callbacks", [])]
    trainer = pl.Trainer(max_steps=max_steps, callbacks=callbacks, **{**base, **kw})
    trainer.fit(lit, data, ckpt_path=ckpt_path)
    return trainer


def test_under_gradient_accumulation_lightning_records_the_loss_and_logs_to_its_loggers(tmp_path):
    import pandas as pd
    from lightning.pytorch.loggers import CSVLogger

    # lr=0: the parameters stay put, so every training batch (the probe batch itself) has
    # exactly the probe loss the monitor measures after the step
    probe = torch.utils.data.TensorDataset(PROBE.repeat(3, 1), PROBE_TGT.repeat(3, 1))
    data = torch.utils.data.DataLoader(probe, batch_size=2)
    lit = lit_module(lr=0.0)
    mon = Monitor(lit.model, PROBE, probe_loss, diagnostics=["updates"], every=1)
    logger = CSVLogger(tmp_path, name="csv")
    lightning_fit(lit, mon, 3, data, accumulate_grad_batches=2, logger=logger)
    loss, probe_l = framed(mon, "loss"), framed(mon, "probe_loss")
    assert sorted(loss) == [1, 2, 3]
    assert all(math.isclose(loss[s], probe_l[s], rel_tol=1e-6) for s in loss)
    metrics = pd.read_csv(f"{logger.log_dir}/metrics.csv")
    got = metrics.dropna(subset=["loopprobe/probe_loss"])
    assert dict(zip(got.step, got["loopprobe/probe_loss"], strict=True)) == pytest.approx(probe_l)


def test_a_lightning_resume_from_a_checkpoint_keeps_the_monitors_rows_and_phase(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    idx, tgt = lp.tasks.random_tokens(8, 6, 16, generator=torch.Generator().manual_seed(1))
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(idx, tgt), batch_size=2)
    diag = {"updates": 1, "increments": 2}
    lit = lit_module(lr=0.5)
    first = Monitor(lit.model, PROBE, probe_loss, diagnostics=diag, every=1)
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1)
    lightning_fit(lit, first, 1, data, callbacks=[ckpt], enable_checkpointing=True)
    path = tmp_path / "epoch=0-step=1.ckpt"

    lit = lit_module(lr=0.5)
    again = Monitor(lit.model, PROBE, probe_loss, diagnostics=diag, every=1)
    lightning_fit(lit, again, 3, data, ckpt_path=str(path))
    assert sorted(framed(again, "probe_loss")) == [1, 2, 3]
    assert framed(again, "probe_loss")[1] == framed(first, "probe_loss")[1]
    assert sorted(framed(again, "growth")) == [1, 3]  # not at step 2: the phase went on


# --------------------------------------------------------- a monitor that is safe to leave on


class Curriculum(nn.Module):
    """A looped block that switches on an input injection at ``inject_from``:
    ``h <- h + block(h)`` before, ``h <- block(inject([h, e]))`` after (increments of the
    latter are undecided: the next visit reads neither the output nor input + output)."""

    def __init__(self, inject_from: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.emb, self.head = nn.Embedding(16, 8), nn.Linear(8, 16)
        self.block = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
        self.inject, self.drop = nn.Linear(16, 8), nn.Dropout(0.1)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        self.inject_from, self.step = inject_from, 0

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        e = self.emb(idx)
        h = e
        for _ in range(3):
            if self.step >= self.inject_from:
                h = self.block(self.inject(torch.cat([h, e], -1)))
            else:
                h = h + self.block(h)
        return self.head(self.drop(h))


def next_token(out, inputs):
    return F.cross_entropy(out[:, :-1].flatten(0, 1), inputs[:, 1:].flatten())


def train_curriculum(model: Curriculum, mon: Monitor | None, steps: int = 5) -> None:
    torch.manual_seed(5)  # dropout draws from the global RNG: the monitor must not touch it
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(6)
    model.train()
    for step in range(steps):
        model.step = step
        idx = torch.randint(0, 16, (4, 6), generator=gen)
        opt.zero_grad()
        next_token(model(idx), idx).backward()
        opt.step()
        if mon is not None:
            mon.step(step)


@pytest.mark.parametrize(
    "inject_from, sublayers, first_failure",
    [(0, ["block"], 0), (2, ["block"], 2)],  # the crashes users reported (the default
    # probe of this model now measures the carried stream: tests/test_inject_increments.py)
)
def test_a_diagnostic_that_fails_mid_run_is_rows_and_one_warning_and_the_training_is_unchanged(
    inject_from, sublayers, first_failure
):
    plain = Curriculum(inject_from)
    train_curriculum(plain, None)
    model = Curriculum(inject_from)
    mon = Monitor(model, PROBE, next_token, every=1, sublayers=sublayers)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train_curriculum(model, mon)
    for a, b in zip(plain.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)  # bit-identical to the unmonitored run
    ours = [w for w in caught if "diagnostic 'increments' failed" in str(w.message)]
    assert len(ours) == 1 and issubclass(ours[0].category, RuntimeWarning)
    f = mon.frame
    failed = f[f.quantity == "increments_failed"]
    assert failed.step.tolist() == list(range(first_failure, 5))
    assert failed.value.isna().all() and (~failed.converged).all()
    assert "reason" in f and failed.reason.str.startswith("ValueError: increments:").all()
    assert sorted(set(f[f.quantity == "probe_loss"].step)) == list(range(5))  # updates ran
    assert [s for s, n, _ in mon.errors] == list(range(first_failure, 5))


def test_strict_raises_the_diagnostics_error_in_the_training_loop():
    model = Curriculum(0)
    mon = Monitor(model, PROBE, next_token, every=1, strict=True, sublayers=["block"])
    with pytest.raises(ValueError, match="increments: cannot tell whether sublayer 'block'"):
        mon.step(0)


def test_a_budget_keeps_the_monitors_share_of_wall_time_within_it(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(monitor_module, "_clock", lambda: now[0])

    def costly(metrics):  # a sink (inside the monitor's timed call) that takes 5 s
        now[0] += 5.0

    mon = Monitor(Curriculum(99), PROBE, next_token, every=1, budget=0.25, sinks=[costly])
    ran = []
    for step in range(60):
        now[0] += 1.0  # a training step takes 1 s
        spent_before = 5.0 * len(ran)
        if mon.step(step) is not None:
            assert spent_before <= 0.25 * (now[0] - 1.0)  # it starts only within budget
            ran.append(step)
    assert mon.skipped == [s for s in range(60) if s not in ran]
    share = 5.0 * len(ran) / now[0]
    assert 0.15 < share <= 0.25 + 5.0 / now[0]
    assert sorted(set(mon.frame.step)) == ran
