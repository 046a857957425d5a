"""A tokenizer's own chat template: render a conversation and find its assistant turns in the text.

``ChatTemplate.render`` renders a conversation with ``transformers``' ``apply_chat_template`` and
returns the text with the character span of every assistant turn, found by rendering prefixes of
the conversation, never guessed from token counts: turn ``i`` starts where ``messages[:i]`` with
the generation prompt ends and ends where ``messages[:i+1]`` ends, less trailing whitespace (the
content and the end-of-turn tokens are in it; the newline between turns, which a model never
generates, is not). A template whose prefixes are not prefixes of the whole rendering (one that
rewrites earlier turns) makes the record a bad record. An assistant turn that opens a
conversation is context, not a target.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from thdpack._optional import require
from thdpack.data.bad_records import BadRecord

TEMPLATE_FILE = "chat_template.jinja"
CONFIG_FILE = "tokenizer_config.json"


@dataclass(frozen=True)
class RenderedChat:
    """A conversation rendered by a chat template: ``text`` and the ``[start, end)`` character
    span of each assistant turn (content and end-of-turn tokens), in order, not overlapping."""

    text: str
    spans: tuple[tuple[int, int], ...]


class ChatTemplate:
    """A Jinja chat template and the ``transformers`` tokenizer that renders it.

    The ``transformers`` tokenizer (``tokenizer``, or ``load()`` on the first render, so that
    a folder whose records are not chats never imports ``transformers``) supplies the special
    tokens (``bos_token``, ``eos_token``) the template reads; ``template`` is always the text
    rendered, so ``sha256`` identifies exactly what was applied.
    """

    def __init__(
        self, template: str, *, source: str, tokenizer: Any = None, load: Callable[[], Any] | None = None
    ) -> None:
        if (tokenizer is None) == (load is None):
            raise TypeError("pass exactly one of tokenizer= and load=")
        self.template = template
        self.source = source
        self.sha256 = hashlib.sha256(template.encode()).hexdigest()
        self._tokenizer = tokenizer
        self._load = load

    @classmethod
    def from_folder(cls, folder: str | os.PathLike[str]) -> ChatTemplate | None:
        """The template of a tokenizer folder (``chat_template.jinja`` first, as ``transformers``
        reads it, then ``tokenizer_config.json``), or None when it has none."""
        folder = Path(folder)
        template = _template_in(folder)
        if template is None:
            return None

        def load() -> Any:
            transformers = require("transformers", f"rendering the chat template of {folder}")
            # a concrete class follows no auto_map; said explicitly all the same, so nothing ever prompts
            return transformers.PreTrainedTokenizerFast.from_pretrained(
                str(folder), local_files_only=True, trust_remote_code=False
            )

        return cls(template, source=str(folder), load=load)

    @classmethod
    def from_transformers(cls, tokenizer: Any) -> ChatTemplate | None:
        """The template of a loaded ``transformers`` tokenizer, or None when it has none."""
        template = getattr(tokenizer, "chat_template", None)
        if isinstance(template, dict):  # several named templates: the default one renders chats
            template = template.get("default")
        if not isinstance(template, str):
            return None
        name = str(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__)
        return cls(template, source=name, tokenizer=tokenizer)

    def render(self, messages: Sequence[tuple[str, str]], origin: str = "record") -> RenderedChat:
        """Render ``(role, content)`` pairs; ``BadRecord`` (``chat_template_error``) when the
        template raises or rewrites earlier turns (see the module docstring).
        """
        conversation = [{"role": role, "content": content} for role, content in messages]
        text = self._apply(conversation, False, origin)
        spans = []
        for i, (role, _) in enumerate(messages):
            if role != "assistant" or i == 0:
                continue
            start = self._prefix_length(text, conversation[:i], True, origin)
            if start is None:
                start = self._prefix_length(text, conversation[:i], False, origin)
            end = self._prefix_length(text, conversation[: i + 1], False, origin)
            if start is None or end is None:
                raise BadRecord(
                    origin,
                    "chat_template_error",
                    f"the chat template of {self.source} renders messages[:{i + 1}] as something other than "
                    "the start of the whole conversation, so its assistant turn cannot be located; render "
                    "these records yourself (as text) or use chat_template='plain' (--chat-template plain)",
                )
            end = max(start, len(text[:end].rstrip()))
            spans.append((start, end))
        return RenderedChat(text, tuple(spans))

    def _prefix_length(
        self, text: str, conversation: list[dict[str, str]], generation: bool, origin: str
    ) -> int | None:
        prefix = self._apply(conversation, generation, origin)
        return len(prefix) if text.startswith(prefix) else None

    def _apply(self, conversation: list[dict[str, str]], add_generation_prompt: bool, origin: str) -> str:
        if self._tokenizer is None:
            assert self._load is not None
            self._tokenizer = self._load()
        try:
            rendered = self._tokenizer.apply_chat_template(
                conversation, chat_template=self.template, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        except ImportError:
            raise
        except Exception as err:  # a template's raise_exception("roles must alternate ..."), or a jinja error
            if isinstance(err, require("jinja2", "rendering chat templates").TemplateSyntaxError):
                # the template itself is broken: every record would fail, so no record is to blame
                raise ValueError(f"the chat template of {self.source} is not valid Jinja: {err}") from err
            raise BadRecord(
                origin, "chat_template_error", f"the chat template of {self.source} refused it: {err}"
            ) from err
        assert isinstance(rendered, str), type(rendered)
        return rendered


def _template_in(folder: Path) -> str | None:
    if (folder / TEMPLATE_FILE).is_file():
        return (folder / TEMPLATE_FILE).read_text(encoding="utf-8")
    if not (folder / CONFIG_FILE).is_file():
        return None
    try:
        config = json.loads((folder / CONFIG_FILE).read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{folder / CONFIG_FILE} is not valid JSON ({err.msg}, line {err.lineno})") from err
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    return template if isinstance(template, str) else None
