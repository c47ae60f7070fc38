"""The requests of the compatibility suite.

Each case is one HTTP exchange. Cases run in order, one at a time, against a
fresh server. Cases that kill upstream's generation thread (`fatal_upstream`)
run last. Their differences are documented in EXCEPTIONS.
"""

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

SYSTEM = "You are a helpful assistant. Answer briefly and clearly."
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the weather for a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


@dataclass
class Case:
    name: str
    path: str = "/v1/chat/completions"
    method: str = "POST"
    body: Any = None
    raw: Optional[bytes] = None
    headers: Dict[str, str] = field(default_factory=dict)
    # Requests sent (unrecorded) just before this one.
    setup: List[Any] = field(default_factory=list)
    # Upstream's generation thread dies on this case (on some models): run it
    # last.
    fatal_upstream: bool = False


def _chat(text="Tell me about the river and the boat.", **kw):
    return {
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": text},
        ],
        "max_tokens": 12,
        **kw,
    }


MULTI_TURN = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "Plan a picnic by the sea."},
    {"role": "assistant", "content": "Bring bread, fruit and water."},
    {"role": "user", "content": "And what about the weather?"},
]


def cases():
    c = [
        Case("health", "/health", "GET"),
        Case("models", "/v1/models", "GET"),
        Case("models_filtered", "/v1/models/some/repo", "GET"),
        Case("get_unknown", "/nope", "GET"),
        Case("post_unknown", "/v1/nope", body={"x": 1}),
        Case("options", "/v1/chat/completions", "OPTIONS"),
        Case("cors_origin", "/health", "GET", headers={"Origin": "http://example.com"}),
        Case("chat_basic", body=_chat()),
        Case("chat_alias_path", "/chat/completions", body=_chat()),
        Case("chat_multi_turn", body={"messages": MULTI_TURN, "max_tokens": 12}),
        Case("chat_text_parts", body={"messages": [{"role": "user", "content": [
            {"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]}],
            "max_tokens": 8}),
        Case("chat_null_content", body={"messages": [
            {"role": "user", "content": "Hi"}, {"role": "assistant", "content": None},
            {"role": "user", "content": "Again"}], "max_tokens": 8}),
        Case("chat_max_tokens_1", body=_chat(max_tokens=1)),
        Case("chat_max_completion_tokens", body=_chat(max_completion_tokens=3)),
        Case("chat_stream", body=_chat(stream=True)),
        Case("chat_stream_usage", body=_chat(stream=True, stream_options={"include_usage": True})),
        Case("chat_stream_no_usage", body=_chat(stream=True, stream_options={"include_usage": False})),
        Case("chat_logprobs", body=_chat(logprobs=True, max_tokens=4)),
        Case("chat_top_logprobs", body=_chat(logprobs=True, top_logprobs=3, max_tokens=4)),
        Case("chat_stream_logprobs", body=_chat(stream=True, logprobs=True, max_tokens=4)),
        Case("chat_stop_words", body=_chat(stop=["e", "a"], max_tokens=24)),
        Case("chat_stop_string", body=_chat(stop="o", max_tokens=24)),
        Case("chat_tools", body=_chat(tools=TOOLS)),
        Case("chat_tool_history", body={"messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 20C"},
        ], "tools": TOOLS, "max_tokens": 8}),
        Case("chat_no_thinking", body=_chat("Thinking off: name a city.",
                                            chat_template_kwargs={"enable_thinking": False})),
        Case("chat_role_mapping", body=_chat(role_mapping={"user": "U: "})),
        Case("chat_penalties", body=_chat(repetition_penalty=1.3, presence_penalty=0.5,
                                          frequency_penalty=0.5, max_tokens=16)),
        Case("chat_logit_bias", body=_chat(logit_bias={"100": 5.0, "101": -100})),
        Case("chat_sampling_seed", body=_chat(temperature=0.8, top_p=0.9, top_k=40, seed=11)),
        Case("chat_min_p_xtc_seed", body=_chat(temperature=0.7, min_p=0.05,
                                               xtc_probability=0.5, xtc_threshold=0.1, seed=3)),
        Case("chat_explicit_default_model", body=_chat(model="default_model")),
        Case("text_basic", "/v1/completions", body={"prompt": "Once upon a time", "max_tokens": 8}),
        Case("text_stream", "/v1/completions",
             body={"prompt": "Once upon a time", "max_tokens": 8, "stream": True}),
        Case("text_stop", "/v1/completions",
             body={"prompt": "The cat and the dog", "max_tokens": 24, "stop": ["e"]}),
        Case("text_logprobs", "/v1/completions",
             body={"prompt": "The sea", "max_tokens": 4, "logprobs": True}),
        # Validation errors: upstream's messages.
        Case("err_temperature", body=_chat(temperature=-1)),
        Case("err_top_p", body=_chat(top_p=1.5)),
        Case("err_top_k", body=_chat(top_k=-1)),
        Case("err_min_p", body=_chat(min_p=2)),
        Case("err_max_tokens_zero", body=_chat(max_tokens=0)),
        Case("err_max_tokens_type", body=_chat(max_tokens="ten")),
        Case("err_stream_type", body=_chat(stream="yes")),
        Case("err_logprobs_type", body=_chat(logprobs="yes")),
        Case("err_top_logprobs", body=_chat(top_logprobs=12)),
        Case("err_xtc_int", body=_chat(xtc_probability=1)),
        Case("err_rep_penalty", body=_chat(repetition_penalty=-1)),
        Case("err_ctx_size", body=_chat(repetition_context_size=-1)),
        Case("err_presence_type", body=_chat(presence_penalty="a")),
        Case("err_num_draft", body=_chat(num_draft_tokens=-1)),
        Case("err_model_type", body=_chat(model=5)),
        Case("err_adapter_type", body=_chat(adapters=5)),
        Case("err_seed_type", body=_chat(seed="a")),
        Case("err_logit_bias_type", body=_chat(logit_bias=[1])),
        Case("err_logit_bias_keys", body=_chat(logit_bias={"a": 1})),
        Case("err_no_messages", body={"prompt": "x"}),
        Case("err_no_prompt", "/v1/completions", body={"messages": []}),
        Case("err_invalid_json", raw=b"{not json"),
        Case("err_json_list", raw=b"[1, 2]"),
        # Inputs that kill upstream's generation thread (see EXCEPTIONS).
        Case("stream_options_empty", body=_chat(stream=True, stream_options={})),
        Case("image_to_text_model", body={"messages": [{"role": "user", "content": [
            {"type": "text", "text": "What is this?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}]}),
        Case("fatal_top_k_over_vocab", body=_chat(temperature=0.7, top_k=10**6),
             fatal_upstream=True),
        Case("fatal_thinking_toggle", body=_chat("Toggle: what is a lake?"),
             setup=[_chat("Toggle: what is a lake?",
                          chat_template_kwargs={"enable_thinking": False})],
             fatal_upstream=True),
        Case("fatal_stop_ints", body=_chat(stop=[1, 2]), fatal_upstream=True),
        Case("fatal_empty_prompt", "/v1/completions", body={"prompt": ""}, fatal_upstream=True),
    ]
    return [x for x in c if not x.fatal_upstream] + [x for x in c if x.fatal_upstream]


# Differences we make on purpose: case name -> why. Every other difference in
# structure or greedy text is a compatibility bug.
EXCEPTIONS = {
    "models": "ours: each entry also says whether the model is loaded and pinned, and "
    "owned_by (OpenAI clients ignore extra fields; a frontend's dropdown can show it)",
    "models_filtered": "as for models",
    "fatal_thinking_toggle": "upstream, on hybrid models (non-trimmable caches): a "
    "request with enable_thinking false stores a checkpoint equal to the whole prompt "
    "of the same request with thinking on; that request then hits it exactly and "
    "upstream passes an empty prompt to insert_segments: the generation thread dies. "
    "Ours recomputes the last token and answers",
    "chat_top_logprobs": "upstream: each entry is top_logprobs[0], an arbitrary member "
    "of the top-k in argpartition order; ours: the sampled token's entry, and the "
    "top-k sorted by probability",
    "stream_options_empty": "upstream: KeyError after the last chunk, the stream ends "
    "without [DONE]; ours: no usage chunk, then [DONE]",
    "image_to_text_model": "upstream: 404 'Only 'text' content type is supported.'; "
    "ours: the same message with 400 (it is a bad request, not a missing model)",
    "fatal_top_k_over_vocab": "upstream: top_k larger than the vocabulary kills the "
    "generation thread; ours: 400 'top_k must be less than <vocab size>'",
    "fatal_stop_ints": "upstream: the generation thread dies on non-string stop words "
    "and every later request fails; ours: 400 'stop must be a string or a list of strings'",
    "fatal_empty_prompt": "upstream: the generation thread dies on an empty prompt; "
    "ours: 400 'prompt must not be empty'",
}
