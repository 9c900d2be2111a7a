"""Guards against the semantic cache's false hits: two questions close in embedding space may still
ask different things ("...in 2019?" / "...in 2021?", "is X safe" / "is X not safe", Paris /
Lyon). A sentence embedding barely moves for such a change (all-MiniLM-L6-v2 puts "Is aspirin
safe for children?" and "Is aspirin not safe for children?" at cosine 0.994), so a stored answer
is served only when these features of the two questions agree exactly:

- numbers: digit strings ("1,000" = "1000") and number words ("five" = "5");
- dates and times: month and weekday names, and relative days ("today", "tomorrow", "last year");
- negations: "not", "no", "never", "n't", "without" ... (as a multiset: one "not" is not two);
- named entities: capitalised words, except a sentence's first word when it is a common word
  ("What", "Is", "Tell"), and "I"; compared without case and possessive ('s);
- polarity: words of a known antonym pair ("safe" / "dangerous", "increase" / "decrease",
  "before" / "after" ...), as the pair's axis and pole (a synonym on the same pole agrees): an
  axis both questions use must have the same poles;
- slots: the word after a preposition of place or object ("in paris", "from london", "of
  france"): for a preposition both questions use, neither may replace the other's word, so that
  a lowercase name ("weather in paris" / "weather in lyon") or a swap ("celsius to fahrenheit" /
  "fahrenheit to celsius") is seen although nothing is capitalised.

The rule is deliberately conservative: a paraphrase that changes one of these ("five" for "5" is
fine, "France's" for "France" is fine, "Fri" for "Friday" is not) only costs a cache miss.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

NUMBER_WORDS = {w: str(i) for i, w in enumerate(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
    "sixteen seventeen eighteen nineteen twenty".split())}
NUMBER_WORDS.update(thirty="30", forty="40", fifty="50", sixty="60", seventy="70", eighty="80", ninety="90",
                    hundred="100", thousand="1000", million="1000000", billion="1000000000",
                    first="1st", second="2nd", third="3rd", half="0.5", dozen="12")
MONTHS = ("january february march april may june july august september october november december "
          "jan feb mar apr jun jul aug sep sept oct nov dec").split()
WEEKDAYS = "monday tuesday wednesday thursday friday saturday sunday".split()
RELATIVE_TIMES = ("today tonight tomorrow yesterday now currently current latest recent recently ago "
                  "last next previous past future this").split()
# "may" is a month and a modal verb: counted only when capitalised mid-sentence (then an entity too).
DATE_WORDS = (set(MONTHS) - {"may"}) | set(WEEKDAYS) | set(RELATIVE_TIMES)
NEGATIONS = {"not", "no", "never", "none", "nobody", "nothing", "neither", "nor", "without", "cannot",
             "n't", "unsafe", "avoid", "except", "non"}
# Words that open a question or an instruction: capitalised there by grammar, not as a name.
COMMON_OPENERS = set((
    "what who whom whose which when where why how is are am was were be been do does did can could "
    "will would shall should may might must have has had tell give explain list describe name show "
    "write define summarize summarise compare please i the a an in on at of for to from by with and "
    "or but if so it its this that these those there my your our their his her we you they he she "
    "any some all each every one help find make create suggest recommend translate calculate convert "
    "let hey hi hello ok okay yes no not why's what's who's how's where's when's").split())

# Antonym pairs: each word's (axis, pole). Synonyms share a pole, so "dangerous" / "harmful" agree.
_POLES = {
    "safety": ("safe safer safest harmless", "dangerous unsafe harmful risky hazardous toxic poisonous deadly"),
    "quality": ("good better best", "bad worse worst"),
    "legality": ("legal lawful allowed permitted", "illegal unlawful forbidden banned prohibited"),
    "health": ("healthy healthier", "unhealthy"),
    "truth": ("true correct right", "false incorrect wrong"),
    "change": ("increase increases increasing raise raising grow", "decrease decreases decreasing reduce "
               "reducing lower lowering shrink"),
    "amount": ("more most maximum max", "less least fewer fewest minimum min"),
    "price": ("expensive costly", "cheap cheaper cheapest inexpensive"),
    "speed": ("fast faster fastest quick quicker", "slow slower slowest"),
    "height": ("high higher highest", "low lowest"),
    "temperature": ("hot hotter warm warmer", "cold colder cool cooler"),
    "size": ("big bigger biggest large larger largest", "small smaller smallest little tiny"),
    "time": ("before earlier", "after later"),
    "state": ("open opening enable enabled turn_on start", "close closing disable disabled stop"),
    "trade": ("buy buying", "sell selling"),
    "membership": ("add adding include including install", "remove removing exclude excluding uninstall "
                   "delete deleting"),
    "sign": ("positive plus pros advantages advantage benefits benefit", "negative minus cons "
             "disadvantages disadvantage drawbacks drawback risks"),
    "direction": ("up upload import encrypt encode", "down download export decrypt decode"),
    "outcome": ("win winning accept", "lose losing reject"),
    "possibility": ("possible", "impossible"),
}
POLARITY = {word: (axis, pole) for axis, poles in _POLES.items()
            for pole, words in zip("+-", poles) for word in words.split()}
# A slot's preposition, and the words skipped between it and the word it governs.
SLOT_PREPOSITIONS = {"in", "at", "from", "to", "near", "of", "for", "into", "on", "via", "between"}
SLOT_SKIPPED = {"the", "a", "an", "my", "your", "our", "their", "his", "her", "its", "this", "that",
                "these", "those", "some", "any", "me", "us", "them", "it"}

_TOKEN = re.compile(r"[A-Za-z]+(?:'[A-Za-z]+)?|\d+(?:[.,:/-]\d+)*")
_SENTENCE_END = re.compile(r"[.!?]\s*$")


@dataclass(frozen=True)
class QuestionFeatures:
    numbers: frozenset[str]
    dates: frozenset[str]
    negations: tuple[tuple[str, int], ...]      # sorted (word, count) pairs
    entities: frozenset[str]
    polarity: frozenset[tuple[str, str]] = frozenset()     # (axis, pole)
    slots: frozenset[tuple[str, str]] = frozenset()        # (preposition, the word after it)

    def disagreement(self, other: QuestionFeatures) -> str | None:
        """The first feature that differs ("numbers", "dates", "negations", "entities",
        "polarity", "slots"), or None."""
        for name in ("numbers", "dates", "negations", "entities"):
            if getattr(self, name) != getattr(other, name):
                return name
        if _swapped(self.polarity, other.polarity):
            return "polarity"
        return "slots" if _swapped(self.slots, other.slots) else None


def _swapped(mine: frozenset[tuple[str, str]], theirs: frozenset[tuple[str, str]]) -> bool:
    """Whether a (kind, value) pair of one question was replaced in the other: for some kind both
    use, each has a value the other lacks. A paraphrase may add or drop one ("how fast" for "the
    speed of", "a summary of the plot of" for "the plot of"); it may not swap one ("safe" for
    "dangerous", "in paris" for "in lyon")."""
    for kind in {k for k, _ in mine} & {k for k, _ in theirs}:
        a = {v for k, v in mine if k == kind}
        b = {v for k, v in theirs if k == kind}
        if a - b and b - a:
            return True
    return False


def features(text: str) -> QuestionFeatures:
    numbers, dates, negations, entities, polarity = set(), set(), Counter(), set(), set()
    for word, sentence_start in _words(text):
        lower = word.lower()
        if lower in POLARITY:
            polarity.add(POLARITY[lower])
        if lower[0].isdigit():
            numbers.add(_number(lower))
            continue
        if lower in NUMBER_WORDS:
            numbers.add(NUMBER_WORDS[lower])
        if lower in DATE_WORDS:
            dates.add(lower)
        if lower in NEGATIONS or lower.endswith("n't"):
            negations["not" if lower.endswith("n't") or lower == "cannot" else lower] += 1
        if _is_entity(word, lower, sentence_start):
            entities.add(_strip_possessive(lower))
    return QuestionFeatures(frozenset(numbers), frozenset(dates), tuple(sorted(negations.items())),
                            frozenset(entities), frozenset(polarity), _slots(text))


def _slots(text: str) -> frozenset[tuple[str, str]]:
    """(preposition, the first word after it that is not an article or a pronoun), each word
    lowercased and without a plural or possessive ending; numbers are the numbers guard's."""
    words = [w.lower() for w, _ in _words(text)]
    slots = set()
    for i, word in enumerate(words):
        if word not in SLOT_PREPOSITIONS:
            continue
        following = next((w for w in words[i + 1:] if w not in SLOT_SKIPPED), None)
        if following is not None and not following[0].isdigit() and following not in SLOT_PREPOSITIONS:
            slots.add((word, _singular(_strip_possessive(following))))
    return frozenset(slots)


def _singular(word: str) -> str:
    return word[:-1] if len(word) > 3 and word.endswith("s") and not word.endswith("ss") else word


def _words(text: str):
    """(word, whether it opens a sentence) for each word or number of the text."""
    start = True
    for m in _TOKEN.finditer(text):
        yield m.group(), start
        start = bool(_SENTENCE_END.search(text[m.end():m.end() + 2]))


def _number(token: str) -> str:
    if re.fullmatch(r"\d{1,3}(,\d{3})+(\.\d+)?", token):
        token = token.replace(",", "")
    return token


def _is_entity(word: str, lower: str, sentence_start: bool) -> bool:
    if not word[0].isupper() or lower == "i":
        return False
    if word.isupper() and len(word) > 1:
        return True                               # an acronym: NASA, EU, USB
    return not (sentence_start and (lower in COMMON_OPENERS or _strip_possessive(lower) in COMMON_OPENERS))


def _strip_possessive(lower: str) -> str:
    return lower[:-2] if lower.endswith("'s") else lower
