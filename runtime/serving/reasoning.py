"""``--reasoning-parser``: splits a reasoning model's ``<think>...</think>`` text from its answer.

The chat reply then carries the thinking in ``message.reasoning_content`` (streamed as
``delta.reasoning_content``) and the answer in ``content``, as vLLM and DeepSeek's API do.

- ``deepseek_r1``: the output starts inside the reasoning (DeepSeek-R1's template opens
  ``<think>`` in the prompt); an opening tag at the start is skipped; the reasoning ends at
  ``</think>`` (without one, all of it is reasoning: thinking cut by ``max_tokens``).
- ``qwen3``: the output is reasoning when it opens with ``<think>``, or when the prompt itself
  ends with ``<think>`` (thinking-only templates); otherwise it is all content (a template with
  ``enable_thinking=False`` closes the block in the prompt).

One incremental parser serves both the whole reply and the stream: ``feed`` returns the pieces
that are safe to emit (a possible partial tag waits for the next text), ``flush`` the rest.
Whitespace right after ``<think>`` and ``</think>`` is dropped.
"""

from __future__ import annotations

START, END = "<think>", "</think>"
PARSERS = ("deepseek_r1", "qwen3")


def starts_in_reasoning(parser: str, prompt_tail: str) -> bool:
    """Whether the output begins inside the reasoning, before any tag is seen."""
    if parser == "deepseek_r1":
        return True
    return prompt_tail.rstrip().endswith(START)


def _partial(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that starts ``tag`` (held back)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ReasoningSplitter:
    """Routes text to ``"reasoning"`` or ``"content"`` (see the module docstring)."""

    def __init__(self, in_reasoning: bool) -> None:
        self.in_reasoning = in_reasoning
        # start -> [after_start ->] reasoning -> after_end -> content, or start -> content
        self.state = "start"
        self.pending = ""

    def feed(self, text: str) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        self.pending += text
        while self.pending:
            if self.state == "start":
                head = self.pending.lstrip()
                if head.startswith(START):
                    self.pending, self.state = head[len(START) :], "after_start"
                elif START.startswith(head):  # whitespace, or a partial opening tag: wait
                    break
                else:
                    self.state = "reasoning" if self.in_reasoning else "content"
            elif self.state == "reasoning":
                at = self.pending.find(END)
                if at >= 0:
                    out.append(("reasoning", self.pending[:at]))
                    self.pending, self.state = self.pending[at + len(END) :], "after_end"
                    continue
                hold = _partial(self.pending, END)
                cut = len(self.pending) - hold
                out.append(("reasoning", self.pending[:cut]))
                self.pending = self.pending[cut:]
                break
            elif self.state in ("after_start", "after_end"):  # drop the whitespace after a tag
                self.pending = self.pending.lstrip()
                if self.pending:
                    self.state = "reasoning" if self.state == "after_start" else "content"
            else:
                out.append(("content", self.pending))
                self.pending = ""
        return [(kind, piece) for kind, piece in out if piece]

    def flush(self) -> list[tuple[str, str]]:
        text, self.pending = self.pending, ""
        if not text or self.state in ("after_start", "after_end"):
            return []
        if self.state == "start":  # whitespace or a partial opening tag, nothing else
            kind = "reasoning" if self.in_reasoning else "content"
            return [(kind, text)] if text.strip() else []
        return [(self.state, text)]

    def split(self, text: str) -> tuple[str, str]:
        """(reasoning, content) of a whole reply."""
        parts = {"reasoning": "", "content": ""}
        for kind, piece in self.feed(text) + self.flush():
            parts[kind] += piece
        return parts["reasoning"], parts["content"]
