"""The Hugging Face callback as a Trainer user expects it, on a real transformers.Trainer:
one call (``add_to``) puts loopprobe's numbers into ``report_to``'s TensorBoard, where the
documented ``callbacks=[...]`` gives none; ``per_visit=False`` keeps the per-visit numbers
out of the Trainer's logs; ``state_rows`` caps the frame rows each checkpoint rewrites."""

from __future__ import annotations

import json
import math

import pytest
import torch
from test_integrations_ecosystem import BATCH, GROUP, framed
from test_monitor_integrations import Tokens, tiny_albert

from loopprobe.monitor.monitor import Monitor
from loopprobe.monitor.sinks import typed_frame


def trainer_for(hf_args, mon, callbacks=None, **kw):
    """A transformers.Trainer of 4 steps on the monitor's model (``hf_args``: conftest's)."""
    import transformers

    args = hf_args(**{"max_steps": 4, "seed": 0, **kw})
    return transformers.Trainer(
        model=mon.model, args=args, train_dataset=Tokens(), callbacks=callbacks
    )


def tensorboard_tags(tmp_path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = tmp_path.glob("runs/*/events.out.tfevents.*")  # the Trainer's own writer
    ea = EventAccumulator(str(events), size_guidance={"scalars": 0})
    ea.Reload()
    return {t: {e.step: e.value for e in ea.Scalars(t)} for t in ea.Tags()["scalars"]}


def test_add_to_puts_the_numbers_into_report_tos_tensorboard_without_per_visit_ones(
    tmp_path, hf_args
):
    from loopprobe.integrations.huggingface import MonitorCallback

    mon = Monitor(tiny_albert(), BATCH, diagnostics=["updates"], every=2)
    trainer = trainer_for(hf_args, mon, report_to="tensorboard")
    cb = MonitorCallback(mon, per_visit=False)
    assert cb.add_to(trainer) is cb and trainer.callback_handler.callbacks[0] is cb
    trainer.train()
    tags = tensorboard_tags(tmp_path)
    want = framed(mon, "probe_loss")
    assert sorted(want) == [2, 4]
    got = tags["train/loopprobe/probe_loss"]
    assert sorted(got) == [2, 4] and all(math.isclose(got[s], want[s], rel_tol=1e-6) for s in want)
    tied = framed(mon, "G_tied", GROUP)
    got = tags[f"train/loopprobe/G_tied/{GROUP}"]
    assert all(math.isclose(got[s], tied[s], rel_tol=1e-6) for s in tied)
    assert not [t for t in tags if "/r0" in t or "G_norm" in t]  # per_visit=False
    assert not [k for h in trainer.state.log_history for k in h if k.endswith("/r1")]
    assert (mon.frame.quantity == "G_norm").sum() == 2 * 3  # the frame keeps every visit


def test_the_callback_passed_in_callbacks_leaves_tensorboard_without_loopprobe_tags(
    tmp_path, hf_args
):
    """The first recipe users write: why add_to exists (if transformers ever ran user
    callbacks first, this test says add_to is no longer needed)."""
    from loopprobe.integrations.huggingface import MonitorCallback

    mon = Monitor(tiny_albert(), BATCH, diagnostics=["updates"], every=2)
    trainer_for(hf_args, mon, [MonitorCallback(mon)], report_to="tensorboard").train()
    assert sorted(framed(mon, "probe_loss")) == [2, 4]
    assert not [t for t in tensorboard_tags(tmp_path) if "loopprobe" in t]


def test_add_to_moves_a_callback_already_passed_in_callbacks_to_the_front_once(tmp_path, hf_args):
    from loopprobe.integrations.huggingface import MonitorCallback

    mon = Monitor(tiny_albert(), BATCH, diagnostics=["updates"], every=2)
    cb = MonitorCallback(mon)
    trainer = trainer_for(hf_args, mon, [cb], report_to="tensorboard")
    cb.add_to(trainer)
    callbacks = trainer.callback_handler.callbacks
    assert callbacks[0] is cb and sum(c is cb for c in callbacks) == 1
    trainer.train()
    assert sorted(tensorboard_tags(tmp_path)["train/loopprobe/probe_loss"]) == [2, 4]
    with pytest.raises(TypeError, match="expected a transformers.Trainer"):
        cb.add_to(object())


def test_each_checkpoint_carries_at_most_state_rows_latest_rows_and_resumes_from_them(
    tmp_path, hf_args
):
    from loopprobe.integrations.huggingface import MonitorCallback

    first = Monitor(tiny_albert(), BATCH, diagnostics={"updates": 1, "increments": 2}, every=1)
    trainer = trainer_for(hf_args, first, save_strategy="steps", save_steps=1, max_steps=3)
    MonitorCallback(first, state_rows=20).add_to(trainer)
    trainer.train()
    saved = json.loads((tmp_path / "checkpoint-3" / "trainer_state.json").read_text())
    state = saved["stateful_callbacks"]["MonitorCallback"]["attributes"]["monitor_state"]
    rows = first.state_dict()["rows"]
    assert len(rows) > 20 and state["runs"] == 3
    assert typed_frame(state["rows"]).equals(typed_frame(rows[-20:]))  # the latest 20
    early = json.loads((tmp_path / "checkpoint-1" / "trainer_state.json").read_text())
    kept = early["stateful_callbacks"]["MonitorCallback"]["attributes"]["monitor_state"]["rows"]
    assert len(kept) == (first.frame.step == 1).sum() < 20  # fewer than the cap: all kept

    again = Monitor(tiny_albert(), BATCH, diagnostics={"updates": 1, "increments": 2}, every=1)
    trainer = trainer_for(hf_args, again, max_steps=4)
    MonitorCallback(again, state_rows=20).add_to(trainer)
    trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-3"))
    assert again.frame.iloc[:20].equals(first.frame.iloc[-20:].reset_index(drop=True))
    assert sorted(framed(again, "growth")) == [3]  # the phase went on: step 4 is the 4th run


@pytest.mark.parametrize(
    ("kw", "match"),
    [({"state_rows": -1}, "state_rows=-1"), ({"per_visit": "no"}, "per_visit must be")],
)
def test_bad_callback_options_are_named(kw, match):
    from loopprobe.integrations.huggingface import MonitorCallback

    mon = Monitor(tiny_albert(), BATCH, diagnostics=["updates"])
    with pytest.raises((TypeError, ValueError), match=match):
        MonitorCallback(mon, **kw)


def test_a_callback_built_from_arguments_judges_the_trainers_own_adamw_step(tmp_path, hf_args):
    # The Trainer's optimizer (AdamW inside accelerate's wrapper) becomes the monitor's
    # update=: its logged G at the last step is the AdamW-preconditioned per-visit update of
    # the weights and optimizer state the training ended with, not the raw gradient.
    import transformers

    import loopprobe as lp
    from loopprobe.integrations.huggingface import MonitorCallback

    model = tiny_albert()
    cb = MonitorCallback(inputs=BATCH, diagnostics=["updates"], every=3)
    args = hf_args(max_steps=3, seed=0)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens())
    cb.add_to(trainer)
    trainer.train()
    opt = cb.monitor.update
    assert type(opt) is torch.optim.AdamW and opt is trainer.optimizer.optimizer
    probe = lp.attach(model)
    adamw = lp.per_visit_updates(probe, BATCH, update=opt)
    j = adamw.sublayers.index(GROUP)
    raw = lp.per_visit_updates(probe, BATCH).norms(j).tolist()
    got = cb.monitor.frame
    got = got[(got.quantity == "G_norm") & (got.step == 3) & (got.sublayer == GROUP)]
    assert got.value.tolist() == pytest.approx(adamw.norms(j).tolist(), rel=1e-5)
    assert got.value.tolist() != pytest.approx(raw, rel=1e-2)


def test_update_given_to_the_callback_wins_and_an_unknown_optimizer_falls_back_with_a_warning(
    tmp_path, hf_args
):
    import transformers

    from loopprobe.integrations.huggingface import MonitorCallback

    cb = MonitorCallback(inputs=BATCH, diagnostics=["updates"], every=2, update="sgd")
    trainer = transformers.Trainer(model=tiny_albert(), args=hf_args(max_steps=2, seed=0),
                                   train_dataset=Tokens())  # fmt: skip
    cb.add_to(trainer)
    trainer.train()
    assert cb.monitor.update == "sgd"

    model = tiny_albert()
    rms = torch.optim.RMSprop(model.parameters(), lr=1e-3)
    cb = MonitorCallback(inputs=BATCH, diagnostics=["updates"], every=2)
    trainer = transformers.Trainer(model=model, args=hf_args(max_steps=2, seed=0),
                                   train_dataset=Tokens(), optimizers=(rms, None))  # fmt: skip
    cb.add_to(trainer)
    with pytest.warns(UserWarning, match=r"optimizer \(RMSprop\) has no per-visit update rule"):
        trainer.train()
    assert cb.monitor.update == "sgd"
