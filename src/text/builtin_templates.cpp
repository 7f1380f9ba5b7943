// The built-in MiniMax-M3 chat template (see builtin_templates.h). Keep in sync with
// tests/golden/text/templates/minimax_m3.jinja: edit that file, then paste it here verbatim.
#include "text/builtin_templates.h"

namespace m3::text {

const std::string_view kMiniMaxM3ChatTemplate =
    R"M3TPL({#- m3serve built-in MiniMax-M3 chat template (our own text; must stay byte-identical to
    kMiniMaxM3ChatTemplate in src/text/builtin_templates.cpp).
    Layout: docs m3-model.md sections 6.2 and 6.3. UNVERIFIED against the shipped
    chat_template.jinja: the generic thinking paragraph, the tool-call example, the absence of a
    separator between assistant text and its tool block, keeping reasoning on every assistant
    turn, and the mapping enable_thinking=false -> disabled are our choices. -#}
{%- set bod_token = ']~!b[' -%}
{%- set bos_token = ']~b]' -%}
{%- set eos_token = '[e~[' -%}
{%- set ns_token = ']<]minimax[>[' -%}
{%- set think_begin = '<mm:think>' -%}
{%- set think_end = '</mm:think>' -%}
{%- set image_token = ']<]image[>[' -%}
{%- set video_token = ']<]video[>[' -%}
{%- set default_identity = 'Your model version is MiniMax-M3, developed by MiniMax. Knowledge cutoff: January 2026. Founded in early 2022, MiniMax is a global AI foundation model company committed to advancing the frontiers of AI towards AGI.' -%}
{%- set default_system = 'You are a helpful assistant.' -%}

{#- Thinking mode: thinking_mode wins; the deprecated enable_thinking maps true -> enabled. -#}
{%- if thinking_mode is defined and thinking_mode is not none -%}
    {%- set mode = thinking_mode -%}
{%- elif enable_thinking is defined and enable_thinking is not none -%}
    {%- set mode = 'enabled' if enable_thinking else 'disabled' -%}
{%- else -%}
    {%- set mode = 'adaptive' -%}
{%- endif -%}
{%- if mode == 'enabled' -%}
    {%- set mode_line = 'Current thinking mode: enabled. You MUST think step by step before every response, including after receiving function/tool results.' -%}
{%- elif mode == 'disabled' -%}
    {%- set mode_line = 'Current thinking mode: disabled. Do not output any thinking process.' -%}
{%- elif mode == 'adaptive' -%}
    {%- set mode_line = 'Current thinking mode: adaptive. You are encouraged to think for complex decision-making, multi-step reasoning, or when analyzing function/tool results.' -%}
{%- else -%}
    {{- raise_exception("thinking_mode must be 'enabled', 'disabled' or 'adaptive', got '" ~ mode ~ "'") -}}
{%- endif -%}
{%- set thinking_sentence = 'Reasoning goes inside ' ~ think_begin ~ think_end ~ ' before the visible answer: write your thinking between ' ~ think_begin ~ ' and ' ~ think_end ~ ', then give the answer after ' ~ think_end ~ '. When thinking is disabled, the response begins directly after the ' ~ think_end ~ ' prefix. When thinking is adaptive, decide for yourself whether to think first or to answer directly after a bare ' ~ think_end ~ '.' -%}

{#- Message content: a string, or a list of parts (text, image, video). -#}
{%- macro render_content(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- elif content is mapping -%}
        {{- content.text if content.text is defined else '' -}}
    {%- elif content is iterable -%}
        {%- for part in content -%}
            {%- if part is string -%}
                {{- part -}}
            {%- elif part.type == 'text' -%}
                {{- part.text -}}
            {%- elif part.type in ['image', 'image_url'] -%}
                {{- image_token -}}
            {%- elif part.type in ['video', 'video_url'] -%}
                {{- video_token -}}
            {%- endif -%}
        {%- endfor -%}
    {%- elif content is not none -%}
        {{- content -}}
    {%- endif -%}
{%- endmacro -%}

{#- Tool-call argument values: strings and numbers raw (no escaping), booleans true/false, None
    skipped, dicts as nested elements, lists as repeated <item> elements. -#}
{%- macro to_xml(value) -%}
    {%- if value is mapping -%}
        {%- for key, item in value.items() if item is not none -%}
            {{- ns_token ~ '<' ~ key ~ '>' ~ to_xml(item) ~ ns_token ~ '</' ~ key ~ '>' -}}
        {%- endfor -%}
    {%- elif value is string -%}
        {{- value -}}
    {%- elif value is boolean -%}
        {{- 'true' if value else 'false' -}}
    {%- elif value is iterable -%}
        {%- for item in value if item is not none -%}
            {{- ns_token ~ '<item>' ~ to_xml(item) ~ ns_token ~ '</item>' -}}
        {%- endfor -%}
    {%- elif value is not none -%}
        {{- value -}}
    {%- endif -%}
{%- endmacro -%}

{#- Leading root message = identity, then the first system/developer message = system prompt. -#}
{%- set ns = namespace(identity=default_identity, system=default_system, start=0) -%}
{%- if messages and messages[0].role == 'root' -%}
    {%- set ns.identity = render_content(messages[0].content) -%}
    {%- set ns.start = 1 -%}
{%- endif -%}
{%- if messages | length > ns.start and messages[ns.start].role in ['system', 'developer'] -%}
    {%- set ns.system = render_content(messages[ns.start].content) -%}
    {%- set ns.start = ns.start + 1 -%}
{%- endif -%}

{{- bod_token ~ bos_token ~ 'system\n' ~ ns.identity ~ '\n\n<thinking_instructions>\n' ~ thinking_sentence ~ '\n' ~ mode_line ~ '\n</thinking_instructions>' ~ eos_token ~ '\n' -}}
{{- bos_token ~ 'developer\n' ~ ns.system -}}
{%- if tools -%}
    {{- '\n\n# Tools\nYou may call one or more tools to assist with the user query.\nHere are the tools available in JSONSchema format:\n\n<tools>\n' -}}
    {%- for tool in tools -%}
        {{- '<tool>' ~ ((tool.function if tool.function is defined else tool) | tojson) ~ '</tool>\n' -}}
    {%- endfor -%}
    {{- '</tools>\n\nTo call tools, wrap all invocations in a single ' ~ ns_token ~ '<tool_call>' ~ ns_token ~ '</tool_call> block. Parameter values containing nested objects or arrays are recursively expanded into XML elements. Example:\n\n' -}}
    {#- Example block: our own text in the section 6.3 format. -#}
    {{- ns_token ~ '<tool_call>\n' -}}
    {{- ns_token ~ '<invoke name="search_web">' ~ to_xml({'query': 'MiniMax-M3 release notes', 'max_results': 3}) ~ ns_token ~ '</invoke>\n' -}}
    {{- ns_token ~ '<invoke name="create_events">' ~ to_xml({'events': [{'title': 'Standup', 'minutes': 15}, {'title': 'Review', 'minutes': 45}]}) ~ ns_token ~ '</invoke>\n' -}}
    {{- ns_token ~ '</tool_call>' -}}
{%- endif -%}
{{- eos_token ~ '\n' -}}

{%- for message in messages[ns.start:] -%}
    {%- if message.role == 'user' -%}
        {{- bos_token ~ 'user\n' ~ render_content(message.content) ~ eos_token ~ '\n' -}}
    {%- elif message.role == 'assistant' -%}
        {%- set content = render_content(message.content) -%}
        {%- set reasoning = message.reasoning_content if message.reasoning_content is string else '' -%}
        {%- if not reasoning and think_end in content -%}
            {%- set reasoning = content.split(think_end)[0].split(think_begin)[-1].strip('\n') -%}
            {%- set content = content.split(think_end)[-1].lstrip('\n') -%}
        {%- endif -%}
        {{- bos_token ~ 'ai\n' -}}
        {%- if reasoning -%}
            {{- think_begin ~ reasoning ~ think_end -}}
        {%- else -%}
            {{- think_end -}}
        {%- endif -%}
        {{- content -}}
        {%- if message.tool_calls -%}
            {{- ns_token ~ '<tool_call>\n' -}}
            {%- for call in message.tool_calls -%}
                {%- set fn = call.function if call.function is defined else call -%}
                {{- ns_token ~ '<invoke name="' ~ fn.name ~ '">' -}}
                {%- if fn.arguments is string -%}
                    {{- fn.arguments -}}
                {%- else -%}
                    {{- to_xml(fn.arguments) -}}
                {%- endif -%}
                {{- ns_token ~ '</invoke>\n' -}}
            {%- endfor -%}
            {{- ns_token ~ '</tool_call>' -}}
        {%- endif -%}
        {{- eos_token ~ '\n' -}}
    {%- elif message.role == 'tool' -%}
        {%- if loop.first or loop.previtem.role != 'tool' -%}
            {{- bos_token ~ 'tool' -}}
        {%- endif -%}
        {{- '\n<response>' ~ render_content(message.content) ~ '</response>' -}}
        {%- if loop.last or loop.nextitem.role != 'tool' -%}
            {{- eos_token ~ '\n' -}}
        {%- endif -%}
    {%- elif message.role in ['system', 'developer'] -%}
        {{- bos_token ~ message.role ~ '\n' ~ render_content(message.content) ~ eos_token ~ '\n' -}}
    {%- else -%}
        {{- raise_exception('Unsupported message role: ' ~ message.role) -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- bos_token ~ 'ai\n' -}}
    {%- if mode == 'enabled' -%}
        {{- think_begin -}}
    {%- elif mode == 'disabled' -%}
        {{- think_end -}}
    {%- endif -%}
{%- endif -%}
)M3TPL";

}  // namespace m3::text
