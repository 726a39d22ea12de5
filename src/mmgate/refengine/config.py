"""Reference-engine configuration: the command line, parsed once.

Stage: engine start-up.  In: ``argv`` of ``mmgate engine`` /
``python -m mmgate.refengine``; out: a frozen :class:`EngineConfig` that is
passed down explicitly.  No other module of the engine reads the command line
or the environment.

``--wire vllm|sglang|tokenspeed`` picks the gRPC service the engine serves and
``--role single|prefill|decode|encode`` its part in a disaggregated deployment
(docs/refengine-roles.md); ``encode`` exists on the TokenSpeed wire only (its
``TokenSpeedEncoder`` service).  A prefill or encode engine listens for its
consumers on ``--bootstrap-port`` (the reference engine's own handoff,
:mod:`mmgate.refengine.handoff`).  ``--language-model-only`` makes the engine
report and behave as a worker that runs the language model without its vision
tower (vLLM ``--language-model-only``, SGLang ``language_only``, TokenSpeed
with no active modality): it takes no media tensors, only a decode leg's media
identity (docs/refengine-roles.md).  ``--constraint-compile-*`` bound the compile of a
structured-output constraint, which runs in a child process (:mod:`.constraint_pool`).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from mmgate.engines.base import Role, Wire
from mmgate.config.options import add_option, resolve
from mmgate.refengine.mm_config import MmProcessorConfig, add_mm_arguments, mm_config
from mmgate.config.settings import ENCODER_DTYPES, add_model_options


@dataclass(frozen=True, slots=True)
class CompileLimits:
    """How structured-output constraints are compiled (``--constraint-compile-*``; :mod:`.constraint_pool`)."""

    timeout_s: float = 10.0  # a compile running longer is abandoned (its child killed): constraint_too_complex
    memory_bytes: int = 1 << 30  # address space a child may add while compiling (RLIMIT_AS)
    workers: int = 2  # child processes at most (started on demand, kept warm; one compile each at a time)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything the reference engine is started with."""

    model: Path  # bundle folder: config.json, tokenizer files, optional *.safetensors
    host: str = "127.0.0.1"
    port: int = 0  # 0 = let the OS pick; serve() reports the bound port
    seed: int = 0  # torch.manual_seed for random weights
    served_model_name: str = ""  # "" = the model path as given (vLLM's default)
    max_tokens_default: int = 16  # completion budget when a request leaves max_tokens unset
    num_threads: int = 2  # torch.set_num_threads
    model_workers: int = 1  # threads running model code (one request at a time per thread)
    rpc_workers: int = 64  # Generate streams at once (each holds a gRPC thread; the pool has a few more for health)
    device_normalize: bool = False  # take raw uint8 pixels and rescale+normalize here (mm_device_do_normalize)
    encoder_dtype: str = "float32"  # advertised multimodal_encoder_dtype label (--advertised-encoder-dtype)
    log_level: str = "info"  # --log-level: level of the engine's loggers
    mm: MmProcessorConfig = field(default_factory=MmProcessorConfig)  # worker-side media processing
    record_dir: Path | None = None  # debug: write each request's final model inputs here (.npz)
    wire: Wire = Wire.VLLM  # the gRPC service served
    role: Role = Role.SINGLE  # single | prefill | decode | encode (TokenSpeed only)
    bootstrap_port: int = 0  # a prefill / encode engine's handoff listener (0: the OS picks; reported)
    handoff_timeout_s: float = 30.0  # an unclaimed KV / embedding is freed after this long
    handoff_wait_s: float = 30.0  # a decode / EPD prefill waits this long for its room
    language_model_only: bool = False  # no vision tower: report it, take no media tensors (a decode leg's identity only)
    compile_limits: CompileLimits = field(default_factory=CompileLimits)  # structured-output constraint compiles

    @property
    def model_name(self) -> str:
        """The name GetModelInfo reports."""
        return self.served_model_name or str(self.model)


def build_arg_parser() -> argparse.ArgumentParser:
    """The ``mmgate engine`` argument parser, its options grouped by topic (docs/configuration.md).

    The worker-side processing groups (media intake, video) are ``mmgate serve``'s own
    definitions (:func:`mmgate.sidecar.config.add_processing_arguments`).
    """
    parser = argparse.ArgumentParser(
        prog="mmgate engine",
        description="CPU reference engine: the vLLM, SGLang or TokenSpeed gRPC engine service over a "
                    "transformers model, as a single engine or one leg of a disaggregated deployment.",
    )
    g = parser.add_argument_group("engine")
    add_model_options(g, search_path=False)
    add_option(g, "--host", default="127.0.0.1", help="address the gRPC server listens on")
    add_option(g, "--port", type=int, default=0, minimum=0, help="gRPC port (0 picks a free port)")
    add_option(g, "--seed", type=int, default=0, help="seed for random weights")
    add_option(g, "--served-model-name", default="", help="name reported by GetModelInfo (default: --model)")
    add_option(g, "--max-tokens-default", type=int, default=16, help="max_tokens when a request omits it")
    add_option(g, "--num-threads", type=int, default=2, help="torch CPU threads")
    add_option(g, "--mm-device-do-normalize", action="store_true", default=False,
               help="advertise mm_device_do_normalize: take uint8 pixels and normalize them here")
    add_option(g, "--advertised-encoder-dtype", "--multimodal-encoder-dtype", dest="advertised_encoder_dtype",
               choices=list(ENCODER_DTYPES), default="float32",
               help="multimodal_encoder_dtype label the engine reports (the gateway's --multimodal-encoder-dtype "
                    "auto converts float tensors to it); --multimodal-encoder-dtype: its old, deprecated spelling")
    add_option(g, "--record-dir", type=Path, default=None, metavar="DIR",
               help="debug: write each request's final input_ids and model tensors to DIR/<request_id>.npz")
    d = parser.add_argument_group("disaggregation")
    add_option(d, "--wire", choices=[w.value for w in Wire], default=Wire.VLLM.value,
               help="the gRPC service served: vllm (VllmEngine), sglang (SglangScheduler), tokenspeed "
                    "(TokenSpeedScheduler, and TokenSpeedEncoder for --role encode)")
    add_option(d, "--role", choices=[r.value for r in Role], default=Role.SINGLE.value,
               help="single engine, or one leg of a disaggregated pair: prefill, decode, encode (tokenspeed only)")
    add_option(d, "--bootstrap-port", type=int, default=0, minimum=0,
               help="port of a prefill / encode engine's handoff listener (0 picks a free port; "
                    "GetServerInfo reports it)")
    add_option(d, "--handoff-timeout", type=float, default=30.0, minimum=0.001,
               help="seconds a prefill's KV or an encoder's embeddings wait for their consumer before they are freed")
    add_option(d, "--handoff-wait", type=float, default=30.0, minimum=0.0,
               help="seconds a decode or EPD prefill waits for its bootstrap room to be published")
    add_option(d, "--language-model-only", action="store_true", default=False,
               help="run as a language-model-only worker (no vision tower): report it as the wire's engines do "
                    "(vLLM supports_vision false, SGLang language_only, TokenSpeed no modality) and refuse media "
                    "tensors; a decode leg's media identity is still taken")
    c = parser.add_argument_group("structured outputs")
    add_option(c, "--constraint-compile-timeout", type=float, default=10.0, minimum=0.001,
               help="seconds a structured-output constraint may take to compile (in a child process); past it "
                    "the compile is abandoned and the request refused: 400 constraint_too_complex")
    add_option(c, "--constraint-compile-memory", type=int, default=1024, minimum=16, metavar="MIB",
               help="MiB of address space one compile may add to its child process (RLIMIT_AS); past it: "
                    "400 constraint_too_complex")
    add_option(c, "--constraint-compile-workers", type=int, default=2, minimum=1,
               help="child processes compiling constraints, at most (started on demand and kept warm; each "
                    "compiles one constraint at a time)")
    add_mm_arguments(parser)
    return parser


def parse_args(argv: list[str] | None, environ: Mapping[str, str] | None = None) -> EngineConfig:
    """Parse ``argv`` (``None`` = ``sys.argv[1:]``) and ``environ`` (``None`` = ``os.environ``;
    the media-processor and shared processing options have environment fallbacks) into an
    :class:`EngineConfig`.

    Raises:
        SystemExit: bad arguments (argparse prints the usage).
    """
    parser = build_arg_parser()
    env = os.environ if environ is None else environ
    ns = resolve(parser, parser.parse_args(argv), env)
    if ns.max_tokens_default < 1:
        parser.error("--max-tokens-default must be at least 1")
    if ns.num_threads < 1:
        parser.error("--num-threads must be at least 1")
    if ns.role == Role.ENCODE.value and ns.wire != Wire.TOKENSPEED.value:
        parser.error("--role encode exists on the tokenspeed wire only (its TokenSpeedEncoder service)")
    if ns.role == Role.ENCODE.value and ns.language_model_only:
        parser.error("--language-model-only: an encode worker runs the vision tower")
    return EngineConfig(
        model=ns.model,
        host=ns.host,
        port=ns.port,
        seed=ns.seed,
        served_model_name=ns.served_model_name,
        max_tokens_default=ns.max_tokens_default,
        num_threads=ns.num_threads,
        device_normalize=ns.mm_device_do_normalize,
        encoder_dtype=ns.advertised_encoder_dtype,
        log_level=ns.log_level,
        mm=mm_config(ns, parser, env),
        record_dir=ns.record_dir,
        wire=Wire(ns.wire),
        role=Role(ns.role),
        bootstrap_port=ns.bootstrap_port,
        handoff_timeout_s=ns.handoff_timeout,
        handoff_wait_s=ns.handoff_wait,
        language_model_only=ns.language_model_only,
        compile_limits=CompileLimits(timeout_s=ns.constraint_compile_timeout,
                                     memory_bytes=ns.constraint_compile_memory << 20,
                                     workers=ns.constraint_compile_workers),
    )
