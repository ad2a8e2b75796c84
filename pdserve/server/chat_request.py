"""The chat-only part of a /v1/chat/completions body: checked messages, tools and tool_choice,
and the `ChatShape` that says how the answer is read back (reasoning split, tool calls).

A tool_choice this server cannot honour is a 400 naming why: tools for a chat template that does
not take them, "auto" with no tool-call parser, `strict` tools under "auto". "required" and a
named function hold the answer to a JSON schema with the structured-output grammar.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..core.errors import BadRequest
from ..core.grammar_spec import json_schema_spec
from ..core.sampling import SamplingParams, unsupported
from ..grammar.compiler import check_spec
from .api_options import ApiOptions
from .chat_messages import chat_messages
from .chat_output import ChatShape
from .protocol import opt_bool
from .tokenizer import ServerTokenizer
from .tools import FirstCallOnly, ToolChoice, ToolRequest, forced_parser, forced_schema, parse_tools


@dataclass(frozen=True)
class ChatRequest:
    messages: list[dict]
    tools: ToolRequest
    shape: ChatShape
    forced_schema: dict | None = None  # the grammar a forced tool_choice needs

    def prompt_text(self, body: dict, tok: ServerTokenizer) -> str:
        """The rendered prompt: messages and tools through the template, with the body's
        add_generation_prompt, continue_final_message and chat_template_kwargs."""
        extra = body.get("chat_template_kwargs")
        if extra is not None and not isinstance(extra, dict):
            raise BadRequest("chat_template_kwargs must be an object")
        cont = opt_bool(body, "continue_final_message")
        add_gen = opt_bool(body, "add_generation_prompt", default=not cont)
        text = tok.apply_chat_template(self.messages, add_gen and not cont, self.tools.tools, extra)
        if cont:  # end the prompt right after the last message's content
            last = self.messages[-1]["content"]
            cut = text.rfind(last) if last else -1
            if cut >= 0:
                text = text[:cut + len(last)]
        return text

    def shape_for(self, sampling: SamplingParams) -> ChatShape:
        """The shape for the final sampling: an answer a grammar holds from its first token has no
        <think> part, so it is not split (deepseek_r1 would read it all as reasoning)."""
        return replace(self.shape, reasoning=None) if sampling.grammar is not None else self.shape

    def constrain(self, sampling: SamplingParams) -> SamplingParams:
        """`sampling` held to the forced tool_choice's schema (with another constraint: 400)."""
        if self.forced_schema is None:
            return sampling
        if sampling.grammar is not None:
            raise BadRequest(f"tool_choice {self.tools.choice.value!r} forces a tool call and cannot be "
                             f"combined with {sampling.grammar.describe()}")
        spec = json_schema_spec(self.forced_schema, "tool_choice")
        check_spec(spec)  # a tool whose parameters are not a usable schema: 400 here
        return sampling.replace(grammar=spec)


def parse_chat_request(body: dict, opts: ApiOptions) -> ChatRequest:
    messages = chat_messages(body)
    tools = parse_tools(body)
    if tools.tools and tools.choice is not ToolChoice.NONE and not opts.template_takes_tools:
        raise BadRequest("tools: this model's chat template does not take tools, so the model would "
                         "never see them")
    parser, schema = None, None
    if tools.choice is ToolChoice.AUTO:
        if opts.tool_parser is None:
            raise BadRequest("tool_choice 'auto' needs a tool-call parser: this model's chat template "
                             "has no known tool-call format; start the server with --tool-call-parser "
                             "hermes|llama3_json")
        parser = opts.tool_parser if tools.parallel else FirstCallOnly(opts.tool_parser)
        strict = [t["function"]["name"] for t in tools.tools or () if t["function"].get("strict")]
        if strict:
            raise unsupported(f"strict tools with tool_choice 'auto' ({strict})", " (the arguments of a "
                              "call the model chooses to make are not held to the schema; use tool_choice "
                              "'required' or a named function, which are)")
    elif tools.forced:
        parser, schema = forced_parser(tools), forced_schema(tools)
    reasoning = opts.reasoning if opt_bool(body, "separate_reasoning", True) else None  # SGLang's switch
    shape = ChatShape(reasoning, parser, tools.choice is not ToolChoice.NAMED,
                      opt_bool(body, "stream_reasoning", True))
    return ChatRequest(messages, tools if opts.template_takes_tools else ToolRequest(None), shape, schema)
