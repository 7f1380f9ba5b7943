"""vLLM's own minimax_m3 parsers, loaded from a local vLLM source tree, driven the way vLLM's
chat server drives them (tools/parity).

Nothing of vLLM is copied here: `load(path)` puts the tree given on the command line (a git
checkout, or the `vllm/` folder unpacked from the vLLM wheel) on the import path and imports
vLLM's parser modules from it. Only what those modules import and this machine lacks is stubbed:
torch, transformers and a few GPU-side packages that the parser code never calls, plus the
`vllm.config`, `vllm.model_executor` and `vllm.distributed` packages (their import runs GPU
set-up code). The `vllm` package's own `__init__` is skipped for the same reason (it imports
torch and sets up the engine). The parsers themselves, the chat request model (pydantic), the
`ParserManager` that composes `--tool-call-parser minimax_m3 --reasoning-parser minimax_m3`, the
serving layer's `assemble_chat_message_fields` (non-streaming) and `ChatStreamProcessor`
(streaming) run unchanged.

The tokenizer is a `tokenizers.Tokenizer` (the HF tokenizer.json of the model) behind the few
methods vLLM's parsers call.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import json
import os
import sys
import types
from typing import Any

# Third-party packages the parser modules import (through vLLM's protocol and utility modules)
# whose code the parsers never run; stubbed when not installed.
STUB_IF_MISSING = ["torch", "transformers", "partial_json_parser", "xgrammar", "ijson",
                   "mistral_common", "cbor2", "psutil", "PIL", "pybase64", "cachetools",
                   "prometheus_client", "openai_harmony", "uvloop", "cpuinfo"]
# vLLM packages whose import runs device set-up; the parsers only import names from them.
STUB_ALWAYS = ["vllm.config", "vllm.model_executor", "vllm.distributed"]


class _StubType(type):
    """A class that answers every attribute with another stub; calling it returns a stub (or,
    used as a decorator, the decorated function unchanged)."""

    def __getattr__(cls, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _stub(name)

    def __call__(cls, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]
        return _stub("instance")

    def __getitem__(cls, key):
        return cls

    def __or__(cls, other):
        return cls

    def __ror__(cls, other):
        return cls

    def __iter__(cls):
        return iter(())

    def __bool__(cls):
        return False


def _stub(name: str) -> type:
    return _StubType(name, (), {})


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        value = _stub(name)
        setattr(self, name, value)
        return value


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, prefixes: list[str]):
        self.prefixes = prefixes

    def find_spec(self, fullname, path, target=None):
        if any(fullname == p or fullname.startswith(p + ".") for p in self.prefixes):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        m = _StubModule(spec.name)
        m.__path__ = []
        return m

    def exec_module(self, module):
        pass


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


class HFTokenizer:
    """The tokenizer methods vLLM's parsers and their serving code call."""

    def __init__(self, tokenizer_json: str):
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(tokenizer_json)
        self._vocab = self.tok.get_vocab(with_added_tokens=True)
        # transformers' all_special_tokens: the special-tokens map of tokenizer_config.json
        # (bos / eos / unk / pad / additional_special_tokens), not every added token flagged
        # special in tokenizer.json. vLLM's streaming engine drops these from the text.
        cfg_path = os.path.join(os.path.dirname(tokenizer_json), "tokenizer_config.json")
        cfg = json.load(open(cfg_path, encoding="utf-8")) if os.path.isfile(cfg_path) else {}
        names = []
        for key in ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token",
                    "cls_token", "mask_token"):
            v = cfg.get(key)
            if isinstance(v, dict):
                v = v.get("content")
            if isinstance(v, str) and v not in names:
                names.append(v)
        for v in cfg.get("additional_special_tokens") or []:
            v = v.get("content") if isinstance(v, dict) else v
            if isinstance(v, str) and v not in names:
                names.append(v)
        self.all_special_tokens = [t for t in names if t in self._vocab]
        self.all_special_ids = [self._vocab[t] for t in self.all_special_tokens]
        self.eos_token_id = self._vocab.get("[e~[")

    def get_vocab(self) -> dict[str, int]:
        return dict(self._vocab)

    @property
    def vocab(self) -> dict[str, int]:
        return self.get_vocab()

    def encode(self, text: str, add_special_tokens: bool = False, **_: Any) -> list[int]:
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = False, **_: Any) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_tokens_to_ids(self, tokens):
        if isinstance(tokens, str):
            return self._vocab.get(tokens)
        return [self._vocab.get(t) for t in tokens]

    def convert_ids_to_tokens(self, ids):
        if isinstance(ids, int):
            return self.tok.id_to_token(ids)
        return [self.tok.id_to_token(i) for i in ids]

    def __len__(self) -> int:
        return len(self._vocab)


class VllmParsers:
    """vLLM's composed `minimax_m3` reasoning + tool parser, as its chat server uses it."""

    def __init__(self, vllm_root: str, tokenizer: HFTokenizer):
        pkg = os.path.join(vllm_root, "vllm")
        if not os.path.isfile(os.path.join(pkg, "parser", "minimax_m3.py")) and not os.path.isfile(
                os.path.join(pkg, "tool_parsers", "minimax_m3_tool_parser.py")):
            raise SystemExit(f"{vllm_root}: no vllm/tool_parsers/minimax_m3_tool_parser.py there; "
                             "give --vllm the folder that holds vLLM's `vllm` package")
        stubs = [n for n in STUB_IF_MISSING if not _installed(n)] + STUB_ALWAYS
        self.stubbed = stubs
        sys.meta_path.insert(0, _StubFinder(stubs))
        real_version = importlib.metadata.version

        def version(name: str) -> str:  # vLLM checks torch's version at import
            if name in stubs:
                return "2.10.0"
            return real_version(name)

        importlib.metadata.version = version
        root = types.ModuleType("vllm")
        root.__path__ = [pkg]
        sys.modules["vllm"] = root
        self.tokenizer = tokenizer
        pm = importlib.import_module("vllm.parser.parser_manager")
        self.protocol = importlib.import_module("vllm.entrypoints.openai.chat_completion.protocol")
        self.assembly = importlib.import_module(
            "vllm.entrypoints.openai.chat_completion.message_assembly")
        self.stream_mod = importlib.import_module(
            "vllm.entrypoints.openai.chat_completion.stream_processor")
        self.parser_cls = pm.ParserManager.get_parser(
            tool_parser_name="minimax_m3", reasoning_parser_name="minimax_m3",
            enable_auto_tools=True, model_name="MiniMaxAI/MiniMax-M3", tokenizer=tokenizer)
        self.version = _vllm_version(vllm_root)

    def request(self, rec: dict):
        kw: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                              "chat_template_kwargs": {"thinking_mode": rec["thinking_mode"]}}
        if rec.get("tools"):
            kw["tools"] = rec["tools"]
            kw["tool_choice"] = "auto"
        return self.protocol.ChatCompletionRequest(**kw)

    def _parser(self, req):
        return self.parser_cls(self.tokenizer, req.tools,
                               chat_template_kwargs=req.chat_template_kwargs, model_config=None)

    def whole(self, rec: dict, text: str, ids: list[int], prompt_ids: list[int]) -> dict:
        req = self.request(rec)
        p = self._parser(req)
        p.set_prompt_token_ids(prompt_ids)
        reasoning, content, calls = p.parse(text, req, enable_auto_tools=True,
                                            model_output_token_ids=ids)
        fields = self.assembly.assemble_chat_message_fields(
            req, reasoning, content, calls, enable_auto_tools=True, parser_cls=self.parser_cls)
        return {"reasoning": fields.reasoning or "", "content": fields.content,
                "tool_calls": [{"name": c.function.name, "arguments": c.function.arguments}
                               for c in fields.tool_calls]}

    def stream(self, rec: dict, chunks: list[tuple[str, list[int]]], finish: str,
               prompt_ids: list[int]) -> dict:
        req = self.request(rec)
        p = self._parser(req)
        proc = self.stream_mod.ChatStreamProcessor(req, p, enable_auto_tools=True,
                                                   parser_cls=self.parser_cls)
        reasoning, content, calls = "", None, {}
        for i, (dtext, dids) in enumerate(chunks):
            last = i + 1 == len(chunks)
            step = proc.step(dtext, dids, finish if last else None, prompt_ids)
            d = step.delta
            if d is None:
                continue
            if d.reasoning:
                reasoning += d.reasoning
            if d.content:
                content = (content or "") + d.content
            for tc in d.tool_calls or []:
                c = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                if tc.function is not None:
                    if tc.function.name:
                        c["name"] += tc.function.name
                    if tc.function.arguments:
                        c["arguments"] += tc.function.arguments
        return {"reasoning": reasoning, "content": content,
                "tool_calls": [calls[k] for k in sorted(calls)]}


def _vllm_version(root: str) -> str:
    for name in os.listdir(root):
        if name.startswith("vllm-") and name.endswith(".dist-info"):
            return name[len("vllm-"):-len(".dist-info")]
    path = os.path.join(root, "vllm", "_version.py")
    if os.path.isfile(path):
        for line in open(path, encoding="utf-8"):
            if line.startswith("__version__") or line.startswith("version ="):
                return line.split("=", 1)[1].strip().strip("'\"")
    return "unknown"
