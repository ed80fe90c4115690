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

    def parse_cut(self, text: str) -> tuple[str, list[dict]]:
        """:meth:`parse` of an output that ``max_tokens`` cut off: the complete calls, then the unfinished last
        one as a partial call (its name, its arguments so far) once its name is complete. The unfinished call's
        markup never stays content (dropped when even its name is cut)."""
        if self.start:
            i = text.rfind(self.start)
            if i < 0 or self.end in text[i:]:
                return self.parse(text)
            content, calls = self.parse(text[:i])
            part = _partial_call(text[i + len(self.start):])
            return content.strip(), calls + ([part] if part else [])
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return self.parse(text)
        done, sep, last = body.rpartition(";")
        calls = [_call(p, self.args_key) for p in done.split(";")] if sep else []
        if any(c is None for c in calls):
            return self.parse(text)
        part = _partial_call(last)
        return "", calls + ([part] if part else [])


def _lark_escape(s: str) -> str:
    return s.replace("\\", "\\\\").replace('"', '\\"')


# the head of a call's JSON: its complete name, then (once written) the key of its arguments
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_ARGS_KEY = re.compile(r'\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\S)')  # (?=\S): the value has begun


def _call_head(raw: str) -> tuple[str, int | None] | None:
    """(name, index in ``raw`` where the arguments' value starts, None until written) of a call's JSON that
    starts with its complete name (the order a forced call's grammar writes), else None."""
    m = _HEAD.match(raw)
    if m is None:
        return None
    try:
        name = json.loads(f'"{m.group(1)}"')
    except ValueError:
        return None
    k = _ARGS_KEY.match(raw, m.end())
    return name, (k.end() if k else None)


def _json_value_end(s: str) -> int | None:
    """Length of the JSON value at the start of ``s`` (a scalar ends at its first delimiter); None while it is
    unfinished. Only brackets and strings are tracked: the text is assumed to be a JSON value's prefix."""
    depth, in_str, esc = 0, False, False
    for j, c in enumerate(s):
        if in_str:
            if esc:
                esc = False
            elif c == "\\":
                esc = True
            elif c == '"':
                in_str = False
                if depth == 0:
                    return j + 1
        elif c == '"':
            in_str = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth <= 0:
                return j + 1 if depth == 0 else j
        elif depth == 0 and c in ", \t\r\n" and j > 0:
            return j
    return None


def _partial_call(raw: str) -> dict | None:
    """An unfinished call's JSON -> {"name", "arguments": the arguments' text so far}, or None before its name
    is complete."""
    head = _call_head(raw)
    if head is None:
        return None
    name, at = head
    if at is None:
        return {"name": name, "arguments": ""}
    args = raw[at:]
    end = _json_value_end(args)
    return {"name": name, "arguments": args if end is None else args[:end]}


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
    ``id``/``name`` as soon as its name is complete and ``arguments`` fragments as they are generated (a call
    whose JSON does not start with its name is sent once it closes). Text that might be the start of a call tag
    is held back until it is decided."""

    parser: ToolParser
    buf: str = ""
    sent_content: int = 0
    calls_sent: int = 0
    in_call: bool = False
    ids: list[str] = field(default_factory=list)
    named: bool = False  # the open call's id and name are sent
    args_at: int | None = None  # buf index where the open call's arguments start (None: not yet written)
    args_sent: int = 0  # buf index up to which the open call's arguments are sent

    def feed(self, delta: str, final: bool = False, cut: bool = False) -> list[dict]:
        """The deltas ``delta`` completes; ``final``: the output ended (``cut``: by max_tokens, so an unfinished
        call is a partial call and its markup is never content)."""
        self.buf += delta
        out: list[dict] = []
        if not self.parser.start:  # bare JSON: decided at the end
            if final:
                content, calls = (self.parser.parse_cut if cut else self.parser.parse)(self.buf)
                if calls:
                    out += self._call_deltas(calls)
                elif content:
                    out.append({"content": content})
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
                self.in_call, self.named, self.args_at = True, False, None
            body_at = self.sent_content + len(self.parser.start)
            j = self.buf.find(self.parser.end, body_at)
            if j < 0:
                out += self._open_call_deltas(body_at, len(self.buf))
                if final:
                    if not self.named and not cut:  # an unterminated call: pass the text on as content
                        out.append({"content": self.buf[self.sent_content:]})
                    self.sent_content = len(self.buf)
                return out
            if self.named:  # the rest of its arguments
                out += self._open_call_deltas(body_at, j)
            else:
                block = self.buf[self.sent_content: j + len(self.parser.end)]
                _, calls = self.parser.parse(block)
                out += self._call_deltas(calls) if calls else [{"content": block}]
            self.sent_content = j + len(self.parser.end)
            self.in_call = False

    def _open_call_deltas(self, body_at: int, upto: int) -> list[dict]:
        """Deltas of the open call's JSON ``buf[body_at:upto]`` not sent yet: its id and name once the name is
        complete, then its arguments' new text (up to the end of their JSON value)."""
        head = _call_head(self.buf[body_at:upto])
        if head is None:
            return []
        out = []
        if not self.named:
            cid = "call_" + uuid.uuid4().hex[:24]
            self.ids.append(cid)
            self.calls_sent += 1
            self.named = True
            out.append({"tool_calls": [{"index": self.calls_sent - 1, "id": cid, "type": "function",
                                        "function": {"name": head[0], "arguments": ""}}]})
        if self.args_at is None and head[1] is not None:
            self.args_at = self.args_sent = body_at + head[1]
        if self.args_at is None:
            return out
        end = _json_value_end(self.buf[self.args_at: upto])
        stop = upto if end is None else self.args_at + end
        if stop > self.args_sent:
            out.append({"tool_calls": [{"index": self.calls_sent - 1,
                                        "function": {"arguments": self.buf[self.args_sent: stop]}}]})
            self.args_sent = stop
        return out

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
