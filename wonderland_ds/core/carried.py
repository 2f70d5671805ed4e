"""The launch environment carried to every node (``RUN/.deepspeed_env``); no torch import."""

#: Written to RUN_DIR/.deepspeed_env and named by DS_ENV_FILE, so DeepSpeed's pdsh launcher
#: exports them to every node (it forwards only NCCL*/PYTHON*/... variables by itself).
#: NCCL_TIMEOUT is not an NCCL variable: the real knobs are the process-group timeout
#: (passed to deepspeed.init_distributed from wonderland.process_group_timeout_s) and this one.
CARRIED_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
#: Variables of the launching shell that are carried too when set: DeepSpeed's runner forwards
#: only NCCL/PYTHON/UCX/MV2/MLFLOW ones, so GLOO_SOCKET_IFNAME (the interface gloo binds on a
#: multi-homed host), TORCH_NCCL_* and the fault switch would not reach the other hosts.
CARRIED_PREFIXES = (
    "GLOO_",
    "TORCH_NCCL_",
    "TORCH_DISTRIBUTED_",
    "WONDERLAND_",
    "OMP_NUM_THREADS",
    "TORCH_EXTENSIONS_DIR",
)
