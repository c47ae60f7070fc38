"""Agent traffic: prompt tokens recomputed per novel prompt token, per API.

    python -m benchmarks.agent                          # tiny hybrid fixture (qwen3_5)
    python -m benchmarks.agent --kind qwen3 --json out.json
    python -m benchmarks.agent --model PATH --volatile-header

A Claude Code / Codex-like conversation: a ~1.5k-character system prompt,
20 tools with JSON-schema parameters, 10 requests. A random fixture model
never calls a tool, so the client scripts the agent's side: after each
reply it appends an assistant turn (a short text and one tool call) and the
tool's result (a few hundred tokens of listing, file content, grep or test
output, pseudo-random but deterministic), and a new user message after
every 3rd turn. Each prompt is the previous one + that scripted turn; the
model's own reply is not sent back (the workload does not depend on what
the model says). The same conversation goes, one request at a time, greedy,
each to a freshly started server, to:

  ours /v1/messages          Anthropic shape (system, tool_use/tool_result
                             blocks, tools with input_schema): reused =
                             usage.cache_read_input_tokens, prompt =
                             input_tokens + cache_read_input_tokens
  ours /v1/responses         OpenAI Responses shape as Codex sends it with
                             store=false (instructions, the full `input`
                             every turn: message / function_call /
                             function_call_output items): reused =
                             usage.input_tokens_details.cached_tokens, prompt
                             = usage.input_tokens (skipped, with a note, where
                             the server answers 404)
  ours /v1/chat/completions  reused = usage.prompt_tokens_details.cached_tokens
  upstream /v1/chat/completions  mlx_lm.server 0.32.2, which reports the same
                             field (its prompt_cache_count; 0 where absent)

Figures per request, as in benchmarks/cache_reuse.py: recomputed = prompt -
reused; novel = the prompt minus its longest common prefix with any earlier
request's prompt + generated tokens. The prompt token ids are rendered here
with the model's tokenizer and chat template from the chat-completions form
the server makes of the request (for /v1/messages and /v1/responses, by the
API module's own `to_chat_body`), and their count must equal the server's
prompt size (checked). Where an API's translation renders other tokens than
the chat-completions form of the same conversation, a note says so.
Generated ids: chat completions give them as logprobs; the Anthropic and
Responses answers carry none (and a random model's text does not tokenize
back to its ids), so there only earlier prompts count. As the scripted
assistant turn replaces the model's reply, generated tokens extend a common
prefix only where the model's first tokens happen to equal the scripted
turn's: both ways give the same novel counts here (compare the chat and
Responses rows, whose prompts are the same).

Per request, the table also shows where the previous conversation ends in
this prompt (prompt.py's last message boundary, `checkpoint_positions` of
the previous messages in this prompt) and, for ours, the last checkpoint
stored for the previous prompt (`checkpoint_positions` of the previous
messages in their own prompt, which never holds a boundary at its very end).

--volatile-header adds Claude Code's per-request first system text block
(`x-anthropic-billing-header: ...; cch=<5 hex>;`, new every request): the
prompts then differ a few tokens in, so no prefix cache can reuse anything
past them. Those runs are separate rows (" +volatile"), with one more for
/v1/messages on a server started with --strip-billing-header where ours has
that option.

Timings are secondary here (no A/B alternation): the median seconds of a
whole non-streaming request per API.
"""

import argparse
import copy
import json
import logging
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from benchmarks.harness import fixture_or_model
from compat.launch import OURS, UPSTREAM, ServerProcess
from mlx_lm_plus.planning.checkpoints import common_prefix

SYSTEM = """\
You are an interactive command-line coding agent. You help the user with \
software engineering tasks: fixing bugs, adding features, refactoring, \
explaining code and running tests, using the tools available to you.

# Tone and style
Be concise and direct. Answer in fewer than four lines unless the user asks \
for detail. Do not add preambles or summaries of what you just did. Use \
GitHub-flavored markdown; it is shown in a monospace terminal.

# Doing tasks
- Use the search tools (grep, glob, list_dir) to understand the codebase \
before you change it, and read a file before you edit it.
- Follow the conventions of the code around you: imports, naming, typing, \
error handling. Never assume a library is available: check the imports and \
the package manifest first.
- Plan multi-step work with todo_write and mark each item done as soon as it \
is done.
- After a change, run the project's tests and linters with bash; if they \
fail, fix the cause, not the test.
- Never commit, push or delete files unless the user asks you to.

# Tool use
- Call several independent tools in one turn when you can.
- Prefer edit_file over write_file for existing files; keep edits minimal.
- Quote paths with spaces in shell commands; prefer absolute paths.
- Never print secrets or credentials to the terminal.

Working directory: /home/dev/projects/orbit
Platform: linux. Today's date: 2025-06-01.
"""

# (name, description, {property: schema}, required)
_TOOL_SPECS = [
    ("read_file", "Read a file from the local filesystem, with line numbers.",
     {"file_path": {"type": "string", "description": "Absolute path of the file"},
      "offset": {"type": "integer", "description": "First line to read"},
      "limit": {"type": "integer", "description": "Number of lines to read"}},
     ["file_path"]),
    ("write_file", "Write a file to the local filesystem, replacing it if it exists.",
     {"file_path": {"type": "string"}, "content": {"type": "string"}},
     ["file_path", "content"]),
    ("edit_file", "Replace an exact string in a file with another.",
     {"file_path": {"type": "string"}, "old_string": {"type": "string"},
      "new_string": {"type": "string"},
      "replace_all": {"type": "boolean", "default": False}},
     ["file_path", "old_string", "new_string"]),
    ("multi_edit", "Several edits of one file, applied in order, all or none.",
     {"file_path": {"type": "string"},
      "edits": {"type": "array", "items": {
          "type": "object",
          "properties": {"old_string": {"type": "string"}, "new_string": {"type": "string"}},
          "required": ["old_string", "new_string"]}}},
     ["file_path", "edits"]),
    ("list_dir", "List the files and directories at a path.",
     {"path": {"type": "string"},
      "ignore": {"type": "array", "items": {"type": "string"}}},
     ["path"]),
    ("glob", "Find files whose paths match a glob pattern, newest first.",
     {"pattern": {"type": "string"}, "path": {"type": "string"}},
     ["pattern"]),
    ("grep", "Search file contents with a regular expression (ripgrep).",
     {"pattern": {"type": "string"}, "path": {"type": "string"},
      "glob": {"type": "string"},
      "output_mode": {"type": "string", "enum": ["content", "files_with_matches", "count"]},
      "-i": {"type": "boolean"}},
     ["pattern"]),
    ("bash", "Run a shell command in a persistent session, with a timeout.",
     {"command": {"type": "string"},
      "timeout": {"type": "integer", "description": "Milliseconds, at most 600000"},
      "description": {"type": "string"},
      "run_in_background": {"type": "boolean"}},
     ["command"]),
    ("bash_output", "Read the new output of a background shell.",
     {"bash_id": {"type": "string"}, "filter": {"type": "string"}},
     ["bash_id"]),
    ("kill_shell", "Stop a background shell by its id.",
     {"shell_id": {"type": "string"}}, ["shell_id"]),
    ("web_fetch", "Fetch a URL and answer a question about its content.",
     {"url": {"type": "string", "format": "uri"}, "prompt": {"type": "string"}},
     ["url", "prompt"]),
    ("web_search", "Search the web; returns titles, links and snippets.",
     {"query": {"type": "string", "minLength": 2},
      "allowed_domains": {"type": "array", "items": {"type": "string"}}},
     ["query"]),
    ("todo_write", "Create or update the structured task list of this session.",
     {"todos": {"type": "array", "items": {
         "type": "object",
         "properties": {"content": {"type": "string"},
                        "status": {"type": "string",
                                   "enum": ["pending", "in_progress", "completed"]},
                        "id": {"type": "string"}},
         "required": ["content", "status", "id"]}}},
     ["todos"]),
    ("task", "Start a sub-agent for a complex, multi-step search or task.",
     {"description": {"type": "string"}, "prompt": {"type": "string"},
      "subagent_type": {"type": "string"}},
     ["description", "prompt"]),
    ("notebook_edit", "Replace, insert or delete a cell of a Jupyter notebook.",
     {"notebook_path": {"type": "string"}, "cell_id": {"type": "string"},
      "new_source": {"type": "string"},
      "edit_mode": {"type": "string", "enum": ["replace", "insert", "delete"]}},
     ["notebook_path", "new_source"]),
    ("ask_user", "Ask the user a question and wait for the answer.",
     {"question": {"type": "string"},
      "options": {"type": "array", "items": {"type": "string"}}},
     ["question"]),
    ("exit_plan_mode", "Present the plan to the user and leave plan mode.",
     {"plan": {"type": "string"}}, ["plan"]),
    ("git_diff", "Show the working tree's changes against a revision.",
     {"revision": {"type": "string", "default": "HEAD"},
      "paths": {"type": "array", "items": {"type": "string"}}},
     []),
    ("run_tests", "Run the project's test suite or a subset of it.",
     {"selector": {"type": "string"}, "verbose": {"type": "boolean"},
      "timeout": {"type": "integer"}},
     []),
    ("lsp_diagnostics", "Type errors and lint warnings of a file from the language server.",
     {"file_path": {"type": "string"},
      "severity": {"type": "string", "enum": ["error", "warning", "info"]}},
     ["file_path"]),
]
TOOL_NAMES = [spec[0] for spec in _TOOL_SPECS]


def agent_tools(n: int = 20) -> List[dict]:
    """The first `n` tools, chat-completions form."""
    tools = []
    for name, description, properties, required in _TOOL_SPECS[:n]:
        tools.append({"type": "function", "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": properties, "required": required,
                           "additionalProperties": False},
        }})
    return tools


# -- deterministic pseudo-random tool output --

_WORDS = ("config cache store entry request token prompt model batch stream server client "
          "handler parse render split merge fetch insert evict budget limit timeout retry "
          "path file line index offset count size state queue worker thread event result "
          "error value key node tree edge depth list map set item user message tool call").split()
_DIRS = ("src", "src/orbit", "src/orbit/net", "tests", "docs", "scripts")
_EXTS = (".py", ".py", ".py", ".md", ".toml", ".json")


def _ident(rng):
    return "_".join(rng.choice(_WORDS) for _ in range(rng.randint(1, 3)))


def _path(rng):
    return f"{rng.choice(_DIRS)}/{_ident(rng)}{rng.choice(_EXTS)}"


def _code_lines(rng, n, start=1):
    lines, indent = [], 0
    for i in range(start, start + n):
        kind = rng.random()
        if kind < 0.15:
            text, indent = f"def {_ident(rng)}({_ident(rng)}, {_ident(rng)}=None):", 1
        elif kind < 0.3:
            text = "    " * indent + f"if {_ident(rng)} is None:"
        elif kind < 0.7:
            text = ("    " * indent + f"{_ident(rng)} = {_ident(rng)}.{_ident(rng)}"
                    f"({_ident(rng)}, {rng.randint(0, 4096)})")
        else:
            text = "    " * indent + f"return {_ident(rng)}[{rng.randint(0, 64)}]"
        lines.append(f"{i:>6}\t{text}")
    return lines


def _clip(lines, chars):
    out, size = [], 0
    for line in lines:
        if size + len(line) + 1 > chars and out:
            break
        out.append(line)
        size += len(line) + 1
    return "\n".join(out)


def _result(rng, name, args, chars):
    """A tool's output of about `chars` characters."""
    if name == "list_dir":
        lines = [f"- {args['path']}/"]
        for _ in range(200):
            lines.append(f"  - {_ident(rng)}{rng.choice(_EXTS)}  ({rng.randint(120, 48000)} bytes)")
        return _clip(lines, chars)
    if name == "read_file":
        return _clip(_code_lines(rng, 200, start=args.get("offset", 1)), chars)
    if name == "grep":
        lines = [f"{_path(rng)}:{rng.randint(1, 900)}:    {_ident(rng)} = "
                 f"{_ident(rng)}({_ident(rng)})" for _ in range(200)]
        return _clip(lines, chars)
    if name == "edit_file":
        head = (f"The file {args['file_path']} has been updated. Here's the result of "
                "running `cat -n` on a snippet of the edited file:")
        return _clip([head] + _code_lines(rng, 200, start=rng.randint(10, 400)), chars)
    if name in ("bash", "run_tests"):
        lines = ["============================= test session starts =============================="]
        for _ in range(200):
            status = "PASSED" if rng.random() < 0.85 else "FAILED"
            lines.append(f"tests/test_{_ident(rng)}.py::test_{_ident(rng)} {status}")
        return _clip(lines, chars)
    lines = [f"{_path(rng)}: {_ident(rng)} {_ident(rng)} {rng.randint(0, 999)}" for _ in range(200)]
    return _clip(lines, chars)


# The agent's side of each turn: (what it says, the tool it calls, its arguments).
_ROOT = "/home/dev/projects/orbit"
_ACTIONS = [
    ("I'll start by looking at the project layout.", "list_dir", {"path": "src/orbit"}),
    ("Let me read the cache module.", "read_file",
     {"file_path": f"{_ROOT}/src/orbit/cache.py"}),
    ("Searching for where entries are evicted.", "grep",
     {"pattern": "def evict\\w*", "path": "src", "output_mode": "content"}),
    ("Reading the store around the eviction code.", "read_file",
     {"file_path": f"{_ROOT}/src/orbit/store.py", "offset": 120, "limit": 80}),
    ("Fixing the off-by-one in the budget check.", "edit_file",
     {"file_path": f"{_ROOT}/src/orbit/store.py", "old_string": "if size > budget:",
      "new_string": "if size >= budget:"}),
    ("Running the tests.", "bash",
     {"command": "python -m pytest -q tests/test_store.py", "description": "Run the store tests"}),
    ("Looking for other callers of the budget.", "grep",
     {"pattern": "budget", "path": "src/orbit", "glob": "*.py"}),
    ("Reading the server's request handler.", "read_file",
     {"file_path": f"{_ROOT}/src/orbit/server.py"}),
    ("Updating the handler to pass the budget through.", "edit_file",
     {"file_path": f"{_ROOT}/src/orbit/server.py", "old_string": "store = Store()",
      "new_string": "store = Store(budget=args.budget)"}),
    ("Running the whole suite.", "run_tests", {"verbose": False}),
]
_USERS = [
    "The prompt cache in src/orbit evicts entries too early when the budget is nearly "
    "full. Find the cause and fix it, then run the tests.",
    "Good. Also check whether the server passes the configured budget to the store.",
    "Thanks. Make sure nothing else reads the old default, and run everything once more.",
    "One more thing: add a short note about the budget to the changelog.",
]
BILLING_PREFIX = "x-anthropic-billing-header:"


def volatile_header(request: int, seed: int = 0) -> str:
    """Claude Code's per-request first system line (a new cch every request)."""
    cch = f"{random.Random(f'cch-{seed}-{request}').getrandbits(20):05x}"
    return f"{BILLING_PREFIX} cc_version=2.1.0.abc; cc_entrypoint=cli; cch={cch};"


def agent_workload(turns: int = 10, n_tools: int = 20, result_chars: int = 1200,
                   user_every: int = 3, volatile: bool = False,
                   seed: int = 0) -> List[Tuple[List[dict], List[dict]]]:
    """The requests of one agent conversation, chat-completions form:
    [(messages, tools)] per turn. Request t+1's messages are request t's +
    the scripted assistant turn (text + one tool call) + the tool's result
    (+ a user message after every `user_every`-th turn). With `volatile`,
    the system message starts with a per-request billing header line."""
    tools = agent_tools(n_tools)
    names = {t["function"]["name"] for t in tools}
    history = [{"role": "user", "content": _USERS[0]}]
    requests = []
    for t in range(turns):
        system = SYSTEM
        if volatile:
            system = volatile_header(t, seed) + "\n\n" + SYSTEM  # as Anthropic joins blocks
        requests.append(([{"role": "system", "content": system}, *copy.deepcopy(history)],
                         copy.deepcopy(tools)))
        text, name, args = _ACTIONS[t % len(_ACTIONS)]
        if name not in names:  # fewer tools: the first one that takes a path
            name, args = "read_file", {"file_path": f"{_ROOT}/{_path(random.Random(t))}"}
        call_id = f"toolu_{seed:02d}{t:04d}{random.Random(f'id-{seed}-{t}').getrandbits(48):012x}"
        history.append({"role": "assistant", "content": text, "tool_calls": [{
            "id": call_id, "type": "function",
            "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}]})
        rng = random.Random(f"result-{seed}-{t}")
        history.append({"role": "tool", "tool_call_id": call_id,
                        "content": _result(rng, name, args, result_chars)})
        if (t + 1) % user_every == 0:
            user = _USERS[((t + 1) // user_every) % len(_USERS)]
            history.append({"role": "user", "content": user})
    return requests


# -- the same requests in the other APIs' shapes --

def _system_blocks(system: str):
    """Anthropic's system: a volatile header line becomes its own first block."""
    if system.startswith(BILLING_PREFIX):
        header, rest = system.split("\n\n", 1)
        return [{"type": "text", "text": header}, {"type": "text", "text": rest}]
    return system


def to_anthropic(messages: List[dict], tools: List[dict]) -> Dict[str, Any]:
    """system, messages (tool_use / tool_result blocks) and tools (input_schema);
    a tool result and the user text after it share one user turn."""
    body: Dict[str, Any] = {}
    turns: List[dict] = []

    def user_blocks():
        if turns and turns[-1]["role"] == "user":
            return turns[-1]["content"]
        turns.append({"role": "user", "content": []})
        return turns[-1]["content"]

    for m in messages:
        if m["role"] == "system":
            body["system"] = _system_blocks(m["content"])
        elif m["role"] == "user":
            user_blocks().append({"type": "text", "text": m["content"]})
        elif m["role"] == "tool":
            user_blocks().append({"type": "tool_result", "tool_use_id": m["tool_call_id"],
                                  "content": m["content"]})
        elif m["role"] == "assistant":
            blocks = [{"type": "text", "text": m["content"]}] if m.get("content") else []
            for call in m.get("tool_calls") or ():
                blocks.append({"type": "tool_use", "id": call["id"],
                               "name": call["function"]["name"],
                               "input": json.loads(call["function"]["arguments"])})
            turns.append({"role": "assistant", "content": blocks})
    body["messages"] = turns
    body["tools"] = [{"name": t["function"]["name"],
                      "description": t["function"]["description"],
                      "input_schema": t["function"]["parameters"]} for t in tools]
    return body


def to_responses(messages: List[dict], tools: List[dict]) -> Dict[str, Any]:
    """instructions + the whole conversation as `input` items, as Codex sends
    it with store=false."""
    body: Dict[str, Any] = {}
    items = []
    for m in messages:
        if m["role"] == "system":
            body["instructions"] = m["content"]
        elif m["role"] == "user":
            items.append({"type": "message", "role": "user",
                          "content": [{"type": "input_text", "text": m["content"]}]})
        elif m["role"] == "tool":
            items.append({"type": "function_call_output", "call_id": m["tool_call_id"],
                          "output": m["content"]})
        elif m["role"] == "assistant":
            if m.get("content"):
                items.append({"type": "message", "role": "assistant",
                              "content": [{"type": "output_text", "text": m["content"]}]})
            for call in m.get("tool_calls") or ():
                items.append({"type": "function_call", "call_id": call["id"],
                              "name": call["function"]["name"],
                              "arguments": call["function"]["arguments"]})
    body["input"] = items
    body["tools"] = [{"type": "function", "name": t["function"]["name"],
                      "description": t["function"]["description"], "strict": False,
                      "parameters": t["function"]["parameters"]} for t in tools]
    return body


# -- what the server renders --

def server_messages(messages: List[dict]) -> List[dict]:
    """The messages as the server hands them to the template (tool call
    arguments parsed into objects, as mlx_lm.server does)."""
    from mlx_lm.server import process_message_content

    out = copy.deepcopy(messages)
    process_message_content(out)
    return out


def strips_billing_header() -> bool:
    """Whether this server has --strip-billing-header (for /v1/messages)."""
    import inspect

    from mlx_lm_plus.protocols.anthropic import to_chat_body

    return "strip_billing_header" in inspect.signature(to_chat_body).parameters


def keeps_billing_header() -> bool:
    """Whether this server strips the billing header by default (and has
    --keep-billing-header not to)."""
    from mlx_lm_plus.config.flags import OUR_FLAGS

    return "--keep-billing-header" in OUR_FLAGS


def api_form(api: str, messages: List[dict], tools: List[dict], strip: bool = False):
    """(messages, tools) as the server gets them from this API's body: the
    API module's own translation (`to_chat_body` of mlx_lm_plus.protocols.anthropic
    and mlx_lm_plus.protocols.responses), else the chat form itself. `strip`: as
    with --strip-billing-header."""
    if api == "messages":
        from mlx_lm_plus.protocols.anthropic import to_chat_body

        body = {"model": "m", "max_tokens": 1, **to_anthropic(messages, tools)}
        disabled = logging.root.manager.disable
        logging.disable(logging.WARNING)  # its warning of a billing header is the server's
        try:
            chat = to_chat_body(body, strip_billing_header=True) if strip else to_chat_body(body)
        finally:
            logging.disable(disabled)
    elif api == "responses":
        try:
            from mlx_lm_plus.protocols.response_store import ResponseStore
            from mlx_lm_plus.protocols.responses_input import to_chat_body

            chat, _ = to_chat_body({"model": "m", "store": False,
                                    **to_responses(messages, tools)}, ResponseStore())
        except (ImportError, TypeError, ValueError):
            return messages, tools  # no such module (yet), or another signature
    else:
        return messages, tools
    return chat["messages"], chat.get("tools")


def render(tokenizer, messages, tools) -> List[int]:
    return list(tokenizer.apply_chat_template(server_messages(messages), tools=tools,
                                              add_generation_prompt=True))


def last_checkpoint(tokenizer, messages, tools, tokens) -> int:
    """The largest message-boundary checkpoint prompt.py finds in `tokens`
    for this conversation (any kind; 0 if none). With the conversation's own
    prompt: the last checkpoint the server stores for it. With the next
    turn's prompt: the end of this conversation as the next turn renders it
    (prompt.py's last boundary, which it drops from the conversation's own
    prompt where it falls at the very end)."""
    from mlx_lm_plus.planning.checkpoints import checkpoint_positions

    kwargs = dict(tools=tools, tokenize=True)
    found = checkpoint_positions(tokenizer, server_messages(messages), tokens, kwargs)
    return max((p for p, kind in found), default=0)


# -- the clients --

APIS = {
    "messages": "/v1/messages",
    "responses": "/v1/responses",
    "chat": "/v1/chat/completions",
}


class NotServed(Exception):
    """The server has no such endpoint (404)."""


def _send(server, api: str, messages, tools, max_tokens: int):
    """(prompt tokens, reused tokens, generated ids or None, seconds)."""
    if api == "messages":
        body = {"model": "claude-sonnet-4-5", "max_tokens": max_tokens, "temperature": 0,
                **to_anthropic(messages, tools)}
    elif api == "responses":
        body = {"model": "gpt-5-codex", "max_output_tokens": max_tokens, "temperature": 0,
                "store": False, "stream": False, "tool_choice": "auto",
                "parallel_tool_calls": False, **to_responses(messages, tools)}
    else:
        body = {"messages": messages, "tools": tools, "max_tokens": max_tokens,
                "temperature": 0, "logprobs": True}
    start = time.perf_counter()
    status, r = server.post(APIS[api], body)
    seconds = time.perf_counter() - start
    if status == 404 and api != "chat":
        raise NotServed(f"{APIS[api]}: 404 {str(r)[:200]}")
    if status != 200:
        raise RuntimeError(f"{APIS[api]}: {status} {str(r)[:500]}")
    usage = r["usage"]
    if api == "messages":
        reused = usage["cache_read_input_tokens"]
        return usage["input_tokens"] + reused, reused, None, seconds
    if api == "responses":
        reused = (usage.get("input_tokens_details") or {}).get("cached_tokens", 0)
        return usage["input_tokens"], reused, None, seconds
    reused = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    ids = [c["id"] for c in r["choices"][0]["logprobs"]["content"]]
    return usage["prompt_tokens"], reused, ids, seconds


def run_api(server, api: str, tokenizer, requests, max_tokens: int,
            strip: bool = False) -> List[Dict[str, Any]]:
    """Send the requests in order; a row per request. `strip`: the server
    runs with --strip-billing-header."""
    seen: List[List[int]] = []  # earlier prompts (+ generated ids where known)
    rows, previous = [], None
    for messages, tools in requests:
        form = api_form(api, messages, tools, strip)
        tokens = render(tokenizer, *form)
        prompt, reused, generated, seconds = _send(server, api, messages, tools, max_tokens)
        assert prompt == len(tokens), (
            f"{APIS[api]}: the server's prompt has {prompt} tokens, its chat form "
            f"renders {len(tokens)}")
        reusable = max((common_prefix(tokens, s) for s in seen), default=0)
        row = {"prompt": prompt, "reused": reused, "recomputed": prompt - reused,
               "novel": prompt - reusable, "seconds": round(seconds, 4)}
        if api != "chat" and not strip:
            # The API's translation; does it render as the chat form does?
            direct = render(tokenizer, messages, tools)
            if direct != tokens:
                row["chat_form_differs"] = {"chat_form_tokens": len(direct),
                                            "first_difference": common_prefix(direct, tokens)}
        if previous is not None:
            # Where the previous prompt's cache could be resumed: its last
            # message-boundary checkpoint and its common prefix with this one.
            row["previous_prompt"] = len(previous[2])
            row["previous_checkpoint"] = last_checkpoint(tokenizer, *previous)
            row["previous_end"] = last_checkpoint(tokenizer, *previous[:2], tokens)
        rows.append(row)
        seen.append(tokens + (generated or []))
        previous = (*form, tokens)
    return rows


def summary(rows: List[Dict[str, Any]]) -> Dict[str, Any]:
    novel = sum(r["novel"] for r in rows)
    recomputed = sum(r["recomputed"] for r in rows)
    return {
        "requests": len(rows),
        "prompt": sum(r["prompt"] for r in rows),
        "novel": novel,
        "recomputed": recomputed,
        "ratio": round(recomputed / max(novel, 1), 3),
        "median_s": round(statistics.median(r["seconds"] for r in rows), 4),
        "reused": [r["reused"] for r in rows],
        "rows": rows,
    }


def measure(model: str, tokenizer=None, apis: Sequence[str] = ("messages", "responses", "chat"),
            upstream: bool = True, turns: int = 10, n_tools: int = 20,
            result_chars: int = 1200, max_tokens: int = 8, volatile: Sequence[bool] = (False,),
            log_dir: Optional[Path] = None) -> Dict[str, Any]:
    """Run the agent conversation on each API (a fresh server each).
    Returns {"results": {label: summary}, "skipped": {label: why}}."""
    if tokenizer is None:
        from mlx_lm.utils import load_tokenizer

        tokenizer = load_tokenizer(Path(model))
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="bench-agent-"))
    results, skipped = {}, {}
    for vol in volatile:
        requests = agent_workload(turns, n_tools, result_chars, volatile=vol)
        # (label, command, API, strip the billing header)
        runs = [(f"ours {APIS[a]}", OURS, a, False) for a in apis]
        if vol and "messages" in apis and strips_billing_header():
            runs.insert(1, ("ours /v1/messages --strip-billing-header", OURS, "messages", True))
        if upstream:
            runs.append(("upstream /v1/chat/completions", UPSTREAM, "chat", False))
        for label, command, api, strip in runs:
            label += " +volatile" if vol else ""
            log = log_dir / (label.replace(" ", "_").replace("/", "_") + ".log")
            args = ["--model", model] + (["--strip-billing-header"] if strip else [])
            if api == "messages" and not strip and command is OURS and keeps_billing_header():
                args.append("--keep-billing-header")  # (the default strips it)
            with ServerProcess(command, args, log=log) as server:
                try:
                    results[label] = summary(run_api(server, api, tokenizer, requests,
                                                     max_tokens, strip))
                except NotServed as e:
                    skipped[label] = str(e)
    return {"results": results, "skipped": skipped}


def print_table(out: Dict[str, Any]) -> None:
    results = out["results"]
    width = max([len(k) for k in results] + [40])
    print(f"{'API':<{width}} {'requests':>8} {'prompt':>8} {'novel':>7} {'recomputed':>10} "
          f"{'recomp/novel':>12} {'median s':>9}")
    for label, s in results.items():
        print(f"{label:<{width}} {s['requests']:>8} {s['prompt']:>8} {s['novel']:>7} "
              f"{s['recomputed']:>10} {s['ratio']:>12.3f} {s['median_s']:>9.3f}")
    for label, why in out["skipped"].items():
        print(f"{label:<{width}} skipped: {why}")
    if results:
        print("\nper request (tokens): the prompt; the reused (cached) part; the end of the "
              "previous\nconversation in this prompt; the last checkpoint ours stores for the "
              "previous prompt")

        def line(name, values):
            print(f"  {name:<16}" + " ".join(f"{v:>6}" for v in values))

        for label, s in results.items():
            print(label)
            line("prompt", [r["prompt"] for r in s["rows"]])
            line("reused", s["reused"])
            line("previous end", [r.get("previous_end", 0) for r in s["rows"]])
            if label.startswith("ours"):
                line("last checkpoint", [r.get("previous_checkpoint", 0) for r in s["rows"]])
        for label, s in results.items():
            differs = [i for i, r in enumerate(s["rows"]) if "chat_form_differs" in r]
            if differs:
                r = s["rows"][differs[0]]["chat_form_differs"]
                print(f"note: {label}: the API's own translation renders other tokens than "
                      f"the chat-completions form (request {differs[0]}: "
                      f"{s['rows'][differs[0]]['prompt']} vs {r['chat_form_tokens']} tokens, "
                      f"first difference at token {r['first_difference']}); its figures use "
                      "its own rendering")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kind", default="qwen3_5", help="fixture kind to build (testkit/fixtures.py)")
    p.add_argument("--model", help="use this model folder instead of a fixture")
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--tools", type=int, default=20, help="how many tools (at most 20)")
    p.add_argument("--result-chars", type=int, default=1200,
                   help="about how long each tool result is, in characters")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--api", action="append", choices=list(APIS),
                   help="ours on this API (default: all three)")
    p.add_argument("--no-upstream", action="store_true", help="skip upstream mlx_lm.server")
    p.add_argument("--volatile-header", action="store_true",
                   help="also run with a per-request billing header as the first system block")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="bench-agent-"))
    model = fixture_or_model(args, work / "fixtures", kind=args.kind)
    out = measure(model, apis=args.api or list(APIS), upstream=not args.no_upstream,
                  turns=args.turns, n_tools=args.tools, result_chars=args.result_chars,
                  max_tokens=args.max_tokens,
                  volatile=(False, True) if args.volatile_header else (False,),
                  log_dir=work)
    print(f"model: {args.model or 'fixture ' + args.kind}   {args.turns} turns, {args.tools} "
          f"tools, max_tokens {args.max_tokens}   (recomputed / novel prompt tokens; ideal 1.0)")
    print_table(out)
    print(f"\nserver logs: {work}")
    if args.json:
        report = {"model": model, "kind": None if args.model else args.kind,
                  "turns": args.turns, "tools": args.tools, "max_tokens": args.max_tokens,
                  **out}
        Path(args.json).write_text(json.dumps(report, indent=1))
        print(f"figures written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
