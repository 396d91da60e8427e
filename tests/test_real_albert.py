"""Hugging Face ALBERT (``transformers.AlbertModel``), probed unchanged.

What its code does (``transformers/models/albert/modeling_albert.py``, 5.24.0):
``AlbertTransformer.forward`` loops ``for i in range(num_hidden_layers)`` and calls
``albert_layer_groups[group_idx]`` with ``group_idx = i // (num_hidden_layers //
num_hidden_groups)``. With one group (the published ALBERT configs) the single module
``encoder.albert_layer_groups.0`` (one ``AlbertLayer``: attention + FFN + two LayerNorms)
is called once per layer, R = num_hidden_layers times, each call feeding the next: a
round. Embeddings, the embedding projection and the pooler run once. The model attends
through ``F.scaled_dot_product_attention`` (the default ``sdpa`` implementation).

Expected visit table: one sublayer, ``encoder.albert_layer_groups.0``, with R visits,
all gradient-visible (F = ``last_hidden_state`` reads the last call, which reads all).
"""

from __future__ import annotations

import numpy as np
from _oracles import counting_calls
from realmodels import EXACT, LANCZOS, PLAIN, make_albert

import loopprobe.testing as lpt

R = 3
GROUP = "encoder.albert_layer_groups.0"


def test_visit_table_is_one_layer_group_visited_once_per_layer():
    case = make_albert(R)
    with counting_calls(case.model.get_submodule(GROUP)) as calls:
        case.model(case.inputs)
    assert calls == [True] * R  # the code, read independently
    table = case.probe().visit_table(case.inputs, output=case.output)
    assert list(table.sublayer) == [GROUP]
    group_params = sum(p.numel() for p in case.model.get_submodule(GROUP).parameters())
    assert list(table.parameters) == [group_params]
    assert (int(table.visits[0]), int(table.grad_visible[0]), int(table.no_grad_visits[0])) == (
        R,
        R,
        0,
    )
    assert (table.attrs["M"], table.attrs["M_g"]) == (R, R)


def test_sum_of_per_visit_updates_is_the_tied_gradient():
    make_albert(R).check(lpt.check_updates_sum_to_tied_gradient, loss=True, rtol=EXACT)


def test_each_per_visit_update_is_the_gradient_of_an_explicitly_untied_copy():
    compared = len(make_albert(R).check(lpt.check_updates_match_untied_copy, loss=True, rtol=EXACT))
    assert compared == R


def test_one_visit_sensitivity_is_the_top_singular_value_of_the_dense_jacobian():
    make_albert(R).check(lpt.check_sensitivity_matches_dense_jacobian, output=True, **LANCZOS)


def test_kappa_lies_between_zero_and_the_number_of_layers():
    rep = make_albert(R).check(
        lpt.check_kappa_in_range, loss=True, output=True, slack=1e-9, **LANCZOS
    )
    assert list(rep.sublayers.R_g) == [R]


def test_increments_run_with_finite_norms():
    inc = make_albert(R).increments()
    assert np.isfinite(inc.inc_norm).all() and len(inc.inc_norm) == len(inc.visits) > 0
    assert len(inc.visits) == R


def test_spectral_radius_of_the_replayed_layer_round_is_the_dense_one():
    make_albert(R).check(lpt.check_spectral_radius_matches_dense, GROUP)


def test_probing_leaves_the_model_bit_identical():
    make_albert(R).check(
        lpt.check_probe_leaves_model_unchanged, loss=True, output=True, round_module=GROUP, **PLAIN
    )


def test_without_output_F_is_the_hugging_face_last_hidden_state():
    from loopprobe.estimate.sensitivity import sensitivity_norms

    case = make_albert(R)
    probe = case.probe()
    table = probe.visit_table(case.inputs)  # no output=: BaseModelOutput -> .last_hidden_state
    assert (table.attrs["M"], table.attrs["M_g"]) == (R, R)
    plain = sensitivity_norms(probe, case.inputs, method="lanczos", tol=1e-12)
    named = sensitivity_norms(probe, case.inputs, output=case.output, method="lanczos", tol=1e-12)
    assert [e.value for e in plain.visit_norms] == [e.value for e in named.visit_norms]
