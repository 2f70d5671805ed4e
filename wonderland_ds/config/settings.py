"""The ``"wonderland"`` section of a config: settings DeepSpeed has no key for.

A wonderland config is a DeepSpeed JSON config with one extra top-level object,
``"wonderland"``. It is validated here (unknown keys refused) and stripped before the rest is
handed to ``deepspeed.initialize``. Each field's docstring is its description, from which
docs/configuration.md is generated (``python -m wonderland_ds.config.reference``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from wonderland_ds.config.lm_settings import HFModel, Mix, Source, TokenFiles
from wonderland_ds.config.strict import _Strict

__all__ = ["HFModel", "Mix", "Source", "TokenFiles", "WonderlandSettings"]


class Evaluation(_Strict):
    """Stage 17: what is scored besides the held-out loss, and the gate against stage 15's
    checkpoint."""

    recall_drop_margin: float = Field(0.10, ge=0.0, le=1.0)
    """A class whose recall fell by more than this (absolute) since stage 15 fails the gate."""
    minority_recall_floor: float = Field(0.50, ge=0.0, le=1.0)
    """A minority class whose recall is below this fails the gate."""
    lm_loss_rise: float = Field(0.10, ge=0.0)
    """Language models: a text source whose held-out loss rose by more than this fraction
    since stage 15 fails the gate."""
    tasks: list[str] = Field(default_factory=list)
    """Language models: lm-evaluation-harness task, group or tag names scored on both
    checkpoints (``["hellaswag", "my_task"]``), by lm-eval itself: its prompts, filters,
    metrics and aggregation. Needs ``pip install 'wonderland_ds[eval]'`` and a tokenizer in
    the model directory."""
    include_path: str | None = None
    """A folder of your own lm-eval task YAML files (for local data: ``dataset_path: json``
    with ``dataset_kwargs: {data_files: ...}``); their names join lm-eval's own."""
    num_fewshot: int | None = Field(None, ge=0)
    """Few-shot examples per prompt (lm-eval's ``num_fewshot``); None: each task's own."""
    limit: int | float | None = Field(None, gt=0)
    """Score only the first N documents of each task, or this fraction when below 1.0
    (lm-eval's ``limit``; for quick looks, not for gating)."""
    batch_size: int = Field(8, ge=1)
    """Requests per forward pass on each rank (lm-eval's ``batch_size``)."""
    fewshot_seed: int = Field(1234, ge=0)
    """Seed of the few-shot sampler (lm-eval's ``fewshot_random_seed``): both checkpoints see
    the same examples."""
    log_samples: bool = False
    """Keep every document's prompt, response and metric in the results files
    (lm-eval's ``log_samples``)."""
    task_drop: float = Field(0.02, ge=0.0)
    """A task's metric fails the gate when it got worse by more than this since stage 15:
    in the metric's own units for metrics between 0 and 1 (accuracy, exact match: 0.02 is two
    points), as a fraction of stage 15's value for the others (perplexity, bits per byte)."""
    task_alpha: float = Field(0.05, gt=0.0, lt=1.0)
    """...and when the fall is significant at this level, both checkpoints' answers on the
    same documents compared paired (McNemar's exact test for right/wrong metrics, a paired
    bootstrap otherwise), Holm-corrected over every task and metric judged: the chance that
    noise alone fails a run stays below it."""

    @field_validator("tasks")
    @classmethod
    def _named(cls, value: list[str]) -> list[str]:
        blank = [t for t in value if not t.strip()]
        if blank:
            raise ValueError("an empty task name")
        if len(set(value)) != len(value):
            raise ValueError(f"a task named twice: {sorted(value)}")
        return value


Policy = Literal["warn", "stop", "rollback"]


class Guards(_Strict):
    """Health guards while a stage trains: silent gradient drops, slow ranks, loss spikes.

    Policies: ``warn`` (log and go on), ``stop`` (exit 3 with a report; the last complete
    checkpoint stays the newest), ``rollback`` (reload the last complete checkpoint and skip the
    offending batches, at most ``max_rollbacks`` times, then stop)."""

    enabled: bool = True
    """Run the health guards (false: none of the checks below)."""
    check_interval: int = Field(10, ge=1)
    """Steps between checks: the numbers of every step since the last check travel in one
    all-reduce, then each step is judged in order (events keep their own step). A save and the
    stage's last step always check first, so no checkpoint holds an unjudged step. 1: every step
    (one all-reduce a step)."""
    overlap_check: bool = True
    """The check's all-reduce runs while the next step trains, and its verdict is taken when
    that step ends: a stop or rollback comes one step later, and that step is discarded with
    the offending one. A save and the stage's last step still wait for their check. False: wait
    for every check's all-reduce at once (a decision in the step it checks)."""
    allreduce_check: bool | None = None
    """Verify the all-reduce at stage start; None: on for stage 16, off elsewhere."""
    slow_factor: float = Field(1.25, gt=1.0)
    """A rank whose transfers take this many times the median of the others is slow."""
    slow_min_ms: float = Field(1.0, ge=0.0)
    """...and at least this many milliseconds slower (sub-millisecond timings are noise)."""
    slow_policy: Literal["warn", "stop"] = "warn"
    """What a slow rank triggers."""
    comm_probe_interval: int | None = Field(None, ge=0)
    """Re-run the per-rank transfer probe (4 MB, min of 3; both ways round the ring with 3+
    ranks) every N steps while training (0: never). None (default): adaptive, so that probing
    costs at most ``comm_probe_budget`` of the training time (every 10 to 1000 steps; the
    first at step 10). A rank is reported after three slow probes in a row."""
    comm_probe_budget: float = Field(0.005, gt=0.0, le=0.5)
    """Adaptive probing: the largest fraction of training time the probes may take. Only binds
    when a probe is long against a step (a 14 ms probe and 6 ms digits steps on a 2-core CPU
    host: every ~470 steps); on GPU-sized steps the 10-step floor does."""
    grad_drop_ratio: float = Field(0.1, gt=0.0, lt=1.0)
    """A rank whose local gradient norm is below this fraction of its peers' median (or zero,
    or non-finite) dropped its gradients."""
    grad_drop_patience: int = Field(3, ge=1)
    """Steps in a row a rank must stay below grad_drop_ratio before it is reported (a zero or
    non-finite norm is reported at once)."""
    grad_drop_policy: Policy = "stop"
    """What a rank that dropped its gradients triggers."""
    fingerprint_interval: int = Field(50, ge=0)
    """Compare a parameter fingerprint across data-parallel replicas every N steps (0: never;
    ZeRO-3 holds no replicas)."""
    divergence_policy: Policy = "stop"
    """What replicas whose parameter fingerprints differ trigger."""
    nan_policy: Policy = "stop"
    """What a non-finite loss triggers."""
    spike_factor: float = Field(3.0, gt=1.0)
    """A loss above this multiple of the rolling median is a spike (the field notes saw 4x)."""
    spike_mad: float = Field(6.0, ge=0.0)
    """...and above the rolling median by this many robust standard deviations (1.4826 x MAD),
    so that the heavy-tailed loss of small batches does not false-alarm."""
    spike_min_delta: float = Field(0.05, ge=0.0)
    """...and at least this far above it in absolute loss units (a converged loss of 0.0002
    that jumps to 0.002 is noise, not a spike). Tune to your loss's scale."""
    spike_window: int = Field(50, ge=5)
    """Steps of loss history the rolling median and MAD are taken over."""
    spike_warmup: int = Field(20, ge=1)
    """Steps of history needed before spikes are judged."""
    spike_policy: Policy = "warn"
    """What a loss spike triggers."""
    plateau_window: int = Field(0, ge=0)
    """Flag a loss flat within plateau_tolerance over this many steps while the LR does not
    decrease (0: off; it false-alarms on converged runs)."""
    plateau_tolerance: float = Field(0.01, gt=0.0)
    """The loss is flat when the mean of the last ``plateau_window`` steps is within this
    fraction of the mean of the window before."""
    plateau_policy: Literal["warn", "stop"] = "warn"
    """What a plateau triggers."""
    loss_scale_stuck_steps: int = Field(50, ge=1)
    """fp16: the loss scale at its minimum this many steps in a row is an error (stop)."""
    max_rollbacks: int = Field(2, ge=0)
    """Rollbacks a stage may make; the next ``rollback`` stops it instead."""


class Elastic(_Strict):
    """A node lost mid-stage: the stage continues on the nodes left, with the same global
    batch, and grows back when it is next started on more."""

    min_nodes: int | None = Field(None, ge=1)
    """On a restart after a node was lost (``max_restarts`` > 0), relaunch on the nodes left
    as long as at least this many remain; fewer ends the stage. The global batch of the
    checkpoint is kept: gradient accumulation is derived for the new world size, and a world
    that cannot keep it with the configured micro batch ends the stage. None: a restart
    relaunches on the same nodes (``--min-nodes`` overrides)."""
    heartbeat_timeout_s: float = Field(15.0, ge=0.0)
    """A stage whose ranks span several hosts: a rank whose heartbeat (written every 2 s to
    the shared run folder) stops changing for this long is lost with its host, and the others
    leave at once instead of waiting for the process-group timeout. 0: off."""


class Preemption(_Strict):
    """Stopping on a signal or the job's time limit, and coming back (Slurm)."""

    requeue: bool = False
    """After a stop on Slurm's warning signal (``--signal=B:USR1@...``) or the job's time limit,
    ``scontrol requeue`` the job once the checkpoint is saved: it runs the same command again and
    continues the stage (submit it with ``--requeue``). A ``scancel`` is never requeued.
    ``--requeue`` on the command line sets it."""
    time_limit_stop: bool = True
    """Inside a Slurm job, stop and save before the job's end time (``squeue``'s end time) on
    its own, even when the job was submitted without ``--signal``."""
    stop_margin_s: float | None = Field(None, gt=0.0)
    """How long before the job's end time to stop. None: from what this stage measured: twice
    its slowest recent step, plus its last save's full duration (before the first save: its
    model state at 100 MB/s), plus 15 s to exit."""
    end_time_poll_s: float = Field(60.0, ge=1.0)
    """How often rank 0 reads the job's end time again (``scontrol update`` can move it)."""


class Export(_Strict):
    """Stage 18's export: sharded safetensors written one parameter at a time."""

    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """The dtype of the exported weights (read from the checkpoint's fp32 master weights)."""
    max_shard_size: str = Field("5GB", pattern=r"^[0-9]+(\.[0-9]+)?\s*(B|KB|MB|GB|KiB|MiB|GiB)$")
    """The largest safetensors file (``transformers``' ``max_shard_size``): ``"5GB"``,
    ``"500MB"``; a parameter larger than it gets a shard of its own."""

    @property
    def max_shard_bytes(self) -> int:
        import re

        m = re.match(r"^([0-9.]+)\s*([A-Za-z]+)$", self.max_shard_size)
        assert m is not None
        unit = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9}
        unit |= {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
        return max(1, int(float(m.group(1)) * unit[m.group(2)]))


class WonderlandSettings(_Strict):
    """Run settings of a stage; every field has a default."""

    task: str = "digits"
    """``causal-lm`` (a Hugging Face model on token files, set by ``model`` and ``data``), a
    built-in demo task (``digits``, ``pylm``) or ``module:function`` returning a Task."""
    model: HFModel | None = None
    """The ``causal-lm`` task's model (required by it, refused with any other task)."""
    data: TokenFiles | None = None
    """The ``causal-lm`` task's token files (required by it, refused with any other task)."""
    cache: str | None = None
    """Dataset cache made by ``wonderland cache`` (default: RUN_DIR/cache/TASK, built once)."""
    seed: int = Field(1234, ge=0)
    """Data-order and initialisation seed; stage 16 must use stage 15's (preflight)."""
    train_steps: int = Field(100, ge=1)
    """Optimizer steps a training stage runs (default for every stage)."""
    stage_train_steps: dict[str, int] = Field(default_factory=dict)
    """Per-stage override of ``train_steps``, keyed by stage number as a string: ``{"15": 600}``."""
    save_interval: int = Field(100, ge=1)
    """Save a checkpoint every this many optimizer steps (and always at the end of a stage)."""
    disk_space_check: Literal["stop", "warn", "off"] = "stop"
    """Before each save, the checkpoint folder's free space against the size of the stage's
    last checkpoint (before the first: its state's size). ``stop``: a save that would not fit
    stops the stage cleanly (exit 5, the newest complete checkpoint intact), and a warning
    comes while only one more save fits; ``warn``: the warning only, then the save is tried;
    ``off``: no check. A write that fails anyway (a full disk, a quota, an I/O error) always
    stops the stage with exit 5 and removes the half-written checkpoint."""
    async_save: bool = True
    """Block training only for an in-memory snapshot per save; files, checksums, metadata and
    ``latest`` are written in the background (false: wait for all of it at every save)."""
    async_save_copy: bool = True
    """Parameters and optimizer state are not copied on the loop's time: the checkpoint
    writer copies them into host buffers reused from save to save, and the next optimizer
    update waits for that copy only (costs one host copy of this rank's state, kept between
    saves). false: the writer serializes them straight from the live tensors, no extra
    memory, and the update waits until they are serialized."""
    keep_last: int = Field(3, ge=1)
    """Keep this many complete checkpoints per stage; the newest complete one is never deleted."""
    min_warmup_steps: int = Field(500, ge=0)
    """Stage 16 refuses a checkpoint with fewer LR-warmup steps behind it (field notes: 500)."""
    process_group_timeout_s: int = Field(600, ge=10)
    """Process-group timeout passed to ``deepspeed.init_distributed`` (field notes: 600 s)."""
    cpu_mmap_threshold: int | None = Field(None, ge=4096)
    """Ranks on the CPU: fix glibc's mmap threshold at this many bytes, so freed blocks from
    that size up go back to the system at once (``MALLOC_MMAP_THRESHOLD_`` in the environment
    takes precedence). ``131072`` makes ZeRO-3 rank memory fall with the world size; a step
    with large activations then maps and zeroes them anew each step and runs slower (figures
    in docs/performance.md). None: glibc's default, whose threshold grows with the first large
    frees."""
    max_restarts: int = Field(0, ge=0)
    """Relaunch a stage whose rank died or whose process group timed out, from its newest
    complete checkpoint, up to this many times (``--max-restarts`` overrides)."""
    restart_backoff_s: float = Field(5.0, ge=0.0)
    """Seconds before the first restart; doubled for each further one, at most 300."""
    log_interval: int = Field(50, ge=1)
    """Print a progress line every this many steps on rank 0."""
    eval: Evaluation = Field(default_factory=Evaluation)
    """Stage 17: downstream tasks and the gate."""
    guards: Guards = Field(default_factory=Guards)
    """The health guards while a stage trains."""
    preemption: Preemption = Field(default_factory=Preemption)
    """Stops on a signal or the job's time limit, and the requeue after them."""
    elastic: Elastic = Field(default_factory=Elastic)
    """A lost node: continue on the nodes left, and grow back."""
    export: Export = Field(default_factory=Export)
    """Stage 18's export."""
    device_memory_gb: float | None = Field(None, gt=0)
    """Memory of one accelerator in GB, for ``check``'s memory estimate (default: what the
    hosts report, the host's memory per rank when they train on CPUs)."""

    @model_validator(mode="after")
    def _causal_lm_sections(self) -> WonderlandSettings:
        if self.task == "causal-lm":
            missing = [k for k in ("model", "data") if getattr(self, k) is None]
            if missing:
                raise ValueError(
                    f"task causal-lm needs {' and '.join(missing)}: a model directory"
                    ' ("model": {"hf": DIR}) and token files ("data": {"train": [...],'
                    ' "heldout": {...}, "seq_len": N})'
                )
        elif self.model is not None or self.data is not None:
            raise ValueError(
                f"model and data configure the causal-lm task; task {self.task!r} brings its own"
            )
        if self.eval.tasks and self.task != "causal-lm":
            raise ValueError(
                f"eval.tasks scores a language model with lm-eval; task {self.task!r} is not"
                " causal-lm"
            )
        return self

    @model_validator(mode="after")
    def _stage_keys(self) -> WonderlandSettings:
        for key, steps in self.stage_train_steps.items():
            if not key.isdigit() or not 1 <= int(key) <= 18:
                raise ValueError(f"stage_train_steps key {key!r} is not a stage number 1..18")
            if steps < 1:
                raise ValueError(f"stage_train_steps[{key!r}] must be >= 1, got {steps}")
        return self

    def steps_for(self, stage: int) -> int:
        return self.stage_train_steps.get(str(stage), self.train_steps)
