"""Tools, tool_choice and reasoning effort in chat-completions terms: what
the agent protocols (anthropic.py, responses.py) translate theirs into.

Each protocol still validates its own fields with its own messages (their
shapes differ: Anthropic's `input_schema` is required and `tool_choice`
says any/tool, Responses' `parameters` are optional and `tool_choice` says
required/function/allowed_tools); what they make of them is built here, so
the same tool renders the same tokens whichever API sent it.
"""

from typing import Any, List, Optional

from mlx_lm_plus.protocols.validation import one_of

# The template's thinking switch for each protocol's effort levels (both
# also pass the level on as reasoning_effort, for its budget: reasoning.py).
# Anthropic's output_config.effort: the lowest effort skips thinking, the
# others think.
MESSAGES_THINKING_BY_EFFORT = {"low": False, "medium": True, "high": True, "max": True}
# Responses' reasoning.effort: none and minimal skip thinking.
RESPONSES_THINKING_BY_EFFORT = {
    "none": False, "minimal": False,
    "low": True, "medium": True, "high": True, "xhigh": True, "max": True,
}


def chat_tool(name: str, description: Optional[str] = None,
              parameters: Optional[dict] = None, strict: bool = False) -> dict:
    """A function tool as chat completions has it, its keys in chat
    completions' order: templates dump tools as they are, and another order
    is other tokens, and another cache path."""
    function = {"name": name}
    if description is not None:
        function["description"] = description
    if parameters is not None:
        function["parameters"] = parameters
    if strict:  # structured outputs: held to the schema
        function["strict"] = True
    return {"type": "function", "function": function}


def tool_names(tools: Optional[List[dict]]) -> List[str]:
    """The function names of chat tools (chat_tool's)."""
    return [t["function"]["name"] for t in tools or ()]


def has_tool(tools: Optional[List[dict]], name: str) -> bool:
    return name in tool_names(tools)


def named_tool(name: str) -> dict:
    """The chat tool_choice that forces a call to the function `name`."""
    return {"type": "function", "function": {"name": name}}


def forced_tool(request) -> Optional[str]:
    """The function a validated request's tool_choice names, if it names one."""
    choice = request.tool_choice
    return choice["function"]["name"] if isinstance(choice, dict) else None


def thinking_switch(effort: Any, levels: dict, where: str) -> Optional[bool]:
    """The template's thinking switch for an effort level (None: no level
    given, the template's default); a level not in `levels` is a 400
    naming `where`."""
    return None if effort is None else one_of(effort, levels, where)
