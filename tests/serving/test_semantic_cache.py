"""The semantic cache without a model: the guards on the labelled near-miss pairs and on made-up
questions, the exact key's split of a chat body, and the index's bounds and TTL (hand-made unit
vectors stand in for embeddings: the index only takes dot products)."""

import json
from pathlib import Path

import numpy as np
import pytest

from kiln.serving.cache.semantic_cache import SemanticCache, SemanticQuery
from kiln.serving.cache.semantic_guards import features
from kiln.serving.cache.semantic_requests import split_chat

PAIRS = [json.loads(line) for line in (Path(__file__).parents[1] / "data" / "semantic_pairs.jsonl").open()]
GUARDED_KINDS = ("number", "date", "negation", "entity")


def disagreement(a: str, b: str):
    return features(a).disagreement(features(b))


@pytest.mark.parametrize("pair", [p for p in PAIRS if p.get("kind") in GUARDED_KINDS],
                         ids=lambda p: p["b"][:40])
def test_every_labelled_near_miss_of_a_guarded_kind_is_turned_down(pair):
    expected = {"number": "numbers", "date": "dates", "negation": "negations", "entity": "entities"}[pair["kind"]]
    assert disagreement(pair["a"], pair["b"]) == expected


def test_every_labelled_paraphrase_passes_the_guards():
    blocked = [(p["a"], p["b"]) for p in PAIRS if p["label"] == "paraphrase" and disagreement(p["a"], p["b"])]
    assert not blocked


@pytest.mark.parametrize("a, b, guard", [
    ("Give me 5 tips.", "Give me five tips.", None),                       # number words are numbers
    ("What is 1,000 times 3?", "What is 1000 times 3?", None),
    ("What is 1.5 plus 2?", "What is 1.25 plus 2?", "numbers"),
    ("Is it safe?", "Isn't it safe?", "negations"),
    ("Is it safe?", "Is it unsafe?", "negations"),
    ("Can I do it?", "I cannot do it?", "negations"),
    ("What is France's capital?", "What is the capital of France?", None),  # possessive
    ("Tell me about NASA.", "Tell me about ESA.", "entities"),               # acronyms
    ("Paris is in which country?", "Lyon is in which country?", "entities"), # a sentence-initial name
    ("What happens in May?", "What happens in June?", "dates"),
])
def test_guard_cases(a, b, guard):
    assert disagreement(a, b) == guard


def test_the_exact_key_holds_everything_but_the_last_user_turn():
    body = {"model": "m", "temperature": 0, "max_tokens": 8, "stream": True,
            "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there?"}]}
    key, question = split_chat(body, None)
    assert question == "Hi there?"
    assert split_chat({**body, "stream": False}, None)[0] == key               # delivery is not meaning
    other = [
        {**body, "messages": [{"role": "system", "content": "Be long."}, body["messages"][1]]},
        {**body, "tools": [{"type": "function", "function": {"name": "f"}}]},
        {**body, "max_tokens": 9},
        {**body, "seed": 3},
    ]
    assert all(split_chat(b, None)[0] != key for b in other)
    assert split_chat(body, "api-key:alice")[0] != key                          # tenants never share
    assert split_chat({**body, "messages": body["messages"] + [{"role": "assistant", "content": "x"}]},
                      None) is None                                            # not a user turn last
    parts = [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there?"}]
    assert split_chat({**body, "messages": [{"role": "user", "content": parts}]}, None)[1] == "Hi\nthere?"


def unit(*xs):
    v = np.array(xs, dtype=np.float32)
    return v / np.linalg.norm(v)


class Clock:
    now = 0.0

    def __call__(self):
        return self.now


def query(question, vector, key="k"):
    return SemanticQuery(key, question, unit(*vector))


def test_a_close_question_hits_and_a_far_one_misses():
    cache = SemanticCache(10, 1 << 20, 60, threshold=0.9)
    cache.put(query("What is the capital of France?", (1, 0, 0)), "Paris", 10)
    hit = cache.lookup(query("Which city is the capital of France?", (1, 0.2, 0)))
    assert (hit.outcome, hit.value) == ("hit", "Paris") and hit.similarity == pytest.approx(0.9806, abs=1e-3)
    assert cache.lookup(query("Which city is the capital of France?", (1, 1, 0))).outcome == "miss"
    assert cache.lookup(query("Which city is the capital of France?", (1, 0, 0), key="other")).outcome == "miss"


def test_a_guarded_near_miss_is_a_guard_rejection_and_a_later_candidate_can_still_hit():
    cache = SemanticCache(10, 1 << 20, 60, threshold=0.9)
    cache.put(query("Who won the World Cup in 2018?", (1, 0, 0)), "France", 10)
    rejected = cache.lookup(query("Who won the World Cup in 2022?", (1, 0.1, 0)))
    assert (rejected.outcome, rejected.guard, rejected.value) == ("guard", "numbers", None)
    cache.put(query("Who was the World Cup winner in 2022?", (1, 0.3, 0)), "Argentina", 10)
    assert cache.lookup(query("Who won the World Cup in 2022?", (1, 0.1, 0))).value == "Argentina"
    unguarded = SemanticCache(10, 1 << 20, 60, threshold=0.9, guards=False)
    unguarded.put(query("Who won the World Cup in 2018?", (1, 0, 0)), "France", 10)
    assert unguarded.lookup(query("Who won the World Cup in 2022?", (1, 0.1, 0))).value == "France"


def test_entries_expire_after_the_ttl():
    clock = Clock()
    cache = SemanticCache(10, 1 << 20, ttl=60, clock=clock)
    cache.put(query("How do I boil an egg?", (1, 0)), "answer", 10)
    clock.now = 60
    assert cache.lookup(query("How do I boil an egg?", (1, 0))).outcome == "hit"
    clock.now = 60.5
    assert cache.lookup(query("How do I boil an egg?", (1, 0))).outcome == "miss"
    assert len(cache) == 0 and cache.nbytes == 0


def test_the_index_is_bounded_in_entries_least_recently_used_out_first():
    cache = SemanticCache(2, 1 << 20, 60)
    cache.put(query("a one?", (1, 0, 0)), "A", 10)
    cache.put(query("b two?", (0, 1, 0)), "B", 10)
    assert cache.lookup(query("a one?", (1, 0, 0))).value == "A"             # A is now the most recent
    cache.put(query("c three?", (0, 0, 1)), "C", 10)
    assert len(cache) == 2
    assert cache.lookup(query("b two?", (0, 1, 0))).outcome == "miss"
    assert cache.lookup(query("a one?", (1, 0, 0))).value == "A"


def test_the_index_is_bounded_in_bytes():
    one = SemanticCache(100, 1 << 20, 60)
    one.put(query("q?", (1, 0)), "A", 1000)
    size = one.nbytes
    cache = SemanticCache(100, 2 * size + size // 2, 60)
    for i in range(5):
        cache.put(query("q?", (1, i)), str(i), 1000)
        assert cache.nbytes <= cache.max_bytes
    assert len(cache) == 2
    cache.put(query("huge?", (1, 0)), "H", 10 * size)                         # never fits: not stored
    assert len(cache) == 2 and cache.lookup(query("huge?", (1, 0))).value != "H"


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="threshold"):
        SemanticCache(10, 100, 60, threshold=1.5)
    with pytest.raises(ValueError, match="above 0"):
        SemanticCache(0, 100, 60)


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

OPS = st.lists(st.tuples(st.sampled_from(["put", "lookup", "wait"]), st.integers(0, 5), st.integers(0, 3),
                         st.integers(0, 3000)), max_size=60)


@settings(max_examples=150, deadline=None)
@given(OPS, st.integers(1, 6), st.integers(1500, 8000))
def test_random_use_keeps_the_bounds_and_the_books(ops, max_entries, max_bytes):
    """Whatever the order of puts, lookups and time passing: at most max_entries entries and
    max_bytes bytes, the byte count is the entries' sum, the per-key index names exactly the live
    entries, and no lookup returns an entry older than the TTL."""
    clock = Clock()
    cache = SemanticCache(max_entries, max_bytes, ttl=10, clock=clock)
    stored_at = {}
    for op, a, key, size in ops:
        q = query(f"question {a}?", (1, a, 0), key=f"k{key}")
        if op == "put":
            cache.put(q, (a, key, clock.now), size)
            stored_at[(a, key, clock.now)] = clock.now
        elif op == "lookup":
            found = cache.lookup(q)
            if found.outcome == "hit":
                assert clock.now - stored_at[found.value] <= 10
        else:
            clock.now += size / 300
        cache.check_invariants()
