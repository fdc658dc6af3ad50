"""The retrieval check's items: one fact hidden among filler sentences at a chosen depth.

Deterministic in (seed, index); the words below never occur in the filler, so a reply that
names the answer can only have read it from the needle.
"""

from __future__ import annotations

import random

RETRIEVAL_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
RETRIEVAL_FILLER_SENTENCES = 40

_FILLER = (
    "The morning train left the station a few minutes late.",
    "A small dog slept under the kitchen table.",
    "The library closes early on public holidays.",
    "Fresh bread was stacked on the wooden shelves.",
    "The river rose slowly after a week of rain.",
    "Two children built a sandcastle near the water.",
    "The old clock in the hall needs a new battery.",
    "A cool breeze moved through the open window.",
    "The bakery on the corner sells warm muffins.",
    "Someone left an umbrella on the bus.",
    "The garden hose was coiled next to the shed.",
    "The museum added a new room for old maps.",
    "A farmer loaded crates of apples onto a truck.",
    "The teacher wrote the date on the board.",
    "The soup needed a little more salt.",
    "A cat watched the birds from the fence.",
    "The bridge was painted during the summer.",
    "Most shops in the street open at nine.",
    "The printer on the second floor is out of paper.",
    "A light rain started just after lunch.",
    "The bus driver waved at the crossing guard.",
    "The neighbors planted tomatoes this year.",
    "The coffee machine makes a loud noise.",
    "A long line formed outside the cinema.",
    "The hikers rested on a flat rock by the trail.",
    "The phone battery lasted the whole day.",
    "The office plants get water on Mondays.",
    "A boat drifted slowly across the lake.",
    "The football match ended in a draw.",
    "The baker woke up before sunrise.",
    "The street lamps turned on at dusk.",
    "The new chairs arrived in large boxes.",
    "A quiet song played on the radio.",
    "The road to the village was freshly paved.",
    "The students finished their project on time.",
    "The market sells fruit, cheese and honey.",
    "The wind knocked a few leaves off the tree.",
    "A pair of ducks swam near the shore.",
    "The kettle whistled in the small kitchen.",
    "The painter cleaned the brushes after work.",
    "The elevator stopped at every floor.",
    "The snow melted by the end of the week.",
    "A delivery van parked outside the school.",
    "The museum guide spoke slowly and clearly.",
    "The chess club meets every Thursday evening.",
    "The waiter brought a glass of water.",
    "The path through the park is lined with benches.",
    "The town hall was built a long time ago.",
)
_COLORS = ("red", "blue", "green", "yellow", "purple", "orange", "pink", "violet", "gray", "teal",
           "silver", "gold")
_CODE_WORDS = ("falcon", "marble", "lantern", "cactus", "violin", "pepper", "anchor", "glacier", "tulip",
               "rocket", "walnut", "compass", "saddle", "pencil", "comet", "ladder", "orchid", "jigsaw",
               "nickel", "raven", "summit", "trumpet", "pebble", "zebra")
_NAMES = ("Alice", "Bruno", "Chloe", "Daniel", "Elena", "Farid", "Grace", "Hiro", "Irene", "Jonas",
          "Keira", "Luis", "Maya", "Nora", "Omar", "Priya")
_CITIES = ("Paris", "Tokyo", "Cairo", "Lima", "Oslo", "Dublin", "Madrid", "Nairobi", "Seoul", "Toronto",
           "Vienna", "Lisbon", "Sydney", "Prague", "Denver", "Manila")


def retrieval_item(index: int, seed: int = 0,
                   n_sentences: int = RETRIEVAL_FILLER_SENTENCES) -> tuple[str, str, dict[str, object]]:
    """Item ``index`` of the retrieval workload: ``(task, answer, details)``, deterministic in (seed, index).

    Depth cycles through :data:`RETRIEVAL_DEPTHS` with the index; the fact kind alternates between
    a code word and a home city.  The needle goes before filler sentence ``round(depth * n)``.
    """
    rng = random.Random(f"kvcomm-retrieval:{seed}:{index}")
    depth = RETRIEVAL_DEPTHS[index % len(RETRIEVAL_DEPTHS)]
    if index % 2 == 0:
        key, answer = rng.choice(_COLORS), rng.choice(_CODE_WORDS)
        kind, needle, question = "code_word", f"The code word for {key} is {answer}.", f"What is the code word for {key}?"
    else:
        key, answer = rng.choice(_NAMES), rng.choice(_CITIES)
        kind, needle, question = "residence", f"{key} lives in {answer}.", f"In which city does {key} live?"
    sentences = rng.sample(_FILLER, min(n_sentences, len(_FILLER)))
    position = round(depth * len(sentences))
    sentences.insert(position, needle)
    task = f"Text: {' '.join(sentences)}\n\nQuestion: {question}"
    return task, answer, {"depth": depth, "kind": kind, "key": key, "needle": needle, "position": position,
                          "sentences": len(sentences), "source_index": index}
