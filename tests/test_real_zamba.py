"""Hugging Face Zamba (``transformers.ZambaForCausalLM``), probed unchanged.

What its code does (``transformers/models/zamba/modeling_zamba.py``, 5.24.0): every
``hybrid`` entry of ``config.layers_block_type`` is a ``ZambaHybridLayer`` that builds
its *own* ``ZambaAttentionDecoderLayer`` (``shared_transf``), then ``post_init`` ties the
parameters of all of them to the first one (``_tied_weights_keys``). So the shared
attention block is one set of Parameter objects held by several module instances, each
called once: no module is called twice. It reads the concatenation of the stream and the
original embeddings; its output goes through a per-layer (untied) ``linear`` into that
layer's Mamba block. The RMSNorms compute in float32.

Expected visit table (5 layers, hybrid at 2 and 4 for this config): one sublayer named
after the first instance, ``model.layers.2.shared_transf``, whose modules are both
instances, with 2 visits, both reaching the logits. No module holds a round (the Mamba
layers between the visits are not tied), so there is no spectral radius to take.
"""

from __future__ import annotations

import numpy as np
import pytest
from _oracles import counting_calls
from realmodels import EXACT, LANCZOS, PLAIN, make_zamba

import loopprobe.testing as lpt
from loopprobe.estimate.sensitivity import sensitivity_norms


def shared_instances(model) -> list[str]:
    return [n for n, m in model.named_modules() if n.endswith(".shared_transf")]


def test_visit_table_is_one_shared_block_held_by_two_instances_each_called_once():
    case = make_zamba()
    names = shared_instances(case.model)
    assert names == ["model.layers.2.shared_transf", "model.layers.4.shared_transf"]
    a, b = (case.model.get_submodule(n) for n in names)
    assert a is not b and all(p is q for p, q in zip(a.parameters(), b.parameters(), strict=True))
    with counting_calls(a) as calls_a, counting_calls(b) as calls_b:
        case.model(case.inputs)
    assert (calls_a, calls_b) == ([True], [True])
    table = case.probe().visit_table(case.inputs, output=case.output)
    assert list(table.sublayer) == [names[0]]
    assert table.modules[0] == ",".join(names)
    assert int(table.parameters[0]) == sum(p.numel() for p in a.parameters())
    assert (int(table.visits[0]), int(table.grad_visible[0])) == (2, 2)
    assert (table.attrs["M"], table.attrs["M_g"]) == (2, 2)


def test_sum_of_per_visit_updates_is_the_tied_gradient():
    make_zamba().check(lpt.check_updates_sum_to_tied_gradient, loss=True, rtol=EXACT)


def test_each_per_visit_update_is_the_gradient_of_an_explicitly_untied_copy():
    compared = len(make_zamba().check(lpt.check_updates_match_untied_copy, loss=True, rtol=EXACT))
    assert compared == 2


def test_one_visit_sensitivity_is_the_top_singular_value_of_the_dense_jacobian():
    # float32 RMSNorms inside a float64 model: about 1e-7 relative roundoff on both sides.
    make_zamba().check(
        lpt.check_sensitivity_matches_dense_jacobian, output=True, rtol=1e-5, **LANCZOS
    )


def test_kappa_lies_between_zero_and_the_two_visits():
    rep = make_zamba().check(
        lpt.check_kappa_in_range, loss=True, output=True, slack=1e-9, **LANCZOS
    )
    assert list(rep.sublayers.R_g) == [2]


def test_increments_run_with_finite_norms():
    inc = make_zamba().increments()
    assert np.isfinite(inc.inc_norm).all() and len(inc.inc_norm) == len(inc.visits) > 0
    assert len(inc.visits) == 2


def test_probing_leaves_the_model_bit_identical():
    make_zamba().check(lpt.check_probe_leaves_model_unchanged, loss=True, output=True, **PLAIN)


def test_default_power_iteration_agrees_with_lanczos_despite_the_float32_norms():
    # The precision floor on this path is float32 (the RMSNorms), not the parameters'
    # float64: the adjointness check and the stopping rule must use it (no false alarm,
    # no endless iteration), and both estimators must land on the same norms.
    case = make_zamba()
    p = case.probe()
    power = sensitivity_norms(p, case.inputs, output=case.output)
    lanczos = sensitivity_norms(p, case.inputs, output=case.output, method="lanczos")
    assert all(e.converged for e in power.visit_norms)
    for a, b in zip(power.visit_norms, lanczos.visit_norms, strict=True):
        assert a.value == pytest.approx(b.value, rel=1e-5)
