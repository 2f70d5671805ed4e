"""The model room: building Hugging Face models (partitioned under ZeRO-3), their levers
(gradient checkpointing, attention kernel, dtype, MoE router loss), the front's reading of a
model directory, the memory estimate and stage 18's streamed export."""
