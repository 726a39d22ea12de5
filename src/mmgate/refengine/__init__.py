"""The CPU reference engine: the vLLM, SGLang or TokenSpeed gRPC engine service over a transformers model.

Stage: engine (the far end of the transport).  It runs the real Hugging Face
model code on CPU, so what a gateway sends is checked by the model itself:
pixel tensors, grids, expanded placeholder runs.  A bundle without weights is
served by a shrunken, seeded random model that keeps every token id and the
patch geometry.  Families it runs: Qwen2/2.5/3-VL, LLaVA-1.5, LLaVA-NeXT,
Gemma 3 (one data row each in ``families.py``), plus text-only models.

``--wire vllm|sglang|tokenspeed`` picks the service, ``--role single|prefill|decode|encode``
the engine's part in a disaggregated deployment (docs/refengine-roles.md): a prefill
hands its KV cache to its decode engine, an encode engine its embeddings to its
prefill engine, over the engine's own loopback handoff keyed by room.  Every wire
and role reads its requests into the same neutral tensors and runs the same model
code, so greedy ids are the same whatever the split.

Modules, in request order:
  config.py     EngineConfig, parsed once from the command line.
  families.py   the per-family table (data): shrink sizes/rules/invariants, token types, raw pixel layout.
  shrink.py     the shrunken config for weight-less bundles (the rules the table names).
  bundle.py     bundle -> model + ModelFacts; the lazy tokenizer.
  tensors.py    TensorData (inline, shm, SGLang's bare bytes) -> torch tensor.
  device_normalize.py  uint8 -> float32 pixels (--mm-device-do-normalize), per the family's raw layout.
  mm_inputs.py  neutral MediaBatch values -> ModelInputs (forward kwargs); the vLLM wire's reader.
  tokenspeed_inputs.py  the TokenSpeed wire's items, bootstrap info and sampling fields.
  sampling.py   SamplingParams -> GenerationPlan.
  constraint_pool.py  a constraint compiled in a child process (deadline, memory cap, cache), off the model thread.
  constraint_worker.py  that child: one xgrammar compiler;  constraints.py  the grammar's mask on each step.
  generation.py the token loop: a single engine, a prefill leg, a decode leg.
  kv_state.py   what a prefill hands its decode: KV cache, position state, first tokens.
  encoding.py   EPD: the tower on one item; the items' embeddings as mm_encoder_outputs.
  handoff.py    the engine's own transfer between legs: a TCP listener keyed by room.
  core.py       the wire-neutral engine: registry, model thread, each role's leg.
  streaming.py  a leg's events -> each wire's GenerateResponse stream.
  mm_config.py  --mm-processor off|inprocess|redis and the shared processing flags.
  mm_processor.py  worker-side media processing of media_refs (in process, or via the Redis sidecar).
  recording.py  --record-dir: each request's final model inputs as .npz (debug).
  wire_base.py  the Generate flow and refusals every wire shares.
  servicer.py   the vLLM servicer;  sglang_servicer.py, tokenspeed_servicer.py the others.
  health.py     the standard grpc.health.v1.Health service.
  server.py     start_engine / serve / main.

Entry points: ``mmgate.refengine.server.serve(config)`` and
``mmgate.refengine.server.main(argv)`` (``python -m mmgate.refengine``).
Importing this package imports neither torch nor transformers.
"""
