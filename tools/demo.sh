#!/usr/bin/env bash
# The main job: build m3serve, serve the embedded demo model (models/demo) on 127.0.0.1, and
# answer chat requests through the OpenAI API: one with reasoning, one with a tool call.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build/release}
bash tools/build.sh "$BUILD" >/dev/null
PORT=${PORT:-$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')}
"$BUILD/bin/m3serve" serve --host 127.0.0.1 --port "$PORT" --tool-call-parser minimax_m3 \
  --reasoning-parser minimax_m3 --enable-auto-tool-choice &
PID=$!
trap 'kill $PID 2>/dev/null || true; wait $PID 2>/dev/null || true' EXIT
for _ in $(seq 1 120); do
  curl -sf "http://127.0.0.1:$PORT/health" >/dev/null 2>&1 && break
  sleep 0.5
done
python3 - "$PORT" <<'PY'
import json, sys, urllib.request
port = sys.argv[1]
def chat(body):
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions",
                                 data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(req, timeout=300))
r = chat({"model": "demo", "messages": [{"role": "user", "content": "What is 23 + 19?"}],
          "chat_template_kwargs": {"thinking_mode": "enabled"}, "max_tokens": 120})
m = r["choices"][0]["message"]
print("user: What is 23 + 19?   (thinking enabled)")
print("  reasoning:", m.get("reasoning"))
print("  content:  ", m.get("content"))
print("  usage:    ", r["usage"])
tools = [{"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city.",
          "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "City name"},
                         "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}}},
         {"type": "function", "function": {"name": "set_timer", "description": "Start a countdown timer.",
          "parameters": {"type": "object", "properties": {"minutes": {"type": "integer"}, "label": {"type": "string"}},
                         "required": ["minutes", "label"]}}}]
q = "What is the weather in Paris in celsius?"
r = chat({"model": "demo", "messages": [{"role": "user", "content": q}], "tools": tools, "max_tokens": 120})
c = r["choices"][0]
print(f"user: {q}   (tools: get_weather, set_timer)")
for call in c["message"].get("tool_calls") or []:
    print("  tool call:", call["function"]["name"], call["function"]["arguments"])
print("  finish_reason:", c["finish_reason"])
calls = c["message"].get("tool_calls") or []
if calls:
    result = {"city": "Paris", "temperature": 18, "unit": "celsius", "condition": "sunny"}
    msgs = [{"role": "user", "content": q}, {"role": "assistant", "content": None, "tool_calls": calls[:1]},
            {"role": "tool", "tool_call_id": calls[0]["id"], "content": json.dumps(result)}]
    r = chat({"model": "demo", "messages": msgs, "tools": tools, "max_tokens": 120})
    print("tool result:", json.dumps(result))
    print("  answer:", r["choices"][0]["message"].get("content"))
PY
