"""Closed forms of seed 002 (Eqs. 3-22) and the residual rules of seeds 003/004."""

import math
from fractions import Fraction

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

import loopprobe as lp
from loopprobe import theory

Ns = st.integers(min_value=1, max_value=10**6)
Ks = st.integers(min_value=1, max_value=64)
Rs = st.integers(min_value=1, max_value=256)


def close(a, b):
    return math.isclose(a, b, rel_tol=1e-12, abs_tol=0.0)


@given(Ns)
@example(1)
def test_deepnorm_ratio_is_one_over_two_sqrt_n_and_untied_bound_is_one_half(N):
    sc = theory.scales(N, "deepnorm")
    assert close(sc.alpha, (2 * N) ** 0.25)
    assert close(sc.beta, (8 * N) ** -0.25)
    assert sc.p == 0.25
    assert close(sc.ratio, 1 / (2 * math.sqrt(N)))
    assert close(theory.untied_bound(N, sc), 0.5)


@given(Ks, Rs)
@example(1, 1)
def test_deeploop_ratio_is_one_over_four_n_and_aligned_bound_is_one_over_eight_k(K, R):
    N = theory.unrolled_depth(K, R)
    sc = theory.scales(N, "deeploop")
    assert close(sc.alpha, math.sqrt(2 * N))
    assert close(sc.beta, 1 / math.sqrt(8 * N))
    assert close(sc.ratio, 1 / (4 * N))
    assert close(theory.aligned_tied_bound(K, R, sc), 1 / (8 * K))
    # untied bound under DeepLoop decays like 1/N: 2N / (16 N^2) = 1/(8N)
    assert close(theory.untied_bound(N, sc), 1 / (8 * N))


@given(Ks, Rs)
def test_deepnorm_aligned_tied_bound_is_r_over_two(K, R):
    sc = theory.scales(theory.unrolled_depth(K, R), "deepnorm")
    assert close(theory.aligned_tied_bound(K, R, sc), R / 2)


@given(Ks, Rs)
def test_visit_count_is_two_k_r_and_twice_the_unrolled_depth(K, R):
    assert theory.unrolled_depth(K, R) == K * R
    assert theory.visit_count(K, R) == 2 * K * R == 2 * theory.unrolled_depth(K, R)


@given(Ns, st.floats(min_value=0.01, max_value=2.0), st.floats(0.5, 4.0), st.floats(0.5, 16.0))
def test_postp_family_ratio_is_cd_to_minus_p_times_n_to_minus_two_p(N, p, c, d):
    sc = theory.scales(N, "postp", p=p, c=c, d=d)
    assert math.isclose(sc.ratio, (c * d) ** -p * N ** (-2 * p), rel_tol=1e-9)
    assert sc.p == p


def test_postp_at_one_quarter_and_one_half_reproduces_deepnorm_and_deeploop():
    for p, name in [(0.25, "deepnorm"), (0.5, "deeploop")]:
        assert theory.scales(12, "postp", p=p) == theory.scales(12, name)


@pytest.mark.parametrize("norm", ["pre", "post", "none"])
def test_unscaled_norms_have_alpha_beta_one_and_p_zero(norm):
    assert theory.scales(17, norm) == theory.Scales(alpha=1.0, beta=1.0, p=0.0)
    assert theory.scales(17, norm).ratio == 1.0


def test_bound_is_m_kappa_ratio_squared_and_kappa_one_is_the_untied_bound():
    assert theory.bound(16, 3.0, 0.5) == 16 * 3.0 * 0.25
    sc = theory.scales(8, "deepnorm")
    assert close(theory.bound(16, 1.0, sc.ratio), theory.untied_bound(8, sc))
    assert close(theory.bound(16, 4.0, sc.ratio), theory.aligned_tied_bound(2, 4, sc))


def test_exponent_threshold_is_one_quarter_decorrelated_and_one_half_aligned():
    assert theory.exponent_threshold(0) == 0.25
    assert theory.exponent_threshold(1) == 0.5
    assert theory.exponent_threshold(0.5) == 0.375


@given(Ks, st.floats(min_value=0.0, max_value=1.0), st.floats(min_value=0.05, max_value=1.0))
def test_bound_exponent_matches_log_log_slope_of_the_bound_in_n(K, gamma, p):
    # kappa_R = R^gamma with R = N/K: slope of log(M kappa ratio^2) vs log N at fixed K
    def value(R):
        N = K * R
        return theory.bound(2 * N, R**gamma, theory.scales(N, "postp", p=p).ratio)

    slope = math.log(value(1024) / value(32)) / math.log(1024 / 32)
    assert math.isclose(slope, theory.bound_exponent(p, gamma), abs_tol=1e-9)
    at_threshold = theory.bound_exponent(theory.exponent_threshold(gamma), gamma)
    assert abs(at_threshold) < 1e-12


def test_hierarchical_counts_for_a_small_hrm():
    h = theory.hierarchical_counts(C=3, K_H=1, C_L=4, K_L=2)
    assert h["M"] == 2 * 3 * (1 + 4 * 2) == 54
    assert h["M_g"] == 18 and h["M"] == 3 * h["M_g"]
    assert h["N_g"] == 9
    assert (h["J_H"], h["J_L"], h["J"]) == (2, 4, 6)
    assert (h["R_g_H"], h["R_g_L"]) == (1, 4)
    lo, hi = h["kappa_bar_range"]
    assert close(lo, 2 / 18)
    assert close(hi, 1 + 4 * 4 * 3 / 18)


@given(st.integers(1, 8), st.integers(1, 8), st.integers(1, 16), st.integers(1, 8))
@example(1, 1, 1, 1)
def test_eq21_range_ends_are_kappa_bar_at_kappa_l_zero_and_c_l(C, K_H, C_L, K_L):
    h = theory.hierarchical_counts(C, K_H, C_L, K_L)
    J_H, J_L, M_g = h["J_H"], h["J_L"], h["M_g"]
    assert M_g == J_H + J_L * C_L
    lo, hi = h["kappa_bar_range"]
    # exact rational check of the seed's closed form for the upper end
    assert Fraction(J_H + J_L * C_L**2, M_g) == 1 + Fraction(J_L * C_L * (C_L - 1), M_g)
    assert close(lo, J_H / M_g)
    assert close(hi, 1 + J_L * C_L * (C_L - 1) / M_g)
    assert close(theory.kappa_bar_g(J_H, J_L, C_L, 0.0, M_g), lo)
    assert close(theory.kappa_bar_g(J_H, J_L, C_L, float(C_L), M_g), hi)
    assert lo <= theory.kappa_bar_g(J_H, J_L, C_L, C_L / 2, M_g) <= hi


def test_one_inner_iterate_makes_kappa_bar_range_collapse_to_at_most_one():
    # C_L = 1: every sublayer has one gradient-visible visit, the untied regime
    lo, hi = theory.hierarchical_counts(2, 1, 1, 1)["kappa_bar_range"]
    assert close(hi, 1.0) and close(lo, 0.5)


@given(st.integers(1, 10**4), st.integers(1, 64), st.floats(0.1, 10.0))
def test_residual_multipliers_follow_their_closed_forms(N, L, lam):
    rm = theory.residual_multiplier
    assert rm("none", N) == 1.0
    assert close(rm("1/sqrt(N)", N), N**-0.5)
    assert close(rm("1/N", N), 1 / N)
    assert close(rm("loop-mup", N, L=L, lam=lam), lam / (N * math.sqrt(L)))
    assert close(rm("loop-mup", N), rm("1/N", N))


def test_allowed_tuples_list_every_scheme():
    assert theory.ALLOWED_NORMS == ("deepnorm", "deeploop", "postp", "pre", "post", "none")
    assert theory.ALLOWED_RESIDUALS == ("none", "1/sqrt(N)", "1/N", "loop-mup")
    for norm in theory.ALLOWED_NORMS:
        assert theory.scales(4, norm, p=0.3 if norm == "postp" else None).alpha > 0


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(N=0), ["N", "0", ">= 1"]),
        (dict(N=0.5, norm="deeploop"), ["N", "0.5"]),
        (dict(N=4, norm="layernorm"), ["norm", "layernorm", "deepnorm", "postp"]),
        (dict(N=4, norm="postp"), ["postp", "p=None"]),
        (dict(N=4, norm="postp", p=0.0), ["p", "0.0", "> 0"]),
        (dict(N=4, norm="postp", p=-1), ["p", "-1"]),
        (dict(N=4, norm="deepnorm", p=0.5), ["deepnorm", "0.25", "0.5", "postp"]),
        (dict(N=4, c=0.0), ["c", "0.0"]),
        (dict(N=float("nan")), ["N", "nan"]),
    ],
)
def test_scales_rejects_bad_input_naming_field_value_and_allowed(kwargs, words):
    with pytest.raises(ValueError) as info:
        theory.scales(**kwargs)
    message = str(info.value)
    assert message.startswith("scales:")
    for word in words:
        assert word in message


def test_counts_reject_zero_negative_and_non_integer_arguments():
    with pytest.raises(ValueError, match=r"visit_count: K must be an integer >= 1, got 0"):
        theory.visit_count(0, 3)
    with pytest.raises(ValueError, match=r"unrolled_depth: R .* got -2"):
        theory.unrolled_depth(2, -2)
    with pytest.raises(TypeError, match=r"visit_count: R .* got 2.5"):
        theory.visit_count(2, 2.5)
    with pytest.raises(TypeError, match=r"K .* got True"):
        theory.visit_count(True, 2)
    with pytest.raises(ValueError, match=r"hierarchical_counts: C_L .* got 0"):
        theory.hierarchical_counts(2, 1, 0, 1)


def test_other_functions_reject_out_of_range_values():
    with pytest.raises(ValueError, match=r"exponent_threshold: gamma .* \[0, 1\], got 1.5"):
        theory.exponent_threshold(1.5)
    with pytest.raises(ValueError, match=r"bound: kappa .* got -1"):
        theory.bound(4, -1, 0.1)
    with pytest.raises(ValueError, match=r"kappa_bar_g: kappa_L .* \[0, C_L=2\], got 3.0"):
        theory.kappa_bar_g(2, 2, 2, 3.0, 6)
    with pytest.raises(ValueError) as info:
        theory.residual_multiplier("1/L", 4)
    assert "1/L" in str(info.value) and "loop-mup" in str(info.value)


def test_theory_names_are_reachable_from_the_one_import_path():
    assert lp.theory.scales is theory.scales
    assert "theory" in lp.__all__ and "tasks" in lp.__all__
