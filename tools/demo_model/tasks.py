"""Task generators for the m3serve demo model: each sample is an OpenAI-style conversation (the
messages a client would send), the tools, the thinking mode, the completion the model must learn
(or, for evaluation, the expected answer). Shared by make_data.py (training data), train.py (the
transformers evaluation) and eval.py (the same prompts through m3serve), so both engines see
identical prompts. Deterministic given the seed. No torch here.
"""

import json
import random

from chat_format import completion_text

# ------------------------------------------------------------------------------------------
# Tools
# ------------------------------------------------------------------------------------------

TOOLS = {
    "get_weather": {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "City name"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city", "unit"],
            },
        },
    },
    "convert_currency": {
        "type": "function",
        "function": {
            "name": "convert_currency",
            "description": "Convert an amount of money from one currency to another.",
            "parameters": {
                "type": "object",
                "properties": {
                    "amount": {"type": "number"},
                    "source": {"type": "string", "description": "ISO code, e.g. USD"},
                    "target": {"type": "string", "description": "ISO code, e.g. EUR"},
                },
                "required": ["amount", "source", "target"],
            },
        },
    },
    "get_stock_price": {
        "type": "function",
        "function": {
            "name": "get_stock_price",
            "description": "Get the latest price of a stock by its ticker symbol.",
            "parameters": {
                "type": "object",
                "properties": {"symbol": {"type": "string"}},
                "required": ["symbol"],
            },
        },
    },
    "set_timer": {
        "type": "function",
        "function": {
            "name": "set_timer",
            "description": "Start a countdown timer.",
            "parameters": {
                "type": "object",
                "properties": {
                    "minutes": {"type": "integer"},
                    "label": {"type": "string"},
                },
                "required": ["minutes", "label"],
            },
        },
    },
    "send_email": {
        "type": "function",
        "function": {
            "name": "send_email",
            "description": "Send an email.",
            "parameters": {
                "type": "object",
                "properties": {
                    "to": {"type": "array", "items": {"type": "string"}},
                    "subject": {"type": "string"},
                },
                "required": ["to", "subject"],
            },
        },
    },
}

CITIES = ["Paris", "Berlin", "Tokyo", "Lima", "Cairo", "Oslo", "Madrid", "Seoul", "Rome",
          "Dublin", "Nairobi", "Lisbon", "Vienna", "Prague", "Sydney", "Boston", "Denver",
          "Mumbai", "Shanghai", "Toronto", "Chicago", "Athens", "Warsaw", "Helsinki"]
CURRENCIES = ["USD", "EUR", "JPY", "GBP", "CHF", "CNY", "CAD", "AUD", "INR", "SEK"]
SYMBOLS = ["ACME", "GLOBX", "INITECH", "UMBRA", "WAYNE", "STARK", "HOOLI", "VAND", "NOVA", "ZEN"]
CONDITIONS = ["sunny", "cloudy", "rainy", "windy", "snowy", "foggy"]
NAMES = ["alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi", "ivan", "judy"]
LABELS = ["tea", "pasta", "laundry", "workout", "meeting", "break", "oven", "nap"]
SUBJECTS = ["Lunch on Friday", "Project update", "Weekly report", "Holiday plans",
            "Team dinner", "Budget review", "New schedule"]
ITEMS = ["apples", "pears", "lemons", "plums", "cherries", "melons", "peaches", "grapes",
         "figs", "limes", "onions", "carrots", "potatoes", "tomatoes", "eggs", "cookies"]
SYSTEMS = [None, None, None, "You are a helpful assistant.", "You are a concise assistant.",
           "You are a friendly assistant. Answer briefly."]


def tools_for(rng, must):
    names = [must] + rng.sample([n for n in TOOLS if n != must], rng.randint(0, 2))
    rng.shuffle(names)
    return [TOOLS[n] for n in names]


def base_messages(rng, system_choice=True):
    msgs = []
    s = rng.choice(SYSTEMS) if system_choice else None
    if s:
        msgs.append({"role": "system", "content": s})
    return msgs


# ------------------------------------------------------------------------------------------
# Arithmetic
# ------------------------------------------------------------------------------------------


def arith_problem(rng):
    op = rng.choice(["+", "-", "*"])
    if op == "+":
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        r = a + b
        tens, ones = (b // 10) * 10, b % 10
        x = a + tens
        steps = f"{a} + {b}: {a} + {tens} = {x}. {x} + {ones} = {r}."
        word = "plus"
    elif op == "-":
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        if b > a:
            a, b = b, a
        r = a - b
        tens, ones = (b // 10) * 10, b % 10
        x = a - tens
        steps = f"{a} - {b}: {a} - {tens} = {x}. {x} - {ones} = {r}."
        word = "minus"
    else:
        a, b = rng.randint(2, 9), rng.randint(10, 99)
        r = a * b
        tens, ones = (b // 10) * 10, b % 10
        steps = f"{a} * {b}: {a} * {tens} = {a * tens}. {a} * {ones} = {a * ones}. " \
                f"{a * tens} + {a * ones} = {r}."
        word = "times"
    q = rng.choice([
        f"What is {a} {op} {b}?", f"Compute {a} {op} {b}.", f"Calculate {a} {word} {b}.",
        f"How much is {a} {op} {b}?", f"{a} {op} {b} = ?",
    ])
    ans = f"{a} {op} {b} = {r}."
    # The reasoning ends with the answer sentence, so the final answer is a verbatim copy of
    # it (an induction-friendly target: the first model computed the steps right but did not
    # carry the result over).
    return q, steps + " So " + ans, r, ans


# ------------------------------------------------------------------------------------------
# Lookup (in-context table), optionally with a sum
# ------------------------------------------------------------------------------------------


def lookup_problem(rng):
    n = rng.randint(3, 6)
    items = rng.sample(ITEMS, n)
    counts = {it: rng.randint(1, 60) for it in items}
    table = "Inventory:\n" + "".join(f"- {it}: {counts[it]}\n" for it in items)
    if rng.random() < 0.5:
        it = rng.choice(items)
        q = table + rng.choice([f"How many {it} are there?", f"How many {it} do we have?",
                                f"What is the count of {it}?"])
        ans = f"There are {counts[it]} {it}."
        reasoning = f"The inventory lists {it}: {counts[it]}. So " + ans[0].lower() + ans[1:]
        return q, reasoning, counts[it], ans
    a, b = rng.sample(items, 2)
    s = counts[a] + counts[b]
    q = table + rng.choice([f"How many {a} and {b} are there in total?",
                            f"What is the total of {a} and {b}?"])
    ca, cb = counts[a], counts[b]
    tens, ones = (cb // 10) * 10, cb % 10
    ans = f"There are {s} {a} and {b} in total."
    reasoning = (f"The inventory lists {a}: {ca} and {b}: {cb}. "
                 f"{ca} + {tens} = {ca + tens}. {ca + tens} + {ones} = {s}. So " + ans[0].lower() + ans[1:])
    return q, reasoning, s, ans


# ------------------------------------------------------------------------------------------
# Tool use
# ------------------------------------------------------------------------------------------


def tool_problem(rng):
    """Returns (user text, tool name, args, reasoning, result dict, final answer)."""
    kind = rng.choice(list(TOOLS))
    if kind == "get_weather":
        city = rng.choice(CITIES)
        unit = rng.choice(["celsius", "fahrenheit"])
        q = rng.choice([f"What is the weather in {city} in {unit}?",
                        f"How warm is it in {city}? Use {unit}.",
                        f"Tell me the weather in {city}, in {unit} please."])
        args = {"city": city, "unit": unit}
        temp = rng.randint(-5, 35) if unit == "celsius" else rng.randint(20, 95)
        cond = rng.choice(CONDITIONS)
        result = {"city": city, "temperature": temp, "unit": unit, "condition": cond}
        final = f"It is {temp} degrees {unit} and {cond} in {city}."
        reasoning = f"The user wants the weather in {city} in {unit}. I will call get_weather."
    elif kind == "convert_currency":
        amount = rng.choice([rng.randint(1, 999), rng.randint(1, 99) * 10])
        src, dst = rng.sample(CURRENCIES, 2)
        q = rng.choice([f"Convert {amount} {src} to {dst}.", f"How much is {amount} {src} in {dst}?",
                        f"What are {amount} {src} worth in {dst}?"])
        args = {"amount": amount, "source": src, "target": dst}
        val = round(amount * rng.uniform(0.2, 3.0), 2)
        result = {"amount": val, "currency": dst}
        final = f"{amount} {src} is {val} {dst}."
        reasoning = f"The user wants to convert {amount} {src} to {dst}. I will call convert_currency."
    elif kind == "get_stock_price":
        sym = rng.choice(SYMBOLS)
        q = rng.choice([f"What is the price of {sym} stock?", f"How much does {sym} trade at?",
                        f"Get me the latest {sym} share price."])
        args = {"symbol": sym}
        price = round(rng.uniform(5, 500), 2)
        result = {"symbol": sym, "price": price}
        final = f"{sym} trades at {price}."
        reasoning = f"The user asks for the price of {sym}. I will call get_stock_price."
    elif kind == "set_timer":
        minutes = rng.randint(1, 90)
        label = rng.choice(LABELS)
        q = rng.choice([f"Set a timer for {minutes} minutes for the {label}.",
                        f"Start a {minutes} minute {label} timer.",
                        f"Remind me about the {label} in {minutes} minutes."])
        args = {"minutes": minutes, "label": label}
        result = {"ok": True, "minutes": minutes}
        final = f"Done. The {label} timer is set for {minutes} minutes."
        reasoning = f"The user wants a {minutes} minute timer for the {label}. I will call set_timer."
    else:
        to = rng.sample(NAMES, rng.randint(1, 2))
        subject = rng.choice(SUBJECTS)
        who = " and ".join(to)
        q = rng.choice([f"Send an email to {who} with the subject {subject}.",
                        f"Email {who} about {subject}."])
        args = {"to": [f"{n}@example.com" for n in to], "subject": subject}
        result = {"sent": True}
        final = f"The email about {subject} was sent to {who}."
        reasoning = f"The user wants to email {who} about {subject}. I will call send_email."
    return q, kind, args, reasoning, result, final


# ------------------------------------------------------------------------------------------
# Passkey retrieval
# ------------------------------------------------------------------------------------------

FILLER = [
    "The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.",
    "There and back again.", "The river flows to the sea.", "Birds sing in the morning.",
    "The road winds through the hills.", "A cat sleeps on the warm stone.",
    "The market opens early.", "Clouds drift over the valley.", "The old clock ticks.",
    "Leaves fall in the autumn wind.", "The baker makes fresh bread.", "Waves touch the sand.",
]
FILLER_NUM = ["Room {} has a small window.", "The bus number {} was late.",
              "In the year {} the bridge was built.", "The shelf holds {} old books.",
              "Train {} leaves at noon."]


class FillerLengths:
    """Token length of ' ' + sentence for each filler sentence, measured with the tokenizer."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.cache = {}

    def __call__(self, s):
        if s not in self.cache:
            self.cache[s] = len(self.tok.encode(" " + s, add_special_tokens=False).ids)
        return self.cache[s]


def filler_text(rng, n_tokens, flen):
    out, used = [], 0
    while used < n_tokens:
        if rng.random() < 0.15:
            s = rng.choice(FILLER_NUM).format(rng.randint(1, 999))
        else:
            s = rng.choice(FILLER)
        out.append(s)
        used += flen(s)
    return " ".join(out)


def passkey_problem(rng, ctx_tokens, flen, depth=None):
    """A passkey hidden at relative `depth` in filler of about ctx_tokens tokens."""
    key = rng.randint(10000, 99999)
    depth = rng.random() if depth is None else depth
    intro = "There is a pass key hidden in the text below. Find it and remember it.\n"
    needle = f" The pass key is {key}. Remember it. {key} is the pass key. "
    question = "\nWhat is the pass key?"
    before = int(ctx_tokens * depth)
    after = max(0, ctx_tokens - before)
    text = intro + filler_text(rng, before, flen) + needle + filler_text(rng, after, flen) + question
    return text, key, f"The pass key is {key}."


# ------------------------------------------------------------------------------------------
# Chit-chat
# ------------------------------------------------------------------------------------------

CHAT = [
    (["Hello!", "Hi", "Hi there!", "Hey.", "Good morning!"],
     "Hello! How can I help you today?"),
    (["Who are you?", "What are you?", "Introduce yourself."],
     "I am a small demo model with the MiniMax-M3 architecture, served by m3serve."),
    (["Thank you!", "Thanks a lot.", "Great, thanks."], "You are welcome!"),
    (["What can you do?", "How can you help me?"],
     "I can do small arithmetic, read lists, call tools and find a pass key in long text."),
    (["Bye!", "Goodbye.", "See you later."], "Goodbye! Have a nice day."),
]


def chat_problem(rng):
    qs, a = rng.choice(CHAT)
    return rng.choice(qs), a


# ------------------------------------------------------------------------------------------
# Training samples: dict(prompt_messages, tools, mode, completion, kind)
# ------------------------------------------------------------------------------------------


def _mode(rng, p_enabled=0.45, p_disabled=0.4):
    x = rng.random()
    return "enabled" if x < p_enabled else ("disabled" if x < p_enabled + p_disabled else "adaptive")


def _history(rng):
    """An optional earlier exchange, as a client would send it back (no reasoning)."""
    if rng.random() < 0.25:
        q, _, _, ans = arith_problem(rng)
        return [{"role": "user", "content": q}, {"role": "assistant", "content": ans}]
    if rng.random() < 0.1:
        q, a = chat_problem(rng)
        return [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    return []


def train_sample(rng, kind, flen=None, ctx_tokens=None):
    msgs = base_messages(rng)
    if kind == "arith":
        q, steps, _, ans = arith_problem(rng)
        mode = _mode(rng)
        msgs += _history(rng) + [{"role": "user", "content": q}]
        # adaptive: think for arithmetic (multi-step)
        return dict(messages=msgs, tools=None, mode=mode, kind=kind,
                    completion=completion_text(mode, "" if mode == "disabled" else steps, ans))
    if kind == "lookup":
        q, reasoning, _, ans = lookup_problem(rng)
        mode = _mode(rng)
        msgs += _history(rng) + [{"role": "user", "content": q}]
        return dict(messages=msgs, tools=None, mode=mode, kind=kind,
                    completion=completion_text(mode, "" if mode == "disabled" else reasoning, ans))
    if kind == "chat":
        q, a = chat_problem(rng)
        mode = _mode(rng)
        tools = tools_for(rng, rng.choice(list(TOOLS))) if rng.random() < 0.2 else None
        msgs += _history(rng) + [{"role": "user", "content": q}]
        # adaptive: no thinking for small talk; enabled: a one-line thought
        reasoning = {"enabled": "The user is chatting. I will reply briefly."}.get(mode, "")
        return dict(messages=msgs, tools=tools, mode=mode, kind=kind,
                    completion=completion_text(mode, reasoning, a))
    if kind in ("tool_call", "tool_answer"):
        q, name, args, reasoning, result, final = tool_problem(rng)
        tools = tools_for(rng, name)
        mode = _mode(rng)
        msgs += _history(rng) + [{"role": "user", "content": q}]
        if kind == "tool_call":
            return dict(messages=msgs, tools=tools, mode=mode, kind=kind,
                        completion=completion_text(mode, "" if mode == "disabled" else reasoning,
                                                   "", [(name, args)]))
        call = {"id": "call_0", "type": "function", "function": {"name": name, "arguments": args}}
        msgs += [{"role": "assistant", "content": "", "tool_calls": [call]},
                 {"role": "tool", "tool_call_id": "call_0", "content": json.dumps(result)}]
        r2 = "The tool returned the result. I will report it."
        return dict(messages=msgs, tools=tools, mode=mode, kind=kind,
                    completion=completion_text(mode, "" if mode == "disabled" else r2, final))
    if kind == "passkey":
        text, _, ans = passkey_problem(rng, ctx_tokens, flen)
        msgs = [{"role": "user", "content": text}]
        return dict(messages=msgs, tools=None, mode="disabled", kind=kind,
                    completion=completion_text("disabled", "", ans))
    raise ValueError(kind)


# ------------------------------------------------------------------------------------------
# Evaluation prompts (fixed seed, disjoint stream from training)
# ------------------------------------------------------------------------------------------

PASSKEY_EVAL_LENGTHS = [512, 1024, 2048, 3072, 4000]


def eval_set(flen, seed=12345, n_task=40, n_tool=40, n_passkey=12):
    rng = random.Random(seed)
    out = []
    for i in range(n_task):
        if i % 2 == 0:
            q, _, r, _ = arith_problem(rng)
            kind = "arith"
        else:
            q, _, r, _ = lookup_problem(rng)
            kind = "lookup"
        for mode in ("enabled", "disabled"):
            out.append(dict(id=f"{kind}{i}_{mode}", kind=kind, mode=mode, tools=None,
                             messages=[{"role": "user", "content": q}], expect=str(r)))
    for i in range(n_tool):
        q, name, args, _, _, _ = tool_problem(rng)
        tools = tools_for(rng, name)
        mode = "enabled" if i % 2 == 0 else "disabled"
        out.append(dict(id=f"tool{i}_{mode}", kind="tool", mode=mode, tools=tools,
                        messages=[{"role": "user", "content": q}],
                        expect={"name": name, "arguments": args}))
    for L in PASSKEY_EVAL_LENGTHS:
        for i in range(n_passkey):
            text, key, _ = passkey_problem(rng, L, flen, depth=(i + 0.5) / n_passkey)
            out.append(dict(id=f"passkey{L}_{i}", kind="passkey", mode="disabled", tools=None,
                            ctx=L, messages=[{"role": "user", "content": text}], expect=str(key)))
    return out


def answer_correct(item, content):
    """Task scoring shared by both engines: the expected number appears in the final answer."""
    import re
    nums = re.findall(r"-?\d+", content or "")
    if item["kind"] in ("arith", "lookup"):
        return bool(nums) and nums[-1] == item["expect"]
    if item["kind"] == "passkey":
        return item["expect"] in nums
    raise ValueError(item["kind"])


def tool_call_correct(item, calls):
    if not calls:
        return False
    c = calls[0]
    return c["name"] == item["expect"]["name"] and c["arguments"] == item["expect"]["arguments"]
