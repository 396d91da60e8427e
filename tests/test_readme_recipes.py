"""The recipes users copy most are still on the site, each with the output it prints.

They moved from the README to the guides; ``tests/test_docs_site.py`` runs every guide's
python blocks and compares what they print, so this file only checks that none of them was
dropped or lost its printed output in a rewrite.
"""

from __future__ import annotations

import pathlib

import pytest
from test_docs_site import blocks

DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs"

RECIPES = {  # a string the recipe's code contains -> the page it lives on
    "loopprobe.integrations.huggingface import MonitorCallback": "guides/monitor.md",
    "loopprobe.integrations.lightning import MonitorCallback": "guides/monitor.md",
    '"increments": 1, "kappa": 2}': "guides/monitor.md",
    "with lp.transform_safe():": "guides/reuse.md",
    "lp.sensitivity_operators(probe, x)": "guides/reuse.md",
    "lp.visit_function(tiny, x)": "guides/your-model.md",
    "transformers.AlbertModel(cfg)": "guides/huggingface.md",
    "lp.fixed_point(model.step": "guides/fixed-points.md",
}


@pytest.mark.parametrize("needle", RECIPES)
def test_a_recipe_is_on_its_page_with_the_output_it_prints(needle):
    found = [
        printed for code, printed in blocks((DOCS / RECIPES[needle]).read_text()) if needle in code
    ]
    assert len(found) == 1, f"{needle!r} on {RECIPES[needle]}: {len(found)} blocks"
    assert found[0], f"{needle!r} has no ```text block of what it prints"
