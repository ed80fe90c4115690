"""Tool calls: rendering tools into the prompt, and parsing the model's output into OpenAI ``tool_calls``.

Parsers (``--tool-call-parser``, or auto-detected from the chat template):

* ``hermes`` (Hermes / Qwen / SmolLM2-1.7B): ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``,
  one block per call;
* ``llama3_json`` (Llama 3.x): a bare JSON object ``{"name": ..., "parameters": {...}}`` (optionally after
  ``<|python_tag|>``), several separated by ``;``.

Everything here is pure: text in, data out. :class:`StreamParser` turns streamed text deltas into OpenAI
``delta.tool_calls`` fragments (name first, then argument fragments) and plain content.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

PARSERS = ("hermes", "llama3_json")


@dataclass(frozen=True)
class ToolParser:
    name: str
    start: str  # text that opens a call ("" = the output is a bare JSON call)
    end: str
    args_key: str  # "arguments" (Hermes) or "parameters" (Llama 3)

    def lark(self, json_rule: str, many: str) -> str:
        """A Lark grammar for one (``many`` "") or more ("+") calls whose JSON body is ``json_rule``."""
        if self.start:
            call = f'"{_lark_escape(self.start)}\\n" call_json "\\n{_lark_escape(self.end)}"'
            body = f"call{many}" if not many else 'call ("\\n" call)*'
        else:
            call = "call_json"
            body = 'call ("; " call)*' if many else "call"
        return f"start: {body}\ncall: {call}\ncall_json: {json_rule}\n"

    def parse(self, text: str) -> tuple[str, list[dict]]:
        """(content outside the calls, [{"name", "arguments": str(JSON)}]); text that is not a well-formed call
        stays content."""
        if self.start:
            calls, content, pos = [], [], 0
            for m in re.finditer(re.escape(self.start) + r"\s*(.*?)\s*" + re.escape(self.end), text, re.S):
                call = _call(m.group(1), self.args_key)
                if call is None:
                    continue
                content.append(text[pos: m.start()])
                pos = m.end()
                calls.append(call)
            content.append(text[pos:])
            return "".join(content).strip() if calls else text, calls
        body = text.strip().removeprefix("<|python_tag|>").strip()
        calls = [_call(part, self.args_key) for part in body.split(";")] if body.startswith("{") else [None]
        if not calls or any(c is None for c in calls):
            return text, []
        return "", calls


def _lark_escape(s: str) -> str:
    return s.replace("\\", "\\\\").replace('"', '\\"')


def _call(raw: str, args_key: str) -> dict | None:
    try:
        obj = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    return {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}


_PARSERS = {"hermes": ToolParser("hermes", "<tool_call>", "</tool_call>", "arguments"),
            "llama3_json": ToolParser("llama3_json", "", "", "parameters")}


def parser_for(name: str) -> ToolParser:
    if name not in _PARSERS:
        raise ValueError(f"tool-call parser {name!r} is unknown; accepted: {', '.join(PARSERS)} or auto")
    return _PARSERS[name]


def detect_parser(chat_template: str | None) -> str:
    """``auto``: Llama 3 templates mention ``<|python_tag|>``/``ipython``; everything else speaks Hermes."""
    t = chat_template or ""
    if "<|python_tag|>" in t or "ipython" in t:
        return "llama3_json"
    return "hermes"


def openai_tool_calls(calls: list[dict]) -> list[dict]:
    return [{"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
             "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls]


# ---- prompt side ------------------------------------------------------------------------------

def tools_system_prompt(tools: list[dict], parser: str) -> str:
    """The tool instructions for templates that do not render ``tools`` themselves (Hermes' wording)."""
    p = parser_for(parser)
    sigs = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    if p.start:
        how = (f"For each function call, return a JSON object with the function name and arguments within "
               f"{p.start}{p.end} tags:\n{p.start}\n{{\"name\": <function-name>, \"{p.args_key}\": <args-json-object>}}\n{p.end}")
    else:
        how = f"To call a function, answer only with JSON: {{\"name\": <function-name>, \"{p.args_key}\": <args>}}"
    return ("You are a function calling AI model. You may call one or more functions to assist with the user query. "
            f"Here are the available tools:\n<tools>\n{sigs}\n</tools>\n{how}")


def render_messages(messages: list[dict], tools: list[dict] | None, parser: str, template_has_tools: bool) -> list[dict]:
    """Messages for a template without tool support: tools go into the system message, assistant tool calls
    become the parser's text, tool results become ``<tool_response>`` user turns (Hermes convention)."""
    if template_has_tools:
        return messages
    p = parser_for(parser)
    out: list[dict] = []
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        if role == "assistant" and m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                fn = c.get("function", {})
                try:
                    args = json.loads(fn.get("arguments") or "{}")
                except ValueError:
                    args = fn.get("arguments")
                body = json.dumps({"name": fn.get("name"), p.args_key: args}, ensure_ascii=False)
                calls.append(f"{p.start}\n{body}\n{p.end}" if p.start else body)
            content = (content + "\n" if content else "") + ("\n" if p.start else "; ").join(calls)
            out.append({"role": "assistant", "content": content})
        elif role == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"})
        else:
            out.append({"role": role, "content": content})
    if tools:
        sys_text = tools_system_prompt(tools, parser)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + sys_text}
        else:
            out.insert(0, {"role": "system", "content": sys_text})
    return out


# ---- streaming --------------------------------------------------------------------------------

@dataclass
class StreamParser:
    """Streamed text -> OpenAI chat deltas: plain ``content`` until a call opens, then per call one delta with
    ``id``/``name`` and ``arguments`` fragments as the call's JSON completes. Text that might be the start of
    a call tag is held back until it is decided."""

    parser: ToolParser
    buf: str = ""
    sent_content: int = 0
    calls_sent: int = 0
    in_call: bool = False
    ids: list[str] = field(default_factory=list)

    def feed(self, delta: str, final: bool = False) -> list[dict]:
        self.buf += delta
        out: list[dict] = []
        if not self.parser.start:  # bare JSON: decided at the end
            if final:
                content, calls = self.parser.parse(self.buf)
                if calls:
                    out += self._call_deltas(calls)
                elif self.buf:
                    out.append({"content": self.buf})
            return out
        while True:
            if not self.in_call:
                i = self.buf.find(self.parser.start, self.sent_content)
                if i < 0:
                    keep = 0 if final else _partial_suffix(self.buf, self.parser.start)
                    upto = len(self.buf) - keep
                    if upto > self.sent_content:
                        out.append({"content": self.buf[self.sent_content: upto]})
                        self.sent_content = upto
                    return out
                if i > self.sent_content:
                    text = self.buf[self.sent_content: i]
                    if text.strip():
                        out.append({"content": text})
                self.sent_content = i
                self.in_call = True
            j = self.buf.find(self.parser.end, self.sent_content)
            if j < 0:
                if final:  # an unterminated call: pass the text on as content
                    out.append({"content": self.buf[self.sent_content:]})
                    self.sent_content = len(self.buf)
                return out
            block = self.buf[self.sent_content: j + len(self.parser.end)]
            _, calls = self.parser.parse(block)
            out += self._call_deltas(calls) if calls else [{"content": block}]
            self.sent_content = j + len(self.parser.end)
            self.in_call = False

    def _call_deltas(self, calls: list[dict]) -> list[dict]:
        out = []
        for c in calls:
            cid = "call_" + uuid.uuid4().hex[:24]
            self.ids.append(cid)
            idx = self.calls_sent
            self.calls_sent += 1
            out.append({"tool_calls": [{"index": idx, "id": cid, "type": "function",
                                        "function": {"name": c["name"], "arguments": ""}}]})
            args = c["arguments"]
            for k in range(0, len(args), 16):  # argument fragments, as OpenAI streams them
                out.append({"tool_calls": [{"index": idx, "function": {"arguments": args[k: k + 16]}}]})
        return out


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
