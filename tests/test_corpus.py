import math
import random

import pytest

from nanolm.data import corpus
from nanolm.data.corpus import generate_stories, parse, write_stories
from nanolm.data.prepare import prepare


@pytest.mark.kernels
def test_parsing_a_story_recovers_exactly_its_choices():
    """The floor is exact only if the text determines the choices: one parse, the right one."""
    for story in generate_stories(150, seed=11):
        readings = parse(story.text, limit=2)
        assert len(readings) == 1
        assert readings[0].choices == story.choices
        assert readings[0].nats == pytest.approx(story.nats, rel=1e-12)


def test_a_grammar_with_a_hidden_choice_is_caught_by_the_parser(monkeypatch):
    """A choice that never shows in the text makes two choice sequences write one text.
    The parser then finds two readings, which is how the test above would fail."""
    original = corpus._tell

    def leaky(t):
        t.pick(["invisible", "choice"])
        original(t)

    monkeypatch.setattr(corpus, "_tell", leaky)
    story = corpus.generate_story(random.Random(0))
    assert len(parse(story.text, limit=2)) == 2


@pytest.mark.kernels
def test_story_information_is_the_sum_of_minus_log_choice_probabilities():
    rng = random.Random(5)
    t = corpus._Teller(rng=rng)
    corpus._tell(t)
    story = parse(t.text)[0]
    # recompute by hand: replay the choices and add -ln p with the grammar's probabilities
    total = 0.0

    class Recorder(corpus._Teller):
        def pick(self, options, weights=None):
            i = story.choices[len(self.choices)]
            p = 1 / len(options) if weights is None else weights[i] / sum(weights)
            nonlocal total
            total -= math.log(p)
            self.choices.append(i)
            return options[i]

    corpus._tell(Recorder(forced=story.choices))
    assert total == pytest.approx(t.nats, rel=1e-12) and total > 10


def test_stories_vary_in_length_and_content():
    stories = generate_stories(300, seed=2)
    lengths = sorted(len(s.text) for s in stories)
    assert lengths[0] < 250 < 600 < lengths[-1]
    assert len({s.text for s in stories}) == 300
    assert len(set(generate_stories(5, seed=2)[0].text)) > 20
    assert [s.text for s in generate_stories(20, seed=2)] == [s.text for s in stories[:20]]  # seeded


@pytest.mark.kernels
def test_prepare_reports_the_exact_floor_of_the_validation_documents(tmp_path):
    path = tmp_path / "s.txt"
    summary = write_stories(path, 100, seed=4)
    data = prepare(path, tmp_path / "out", "bpe", 300, val_fraction=0.1, progress=False)
    val_docs = [i for i in range(100) if i % 10 == 9]
    nats = sum(summary["doc_nats"][i] for i in val_docs)
    stories = generate_stories(100, seed=4)
    n_bytes = sum(len(stories[i].text.encode()) for i in val_docs)
    floor = data.meta["floor"]
    assert floor["nats"] == pytest.approx(nats, rel=1e-9)
    assert floor["bpb"] == pytest.approx(nats / math.log(2) / n_bytes, rel=1e-9)
    predictions = data.meta["splits"]["val"]["tokens"] - 1  # every token but the opening EOS is predicted
    assert floor["nats_per_token"] == pytest.approx(nats / predictions, rel=1e-9)
