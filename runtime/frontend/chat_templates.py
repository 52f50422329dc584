"""Which chat template renders a conversation: the model's own, `--chat-template FILE`
instead, or, for a request with tools whose template has no place for them, a built-in one.

The built-in template is Hermes-style ChatML, as Qwen2.5's template writes tools: the tools
listed in the system turn with how to call them (`<tool_call>{"name", "arguments"}
</tool_call>`, what the `hermes` parser reads), the assistant's calls in that form, and tool
results as a user turn of `<tool_response>` blocks. It only fits a model whose own template
is ChatML (`<|im_start|>`), like the default SmolLM2; any other without a tool section is
refused with words rather than prompted in turn markers it never saw.
"""

from __future__ import annotations

HERMES_TOOLS_TEMPLATE = """\
{%- if messages[0].role == 'system' %}
{%- set system = messages[0].content %}{%- set rest = messages[1:] %}
{%- else %}
{%- set system = 'You are a helpful assistant.' %}{%- set rest = messages %}
{%- endif %}
{{- '<|im_start|>system\\n' + system }}
{%- if tools %}
{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n\
You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and \
arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, \
"arguments": <args-json-object>}\\n</tool_call>' }}
{%- endif %}
{{- '<|im_end|>\\n' }}
{%- for message in rest %}
{%- if message.role == 'tool' %}
{%- if loop.first or rest[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or rest[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- elif message.role == 'assistant' and message.tool_calls %}
{{- '<|im_start|>assistant' }}
{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for call in message.tool_calls %}
{{- '\\n<tool_call>\\n{"name": "' + call.function.name + '", "arguments": ' + \
(call.function.arguments | tojson) + '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""


def template_for(own: str | None, has_tools: bool) -> str | None:
    """The template a conversation is rendered with: the model's own (or --chat-template's),
    unless the request has tools and it has no place for them (then the built-in one, for a
    ChatML model); ValueError if there is none that fits."""
    if not has_tools or (own is not None and "tools" in own):
        return own
    if own is not None and "<|im_start|>" in own:
        return HERMES_TOOLS_TEMPLATE
    raise ValueError(
        "this model's chat template has no place for tools: start the server with "
        "--chat-template FILE, a template that renders `tools`"
    )
