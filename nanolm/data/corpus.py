"""The built-in corpus: simple stories whose information content is known exactly.

"The loss has a floor, the entropy of the data, and that is not a bug." To see that floor,
the data must have a known entropy. These stories come from a small stochastic grammar
(a hero, a place, objects, friends, a little dialogue, a varied number of events). Every
random choice is visible in the text and different choices always give different texts,
so the probability of a story *is* the product of the probabilities of its choices:

    information of a story = Σ over its choices of -ln p(choice)      (nats)

No model, however large, can predict these texts with fewer nats than that on average.
:func:`parse` recovers the choices from the text alone; the tests check that it finds
exactly the choices the generator made (and no other reading), which is what makes the
floor exact rather than estimated.

In practice a model sees a window of ``seq_len`` tokens: a window that starts in the
middle of a story hides its hero's name, which then has to be guessed again, so the loss
a model can reach at a given context length sits a little above the floor.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path

from ..base.files import atomic_write_all, parents_made
from ..tokenizer import EOS

HEROES = [  # name, pronoun, possessive, kind
    ("Lily", "she", "her", "girl"),
    ("Tom", "he", "his", "boy"),
    ("Mia", "she", "her", "girl"),
    ("Ben", "he", "his", "boy"),
    ("Sue", "she", "her", "girl"),
    ("Max", "he", "his", "boy"),
    ("Anna", "she", "her", "girl"),
    ("Sam", "he", "his", "boy"),
    ("Lucy", "she", "her", "girl"),
    ("Tim", "he", "his", "boy"),
    ("Zoe", "she", "her", "girl"),
    ("Jack", "he", "his", "boy"),
]
AGES = ["little", "small", "young", "happy", "curious", "brave"]
HOMES = ["a small house", "a big red house", "a tiny cottage", "a house by the sea", "a farm", "a quiet town"]
TRAITS = [
    "loved to play outside",
    "liked to draw pictures",
    "was very kind to everyone",
    "loved to sing songs",
    "liked to help {pos} mom",
    "was always asking questions",
    "loved animals",
    "liked to run fast",
]
PLACES = ["park", "forest", "garden", "beach", "river", "hill", "market", "school", "lake", "farm"]
COLORS = ["red", "blue", "green", "yellow", "shiny", "big", "little", "soft"]
OBJECTS = ["ball", "box", "hat", "kite", "rock", "cup", "book", "shell", "key", "leaf", "toy car", "flower"]
ANIMALS = [("dog", "Woof"), ("cat", "Meow"), ("bird", "Tweet"), ("frog", "Ribbit"), ("duck", "Quack"), ("cow", "Moo")]
FRIENDS = ["Pip", "Bella", "Rex", "Daisy", "Coco", "Bobo", "Lulu", "Nemo"]
FEELINGS = ["happy", "excited", "surprised", "glad", "proud"]
PROBLEMS = [
    ("it started to rain", "the sun came out again"),
    ("{name} lost {pos} way", "a kind lady showed {obj} the way home"),
    ("a strong wind blew", "the wind stopped"),
    ("{name} fell down and cried", "{pos} mom gave {obj} a big hug"),
    ("the {thing} broke", "{name} fixed it with some tape"),
]
MORALS = [
    "sharing makes everyone happy",
    "it is good to be kind",
    "friends help each other",
    "being brave is important",
    "it is fun to try new things",
]
OBJECT_PRONOUN = {"she": "her", "he": "him"}


class _Stop(Exception):
    """Raised while parsing when the grammar needs a choice not yet fixed."""

    def __init__(self, n_options):
        self.n_options = n_options


class _Mismatch(Exception):
    """Raised while parsing when the text written so far differs from the target."""


@dataclass
class _Teller:
    """Makes the grammar's choices and collects the text it writes.

    Generation draws each choice from ``rng``; parsing replays ``forced`` choices and checks
    every written piece against ``target``.
    """

    rng: random.Random | None = None
    forced: list[int] | None = None
    target: str | None = None
    choices: list[int] = field(default_factory=list)
    nats: float = 0.0
    parts: list[str] = field(default_factory=list)
    length: int = 0

    def pick(self, options, weights=None):
        n = len(options)
        probs = [1 / n] * n if weights is None else [w / sum(weights) for w in weights]
        if self.forced is not None:
            if len(self.choices) == len(self.forced):
                raise _Stop(n)
            i = self.forced[len(self.choices)]
        else:
            i = self.rng.choices(range(n), weights=probs)[0]
        self.choices.append(i)
        self.nats -= math.log(probs[i])
        return options[i]

    def chance(self, p_yes: float) -> bool:
        return self.pick([True, False], [p_yes, 1 - p_yes])

    def say(self, text: str) -> None:
        if self.target is not None and not self.target.startswith(text, self.length):
            raise _Mismatch
        self.parts.append(text)
        self.length += len(text)

    @property
    def text(self) -> str:
        return "".join(self.parts)


def _tell(t: _Teller) -> None:
    """The grammar. Every ``t.pick`` is a random choice; every ``t.say`` writes text.

    Rule that keeps the entropy exact: never make a choice whose result might not appear
    in the text (for instance inside an option that is not taken). Text is written as
    soon as a choice is made, which lets :func:`parse` reject wrong guesses early.
    """
    t.say(t.pick(["Once upon a time, there was", "Long ago, there was", "There once was"]))
    t.say(f" a {t.pick(AGES)} ")
    name, he, his, kind = t.pick(HEROES)
    him, He = OBJECT_PRONOUN[he], he.capitalize()
    t.say(f"{kind} named {name}. {He} lived in {t.pick(HOMES)}. ")
    t.say(f"{He} {t.pick(TRAITS).format(pos=his)}.")
    friend = thing = None
    for events in range(1, 6):
        t.say(f"\n\n{t.pick(['One day', 'The next day', 'Later', 'In the morning'])}, {name} ")
        kind_of_event = t.pick(["find", "meet", "problem", "talk"], [3, 3, 2, 2])
        if kind_of_event == "find":
            t.say(f"went to the {t.pick(PLACES)}. ")
            t.say(f"There {he} found a {t.pick(COLORS)} ")
            thing = t.pick(OBJECTS)
            t.say(f"{thing}. {name} was very {t.pick(FEELINGS)}.")
            if t.chance(0.5):
                t.say(f' "I will keep it safe," said {name}.')
        elif kind_of_event == "meet":
            animal, sound = t.pick(ANIMALS)
            t.say(f"met a {animal} named ")
            friend = t.pick(FRIENDS)
            t.say(f'{friend} at the {t.pick(PLACES)}. "{sound}!" said {friend}. ')
            t.say(
                t.pick(
                    [
                        f'"Do you want to play with me?" asked {name}.',
                        f'"Hello, {friend}! Let us be friends," said {name}.',
                        f"{name} gave {friend} a little pat.",
                    ]
                )
            )
        elif kind_of_event == "problem":
            t.say(f"was at the {t.pick(PLACES)} when ")
            trouble, fix = t.pick(PROBLEMS if thing else PROBLEMS[:4])
            fill = dict(name=name, pos=his, obj=him, thing=thing)
            t.say(f"{trouble.format(**fill)}. {He} felt {t.pick(['sad', 'scared', 'upset'])}. ")
            t.say(f"Then {fix.format(**fill)}, and {name} smiled.")
        else:
            who = friend or "Mom"
            t.say(f"and {who} walked to the {t.pick(PLACES)}. ")
            line = t.pick(["sky", "what", "feel"])  # pick the line first, then fill it in
            if line == "sky":
                t.say(f'"Look at the sky!" said {name}. "It is so {t.pick(["blue", "pretty", "big"])}!"')
            elif line == "what":
                t.say(f'"What is that?" asked {name}. "It is a {t.pick(OBJECTS)}," said {who}.')
            else:
                t.say(f'"I am {t.pick(FEELINGS)} today," said {name}.')
        if events == 5 or not t.chance(0.55):
            break
    ending = t.pick(["moral", "happy", "sleep"])
    if ending == "moral":
        t.say(f"\n\n{name} learned that {t.pick(MORALS)}.")
    elif ending == "happy":
        t.say(f"\n\nAt the end of the day, {name} went home {t.pick(FEELINGS)}.")
    else:
        t.say(f"\n\nThat night, {name} went to bed and dreamed about the {t.pick(PLACES)}.")


@dataclass
class Story:
    text: str
    choices: list[int]
    nats: float  # exact information content: Σ -ln p(choice)


def generate_story(rng: random.Random) -> Story:
    t = _Teller(rng=rng)
    _tell(t)
    return Story(t.text, t.choices, t.nats)


def generate_stories(n_docs: int, seed: int = 0) -> list[Story]:
    rng = random.Random(seed)
    return [generate_story(rng) for _ in range(n_docs)]


def parse(text: str, limit: int = 2) -> list[Story]:
    """Every choice sequence of the grammar that writes exactly ``text`` (at most ``limit``).

    A depth-first search that replays the grammar with a growing prefix of fixed choices
    and abandons a branch as soon as the text it writes departs from ``text``. A text the
    grammar can write has exactly one reading; the tests check that.
    """
    found: list[Story] = []

    def search(prefix: list[int]):
        if len(found) >= limit:
            return
        t = _Teller(forced=prefix, target=text)
        try:
            _tell(t)
        except _Mismatch:
            return
        except _Stop as stop:
            for i in range(stop.n_options):
                search(prefix + [i])
            return
        if t.text == text:
            found.append(Story(t.text, t.choices, t.nats))

    search([])
    return found


def write_stories(path, n_docs: int, seed: int = 0) -> dict:
    """Write ``n_docs`` stories separated by ``<|endoftext|>`` lines, and beside them
    ``<path>.entropy.json`` with each story's information content in nats.

    The two files replace what ``path`` held together (:func:`~nanolm.base.files.atomic_write_all`),
    in the directories made for them: a full disk leaves the old corpus and its entropy as they
    were and no directory made, never a corpus beside another one's entropy."""
    stories = generate_stories(n_docs, seed)
    path = Path(path)
    summary = corpus_entropy(stories)
    summary.update(seed=seed, documents=n_docs, doc_nats=[round(s.nats, 6) for s in stories])
    text = f"\n{EOS}\n".join(s.text for s in stories)
    with parents_made(path):
        atomic_write_all({path: text, entropy_path(path): json.dumps(summary)})
    return summary


def entropy_path(path) -> Path:
    path = Path(path)
    return path.with_name(path.name + ".entropy.json")


def corpus_entropy(stories: list[Story]) -> dict:
    nats = sum(s.nats for s in stories)
    n_bytes = sum(len(s.text.encode("utf-8")) for s in stories)
    return {"nats": nats, "bytes": n_bytes, "bits_per_byte": nats / math.log(2) / max(1, n_bytes)}
