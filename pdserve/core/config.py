"""Frozen config dataclasses; the CLI flags are generated from their fields."""

from __future__ import annotations

import argparse
import enum
import json
import typing
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any

from .pd_vocab import DEFAULT_BOOTSTRAP_PORT, KV_DTYPES, LB_METHODS, SERVED_BACKENDS


class Role(str, enum.Enum):
    COLOCATED = "colocated"
    PREFILL = "prefill"
    DECODE = "decode"




def _opt(help: str, choices: tuple[Any, ...] | None = None, aliases: tuple[str, ...] = (), **kw: Any) -> Any:
    """A config field; `aliases`: other flag names users know it by (e.g. SGLang's)."""
    return field(metadata={"help": help, "choices": choices, "aliases": aliases}, **kw)


@dataclass(frozen=True)
class ServerConfig:
    """Everything `pdserve serve` needs; workers get a copy plus their dp_rank."""

    role: Role = _opt("server role", tuple(r.value for r in Role), default=Role.COLOCATED)
    model: str = _opt("local HF dir, .gguf file, or 'smollm2-135m' (default)", default="smollm2-135m")
    host: str = _opt("bind address of every listener (HTTP, bootstrap service, transfer endpoints); "
                     "0.0.0.0 or :: for all", default="127.0.0.1")
    advertise_host: str = _opt(
        "address peers are told for this server's bootstrap service and transfer endpoints (default: "
        "--host; for 0.0.0.0 or ::, --advertise-interface's address or the default route's; also "
        "PDSERVE_ADVERTISE_HOST or SGLang's SGLANG_HOST_IP)", default="")
    advertise_interface: str = _opt(
        "with --host 0.0.0.0 or ::, advertise this network interface's address (also "
        "PDSERVE_ADVERTISE_INTERFACE or SGLang's SGLANG_LOCAL_IP_NIC)", default="")
    port: int = _opt("HTTP port", default=30000)
    dp_size: int = _opt("number of data-parallel worker processes", default=1)
    load_balance_method: str = _opt("DP dispatch method", LB_METHODS, default="auto")
    bootstrap_port: int = _opt("prefill bootstrap service port", default=DEFAULT_BOOTSTRAP_PORT,
                               aliases=("--disaggregation-bootstrap-port",))
    transfer_port: int = _opt("port of DP rank 0's transfer endpoint; rank r listens on this + r, so a "
                              "firewall or a proxy can name them (0 = any free port)", default=0)
    transfer_backend: str = _opt("KV transfer backend", SERVED_BACKENDS, default="tcp",
                                 aliases=("--disaggregation-transfer-backend",))
    force_query_prefill_dp_rank: bool = _opt(
        "prefill: allow mixed routing; decode: always query the prefill DP rank", default=False)
    dtype: str = _opt("weights and KV dtype (auto: the checkpoint's torch_dtype if bfloat16 or float16, "
                      "else bfloat16 where supported)", ("auto", *KV_DTYPES),
                      default="auto")
    device: str = _opt("torch device", ("cpu", "cuda"), default="cpu")
    page_size: int = _opt("tokens per KV page", default=16)
    max_total_tokens: int = _opt("KV pool size in tokens per worker (0 = from --mem-fraction)", default=0)
    mem_fraction: float = _opt("fraction of free memory for the KV pool when max_total_tokens is 0",
                               default=0.05)
    max_running_requests: int = _opt("max requests decoding at once per worker", default=64)
    chunked_prefill_size: int = _opt("max prompt tokens prefilled per step (every step also decodes "
                                     "each running request)", default=512)
    max_num_batched_tokens: int = _opt(
        "max tokens per step, decodes and prompt chunks together (vLLM's flag); prefill chunks get "
        "what the decodes leave, up to --chunked-prefill-size (0 = no cap beyond that)", default=0)
    disable_prefix_cache: bool = _opt(
        "do not reuse KV pages of earlier requests' prompts (the prefix cache is on by default)",
        default=False, aliases=("--disable-radix-cache",))
    disagg_local_prefill_max_tokens: int = _opt(
        "decode: prefill a PD request on this decode instead, and tell its prefill to drop the room, "
        "when at most this many of its prompt tokens are missing from this decode's prefix cache "
        "(conditional disaggregation; 0 = always use the prefill)", default=0)
    disagg_prefill_overload_tokens: int = _opt(
        "decode: also prefill a PD request here when its prefill server last reported more than this "
        "many prompt tokens queued or in flight (bootstrap /health, read on each heartbeat; 0 = never)",
        default=0)
    num_reserved_decode_tokens: int = _opt(
        "decode: KV tokens kept for the generation of each request (running, or holding pages for its "
        "KV), at most its max_new_tokens still to come; a handoff is admitted only when the pool holds "
        "its prompt (less the pages reused from the prefix cache) plus these (SGLang's flag)", default=512)
    max_queued_handoffs: int = _opt(
        "decode: handoffs per DP worker waiting for KV pages, in arrival order; one more is refused "
        "at once with 429 (0 = refuse at once a handoff the pool cannot hold)", default=64)
    handoff_queue_timeout: float = _opt(
        "decode: seconds a handoff waits for KV pages before it is refused with 429", default=30.0)
    max_held_prefill_tokens: int = _opt(
        "prefill: prompt tokens of PD requests a DP rank holds at once (prefilling, holding KV for a "
        "slow decode, or sending it); a request beyond it is refused at once with 429, unless the rank "
        "holds none (0 = no limit)", default=0)
    context_length: int = _opt("max prompt + output tokens (0 = the model's)", default=0)
    cpu_kernels: str = _opt("bfloat16 on CPU: auto (our C kernels, built with gcc at first use where the "
                            "CPU has what they need: attention, norms and RoPE with AVX-512 BF16, "
                            "matmuls with AVX2) or torch (none of them: torch ops only)",
                            ("auto", "torch"), default="auto")
    cpu_calibration: str = _opt(
        "CPU: auto (measure which matmul, attention and norm paths are fastest here at first start, "
        "then reuse the result, cached per CPU, threads, torch version and model shape), redo "
        "(measure again) or off (the defaults, unmeasured); server_info shows the plan and why",
        ("auto", "redo", "off"), default="auto")
    cpu_matmul: str = _opt("force the matmul path: torch (F.linear as stored), onednn (oneDNN's "
                           "packed bf16), panel (our AVX2 bf16 kernel), float32 (weights held in "
                           "float32) or onednn_gemv (onednn, and our AVX-512 BF16 kernel for one or two "
                           "rows: twice the weight memory); auto: measured",
                           ("auto", "torch", "onednn", "panel", "float32", "onednn_gemv"),
                           default="auto")
    cpu_decode_attention: str = _opt("force decode attention: kernel (ours), torch, torch_fp32 "
                                     "(torch ops on float32 copies); auto: measured",
                                     ("auto", "kernel", "torch", "torch_fp32"), default="auto")
    cpu_prefill_attention: str = _opt("force prefill attention at every length: kernel (ours, tiled "
                                      "where faster), kernel_per_query, torch, torch_fp32; auto: "
                                      "measured per KV length", ("auto", "kernel", "kernel_per_query",
                                                                 "torch", "torch_fp32"), default="auto")
    cpu_wait_policy: str = _opt(
        "how workers' OpenMP threads wait between parallel regions: auto (measured once per CPU; "
        "spinning workers park their threads while idle and beside CPU-bound processes), passive, "
        "active or spin:N (libgomp's GOMP_SPINCOUNT); a user's OMP_WAIT_POLICY or GOMP_SPINCOUNT "
        "wins over auto", default="auto")
    cpu_norms: str = _opt("force norms and RoPE: fused (our C ops) or torch; auto: measured",
                          ("auto", "fused", "torch"), default="auto")
    num_threads: int = _opt("torch threads per worker (0 = its --cpu-bind cores, or cores / dp_size)",
                            default=0)
    cpu_bind: str = _opt("cores of each DP worker, as vLLM's VLLM_CPU_OMP_THREADS_BIND: auto (split this "
                         "process's cores among the ranks, one pinned thread per core), none, or lists "
                         "per rank like 0-3|4-7", default="auto")
    api_key: str = _opt("require this Bearer token (health stays open)", default="")
    bootstrap_token: str = _opt("prefill: cluster token the bootstrap service requires on PUT /route and "
                                "/register_dp_rank (also PDSERVE_BOOTSTRAP_TOKEN, which keeps it off the "
                                "command line)", default="")
    max_request_bytes: int = _opt("largest request body in bytes; a larger one gets 413", default=64 << 20)
    max_concurrent_requests: int = _opt("generation requests served at once; more wait in a queue "
                                        "(0 = no limit)", default=1024)
    max_queued_requests: int = _opt("requests waiting for a slot; more are refused at once with 429",
                                    default=1024)
    queue_timeout: float = _opt("seconds a request waits for a slot before it is refused with 429",
                                default=30.0)
    log_level: str = _opt("log level", ("debug", "info", "warning", "error"), default="info")
    log_format: str = _opt("log lines: text (key=value) or json, one line per event", ("text", "json"),
                           default="text")
    instance_id: str = _opt("server instance id in logs and metrics (default: random per start)", default="")
    served_model_name: tuple[str, ...] = _opt(
        "model names the OpenAI routes answer to, first one reported (vLLM/SGLang's flag; may take several; "
        "default: the model dir name); another `model` in a request is a 404", default=())
    tool_call_parser: str = _opt("tool-call format parsed from chat answers (vLLM's names; default: the one "
                                 "the chat template uses, if any)", ("hermes", "llama3_json"), default="")
    reasoning_parser: str = _opt("split <think>...</think> into reasoning_content (vLLM/SGLang's names)",
                                 ("deepseek_r1", "qwen3"), default="")
    generation_config: str = _opt("sampling defaults for fields a request leaves unset: auto (the model's "
                                  "generation_config.json), vllm (none: the API defaults) or a directory "
                                  "holding a generation_config.json (vLLM's flag)", default="auto")

    def __post_init__(self) -> None:
        from .cpu_binding import rank_cpus

        for rank in range(max(1, self.dp_size)):  # a bad --cpu-bind fails at start-up, naming it
            rank_cpus(self.cpu_bind, rank, max(1, self.dp_size))
        if self.cpu_wait_policy != "auto":
            from .wait_policy import env_for

            env_for(self.cpu_wait_policy)  # raises ValueError naming the flag
        for name in ("disagg_local_prefill_max_tokens", "disagg_prefill_overload_tokens"):
            flag = _flag(name)
            if getattr(self, name) and Role(self.role) is not Role.DECODE:
                raise ValueError(f"{flag} applies to --role decode only")
            if getattr(self, name) < 0:
                raise ValueError(f"{flag} must be >= 0")
        for name in ("num_reserved_decode_tokens", "max_queued_handoffs", "max_held_prefill_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{_flag(name)} must be >= 0, got {getattr(self, name)}")
        if self.max_held_prefill_tokens and Role(self.role) is not Role.PREFILL:
            raise ValueError("--max-held-prefill-tokens applies to --role prefill only")
        if not self.handoff_queue_timeout > 0:
            raise ValueError(f"--handoff-queue-timeout must be > 0, got {self.handoff_queue_timeout}")
        if self.transfer_port and not 0 < self.transfer_port <= 65536 - max(1, self.dp_size):
            raise ValueError(f"--transfer-port {self.transfer_port}: ports {self.transfer_port}.."
                             f"{self.transfer_port + max(1, self.dp_size) - 1} must lie in 1..65535")
        if self.chunked_prefill_size < 1:
            raise ValueError(f"--chunked-prefill-size must be >= 1, got {self.chunked_prefill_size}")
        if self.max_num_batched_tokens and self.max_num_batched_tokens <= self.max_running_requests:
            raise ValueError(f"--max-num-batched-tokens ({self.max_num_batched_tokens}) must be larger than "
                             f"--max-running-requests ({self.max_running_requests}): a step full of decodes "
                             "would leave prompts no tokens")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_dataclass_args(parser: argparse.ArgumentParser, cls: type, skip: tuple[str, ...] = ()) -> None:
    """Add one CLI flag per dataclass field, typed from the field's default."""
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        if f.name in skip:
            continue
        default = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[operator]
        kind = hints[f.name]
        meta = f.metadata
        kw: dict[str, Any] = {"help": meta.get("help", ""), "dest": f.name}
        names = (_flag(f.name), *meta.get("aliases", ()))
        if kind is bool:
            parser.add_argument(*names, action="store_true", default=default, **kw)
            continue
        if typing.get_origin(kind) is tuple:  # tuple[str, ...]: one or more values
            parser.add_argument(*names, nargs="+", default=default, **kw)
            continue
        if isinstance(default, enum.Enum):
            kw["type"] = str
            default = default.value
        else:
            kw["type"] = kind if kind in (int, float, str) else str
        if meta.get("choices"):
            kw["choices"] = meta["choices"]
        parser.add_argument(*names, default=default, **kw)


def dataclass_from_args(cls: type[Any], args: argparse.Namespace, **override: Any) -> Any:
    hints = typing.get_type_hints(cls)
    kw = {}
    for f in fields(cls):
        if f.name in override:
            kw[f.name] = override[f.name]
        elif hasattr(args, f.name):
            v = getattr(args, f.name)
            kind = hints[f.name]
            if isinstance(kind, type) and issubclass(kind, enum.Enum):
                v = kind(v)
            elif typing.get_origin(kind) is tuple:
                v = tuple(v)
            kw[f.name] = v
    return cls(**kw)


def config_to_json(cfg: ServerConfig) -> str:
    """ServerConfig as JSON (enums by value), for a worker's command line."""
    return json.dumps({k: (v.value if isinstance(v, enum.Enum) else v) for k, v in asdict(cfg).items()})


def config_from_json(text: str) -> ServerConfig:
    d = json.loads(text)
    d["role"] = Role(d["role"])
    d["served_model_name"] = tuple(d.get("served_model_name") or ())
    return ServerConfig(**d)
