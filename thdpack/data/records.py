"""Record shapes and the prompt templates that mark which text is a training target.

A record's kind (``RecordKind``: ``text``, ``alpaca``, ``chat``) decides its segments, runs of
prompt (masked out of the loss) or target text, and where the EOS goes; ``thdpack.data.encode``
turns them into tokens and labels. Alpaca records use Stanford Alpaca's published prompt; chats
use the tokenizer's own chat template when it has one (``thdpack.data.chat_template``), else the
plain ``### User:`` / ``### Assistant:`` template here, where each assistant reply and its EOS
are the targets. The kinds and templates: docs/guides/hugging-face.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

from thdpack.data.bad_records import BadRecord

RecordKind = Literal["text", "alpaca", "chat"]
RECORD_KINDS: tuple[str, ...] = get_args(RecordKind)

ALPACA_PROMPT_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
ALPACA_PROMPT_NO_INPUT = (
    "Below is an instruction that describes a task. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n"
)
CHAT_HEADERS = {"system": "### System:\n", "user": "### User:\n", "assistant": "### Assistant:\n"}
CHAT_SEPARATOR = "\n\n"
_SHAREGPT_ROLES = {"system": "system", "human": "user", "gpt": "assistant"}


@dataclass(frozen=True)
class Segment:
    """A run of text and whether its tokens are training targets."""

    text: str
    target: bool
    eos: bool = False
    """Append the EOS token after the text (a target exactly when ``target`` is)."""


CHAT_FIELDS = ("messages", "conversations")
"""The fields that hold a chat's messages (OpenAI style, ShareGPT)."""
_DETECTION_ORDER: tuple[RecordKind, ...] = ("chat", "alpaca", "text")
"""A record with the fields of several kinds is the first of them (a chat may carry a 'text' too)."""


def has_kind_fields(record: Mapping[str, Any], kind: RecordKind, text_key: str = "text") -> bool:
    """True when ``record`` has the fields of ``kind`` (their values are checked later).

    >>> has_kind_fields({"messages": []}, "chat"), has_kind_fields({"messages": []}, "text")
    (True, False)
    """
    present = [name in record for name in _kind_fields(kind, text_key)]
    return any(present) if kind == "chat" else all(present)


def _kind_fields(kind: RecordKind, text_key: str) -> tuple[str, ...]:
    return {"chat": CHAT_FIELDS, "alpaca": ("instruction", "output")}.get(kind, (text_key,))


def detect_kind(record: Mapping[str, Any], text_key: str = "text", origin: str = "record") -> RecordKind:
    """The kind of a record from its keys; ``BadRecord`` (a ``ValueError``) naming ``origin`` and the
    keys otherwise.

    >>> detect_kind({"instruction": "Add 2 and 3.", "input": "", "output": "5"})
    'alpaca'
    >>> detect_kind({"messages": []}), detect_kind({"text": "hi"})
    ('chat', 'text')
    """
    for kind in _DETECTION_ORDER:
        if has_kind_fields(record, kind, text_key):
            return kind
    raise BadRecord(
        origin,
        "unknown_kind",
        f"has keys {sorted(record)}; expected {text_key!r} (text), 'instruction' + 'output' (alpaca) or "
        "'messages' / 'conversations' (chat); set text_key (--text-key) to the field holding the text",
    )


def check_kind(record: Mapping[str, Any], kind: RecordKind, text_key: str = "text", origin: str = "record") -> None:
    """``BadRecord`` (``wrong_kind``) when a record set to be of ``kind`` lacks its fields but has
    another kind's: every record of the file is then likely of that kind, so the message names
    the setting to change, not the skip policy (skipping would drop them all).

    >>> check_kind({"messages": [{"role": "user", "content": "hi"}]}, "text", origin="chats.jsonl line 1")
    Traceback (most recent call last):
    ...
    thdpack.data.bad_records.BadRecord: chats.jsonl line 1: is a chat record (its keys: ['messages']), not text ...
    """
    if any(name in record for name in _kind_fields(kind, text_key)):
        return  # a field of its kind is there: record_segments names what else is missing
    found = [other for other in _DETECTION_ORDER if has_kind_fields(record, other, text_key)]
    if found:
        raise BadRecord(
            origin,
            "wrong_kind",
            f"is {'an' if found[0] == 'alpaca' else 'a'} {found[0]} record (its keys: {sorted(record)}), not {kind} "
            f"as kind={kind!r} says; set kind={found[0]!r} or 'auto' (--kind; trainer: data.kind={found[0]}, or "
            f"data.kind=auto, as the data=jsonl preset has)",
        )


def record_segments(
    record: Mapping[str, Any],
    kind: RecordKind,
    *,
    text_key: str = "text",
    append_eos: bool = True,
    mask_prompt: bool = True,
    origin: str = "record",
) -> list[Segment]:
    """Split a record into prompt and target segments (see the module docstring for the templates).

    ``mask_prompt=False`` makes every segment a target (training on the prompt too). A record that
    does not fit its kind raises ``BadRecord`` (a ``ValueError``) naming ``origin`` and the reason.

    >>> record_segments({"instruction": "Say hi.", "output": "Hi!"}, "alpaca")[1]
    Segment(text='Hi!', target=True, eos=True)
    >>> chat = {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]}
    >>> [(s.text, s.target) for s in record_segments(chat, "chat")]
    [('### User:\\n2+2?\\n\\n### Assistant:\\n', False), ('4', True)]
    """
    if kind == "text":
        segments = [Segment(_string(record, text_key, origin), target=True, eos=append_eos)]
    elif kind == "alpaca":
        segments = _alpaca_segments(record, append_eos, origin)
    elif kind == "chat":
        segments = _chat_segments(record, append_eos, origin)
    else:
        raise ValueError(f"unknown record kind {kind!r}; use one of {list(RECORD_KINDS)}")
    if not mask_prompt:
        segments = [Segment(s.text, True, s.eos) for s in segments]
    return segments


def text_chars(value: Any) -> int:
    """Characters of text in a record (all string values, nested ones included)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, Mapping):
        return sum(text_chars(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(text_chars(v) for v in value)
    return 0


def _string(record: Mapping[str, Any], key: str, origin: str, *, optional: bool = False) -> str:
    if key not in record:
        if optional:
            return ""
        raise BadRecord(origin, "missing_field", f"has no field {key!r} (its keys: {sorted(record)})")
    value = record[key]
    if value is None and optional:
        return ""
    if not isinstance(value, str):
        raise BadRecord(origin, "wrong_type", f"field {key!r} must be a string, got {type(value).__name__}")
    return value


def _alpaca_segments(record: Mapping[str, Any], append_eos: bool, origin: str) -> list[Segment]:
    instruction = _string(record, "instruction", origin)
    context = _string(record, "input", origin, optional=True)
    output = _string(record, "output", origin)
    if context.strip():
        prompt = ALPACA_PROMPT_WITH_INPUT.format(instruction=instruction, input=context)
    else:
        prompt = ALPACA_PROMPT_NO_INPUT.format(instruction=instruction)
    return [Segment(prompt, target=False), Segment(output, target=True, eos=append_eos)]


def chat_messages(record: Mapping[str, Any], origin: str = "record") -> list[tuple[str, str]]:
    """``(role, content)`` pairs from OpenAI-style ``messages`` or ShareGPT ``conversations``; roles
    are ``system`` / ``user`` / ``assistant`` (ShareGPT's ``human`` / ``gpt`` renamed).

    Raises ``BadRecord`` for a conversation that is empty, has no assistant turn, an unknown role
    or a message that is not ``{role: str, content: str}``.

    >>> chat_messages({"conversations": [{"from": "human", "value": "2+2?"}, {"from": "gpt", "value": "4"}]})
    [('user', '2+2?'), ('assistant', '4')]
    >>> chat_messages({"id": "x", "conversations": []}, "chats.jsonl line 2")
    Traceback (most recent call last):
    ...
    thdpack.data.bad_records.BadRecord: chats.jsonl line 2: 'conversations' is empty: no messages to train on
    """
    sharegpt = "messages" not in record
    field_name = "conversations" if sharegpt else "messages"
    if field_name not in record:
        keys = sorted(record)
        raise BadRecord(origin, "missing_field", f"has no 'messages' or 'conversations' field (its keys: {keys})")
    messages = record[field_name]
    if not isinstance(messages, list):
        raise BadRecord(origin, "wrong_type", f"{field_name!r} must be a list, got {type(messages).__name__}")
    if not messages:
        raise BadRecord(origin, "empty_conversation", f"{field_name!r} is empty: no messages to train on")
    role_key, content_key = ("from", "value") if sharegpt else ("role", "content")
    valid = list(_SHAREGPT_ROLES) if sharegpt else list(CHAT_HEADERS)
    pairs = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise BadRecord(origin, "wrong_type", f"message {i} must be a mapping, got {type(message).__name__}")
        role = message.get(role_key)
        if role not in valid:
            raise BadRecord(origin, "unknown_role", f"message {i} has {role_key}={role!r}; use one of {valid}")
        content = message.get(content_key)
        if not isinstance(content, str):
            found = "no field" if content_key not in message else f"a {type(content).__name__} in field"
            raise BadRecord(
                origin,
                "missing_field" if content_key not in message else "wrong_type",
                f"message {i} has {found} {content_key!r}; it must be a string (its keys: {sorted(message)})",
            )
        pairs.append((_SHAREGPT_ROLES[role] if sharegpt else role, content))
    if not any(content.strip() for _, content in pairs):
        raise BadRecord(origin, "empty_conversation", f"{field_name!r} holds no text: no messages to train on")
    if not any(role == "assistant" for role, _ in pairs):
        roles = [message[role_key] for message in messages]
        assistant = "gpt" if sharegpt else "assistant"
        raise BadRecord(origin, "no_assistant_turn", f"has no {assistant!r} message to train on (its roles: {roles})")
    return pairs


def _chat_segments(record: Mapping[str, Any], append_eos: bool, origin: str) -> list[Segment]:
    segments: list[Segment] = []
    prompt = ""  # masked text waiting for the next target
    for i, (role, content) in enumerate(chat_messages(record, origin)):
        prompt += (CHAT_SEPARATOR if i else "") + CHAT_HEADERS[role]
        if role == "assistant":
            segments.append(Segment(prompt, target=False))
            segments.append(Segment(content, target=True, eos=append_eos))
            prompt = ""
        else:
            prompt += content
    if prompt:
        segments.append(Segment(prompt, target=False))
    return segments
