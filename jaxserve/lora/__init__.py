"""Multi-LoRA: PEFT adapters served beside the base model in one batch.

`request` names an adapter (vLLM's LoRARequest), `adapter` loads and checks one from a PEFT directory into host
arrays, `buffers` holds `max_loras` of them on device as fixed-shape stacks the step reads, `delta` computes the
LoRA term of a linear layer for a ragged batch whose tokens each name a slot (or none).
"""
