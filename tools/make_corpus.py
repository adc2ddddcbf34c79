#!/usr/bin/env python3
"""Writes examples/data/corpus.txt: the byte-level training text of examples/gpt_train.

The text is synthetic and deterministic (a fixed seed; Python's random module, whose choice() and random()
streams are stable across Python 3 versions), so it carries no copyright and rebuilds byte for byte. It is
structured at several scales for a small model to learn: spelling and punctuation, recurring names,
sentence templates whose parts agree (a town's river, its neighbours, counting words), and section headers
that number themselves.

usage: tools/make_corpus.py [output] [--bytes N]
"""
import argparse
import pathlib
import random

TOWNS = ["Ashford", "Bramwell", "Carrow", "Dunmere", "Elsworth", "Fallowby", "Greystone", "Harrowgate",
         "Ivybridge", "Kettering", "Larkhill", "Marlow", "Netherby", "Oakham", "Pennick", "Quarry End",
         "Rosedale", "Stanwick", "Thornbury", "Upwell", "Westcombe", "Yarrow"]
RIVERS = ["Wend", "Tamsin", "Alder", "Coll", "Brook", "Lune", "Merrow", "Sable"]
TRADES = ["barley", "wool", "cheese", "timber", "salt", "cider", "slate", "linen", "honey", "leather"]
BUILDINGS = ["a mill", "a chapel", "an inn", "a bridge of seven arches", "a market cross", "a tannery",
             "a smithy", "a school", "a granary", "a ferry house"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December"]
WINDS = ["north", "south", "east", "west", "north-east", "south-west"]
WEATHER = ["the rain fell in the evening", "the sky stayed clear", "a fog lay on the fields until noon",
           "there was frost at dawn", "a storm came over the hills", "the sun was warm by midday"]
NAMES = ["Ada", "Bran", "Cora", "Dell", "Edwin", "Flora", "Gideon", "Hester", "Isaac", "June", "Kit", "Lydia",
         "Martin", "Nell", "Oswin", "Prue"]
GOODS = ["apples", "candles", "nails", "loaves", "eggs", "ropes", "jars", "boots"]
NUMBERS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
           "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen",
           "twenty"]
ORDINALS = ["first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth", "tenth",
            "eleventh", "twelfth", "thirteenth", "fourteenth", "fifteenth", "sixteenth", "seventeenth",
            "eighteenth", "nineteenth", "twentieth", "twenty-first", "twenty-second", "twenty-third",
            "twenty-fourth", "twenty-fifth", "twenty-sixth", "twenty-seventh", "twenty-eighth"]


class Gazetteer:
    """Fixed facts per town, so that sentences about a town agree wherever they appear."""

    def __init__(self, rng):
        self.river = {t: rng.choice(RIVERS) for t in TOWNS}
        self.trade = {t: rng.choice(TRADES) for t in TOWNS}
        self.building = {t: rng.choice(BUILDINGS) for t in TOWNS}
        self.market = {t: rng.choice(DAYS) for t in TOWNS}
        self.neighbour = {t: rng.choice([u for u in TOWNS if u != t]) for t in TOWNS}
        self.miles = {t: rng.randint(2, 20) for t in TOWNS}
        self.direction = {t: rng.choice(WINDS) for t in TOWNS}


def town_entry(rng, g):
    t = rng.choice(TOWNS)
    n = g.neighbour[t]
    lines = [
        f"The town of {t} lies on the river {g.river[t]}, {NUMBERS[g.miles[t]]} miles {g.direction[t]} of {n}.",
        f"It keeps a market on {g.market[t]} and is known for its {g.trade[t]}.",
        f"Travellers remember {t} for {g.building[t]}.",
    ]
    if rng.random() < 0.5:
        lines.append(f"From {t} the road runs on to {g.neighbour[n]} by way of {n}.")
    return " ".join(lines)


def weather_entry(rng):
    month = rng.randrange(12)
    day = rng.randrange(28)
    return (f"On the {ORDINALS[day]} day of {MONTHS[month]} the wind was from the {rng.choice(WINDS)} "
            f"and {rng.choice(WEATHER)}.")


def sum_entry(rng):
    a, b = rng.randint(0, 10), rng.randint(0, 10)
    if rng.random() < 0.5:
        return f"{NUMBERS[a].capitalize()} and {NUMBERS[b]} make {NUMBERS[a + b]}."
    hi, lo = max(a, b), min(a, b)
    return f"{NUMBERS[hi].capitalize()} less {NUMBERS[lo]} leaves {NUMBERS[hi - lo]}."


def trade_dialogue(rng, g):
    seller, buyer = rng.sample(NAMES, 2)
    t = rng.choice(TOWNS)
    good = rng.choice(GOODS)
    count, price = rng.randint(2, 9), rng.randint(1, 2)
    total = count * price
    return "\n".join([
        f"At the {g.market[t]} market in {t}, {buyer} asked {seller} for {NUMBERS[count]} {good}.",
        f"\"{NUMBERS[count].capitalize()} {good} at {NUMBERS[price]} pence each,\" said {seller}, "
        f"\"comes to {NUMBERS[total]} pence.\"",
        f"\"Then here are {NUMBERS[total]} pence,\" said {buyer}.",
    ])


def chapter(rng, g, number):
    parts = [f"CHAPTER {number}", ""]
    for _ in range(rng.randint(4, 8)):
        kind = rng.random()
        if kind < 0.35:
            parts.append(town_entry(rng, g))
        elif kind < 0.6:
            parts.append(" ".join(weather_entry(rng) for _ in range(rng.randint(1, 3))))
        elif kind < 0.8:
            parts.append(trade_dialogue(rng, g))
        else:
            parts.append(" ".join(sum_entry(rng) for _ in range(rng.randint(2, 4))))
        parts.append("")
    return "\n".join(parts) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    root = pathlib.Path(__file__).resolve().parent.parent
    parser.add_argument("output", nargs="?", default=root / "examples" / "data" / "corpus.txt", type=pathlib.Path)
    parser.add_argument("--bytes", type=int, default=256 * 1024, help="stop after the chapter that reaches this")
    parser.add_argument("--seed", type=int, default=2401_11202)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    g = Gazetteer(rng)
    text, number = "", 1
    while len(text) < args.bytes:
        text += chapter(rng, g, number)
        number += 1
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text, encoding="ascii")
    print(f"wrote {args.output}: {len(text)} bytes, {number - 1} chapters")


if __name__ == "__main__":
    main()
