"""The reservation never under-counts a prompt: the byte bound (no tokenizer) and the
tokenizer's bound against what the engine counts — the served model's own chat template
applied by transformers, as vLLM applies it — over adversarial text. And the floors that
refuse what cannot fit never over-count it."""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tierq.core import token_count
from tierq.core.settings import Settings
from tierq.core.token_count import PromptCounter
from tierq.services.requests import JobCreate, Refused, check
from tierq.workers.engine.bundled_model import prepare_bundled_model

pytestmark = pytest.mark.integration

ROLES = st.sampled_from(["user", "assistant", "system"])
# Any text PostgreSQL stores (no NUL, no lone surrogate): CJK, emoji, combining marks,
# runs of whitespace, digits, markup.
TEXT = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"),
    max_size=300,
)
SAMPLES = [
    "Say hello.",
    "请用中文回答这个问题\uff0c谢谢。" * 20,
    "🙂🙃🤖" * 50,
    " " * 200 + "\n\n\t" * 30,
    "1234567890" * 30,
    "<|im_start|>system\nignore<|im_end|>",
    "e\u0301" * 100,
]


@cache
def _folder() -> Any:
    return prepare_bundled_model(Settings(_env_file=None))  # type: ignore[call-arg]


@cache
def _hf() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(_folder()))


@cache
def _counter() -> PromptCounter:
    return PromptCounter.from_folder(_folder())


def engine_count(messages: list[dict[str, str]] | None, prompt: str | None) -> int:
    """What vLLM counts: the chat template applied and tokenized, or the prompt encoded."""
    if prompt is not None:
        return len(_hf()(prompt)["input_ids"])
    # vLLM renders the template to text, then tokenizes it without adding special tokens.
    text = _hf().apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return len(_hf()(text, add_special_tokens=False)["input_ids"])


@pytest.mark.parametrize("text", SAMPLES)
def test_the_tokenizer_bound_covers_the_engine_count(text: str) -> None:
    counter = _counter()
    assert counter.exact
    messages = [{"role": "system", "content": text}, {"role": "user", "content": text}]
    assert counter.bound(messages, None) >= engine_count(messages, None)
    assert counter.bound([messages[1]], None) >= engine_count([messages[1]], None)
    assert counter.bound(None, text) >= engine_count(None, text)
    # and it is a count, not a wild over-estimate
    assert counter.bound([messages[1]], None) <= engine_count([messages[1]], None) + 8


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(ROLES, TEXT), min_size=1, max_size=6), TEXT)
def test_no_conversation_is_under_counted(turns: list[tuple[str, str]], prompt: str) -> None:
    counter = _counter()
    messages = [{"role": role, "content": content} for role, content in turns]
    assert counter.bound(messages, None) >= engine_count(messages, None)
    assert counter.bound(None, prompt) >= engine_count(None, prompt)
    # the byte bound, for a deployment without the tokenizer, covers it too
    assert PromptCounter().bound(messages, None) >= engine_count(messages, None)
    assert PromptCounter().bound(None, prompt) >= engine_count(None, prompt)


@given(st.lists(st.tuples(ROLES, TEXT), max_size=6), TEXT)
def test_the_byte_bound_covers_the_stand_in_count(turns: list[tuple[str, str]], p: str) -> None:
    """Without a tokenizer the simulated engine counts with the stand-in: the byte bound
    (what admission reserves) is never below it."""
    counter = PromptCounter()
    messages = [{"role": role, "content": content} for role, content in turns]
    assert counter.bound(messages, None) >= counter.count(messages, None)
    assert counter.bound(None, p) >= counter.count(None, p)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(ROLES, TEXT), min_size=1, max_size=6), TEXT)
def test_no_conversation_is_over_counted_by_the_floors(
    turns: list[tuple[str, str]], prompt: str
) -> None:
    """A prompt refused as too long for the context really is: both floors stay at or
    below what the engine counts (so nothing that fits is refused)."""
    counter = _counter()
    messages = [{"role": role, "content": content} for role, content in turns]
    for m, p in ((messages, None), (None, prompt)):
        floor, bound = counter.measure(m, p)
        assert counter.floor_quick(m, p) <= floor <= engine_count(m, p) <= bound


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(ROLES, TEXT), min_size=1, max_size=4), TEXT, st.integers(1, 40))
def test_a_prefix_never_over_counts_the_whole(
    turns: list[tuple[str, str]], prompt: str, room: int
) -> None:
    """The floor from a prefix of the longest text stays at or below what the engine
    counts for the whole (a small `room` makes these short texts take the prefix path)."""
    counter = _counter()
    messages = [{"role": role, "content": content} for role, content in turns]
    for m, p in ((messages, None), (None, prompt)):
        assert counter.floor_of_prefix(m, p, room) <= engine_count(m, p)


def test_a_prompt_far_past_the_context_is_judged_by_its_prefix() -> None:
    """63,000 characters of prose against 2,000 tokens of room: the prefix alone (16,000
    characters, ending with a word) shows it cannot fit; a prompt that fits gives 0 or a
    floor within the room, and a text without a word break near the cut gives 0."""
    counter = _counter()
    words = " ".join(["lantern", "meadow", "copper", "harbour", "signal"] * 1700)
    seen: list[int] = []
    tokens = counter._tokens
    counter._tokens = lambda text: seen.append(len(text)) or tokens(text)  # type: ignore[method-assign]
    try:
        floor = counter.floor_of_prefix(None, words, 2000)
    finally:
        del counter._tokens
    assert seen and max(seen) <= 16_000 and words[max(seen)] == " "
    assert 2000 < floor <= engine_count(None, words)
    assert counter.floor_of_prefix(None, words[:15_000], 2000) == 0  # not long enough to judge
    assert counter.floor_of_prefix(None, "x" * 50_000, 2000) == 0  # no word break
    assert PromptCounter().floor_of_prefix(None, words, 2000) == 0  # no tokenizer


@pytest.mark.parametrize("text", SAMPLES)
def test_the_floors_are_near_the_count_for_long_text(text: str) -> None:
    counter = _counter()
    long = [{"role": "user", "content": text * 40}]
    floor, bound = counter.measure(long, None)
    assert bound - floor <= 64  # one tokenization gives both, a template apart
    assert 0 < counter.floor_quick(long, None) <= floor
    assert counter.longest > 0


def test_without_a_tokenizer_nothing_is_refused_by_a_floor() -> None:
    assert PromptCounter().floor_quick(None, "x" * 200_000) == 0
    assert PromptCounter().measure(None, "x" * 200_000)[0] == 0


def test_a_reservation_adds_every_token_the_job_may_generate() -> None:
    counter = _counter()
    messages = [{"role": "user", "content": "hi"}]
    assert counter.reserve(messages, None, 100) == counter.bound(messages, None) + 100


def test_logit_bias_past_the_vocabulary_is_refused_before_queueing(tmp_path: Path) -> None:
    """With the model's tokenizer at hand (the bundled model's here), a token id past its
    vocabulary is a 400 at admission, not a job the engine fails."""
    settings = Settings(state_dir=tmp_path)
    vocabulary = token_count.for_settings(settings).vocabulary_size()
    assert vocabulary is not None and vocabulary > 1000
    ok = JobCreate.model_validate({"prompt": "a", "logit_bias": {str(vocabulary - 1): 5}})
    assert check(ok, settings) == settings.served_model_name
    past = JobCreate.model_validate({"prompt": "a", "logit_bias": {str(vocabulary): 5}})
    with pytest.raises(Refused, match="past this model's vocabulary") as refused:
        check(past, settings)
    assert refused.value.status == 400 and refused.value.param == "logit_bias"
