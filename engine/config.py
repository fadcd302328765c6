"""The engine's settings, in one place: built once from the flags (``from_args``) and
validated there, sent to ``--dp-size`` engine workers when they connect (``to_dict`` /
``from_dict``: the workers get no engine flags of their own), turned into the
scheduler's config (``scheduler``) and reported by ``/server_info`` (``settings``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from .errors import ModelLoadError
from .platform import platform
from .scheduler import SchedulerConfig
from .speculative import SpeculativeConfig

# SpeculativeConfig's fields under SGLang's flag names.
SPECULATIVE_FLAGS = {
    "num_draft_tokens": "speculative_num_draft_tokens",
    "min_window": "speculative_ngram_min_match_window_size",
    "max_window": "speculative_ngram_max_match_window_size",
}


def option(dest: str) -> str:
    """The command-line spelling of an argparse destination."""
    return "--" + dest.replace("_", "-")


@dataclass(frozen=True)
class EngineConfig:
    # The model: a GGUF file or a transformers folder; None: the default model.
    model_path: str | None = None
    device: str = "cpu"
    dtype: str = "auto"  # "auto" until settled (``precision``)
    quantization: str | None = None  # None: chosen from the file (``quantization``)
    threads: int = 1
    context_length: int | None = None  # None: the model's own
    max_running_requests: int = 64
    chunked_prefill_size: int = 512
    kv_cache_gb: float = 4.0
    mixed_chunk: bool = True
    speculative_algorithm: str | None = None
    speculative: SpeculativeConfig | None = None
    cuda_graph: bool = True  # on a CUDA device
    cuda_graph_max_bs: int = 0  # 0: max_running_requests
    torch_compile: bool = False  # the CPU's decode step compiled by inductor
    torch_compile_max_bs: int = 4

    def __post_init__(self) -> None:
        platform(self.device)  # a device Sluice runs on
        if self.cuda_graph_max_bs < 0:
            raise ModelLoadError("--cuda-graph-max-bs must be 0 (the default) or more")
        if self.torch_compile_max_bs < 1:
            raise ModelLoadError("--torch-compile-max-bs must be at least 1")
        if self.torch_compile and platform(self.device).captures_graphs:
            raise ModelLoadError(
                "--enable-torch-compile compiles the CPU's decode step; on "
                f"--device {self.device} decode steps are replayed from CUDA graphs"
            )
        if self.max_running_requests < 1:
            raise ModelLoadError("--max-running-requests must be at least 1")
        if self.chunked_prefill_size < 1:
            raise ModelLoadError("--chunked-prefill-size must be at least 1")
        if self.kv_cache_gb <= 0:
            raise ModelLoadError("--kv-cache-gb must be more than 0")
        if self.context_length is not None and self.context_length < 1:
            raise ModelLoadError("--context-length must be at least 1")

    @classmethod
    def from_args(cls, args: Any) -> EngineConfig:
        """From parsed flags (``sluice.cli``); raises ``ModelLoadError``."""
        return cls(
            model_path=args.model_path,
            device=args.device,
            dtype=args.dtype,
            quantization=args.quantization,
            threads=args.threads,
            context_length=args.context_length,
            max_running_requests=args.max_running_requests,
            chunked_prefill_size=args.chunked_prefill_size,
            kv_cache_gb=args.kv_cache_gb,
            mixed_chunk=not args.disable_mixed_chunk,
            speculative_algorithm=args.speculative_algorithm,
            speculative=_speculative(args),
            cuda_graph=not args.disable_cuda_graph,
            cuda_graph_max_bs=args.cuda_graph_max_bs,
            torch_compile=args.enable_torch_compile,
            torch_compile_max_bs=args.torch_compile_max_bs,
        )

    def settled(self, *, model_path: str, dtype: str, quantization: str) -> EngineConfig:
        """This config with the model resolved and its precision and quantisation
        chosen: what a worker is sent, so that it chooses nothing again."""
        return dataclasses.replace(
            self, model_path=model_path, dtype=dtype, quantization=quantization
        )

    def scheduler(self, context_length: int) -> SchedulerConfig:
        return SchedulerConfig(
            max_running=self.max_running_requests,
            context_length=context_length,
            prefill_chunk=self.chunked_prefill_size,
            mixed_chunk=self.mixed_chunk,
            speculative=self.speculative,
            kv_cache_bytes=int(self.kv_cache_gb * (1 << 30)),
            fixed_shape_decode=self.torch_compile
            or (self.cuda_graph and platform(self.device).captures_graphs),
            graph_max_batch=self.torch_compile_max_bs
            if self.torch_compile
            else self.cuda_graph_max_bs,
            compile_decode=self.torch_compile,
        )

    def settings(self) -> dict[str, object]:
        """``/server_info``'s engine fields, by SGLang's names (no paths)."""
        speculative: dict[str, object] = {"speculative_algorithm": self.speculative_algorithm}
        if self.speculative is not None:
            speculative.update(
                {flag: getattr(self.speculative, f) for f, flag in SPECULATIVE_FLAGS.items()}
            )
        return {
            "device": self.device,
            "threads": self.threads,
            "context_length": self.context_length,
            "max_running_requests": self.max_running_requests,
            "chunked_prefill_size": self.chunked_prefill_size,
            "kv_cache_gb": self.kv_cache_gb,
            "enable_mixed_chunk": self.mixed_chunk,
            "disable_cuda_graph": not self.cuda_graph,
            "cuda_graph_max_bs": self.cuda_graph_max_bs,
            "enable_torch_compile": self.torch_compile,
            "torch_compile_max_bs": self.torch_compile_max_bs,
            **speculative,
        }

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EngineConfig:
        speculative = data.get("speculative")
        return cls(
            **{
                **data,
                "speculative": SpeculativeConfig(**speculative) if speculative else None,
            }
        )


def _speculative(args: Any) -> SpeculativeConfig | None:
    """The speculative decoding the flags ask for; ``ModelLoadError`` for sizes given
    without ``--speculative-algorithm`` (they would do nothing) or out of range."""
    given = {field: getattr(args, flag) for field, flag in SPECULATIVE_FLAGS.items()}
    given = {field: value for field, value in given.items() if value is not None}
    if args.speculative_algorithm is None:
        if given:
            named = ", ".join(option(SPECULATIVE_FLAGS[field]) for field in given)
            raise ModelLoadError(f"{named} needs --speculative-algorithm NGRAM")
        return None
    try:
        return SpeculativeConfig(**given)
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from exc
