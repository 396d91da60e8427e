"""Issue 39.7: every verdict of studies/verdicts.csv says what it was tested at, and every
undecided one says what would decide it."""

from __future__ import annotations

import pandas as pd
import pytest

from loopprobe.report.verdicts import FAILS, HOLDS, UNKNOWN, Verdict
from studies import scope
from studies import verdicts as study_verdicts


def test_every_committed_verdict_names_its_scale_and_every_undecided_one_its_decider():
    table = pd.read_csv(study_verdicts.VERDICTS, keep_default_na=False, dtype=str)
    assert table["claim"].str.contains(r" \[tested: [^]]+\]$").all()
    undecided = table[table["verdict"] == UNKNOWN]
    assert len(undecided) > 0 and undecided["why"].str.contains("would decide it: ").all()
    decided = table[table["verdict"].isin([HOLDS, FAILS])]
    assert not decided["why"].str.contains("would decide it").any()


def test_worded_uses_the_first_matching_prefix_and_refuses_an_unknown_claim():
    v = Verdict("reproductions", "DeepLoop: p-sweep: x", UNKNOWN, "m", "e", "why")
    w = scope.worded("deeploop", v)
    assert w.claim.startswith("DeepLoop: p-sweep: x [tested: the design above at R = 3 only")
    assert w.why.startswith("why; would decide it: the p-sweep across R")
    other = scope.worded("deeploop", Verdict("reproductions", "DeepLoop: vs post", HOLDS, "m",
                                             "e"))  # fmt: skip
    assert "one lr 3e-3 for every arm" in other.claim and other.why == ""
    with pytest.raises(ValueError, match="no scope for study 'nope'.*studies.scope.SCOPES"):
        scope.worded("nope", v)
