"""How many tokens a request's prompt takes: what admission reserves against quotas and
budgets, so the reservation must never be below what the engine will bill.

With the served model's tokenizer at hand (its folder: MODEL_PATH, or the bundled model
once prepared), prompts are counted with the fast `tokenizers` library, and the chat
template's own tokens (role markers, a default system prompt) are measured once by
rendering the model's template: `bound` is that count plus a small margin for merges
across a message's edges. Without it, `bound` falls back to the prompt's UTF-8 bytes —
a byte-level BPE or SentencePiece token covers at least one byte, so bytes can never
under-count — plus a generous template allowance.

What provably cannot fit is refused before anything is tokenized: with the tokenizer at
hand, no token covers more bytes than its vocabulary's longest, so a prompt of B bytes is
at least B / longest tokens (`floor_quick`). That floor is loose (the bundled model's
longest token is 162 bytes: 332,000 bytes of prompt before it alone refuses a 2,048-token
context). A text past eight characters for each token that could fit is then judged by a
prefix that long (`floor_of_prefix`): a tokenizer splits words before it merges, so the
prefix's tokens are the whole's first ones, and a prefix that alone passes the context
refuses the prompt for a fraction of its tokenizing. What passes both but might not fit is
tokenized (`measure`: the count's floor and bound from one tokenization, 0.1-0.2 s for
200,000 characters) in a small pool of threads of its own (COUNT_THREADS), so a tenant's
flood of long prompts waits there, not in the default pool that file writes and every
other thread hop of the process share.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import unicodedata
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from tierq.core.settings import Settings

log = logging.getLogger(__name__)

# Without a tokenizer: tokens a chat template may add, in all and per message.
BYTES_TEMPLATE_TOKENS = 64
BYTES_MESSAGE_TOKENS = 8
# With one: what tokenizing a message's content alone may miss at its edges.
EDGE_MARGIN = 2
# Prompts shorter than this are counted on the event loop (a thread costs more).
INLINE_CHARS = 4096
# A text longer than this many characters for each token that could fit is first judged
# by a prefix that long (`floor_of_prefix`): the bundled model's tokens average 4-7
# characters of prose, so such a prefix alone usually passes the context; the word break
# ending it is looked for in the last PREFIX_SEARCH_CHARS characters.
PREFIX_CHARS_PER_TOKEN = 8
PREFIX_SEARCH_CHARS = 256
# Threads that count long prompts (one API or Celery process): the tokenizer lets go of the
# GIL, so two count at once on two cores; more would only queue for the CPU.
COUNT_THREADS = 2
_COUNTING = ThreadPoolExecutor(max_workers=COUNT_THREADS, thread_name_prefix="tierq-count")


def _text(content: Any) -> str:
    return content if isinstance(content, str) else json.dumps(content)


def _texts(messages: Sequence[dict[str, Any]] | None, prompt: str | None) -> list[str]:
    """The prompt, or each message's content: the texts a tokenizer sees apart from the
    template."""
    if prompt is not None:
        return [prompt]
    return [_text(m.get("content", "")) for m in messages or []]


def _bytes(text: str) -> int:
    """UTF-8 bytes of the text, or of its NFKC form if longer (a tokenizer that normalises
    may see more bytes than were sent: U+FDFA becomes 33)."""
    raw = len(text.encode())
    if text.isascii():
        return raw
    return max(raw, len(unicodedata.normalize("NFKC", text).encode()))


def _fewest_bytes(text: str) -> int:
    """The fewest UTF-8 bytes a tokenizer may see of the text: its own, or its NFKC form's
    if shorter (normalisation may compose characters)."""
    raw = len(text.encode())
    if text.isascii():
        return raw
    return min(raw, len(unicodedata.normalize("NFKC", text).encode()))


class PromptCounter:
    def __init__(
        self, tokenizer: Any = None, base: int = 0, per_message: int = 0, longest: int = 0
    ) -> None:
        self.tokenizer = tokenizer
        # The model's vocabulary size (config.json's vocab_size, what the engine checks
        # token ids against), where the folder says it; else the tokenizer's.
        self.model_vocabulary: int | None = None
        self.base = base  # template tokens of a one-message conversation
        self.per_message = per_message  # template tokens each further message adds
        # The most bytes one token of the vocabulary stands for (0: unknown, no floor).
        self.longest = longest

    @property
    def exact(self) -> bool:
        return self.tokenizer is not None

    def vocabulary_size(self) -> int | None:
        """How many token ids the model takes (the engine refuses a logit_bias past them):
        its config's vocab_size, else the tokenizer's (added tokens too); None without
        either."""
        if self.model_vocabulary:
            return self.model_vocabulary
        return None if self.tokenizer is None else int(self.tokenizer.get_vocab_size())

    def _tokens(self, text: str) -> int:
        return self._tokens_many([text])[0]

    def _tokens_many(self, texts: list[str]) -> list[int]:
        # encode_batch lets go of the GIL: run in a thread, a long prompt does not stall
        # the event loop (encode holds it for the whole prompt, long for the longest).
        found = self.tokenizer.encode_batch(texts, add_special_tokens=False)
        return [len(e.ids) for e in found]

    def count(self, messages: Sequence[dict[str, Any]] | None, prompt: str | None) -> int:
        """The prompt's tokens as the engine counts them (the tokenizer's, or a stand-in of
        about four characters a token where there is none)."""
        if self.tokenizer is None:
            if prompt is not None:
                return max(1, len(prompt) // 4)
            return (
                sum(4 + max(1, len(_text(m.get("content", ""))) // 4) for m in messages or []) + 3
            )
        if prompt is not None:
            return max(1, self._tokens(prompt))
        contents = self._tokens_many([_text(m.get("content", "")) for m in messages or []])
        return self.base + self.per_message * max(0, len(contents) - 1) + sum(contents)

    def floor_quick(self, messages: Sequence[dict[str, Any]] | None, prompt: str | None) -> int:
        """At most as many tokens as the engine will count for this prompt, from its bytes
        alone (no tokenizing): 0 without a tokenizer, whose longest token is unknown."""
        if self.longest <= 0:
            return 0
        return sum(_fewest_bytes(t) for t in _texts(messages, prompt)) // self.longest

    def measure(
        self, messages: Sequence[dict[str, Any]] | None, prompt: str | None
    ) -> tuple[int, int]:
        """(floor, bound): at most and at least as many tokens as the engine will count,
        from one tokenization (the floor is 0 without a tokenizer)."""
        if self.tokenizer is None:
            return 0, self.bound(messages, prompt)
        if prompt is not None:
            counted = self._tokens(prompt) if prompt else 0
            return counted, max(1, counted) + 2  # a BOS and an EOS the engine may add
        contents = self._tokens_many([_text(m.get("content", "")) for m in messages or []])
        template = self.base + self.per_message * max(0, len(contents) - 1)
        edges = EDGE_MARGIN * (2 * len(contents) + 1)
        # The floor leaves the template out (its tokens differ by role): contents only.
        return max(0, sum(contents) - edges), template + sum(contents) + edges

    def bound(self, messages: Sequence[dict[str, Any]] | None, prompt: str | None) -> int:
        """At least as many tokens as the engine will count for this prompt."""
        if self.tokenizer is None:
            if prompt is not None:
                return _bytes(prompt) + 2
            return BYTES_TEMPLATE_TOKENS + sum(
                _bytes(_text(m.get("content", "")))
                + _bytes(str(m.get("role", "")))
                + BYTES_MESSAGE_TOKENS
                for m in messages or []
            )
        if prompt is not None:
            return self.count(None, prompt) + 2  # a BOS and an EOS the engine may add
        return self.count(messages, None) + EDGE_MARGIN * (2 * len(messages or []) + 1)

    def reserve(
        self, messages: Sequence[dict[str, Any]] | None, prompt: str | None, max_tokens: int
    ) -> int:
        """What a job reserves: its prompt's bound plus every token it may generate."""
        return self.bound(messages, prompt) + max_tokens

    def floor_of_prefix(
        self, messages: Sequence[dict[str, Any]] | None, prompt: str | None, room: int
    ) -> int:
        """At most as many tokens as the engine will count for this prompt, from the
        tokens of a prefix of its longest text only: 0 unless that text is longer than
        PREFIX_CHARS_PER_TOKEN characters for each of the `room` tokens that could fit,
        when a prefix that long is tokenized (a prompt far past the context is refused
        for the price of its first part; the bound is then never needed).

        The prefix ends with a word, where a space (U+0020) follows it: a tokenizer splits
        text into words before it merges (byte-level BPE's pattern, SentencePiece's
        spaces), so each of the prefix's tokens is one of the whole text's; EDGE_MARGIN
        covers a merge or an added token across the cut. Without a word break near the
        cut, 0."""
        if self.tokenizer is None or room <= 0:
            return 0
        longest = max(_texts(messages, prompt), key=len, default="")
        cut = room * PREFIX_CHARS_PER_TOKEN
        if len(longest) <= cut:
            return 0
        stop = max(1, cut - PREFIX_SEARCH_CHARS)
        while cut >= stop and not (longest[cut] == " " and not longest[cut - 1].isspace()):
            cut -= 1
        if cut < stop:
            return 0
        return max(0, self._tokens(longest[:cut]) - EDGE_MARGIN)

    async def floor_of_prefix_off_loop(
        self, messages: Sequence[dict[str, Any]] | None, prompt: str | None, room: int
    ) -> int:
        """`floor_of_prefix` in the counting threads where it has a text to tokenize (0 at
        once where it has none)."""
        if self.tokenizer is None or room <= 0:
            return 0
        if max(map(len, _texts(messages, prompt)), default=0) <= room * PREFIX_CHARS_PER_TOKEN:
            return 0
        if room * PREFIX_CHARS_PER_TOKEN < INLINE_CHARS:  # a short prefix: no thread hop
            return self.floor_of_prefix(messages, prompt, room)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(_COUNTING, self.floor_of_prefix, messages, prompt, room)

    async def measure_off_loop(
        self, messages: Sequence[dict[str, Any]] | None, prompt: str | None
    ) -> tuple[int, int]:
        """`measure`, in a thread when the prompt is long (the event loop keeps serving)."""
        size = len(prompt or "") + sum(len(_text(m.get("content", ""))) for m in messages or [])
        if self.tokenizer is None or size < INLINE_CHARS:
            return self.measure(messages, prompt)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(_COUNTING, self.measure, messages, prompt)

    @classmethod
    def from_folder(cls, folder: Path) -> PromptCounter:
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        # A vocabulary entry's UTF-8 length is at least the bytes it stands for (byte-level
        # BPE writes a byte as one character of up to two bytes; SentencePiece's space
        # marker is three bytes for one): never below, so the floor never over-counts.
        longest = max((len(t.encode()) for t in tokenizer.get_vocab()), default=0)
        counter = cls(tokenizer, longest=longest)
        with contextlib.suppress(OSError, ValueError, TypeError):
            model_config = json.loads((folder / "config.json").read_text())
            text_config = model_config.get("text_config") or {}
            vocabulary = model_config.get("vocab_size") or text_config.get("vocab_size")
            counter.model_vocabulary = int(vocabulary) if vocabulary else None
        config_path = folder / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        template = config.get("chat_template")
        if (folder / "chat_template.jinja").is_file():  # where newer transformers save it
            template = (folder / "chat_template.jinja").read_text()
        if isinstance(template, str):
            counter.base, counter.per_message = _template_overhead(counter, template, config)
        else:  # no template: the engine's default framing is short; stay generous
            counter.base, counter.per_message = BYTES_TEMPLATE_TOKENS, BYTES_MESSAGE_TOKENS
        return counter


def _template_overhead(
    counter: PromptCounter, template: str, config: dict[str, Any]
) -> tuple[int, int]:
    """(tokens of a one-message conversation with empty content, the most a further
    message of any role adds), measured by rendering the model's own template."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def special(name: str) -> str:
        value = config.get(name) or ""
        return str(value.get("content", "")) if isinstance(value, dict) else str(value)

    def raise_exception(message: str) -> None:
        raise ValueError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    compiled = env.from_string(template)

    def tokens(messages: list[dict[str, str]]) -> int:
        text = compiled.render(
            messages=messages,
            add_generation_prompt=True,
            bos_token=special("bos_token"),
            eos_token=special("eos_token"),
        )
        return counter._tokens(text)

    base = max(tokens([{"role": role, "content": ""}]) for role in ("user", "system"))
    one = tokens([{"role": "user", "content": ""}])
    per_message = max(
        tokens([{"role": "user", "content": ""}, {"role": role, "content": ""}]) - one
        for role in ("user", "assistant", "system")
    )
    return base, max(per_message, 0)


def _for_folder(folder: str | None) -> PromptCounter:
    """The folder's counter, loaded once; a folder that fails to load is tried again
    after FIND_AGAIN_S (it may be being written), the byte bound meanwhile."""
    if folder is None:
        return BYTE_BOUND
    counter = _counters.get(folder)
    if counter is not None:
        return counter
    failed = _failed.get(folder)
    if failed is not None and time.monotonic() - failed < FIND_AGAIN_S:
        return BYTE_BOUND
    try:
        counter = PromptCounter.from_folder(Path(folder))
    except Exception as exc:  # a folder without a usable tokenizer: the byte bound
        log.warning("no tokenizer in %s (%s): reserving by the UTF-8 byte bound", folder, exc)
        _failed[folder] = time.monotonic()
        return BYTE_BOUND
    _counters[folder] = counter
    return counter


_counters: dict[str, PromptCounter] = {}
_failed: dict[str, float] = {}  # folder -> when it failed to load


# Without the tokenizer: an upper bound from the UTF-8 bytes (cheap, and never below).
BYTE_BOUND = PromptCounter()


def for_settings(settings: Settings) -> PromptCounter:
    """The served model's counter: its tokenizer when its folder is here (MODEL_PATH, or
    the bundled model once `tierq prepare-model` made it; never converted here), else the
    tokenizer the fleet's workers published (tierq.core.fleet fetches it into `fleet_folder`),
    else the byte bound. Loaded once per process and folder; a folder without it is
    looked at again at most every FIND_AGAIN_S (it may be prepared or fetched later)."""
    found = _find(own_folder(settings))
    if found is None:
        fetched = _fleet_folders.get((settings.state_dir, settings.served_model_name))
        found = None if fetched is None else _find(fetched)
    return _for_folder(found)


def own_folder(settings: Settings) -> Path:
    return Path(settings.model_path) if settings.model_path else settings.bundled_model_dir


def fleet_folder(settings: Settings) -> Path:
    """Where this host keeps the tokenizer files the fleet published, a folder for each
    version (tierq.core.fleet)."""
    return settings.state_dir / "fleet-models" / settings.served_model_name


def use_fleet_folder(settings: Settings, folder: Path) -> None:
    """Count the served model's prompts with the tokenizer in `folder` (one the fleet
    published) while this host has none of its own."""
    _fleet_folders[(settings.state_dir, settings.served_model_name)] = folder
    _looked.pop(folder, None)


_fleet_folders: dict[tuple[Path, str], Path] = {}


def has_own_tokenizer(settings: Settings) -> bool:
    return _find(own_folder(settings)) is not None


def _find(folder: Path) -> str | None:
    now = time.monotonic()
    looked = _looked.get(folder)
    if looked is None or (looked[1] is None and now - looked[0] > FIND_AGAIN_S):
        found = folder if (folder / "tokenizer.json").is_file() else None
        looked = (now, None if found is None else str(found))
        _looked[folder] = looked
    return looked[1]


FIND_AGAIN_S = 30.0
_looked: dict[Path, tuple[float, str | None]] = {}  # folder -> (when looked, tokenizer folder)
