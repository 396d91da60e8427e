"""Suite-wide settings and the fixtures several test modules share (each defined once here)."""

import os
import sys
import uuid

import pytest
import torch
from hypothesis import settings

settings.register_profile("ci", derandomize=True, deadline=None, max_examples=30)
settings.register_profile("thorough", deadline=None, max_examples=500)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# Tiny models: one thread is faster than two (OpenMP spin-up dominates tiny kernels)
# and does not oversubscribe the 2-core CI machine.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def one_thread():
    """Every test starts on one torch thread, and a test that changes the count gives it back."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def fresh_cwd(tmp_path, monkeypatch):
    """``fresh_cwd(prefix, source)``: writes the user's module ``<prefix>_<random>.py`` into a
    fresh directory, makes it the cwd and takes the cwd off ``sys.path`` (as for the
    ``loopprobe`` console script); returns the module's name. Its imports are forgotten after
    the test."""
    names = []

    def write(prefix: str, source: str) -> str:
        name = f"{prefix}_{uuid.uuid4().hex[:8]}"
        (tmp_path / f"{name}.py").write_text(source)
        monkeypatch.chdir(tmp_path)
        cwd = os.getcwd()
        monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", cwd, ".")])
        names.append(name)
        return name

    yield write
    for mod in [m for m in sys.modules if any(m.startswith(n) for n in names)]:
        del sys.modules[mod]


@pytest.fixture
def restricted_copies(monkeypatch):
    """The visit counts of the copies ``VisitJacobian.restricted`` makes during the test (one
    entry per copy, in order)."""
    from loopprobe.differentiate.jacobian import VisitJacobian

    calls: list[int] = []
    original = VisitJacobian.restricted

    def counting(self, ks, check=True):
        calls.append(len(ks))
        return original(self, ks, check)

    monkeypatch.setattr(VisitJacobian, "restricted", counting)
    return calls


@pytest.fixture
def hf_args(tmp_path):
    """``hf_args(**overrides)``: ``transformers.TrainingArguments`` for a tiny CPU run writing
    into ``tmp_path``: 3 steps, batch 2, lr 1e-2, no saving, logging, reporting or tqdm."""

    def make(**overrides):
        import transformers

        base = dict(
            output_dir=str(tmp_path),
            max_steps=3,
            per_device_train_batch_size=2,
            learning_rate=1e-2,
            report_to="none",
            save_strategy="no",
            logging_strategy="no",
            use_cpu=True,
            disable_tqdm=True,
            dataloader_num_workers=0,
        )
        return transformers.TrainingArguments(**{**base, **overrides})

    return make
