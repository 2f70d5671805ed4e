"""Stage 17's downstream tasks, scored by lm-evaluation-harness on the checkpoint's own weights
where they lie: whole on each rank under ZeRO-1/2, partitioned under ZeRO-3.

The model adapter is lm-eval's own ``HFLM`` over the model stage 17 built on this rank, so
tokenization, batching by length, log-likelihoods and greedy generation are lm-eval's code, and
so are the registry, prompts, filters, metrics and aggregation (``simple_evaluate``). What this
adds is what lm-eval otherwise takes from an ``accelerate`` launch: this rank and the world, the
evaluator's collectives through ``core.distributed``, and under ZeRO-3 a lockstep. There every
forward pass gathers parameters collectively, but lm-eval's batches, its logits cache and each
generation's stop differ between ranks; the lockstep pairs each rank's forward passes with a
1-token pass on any rank that has none, until the slowest rank is done (what ``synced_gpus``
does for one ``generate`` call, for the whole evaluation).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from wonderland_ds.core import distributed as dist
from wonderland_ds.core.findings import Finding, Refused

if TYPE_CHECKING:
    import torch

    from wonderland_ds.config.settings import Evaluation

INSTALL = "pip install 'wonderland_ds[eval]' (in a checkout: pip install -e '.[eval]')"


def require() -> Any:
    """lm-eval, or a refusal naming the install line."""
    try:
        import lm_eval
    except ImportError as exc:
        raise Refused(
            Finding(
                "eval-lm-eval-missing",
                "error",
                f"wonderland.eval.tasks needs lm-evaluation-harness, which is not installed ({exc})",
                INSTALL,
                "",
                "wonderland.eval.tasks",
            )
        ) from None
    return lm_eval


def task_manager(spec: Evaluation) -> Any:
    """lm-eval's registry: the user's folder first, lm-eval's own tasks only when a name is
    not in it (indexing lm-eval's hundreds of YAML files takes seconds)."""
    from lm_eval.tasks import TaskManager

    include = str(Path(spec.include_path).expanduser().resolve()) if spec.include_path else None
    if include is not None:
        own = TaskManager(include_path=include, include_defaults=False)
        if all(name in own.all_tasks for name in spec.tasks):
            return own
    return TaskManager(include_path=include)


class Lockstep:
    """Pairs every forward pass of ``module`` across ranks: each pass first sums one flag
    over the world; a rank with nothing to score (:meth:`drain`) runs a 1-token pass for
    every round a peer still scores in, and all leave together when the sum is 0."""

    def __init__(self, module: torch.nn.Module, token: int) -> None:
        import torch

        self.module, self.token = module, token
        self.inside = False
        self.passes = 0  # this rank's own forward passes
        self.idle = 0  # 1-token passes run while a peer still scored
        self._flag = torch.zeros(1, dtype=torch.int64)
        # First in line, ahead of ZeRO-3's own hooks that fetch the parameters.
        self.handle = module.register_forward_pre_hook(self._before, prepend=True)

    def _round(self, busy: int) -> int:
        self._flag.fill_(busy)
        return int(dist.all_reduce_sum(self._flag).item())

    def _before(self, module: Any, args: Any) -> None:
        if not self.inside:
            self.passes += 1
            self._round(1)

    def drain(self) -> None:
        import torch

        while self._round(0) > 0:
            self.inside, self.idle = True, self.idle + 1
            try:
                with torch.no_grad():
                    self.module(input_ids=torch.tensor([[self.token]]), use_cache=False)
            finally:
                self.inside = False

    def close(self) -> None:
        self.handle.remove()


def _adapter() -> type:
    """``HFLM`` with this rank's distributed part (defined once lm-eval is imported)."""
    import torch
    from lm_eval.models.huggingface import HFLM

    class PartitionedLM(HFLM):
        """lm-eval's ``hf`` model over a model already built on this rank."""

        def __init__(self, model: Any, tokenizer: str, batch_size: int, lockstep: bool) -> None:
            super().__init__(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
            self._rank, self._world_size = dist.rank(), dist.world_size()
            self.lockstep = Lockstep(model, self.eot_token_id) if lockstep else None

        def _drain(self) -> None:
            if self.lockstep is not None:
                self.lockstep.drain()

        def loglikelihood(self, requests: Any, disable_tqdm: bool = False) -> Any:
            try:
                return super().loglikelihood(requests, disable_tqdm=disable_tqdm or self.rank > 0)
            finally:
                self._drain()

        def loglikelihood_rolling(self, requests: Any, disable_tqdm: bool = False) -> Any:
            try:
                return super().loglikelihood_rolling(
                    requests, disable_tqdm=disable_tqdm or self.rank > 0
                )
            finally:
                self._drain()

        def generate_until(self, requests: Any, disable_tqdm: bool = False) -> Any:
            try:
                return super().generate_until(requests, disable_tqdm=disable_tqdm or self.rank > 0)
            finally:
                self._drain()

        def _model_generate(self, context: Any, max_length: int, stop: Any, **kwargs: Any) -> Any:
            if self.lockstep is not None:
                # The lockstep pairs the passes; transformers' own ZeRO-3 sync would add
                # collectives of its own that a draining peer never calls.
                kwargs["synced_gpus"] = False
            return super()._model_generate(context, max_length, stop, **kwargs)

        # The evaluator's collectives (lm-eval calls them between request types).
        def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
            self._drain()
            flat = tensor.reshape(-1)
            return torch.cat([t.reshape(-1) for t in dist.gather_all(flat)])

        def gather_object(self, obj: Any, dst: int = 0) -> Any:
            self._drain()
            got = dist.gather_all(obj)
            return got if self.rank == dst else None

        def barrier(self) -> None:
            self._drain()
            dist.barrier()

    return PartitionedLM


@contextmanager
def quiet_library() -> Iterator[None]:
    """lm-eval's per-task notes (default aggregations, dataset loading) are not the stage's
    news: only its errors come through."""
    import logging

    logger = logging.getLogger("lm_eval")
    before = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(before)


def score(
    model: torch.nn.Module, tokenizer: str, spec: Evaluation, zero3: bool
) -> tuple[dict[str, Any] | None, dict[str, int] | None]:
    """lm-eval's results for ``spec.tasks`` on ``model`` (every rank calls it; rank 0 gets
    the results, with every document's sample, the others None), and under ZeRO-3 this
    rank's lockstep counts: its own forward passes and the idle ones it ran for its peers."""
    lm_eval = require()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # ranks fork nothing of it
    lm = _adapter()(model, tokenizer, spec.batch_size, zero3 and dist.world_size() > 1)
    try:
        with quiet_library():
            results = lm_eval.simple_evaluate(
                model=lm,
                tasks=list(spec.tasks),
                num_fewshot=spec.num_fewshot,
                batch_size=spec.batch_size,
                limit=spec.limit,
                task_manager=task_manager(spec),
                log_samples=True,  # the paired gate reads each document's metric
                fewshot_random_seed=spec.fewshot_seed,
            )
    finally:
        if lm.lockstep is not None:
            lm.lockstep.close()
    step = lm.lockstep
    return results, None if step is None else {"passes": step.passes, "idle": step.idle}


def results_json(results: dict[str, Any], with_samples: bool) -> str:
    """lm-eval's results file as its own ``EvaluationTracker`` writes it."""
    import json

    from lm_eval.utils import handle_non_serializable

    body = {k: v for k, v in results.items() if with_samples or k != "samples"}
    return json.dumps(body, indent=2, default=handle_non_serializable, ensure_ascii=False)
