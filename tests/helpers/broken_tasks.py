"""User tasks (``module:function``) that break stage 16 on purpose, for stage 17's gate tests."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from wonderland_ds.data.builtin import digits
from wonderland_ds.data.tasks import Split, Task


def digits_without_minority() -> Task:
    """The built-in digits task with its minority classes (3 and 8) cut from the training
    split: a stage 16 trained on it forgets them (recall 1.0 and 0.8 after stage 15, both under
    the minority floor after 100 such steps). The held-out split is digits' own, so stage
    17 measures the damage on exactly the samples the healthy run is measured on."""
    base = digits()
    make = base.make_splits
    assert make is not None

    def splits() -> tuple[Split, Split]:
        train, heldout = make()
        keep = ~np.isin(train.y, base.minority_classes)
        return Split(train.x[keep], train.y[keep]), heldout

    return replace(base, name="digits-without-minority", make_splits=splits)


class _Chatty(torch.nn.Module):
    """A model whose forward returns what no loss can use (no logits, no loss)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(64, 10)

    def forward(self, x):
        return {"hidden": self.lin(x)}


def digits_without_logits() -> Task:
    """digits with a model whose output has neither logits nor loss: `check` refuses it."""
    return replace(digits(), name="digits-chatty", build_model=_Chatty, normalize=False)
