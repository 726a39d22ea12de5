"""Worker-side media processing: the shared processor and the Redis media sidecar.

Stage: the far side of ``--mm-processing worker``.  A worker (the reference
engine) receives an unexpanded prompt and media references; it processes them
in process (``--mm-processor inprocess``) or hands them to a GPU-free sidecar
over Redis (``--mm-processor redis``).  Both run mmgate's own pipeline
(:meth:`mmgate.pipeline.prepare.Pipeline.process_media`), so the tensors equal what the
gateway would have sent.

Modules:
  config.py     ProcessingConfig: the processing flags engine and sidecar share.
  processor.py  MediaProcessor (ids with anchors + refs -> expanded ids + batches), the fingerprint.
  protocol.py   Redis keys, job/result messages (msgspec msgpack, raw tensor bytes).
  client.py     the engine's side of the Redis protocol (probe the hello, submit, wait).
  server.py     ``mmgate sidecar``: the sidecar process.
"""
