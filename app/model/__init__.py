"""The model in this process: loading (GGUF or hub), int8 weights, the ragged batched pass, attention, the KV cache
and the scheduler that owns every forward pass. Used by the in-process backend; the UI never imports it."""
