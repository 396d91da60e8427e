"""WandbSink on a real offline wandb run, read back with wandb's own reader of the run's
.wandb log (``wandb leet inspect --json``): a step metric that leaves the user's own
``wandb.log`` steps alone, one chart per per-visit quantity instead of one per visit,
heat-map images, and far fewer keys than ``sinks=[wandb.log]``. TensorBoard's custom
scalars layout, read back from the event file, groups each quantity's visits in one chart."""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys

import pandas as pd
import pytest
import torch
import torch.nn.functional as F

import loopprobe as lp
from loopprobe.monitor.monitor import Monitor
from loopprobe.monitor.sinks import TensorBoardSink
from loopprobe.monitor.wandb_sink import WandbSink

wandb = pytest.importorskip("wandb")

STEPS = 4
IDX, TGT = lp.tasks.random_tokens(2, 6, 16, generator=torch.Generator().manual_seed(1))
PER_VISIT = {"G_norm", "cos_G_prev", "inc_rms"}  # the default diagnostics' per-visit rows


def tiny() -> lp.models.LoopedGPT:
    cfg = lp.models.GPTConfig(
        K=1, R=3, d_model=8, n_heads=2, seq_len=6, vocab_size=16, norm="deeploop"
    )
    return lp.models.LoopedGPT(cfg, generator=torch.Generator().manual_seed(0)).double()


def loss_fn(out: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), TGT.flatten())


def train_and_watch(mon: Monitor, log=None) -> None:
    """STEPS SGD steps; ``log`` (the user's own wandb.log) is called before each mon.step."""
    model = mon.model
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    gen = torch.Generator().manual_seed(2)
    for s in range(STEPS):
        idx, tgt = lp.tasks.random_tokens(2, 6, 16, generator=gen)
        opt.zero_grad()
        loss = F.cross_entropy(model(idx).flatten(0, 1), tgt.flatten())
        loss.backward()
        opt.step()
        if log is not None:
            log({"train/loss": loss.item()})
        mon.step(s, loss=loss)
    mon.close()


def offline_run(where):
    settings = wandb.Settings(console="off", silent=True, x_disable_stats=True, save_code=False)
    return wandb.init(mode="offline", dir=str(where), project="loopprobe-test", settings=settings)


def records(run_dir) -> list[dict]:
    """The run's records, through wandb's own reader of its .wandb transaction log."""
    cmd = [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(run_dir)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=60)
    return [json.loads(line) for line in out.stdout.splitlines() if line.strip()]


def names(item: dict, prefix: str) -> set[str]:
    """Logged names under ``prefix/``: media (``<name>._type``) once, scalars as they are."""
    media = {k[: -len("._type")] for k in item if k.endswith("._type")}
    plain = {k for k in item if not any(k.startswith(m + ".") for m in media)}
    return {k for k in media | plain if k.startswith(prefix + "/")}


@pytest.fixture(scope="module")
def logged(tmp_path_factory):
    """One offline run: the user's own wandb.log, the old ``sinks=[wandb.log]`` (prefix
    ``loopprobe``) and two WandbSinks (prefixes ``grouped``, ``late``) on the same steps."""
    where = tmp_path_factory.mktemp("wandb")
    run = offline_run(where)
    try:
        grouped = WandbSink(prefix="grouped", charts_every=3)  # charts at writes 0 and 3
        late = WandbSink(run, prefix="late", step_metric="train/global_step", charts_every=10)
        mon = Monitor(tiny(), IDX, loss_fn, every=1, sinks=[wandb.log, grouped, late])
        train_and_watch(mon, log=run.log)
        run_dir = pathlib.Path(run.dir).parent  # run.dir is <run dir>/files
    finally:
        run.finish()
    return mon, records(run_dir), run_dir


def history(recs: list[dict]) -> list[dict]:
    return [r["history"]["item"] for r in recs if r["type"] == "history"]


def test_wandb_sink_defines_a_hidden_step_metric_and_plots_its_keys_against_it(logged):
    _, recs, _ = logged
    metrics = [r["metric"] for r in recs if r["type"] == "metric"]
    step = [m for m in metrics if m.get("name") == "grouped/step"]
    assert len(step) == 1 and step[0]["options"].get("hidden") is True
    glob = [m for m in metrics if m.get("glob_name") == "grouped/*"]
    assert len(glob) == 1 and glob[0]["step_metric"] == "grouped/step"
    steps = [h["grouped/step"] for h in history(recs) if "grouped/step" in h]
    assert steps == list(range(STEPS))  # close() had nothing left to draw


def test_the_users_own_wandb_log_rows_all_land_next_to_the_sinks(logged):
    mon, recs, _ = logged
    rows = history(recs)
    assert len([h for h in rows if "train/loss" in h]) == STEPS  # wandb dropped none of them
    probe_loss = [h["grouped/probe_loss"] for h in rows if "grouped/probe_loss" in h]
    f = mon.frame
    assert probe_loss == pytest.approx(f[f.quantity == "probe_loss"].value.tolist(), rel=1e-12)


def test_per_visit_values_are_one_chart_per_quantity_not_one_key_per_visit(logged):
    mon, recs, _ = logged
    rows = history(recs)
    new = set().union(*(names(h, "grouped") for h in rows))
    old = set().union(*(names(h, "loopprobe") for h in rows))
    assert all("step" in h for h in rows if "loopprobe/loss" in h)  # a chart of its own, too
    old.add("step")
    assert not [k for k in new if re.search(r"/r\d+$", k)]
    charts = {f"grouped/visits/{q}_table" for q in PER_VISIT}
    assert charts | {"grouped/heatmap/G_norm"} <= new
    f = mon.frame
    level = f[(f.step == 0) & f.visit.isna()]  # model- and sublayer-level rows: scalars
    assert len(new) == len(level) + 1 + len(PER_VISIT) + 1  # + step metric, charts, heat map
    assert len(old) == (f.step == 0).sum() + 1  # one key per row, plus "step"
    assert (len(old), len(new)) == (28, 16)  # the tiny model: K=1, R=3, two sublayers
    config = [r["config"]["update"] for r in recs if r["type"] == "config"]
    shown = {k for c in config for k in c if k.startswith("_wandb.visualize.grouped/")}
    assert shown == {f"_wandb.visualize.grouped/visits/{q}" for q in PER_VISIT}


def test_each_line_series_table_holds_every_visits_values_of_all_steps(logged):
    mon, recs, run_dir = logged
    last = [h for h in history(recs) if "grouped/visits/G_norm_table.path" in h][-1]
    table = json.loads((run_dir / "files" / last["grouped/visits/G_norm_table.path"]).read_text())
    assert table["columns"] == ["step", "lineKey", "lineVal"]
    got = pd.DataFrame(table["data"], columns=["step", "line", "value"])
    f = mon.frame[mon.frame.quantity == "G_norm"]
    want = pd.DataFrame({"step": f.step, "line": f.sublayer + " r" + f.visit.astype(str)})
    want["value"] = f.value.to_numpy()
    key = ["line", "step"]
    got, want = got.sort_values(key, ignore_index=True), want.sort_values(key, ignore_index=True)
    pd.testing.assert_frame_equal(got, want, check_dtype=False, rtol=1e-12)
    assert sorted(set(got.step)) == list(range(STEPS))  # close() drew the last step too


def test_heat_maps_are_png_images_drawn_every_nth_write(logged):
    _, recs, run_dir = logged
    drawn = [h for h in history(recs) if "grouped/heatmap/G_norm.path" in h]
    assert [h["grouped/step"] for h in drawn] == [0, 3]  # charts_every=3 over steps 0..3
    png = run_dir / "files" / drawn[-1]["grouped/heatmap/G_norm.path"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert drawn[-1]["grouped/heatmap/G_norm.width"] > 100


def test_close_logs_the_charts_of_the_steps_after_the_last_chart_write(logged):
    _, recs, _ = logged
    rows = history(recs)
    grouped = [h["grouped/step"] for h in rows if "grouped/visits/inc_rms_table.nrows" in h]
    assert grouped == [0, 3]  # close() added nothing: the last write drew the charts
    late = [h for h in rows if "late/visits/inc_rms_table.nrows" in h]
    assert [h["train/global_step"] for h in late] == [0, 3]  # write 0, then close() at step 3
    assert late[-1]["late/visits/inc_rms_table.nrows"] == 2 * 3 * STEPS  # sublayers, visits, steps


def test_a_step_metric_of_the_users_is_shared_and_not_hidden(logged):
    _, recs, _ = logged
    metrics = [r["metric"] for r in recs if r["type"] == "metric"]
    assert {"name": "train/global_step", "options": {"defined": True}} in metrics
    late = [m for m in metrics if m.get("glob_name") == "late/*"]
    assert len(late) == 1 and late[0]["step_metric"] == "train/global_step"


def test_wandb_sink_without_an_active_run_or_with_bad_arguments_names_the_fix():
    assert wandb.run is None
    with pytest.raises(ValueError, match=r"WandbSink: no wandb run is active; call wandb.init"):
        WandbSink()
    with pytest.raises(TypeError, match=r"WandbSink: run=.* has no log/define_metric"):
        WandbSink(run=object())
    with wandb.init(mode="disabled") as run, pytest.raises(ValueError, match=r"=0; pass >= 1"):
        WandbSink(run=run, charts_every=0)


def test_importing_the_wandb_sink_does_not_load_wandb():
    code = "import sys, loopprobe.monitor.wandb_sink\n"
    code += "print(sorted({m.split('.')[0] for m in sys.modules}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert not {"wandb", "matplotlib", "tensorboard"} & set(eval(out.stdout))


# ------------------------------------------------------------------------ TensorBoard


def layouts(log_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.custom_scalar import layout_pb2, metadata
    from tensorboard.util import tensor_util

    ea = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    ea.Reload()
    events = ea.Tensors(metadata.CONFIG_SUMMARY_TAG)
    found = [
        layout_pb2.Layout.FromString(tensor_util.make_ndarray(e.tensor_proto).item())
        for e in events
    ]
    return found, set(ea.Tags()["scalars"])


def test_the_tensorboard_layout_draws_each_per_visit_quantitys_tags_in_one_chart(tmp_path):
    mon = Monitor(
        tiny(), IDX, loss_fn, every=1, sinks=[TensorBoardSink(tmp_path, heatmap_every=99)]
    )
    train_and_watch(mon)
    found, tags = layouts(tmp_path)
    assert len(found) == 1  # written once: no new per-visit quantity after step 0
    (category,) = found[-1].category
    assert category.title == "loopprobe per visit"
    f = mon.frame[mon.frame.visit.notna()]
    for chart in category.chart:
        (regex,) = chart.multiline.tag
        sub = f[f.quantity == chart.title]
        want = set("loopprobe/" + sub.quantity + "/" + sub.sublayer + "/r" + sub.visit.astype(str))
        assert {t for t in tags if re.search(regex, t)} == want and want
    assert {c.title for c in category.chart} == PER_VISIT


def test_a_per_visit_quantity_that_appears_later_is_added_to_the_layout(tmp_path):
    rows = Monitor(tiny(), IDX, loss_fn, diagnostics=["kappa"], every=1).step(0)
    sink = TensorBoardSink(tmp_path, heatmap_every=99)
    sink.write(0, rows[rows.quantity != "U_norm"])
    sink.write(1, rows)
    sink.close()
    found, _ = layouts(tmp_path)
    assert [sorted(c.title for c in lay.category[0].chart) for lay in found] == [
        ["G_norm", "cos_G_prev"],
        ["G_norm", "U_norm", "cos_G_prev"],
    ]
