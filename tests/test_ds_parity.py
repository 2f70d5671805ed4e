"""`wonderland check` against DeepSpeed's own config parser.

``deepspeed.runtime.config.DeepSpeedConfig(dict)`` runs with a world size of 1 when no process
group exists, so the configs here close their batch triangle at 1 (no train_batch_size), and
our check runs with ``world_size=1`` too. Three directions:

* every config DeepSpeed refuses, we refuse (the run would die after minutes of startup);
* configs DeepSpeed takes but that are wrong (typos it ignores, ``2.5`` grad-acc steps...):
  DeepSpeed's leniency is asserted, so the reason our check exists stays visible;
* every valid config (shipped, public corpus, DeepSpeed features) DeepSpeed accepts and so do we;
  every key DeepSpeed looks up is one ``ds_keys`` knows.
"""

from __future__ import annotations

import collections.abc
import copy
import json
from typing import Any

import pytest

from tests.conftest import CORPUS, REPO
from wonderland_ds.config import ds_config, ds_keys, ds_models

BASE: dict[str, Any] = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 8,
    "gradient_clipping": 1.0,
    "bf16": {"enabled": True},
    "zero_optimization": {"stage": 2},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
    "scheduler": {
        "type": "WarmupDecayLR",
        "params": {"warmup_num_steps": 600, "total_num_steps": 5000},
    },
}
DROP = object()
FP16 = {"enabled": True, "loss_scale": 0, "loss_scale_window": 1000, "min_loss_scale": 1}


def mutate(changes: dict[str, Any]) -> dict[str, Any]:
    cfg = copy.deepcopy(BASE)
    for dotted, value in changes.items():
        *parents, leaf = dotted.split(".")
        node = cfg
        for part in parents:
            node = node.setdefault(part, {})
        if value is DROP:
            node.pop(leaf, None)
        else:
            node[leaf] = copy.deepcopy(value)
    return cfg


@pytest.fixture(scope="module")
def deepspeed_config():
    from deepspeed.runtime.config import DeepSpeedConfig

    return DeepSpeedConfig


def ds_refusal(deepspeed_config, cfg: dict[str, Any]) -> str | None:
    """DeepSpeed's error for the config, None if it accepts it."""
    try:
        deepspeed_config(copy.deepcopy(cfg))
    except Exception as exc:  # DeepSpeed raises anything from TypeError to its own errors
        return f"{type(exc).__name__}: {exc}"
    return None


def our_errors(cfg: dict[str, Any]) -> list[str]:
    *_, found = ds_config.validate(copy.deepcopy(cfg), "parity.json", world_size=1)
    return [f"{f.rule} {f.path}" for f in found if f.severity == "error"]


DS_REFUSES = {
    "removed-sparse_gradients": {"sparse_gradients": True},
    "removed-amp": {"amp": {"enabled": True}},
    "removed-elasticity": {"elasticity": {"enabled": True}},
    "removed-nebula": {"nebula": {"enabled": False}},
    "removed-progressive_layer_drop": {"progressive_layer_drop": {"enabled": True}},
    "removed-zero-mics_shard_size": {"zero_optimization.mics_shard_size": 4},
    "removed-zero-zeropp_loco_param": {"zero_optimization.zeropp_loco_param": {}},
    "zero-stage-4": {"zero_optimization.stage": 4},
    "zero-stage-negative": {"zero_optimization.stage": -1},
    "zero-unknown-key": {"zero_optimization.overlap_com": True},
    "zero-bucket-not-a-number": {"zero_optimization.reduce_bucket_size": "big"},
    "zero-bucket-zero": {"zero_optimization.reduce_bucket_size": 0},
    "zero-bool-not-a-bool": {"zero_optimization.contiguous_gradients": "sometimes"},
    "zero-not-an-object": {"zero_optimization": 2},
    "offload-param-unknown-key": {
        "zero_optimization.stage": 3,
        "zero_optimization.offload_param": {"device": "cpu", "pin_memry": True},
    },
    "offload-optimizer-unknown-key": {
        "zero_optimization.offload_optimizer": {"device": "cpu", "pin_memry": True}
    },
    "offload-device-gpu": {"zero_optimization.offload_optimizer": {"device": "gpu"}},
    "offload-ratio-not-a-number": {
        "zero_optimization.offload_optimizer": {"device": "cpu", "ratio": "half"}
    },
    "fp16-and-bf16": {"fp16": FP16},
    "fp16-and-bfloat16": {"bf16": DROP, "bfloat16": {"enabled": True}, "fp16": FP16},
    "fp16-unknown-key": {"bf16": DROP, "fp16": {**FP16, "loss_scale_windw": 10}},
    "fp16-not-an-object": {"bf16": DROP, "fp16": True},
    "fp16-loss_scale_window-0": {"bf16": DROP, "fp16": {**FP16, "loss_scale_window": 0}},
    "fp16-loss_scale-negative": {"bf16": DROP, "fp16": {**FP16, "loss_scale": -1}},
    "fp16-initial_scale_power-string": {
        "bf16": DROP,
        "fp16": {**FP16, "initial_scale_power": "x"},
    },
    "fp16-min_loss_scale-fraction": {"bf16": DROP, "fp16": {**FP16, "min_loss_scale": 0.5}},
    "bf16-unknown-key": {"bf16.enable": True},
    "bf16-enabled-not-a-bool": {"bf16.enabled": "sometimes"},
    "tensorboard-unknown-key": {"tensorboard": {"enabled": True, "output_pth": "x"}},
    "wandb-unknown-key": {"wandb": {"enabled": False, "projet": "x"}},
    "csv_monitor-enabled-not-a-bool": {"csv_monitor": {"enabled": "often"}},
    "comms_logger-unknown-key": {"comms_logger": {"enabled": True, "verbos": True}},
    "hybrid_engine-max_out_tokens-0": {"hybrid_engine": {"max_out_tokens": 0}},
    "compile-unknown-key": {"compile": {"deepcompil": True}},
    "communication_data_type-fp8": {"communication_data_type": "fp8"},
    "micro-string": {"train_micro_batch_size_per_gpu": "8"},
    "micro-zero": {"train_micro_batch_size_per_gpu": 0},
    "grad-acc-zero": {"gradient_accumulation_steps": 0},
    "grad-acc-negative": {"gradient_accumulation_steps": -2},
    "train-batch-string": {"train_batch_size": "32"},
    "no-batch-size": {"train_micro_batch_size_per_gpu": DROP},
    "triangle-not-closing": {"train_batch_size": 33},
    "triangle-batch-micro": {"train_batch_size": 10, "gradient_accumulation_steps": DROP},
    "triangle-batch-grad-acc": {"train_batch_size": 10, "train_micro_batch_size_per_gpu": DROP},
    "auto-micro": {"train_micro_batch_size_per_gpu": "auto"},
    "checkpoint-tag_validation-bad": {"checkpoint": {"tag_validation": "Nope"}},
    "optimizer-not-an-object": {"optimizer": "AdamW"},
}


@pytest.mark.parametrize("changes", DS_REFUSES.values(), ids=DS_REFUSES)
def test_what_deepspeed_refuses_we_refuse(changes: dict[str, Any], deepspeed_config) -> None:
    cfg = mutate(changes)
    assert ds_refusal(deepspeed_config, cfg) is not None, "DeepSpeed accepts it now: move it"
    assert our_errors(cfg), f"DeepSpeed refuses it ({ds_refusal(deepspeed_config, cfg)})"


#: Configs DeepSpeed refuses for an "auto" that has a source here: filled before DeepSpeed
#: sees them, and the filled config is one DeepSpeed accepts.
DS_REFUSES_WE_FILL = {
    "auto-grad-acc": {"gradient_accumulation_steps": "auto"},
}


@pytest.mark.parametrize("changes", DS_REFUSES_WE_FILL.values(), ids=DS_REFUSES_WE_FILL)
def test_an_auto_deepspeed_refuses_is_filled_into_one_it_accepts(changes, deepspeed_config):
    cfg = mutate(changes)
    assert ds_refusal(deepspeed_config, cfg) is not None, "DeepSpeed accepts it now: move it"
    assert our_errors(cfg) == []
    assert ds_refusal(deepspeed_config, ds_config.deepspeed_dict(cfg, None, 1)) is None


#: Configs DeepSpeed takes without a word although they are wrong: what `check` is for.
DS_TAKES_WE_REFUSE = {
    "typo-top-level": ({"gradient_acumulation_steps": 4}, "unknown-key"),
    "typo-checkpoint": ({"checkpoint": {"load_universl": True}}, "unknown-key"),
    "typo-scheduler-params": ({"scheduler.params.warmup_num_step": 10}, "unknown-key"),
    "typo-optimiser": ({"optimiser": {"type": "Adam"}}, "unknown-key"),
    "grad-acc-2.5": ({"gradient_accumulation_steps": 2.5}, "type"),
    "clipping-string": ({"gradient_clipping": "1.0"}, "type"),
    "bf16-enabled-string": ({"bf16.enabled": "true"}, "type"),
    "stage-string": ({"zero_optimization.stage": "2"}, "type"),
    "auto-bf16": ({"bf16.enabled": "auto"}, "auto-value"),
    "auto-lr": ({"optimizer.params.lr": "auto"}, "auto-value"),
    "unknown-scheduler": ({"scheduler.type": "WarmupLinear"}, "scheduler-type"),
    "no-scheduler": ({"scheduler": DROP}, "missing-scheduler"),
    "nvme-without-path": (
        {"zero_optimization.stage": 3, "zero_optimization.offload_param": {"device": "nvme"}},
        "offload-stage",
    ),
    "offload-param-stage-2": (
        {"zero_optimization.offload_param": {"device": "cpu"}},
        "offload-stage",
    ),
}


@pytest.mark.parametrize(("changes", "rule"), DS_TAKES_WE_REFUSE.values(), ids=DS_TAKES_WE_REFUSE)
def test_what_deepspeed_lets_through(changes: dict[str, Any], rule: str, deepspeed_config) -> None:
    cfg = mutate(changes)
    assert ds_refusal(deepspeed_config, cfg) is None
    assert any(e.startswith(f"{rule} ") for e in our_errors(cfg)), our_errors(cfg)


# ---------------------------------------------------------------- valid configs


def for_deepspeed(raw: dict[str, Any]) -> dict[str, Any]:
    """A config as DeepSpeed sees it at world size 1: our section and train_batch_size gone."""
    out = copy.deepcopy(raw)
    out.pop("wonderland", None)
    out.pop("train_batch_size", None)
    return out


VALID = [
    *sorted((REPO / "ds_configs").glob("*.json")),
    CORPUS / "deepspeedexamples_gpt_neox_20b_zero3.json",
]
#: Public configs DeepSpeed's parser takes whose optimizer (OneBitLamb, OneBitAdam: removed
#: from DeepSpeed 0.19) ``deepspeed.initialize`` then fails on, on every rank.
GONE_OPTIMIZER = [
    CORPUS / "deepspeedexamples_bert_large_pretraining.json",
    CORPUS / "deepspeedexamples_llama_70b_multi_node.json",
]


@pytest.mark.parametrize("path", GONE_OPTIMIZER, ids=lambda p: p.stem)
def test_optimizers_deepspeed_resolves_only_at_initialize(path, deepspeed_config) -> None:
    import torch
    from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS

    cfg = for_deepspeed(json.loads(path.read_text()))
    name = cfg["optimizer"]["type"]
    assert ds_refusal(deepspeed_config, cfg) is None  # the parser takes it...
    assert name.lower() not in DEEPSPEED_OPTIMIZERS and not hasattr(torch.optim, name)  # ...
    assert our_errors(cfg) == ["optimizer-type optimizer.type"]  # initialize would not


@pytest.mark.parametrize("path", VALID, ids=lambda p: p.stem)
def test_valid_configs_accepted_by_both(path, deepspeed_config) -> None:
    cfg = for_deepspeed(json.loads(path.read_text()))
    assert ds_refusal(deepspeed_config, cfg) is None
    assert our_errors(cfg) == []


#: DeepSpeed features and spellings a valid config may use: neither side may refuse them.
DS_VALID_VARIANTS = {
    "tag_validation-lowercase": {"checkpoint": {"tag_validation": "fail"}},
    "checkpoint-all-keys": {
        "checkpoint": {
            "tag_validation": "Warn",
            "load_universal": False,
            "use_node_local_storage": False,
            "parallel_write": {"pipeline_stage": False},
            "checkpoint_serialization": True,
        }
    },
    "bfloat16-old-name": {"bf16": DROP, "bfloat16": {"enabled": True}},
    "bucket-sizes-as-floats": {
        "zero_optimization.reduce_bucket_size": 2e8,
        "zero_optimization.allgather_bucket_size": 2e8,
    },
    "zero3-aliases": {
        "zero_optimization.stage": 3,
        "zero_optimization.stage3_prefetch_bucket_size": 5e7,
        "zero_optimization.stage3_param_persistence_threshold": 1e5,
        "zero_optimization.stage3_gather_16bit_weights_on_model_save": True,
    },
    "offload-optimizer-cpu": {
        "zero_optimization.offload_optimizer": {"device": "cpu", "pin_memory": True}
    },
    "offload-nvme-with-path": {
        "zero_optimization.stage": 3,
        "zero_optimization.offload_param": {"device": "nvme", "nvme_path": "/local_nvme"},
    },
    "monitors": {
        "tensorboard": {"enabled": True, "output_path": "runs", "job_name": "s16"},
        "csv_monitor": {"enabled": True, "output_path": "csv"},
        "wandb": {"enabled": False, "project": "wonderland"},
    },
    "comms_logger": {"comms_logger": {"enabled": True, "verbose": False, "prof_all": True}},
    "communication_data_type-upper": {"communication_data_type": "BF16"},
    "fp16-full": {
        "bf16": DROP,
        "fp16": {**FP16, "initial_scale_power": 12, "hysteresis": 2, "auto_cast": False},
    },
    "flops_profiler": {"flops_profiler": {"enabled": False, "profile_step": 1}},
    "activation_checkpointing": {
        "activation_checkpointing": {"partition_activations": True, "cpu_checkpointing": False}
    },
    "wall_clock_breakdown": {"wall_clock_breakdown": True, "memory_breakdown": False},
    "other-schedulers": {"scheduler": {"type": "OneCycle", "params": {"cycle_max_lr": 0.01}}},
}


@pytest.mark.parametrize("changes", DS_VALID_VARIANTS.values(), ids=DS_VALID_VARIANTS)
def test_deepspeed_features_accepted_by_both(changes: dict[str, Any], deepspeed_config) -> None:
    cfg = mutate(changes)
    assert ds_refusal(deepspeed_config, cfg) is None
    assert our_errors(cfg) == []


# ---------------------------------------------------------------- the keys DeepSpeed reads


class Recorder(dict):
    """A config dict that notes every key looked up in it (nested ones as 'a.b')."""

    def __init__(self, data: dict[str, Any], log: set[str], prefix: str = "") -> None:
        super().__init__(
            {
                k: Recorder(v, log, f"{prefix}{k}.") if isinstance(v, dict) else v
                for k, v in data.items()
            }
        )
        self.log, self.prefix = log, prefix

    def _note(self, key: object) -> None:
        self.log.add(f"{self.prefix}{key}")

    def __getitem__(self, key):
        self._note(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        self._note(key)
        return super().get(key, default)

    def __contains__(self, key) -> bool:
        self._note(key)
        return super().__contains__(key)

    def pop(self, key, *default):
        self._note(key)
        return super().pop(key, *default)

    def setdefault(self, key, default=None):
        self._note(key)
        return super().setdefault(key, default)

    def keys(self):  # so that `key in d.keys()` goes through __contains__
        return collections.abc.KeysView(self)

    def __iter__(self):
        self.log.add(f"{self.prefix}*")
        return super().__iter__()

    def __copy__(self) -> Recorder:  # DeepSpeedConfig works on copy.copy(config)
        new = Recorder({}, self.log, self.prefix)
        for key in dict.keys(self):
            dict.__setitem__(new, key, dict.__getitem__(self, key))
        return new


def test_recorder_records() -> None:
    log: set[str] = set()
    rec = Recorder({"a": {"b": 1}}, log)
    assert "x" not in rec.keys() and rec.get("y") is None and rec["a"]["b"] == 1
    assert copy.copy(rec)["a"].get("c") is None
    assert log == {"x", "y", "a", "a.b", "a.c"}


@pytest.fixture(scope="module")
def keys_deepspeed_reads(deepspeed_config) -> set[str]:
    raw = json.loads((REPO / "ds_configs" / "cpu_zero2_bf16.json").read_text())
    raw = for_deepspeed(raw)
    raw["checkpoint"] = {"tag_validation": "Warn", "load_universal": False}
    raw["flops_profiler"] = {"enabled": False}
    log: set[str] = set()
    deepspeed_config(Recorder(raw, log))
    return log


def test_every_top_level_key_deepspeed_reads_is_known(keys_deepspeed_reads: set[str]) -> None:
    top = {k for k in keys_deepspeed_reads if "." not in k}
    assert len(top) > 40  # the recorder sees DeepSpeed's lookups at all
    assert {"train_batch_size", "zero_optimization", "bf16", "checkpoint"} <= top
    assert "*" not in top, "DeepSpeed iterated over the top level: keys it reads may be hidden"
    looked_up_removed = top & ds_keys.removed_keys()
    assert looked_up_removed == ds_keys.removed_keys()  # it looks each one up to refuse it
    assert sorted(top - ds_keys.known_keys() - ds_keys.removed_keys()) == []


def test_every_checkpoint_key_deepspeed_reads_is_allowed(keys_deepspeed_reads: set[str]) -> None:
    read = {k.split(".", 1)[1] for k in keys_deepspeed_reads if k.startswith("checkpoint.")}
    assert {"tag_validation", "load_universal"} <= read
    assert read <= set(ds_models.Checkpoint.model_fields)


def test_removed_keys_are_deepspeeds(deepspeed_config) -> None:
    from deepspeed.runtime import config as ds_runtime_config

    assert ds_keys.removed_keys() == set(ds_runtime_config._REMOVED_TOP_LEVEL_CONFIG_KEYS)
    for key in ds_keys.removed_keys():
        assert ds_refusal(deepspeed_config, {**BASE, key: {}}) is not None, key


@pytest.mark.parametrize("section", sorted(ds_keys.SECTION_MODELS))
def test_section_keys_match_deepspeeds_models(section: str, deepspeed_config) -> None:
    """ds_keys reads the models' source with ast; the imported models must agree exactly."""
    import importlib

    relpath, class_name = ds_keys.SECTION_MODELS[section]
    module = importlib.import_module("deepspeed." + relpath[:-3].replace("/", "."))
    model = getattr(module, class_name)
    names = set(model.model_fields)
    names |= {f.alias for f in model.model_fields.values() if f.alias}
    assert ds_keys.section_keys(section) == names
    for name, spec in ds_keys.model_schema(relpath, class_name).items():
        field = model.model_fields.get(name) or next(
            f for f in model.model_fields.values() if f.alias == name
        )
        bounds = {
            op: float(getattr(m, op))
            for m in field.metadata
            for op in ("gt", "ge", "lt", "le")
            if getattr(m, op, None) is not None
        }
        assert dict(spec.bounds) == bounds, name


@pytest.fixture
def fresh_key_cache(tmp_path, monkeypatch):
    """ds_keys with an empty on-disk cache in tmp_path, and its in-process caches cleared."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    ds_keys._index.cache_clear()
    ds_keys.model_schema.cache_clear()
    yield tmp_path / "wonderland_ds"
    ds_keys._index.cache_clear()
    ds_keys.model_schema.cache_clear()


def test_the_key_cache_holds_exactly_what_the_parse_finds(fresh_key_cache) -> None:
    known, removed = ds_keys._parse_keys()
    assert ds_keys._parsed() == (known, removed)  # parsed now, and written
    (cache_file,) = fresh_key_cache.glob("ds_keys-*.json")
    ds_keys._index.cache_clear()
    ds_keys.model_schema.cache_clear()
    assert ds_keys._load_cache() is not None  # the next process reads it
    assert ds_keys._parsed() == (known, removed)
    for rel, cls in ds_keys.SECTION_MODELS.values():
        assert ds_keys.model_schema(rel, cls) == ds_keys._parse_schema(rel, cls), cls
    assert "stage" in ds_keys.zero_keys() and "train_batch_size" in known
    assert len(json.loads(cache_file.read_text())["files"]) >= 40  # every source it read


def test_a_changed_deepspeed_source_or_a_damaged_cache_is_parsed_again(fresh_key_cache) -> None:
    ds_keys._parsed()
    (cache_file,) = fresh_key_cache.glob("ds_keys-*.json")
    data = json.loads(cache_file.read_text())
    rel = sorted(data["files"])[0]
    data["files"][rel][1] -= 1  # as if that file had been edited since the cache was written
    data["known"] = ["only_this"]
    cache_file.write_text(json.dumps(data))
    assert ds_keys._load_cache() is None
    ds_keys._index.cache_clear()
    assert "train_batch_size" in ds_keys.known_keys()  # parsed again, not the stale list
    assert ds_keys._load_cache() is not None  # and the cache rewritten
    cache_file.write_text("{not json")
    assert ds_keys._load_cache() is None
    ds_keys._index.cache_clear()
    assert "train_batch_size" in ds_keys.known_keys()
