"""Document masking: attention and positions kept inside each document of a packed sample.

A packed sample holds the end of one document, whole documents and the start of another,
each ended by EOS. With ``data.document_masking`` the model gets position ids that restart
after every EOS, no attention mask and no cache: ``transformers`` then builds the block-diagonal
causal mask itself from the restarts (its ``find_packed_sequence_indices``, or the varlen kernels
under flash attention). The label of each document's first token is ignored, so nothing is
predicted across a boundary: a packed sample's summed loss is the sum of its documents'.

Whether an architecture honours the restarts is asked of the model itself (:func:`refusal`),
not of a list: one forward of three packed rows whose last document is the same.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from wonderland_ds.core.findings import Finding
from wonderland_ds.data.tokens import IGNORE

if TYPE_CHECKING:
    import torch


class _Task(Protocol):
    """What the probe needs of a ``data.tasks.Task`` (which imports this module)."""

    @property
    def document_eos(self) -> int | None: ...

    @property
    def meta(self) -> dict[str, Any]: ...

    def forward(self, model: Any, x: torch.Tensor, y: torch.Tensor) -> Any: ...


def positions(y: torch.Tensor, eos: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(position ids, labels) of a batch of packed samples whose labels ``y`` equal the
    inputs (:data:`IGNORE` on a tail's padding): positions restart after each EOS, and the
    label after each EOS, the next document's first token, is ignored."""
    import torch

    start = torch.zeros_like(y, dtype=torch.bool)
    start[:, 1:] = y[:, :-1] == eos
    idx = torch.arange(y.shape[1], device=y.device).expand_as(y)
    first = torch.where(start, idx, torch.zeros_like(idx)).cummax(dim=1).values
    return idx - first, y.masked_fill(start, IGNORE)


def refusal(task: _Task, model: Any, where: str, file: str = "") -> Finding | None:
    """Why ``model`` cannot keep attention inside documents, or None. Three rows of one
    length end in the same document after different ones (other tokens; other lengths and
    one more boundary): with block-diagonal attention and restarted positions its logits are
    the same in all three. Runs in eval mode without gradients; collective under ZeRO-3 (every
    rank calls it with the same rows)."""
    import torch

    eos = task.document_eos
    assert eos is not None
    vocab = int(task.meta.get("vocab") or 32)
    gen = torch.Generator().manual_seed(0)

    def ids(n: int) -> torch.Tensor:
        out = torch.randint(0, vocab - 1, (n,), generator=gen)
        return out + (out >= eos).long()  # never EOS

    last = ids(6)
    e = torch.tensor([eos])
    rows = [
        torch.cat([ids(5), e, last]),
        torch.cat([ids(5), e, last]),
        torch.cat([ids(3), e, ids(1), e, last]),
    ]
    dev = next(model.parameters()).device
    x = torch.stack(rows).to(dev)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            out = task.forward(model, x, x.clone())
    except Exception as exc:  # the architecture refused position ids, or the packed mask
        why = f"its forward with position ids failed: {type(exc).__name__}: {exc}"
    else:
        logits = out["logits"] if hasattr(out, "keys") else getattr(out, "logits", out)
        tail = logits[:, -len(last) :].float()
        diff = float((tail[1:] - tail[0]).abs().max())
        scale = float(tail[0].abs().max()) + 1e-6
        if diff <= 1e-4 * scale:
            return None
        why = (
            f"a document's logits change with the documents packed before it (by {diff:.3g},"
            f" logits up to {scale:.3g})"
        )
    finally:
        model.train(was_training)
    arch = type(getattr(model, "module", model)).__name__
    return Finding(
        "document-masking",
        "error",
        f"data.document_masking: {arch} does not keep attention inside documents through"
        f" restarted position ids in this transformers version: {why}",
        "set data.document_masking to false (packed samples then attend across documents),"
        " or use an architecture that supports packed sequences (Llama, Qwen2, Mistral,"
        " GPT-2...)",
        file,
        where,
    )
