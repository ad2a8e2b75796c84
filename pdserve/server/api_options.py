"""What the HTTP API of one server is configured to do, fixed at start-up: the model names it
answers to (`--served-model-name`), the sampling defaults (`--generation-config`), the tool-call
parser (`--tool-call-parser`, else the chat template's own format) and the reasoning parser.
Bad flags or files are a ValueError at start-up, naming them."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..core.errors import NotFound
from .reasoning import ReasoningParser, make_reasoning_parser
from .sampling_defaults import load_sampling_defaults
from .tool_parsers import ToolParser, detect_tool_parser, make_tool_parser


class ModelNotFound(NotFound):
    """OpenAI's 404 for a `model` this server does not serve."""

    def to_json(self) -> dict:
        return {"error": {"message": self.message, "type": "invalid_request_error", "param": "model",
                          "code": "model_not_found"}}


@dataclass(frozen=True)
class ApiOptions:
    served_names: tuple[str, ...] = ()  # empty: any model name is taken (in-process tests)
    sampling_defaults: dict = field(default_factory=dict)
    tool_parser: ToolParser | None = None
    reasoning: ReasoningParser | None = None
    template_takes_tools: bool = False

    @classmethod
    def build(cls, served_names: tuple[str, ...], generation_config: str, model_dir: str,
              template: str | None, tool_call_parser: str = "", reasoning_parser: str = "") -> "ApiOptions":
        parser = make_tool_parser(tool_call_parser) if tool_call_parser else detect_tool_parser(template)
        return cls(tuple(served_names), load_sampling_defaults(generation_config, model_dir), parser,
                   make_reasoning_parser(reasoning_parser), bool(template) and "tools" in (template or ""))

    @property
    def model_name(self) -> str:
        return self.served_names[0] if self.served_names else ""

    def check_model(self, model: str | None) -> str:
        """The name to answer with; a name we do not serve is a 404 (None: the first name)."""
        if model is None or not self.served_names:
            return model or self.model_name
        if model not in self.served_names:
            raise ModelNotFound(f"The model {model!r} does not exist on this server; it serves "
                                f"{list(self.served_names)} (see /v1/models)")
        return model
