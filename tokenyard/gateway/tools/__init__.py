"""Tool calling for the chat APIs: a request's tools, tool_choice and tool history
(request.py), and the parsers that read a model's tool calls, whole or streamed (parsers.py).
Pure: no I/O."""

from tokenyard.gateway.tools.parsers import (
    PARSER_NAMES,
    CallDelta,
    CallStream,
    ContentDelta,
    Delta,
    NamedCallStream,
    Parsed,
    ToolCall,
    ToolCallStream,
    ToolParserError,
    choose_parser,
    new_call_id,
    parse_whole,
    stable_call_ids,
    tool_call_stream,
)
from tokenyard.gateway.tools.request import (
    Function,
    History,
    Tools,
    call_reader,
    call_reading,
    job_reader,
    parse_arguments,
    read_function,
    read_tools,
)

__all__ = [
    "PARSER_NAMES",
    "CallDelta",
    "CallStream",
    "ContentDelta",
    "Delta",
    "Function",
    "History",
    "NamedCallStream",
    "Parsed",
    "ToolCall",
    "ToolCallStream",
    "ToolParserError",
    "Tools",
    "call_reader",
    "call_reading",
    "choose_parser",
    "job_reader",
    "new_call_id",
    "parse_arguments",
    "parse_whole",
    "read_function",
    "read_tools",
    "stable_call_ids",
    "tool_call_stream",
]
