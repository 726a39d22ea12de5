"""The CPU reference engine: a ``vllm.grpc.engine.VllmEngine`` gRPC server over a transformers model.

Stage: engine (the far end of the transport).  It runs the real Hugging Face
model code on CPU, so what a gateway sends is checked by the model itself:
pixel tensors, grids, expanded placeholder runs.  A bundle without weights is
served by a shrunken, seeded random model that keeps every token id and the
patch geometry.  Families it runs: Qwen2/2.5/3-VL, LLaVA-1.5, LLaVA-NeXT,
Gemma 3 (one data row each in ``families.py``), plus text-only models.

Modules, in request order:
  config.py     EngineConfig, parsed once from the command line.
  families.py   the per-family table (data): shrink sizes/rules/invariants, token types, raw pixel layout.
  shrink.py     the shrunken config for weight-less bundles (the rules the table names).
  bundle.py     bundle -> model + ModelFacts; the lazy tokenizer.
  tensors.py    decode_tensor: one TensorData -> torch tensor (inline; shm slots in here).
  device_normalize.py  uint8 -> float32 pixels (--mm-device-do-normalize), per the family's raw layout.
  mm_inputs.py  GenerateRequest -> ModelInputs (forward kwargs, as the vLLM servicer builds them).
  sampling.py   SamplingParams -> GenerationPlan.
  generation.py model.generate with streaming, stop rules, cancel.
  mm_config.py  --mm-processor off|inprocess|redis and the shared processing flags.
  mm_processor.py  worker-side media processing of media_refs (in process, or via the Redis sidecar).
  recording.py  --record-dir: each request's final model inputs as .npz (debug).
  servicer.py   the gRPC servicer.
  server.py     start_engine / serve / main.

Entry points: ``mmgate.refengine.server.serve(config)`` and
``mmgate.refengine.server.main(argv)`` (``python -m mmgate.refengine``).
Importing this package imports neither torch nor transformers.
"""
